"""What a checkpoint gives the model, whatever its format: one interface that a GGUF file
(:class:`~minfer.models.gguf_source.GGUFSource`) and an HF folder
(:class:`~minfer.models.hf_checkpoint.HFCheckpoint`) each implement.

The model (:mod:`minfer.models.model`) reads only this, so adding a format means one new module that
implements it and one line in :func:`open_tensor_source`; nothing above it branches on the format.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture
from minfer.models.hparams import HParams

if TYPE_CHECKING:
    from minfer.formats.chat_template import ChatTemplate
    from minfer.formats.tokenizer import Tokenizer


class TensorSource(Protocol):
    """A checkpoint opened for the engine: its architecture, hyperparameters and tensors under the engine's
    GGUF-style names (``blk.0.attn_q.weight``), and what ships beside the weights."""

    path: Path  # the file or folder, as the user named it
    arch: Architecture
    hparams: HParams
    tensors: Mapping[str, WeightTensor | ExpertTensors]  # engine names

    @property
    def rope_style(self) -> RopeStyle | None:
        """How the stored weights pair RoPE dimensions; None: as the architecture's GGUF layout does."""

    @property
    def format_name(self) -> str:
        """The format as ``minfer inspect`` names it (``GGUF v3``, ``HF safetensors folder``)."""

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The checkpoint's own description: GGUF metadata, or an HF folder's config.json."""

    @property
    def metadata_title(self) -> str:
        """What that description is called to a user (``metadata``, ``config.json``)."""

    def shown_metadata(self) -> Mapping[str, Any]:
        """The description as ``minfer inspect`` lists it (long lists shortened)."""

    def field_name(self, field: str) -> str:
        """The name a hyperparameter has in this format (``n_layer``: ``block_count`` / ``num_hidden_layers``)."""

    def describe_tensor(self, name: str) -> str:
        """Where an engine tensor comes from, for errors: its file and the name it has there."""

    def stored_name(self, name: str) -> str:
        """The name an engine tensor has in the checkpoint (the same for GGUF)."""

    def expert_count_field(self) -> str:
        """Where the number of experts is declared, for errors."""

    @property
    def chat_template_field(self) -> str:
        """Where a chat template would be, for the error when there is none."""

    def load_tokenizer(self, n_vocab: int) -> Tokenizer: ...

    def load_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None: ...

    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults the checkpoint ships (HF ``generation_config.json``); empty where it ships none."""

    def pooling_type(self) -> int | None:
        """The llama.cpp pooling type the checkpoint declares (GGUF ``<arch>.pooling_type``); None where it
        declares none."""

    def vocab_summary(self) -> dict[str, Any]:
        """The tokenizer as ``minfer inspect`` describes it: type, size, BOS/EOS ids, whether BOS is added."""

    def source_summary(self) -> dict[str, Any]:
        """The format and what only this format knows (an HF folder's model_type and files), for inspect."""


def open_tensor_source(path: str | os.PathLike[str]) -> TensorSource:
    """The checkpoint at ``path``: an HF folder when it is a folder, else a GGUF file."""
    p = Path(path)
    if p.is_dir():
        from minfer.models.hf_checkpoint import open_hf_folder

        return open_hf_folder(p)
    from minfer.models.gguf_source import GGUFSource

    return GGUFSource.open(p)
