"""The compute graph's intermediate representation: ops, nodes and their metas, and the interface a
backend offers the plan executor (:class:`Backend`).

A graph is a list of nodes in build order. Every activation is a 2-D float32 array ``[tokens, width]``
(heads packed along the width, as the projections produce them); inputs (token ids, positions, output
row ids) are 1-D int32. Weights are leaf nodes that point at a model tensor. Execution is build order,
which is what guarantees that a layer's KV store runs before the attention that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from minfer.compiling import KernelCompiler


class Op(StrEnum):
    INPUT = "input"  # tokens, positions, output row ids, adapter scales per row: filled per call
    WEIGHT = "weight"  # a model tensor, read in place from the memory map
    GET_ROWS = "get_rows"  # rows of a table: embedding lookup, selecting the rows to output
    RMS_NORM = "rms_norm"  # x / sqrt(mean(x^2) + eps) over groups of `width` values
    MUL = "mul"  # elementwise product, the second operand broadcast over rows/heads (norm gains)
    ADD = "add"  # elementwise sum (residuals) or broadcast (biases)
    MATMUL = "matmul"  # x @ W^T, W stored [out, in] in any supported block type
    ROPE = "rope"  # rotary position embedding, in place on q or k
    KV_STORE = "kv_store"  # write this call's K/V rows into the layer's regions at the given cache rows
    KV_LOAD = "kv_load"  # a view of the layer's K/V regions (no data moves)
    ATTN = "attn"  # causal GQA attention: token t reads its sequence's rows for positions 0..pos[t] (or a window)
    SILU = "silu"  # x * sigmoid(x)
    # fused ops, produced only by the fusion pass
    RMS_NORM_MUL = "rms_norm_mul"  # rms_norm followed by the gain multiply
    SWIGLU = "swiglu"  # silu(gate) * up
    QUANTIZE = "quantize"  # activations to 8-bit blocks, shared by the matmuls that read the same input
    SCALE = "scale"  # x * a constant factor (Gemma's embedding scale)
    GELU = "gelu"  # tanh-approximated GELU
    GEGLU = "geglu"  # fused: gelu(gate) * up
    SOFTCAP = "softcap"  # cap * tanh(x / cap): Gemma 2's final logit soft-capping
    # mixture of experts: MOE_ROUTE turns router logits [tokens, n_expert] into each token's chosen experts and
    # their weights ([tokens, 2 k]: k expert ids, then their k weights); MOE_EXPERTS runs those experts' SwiGLU
    # FFNs on the token's row and sums them by weight (its weights are stacks of one matrix per expert)
    MOE_ROUTE = "moe_route"
    MOE_EXPERTS = "moe_experts"
    # a LoRA adapter's update beside a matmul: y + s[row] * (x @ A^T) @ B^T, where s is each row's scale (an
    # input: rows of one batch may use different adapters, or none, with scale 0)
    LORA = "lora"
    # encoders (BERT): LayerNorm with its gain and bias, (x - mean) / sqrt(var + eps) * gain + bias; the exact
    # (erf) GELU; attention of every token to every token of its own sequence, no mask by position and no KV
    # cache (the K/V rows are this pass's own)
    LAYER_NORM = "layer_norm"
    GELU_ERF = "gelu_erf"
    ENC_ATTN = "enc_attn"


class RopeStyle(StrEnum):
    NORMAL = "normal"  # pairs (2i, 2i+1): GGUF llama, whose converter permuted W_q/W_k rows
    NEOX = "neox"  # pairs (i, i + n_rot/2): Qwen2, Qwen3, Gemma, unpermuted HF weights


@dataclass(frozen=True)
class NormMeta:
    eps: float
    width: int  # normalize every group of `width` consecutive values (n_embd, or head_dim for QK-norm)


@dataclass(frozen=True)
class MatmulMeta:
    # the matmul only ever runs in passes of whole sequences (an encoder's: no decode step whose rows must equal
    # these bit for bit), so a backend may give it a GEMM of its own
    whole_sequences: bool = False


@dataclass(frozen=True)
class ScaleMeta:
    factor: float  # float32 multiplier (Gemma's embedding scale sqrt(n_embd))


@dataclass(frozen=True)
class RopeMeta:
    n_head: int
    head_dim: int
    n_rot: int  # leading dims of each head that rotate (== head_dim for every model supported now)
    freq_base: float
    freq_scale: float
    style: RopeStyle
    # RoPE scaling (see minfer.models.rope_scaling): per-pair divisors of the base frequencies (Llama 3,
    # GGUF rope_freqs.weight); YaRN's ramp between scaled and unscaled frequencies over the pairs
    # corr_dims[0]..corr_dims[1] (ext_factor 0 = off); mscale multiplies cos and sin (YaRN's attention factor).
    freq_factors: tuple[float, ...] | None = None
    ext_factor: float = 0.0
    corr_dims: tuple[float, float] = (0.0, 0.0)
    mscale: float = 1.0


@dataclass(frozen=True)
class KVMeta:
    layer: int
    k_width: int  # n_head_kv * head_dim_k
    v_width: int  # n_head_kv * head_dim_v


@dataclass(frozen=True)
class AttnMeta:
    layer: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    scale: float
    window: int = 0  # sliding-window layers: token at position p reads positions p - window + 1 .. p; 0 = all
    softcap: float = 0.0  # scores become softcap * tanh(score / softcap) before the mask (Gemma 2); 0 = off


@dataclass(frozen=True)
class MoeMeta:
    layer: int
    n_expert: int
    n_used: int  # experts per token (top-k)
    normalize: bool  # the chosen experts' weights renormalized to sum to 1 (Mixtral, Qwen3-MoE's norm_topk_prob)


@dataclass(eq=False)
class Node:
    """One operation. ``inputs`` are other nodes; ``shape`` is the output's shape."""

    id: int
    op: Op
    inputs: tuple[Node, ...]
    shape: tuple[int, ...]
    dtype: str = "f32"
    meta: Any = None
    name: str = ""
    layer: int | None = None
    # for WEIGHT nodes, the model tensor; for INPUT nodes, the input's role ("tokens", "positions", ...)
    source: Any = field(default=None, repr=False)

    def label(self) -> str:
        return self.name or f"{self.op}#{self.id}"


