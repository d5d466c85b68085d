"""A decoder-only transformer loaded from a GGUF file: hyperparameters, architecture, tensors."""

from __future__ import annotations

import os
from pathlib import Path

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile, GGUFTensor
from minfer.formats.quants import SUPPORTED_TYPES, is_supported
from minfer.graph.ir import Graph
from minfer.models.architecture import Architecture
from minfer.models.decoder import build_decoder_graph
from minfer.models.hparams import HParams, hparams_from_gguf
from minfer.models.registry import get_architecture


class TransformerModel:
    """Weights stay in the file's memory map; nothing is copied at load time."""

    def __init__(self, gguf: GGUFFile, arch: Architecture, hparams: HParams) -> None:
        self.gguf = gguf
        self.arch = arch
        self.hparams = hparams
        self.path: Path = gguf.path
        self.output_tensor_name = "output.weight" if self.has_tensor("output.weight") else "token_embd.weight"
        self._validate()

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> TransformerModel:
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
        hparams = hparams_from_gguf(f, n_vocab)
        if arch.gguf_hparams is not None:
            hparams = arch.gguf_hparams(f, hparams)
        return cls(f, arch, hparams)

    def has_tensor(self, name: str) -> bool:
        return name in self.gguf.tensors

    def tensor(self, name: str) -> GGUFTensor:
        return self.gguf.tensor(name)

    @property
    def tied_output(self) -> bool:
        return self.output_tensor_name == "token_embd.weight"

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        hp = self.hparams
        shapes = self.arch.global_tensor_shapes(hp)
        if not self.tied_output:
            shapes["output.weight"] = (hp.n_vocab, hp.n_embd)
        for il in range(hp.n_layer):
            shapes.update(self.arch.layer_tensor_shapes(hp, il))
        return shapes

    def _validate(self) -> None:
        for name, shape in self.expected_shapes().items():
            t = self.gguf.tensors.get(name)
            if t is None:
                raise FormatError(f"{self.path}: missing tensor {name!r} ({self.arch.name}, shape {shape})")
            if t.shape != shape:
                raise ModelError(f"{self.path}: tensor {name!r} has shape {t.shape}, expected {shape}")
            if not is_supported(t.ggml_type):
                supported = ", ".join(x.name for x in SUPPORTED_TYPES)
                raise ModelError(
                    f"{self.path}: tensor {name!r} has type {t.ggml_type.name}, not supported yet "
                    f"(supported: {supported})"
                )

    def build_graph(self, n_tokens: int, n_outputs: int, n_ctx: int) -> Graph:
        return build_decoder_graph(self, n_tokens, n_outputs, n_ctx)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.gguf.tensors.values())
