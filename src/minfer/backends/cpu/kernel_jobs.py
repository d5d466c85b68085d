"""The fast kernels as compile jobs (:class:`minfer.compiling.CompileJob`): which ones a plan's nodes need,
and the functions that compile each on tiny inputs of the argument types the engine passes.

A job calls the kernel module's public entry point (``matmul``, ``rms_norm_mul``...) the way a plan does:
C-contiguous float32 activations, int32 positions, read-only weights and gains (a GGUF is mapped read-only),
Python ints and floats, and both a decode (one token) and a prefill shape (more tokens than a GEMM tile and
than ``PARALLEL_QUANTIZE_TOKENS``). A kernel called with other types still works: numba then compiles that
specialization on its first call, which the command line announces too.

``estimate_s``: CPU seconds each took to compile on a 2-core AVX-512 machine (``scripts/compile_costs.py``
measures them again).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from minfer.backends.cpu import amx
from minfer.backends.cpu.simd512 import WIDE
from minfer.compiling import CompileJob
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor
from minfer.graph.ir import MatmulMeta, Node, Op

_CPU = "minfer.backends.cpu"
_HERE = f"{_CPU}.kernel_jobs"
F32 = np.float32
PREFILL_TOKENS = 17  # more than a GEMM tile (8) and than PARALLEL_QUANTIZE_TOKENS (16)


def _job(name: str, what: str, kernels: tuple[str, ...], estimate_s: float, *args: object) -> CompileJob:
    return CompileJob(name, f"{_HERE}:compile_{name.split(':')[0].replace('-', '_')}", what, kernels, estimate_s, args)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# --- the jobs' bodies (module-level: a worker process calls them by name) ----------------------------------


def compile_matmul(type_name: str) -> None:
    """The matmul of one weight type at decode and prefill shapes (with its activation quantization)."""
    from minfer.backends.cpu import float_matmul, iquant_matmul, kquant_matmul, quant_matmul
    from minfer.formats.block_types import block_size, type_size

    t = GGMLType[type_name]
    module = next(m for m in (quant_matmul, kquant_matmul, iquant_matmul) if m.supports(t))
    n_in = 256
    # 9 rows: the row-by-row paths and the rows past whole groups of 8; 16: the repacked layouts (Q4_K's, Q5_K's
    # and Q6_K's compiled with the k-quants family whichever of its types names the job)
    shapes = [(t, 9)]
    if module is kquant_matmul and t not in (GGMLType.Q5_0, GGMLType.Q5_1):
        shapes += [(GGMLType.Q4_K, 16), (GGMLType.Q5_K, 16), (GGMLType.Q6_K, 16)]
    elif t in (GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.IQ4_NL, GGMLType.IQ4_XS):
        shapes += [(t, 16)]  # block32_rows8's layouts
    for n_tok in (1, PREFILL_TOKENS):
        x = np.random.default_rng(0).standard_normal((n_tok, n_in)).astype(F32)
        for wt, n_out in shapes:
            out = np.empty((n_tok, n_out), F32)
            raw = _read_only(np.zeros((n_out, n_in // block_size(wt) * type_size(wt)), np.uint8))
            w = module.prepare(WeightTensor("warmup", wt, (n_out, n_in), raw))
            if module is iquant_matmul or (module is quant_matmul and wt not in float_matmul.WIDENING):
                xq = quant_matmul.quantize_activations(x)  # a shared QUANTIZE node's output, as plans pass it
                module.matmul(x, w, out, xq)
            module.matmul(x, w, out)


def compile_matmul_amx(type_name: str) -> None:
    """Q4_K's and Q6_K's prefill on AMX tiles (a job of its own beside the k-quants one: both are long)."""
    from minfer.backends.cpu import kquant_matmul
    from minfer.backends.cpu.kquant_amx import AMX_TOKENS
    from minfer.formats.block_types import block_size, type_size

    n_in, n_out = 256, 16
    x = np.random.default_rng(0).standard_normal((AMX_TOKENS, n_in)).astype(F32)
    for wt in (GGMLType.Q4_K, GGMLType.Q6_K):
        raw = _read_only(np.zeros((n_out, n_in // block_size(wt) * type_size(wt)), np.uint8))
        w = kquant_matmul.prepare(WeightTensor("warmup", wt, (n_out, n_in), raw))
        kquant_matmul.matmul(x, w, np.empty((AMX_TOKENS, n_out), F32))


def compile_norms(gain: str) -> None:
    """RMSNorm, plain and fused with a gain that is read-only (``"ro"``: float32 in the file, a view of its
    mapping; plain RMSNorm passes a read-only placeholder, so it shares that specialization) or writable
    (``"rw"``: dequantized at load)."""
    from minfer.backends.cpu import norms

    for n_tok in (1, PREFILL_TOKENS):
        x = np.ones((n_tok, 64), F32)
        out = np.empty_like(x)
        g = np.ones(64, F32)
        if gain == "ro":
            norms.rms_norm(x, 1e-5, 64, out)
            norms.rms_norm_mul(x, _read_only(g), 1e-5, 64, out)
        else:
            norms.rms_norm_mul(x, g, 1e-5, 64, out)


def compile_elementwise(ops: str) -> None:
    """The elementwise kernels named in ``ops`` (comma-separated: add, mul, swiglu, silu, geglu, gelu, scale;
    ``add+ro`` / ``add+rw``: with a 1-D weight operand, read-only or writable, as norms' gains)."""
    from minfer.backends.cpu import elementwise as ew

    x = np.ones((2, 64), F32)
    out = np.empty_like(x)
    for op in ops.split(","):
        name, _, weight = op.partition("+")
        if name in ("add", "mul"):
            fn = ew.add if name == "add" else ew.mul
            if weight:
                w = np.ones(64, F32)
                fn(x, _read_only(w) if weight == "ro" else w, out)
            else:
                fn(x, x, out)
        elif name in ("swiglu", "geglu"):
            getattr(ew, name)(x, x, out)
            many = np.ones((ew.PARALLEL_ROWS, 64), F32)  # a prompt's rows: the parallel kernel
            getattr(ew, name)(many, many, np.empty_like(many))
        elif name in ("silu", "gelu"):
            getattr(ew, name)(x, out)
        elif name == "scale":
            ew.scale(x, 2.0, out)


def compile_rope() -> None:
    from minfer.backends.cpu import rope

    x = np.ones((2, 16), F32)
    rope.RopeTable(8, 8, 10000.0, 1.0, n_pos=2).apply(x, np.zeros(2, np.int32), 2, True, np.empty_like(x))


def _regions(cells: str) -> tuple[np.ndarray, np.ndarray]:
    dtype = np.float16 if cells == "f16" else F32
    return np.zeros((4, 16), dtype), np.zeros((4, 16), dtype)


def compile_kv_store(cells: str) -> None:
    from minfer.backends.cpu import attention

    x = np.ones((2, 16), F32)
    attention.kv_store(x, x, np.zeros(2, np.int32), *_regions(cells))


def compile_kv_store_q8_0() -> None:
    from minfer.formats.quants import Q8_0_BLOCK_BYTES, QK8_0, dequantize_q8_0_rows_into, quantize_q8_0_into

    x = np.ones((2, QK8_0), F32)
    region = np.zeros((4, Q8_0_BLOCK_BYTES), np.uint8)
    quantize_q8_0_into(x, region, np.zeros(2, np.int32))  # a plan's rows are int32 (a context shift's int64
    # rows compile on that first shift)
    dequantize_q8_0_rows_into(region, np.arange(2, dtype=np.int32), np.empty((2, QK8_0), F32))


def compile_attention(cells: str) -> None:
    """The attention of one sequence (prefill, decode, and a decode split by keys: one signature), on f32
    or f16 cells."""
    from minfer.backends.cpu import attention

    q = np.ones((2, 16), F32)
    attention.attention(q, *_regions(cells), np.zeros(2, np.int32), 2, 2, 8, 8, 0.5, np.empty_like(q), 0)


def compile_attention_rows(cells: str) -> None:
    """The attention of a batch mixing sequences (a server's engine)."""
    from minfer.backends.cpu import attention

    q = np.ones((2, 16), F32)
    k, v = _regions(cells)
    pos = np.zeros(2, np.int32)
    for window in (0, 1):
        attention.attention_rows(q, k, v, pos, np.array([0, 2], np.int32), 2, 2, 8, 8, 0.5, np.empty_like(q), window)


# --- which jobs --------------------------------------------------------------------------------------------

_QM = f"{_CPU}.quant_matmul"
_KQ = f"{_CPU}.kquant_matmul"
_IQ = f"{_CPU}.iquant_matmul"
_FM = f"{_CPU}.float_matmul"
_ATT = f"{_CPU}.attention"
_B32 = f"{_CPU}.block32_rows8"
# Q5_0's, IQ4_NL's and IQ4_XS's repacked kernels (one compilation serves the three: ``kind`` is an argument)
_BLOCK32 = (f"{_B32}:_rows8", f"{_B32}:_repack_kernel", *((f"{_B32}:_pairs",) if WIDE else ()))
# the 512-bit prefill of the repacked K-quants, which only a CPU with AVX-512 VNNI compiles and runs
_WIDE_KQUANT = (f"{_CPU}.kquant_rows16:_matmul_pairs", f"{_CPU}.kquant_rows16:_matmul_q6_pairs") if WIDE else ()
# and their prefill on AMX tiles, which only a process the probe lets use them compiles (asked only for a
# model with Q4_K or Q6_K weights: the probe's answer is kept on disk, but the first ask costs a child process)
_AMX_KQUANT = (f"{_CPU}.kquant_amx:_matmul_tiles", f"{_CPU}.kquant_amx:_matmul_q6_tiles")
_QUANTIZE = (f"{_QM}:_quantize_serial", f"{_QM}:_quantize_parallel")
_MATMUL_KERNELS: dict[GGMLType, tuple[tuple[str, ...], float]] = {
    GGMLType.Q4_0: ((f"{_QM}:_gemv_q4_0", f"{_QM}:_gemm_q4_0", *_QUANTIZE, *_BLOCK32), 13.0),
    GGMLType.Q4_1: ((f"{_QM}:_q4_1_rows8", f"{_QM}:_repack_q4_1_kernel", *_QUANTIZE, *_BLOCK32), 13.5),
    GGMLType.Q8_0: ((f"{_QM}:_q8_0_rows8", f"{_QM}:_repack_q8_0_kernel", *_QUANTIZE,
                     *((f"{_QM}:_q8_0_pairs",) if WIDE else ())), 3.5 + 3.0 * WIDE),
    GGMLType.F32: ((f"{_FM}:_gemv_float", f"{_FM}:_gemm_float"), 6.5),
    GGMLType.F16: ((f"{_FM}:_gemv_float", f"{_FM}:_gemm_float"), 6.5),
    GGMLType.BF16: ((f"{_FM}:_gemv_float", f"{_FM}:_gemm_float"), 6.5),
    **{t: ((f"{_KQ}:_matmul_q5", *_QUANTIZE, *_BLOCK32), 10.0) for t in (GGMLType.Q5_0, GGMLType.Q5_1)},
    **{t: ((f"{_KQ}:_matmul_k", f"{_KQ}:_q8k_serial", f"{_KQ}:_q8k_parallel", f"{_CPU}.kquant_rows8:_matmul",
            f"{_CPU}.kquant_rows8:_repack", f"{_CPU}.kquant_rows8:_matmul_q6_group",
            f"{_CPU}.kquant_rows8:_repack_q6", *_WIDE_KQUANT),
           24.0 + 8.0 * bool(_WIDE_KQUANT))
       for t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)},
    GGMLType.MXFP4: ((f"{_IQ}:_gemv_mxfp4", f"{_IQ}:_gemm_mxfp4", *_QUANTIZE), 5.0),
    **{t: ((f"{_IQ}:_gemv_{t.name.lower()}", f"{_IQ}:_gemm_{t.name.lower()}", *_QUANTIZE, *_BLOCK32), 12.0)
       for t in (GGMLType.IQ4_NL, GGMLType.IQ4_XS)},
}
_EW = f"{_CPU}.elementwise"
_ELEMENTWISE_OP = {Op.ADD: "add", Op.MUL: "mul", Op.SWIGLU: "swiglu", Op.SILU: "silu", Op.GEGLU: "geglu",
                   Op.GELU: "gelu", Op.SCALE: "scale"}
