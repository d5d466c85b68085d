"""A decoder-only transformer loaded from a GGUF file or a Hugging Face folder: hyperparameters,
architecture, tensors (under the engine's GGUF-style names) and the RoPE pairing its weights need."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile, GGUFTensor
from minfer.formats.quants import SUPPORTED_TYPES, is_supported
from minfer.graph.ir import Graph, RopeStyle
from minfer.models.architecture import Architecture
from minfer.models.decoder import build_decoder_graph
from minfer.models.hparams import HParams
from minfer.models.registry import get_architecture

if TYPE_CHECKING:
    from minfer.formats.chat_template import ChatTemplate
    from minfer.formats.tokenizer import Tokenizer
    from minfer.models.hf_checkpoint import HFCheckpoint


class TransformerModel:
    """Weights stay in the file's memory map; nothing is copied at load time (unless quantized at load).

    ``gguf`` is the GGUF file the model came from, ``hf`` the HF folder (one of them is None).
    ``tensors`` maps engine names to tensors either way.
    """

    def __init__(
        self,
        gguf: GGUFFile | None,
        arch: Architecture,
        hparams: HParams,
        *,
        hf: HFCheckpoint | None = None,
        rope_style: RopeStyle | None = None,
    ) -> None:
        if (gguf is None) == (hf is None):
            raise ValueError("TransformerModel needs exactly one of a GGUF file and an HF folder")
        self.gguf = gguf
        self.hf = hf
        self.arch = arch
        self.hparams = hparams
        self.path: Path = gguf.path if gguf is not None else hf.directory  # type: ignore[union-attr]
        self.tensors: dict[str, GGUFTensor] = dict(gguf.tensors if gguf is not None else hf.tensors)  # type: ignore[union-attr]
        self._rope_style = rope_style
        self.quantized: str | None = None  # the load-time quantize type, if any
        self.output_tensor_name = "output.weight" if self.has_tensor("output.weight") else "token_embd.weight"
        self._validate()

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], quantize: str | None = None,
                  threads: int | None = None) -> TransformerModel:
        """A GGUF file or an HF model folder; ``quantize`` (``q8_0``/``q4_k``) quantizes float matrices at load."""
        p = Path(path)
        model = cls.from_hf(p) if p.is_dir() else cls.from_gguf(p)
        if quantize is not None:
            model.quantize(quantize, threads=threads)
        return model

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
        return cls(f, arch, arch.hparams_from_gguf(f, n_vocab))

    @classmethod
    def from_hf(cls, directory: str | os.PathLike[str]) -> TransformerModel:
        """An HF folder (config.json + safetensors); see :mod:`minfer.models.hf_checkpoint`."""
        from minfer.models.hf_checkpoint import open_hf_folder

        ckpt = open_hf_folder(directory)
        return cls(None, ckpt.arch, ckpt.hparams, hf=ckpt, rope_style=ckpt.rope_style)

    def quantize(self, qtype: str, threads: int | None = None) -> None:
        """Quantize every float matrix to ``qtype`` (``q8_0`` or ``q4_k``) in memory, as
        :mod:`minfer.formats.quantize` describes; 1-D tensors (norms, biases) stay as they are."""
        from minfer.formats.quantize import quantize_tensor, quantize_type

        target = quantize_type(qtype)
        for name, t in self.tensors.items():
            if len(t.shape) == 2:
                self.tensors[name] = quantize_tensor(t, target, threads=threads)
        self.quantized = qtype.lower()

    # -- what the graph builder and the runtime read -------------------------------------------------

    @property
    def rope_style(self) -> RopeStyle:
        """How this checkpoint's weights pair RoPE dimensions: the architecture's GGUF layout, or NEOX for
        HF weights, whose q/k rows were never permuted."""
        return self._rope_style or self.arch.rope_style

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    @property
    def tied_output(self) -> bool:
        return self.output_tensor_name == "token_embd.weight"

    def describe_tensor(self, name: str) -> str:
        """Where a tensor comes from, for errors: the file and the name it has there."""
        if self.hf is not None:
            return self.hf.describe_tensor(name)
        return f"{self.path}: tensor {name!r}"

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
            t = self.tensors.get(name)
            if t is None:
                if self.hf is not None:
                    from minfer.models.hf_checkpoint import hf_tensor_name

                    raise FormatError(f"{self.path}: missing tensor {hf_tensor_name(self.hf.spec, name)!r} "
                                      f"({self.arch.name}, shape {shape})")
                raise FormatError(f"{self.path}: missing tensor {name!r} ({self.arch.name}, shape {shape})")
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

    # -- what comes with the weights ----------------------------------------------------------------

    def load_tokenizer(self) -> Tokenizer:
        if self.hf is not None:
            from minfer.formats.hf_tokenizer import load_hf_tokenizer

            h = self.hf
            return load_hf_tokenizer(h.directory, h.config, h.tokenizer_config, h.generation_config,
                                     n_model_vocab=self.hparams.n_vocab)
        from minfer.formats.tokenizer import Tokenizer

        assert self.gguf is not None
        return Tokenizer.from_gguf_metadata(self.gguf.metadata, source=str(self.path))

    def load_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        if self.hf is not None:
            from minfer.formats.hf_tokenizer import load_hf_chat_template

            return load_hf_chat_template(self.hf.directory, self.hf.tokenizer_config)
        from minfer.formats.chat_template import ChatTemplate

        assert self.gguf is not None
        return ChatTemplate.from_gguf_metadata(self.gguf.metadata, tokenizer)

    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults the checkpoint ships (HF ``generation_config.json``); empty for GGUF files."""
        if self.hf is None:
            return {}
        from minfer.formats.hf_tokenizer import generation_defaults

        return generation_defaults(self.hf.generation_config)

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The file's own description: GGUF metadata, or an HF folder's config.json."""
        if self.gguf is not None:
            return self.gguf.metadata
        assert self.hf is not None
        return self.hf.config

    @property
    def format_name(self) -> str:
        if self.gguf is not None:
            return f"GGUF v{self.gguf.version}"
        assert self.hf is not None
        n = len(self.hf.folder.files)
        shards = f", {n} shards ({self.hf.folder.index_path.name})" if self.hf.folder.sharded else ""  # type: ignore[union-attr]
        return f"HF safetensors folder{shards}"
