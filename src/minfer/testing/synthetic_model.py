"""A GGUF with random weights and a real model's shapes, for speed measurements (the text it writes is noise).

    python bench/synthetic_model.py --shape smollm2-1.7b --type q4_k_m -o /tmp/synth/smollm2-1.7b-q4_k_m.gguf
    minfer bench /tmp/synth/smollm2-1.7b-q4_k_m.gguf -p 512 -n 32 -r 2 -t 2 --compare \
        --peer-python llama.cpp=/tmp/lcpenv/bin/python

Shapes (``--shape``; ``--layers`` overrides the depth, for tests):

* ``smollm2-360m``: llama, 960 wide, 32 layers, 15 query / 5 kv heads of 64, FFN 2560;
* ``smollm2-1.7b``: llama, 2048 wide, 24 layers, 32 / 32 heads of 64, FFN 8192;
* ``qwen2.5-1.5b``: qwen2 (q/k/v biases), 1536 wide, 28 layers, 12 / 2 heads of 128, FFN 8960;
* ``qwen3-4b``: qwen3 (per-head q/k RMSNorm), 2560 wide, 36 layers, 32 / 8 heads of 128, FFN 9728;
* ``tiny``, ``tiny-qwen2``, ``tiny-qwen3``: 256 wide, 2 layers, 4 / 2 heads, FFN 512 (tests).

All have tied embeddings, as the real ones do (no ``output.weight``). The tokenizer (vocabulary, merges, special
ids, chat template: every ``tokenizer.*`` key) is copied from ``--tokenizer-from`` (default: the cached
SmolLM2-135M GGUF), so the vocabulary, and with it the embedding matrix, is that file's (49152 for SmolLM2,
not Qwen's 151936).

Types (``--type``): ``f16``, ``q8_0``, ``q4_0``, ``q4_k_m`` and ``iq4_xs`` (llama.cpp's quantizer only). Values:
matrices N(0, 0.02), norm gains 1, biases N(0, 0.02), from ``np.random.default_rng([seed, tensor index])``.
Quantizer (``--quantizer``):

* ``llama.cpp`` (the default when an interpreter with ``llama_cpp`` is at hand: this one, or
  ``--llamacpp-python``): an F16 file is written next to the output, then ``llama_model_quantize`` makes the
  output from it (``minfer/testing/llamacpp_quantize.py``), llama.cpp choosing each tensor's type itself;
* ``minfer``: the values are quantized here, tensor by tensor, in llama.cpp's mix: Q4_K_M is Q4_K with Q6_K for
  the (tied) embeddings and for ``attn_v`` / ``ffn_down`` in the layers llama.cpp's ``use_more_bits`` picks (the
  first and last eighth and every third between); Q4_0 keeps the embeddings Q6_K; rows that are not whole
  256-value super-blocks fall back as in llama.cpp (Q4_K -> Q5_0, Q6_K -> Q8_0). Q8_0, Q4_K and Q5_0 are
  minfer's (bit-equal to llama.cpp's reference), Q4_0 is ``gguf.quants``', Q6_K is :func:`quantize_q6_k`
  (llama.cpp's reference algorithm in float32 numpy, not held bit-equal).

Memory stays at about one tensor (the largest, the embeddings, in chunks of rows); the file is written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from minfer.testing import gguf_writing as gw

# run by llama.cpp's interpreter (which need not have minfer) to quantize with llama.cpp's own code
LLAMACPP_QUANTIZE = Path(__file__).with_name("llamacpp_quantize.py")

DEFAULT_TOKENIZER = Path.home() / ".cache" / "minfer" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
QK_K = 256
_CHUNK_VALUES = 1 << 21  # values generated and quantized at a time: 8 MB of float32


@dataclass(frozen=True)
class ModelShape:
    """A model's dimensions, as its ``config.json`` gives them."""

    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int | None = None  # None: n_embd / n_head
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    n_ctx: int = 8192

    @property
    def head_dim_k(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


SHAPES: dict[str, ModelShape] = {
    "smollm2-360m": ModelShape("llama", 960, 32, 15, 5, 2560, rope_base=100000.0),
    "smollm2-1.7b": ModelShape("llama", 2048, 24, 32, 32, 8192, rope_base=130000.0),
    "qwen2.5-1.5b": ModelShape("qwen2", 1536, 28, 12, 2, 8960, rope_base=1e6, rms_eps=1e-6, n_ctx=32768),
    "qwen3-4b": ModelShape("qwen3", 2560, 36, 32, 8, 9728, head_dim=128, rope_base=1e6, rms_eps=1e-6, n_ctx=40960),
    # for tests: each architecture's recipe at a few MB (head_dim 128 != 256 / 4 in tiny-qwen3, as in Qwen3)
    "tiny": ModelShape("llama", 256, 2, 4, 2, 512),
    "tiny-qwen2": ModelShape("qwen2", 256, 2, 4, 2, 512, rope_base=1e6, rms_eps=1e-6),
    "tiny-qwen3": ModelShape("qwen3", 256, 2, 4, 2, 512, head_dim=128, rope_base=1e6, rms_eps=1e-6),
    # rows of 320 and 640: no whole super-blocks, so a "Q4_K_M" file is mostly Q5_0 (as SmolLM2-360M's)
    "tiny-q5": ModelShape("llama", 320, 2, 5, 1, 640),
}

# --type -> (llama.cpp's LLAMA_FTYPE_MOSTLY_* suffix, the GGUF file type, the main block type)
FILE_TYPES: dict[str, tuple[str, LlamaFileType, QT]] = {
    "f16": ("F16", LlamaFileType.MOSTLY_F16, QT.F16),
    "q8_0": ("Q8_0", LlamaFileType.MOSTLY_Q8_0, QT.Q8_0),
    "q4_0": ("Q4_0", LlamaFileType.MOSTLY_Q4_0, QT.Q4_0),
    "q4_k_m": ("Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, QT.Q4_K),
    "iq4_xs": ("IQ4_XS", LlamaFileType.MOSTLY_IQ4_XS, QT.IQ4_XS),  # llama.cpp's quantizer only
}


# --------------------------------------------------------------------------------------------- the plan


def tensor_shapes(shape: ModelShape, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model in numpy order, from minfer's own architecture tables (what it will ask for)."""
    from minfer.models.hparams import HParams
    from minfer.models.registry import get_architecture

    hd = shape.head_dim_k
    hp = HParams(arch=shape.arch, n_vocab=n_vocab, n_ctx_train=shape.n_ctx, n_embd=shape.n_embd,
                 n_layer=shape.n_layer, n_head=shape.n_head, n_head_kv=shape.n_head_kv, n_ff=shape.n_ff,
                 head_dim_k=hd, head_dim_v=hd, n_rot=hd, rope_freq_base=shape.rope_base, rope_freq_scale=1.0,
                 rms_eps=shape.rms_eps, attn_scale=hd ** -0.5)
    arch = get_architecture(shape.arch)
    shapes = dict(arch.global_tensor_shapes(hp))
    for il in range(shape.n_layer):
        shapes.update(arch.layer_tensor_shapes(hp, il))
    return shapes


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _fallback(t: QT, n_in: int) -> QT:
    """llama.cpp's ``tensor_type_fallback`` for rows that are not whole super-blocks."""
    if t in (QT.Q4_K, QT.Q5_K, QT.Q6_K) and n_in % QK_K:
        t = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}[t]
    if n_in % 32:
        t = QT.F16
    return t


def block_type(name: str, shp: tuple[int, ...], file_type: str, n_layer: int) -> QT:
    """The type llama.cpp's quantizer gives a tensor of a (tied-embedding) model for ``file_type``."""
    if len(shp) != 2:
        return QT.F32  # norms and biases
    main = FILE_TYPES[file_type][2]
    if main in (QT.F16, QT.Q8_0):
        return _fallback(main, shp[1])
    t = main
    if name == "token_embd.weight":  # tied: llama.cpp treats it as the output matrix
        t = QT.Q6_K
    elif file_type == "q4_k_m" and (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")):
        if use_more_bits(int(name.split(".")[1]), n_layer):
            t = QT.Q6_K
    return _fallback(t, shp[1])


def plan(shape: ModelShape, n_vocab: int, file_type: str) -> list[gw.PlannedTensor]:
    """The tensors of a ``file_type`` file quantized in llama.cpp's mix."""
    return [gw.PlannedTensor(name, shp, block_type(name, shp, file_type, shape.n_layer))
            for name, shp in tensor_shapes(shape, n_vocab).items()]


def float_plan(shape: ModelShape, n_vocab: int) -> list[gw.PlannedTensor]:
    """The F16 source llama.cpp's quantizer reads: matrices F16, norms and biases F32."""
    return [gw.PlannedTensor(name, shp, QT.F16 if len(shp) == 2 else QT.F32)
            for name, shp in tensor_shapes(shape, n_vocab).items()]


# --------------------------------------------------------------------------------------------- quantizers


def _nearest_int(v: np.ndarray) -> np.ndarray:
    return np.rint(v).astype(np.int32)  # half to even, as ggml's nearest_int


def _qx_scales(x: np.ndarray, nmax: int) -> np.ndarray:
    """llama.cpp's ``make_qx_quants(16, nmax, x, L, rmse_type=1, NULL)`` for each row of ``x[sub-blocks, 16]``:
    the sub-block scales, from an 18-step search around -nmax / max weighted by x^2."""
    x = x.astype(np.float32)
    idx = np.argmax(np.abs(x), axis=1)
    mx = x[np.arange(x.shape[0]), idx]
    zero = np.abs(mx) < 1e-15
    mx = np.where(zero, np.float32(1), mx)
    w = x * x

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lv = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(np.float32)
        return (w * x * lv).sum(axis=1), (w * lv * lv).sum(axis=1)

    sumlx, suml2 = sums(np.float32(-nmax) / mx)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0).astype(np.float32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        slx, sl2 = sums(-(np.float32(nmax) + np.float32(0.1) * step) / mx)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        new_scale = slx / np.where(sl2 > 0, sl2, 1)
        scale = np.where(better, new_scale, scale).astype(np.float32)
        best = np.where(better, scale * slx, best)
    return np.where(zero, np.float32(0), scale)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of float rows ``x[rows, n]`` (n a multiple of 256): ``uint8[rows, n / 256 * 210]``, after
    llama.cpp's ``quantize_row_q6_K_ref`` (16 sub-block scales by :func:`_qx_scales`, int8 against an f16 d)."""
    rows, n = x.shape
    sub = x.astype(np.float32).reshape(-1, 16, 16)  # [super-block, sub-block, value]
    nb = sub.shape[0]
    scales = _qx_scales(sub.reshape(-1, 16), 32).reshape(nb, 16)
    pick = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(nb), pick]
    empty = np.abs(max_scale) < 1e-15
    iscale = np.float32(-128) / np.where(empty, np.float32(1), max_scale)
    d = np.where(empty, 0, 1 / iscale).astype(np.float16)
    sc = np.where(empty[:, None], 0, np.minimum(127, _nearest_int(iscale[:, None] * scales))).astype(np.int8)
    dl = d.astype(np.float32)[:, None] * sc.astype(np.float32)  # [nb, 16]
    safe = np.where(dl == 0, np.float32(1), dl)
    q = np.clip(_nearest_int(sub / safe[:, :, None]), -32, 31) + 32
    q = np.where(dl[:, :, None] == 0, 32, q).astype(np.uint8).reshape(nb, 2, 4, 32)  # i = 128 h + 32 c + l
    ql = np.empty((nb, 2, 2, 32), np.uint8)
    ql[:, :, 0] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    ql[:, :, 1] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out = np.empty((nb, 210), np.uint8)
    out[:, 0:128] = ql.reshape(nb, 128)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(nb, 1).view(np.uint8)
    return out.reshape(rows, n // QK_K * 210)


def quantize_rows(x: np.ndarray, t: QT) -> np.ndarray:
    """Float rows ``x[rows, n]`` in block type ``t``: float16/float32 values, or uint8 blocks."""
    if t == QT.F32:
        return x.astype(np.float32)
    if t == QT.F16:
        return x.astype(np.float16)
    if t == QT.Q6_K:
        return quantize_q6_k(x)
    if t == QT.Q4_0:
        return gguf.quants.quantize(x.astype(np.float32), QT.Q4_0)
    from minfer.formats.quantize import quantize_rows as minfer_quantize_rows
    from minfer.formats.quants import GGMLType

    return minfer_quantize_rows(x, GGMLType(int(t)))  # Q8_0, Q4_K, Q5_0


def tensor_values(t: gw.PlannedTensor, index: int, seed: int) -> np.ndarray:
    """The tensor's data in its type, made a chunk of rows at a time (one chunk of float32 alive)."""
    rng = np.random.default_rng([seed, index])
    if len(t.shape) == 1:
        if t.name.endswith(".bias"):
            return (0.02 * rng.standard_normal(t.shape[0], dtype=np.float32)).astype(np.float32)
        return np.ones(t.shape[0], np.float32)
    rows, n = t.shape
    step = max(1, _CHUNK_VALUES // n)
    parts = []
    for r0 in range(0, rows, step):
        x = rng.standard_normal((min(rows, r0 + step) - r0, n), dtype=np.float32)
        x *= np.float32(0.02)
        parts.append(quantize_rows(x, t.ggml_type))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


# --------------------------------------------------------------------------------------------- the file


def _metadata(shape: ModelShape, shape_name: str, file_type: str, source: gguf.GGUFReader,
              ftype: LlamaFileType) -> Callable[[gguf.GGUFWriter], None]:
    def add(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(f"synthetic {shape_name} {file_type} (random weights)")
        w.add_file_type(ftype)
        if ftype != LlamaFileType.MOSTLY_F16:
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(shape.n_ctx)
        w.add_embedding_length(shape.n_embd)
        w.add_block_count(shape.n_layer)
        w.add_feed_forward_length(shape.n_ff)
        w.add_head_count(shape.n_head)
        w.add_head_count_kv(shape.n_head_kv)
        if shape.head_dim is not None:
            w.add_key_length(shape.head_dim)
            w.add_value_length(shape.head_dim)
        w.add_rope_dimension_count(shape.head_dim_k)
        w.add_rope_freq_base(shape.rope_base)
        w.add_layer_norm_rms_eps(shape.rms_eps)
        w.add_vocab_size(gw.tokenizer_vocab_size(source))
        gw.copy_fields(source, w, keep=lambda name: name.startswith("tokenizer."))
    return add


def llamacpp_python(explicit: str | None) -> str | None:
    """An interpreter with ``llama_cpp``: ``explicit``, else this one when it has it."""
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def write_model(out: Path, shape_name: str, file_type: str, tokenizer_from: Path, seed: int = 0,
                quantizer: str = "auto", llamacpp: str | None = None, layers: int | None = None,
                threads: int = 2, log: Callable[[str], None] = print) -> str:
    """Write the synthetic model; returns the quantizer used (``llama.cpp`` or ``minfer``)."""
    shape = SHAPES[shape_name]
    if layers is not None:
        shape = ModelShape(**{**shape.__dict__, "n_layer": layers})
    source = gguf.GGUFReader(tokenizer_from)
    n_vocab = gw.tokenizer_vocab_size(source)
    ftype_name, ftype, _ = FILE_TYPES[file_type]
    python = llamacpp_python(llamacpp) if quantizer in ("auto", "llama.cpp") else None
    if quantizer == "llama.cpp" and python is None:
        raise SystemExit("synthetic_model: --quantizer llama.cpp needs llama_cpp here or --llamacpp-python")
    used = "llama.cpp" if python is not None and file_type != "f16" else "minfer"
    if used == "minfer" and file_type == "iq4_xs":
        raise SystemExit("synthetic_model: iq4_xs needs llama.cpp's quantizer (llama_cpp here or --llamacpp-python)")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if used == "minfer":
        tensors = plan(shape, n_vocab, file_type)
        index = {t.name: i for i, t in enumerate(tensors)}
        gw.write_streamed(out, shape.arch, _metadata(shape, shape_name, file_type, source, ftype), tensors,
                          lambda t: tensor_values(t, index[t.name], seed))
    else:
        tensors = float_plan(shape, n_vocab)
        index = {t.name: i for i, t in enumerate(tensors)}
        f16 = out.with_name(f".{out.name}.{os.getpid()}.f16.gguf")
        part = out.with_name(f".{out.name}.{os.getpid()}.part.gguf")
        try:
            gw.write_streamed(f16, shape.arch,
                              _metadata(shape, shape_name, file_type, source, LlamaFileType.MOSTLY_F16),
                              tensors, lambda t: tensor_values(t, index[t.name], seed))
            log(f"{f16.name}: F16 source written in {time.perf_counter() - t0:.0f} s; llama.cpp quantizing")
            r = subprocess.run([python, str(LLAMACPP_QUANTIZE), str(f16), str(part),
                                ftype_name, str(threads)], capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"synthetic_model: llama.cpp's quantizer failed ({r.returncode}): "
                                 f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
            os.replace(part, out)
        finally:
            for p in (f16, part):
                if p.exists():
                    p.unlink()
    log(f"{out}: {out.stat().st_size / 2**20:.0f} MiB, {shape_name} ({shape.n_layer} layers), {file_type}, "
        f"quantized by {used}, {time.perf_counter() - t0:.0f} s")
    return used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--type", choices=list(FILE_TYPES), required=True)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path, default=DEFAULT_TOKENIZER,
                    help="GGUF whose tokenizer.* keys are copied (default: the cached SmolLM2-135M)")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantizer", choices=["auto", "llama.cpp", "minfer"], default="auto")
    ap.add_argument("--llamacpp-python", default=None, help="interpreter with llama_cpp (e.g. /tmp/lcpenv/bin/python)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads (default: 2)")
    args = ap.parse_args(argv)
    if not args.tokenizer_from.is_file():
        ap.error(f"--tokenizer-from {args.tokenizer_from}: no such file")
    write_model(args.out, args.shape, args.type, args.tokenizer_from, seed=args.seed, quantizer=args.quantizer,
                llamacpp=args.llamacpp_python, layers=args.layers, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