# (SwiGLU and GEGLU: a serial kernel for decode, a parallel one for prompts)
_ELEMENTWISE_KERNEL = {"add": ("_binary_kernel",), "mul": ("_binary_kernel",),
                       "swiglu": ("_swiglu_kernel", "_swiglu_parallel"), "silu": ("_swiglu_kernel",),
                       "geglu": ("_geglu_kernel", "_geglu_parallel"), "gelu": ("_geglu_kernel",),
                       "scale": ("_scale_kernel",)}
_ELEMENTWISE_S = {"_binary_kernel": 1.5, "_swiglu_kernel": 1.0, "_geglu_kernel": 1.5, "_scale_kernel": 0.2,
                  "_swiglu_parallel": 1.0, "_geglu_parallel": 1.0}


# weight types whose matmul is one kernel (the type is an argument): one job compiles the family's
_FAMILY = {
    **{t: "float" for t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)},
    **{t: "q5" for t in (GGMLType.Q5_0, GGMLType.Q5_1)},
    **{t: "k-quants" for t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)},
}


def matmul_jobs(types: Iterable[GGMLType]) -> list[CompileJob]:
    """The matmuls of these weight types: one job per kernel family, named after the types it serves."""
    families: dict[str, list[GGMLType]] = {}
    for t in types:
        if t in _MATMUL_KERNELS:
            families.setdefault(_FAMILY.get(t, t.name), []).append(t)
    jobs = []
    for family, ts in families.items():
        kernels, estimate = _MATMUL_KERNELS[ts[0]]
        what = ", ".join(sorted({t.name for t in ts}))
        jobs.append(_job(f"matmul:{family}", what, kernels, estimate, ts[0].name))
        if {GGMLType.Q4_K, GGMLType.Q6_K} & set(ts) and WIDE and amx.usable():
            jobs.append(_job("matmul-amx:k-quants", what + " on AMX tiles", _AMX_KQUANT, 28.0, ts[0].name))
    return jobs


