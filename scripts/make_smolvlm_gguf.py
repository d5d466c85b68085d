"""Convert the SmolVLM (Idefics3) fixture (``tests/fixtures/smolvlm/hf``) to GGUF with llama.cpp's OWN converter: the
text model (``gguf/model-f32.gguf``) and the vision tower + connector (``gguf/mmproj-f32.gguf``), the two files
users download for SmolVLM with images::

    /tmp/refenv/bin/python scripts/make_smolvlm_gguf.py \\
        [--llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp] [--out tests/fixtures/smolvlm/gguf]

Both files come from ``convert_hf_to_gguf.py`` (llama-cpp-python 0.3.36's vendored llama.cpp) run through
``scripts/llama_cpp_convert.py`` (``config.json`` read as it is; the tiny BPE vocabulary's pre-tokenizer, whose hash
the converter does not know, named ``--pre default``), as ``--outtype f32`` and ``--outtype f32 --mmproj``. Nothing
is edited after the converter wrote it.

One workaround of our own: transformers 5.24's ``save_pretrained`` writes no ``text_config.architectures``; the
Hub's SmolVLM folders have ``"VLlama3ForCausalLM"`` there, which is what the converter's text side keys on (its
``LlamaModel``; the top-level ``Idefics3ForConditionalGeneration`` is registered for ``--mmproj`` only, and the text
conversion stops at "Model Idefics3ForConditionalGeneration is not supported"). So the converter is run on a
temporary copy of the folder whose ``config.json`` has ``text_config.architectures`` = ``["VLlama3ForCausalLM"]``;
the tensors are the fixture's file, and their names (``model.text_model.*``, ``model.vision_model.*``,
``model.connector.*``) are already the Hub's.

What the converter writes that matters to a reader (printed at the end):

- ``clip.projector_type`` "idefics3", ``clip.vision.projector.scale_factor`` (always; the config's ``scale_factor``),
  ``clip.vision.preproc_image_size`` (the processor's ``size.longest_edge``), ``clip.vision.image_size`` (the tile),
  ``clip.vision.image_mean`` / ``image_std``, ``clip.use_gelu`` true;
- ``mm.model.fc.weight``: the connector's ``modality_projection.proj.weight`` as it is, ``[text n_embd, n_embd *
  scale_factor^2]`` (numpy order), F32 (nothing is forced to F16 for idefics3);
- ``v.patch_embd.weight``: the conv weight ``[n_embd, 3, p, p]`` (numpy order), F32; the ``v.*`` tower tensors have
  Gemma 3's names.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "smolvlm"
LLAMA_CPP = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
MODEL_NAME = "smolvlm-tiny"
TEXT_ARCHITECTURE = "VLlama3ForCausalLM"  # the Hub's SmolVLM config.json: text_config.architectures


def hub_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` with the Hub's ``text_config.architectures``."""
    out = json.loads(json.dumps(cfg))
    out.setdefault("text_config", {}).setdefault("architectures", [TEXT_ARCHITECTURE])
    return out


def hub_folder(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with :func:`hub_config`'s ``config.json`` (the safetensors linked, not copied, where it
    can)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and p.name != "config.json":
            try:
                (dst / p.name).symlink_to(p.resolve())
            except OSError:
                shutil.copy2(p, dst / p.name)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    (dst / "config.json").write_text(json.dumps(hub_config(cfg), indent=1) + "\n", encoding="utf-8")
    return dst


def convert(llama_cpp: Path, folder: Path, outfile: Path, *extra: str, model_name: str = MODEL_NAME) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "llama_cpp_convert.py"), "--llama-cpp", str(llama_cpp),
           "--pre", "default", str(folder), "--outfile", str(outfile), "--outtype", "f32",
           "--model-name", model_name, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"convert_hf_to_gguf.py failed ({done.returncode}): {' '.join(extra) or 'text model'}")


def describe(path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_vision_gguf", ROOT / "scripts" / "make_vision_gguf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.describe(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="the sdist's vendor/llama.cpp folder")
    ap.add_argument("--out", type=Path, default=FIXTURE / "gguf")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    text, mmproj = args.out / "model-f32.gguf", args.out / "mmproj-f32.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        folder = hub_folder(FIXTURE / "hf", Path(tmp) / "hf")
        convert(args.llama_cpp, folder, text)
        convert(args.llama_cpp, folder, mmproj, "--mmproj")
    for path in (text, mmproj):
        size = path.stat().st_size
        if size > 1_000_000:
            raise SystemExit(f"{path}: {size} bytes, expected well under 1 MB")
    describe(mmproj)
    print(f"{text} ({text.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
