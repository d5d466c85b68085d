"""Build ``tests/fixtures/iq4``: a tiny random llama-architecture GGUF quantized by llama.cpp itself to IQ4_NL and
to IQ4_XS, with llama.cpp's own logits error on the same files.

Run in the reference environment (numpy, gguf 0.19.0), with an interpreter that has ``llama_cpp`` for the
quantizer and the logits::

    /opt/refenv/bin/python scripts/make_iq4_fixture.py --out tests/fixtures/iq4 --llamacpp /tmp/lcpenv/bin/python

Recipe: hidden 256 (IQ4_XS super-blocks need rows of 256), 2 layers, 4 query heads of 64, 2 kv heads, ffn 256,
vocabulary 512 (the llama fixture's tokenizer), weights ``np.random.default_rng(SEED)``: matrices N(0, 0.05),
norm gains 1 + N(0, 0.1); written F32 as the llama fixture is (a temporary file), then
``llama_model_quantize`` to ``model-iq4_nl.gguf`` and ``model-iq4_xs.gguf`` (llama.cpp picks its own types for
some tensors: ``output.weight`` and the embeddings may get another type; ``meta.json`` lists them).
References: ``tokens.json`` (a 33-token sequence), ``logits_f32.npy`` (llama.cpp, f32 KV cache, on the F32 file:
it agrees with transformers to ~1e-6 on the other llama fixtures), and per quantized file llama.cpp's relative
logit error ``||logits_q - logits_f32|| / ||logits_f32||`` over every position (``meta.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import make_fixtures as mf  # the script's own folder is on sys.path when it runs
import numpy as np

from minfer.testing.synthetic_model import LLAMACPP_QUANTIZE

SEED = 4401
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 256, 512
TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama" / "hf" / "tokenizer.json"
SCRIPTS = Path(__file__).resolve().parent


def write_f32(path: Path) -> None:
    import gguf

    from minfer.testing import gguf_writing as gw

    rng = np.random.default_rng(SEED)
    hd = HIDDEN // HEADS
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    for il in range(LAYERS):
        p = f"blk.{il}."
        shapes.update({p + "attn_norm.weight": (HIDDEN,), p + "attn_q.weight": (HIDDEN, HIDDEN),
                       p + "attn_k.weight": (KV_HEADS * hd, HIDDEN), p + "attn_v.weight": (KV_HEADS * hd, HIDDEN),
                       p + "attn_output.weight": (HIDDEN, HIDDEN), p + "ffn_norm.weight": (HIDDEN,),
                       p + "ffn_gate.weight": (FFN, HIDDEN), p + "ffn_up.weight": (FFN, HIDDEN),
                       p + "ffn_down.weight": (HIDDEN, FFN)})

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_name("tiny-iq4")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_block_count(LAYERS)
        w.add_context_length(256)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(FFN)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(VOCAB)
        w.add_rope_dimension_count(hd)
        gw.add_hf_tokenizer(w, TOKENIZER, bos=0, eos=1, add_bos=True)

    def make(t: gw.PlannedTensor) -> np.ndarray:
        if len(t.shape) == 1:
            return (1.0 + 0.1 * rng.standard_normal(t.shape)).astype(np.float32)
        return (0.05 * rng.standard_normal(t.shape)).astype(np.float32)

    f32 = gguf.GGMLQuantizationType.F32
    gw.write_streamed(path, "llama", metadata, [gw.PlannedTensor(n, s, f32) for n, s in shapes.items()], make)


def llamacpp_logits(python: str, model: Path, seq: list[int], tmp: Path) -> np.ndarray:
    dst = tmp / "logits.npy"
    subprocess.run([python, str(SCRIPTS / "llamacpp_logits.py"), str(model), json.dumps(seq), "64", str(dst)],
                   check=True, capture_output=True)
    return np.load(dst)


def main() -> int:
    import gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llamacpp", required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seq = [0] + np.random.default_rng(SEED + 1).integers(3, VOCAB, 32).tolist()
    meta: dict = {"seed": SEED, "shape": {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                                          "ffn": FFN, "vocab": VOCAB}, "files": {}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        f32 = tmp / "model-f32.gguf"
        write_f32(f32)
        ref = llamacpp_logits(args.llamacpp, f32, seq, tmp)
        np.save(args.out / "logits_f32.npy", ref)
        for ftype in ("IQ4_NL", "IQ4_XS"):
            path = args.out / f"model-{ftype.lower()}.gguf"
            subprocess.run([args.llamacpp, str(LLAMACPP_QUANTIZE), str(f32), str(path), ftype],
                           check=True, capture_output=True)
            q = llamacpp_logits(args.llamacpp, path, seq, tmp)
            rel = float(np.linalg.norm(q - ref) / np.linalg.norm(ref))
            types: dict[str, int] = {}
            for t in gguf.GGUFReader(path).tensors:
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            meta["files"][path.name] = {"llamacpp_relative_logit_error": rel, "tensor_types": types}
            print(f"{path.name}: llama.cpp relative logit error {rel:.4g}, types {types}")
    mf._dump_json(args.out / "tokens.json", {"sequence": seq})
    mf._dump_json(args.out / "meta.json", meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
