"""A decoder-only transformer loaded from a checkpoint (:mod:`minfer.models.tensor_source`: a GGUF file or a
Hugging Face folder): hyperparameters, architecture, tensors (under the engine's GGUF-style names) and the RoPE
pairing its weights need. Nothing here knows which format the checkpoint is."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.block_types import GGMLType
from minfer.formats.quants import SUPPORTED_TYPES, is_supported
from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import Graph, RopeStyle
from minfer.models.decoder import build_decoder_graph
from minfer.models.gemma3_vision import VisionModel
from minfer.models.hparams import GGUF_LAYER, check_hparams, check_layer_count, layer_indices
from minfer.models.lora import LoraAdapter, load_lora, merged_weight
from minfer.models.tensor_source import TensorSource, open_tensor_source

if TYPE_CHECKING:
    from minfer.formats.chat_template import ChatTemplate
    from minfer.formats.tokenizer import Tokenizer


class TransformerModel:
    """Weights stay in the checkpoint's memory map; nothing is copied at load time (unless quantized at load).

    ``source`` is the checkpoint (a :class:`~minfer.models.tensor_source.TensorSource`: a GGUF file or an
    HF folder); ``tensors`` maps engine names to its tensors, whatever the format.
    """

    def __init__(self, source: TensorSource) -> None:
        self.source = source
        self.arch = source.arch
        self.hparams = hparams = source.hparams
        self.path: Path = source.path
        self.tensors: dict[str, WeightTensor | ExpertTensors] = dict(source.tensors)
        if self.arch.split_fused is not None:
            self.tensors = self.arch.split_fused(self.tensors, hparams, self.describe_tensor)
        for name, t in self.tensors.items():  # GGUF's stacked expert tensors: one view per expert
            if isinstance(t, WeightTensor) and len(t.shape) == 3 and name.endswith("_exps.weight"):
                self.tensors[name] = ExpertTensors.from_stacked(t)
        self.quantized: str | None = None  # the load-time quantize type, if any
        # LoRA adapters the graph computes beside the matmuls, in id order (each row's scale is data), and
        # their A/B matrices as graph weights; merged adapters are in the weights themselves
        self.loras: list[LoraAdapter] = []
        self._lora_weights: dict[tuple[int, str], tuple[WeightTensor, WeightTensor]] = {}
        self.merged_loras: list[tuple[LoraAdapter, float]] = []
        self.output_tensor_name = "output.weight" if self.has_tensor("output.weight") else "token_embd.weight"
        # a vision-language checkpoint's vision tower and projector (models/gemma3_vision.py), else None
        self.vision: VisionModel | None = getattr(source, "vision", None)
        check_layer_count(hparams.n_layer, layer_indices(self.tensors, GGUF_LAYER), str(self.path),
                          source.field_name("n_layer"))
        check_hparams(hparams, str(self.path), source.field_name)
        self._validate()

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], quantize: str | None = None,
                  threads: int | None = None,
                  merge_loras: Sequence[tuple[str | os.PathLike[str], float]] = ()) -> TransformerModel:
        """A GGUF file or an HF model folder; ``quantize`` (``q8_0``/``q4_k``) quantizes float matrices at load,
        after ``merge_loras`` (adapter, scale) were added into the float weights."""
        model = cls(open_tensor_source(path))
        for adapter, scale in merge_loras:
            model.merge_lora(adapter, scale)
        if quantize is not None:
            model.quantize(quantize, threads=threads)
        return model

    def quantize(self, qtype: str, threads: int | None = None) -> None:
        """Quantize every float matrix to ``qtype`` (``q8_0`` or ``q4_k``) in memory, as
        :mod:`minfer.formats.quantize` describes; 1-D tensors (norms, biases) stay as they are, and each
        expert's matrix of a mixture of experts is quantized on its own."""
        from minfer.formats.quantize import quantize_tensor, quantize_type

        target = quantize_type(qtype)
        for name, t in self.tensors.items():
            if isinstance(t, ExpertTensors):
                self.tensors[name] = ExpertTensors(name, tuple(quantize_tensor(e, target, threads=threads)
                                                               for e in t.experts))
            elif len(t.shape) == 2:
                self.tensors[name] = quantize_tensor(t, target, threads=threads)
        self.quantized = qtype.lower()

    def add_lora(self, path: str | os.PathLike[str]) -> int:
        """Load a LoRA adapter (a GGUF adapter file or a PEFT folder) for the graph to apply; its id."""
        adapter = load_lora(path, self)
        k = len(self.loras)
        self.loras.append(adapter)
        for target, p in adapter.pairs.items():
            self._lora_weights[(k, target)] = (
                WeightTensor(f"{target}.lora_a[{k}]", GGMLType.F32, p.a.shape, p.a.view(np.uint8)),
                WeightTensor(f"{target}.lora_b[{k}]", GGMLType.F32, p.b.shape, p.b.view(np.uint8)),
            )
        return k

    def merge_lora(self, path: str | os.PathLike[str], scale: float = 1.0) -> LoraAdapter:
        """Add ``scale`` times a LoRA adapter's update into the (float) weights themselves: no cost per token,
        and no way to take it out again but reloading (``--lora-merge``)."""
        adapter = load_lora(path, self)
        if "output.weight" in adapter.pairs and self.tied_output:
            raise ModelError(f"--lora-merge: {path} adapts the output projection, which this model shares with its "
                             "token embeddings (tied): merged, it would change the embeddings too; leave it unmerged")
        for target, p in adapter.pairs.items():
            w = self.tensors[target]
            assert isinstance(w, WeightTensor)  # load_lora checked it is a matrix
            self.tensors[target] = merged_weight(w, p, scale)
        self.merged_loras.append((adapter, scale))
        return adapter

    def lora_weights(self, k: int, target: str) -> tuple[WeightTensor, WeightTensor] | None:
        """Adapter ``k``'s A and B for the matrix ``target`` as graph weights, if it adapts that matrix."""
        return self._lora_weights.get((k, target))

    # -- what the graph builder and the runtime read -------------------------------------------------

    def digest_weights(self, h: Any) -> None:
        """Feed ``h`` (a hashlib object) the identity of what cached K/V cells are computed with: the
        hyperparameters, every tensor's name, type and shape, and the LoRA adapters merged into the
        weights (their values, which the shapes miss). Applied adapters are the caller's to add."""
        h.update(json.dumps(vars(self.hparams), sort_keys=True, default=str).encode())
        for name, tensor in self.tensors.items():
            h.update(f"{name}:{tensor.ggml_type.name}:{tensor.shape}:{tensor.nbytes};".encode())
        for adapter, scale in self.merged_loras:
            h.update(f"merged:{adapter.path.name}:{scale!r};".encode())

    @property
    def rope_style(self) -> RopeStyle:
        """How this checkpoint's weights pair RoPE dimensions: the architecture's GGUF layout, or NEOX for
        HF weights, whose q/k rows were never permuted."""
        return self.source.rope_style or self.arch.rope_style

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> WeightTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    @property
    def tied_output(self) -> bool:
        return self.output_tensor_name == "token_embd.weight"

    def describe_tensor(self, name: str) -> str:
        """Where a tensor comes from, for errors: the file and the name it has there."""
        return self.source.describe_tensor(name)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        hp = self.hparams
        shapes = self.arch.global_tensor_shapes(hp)
        if not self.tied_output:
            shapes["output.weight"] = (hp.n_vocab, hp.n_embd)
        for il in range(hp.n_layer):
            shapes.update(self.arch.layer_tensor_shapes(hp, il))
        return shapes

    def _validate(self) -> None:
        hp = self.hparams
        if hp.n_expert:
            for name, t in self.tensors.items():
                if name.endswith(("_exps.weight", "ffn_gate_inp.weight")) and t.shape[0] != hp.n_expert:
                    raise ModelError(f"{self.describe_tensor(name)} holds {t.shape[0]} experts but "
                                     f"{self.source.expert_count_field()} is {hp.n_expert}")
        for name, shape in self.expected_shapes().items():
            t = self.tensors.get(name)
            if t is None:
                raise FormatError(f"{self.path}: missing tensor {self.source.stored_name(name)!r} "
                                  f"({self.arch.name}, shape {shape})")
            if t.shape != shape:
                raise ModelError(f"{self.describe_tensor(name)} has shape {t.shape}, expected {shape}")
            if not is_supported(t.ggml_type):
                supported = ", ".join(x.name for x in SUPPORTED_TYPES)
                raise ModelError(
                    f"{self.describe_tensor(name)} has type {t.ggml_type.name}, not supported yet "
                    f"(supported: {supported})"
                )

    def build_graph(self, n_tokens: int, n_outputs: int, n_ctx: int, hidden: bool = False) -> Graph:
        return build_decoder_graph(self, n_tokens, n_outputs, n_ctx, hidden)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # -- what comes with the weights: the source's ------------------------------------------------

    def load_tokenizer(self) -> Tokenizer:
        return self.source.load_tokenizer(self.hparams.n_vocab)

    def load_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        return self.source.load_chat_template(tokenizer)

    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults the checkpoint ships (HF ``generation_config.json``); empty for GGUF files."""
        return self.source.generation_defaults()

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The checkpoint's own description: GGUF metadata, or an HF folder's config.json."""
        return self.source.metadata

    @property
    def format_name(self) -> str:
        return self.source.format_name