def elementwise_job(ops: Iterable[str]) -> CompileJob | None:
    ops = sorted(set(ops))
    if not ops:
        return None
    kernels = tuple(dict.fromkeys(f"{_EW}:{k}" for o in ops for k in _ELEMENTWISE_KERNEL[o.partition('+')[0]]))
    estimate = sum(_ELEMENTWISE_S[k.split(":")[1]] for k in kernels) + 0.7 * sum("+" in o for o in ops)
    return _job(f"elementwise:{','.join(ops)}", "elementwise", kernels, estimate, ",".join(ops))


def norms_job(gain: str) -> CompileJob:
    return _job(f"norms:{gain}", "norms", (f"{_CPU}.norms:_rms_norm_kernel",), 1.5, gain)


def rope_job() -> CompileJob:
    return CompileJob("rope", f"{_HERE}:compile_rope", "rope", (f"{_CPU}.rope:_rope_kernel",), 2.0)


def lora_job() -> CompileJob:
    return CompileJob("lora", f"{_CPU}.lora_kernels:warmup", "LoRA adapters",
                      (f"{_CPU}.lora_kernels:_lora_serial", f"{_CPU}.lora_kernels:_lora_parallel"), 3.0)


_ENC = f"{_CPU}.encoder_kernels"
_ENCODER_OPS = (Op.LAYER_NORM, Op.GELU_ERF, Op.ENC_ATTN)