@dataclass
class Graph:
    """Nodes in build order plus the named inputs and the output node. ``extras`` are further named
    results a caller reads after the run (e.g. the final-normed hidden states for embeddings): their
    buffers outlive the run like the output's, and fusion never folds them away."""

    nodes: list[Node]
    inputs: dict[str, Node]
    output: Node
    extras: dict[str, Node] = field(default_factory=dict)

    def compute_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.op not in (Op.INPUT, Op.WEIGHT)]

    def consumers(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i.id].append(n)
        return out


# storage for a plan's buffers: (part name, elements, dtype) -> a 1-D array of that many elements
Take = Callable[[str, int, Any], np.ndarray]


class ExpertReads:
    """What the mixture-of-experts kernels of one backend read: bytes of expert weights, and how many expert
    matrices (each read once per pass for all the tokens that chose it). Tests and ``minfer bench`` read it."""

    def __init__(self) -> None:
        self.bytes = 0
        self.experts = 0

    def reset(self) -> None:
        self.bytes = self.experts = 0


# a plan's step as the backend sees it when grouping: (node, its kernel, its output, its operands)
StepParts = tuple[Node, Callable[..., None], Any, tuple[Any, ...]]


class Backend(Protocol):
    """Everything the plan, the runner, the engine and the trace explorer ask of a backend (nothing is probed
    with getattr)."""

    compiler: KernelCompiler  # kernels compiled ahead of their first call, in announced batches
    expert_reads: ExpertReads

    def prepare_weight(self, tensor: Any) -> Any: ...

    def quantized_input(self, tensor: Any) -> bool:
        """Whether a matmul with this weight takes its activations quantized (a QUANTIZE node before it)."""

    def prepare_kernels(self, nodes: Sequence[Node], kv_layers: Sequence[Any] = ()) -> None:
        """Before a plan binds its kernels: compile (or load) those its nodes run."""

    def will_batch_sequences(self) -> None:
        """The engine will run batches mixing sequences (their attention may need kernels of its own)."""

    def kernel(self, node: Node) -> Callable[..., None]: ...

    def group_kernels(self, steps: Sequence[StepParts]) -> list[Callable[..., None]]:
        """The steps' kernels, where the backend runs some consecutive ones as one (see the CPU backend)."""

    def running(self, pass_key: Hashable | None = None) -> AbstractContextManager[Any]:
        """The context plans run in; ``pass_key``: the kind of pass (its sizes), where the backend adapts to it."""

    def buffer(self, node: Node, take: Take) -> Any: ...

    def rope(self, x: np.ndarray, positions: np.ndarray, meta: RopeMeta, out: np.ndarray) -> None:
        """RoPE outside a plan (a context shift re-rotates cached K rows)."""

    # What the trace explorer recomputes outside a plan, with this backend's own functions, so that the
    # trace layer never imports kernels (and a page's numbers are the engine's).

    def dequantize(self, tensor: Any) -> np.ndarray:
        """A weight tensor whole, as float32 in its numpy shape (small ones: a norm's gain)."""

    def float_matmul(self, x: np.ndarray, w: Any, out: np.ndarray) -> None:
        """``out = x @ W^T`` in float32 with ``W`` dequantized exactly and ``x`` as given (never rounded to
        quantized blocks): the logit lens's projection of a residual onto the vocabulary."""

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, meta: AttnMeta,
                  out: np.ndarray) -> None:
        """One sequence's attention outside a plan with this backend's attention kernel: ``q`` at
        ``positions`` against the float32 K/V rows ``k``, ``v`` for positions 0.. (a hand-made example)."""
