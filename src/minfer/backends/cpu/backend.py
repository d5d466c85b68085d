"""CPU backend: maps each graph op to its kernel and prepares weights for them.

Kernel sets: ``fast`` (numba-compiled: quantized matmuls on raw blocks, fused norms, RoPE tables,
attention parallel over heads), ``reference`` (plain numpy with exactly dequantized weights, the
correctness baseline) and ``reference-q8`` (the reference with matmul inputs rounded to Q8 blocks for
block-quantized weights, the arithmetic the fast kernels do). ``MINFER_KERNELS`` or
``CPUBackend(kernels=...)`` picks one. Kernels take ``(node, out, *operands)`` in the order the node's
inputs were built; the K/V operand of ``kv_store``/``kv_load``/``attn`` is the layer's
:class:`~minfer.runtime.kv_cache.KVLayer` (regions in their cell type). A kernel is resolved once per
node when a plan is prepared, never per call.

Results are bit-identical at any thread count: every output row (or head) is computed by exactly one
worker in a fixed order, and BLAS runs single-threaded while plans execute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from minfer.backends.cpu import explorer_kernels, kernel_jobs
from minfer.backends.cpu import reference as ref
from minfer.backends.cpu.thread_governor import ThreadGovernor
from minfer.compiling import KernelCompiler
from minfer.errors import BadRequestError
from minfer.formats.huge_pages import committed_regions
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import ExpertReads, MatmulMeta, Node, Op, RopeMeta, RopeStyle, StepParts, Take

KERNEL_SETS = ("fast", "reference", "reference-q8")
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # weights an encoder's GEMM reads (as float32 panels)
# weight types whose fast matmul quantizes its activations to Q8 blocks (float weights do not)
Q8_ACTIVATION_TYPES = frozenset({GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                                 GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4})


def _get_rows(node: Node, out, table, ids) -> None:
    # a weight prepared for the fast matmuls (tied embeddings) still holds its tensor
    ref.get_rows(getattr(table, "tensor", table), ids, out)


@contextmanager
def _timed(governor: ThreadGovernor, key: Hashable, threads: int) -> Iterator[None]:
    """Tell ``governor`` how long the block took on ``threads`` threads (not when it raised)."""
    t0 = time.perf_counter()
    yield
    governor.record(key, threads, time.perf_counter() - t0)


def _kv_load(node: Node, kv, store) -> None:
    """A view: the load's operand already is the layer's regions."""


# A sliding-window layer reads its sequence's rows from a multiple of this many positions on (the fast
# attention's key chunk, attention.ATTN_KEY_CHUNK): positions shift by a multiple of the chunk, so the
# kernel sums the same chunks whatever the first row read, and a decode step keeps giving the same bits as
# the token's row in a prefill.
WINDOW_ROW_ALIGN = 256


def _first_window_row(min_pos: int, window: int) -> int:
    """The first row any token from position ``min_pos`` on reads: 0 for full attention."""
    if window <= 0 or min_pos < window:
        return 0
    lo = min_pos - window + 1
    return lo - lo % WINDOW_ROW_ALIGN


def attend_by_sequence(
    q, kv, positions, rows, out, attend: Callable[..., None], window: int = 0, cells: bool = False, key_ends=None
) -> None:
    """Run ``attend(q, window, positions, key_ends, out)`` once per sequence in the batch, with ``window``
    that sequence's rows 0..max(key_ends): (K, V) as float32 arrays (``kv.window``), or with ``cells`` (K, V,
    row map) as the fast kernels read them (``kv.cells``: f32 and f16 regions and the window's slice of the
    row map, q8_0 ones dequantized). ``rows`` are virtual rows (sequence base + position); ``key_ends`` the
    last position each token reads (None: its own position, handed on as ``positions`` itself). In a
    sliding-window layer (``window`` > 0) rows before the oldest one still visible are left out (up to
    ``WINDOW_ROW_ALIGN``), and the positions and key ends handed to ``attend`` count from the first row
    read."""
    read = kv.cells if cells else kv.window
    same = key_ends is None  # causal: the key ends are the positions (one array, shifted once)
    ends = positions if same else key_ends
    n = positions.shape[0]
    start = int(rows[0]) - int(positions[0])
    if n == 1:  # decode: one token, one window
        lo = _first_window_row(int(positions[0]), window)
        pos = positions - lo if lo else positions
        attend(q, read(start + lo, start + int(ends[0]) + 1), pos, pos if same else ends - lo, out)
        return
    starts = rows - positions
    if (starts == start).all():
        lo = _first_window_row(int(positions.min()), window)
        pos = positions - lo if lo else positions
        attend(q, read(start + lo, start + int(ends.max()) + 1), pos, pos if same else ends - lo, out)
        return
    for s in dict.fromkeys(starts.tolist()):  # each sequence once, in batch order
        idx = np.flatnonzero(starts == s)
        lo = _first_window_row(int(positions[idx].min()), window)
        cells = read(s + lo, s + int(ends[idx].max()) + 1)
        if idx[-1] - idx[0] + 1 == len(idx):  # contiguous tokens: views, no copies
            sl = slice(int(idx[0]), int(idx[-1]) + 1)
            pos = positions[sl] - lo if lo else positions[sl]
            attend(q[sl], cells, pos, pos if same else ends[sl] - lo, out[sl])
        else:
            o = np.empty((len(idx), out.shape[1]), np.float32)
            pos = np.ascontiguousarray(positions[idx] - lo)
            attend(np.ascontiguousarray(q[idx]), cells, pos, pos if same else np.ascontiguousarray(ends[idx] - lo), o)
            out[idx] = o


def _one_sequence(positions: np.ndarray, rows: np.ndarray) -> bool:
    """Whether every token of a batch belongs to one sequence (the same first row)."""
    starts = rows - positions
    return bool((starts == starts[0]).all())


def _reference_kv_store(node: Node, kv, k, v, rows) -> None:
    if kv.cache_type == "f32":
        ref.kv_store(k, v, kv.physical(rows), kv.k, kv.v, node.meta.layer)
    else:
        kv.store(k, v, rows)


REFERENCE_KERNELS: dict[Op, Callable[..., None]] = {
    Op.GET_ROWS: _get_rows,
    Op.RMS_NORM: lambda node, out, x: ref.rms_norm(x, node.meta.eps, node.meta.width, out),
    Op.RMS_NORM_MUL: lambda node, out, x, gain: ref.rms_norm_mul(x, gain, node.meta.eps, node.meta.width, out),
    Op.MUL: lambda node, out, x, y: ref.mul(x, y, out),
    Op.ADD: lambda node, out, x, y: ref.add(x, y, out),
    Op.ROPE: lambda node, out, x, positions: ref.rope(x, positions, node.meta, out),
    Op.KV_STORE: _reference_kv_store,
    Op.KV_LOAD: _kv_load,
    # (key_ends: the node's fifth input where it has one, see GraphBuilder.attn)
    Op.ATTN: lambda node, out, q, kv, positions, rows, key_ends=None: attend_by_sequence(
        q, kv, positions, rows, out,
        lambda q, kv_window, pos, ends, o: ref.attention(q, *kv_window, pos, node.meta, o, ends),
        node.meta.window, key_ends=key_ends,
    ),
    Op.SILU: lambda node, out, x: ref.silu(x, out),
    Op.SWIGLU: lambda node, out, gate, up: ref.swiglu(gate, up, out),
    Op.SCALE: lambda node, out, x: ref.scale(x, node.meta.factor, out),
    Op.GELU: lambda node, out, x: ref.gelu(x, out),
    Op.GEGLU: lambda node, out, gate, up: ref.geglu(gate, up, out),
    Op.SOFTCAP: lambda node, out, x: ref.softcap(x, node.meta.factor, out),
    Op.LAYER_NORM: lambda node, out, x, gain, bias: ref.layer_norm(x, gain, bias, node.meta.eps, out),
    Op.GELU_ERF: lambda node, out, x: ref.gelu_erf(x, out),
    Op.ENC_ATTN: lambda node, out, q, k, v, spans: ref.encoder_attention(q, k, v, spans, node.meta, out),
    Op.MOE_ROUTE: lambda node, out, logits: ref.moe_route(logits, node.meta.n_used, node.meta.normalize, out),
}


def _bound(
    general: Callable[..., None], direct: Callable[..., Callable[[], None] | None] | None
) -> Callable[..., None]:
    """A node's kernel that, once ``general(out, *operands)`` has run (with all its checks) on a set of
    buffers, runs the call ``direct(out, *operands)`` bound to them while the node is called with those
    very buffers again: what a plan does every step. The bound call is the same kernel on the same arrays
    (the same bits); it skips the per-call checks and dispatch, which cost about as much as a small decode
    matmul. Other buffers take the general path again (and are bound in turn)."""
    if direct is None:
        return lambda node, out, *args: general(out, *args)
    # out and up to three operands last bound, compared by identity (arrays have no plain ==); None: unbound
    key: list[Any] = [None] * 4
    call: list[Callable[[], None] | None] = [None]

    def run(node: Node, out, *args) -> None:
        k = key
        n = len(args)
        if (
            call[0] is not None and k[0] is out and k[1] is args[0]
            and (k[2] is args[1] if n > 1 else k[2] is None) and (k[3] is args[2] if n > 2 else k[3] is None)
        ):
            call[0]()
            return
        general(out, *args)
        bound = direct(out, *args) if n <= 3 else None
        key[:] = (out, *args, None, None)[:4] if bound is not None else (None,) * 4
        call[0] = bound

    return run


def _computed_by_group(node: Node, out, *args) -> None:
    """A matmul whose output the first step of its group wrote (see ``CPUBackend.group_kernels``)."""


class _GroupedMatmuls:
    """The first step of a group of matmuls: on its first call each member runs its own kernel (with all
    their checks), from then on the group's single parallel loop computes every member's output."""

    def __init__(self, call: Callable[[], None], members: Sequence[tuple[Node, Callable[..., None], Any, tuple]]):
        self.call = call
        self.members = list(members)
        self.checked = False

    def __call__(self, node: Node, out, *args) -> None:
        if self.checked:
            self.call()
            return
        for m_node, fn, m_out, m_args in self.members:
            fn(m_node, m_out, *m_args)
        self.checked = True


def _reads_same_activations(a: Node, b: Node) -> bool:
    """Two matmuls of one input (and, where a QUANTIZE node quantizes it for them, of one quantized copy)."""
    if a.op is not Op.MATMUL or b.op is not Op.MATMUL or len(a.inputs) != len(b.inputs):
        return False
    return a.inputs[0].id == b.inputs[0].id and (len(a.inputs) == 2 or a.inputs[2].id == b.inputs[2].id)


MAX_GROUP = 3  # q, k and v


class CPUBackend(explorer_kernels.ExplorerKernels):
    def __init__(self, threads: int = 1, kernels: str | None = None) -> None:
        kernels = kernels or os.environ.get("MINFER_KERNELS", "fast")
        if kernels not in KERNEL_SETS:
            raise BadRequestError(f"unknown kernel set {kernels!r} (MINFER_KERNELS: {', '.join(KERNEL_SETS)})")
        self.kernels = kernels
        self.name = f"cpu-{kernels}"
        self.threads = threads
        self._blas = ThreadpoolController()
        self._pool: ThreadPoolExecutor | None = None
        self._rope_tables: dict[tuple, Any] = {}
        self._prepared: dict[int, tuple[WeightTensor, Any]] = {}  # id(tensor) -> (tensor, its prepared form)
        self._gemm_panels: dict[int, tuple[WeightTensor, np.ndarray]] = {}  # id(tensor) -> (tensor, float_gemm panels)
        # (id of A, id of B) -> (A, B, A^T, B^T as the LoRA kernel reads them)
        self._lora_operands: dict[tuple[int, int], tuple[WeightTensor, WeightTensor, np.ndarray, np.ndarray]] = {}
        self.expert_reads = ExpertReads()
        # kernels are compiled when a plan first needs them (prepare_kernels), only those it needs
        self.compiler = KernelCompiler()
        self._batched = False
        # fewer threads while other processes take cores (MINFER_ADAPTIVE_THREADS=0 turns it off); the bits
        # do not depend on it, since every kernel gives 1 thread = N
        adaptive = kernels == "fast" and threads > 1 and os.environ.get("MINFER_ADAPTIVE_THREADS", "1") != "0"
        self.governor = ThreadGovernor(threads) if adaptive else None
        if kernels == "fast":
            from minfer.backends.cpu import (
                attention,
                elementwise,
                iquant_matmul,
                kquant_matmul,
                norms,
                quant_matmul,
                rope,
            )

            self._norms, self._ew, self._rope, self._attn = norms, elementwise, rope, attention
            self._qm = quant_matmul
            self._kq = kquant_matmul  # compiled on first use (Q5_0/Q5_1 and the K-quants)
            # the Q8_K activations of every bound K-quant matmul of every plan (one step runs at a time)
            self._q8k_scratch = kquant_matmul.Q8KScratch()
            self._iq = iquant_matmul  # compiled on first use (IQ4_NL, IQ4_XS, MXFP4)
        elif threads > 1:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="minfer")

    def will_batch_sequences(self) -> None:
        """The engine will run batches mixing sequences (a server's): their attention is a kernel of its
        own, compiled with the first plan's."""
        self._batched = True

    def prepare_kernels(self, nodes: Sequence[Node], kv_layers: Sequence[Any] = ()) -> None:
        """Before a plan binds its kernels: compile (or load from numba's cache) those its ``nodes`` run,
        with the KV cells of ``kv_layers``, together with whatever else was asked of :attr:`compiler` (the
        sampler's kernels)."""
        if self.kernels == "fast":
            self._lay_out_lora_operands([n for n in nodes if n.op is Op.LORA])
            self.compiler.need(kernel_jobs.jobs_for(nodes))
            attends = any(n.op is Op.ATTN and n.meta.softcap == 0 for n in nodes)
            for cache_type in dict.fromkeys(layer.cache_type for layer in kv_layers) if attends else ():
                self.compiler.need(kernel_jobs.cache_jobs(cache_type, self._batched))
        self.compiler.flush()

    def running(self, pass_key: Hashable | None = None) -> AbstractContextManager[Any]:
        """Context in which plans execute: BLAS on one thread, numba on ``threads``. A pass of the kind
        ``pass_key`` (its sizes) runs on as many as the thread governor picks for that kind, up to
        ``threads``, and the governor learns how long it took (see :mod:`.thread_governor`)."""
        stack = ExitStack()
        stack.enter_context(self._blas.limit(limits=1, user_api="blas"))
        if self.kernels == "fast":
            import numba

            previous = numba.get_num_threads()
            n = min(self.threads, numba.config.NUMBA_NUM_THREADS)
            if pass_key is not None and self.governor is not None:
                n = min(n, self.governor.threads(pass_key))
                stack.enter_context(_timed(self.governor, pass_key, n))
            numba.set_num_threads(n)
            stack.callback(numba.set_num_threads, previous)
        return stack

    def prepare_weight(self, tensor: WeightTensor | ExpertTensors) -> Any:
        if isinstance(tensor, ExpertTensors):  # one prepared matrix per expert
            return tuple(self.prepare_weight(t) for t in tensor.experts)
        # 1-D tensors (norm gains, biases) and F32 tensors the reference reads are float32 arrays; a 1-D
        # tensor in another type is small, so it is dequantized once. Matrices stay raw blocks.
        if len(tensor.shape) == 1 or (tensor.ggml_type == GGMLType.F32 and self.kernels != "fast"):
            return np.ascontiguousarray(ref.dequantize_tensor(tensor))
        if self.kernels == "fast":  # the fast matmuls' per-weight setup (a repacked copy for Q4_1)
            held = self._prepared.get(id(tensor))
            if held is not None and held[0] is tensor:  # every plan of the model shares it
                return held[1]
            prepared = tensor
            if self._qm.supports(tensor.ggml_type):
                prepared = self._qm.prepare(tensor)
            elif self._kq.supports(tensor.ggml_type):
                prepared = self._kq.prepare(tensor)
            elif self._iq.supports(tensor.ggml_type):
                prepared = self._iq.prepare(tensor)
            self._prepared[id(tensor)] = (tensor, prepared)
            return prepared
        return tensor

    def quantized_input(self, tensor: WeightTensor) -> bool:
        """Whether a matmul with this weight quantizes its activations (so sharing them pays)."""
        return self.kernels == "fast" and tensor.ggml_type in Q8_ACTIVATION_TYPES

    def buffer(self, node: Node, take: Take) -> Any:
        """Buffers of non-float nodes: the quantized activations of a QUANTIZE node (storage from ``take``)."""
        return self._qm.QuantizedActivations(*node.shape, take=take)

    def rope(self, x: np.ndarray, positions: np.ndarray, meta: RopeMeta, out: np.ndarray) -> None:
        """RoPE outside a plan (a context shift re-rotates cached K rows) with this backend's kernels;
        ``out`` may be ``x``."""
        if self.kernels != "fast":
            ref.rope(x, positions, meta, out)
            return
        # int32 positions: the signature the fast kernel is compiled for at warmup
        positions = np.asarray(positions, dtype=np.int32)
        self._rope_table(meta).apply(x, positions, meta.n_head, meta.style is RopeStyle.NEOX, out)

    def kernel(self, node: Node) -> Callable[..., None]:
        if node.op is Op.MOE_EXPERTS:
            return self._moe_experts_kernel(node)
        if node.op is Op.LORA:
            return self._lora_kernel(node)
        if self.kernels == "fast":
            return self._fast_kernel(node)
        if node.op is not Op.MATMUL:
            return REFERENCE_KERNELS[node.op]
        if self.kernels == "reference-q8" and node.inputs[1].source.ggml_type in Q8_ACTIVATION_TYPES:
            return lambda node, out, x, w: self._reference_matmul(node, out, ref.round_activations_q8(x), w)
        return self._reference_matmul

    def _matmul_fn(self, w: WeightTensor) -> Callable[[Any, Any, Any], None]:
        """``fn(x, w, out)``: the matmul this kernel set runs for a weight of ``w``'s type (an expert's)."""
        if self.kernels == "fast":
            if self._qm.supports(w.ggml_type):
                return self._qm.matmul
            if self._kq.supports(w.ggml_type):
                return self._kq.matmul
            if self._iq.supports(w.ggml_type):
                return self._iq.matmul
        q8 = self.kernels == "reference-q8" and w.ggml_type in Q8_ACTIVATION_TYPES
        return lambda x, w, out: self._reference_matmul(None, out, ref.round_activations_q8(x) if q8 else x, w)

    def _lay_out_lora_operands(self, nodes: Sequence[Node]) -> None:
        """The LoRA kernel's operands of these nodes that are not made yet, made now and laid out in the nodes'
        order in one mapping on huge pages (:mod:`minfer.formats.huge_pages`). A decode pass reads each adapter
        matrix once, between matmuls that stream the weights through the caches: scattered on the heap's 4 KiB
        pages they read at a fifth of the memory's rate (SmolLM2's rank-16 adapter, 150 layers' worth of f16
        matrices in a loop: 48-51 us a layer; in one mapping in pass order, 37-39)."""
        from minfer.backends.cpu import lora_kernels

        made: dict[tuple[int, int], tuple[WeightTensor, WeightTensor, np.ndarray, np.ndarray]] = {}
        for node in nodes:
            pair = (node.inputs[2].source, node.inputs[3].source)
            key = (id(pair[0]), id(pair[1]))
            held = self._lora_operands.get(key)
            if key in made or (held is not None and held[0] is pair[0] and held[1] is pair[1]):
                continue
            made[key] = (*pair, *lora_kernels.operands(*(ref.dequantize_tensor(t) for t in pair)))
        if not made:
            return
        regions = committed_regions([(m.shape, m.dtype) for held in made.values() for m in held[2:]])
        for key, (a, b, at, bt) in made.items():
            at_in, bt_in = next(regions), next(regions)
            at_in[...], bt_in[...] = at, bt
            self._lora_operands[key] = (a, b, at_in, bt_in)

    def _lora_kernel(self, node: Node) -> Callable[..., None]:
        """A LoRA node's kernel over its A and B as float32 arrays, whatever the kernel set made of them as
        weights: numpy's products (reference), or the compiled row kernel on its transposed operands, made once
        per adapter matrix pair and shared by every plan (fast)."""
        factor = node.meta.factor
        if self.kernels != "fast":
            a, b = (ref.dequantize_tensor(i.source) for i in node.inputs[2:4])
            return lambda node, out, y, x, _a, _b, scales: ref.lora(y, x, a, b, scales, factor, out)
        from minfer.backends.cpu import lora_kernels

        self._lay_out_lora_operands([node])  # (made when the plan was prepared: a lookup then)
        held = self._lora_operands[(id(node.inputs[2].source), id(node.inputs[3].source))]
        run = lora_kernels.bound(held[2], held[3], factor)
        return lambda node, out, y, x, _a, _b, scales: run(y, x, scales, out)

    def _moe_experts_kernel(self, node: Node) -> Callable[..., None]:
        """The batch's tokens grouped by expert; each chosen expert's three matrices multiplied once for the
        tokens that chose it, with the matmul kernels of their block type (only those experts' rows are read)."""
        fns = tuple(self._matmul_fn(i.source.experts[0]) for i in node.inputs[2:5])
        shared_fns = tuple(self._matmul_fn(i.source) for i in node.inputs[5:])
        act = self._ew.swiglu if self.kernels == "fast" else ref.swiglu
        reads = self.expert_reads

        def moe(node: Node, out, x, route, gate, up, down, *shared) -> None:
            reads.bytes += ref.moe_experts(x, route, gate, up, down, out, fns, act)
            reads.experts += 3 * len(ref.expert_assignments(route, len(gate)))
            if shared:
                reads.bytes += ref.shared_expert(x, *shared, out, shared_fns, act)

        return moe

    def group_kernels(self, steps: Sequence[StepParts]) -> list[Callable[..., None]]:
        """The kernels of a plan's steps, given as (node, kernel, output, operands) in run order, with each
        run of consecutive matmuls that read the same activations and whose weights share a repacked type
        (q/k/v, gate/up) made one parallel loop: the run's first step computes every output of the run,
        the others do nothing. (Nothing runs between them, and their one operand outlives the run, so no
        buffer holds a live value between a run's first step and the step whose output it becomes.)
        Fewer parallel regions per token: each costs a wake-up of the threads and a wait for the slowest."""
        fns = [fn for _, fn, _, _ in steps]
        if self.kernels != "fast":
            return fns
        i = 0
        while i < len(steps):
            node, _, _, args = steps[i]
            j = i + 1
            while (j < len(steps) and j - i < MAX_GROUP and _reads_same_activations(node, steps[j][0])
                   and node.inputs[1].source.ggml_type is steps[j][0].inputs[1].source.ggml_type):
                j += 1
            if j - i > 1:
                run = steps[i:j]
                call = self._kq.group_call(args[0], [a[1] for _, _, _, a in run], [o for _, _, o, _ in run],
                                           self._q8k_scratch, args[2] if len(args) > 2 else None)
                if call is not None:
                    fns[i] = _GroupedMatmuls(call, run)
                    fns[i + 1 : j] = [_computed_by_group] * (j - i - 1)
            i = j
        return fns

    # -- reference ---------------------------------------------------------------------------------

    def _reference_matmul(self, node: Node, out, x, w) -> None:
        chunks = ref.matmul_row_chunks(w.shape)
        if self._pool is None or len(chunks) == 1:
            for r0, r1 in chunks:
                ref.matmul_chunk(x, w, out, r0, r1)
        else:
            # numpy releases the GIL inside matmul and dequantization, so the chunks run in parallel;
            # chunk bounds depend on the shape only, so the result does not depend on the thread count
            list(self._pool.map(lambda c: ref.matmul_chunk(x, w, out, c[0], c[1]), chunks))

    # -- fast --------------------------------------------------------------------------------------

    def _rope_table(self, meta: RopeMeta) -> Any:
        """The fast RoPE's table for this geometry, shared by every node (and call) that has it."""
        key = self._rope.RopeTable.key(meta)
        table = self._rope_tables.get(key)
        if table is None:
            table = self._rope_tables[key] = self._rope.RopeTable.from_meta(meta)
        return table

    def _fast_matmul(self, node: Node) -> Callable[..., None]:
        """A matmul's kernel by its weight's block-type family, with the plan's direct call where there is one."""
        w, qm, kq = node.inputs[1].source, self._qm, self._kq
        if isinstance(node.meta, MatmulMeta) and node.meta.whole_sequences and w.ggml_type in FLOAT_TYPES:
            return self._gemm_kernel(w)
        if qm.supports(w.ggml_type):
            mm = qm.matmul
            direct = lambda out, x, w, xq=None: qm.direct_call(x, w, out, xq)  # noqa: E731
        elif kq.supports(w.ggml_type):  # Q5_0/Q5_1 and the K-quants (compiled on first use)
            mm, scratch = kq.matmul, self._q8k_scratch
            direct = lambda out, x, w, xq=None: kq.direct_call(x, w, out, xq, scratch)  # noqa: E731
        elif self._iq.supports(w.ggml_type):  # IQ4_NL, IQ4_XS, MXFP4 (compiled on first use)
            mm, direct = self._iq.matmul, None
        else:
            return self._reference_matmul
        if len(node.inputs) == 3:  # the activations come quantized by a shared QUANTIZE node
            return _bound(lambda out, x, w, xq: mm(x, w, out, xq), direct)
        return _bound(lambda out, x, w: mm(x, w, out), direct)

    def _gemm_kernel(self, w: WeightTensor) -> Callable[..., None]:
        """An encoder's float matmul (:mod:`.float_gemm`): the weight repacked into panels once, for every plan."""
        from minfer.backends.cpu import float_gemm

        held = self._gemm_panels.get(id(w))
        if held is None or held[0] is not w:
            values = w.data.view(np.float32).reshape(w.shape) if w.ggml_type == GGMLType.F32 else \
                ref.dequantize_tensor(w)
            held = self._gemm_panels[id(w)] = (w, float_gemm.repack(values))
        panels = held[1]
        return lambda node, out, x, _w: float_gemm.gemm(x, panels, out)

    def _fast_kernel(self, node: Node) -> Callable[..., None]:
        norms, ew, attention, qm = self._norms, self._ew, self._attn, self._qm
        op, meta = node.op, node.meta
        if op is Op.MATMUL:
            return self._fast_matmul(node)
        if op is Op.QUANTIZE:
            return _bound(lambda out, x: qm.quantize_activations(x, out), lambda out, x: qm.direct_quantize(x, out))
        if op is Op.RMS_NORM_MUL:
            eps, width = meta.eps, meta.width
            return lambda node, out, x, gain: norms.rms_norm_mul(x, gain, eps, width, out)
        if op is Op.RMS_NORM:
            eps, width = meta.eps, meta.width
            return lambda node, out, x: norms.rms_norm(x, eps, width, out)
        if op is Op.ADD:
            return lambda node, out, x, y: ew.add(x, y, out)
        if op is Op.MUL:
            return lambda node, out, x, y: ew.mul(x, y, out)
        if op is Op.SILU:
            return lambda node, out, x: ew.silu(x, out)
        if op is Op.SWIGLU:
            return lambda node, out, gate, up: ew.swiglu(gate, up, out)
        if op is Op.GELU:
            return lambda node, out, x: ew.gelu(x, out)
        if op is Op.GEGLU:
            return lambda node, out, gate, up: ew.geglu(gate, up, out)
        if op is Op.SCALE:
            factor = meta.factor
            return lambda node, out, x: ew.scale(x, factor, out)
        if op is Op.ROPE:
            table = self._rope_table(meta)
            n_head, neox = meta.n_head, meta.style is RopeStyle.NEOX
            return lambda node, out, x, positions: table.apply(x, positions, n_head, neox, out)
        if op is Op.KV_STORE:
            layer = meta.layer

            def kv_store(node: Node, kv, k, v, rows) -> None:
                if kv.cache_type != "q8_0":
                    attention.kv_store(k, v, kv.physical(rows), kv.k, kv.v, layer)
                else:
                    kv.store(k, v, rows)

            return kv_store
        if op is Op.ATTN and meta.softcap > 0:
            # soft-capped scores (Gemma 2) are not in the compiled kernel yet: the numpy attention runs them
            return REFERENCE_KERNELS[op]
        if op is Op.ATTN:
            m = meta

            def attend(q, cells, positions, ends, out) -> None:
                k, v, row_map = cells
                attention.attention(
                    q, k, v, positions, m.n_head, m.n_head_kv, m.head_dim_k, m.head_dim_v, m.scale, out, m.window,
                    row_map, ends,
                )

            window = m.window

            # key_ends: the node's fifth input where it has one (GraphBuilder.attn); without it the kernels
            # are handed the positions as key ends (causal attention), the same code path and bits
            def attn(node: Node, out, q, kv, positions, rows, key_ends=None) -> None:
                if kv.cache_type != "q8_0" and positions.shape[0] > 1 and not _one_sequence(positions, rows):
                    # every sequence of the batch in one parallel call, on the regions themselves (f16 cells
                    # are widened as the kernel loads them); one sequence's tokens take the kernel a decode
                    # step takes (the same bits), so that a single-sequence engine compiles one kernel
                    attention.attention_rows(
                        q, kv.k, kv.v, positions, rows, m.n_head, m.n_head_kv, m.head_dim_k, m.head_dim_v,
                        m.scale, out, window, kv.row_map, key_ends,
                    )
                else:  # a decode step may split its keys over threads; q8_0 cells are dequantized
                    attend_by_sequence(q, kv, positions, rows, out, attend, window, cells=True, key_ends=key_ends)

            return attn
        if op in (Op.LAYER_NORM, Op.GELU_ERF, Op.ENC_ATTN):  # encoders (compiled on first use)
            from minfer.backends.cpu import encoder_kernels as enc

            if op is Op.LAYER_NORM:
                eps = meta.eps
                return lambda node, out, x, gain, bias: enc.layer_norm(x, gain, bias, eps, out)
            if op is Op.GELU_ERF:
                return lambda node, out, x: enc.gelu_erf(x, out)
            return lambda node, out, q, k, v, spans: enc.encoder_attention(q, k, v, spans, meta, out)
        return REFERENCE_KERNELS[op]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
