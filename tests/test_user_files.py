"""Files the user owns are never lost: the trace page, the dump folder, sessions (a full disk, a kill,
a file that is not ours). Disk full is simulated by making the OS-level write raise ENOSPC (a tmpfs
cannot be mounted in this sandbox)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fixture_dir
from test_session_file import _data

from minfer.cli import main
from minfer.errors import BadRequestError
from minfer.formats import atomic
from minfer.runtime.session_file import MAGIC, save_session
from minfer.trace.dump import Dumper

MODEL = str(fixture_dir("qwen2") / "model-f32.gguf")


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_trace_html_on_a_full_disk_keeps_the_old_page(tmp_path, monkeypatch, capsys):
    page = tmp_path / "out.html"
    page.write_text("my old page")
    monkeypatch.setattr(atomic.os, "write", _enospc)
    assert main(["trace", MODEL, "Hello", "--html", str(page)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"minfer: error: cannot write the trace page {page}: No space left on device"
    assert page.read_text() == "my old page"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.html"]
    monkeypatch.undo()
    assert main(["trace", MODEL, "Hello", "--html", str(page)]) == 0
    assert page.read_text().startswith("<!DOCTYPE html") or "<html" in page.read_text()[:500]


def test_a_dump_never_overwrites_another_dump_and_says_what_it_writes(tmp_path, capsys):
    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"entries": []}  my reference run')
    with pytest.raises(BadRequestError, match="already holds a dump"):
        Dumper(folder)
    assert (folder / "manifest.json").read_text() == '{"entries": []}  my reference run'
    Dumper(tmp_path / "fresh")
    assert "dumping every node's output of every forward pass to" in capsys.readouterr().err
    Dumper(tmp_path / "chosen", "blk.0.*")
    assert "matching 'blk.0.*'" in capsys.readouterr().err


def test_save_does_not_replace_a_file_that_only_starts_like_a_session(tmp_path):
    path = tmp_path / "notes.bin"
    path.write_bytes(MAGIC + b"... my notes, not a session")
    with pytest.raises(BadRequestError, match="not a minfer session file"):
        save_session(path, _data())
    assert path.read_bytes() == MAGIC + b"... my notes, not a session"


def test_sigkill_during_save_leaves_nothing_after_the_next_save(tmp_path):
    path = tmp_path / "chat.session"
    save_session(path, _data(tokens=[1]))
    before = path.read_bytes()
    code = ("import time; "
            "from test_session_file import _data; from minfer.runtime import session_file as sf; real = sf._write\n"
            "def slow(f, *a):\n    f.write(b'partial'); f.flush(); print('writing', flush=True); time.sleep(60)\n"
            f"sf._write = slow; sf.save_session({str(path)!r}, _data(tokens=[2]))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parent)  # where ``python -c`` finds test_session_file
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert path.read_bytes() == before  # the old session, whole
    assert len(list(tmp_path.glob(".chat.session.*.tmp"))) == 1  # the killed save's temporary file
    save_session(path, _data(tokens=[3]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.session"]
