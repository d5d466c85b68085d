"""llama.cpp's names of a file's type and vocabulary, as its server reports them (``/props``, ``/v1/models``)."""

from __future__ import annotations

import pytest

from minfer.formats.file_types import ftype_name, ollama_quantization, vocab_type


def test_file_type_names_are_llama_cpps():
    assert ftype_name({"general.file_type": 15}) == "Q4_K - Medium"
    assert ftype_name({"general.file_type": 3}) == "Q4_1"
    assert ftype_name({"general.file_type": 0}) == "all F32"
    assert ftype_name({"general.file_type": 30}) == "IQ4_XS - 4.25 bpw"


def test_a_file_without_its_type_is_named_by_most_of_its_bytes_guessed():
    matrices = [("Q8_0", 100), ("F32", 60), ("F32", 50)]
    assert ftype_name({}, matrices) == "all F32 (guessed)"
    assert ftype_name({"general.file_type": 999}, [("Q8_0", 100)]) == "Q8_0 (guessed)"
    assert ftype_name({}) == "unknown, may not work"


def test_vocab_types_are_llama_cpps_enum():
    assert [vocab_type(m) for m in ("llama", "gpt2", "bert", "t5", None, "other")] == [1, 2, 3, 4, 0, 0]


@pytest.mark.parametrize("file_type,expected", [
    (15, "Q4_K_M"), (14, "Q4_K_S"), (17, "Q5_K_M"), (12, "Q3_K_M"), (13, "Q3_K_L"), (7, "Q8_0"), (3, "Q4_1"),
    (18, "Q6_K"), (10, "Q2_K"), (21, "Q2_K_S"), (0, "F32"), (1, "F16"), (32, "BF16"), (30, "IQ4_XS"),
    (25, "IQ4_NL"), (38, "MXFP4"), (None, None), (999, None)])
def test_ollama_s_quantization_level_is_the_file_type_s_short_name(file_type, expected):
    metadata = {} if file_type is None else {"general.file_type": file_type}
    assert ollama_quantization(metadata) == expected