def encoder_job() -> CompileJob:
    """LayerNorm, the erf GELU and the bidirectional attention of encoders (BERT), serial and parallel."""
    kernels = tuple(f"{_ENC}:{k}" for k in ("_layer_norm_serial", "_layer_norm_parallel", "_gelu_erf_serial",
                                            "_gelu_erf_parallel", "_sequence_starts", "_attn_serial",
                                            "_attn_parallel"))
    return CompileJob("encoder", f"{_ENC}:warmup", "encoders", kernels, 7.0)


def gemm_job() -> CompileJob:
    """The float GEMM of encoders' matmuls (whole sequences, weights repacked into panels)."""
    return CompileJob("gemm", f"{_CPU}.float_gemm:warmup", "encoder matmuls",
                      (f"{_CPU}.float_gemm:_gemm_serial", f"{_CPU}.float_gemm:_gemm_parallel"), 4.0)


def _weight_kind(node: Node) -> str:
    """How a 1-D weight operand reaches a kernel: read-only (float32 in the file: a view of the read-only
    mapping) or writable (dequantized at load)."""
    return "ro" if node.source.ggml_type == GGMLType.F32 else "rw"


def cache_jobs(cache_type: str, batched: bool = False) -> list[CompileJob]:
    """The KV store and attention for cells of ``cache_type`` (``batched``: also a batch of several
    sequences in one call, what a server's engine runs)."""
    what = f"the {cache_type} cache" if cache_type != "f32" else "attention"
    if cache_type == "q8_0":  # quantized on store, attended as dequantized f32 windows
        jobs = [CompileJob("kv_store_q8_0", f"{_HERE}:compile_kv_store_q8_0", what,
                           ("minfer.formats.quants:_store_kernel",), 1.5)]
        cells = "f32"
    else:
        jobs = [_job(f"kv_store:{cache_type}", what, (f"{_ATT}:_kv_store_kernel",), 0.7, cache_type)]
        cells = cache_type
    jobs.append(_job(f"attention:{cells}", "attention" if cells == "f32" else what,
                     (f"{_ATT}:_attn_kernel",), 11.0, cells))
    if batched and cache_type != "q8_0":
        jobs.append(_job(f"attention-rows:{cells}", what, (f"{_ATT}:_attn_rows_kernel",), 6.0, cells))
    return jobs


