"""The decoder layer recipe of every architecture here, emitted as a compute graph; what differs between
families are the flags their modules declare (:class:`~minfer.models.architecture.Architecture`).

    x = embed(tokens) * embd_scale                             (Gemma: sqrt(n_embd); Granite: its multiplier)
    per layer:  h = x + r * post_n(W_o · attn(rope(norm_qk(W_q·n(x))), rope(norm_qk(W_k·n(x))), W_v·n(x)))
                x = h + r * post_n(ffn(n(h)))
    logits = softcap(W_out · n(x[output rows]) / logit_scale)

``ffn`` is ``W_down · (act(W_gate·y) * W_up·y)``, or with experts (``hp.n_expert`` > 0: Mixtral, Qwen3-MoE)
the router's chosen experts' SwiGLU FFNs summed by their weights. ``r`` is Granite's residual multiplier
(1 elsewhere), ``softcap`` Gemma 2's final soft-capping (none elsewhere); attention scores may be
soft-capped too (``hp.attn_softcap``).

``n`` is the pre-norm (``pre_norms``; OLMo 2 has none: n(x) = x), ``norm_qk`` the RMSNorm of q and of k
(``qk_norm``: per head, or over the whole q and k width), ``post_n`` the norm of the attention output and
of the FFN output before each residual add (``post_norms``), ``act`` SiLU or tanh GELU (``ffn_act``).
Sliding-window layers attend to the last ``hp.sliding_window`` positions with their own RoPE base
(``hp.layer_window(il)``, ``hp.layer_rope(il)``).

Positions are an input, and so are the KV cache rows the tokens' K/V land in: the same graph serves
prefill, decode, continuation and several sequences in one batch. Only the rows named by
the ``output_rows`` input reach the output matmul (the last layer's FFN runs on them alone too, unless
the pass also wants every row's final-normed hidden state for embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from minfer.formats.tensors import WeightTensor
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import AttnMeta, Graph, KVMeta, MoeMeta, Node, RopeStyle
from minfer.models.architecture import Architecture
from minfer.models.hparams import HParams
from minfer.models.lora import LoraAdapter
from minfer.models.rope_scaling import layer_rope_meta


class DecoderWeights(Protocol):
    """What the recipe reads of a loaded model (a :class:`minfer.models.model.TransformerModel`)."""

    @property
    def arch(self) -> Architecture: ...

    @property
    def hparams(self) -> HParams: ...

    @property
    def rope_style(self) -> RopeStyle: ...

    @property
    def output_tensor_name(self) -> str: ...

    def tensor(self, name: str) -> WeightTensor: ...

    def has_tensor(self, name: str) -> bool: ...

    @property
    def loras(self) -> Sequence[LoraAdapter]: ...

    def lora_weights(self, k: int, target: str) -> tuple[WeightTensor, WeightTensor] | None: ...

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision model whose image tokens replace prompt rows' embeddings."""


