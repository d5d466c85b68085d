"""llama.cpp's names for what a GGUF file holds, as its server reports them: the file type (``general.file_type``,
``llama_ftype_name``) and the vocabulary type (``tokenizer.ggml.model`` as ``enum llama_vocab_type``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

# enum llama_ftype -> llama_ftype_name (llama.cpp src/llama-model-loader.cpp)
FTYPE_NAMES: dict[int, str] = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small", 22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw", 28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw", 32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary", 37: "TQ2_0 - 2.06 bpw ternary", 38: "MXFP4 MoE", 39: "NVFP4", 40: "Q1_0",
    41: "Q2_0",
}

# tokenizer.ggml.model -> enum llama_vocab_type (llama.cpp include/llama.h)
VOCAB_TYPES: dict[str, int] = {"no_vocab": 0, "none": 0, "llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5,
                               "plamo2": 6}


def ftype_name(metadata: Mapping[str, Any], tensor_types: Iterable[tuple[str, int]] = ()) -> str:
    """llama.cpp's name of the file's type. A file without ``general.file_type`` (an HF folder's weights, say) is
    named as llama.cpp names a guessed one: the type of most of its matrices' bytes, ``" (guessed)"`` after it.
    ``tensor_types``: (GGML type name, bytes) of each matrix."""
    value = metadata.get("general.file_type")
    if isinstance(value, int) and value in FTYPE_NAMES:
        return FTYPE_NAMES[value]
    by_type: Counter[str] = Counter()
    for name, nbytes in tensor_types:
        by_type[name] += nbytes
    if not by_type:
        return "unknown, may not work"
    main = by_type.most_common(1)[0][0]
    return f"{'all F32' if main == 'F32' else main} (guessed)"


def ollama_quantization(metadata: Mapping[str, Any]) -> str | None:
    """ollama's short name of the file's type (its ``quantization_level``: ``Q4_K_M``, ``Q8_0``, ``IQ4_XS``),
    from ``general.file_type``; None for a file without one."""
    value = metadata.get("general.file_type")
    if not isinstance(value, int) or value not in FTYPE_NAMES:
        return None
    if value == 10:  # llama.cpp's "Q2_K - Medium" is ollama's plain Q2_K
        return "Q2_K"
    base, _, size = FTYPE_NAMES[value].partition(" - ")
    if size in ("Small", "Medium", "Large"):
        return f"{base}_{size[0]}"
    return base.removeprefix("all ").split()[0]


def vocab_type(tokenizer_model: str | None) -> int:
    """``enum llama_vocab_type`` of a ``tokenizer.ggml.model`` name (0, none, for one llama.cpp does not know)."""
    return VOCAB_TYPES.get(tokenizer_model or "none", 0)
