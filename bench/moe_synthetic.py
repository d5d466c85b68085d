"""A synthetic mixture of experts with Qwen3-30B-A3B's per-layer shapes, for ``minfer bench`` against llama.cpp.

    python bench/moe_synthetic.py OUT.gguf [--layers 2] [--type Q8_0]
    minfer bench OUT.gguf -p 64 -n 32 -r 2 -t 2 --compare --peer-python llama.cpp=/tmp/lcpenv/bin/python

Per layer as Qwen3-30B-A3B (``qwen3moe``): hidden 2048, 32 query heads and 4 kv heads of 128 with per-head q/k
RMSNorm, 128 experts of width 768, 8 per token (weights renormalized); fewer layers (default 2 of 48) so that
it fits in memory, and the llama fixture's 512-token vocabulary (the output matrix is not what is measured).
Matrices are random valid Q8_0 blocks (random int8 values, f16 scale 2^-10); the router and the norms are F32
(the router N(0, 1), so tokens spread over the experts). A decode step reads 8 of the 128 experts per layer:
the bench reports the bytes one token reads (``weights read per token``, and the MoE kernels' own count).

Seen on 2026-12-02 (2 layers, Q8_0, 1266 MiB; the 2 vCPUs shared with other jobs at a load average of 10-13,
so these are contended figures): weights read per token 117.9 MiB, of which the experts 76.5 MiB by the
kernels' count (8 of 128 experts x 3 matrices x 2 layers); 1 thread: minfer pp64 63.9 t/s, tg16 12.7 t/s;
llama.cpp (llama-cpp-python 0.3.36) pp64 27.8 t/s, tg16 9.1 t/s. At 2 threads both collapsed under the
contention (minfer tg16 0.8 t/s, llama.cpp 2.4 t/s): numba's parallel launches suffer most when the cores are
taken.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from minfer.testing import gguf_writing as gw

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_FF, DENSE_FF = 128, 8, 768, 6144
TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama" / "hf" / "tokenizer.json"


def q8_0(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random Q8_0 blocks for a tensor of ``shape`` (numpy order), as raw bytes ``[rows, row bytes]``."""
    rows, n_in = int(np.prod(shape[:-1])), shape[-1]
    raw = rng.integers(0, 256, (rows, n_in // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(2.0 ** -10).tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], n_in // 32 * 34)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    n_vocab = len(gw.hf_tokenizer_fields(TOKENIZER)["tokens"])

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_name("synthetic-qwen3-30b-a3b-shapes")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        w.add_block_count(args.layers)
        w.add_context_length(4096)
        w.add_embedding_length(HIDDEN)
        w.add_feed_forward_length(DENSE_FF)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_rope_freq_base(1e6)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(USED)
        w.add_expert_feed_forward_length(EXPERT_FF)
        gw.add_hf_tokenizer(w, TOKENIZER, bos=0, eos=1)

    q8, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    tensors = [gw.PlannedTensor("token_embd.weight", (n_vocab, HIDDEN), q8),
               gw.PlannedTensor("output_norm.weight", (HIDDEN,), f32),
               gw.PlannedTensor("output.weight", (n_vocab, HIDDEN), q8)]
    for il in range(args.layers):
        p = f"blk.{il}."
        tensors += [
            gw.PlannedTensor(p + "attn_norm.weight", (HIDDEN,), f32),
            gw.PlannedTensor(p + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), q8),
            gw.PlannedTensor(p + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), q8),
            gw.PlannedTensor(p + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), q8),
            gw.PlannedTensor(p + "attn_q_norm.weight", (HEAD_DIM,), f32),
            gw.PlannedTensor(p + "attn_k_norm.weight", (HEAD_DIM,), f32),
            gw.PlannedTensor(p + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), q8),
            gw.PlannedTensor(p + "ffn_norm.weight", (HIDDEN,), f32),
            gw.PlannedTensor(p + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), f32),
            gw.PlannedTensor(p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN), q8),
            gw.PlannedTensor(p + "ffn_up_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN), q8),
            gw.PlannedTensor(p + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FF), q8),
        ]

    def make(t: gw.PlannedTensor) -> np.ndarray:
        if t.ggml_type == q8:
            return q8_0(rng, t.shape)
        if t.name.endswith("ffn_gate_inp.weight"):
            return rng.standard_normal(t.shape).astype(np.float32) * 0.05
        return (1.0 + 0.1 * rng.standard_normal(t.shape[0])).astype(np.float32)

    gw.write_streamed(args.out, "qwen3moe", metadata, tensors, make)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB, {args.layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