def jobs_for(nodes: Iterable[Node]) -> list[CompileJob]:
    """The jobs a graph's nodes need, for the fast kernel set (attention and the KV store: :func:`cache_jobs`)."""
    jobs: list[CompileJob | None] = []
    ew: set[str] = set()
    types: dict[GGMLType, None] = {}
    for node in nodes:
        op = node.op
        if op is Op.MATMUL and isinstance(node.meta, MatmulMeta) and node.meta.whole_sequences and \
                node.inputs[1].source.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            jobs.append(gemm_job())
        elif op is Op.MATMUL:
            types[node.inputs[1].source.ggml_type] = None
        elif op is Op.MOE_EXPERTS:
            types.update(dict.fromkeys(i.source.experts[0].ggml_type for i in node.inputs[2:5]))
            types.update(dict.fromkeys(i.source.ggml_type for i in node.inputs[5:]))
            ew.add("swiglu")
        elif op is Op.RMS_NORM:
            jobs.append(norms_job("ro"))
        elif op is Op.RMS_NORM_MUL:
            jobs.append(norms_job(_weight_kind(node.inputs[1])))
        elif op in (Op.ADD, Op.MUL):
            weight = next((i for i in node.inputs if i.op is Op.WEIGHT), None)
            ew.add(_ELEMENTWISE_OP[op] + ("" if weight is None else "+" + _weight_kind(weight)))
        elif op in _ELEMENTWISE_OP:
            ew.add(_ELEMENTWISE_OP[op])
        elif op is Op.ROPE:
            jobs.append(rope_job())
        elif op is Op.LORA:
            jobs.append(lora_job())
        elif op in _ENCODER_OPS:
            jobs.append(encoder_job())
    jobs.append(elementwise_job(ew))
    jobs.extend(matmul_jobs(types))
    return list({j.name: j for j in jobs if j is not None}.values())


def all_jobs(cache_types: Iterable[str] = ("f32", "f16", "q8_0")) -> list[CompileJob]:
    """Every fast kernel: each weight type's matmul, every vector op, the caches of ``cache_types``."""
    jobs: list[CompileJob | None] = list(matmul_jobs(_MATMUL_KERNELS))
    jobs += [norms_job("ro"), norms_job("rw"), rope_job(), lora_job(), encoder_job(), gemm_job()]
    ops = [o for o in _ELEMENTWISE_OP.values() if o not in ("add", "mul")]
    jobs.append(elementwise_job([*ops, *(f"{o}{w}" for o in ("add", "mul") for w in ("", "+ro", "+rw"))]))
    for c in cache_types:
        jobs.extend(cache_jobs(c, batched=True))
    return [j for j in {j.name: j for j in jobs if j is not None}.values()]
