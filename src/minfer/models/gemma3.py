"""Gemma 3 (GGUF ``gemma3``, text only), laid out as llama.cpp runs it.

What differs from the llama recipe:

* token embeddings multiplied by sqrt(n_embd) (a float32 multiply, as llama.cpp's ``ggml_scale``);
* RMSNorm gains as stored: the GGUF converter already wrote ``1 + w`` for HF's ``w``;
* per-head RMSNorm of q and k before RoPE (as Qwen3); NEOX RoPE pairing (i, i + d/2);
* the attention output and the FFN output are each RMS-normalized (``post_attention_norm``,
  ``post_ffw_norm``) before they are added to the residual stream;
* the FFN gate goes through tanh-approximated GELU: ``down(gelu(gate(x)) * up(x))``;
* sliding-window layers: layer il is local iff il % 6 < 5 (llama.cpp's ``set_swa_pattern(6)``, HF's
  ``layer_types``); a local layer's query at position i sees keys i - W < j <= i
  (``gemma3.attention.sliding_window`` = W) and uses RoPE base 10000, scale 1; global layers see every
  earlier position with ``rope.freq_base`` and the file's RoPE scaling (linear x8 in the larger models);
* attention scale 1/sqrt(head_dim) (HF's ``query_pre_attn_scalar`` = head_dim), except for the 27B
  model (62 layers), where it is 1/sqrt(n_embd / n_head): the GGUF has no key for it and llama.cpp
  decides by layer count, so do we;
* the output matrix is the embedding table (tied); no final logit soft-capping in Gemma 3.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from minfer.errors import FormatError
from minfer.formats.gguf_file import GGUFFile
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture
from minfer.models.hparams import HParams

SWA_PATTERN = 6  # of every 6 layers the first 5 are sliding-window layers
ROPE_BASE_LOCAL = 10000.0
N_LAYER_27B = 62  # llama.cpp's LLM_TYPE_27B for gemma3, whose attention scale is 1/sqrt(n_embd / n_head)


def gemma3_layout(hp: HParams, sliding_window: int, source: str = "") -> HParams:
    """``hp`` completed with Gemma 3's sliding-window layout, local RoPE, attention and embedding scales.

    Shared by the GGUF reader below and any other loader that knows the window (``config.json``'s
    ``sliding_window``)."""
    if sliding_window < 1:
        where = f"{source}: " if source else ""
        raise FormatError(f"{where}gemma3 sliding window must be a positive number of positions, got {sliding_window}")
    if hp.n_layer == N_LAYER_27B:
        attn_scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head)
    else:
        attn_scale = 1.0 / math.sqrt(hp.head_dim_k)
    return dataclasses.replace(
        hp,
        attn_scale=attn_scale,
        sliding_window=sliding_window,
        swa_layers=tuple(il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(hp.n_layer)),
        rope_freq_base_swa=ROPE_BASE_LOCAL,
        rope_freq_scale_swa=1.0,
        embd_scale=float(np.float32(math.sqrt(hp.n_embd))),
    )


def gemma3_gguf_hparams(f: GGUFFile, hp: HParams) -> HParams:
    key = f"{f.architecture}.attention.sliding_window"
    return gemma3_layout(hp, int(f.require(key, int)), f"{f.path}: {key}")


ARCH = Architecture(
    name="gemma3",
    rope_style=RopeStyle.NEOX,
    qk_norm=True,
    post_norms=True,
    ffn_act="gelu",
    gguf_hparams=gemma3_gguf_hparams,
)
