"""Convert the Gemma 3 vision fixture (``tests/fixtures/gemma3_vision/hf``) to GGUF with llama.cpp's OWN converter:
the text model (``gguf/model-f32.gguf``) and the vision tower + projector (``gguf/mmproj-f32.gguf``), the two files
users download for Gemma 3 with images::

    /tmp/refenv/bin/python scripts/make_vision_gguf.py \\
        [--llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp] [--out tests/fixtures/gemma3_vision/gguf]

Both files come from ``convert_hf_to_gguf.py`` (llama-cpp-python 0.3.36's vendored llama.cpp) run through
``scripts/llama_cpp_convert.py`` (its transformers 5.24 workarounds: ``config.json`` read as it is; the tiny
vocabulary's pre-tokenizer, whose hash the converter does not know, named ``--pre default``), as
``--outtype f32`` and ``--outtype f32 --mmproj``. Nothing is edited after the converter wrote it.

One workaround of our own: transformers 5.24's ``save_pretrained`` names the vision tower ``vision_tower.embeddings.*``
/ ``vision_tower.encoder.*`` / ``vision_tower.post_layernorm.*``, without the ``vision_model.`` level that the Hub's
gemma-3 folders (and the converter's ``TensorNameMap``) have; the converter stops at "Can not map tensor
'vision_tower.embeddings.patch_embedding.bias'". So the converter is run on a temporary copy of the folder whose
``model.safetensors`` names the tensors as the Hub's folders do (``vision_tower.vision_model.*``; the text model's
``language_model.model.*`` and the projector's ``multi_modal_projector.*`` are already the Hub's names). The values
are the fixture's, bit for bit. The copy also gets a ``tokenizer.model``: the Hub's gemma-3 folders have one (the
converter then writes a SentencePiece vocabulary, ``tokenizer.ggml.model`` "llama"), the fixture has only
``tokenizer.json``, from which the converter writes a "gpt2" vocabulary whose merges name tokens it does not
byte-encode (minfer refuses it: "merges[0] = '\\n \\n' needs the token '\\n'"). The ``tokenizer.model`` is a
SentencePiece model written here by hand (protobuf fields; no ``protobuf`` package in the reference environment)
with ``tokenizer.json``'s pieces (:func:`sentencepiece_model`). The tests take token ids from the fixture and look
tokens up by text only.

What the converter writes that matters to a reader (printed at the end):

- ``mm.input_projection.weight`` is F16 even with ``--outtype f32`` (``Gemma3VisionModel.tensor_force_quant``, for
  llama.cpp issue 13025), stored as HF's parameter ``[vision n_embd, text n_embd]`` (numpy order);
- ``mm.soft_emb_norm.weight`` holds 1 + w (``Gemma3VisionModel.modify_tensors``);
- ``v.patch_embd.weight`` is the conv weight ``[n_embd, 3, p, p]`` (numpy order), F32;
- ``clip.vision.projector.scale_factor`` (the pooling kernel) is written only when it is not 4 (here 2: the
  processor's ``image_seq_length`` 16 from ``processor_config.json``);
- the text model's GGUF has no sliding-window pattern key: llama.cpp (and minfer's GGUF reader) then take Gemma 3's
  rule (every 6th layer global), so this fixture's 3 layers are all sliding-window layers in the GGUF, while the HF
  config says sliding / full / sliding.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "gemma3_vision"
LLAMA_CPP = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
MODEL_NAME = "gemma3-vision-tiny"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "preprocessor_config.json", "processor_config.json")


def hub_name(name: str) -> str:
    """The Hub's gemma-3 name of a tensor that transformers 5.24 saved."""
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower."):]
    return name


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, value: bytes | str | int | float) -> bytes:
    """One protobuf field: a string / message (bytes), a varint (int, bool) or a float32."""
    if isinstance(value, str):
        value = value.encode("utf-8")
    if isinstance(value, bytes):
        return _varint(num << 3 | 2) + _varint(len(value)) + value
    if isinstance(value, float):
        return _varint(num << 3 | 5) + struct.pack("<f", value)
    return _varint(num << 3) + _varint(int(value))


def sentencepiece_model(tokenizer_json: Path) -> bytes:
    """A SentencePiece ``ModelProto`` (BPE, byte fallback, no dummy prefix: Gemma 3's settings) holding the
    vocabulary of the fixture's ``tokenizer.json``: control tokens (the special added tokens), ``<unk>``, the
    non-special added tokens as user-defined pieces, ``<0xXX>`` byte pieces and the rest normal with score
    minus its id (the order of the merges), as ``make_gemma3_fixture.py`` scores its GGUF vocabulary."""
    tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    pieces = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj["added_tokens"]}
    pieces.update({i: a["content"] for i, a in added.items()})
    unk = tj["model"]["unk_token"]
    out = bytearray()
    for i in range(len(pieces)):
        text = pieces[i]
        if text == unk:
            kind, score = 2, 0.0
        elif i in added:
            kind, score = (3 if added[i]["special"] else 4), 0.0
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", text):
            kind, score = 6, 0.0
        else:
            kind, score = 1, -float(i)
        out += _field(1, _field(1, text) + _field(2, score) + _field(3, kind))
    ids = {t: i for i, t in pieces.items()}
    trainer = (_field(3, 2) + _field(35, True) + _field(40, ids[unk]) + _field(41, ids["<bos>"])
               + _field(42, ids["<eos>"]) + _field(43, ids["<pad>"]))
    normalizer = _field(1, "identity") + _field(3, False) + _field(4, False) + _field(5, True)
    return bytes(out + _field(2, trainer) + _field(3, normalizer))


def hub_folder(src: Path, dst: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    (dst / "tokenizer.model").write_bytes(sentencepiece_model(src / "tokenizer.json"))
    tensors = load_file(src / "model.safetensors")
    save_file({hub_name(k): v for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def convert(llama_cpp: Path, folder: Path, outfile: Path, *extra: str) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "llama_cpp_convert.py"), "--llama-cpp", str(llama_cpp),
           "--pre", "default", str(folder), "--outfile", str(outfile), "--outtype", "f32",
           "--model-name", MODEL_NAME, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise SystemExit(f"convert_hf_to_gguf.py failed ({done.returncode}): {' '.join(extra) or 'text model'}")


def describe(path: Path) -> None:
    import gguf

    r = gguf.GGUFReader(path)
    print(f"{path} ({path.stat().st_size} bytes)")
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 8:
            value = f"[{len(value)} items]"
        elif isinstance(value, str) and len(value) > 80:
            value = value[:80] + "..."
        print(f"  {key} = {value!r}")
    for t in r.tensors:
        print(f"  {t.name:34s} {str(tuple(int(d) for d in reversed(t.shape))):18s} {t.tensor_type.name}")


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