# over 80 lines on purpose: the layer recipe in one place, in the order the graph runs it, each family
# flag's branch beside its neighbours
def build_decoder_graph(
    model: DecoderWeights, n_tokens: int, n_outputs: int, n_ctx: int, hidden: bool = False
) -> Graph:
    """The forward pass of ``n_tokens`` tokens into a cache of ``n_ctx`` positions, with the logits of
    ``n_outputs`` rows.

    ``hidden``: every token's final-normed hidden state (the output norm's result, before the output
    matmul) is kept as the graph's ``"hidden"`` extra, ``[n_tokens, n_embd]`` (embeddings pool it); the
    last layer then runs on every row, and ``n_outputs`` may be 0 (no logits: the output is the hidden
    states themselves)."""
    hp, arch = model.hparams, model.arch
    if n_outputs < (0 if hidden else 1) or n_outputs > n_tokens:
        raise ValueError(f"{n_outputs} output rows for {n_tokens} tokens")
    b = GraphBuilder()
    w = lambda name: b.weight(model.tensor(name))  # noqa: E731
    tokens = b.input("tokens", n_tokens)
    positions = b.input("positions", n_tokens)
    rows = b.input("rows", n_tokens)  # each token's KV cache row (its sequence's base + its position)
    out_rows = b.input("output_rows", n_outputs) if 0 < n_outputs != n_tokens else None
    # each loaded LoRA adapter's scale for each row (0: the row's sequence does not use it)
    lora_scales = [b.input(f"lora_scale.{k}", n_tokens, "f32") for k in range(len(model.loras))]

    def output_lora_scales() -> list[Node]:
        """The adapter scales of the output rows alone, for the matmuls after the rows are selected."""
        return [b.input(f"lora_scale.{k}.output_rows", n_outputs, "f32") for k in range(len(model.loras))]
    eps = hp.rms_eps

    def norm(x: Node, gain: str, name: str, layer: int | None, width: int | None = None) -> Node:
        return b.mul(b.rms_norm(x, eps, width, name=name, layer=layer), w(gain), name=name + ".gain", layer=layer)

    def biased(y: Node, p: str, which: str, il: int) -> Node:
        bias = f"{p}attn_{which}.bias"
        if model.has_tensor(bias):
            y = b.add(y, w(bias), name=f"{p}{which}.bias", layer=il)
        return y

    def adapted(y: Node, x: Node, weight: str, layer: int | None) -> Node:
        """The matmul ``y = W·x`` plus the update of every loaded adapter of ``W`` (after its bias, as PEFT)."""
        for k, adapter in enumerate(model.loras):
            ab = model.lora_weights(k, weight)
            if ab is not None:
                y = b.lora(y, x, b.weight(ab[0]), b.weight(ab[1]), lora_scales[k], adapter.pairs[weight].scale,
                           name=f"{y.name}.lora[{k}]", layer=layer)
        return y

    x = b.get_rows(w("token_embd.weight"), tokens, name="embd")
    if hp.embd_scale != 1.0:
        x = b.scale(x, hp.embd_scale, name="embd.scale")
    key_ends = None
    if model.takes_images:
        # an image's rows take its tokens from the vision model (x * 0 + image), every other row keeps its token's
        # embedding (x * 1 + 0: the same bits); an image's rows attend to each other both ways: each row's last
        # visible key position is data (key_ends), its own position on a text row
        x = b.add(b.mul(x, b.input("embd_keep", n_tokens, "f32", width=hp.n_embd), name="embd.text_rows"),
                  b.input("embd_image", n_tokens, "f32", width=hp.n_embd), name="embd.image_rows")
        key_ends = b.input("key_ends", n_tokens)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = norm(x, p + "attn_norm.weight", p + "attn_norm", il) if arch.pre_norms else x
        # the three matmuls before any bias: consecutive steps reading one input, which the CPU backend runs
        # as one parallel loop (Qwen2's biases between them kept them three)
        q, k, v = (b.matmul(h, w(f"{p}attn_{c}.weight"), name=f"{p}{c}", layer=il) for c in "qkv")
        q, k, v = (adapted(biased(y, p, c, il), h, f"{p}attn_{c}.weight", il) for y, c in zip((q, k, v), "qkv",
                                                                                               strict=True))
        if arch.qk_norm is not None:
            q = norm(q, p + "attn_q_norm.weight", p + "q_norm", il, width=arch.qk_norm_width(hp))
            k = norm(k, p + "attn_k_norm.weight", p + "k_norm", il, width=arch.qk_norm_width(hp))
        q_rope = layer_rope_meta(hp, model.rope_style, hp.n_head, il, n_ctx)
        k_rope = layer_rope_meta(hp, model.rope_style, hp.n_head_kv, il, n_ctx)
        q = b.rope(q, positions, q_rope, name=p + "q_rope", layer=il)
        k = b.rope(k, positions, k_rope, name=p + "k_rope", layer=il)
        store = b.kv_store(k, v, rows, KVMeta(il, hp.k_width, hp.v_width), n_ctx, name=p + "kv_store")
        kv = b.kv_load(store, name=p + "kv_load")
        attn_meta = AttnMeta(
            il, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.head_dim_v, hp.attn_scale, hp.layer_window(il),
            hp.attn_softcap,
        )
        a = b.attn(q, kv, positions, rows, attn_meta, name=p + "attn", key_ends=key_ends)
        o = adapted(b.matmul(a, w(p + "attn_output.weight"), name=p + "attn_out", layer=il), a,
                    p + "attn_output.weight", il)
        if out_rows is not None and not hidden and il == hp.n_layer - 1:
            # from here on only the rows whose logits are wanted matter
            o = b.get_rows(o, out_rows, name=p + "attn_out.rows")
            x = b.get_rows(x, out_rows, name=p + "residual.rows")
            lora_scales[:] = output_lora_scales()
        if arch.post_norms:
            o = norm(o, p + "post_attention_norm.weight", p + "post_attn_norm", il)
        if hp.residual_scale != 1.0:
            o = b.scale(o, hp.residual_scale, name=p + "attn_out.residual_scale", layer=il)
        x = b.add(x, o, name=p + "attn_residual", layer=il)
        h = norm(x, p + "ffn_norm.weight", p + "ffn_norm", il) if arch.pre_norms else x
        if hp.n_expert:
            down = moe_ffn(b, w, h, p, il, hp)
        else:
            gate = b.matmul(h, w(p + "ffn_gate.weight"), name=p + "ffn_gate", layer=il)
            up = b.matmul(h, w(p + "ffn_up.weight"), name=p + "ffn_up", layer=il)
            gate, up = adapted(gate, h, p + "ffn_gate.weight", il), adapted(up, h, p + "ffn_up.weight", il)
            if arch.ffn_act == "gelu":
                gated = b.gelu(gate, name=p + "ffn_gelu", layer=il)
            else:
                gated = b.silu(gate, name=p + "ffn_silu", layer=il)
            act = b.mul(gated, up, name=p + "ffn_act", layer=il)
            down = adapted(b.matmul(act, w(p + "ffn_down.weight"), name=p + "ffn_down", layer=il), act,
                           p + "ffn_down.weight", il)
        if arch.post_norms:
            down = norm(down, p + "post_ffw_norm.weight", p + "post_ffw_norm", il)
        if hp.residual_scale != 1.0:
            down = b.scale(down, hp.residual_scale, name=p + "ffn_out.residual_scale", layer=il)
        x = b.add(x, down, name=p + "ffn_residual", layer=il)
    x = norm(x, "output_norm.weight", "output_norm", None)
    if not hidden:
        return b.build(_logits(b, w, x, model, hp, adapted))
    if n_outputs == 0:
        return b.build(x, {"hidden": x})
    rows = x
    if out_rows is not None:
        rows = b.get_rows(x, out_rows, name="output_norm.rows")
        lora_scales[:] = output_lora_scales()
    return b.build(_logits(b, w, rows, model, hp, adapted), {"hidden": x})


