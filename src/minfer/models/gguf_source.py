"""A GGUF file as a :class:`~minfer.models.tensor_source.TensorSource`: its tensors already carry the
engine's names, its metadata the hyperparameters, the tokenizer and the chat template."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.errors import ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture
from minfer.models.hparams import HParams, gguf_field_name
from minfer.models.registry import get_architecture

if TYPE_CHECKING:
    from minfer.formats.chat_template import ChatTemplate
    from minfer.formats.tokenizer import Tokenizer


class GGUFSource:
    """One GGUF file, memory-mapped; nothing is copied."""

    file: GGUFFile
    path: Path
    arch: Architecture
    hparams: HParams
    tensors: Mapping[str, WeightTensor | ExpertTensors]
    metadata_title = "metadata"
    chat_template_field = "tokenizer.chat_template"
    rope_style: RopeStyle | None = None  # the converter stored q/k rows in the architecture's own layout

    def __init__(self, file: GGUFFile, arch: Architecture, hparams: HParams) -> None:
        self.file = file
        self.path = file.path
        self.arch = arch
        self.hparams = hparams
        self.tensors = file.tensors

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFSource:
        f = GGUFFile(path)
        arch = get_architecture(f.architecture, str(f.path))
        embd = f.tensor("token_embd.weight")
        if len(embd.shape) != 2:
            raise ModelError(f"{f.path}: tensor 'token_embd.weight' has shape {embd.shape}, expected 2-D")
        n_vocab = embd.shape[0]
        declared = f.get(f"{arch.name}.vocab_size")
        if declared is not None and int(declared) != n_vocab:
            raise ModelError(
                f"{f.path}: {arch.name}.vocab_size is {declared} but token_embd.weight has {n_vocab} rows"
            )
        return cls(f, arch, arch.hparams_from_gguf(f, n_vocab))

    @property
    def format_name(self) -> str:
        return f"GGUF v{self.file.version}"

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.file.metadata

    def shown_metadata(self) -> Mapping[str, Any]:
        return self.file.summary_metadata()

    def field_name(self, field: str) -> str:
        return gguf_field_name(field)

    def describe_tensor(self, name: str) -> str:
        return f"{self.path}: tensor {name!r}"

    def stored_name(self, name: str) -> str:
        return name

    def expert_count_field(self) -> str:
        return f"{self.arch.name}.expert_count"

    def load_tokenizer(self, n_vocab: int) -> Tokenizer:
        from minfer.formats.tokenizer import Tokenizer

        return Tokenizer.from_gguf_metadata(self.file.metadata, source=str(self.path))

    def load_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        from minfer.formats.chat_template import ChatTemplate

        return ChatTemplate.from_gguf_metadata(self.file.metadata, tokenizer)

    def generation_defaults(self) -> dict[str, Any]:
        return {}  # GGUF carries no sampling defaults

    def pooling_type(self) -> int | None:
        raw = self.file.metadata.get(f"{self.arch.name}.pooling_type")
        return None if raw is None else int(raw)

    def vocab_summary(self) -> dict[str, Any]:
        md = self.file.metadata
        kind = md.get("tokenizer.ggml.model")
        names = {"gpt2": "gpt2 BPE (byte-level)", "llama": "SentencePiece (llama)"}
        text = names.get(kind, str(kind)) if kind is not None else "none (no tokenizer.ggml.model)"
        pre = md.get("tokenizer.ggml.pre")
        tokens = md.get("tokenizer.ggml.tokens")
        return {"type": text + (f", pre {pre!r}" if pre else ""), "size": len(tokens) if tokens else None,
                "bos_id": md.get("tokenizer.ggml.bos_token_id"), "eos_id": md.get("tokenizer.ggml.eos_token_id"),
                "add_bos": md.get("tokenizer.ggml.add_bos_token")}

    def source_summary(self) -> dict[str, Any]:
        return {"format": self.format_name}
