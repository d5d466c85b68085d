"""What a new user meets following the README: Ctrl-C in the chat (driven through a pseudo-terminal),
``-n`` beyond the context, ``chat --load`` of a session made with another cache type."""

from __future__ import annotations

import os
import platform
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import fixture_dir

GEMMA = str(fixture_dir("gemma3") / "model-f32.gguf")
READ_SYSCALL = {"x86_64": 0, "aarch64": 63}[platform.machine()]  # read(2)'s number, as /proc/PID/syscall shows it


def minfer(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "minfer", *args], input=stdin, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_n_beyond_the_context_stops_with_length_a_summary_and_a_hint():
    r = minfer("run", str(fixture_dir("qwen2") / "model-f32.gguf"), "Hello", "-n", "500", "-c", "32", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "finish: length" in r.stderr
    assert "-n 500 is more than the context leaves" in r.stderr and "--ctx-size" in r.stderr
    assert "--context-shift" in r.stderr


def test_chat_load_with_another_cache_type_names_the_flag(tmp_path):
    session = tmp_path / "chat.session"
    r = minfer("chat", GEMMA, "-n", "3", stdin=f"hi\n/save {session}\n")
    assert r.returncode == 0 and session.exists(), r.stderr
    r = minfer("chat", GEMMA, "--load", str(session), "--cache-type", "f16")
    assert r.returncode == 1
    assert "--cache-type f32" in r.stderr and "Traceback" not in r.stderr


class Terminal:
    """``minfer chat`` on a pseudo-terminal (stdin is a tty: the interactive REPL), started with SIGINT ignored as
    a shell's background job or a supervisor starts it: the chat must install its own Ctrl-C handling, so the test
    does not depend on how its runner was started (test_pull's SIGINT test covers the default disposition)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.master = master
        self.proc = subprocess.Popen([sys.executable, "-m", "minfer", "chat", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env={**os.environ, **env}, close_fds=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        os.close(slave)
        self.out = ""

    def read_until(self, text: str, timeout: float = 180, start: int = 0) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.out[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} in:\n{self.out[-2000:]}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.out += os.read(self.master, 4096).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    break
        return self.out

    def read_more(self, length: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while len(self.out) < length:
            assert time.monotonic() < deadline, self.out[-2000:]
            ready, _, _ = select.select([self.master], [], [], 1)
            if ready:
                self.out += os.read(self.master, 4096).decode("utf-8", "replace")

    def write(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait_reading(self, timeout: float = 60) -> None:
        """Until the chat is blocked reading its terminal. A SIGINT that comes after the prompt is drawn but
        before that read begins is only noted by Python's C-level handler, and the read then waits for input
        without seeing it: a window of microseconds that a loaded machine stretches (it failed this test in a
        full run beside other work). A person cannot hit it; a test that signals at once can."""
        syscall = Path(f"/proc/{self.proc.pid}/syscall")
        deadline = time.monotonic() + timeout
        while syscall.read_text().split()[0] != str(READ_SYSCALL):
            assert time.monotonic() < deadline, f"the chat is not reading its terminal: {syscall.read_text()}"
            time.sleep(0.01)


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_then_ends_the_chat_and_saves_it(smollm2_path, tmp_path):
    term = Terminal([str(smollm2_path), "-n", "400", "--temp", "0"], {"MINFER_CACHE_DIR": str(tmp_path)})
    try:
        term.read_until("> ")
        term.write("Tell me a very long story about a dragon and a knight.\n")
        start = len(term.read_until("Tell me a very long story about a dragon and a knight.\r\n"))
        term.read_more(start + 40)  # some of the answer is out
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C while the answer is being written
        term.read_until("(answer stopped")
        term.read_until("> ", start=term.out.rindex("(answer stopped"))  # the prompt drawn after the stop
        assert term.proc.poll() is None  # the chat goes on
        term.write("Say hi.\n")
        term.read_until("Say hi.\r\n")
        term.read_until("\n> ", start=len(term.out))  # its answer, then the prompt again
        term.wait_reading()
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C at the prompt: the chat ends
        term.read_until("resume it with: minfer chat --load")
        assert term.proc.wait(60) == 0
        saved = list((tmp_path / "sessions").glob("chat-*.session"))
        assert len(saved) == 1 and str(saved[0]) in term.out
        assert "Traceback" not in term.out
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.master)