def _logits(b: GraphBuilder, w, x: Node, model: DecoderWeights, hp: HParams, adapted) -> Node:
    """The output matmul, then Granite's logit scale and Gemma 2's soft-capping where the model has them."""
    # an adapter of the output projection is filed under output.weight, tied to the embeddings or not
    logits = adapted(b.matmul(x, w(model.output_tensor_name), name="output"), x, "output.weight", None)
    if hp.logit_scale != 1.0:
        logits = b.scale(logits, 1.0 / hp.logit_scale, name="output.logit_scale")
    if hp.final_softcap > 0:
        logits = b.softcap(logits, hp.final_softcap, name="output.softcap")
    return logits


def moe_ffn(b: GraphBuilder, w, h: Node, p: str, il: int, hp: HParams) -> Node:
    """The mixture-of-experts FFN: router logits, the chosen experts and their weights (a node of its own, so
    the trace shows the routing), then the experts' weighted sum."""
    meta = MoeMeta(il, hp.n_expert, hp.n_expert_used, hp.expert_weights_norm)
    logits = b.matmul(h, w(p + "ffn_gate_inp.weight"), name=p + "ffn_router", layer=il)
    route = b.moe_route(logits, meta, name=p + "ffn_route")
    shared = None
    if hp.n_ff_shexp:  # Qwen2-MoE's shared expert, gated per token
        shared = tuple(w(f"{p}ffn_{k}_shexp.weight") for k in ("gate", "up", "down", "gate_inp"))
    return b.moe_experts(h, route, w(p + "ffn_gate_exps.weight"), w(p + "ffn_up_exps.weight"),
                         w(p + "ffn_down_exps.weight"), meta, name=p + "ffn_moe", shared=shared)
