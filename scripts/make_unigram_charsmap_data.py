"""Write ``tests/data/unigram_charsmap.json``: a small SentencePiece Unigram model trained by the ``sentencepiece``
library itself with a custom normalisation rule set (its pieces, scores, the ``precompiled_charsmap`` that
SentencePiece compiles from the rules, base64) and SentencePiece's own ids for a list of texts (``add_dummy_prefix``
and ``remove_extra_whitespaces`` on, SentencePiece's defaults). ``tests/test_encoder_unigram_gguf.py`` rebuilds a
GGUF "t5" vocabulary from it: a real charsmap (XLM-R's nmt_nfkc one is 240 kB; this one 1153 bytes) for the
``Precompiled`` normaliser path. Run in the reference environment (sentencepiece 0.2.3, no protobuf needed):

    /opt/refenv/bin/python scripts/make_unigram_charsmap_data.py --out tests/data/unigram_charsmap.json
"""

from __future__ import annotations

import argparse
import base64
import json
import tempfile
from pathlib import Path

# source code points -> target code points (hex), SentencePiece's normalization_rule_tsv format
RULES = ([(f"{0xFF21 + i:X}", f"{0x41 + i:X}") for i in range(26)]  # full-width A-Z -> A-Z
         + [(f"{0xFF41 + i:X}", f"{0x61 + i:X}") for i in range(26)]  # full-width a-z -> a-z
         + [("FB01", "66 69"), ("FB02", "66 6C"), ("3000", "20"), ("A0", "20"), ("9", "20"), ("A", "20"),
            ("2026", "2E 2E 2E"), ("2019", "27"), ("65 301", "E9"), ("41 300", "C0"), ("200B", "")])
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Café crème brûlée for Zoë and Chloé.",
          "Financial flows, fiscal filings and floor fittings.", "Tokyo 東京 and Beijing 北京 are cities.",
          "It's the user's own file... isn't it?", "hello world, hello there, hello again",
          "Numbers 12345 and 67890 and 3.14159", "ＦＵＬＬ width ｔｅｘｔ here", "emoji 😀 and more text"] * 20
TEXTS = ["ＦＵＬＬ ｗｉｄｔｈ text", "the ﬁrst ﬂoor", "tab\there\nnewline", "ideo\u3000space and\u00a0nbsp",
         "wait\u2026 it\u2019s fine", "cafe\u0301 and A\u0300 composed", "zero\u200bwidth", "plain words only",
         "  leading and   repeated   spaces  ", "東京 😀 unknown ☃ chars", "", "   "]


def main() -> None:
    import sentencepiece as spm

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "corpus.txt").write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
        (t / "rules.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in RULES), encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(t / "corpus.txt"), model_prefix=str(t / "m"), vocab_size=120,
                                       model_type="unigram", normalization_rule_tsv=str(t / "rules.tsv"),
                                       character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
        proc = spm.SentencePieceProcessor(model_file=str(t / "m.model"))
        charsmap = normalizer_charsmap((t / "m.model").read_bytes())
        pieces = [(proc.id_to_piece(i), proc.get_score(i)) for i in range(proc.get_piece_size())]
        kinds = ["unknown" if proc.is_unknown(i) else "control" if proc.is_control(i) else "normal"
                 for i in range(proc.get_piece_size())]
        ids = [proc.encode(x) for x in TEXTS]  # add_dummy_prefix and remove_extra_whitespaces on (the defaults)
    args.out.write_text(json.dumps({"pieces": pieces, "kinds": kinds, "charsmap": base64.b64encode(charsmap).decode(),
                                    "texts": TEXTS, "sentencepiece_ids": ids}, ensure_ascii=False, indent=0)
                        + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(pieces)} pieces, charsmap {len(charsmap)} bytes")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message; value: int or bytes."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield field, wire, value


def normalizer_charsmap(model: bytes) -> bytes:
    """ModelProto.normalizer_spec (field 3).precompiled_charsmap (field 2), read without protobuf."""
    for field, _, value in _fields(model):
        if field == 3:
            for f2, _, v2 in _fields(value):
                if f2 == 2:
                    return bytes(v2)
    raise ValueError("no precompiled_charsmap in the model")


if __name__ == "__main__":
    main()
