"""Run llama.cpp's own ``convert_hf_to_gguf.py`` (from the llama-cpp-python 0.3.36 sdist) on a tiny fixture folder,
with the two changes such folders need; the reference writer for fixtures that our own writer does not cover.

    /tmp/refenv/bin/python scripts/llama_cpp_convert.py --llama-cpp SDIST/vendor/llama.cpp \\
        FOLDER --outfile OUT.gguf --outtype f32 --model-name NAME

- ``get_vocab_base_pre`` returns "jina-v2-en": the converter hashes a tokenizer's output to name its
  pre-tokenizer and refuses a vocabulary it does not know (a fixture's tiny WordPiece); "jina-v2-en" is what it
  writes for all-MiniLM-L6-v2's WordPiece, and llama.cpp reads the key only for BPE vocabularies; ``--pre NAME``
  names another (``make_vision_gguf.py`` passes "default" for its tiny BPE vocabulary).
- ``load_hparams`` reads ``config.json`` as it is. With transformers 5.24 installed, ``AutoConfig`` knows
  ``nomic_bert`` and fills in ``NomicBertConfig``'s defaults (768 wide, 12 layers) beside the folder's own
  ``n_embd``/``n_layer`` fields, and the converter then writes the defaults into the file's metadata: a
  nomic-embed-text folder converted with transformers 5.24 gives a GGUF whose sizes are not its tensors'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the sdist's vendor/llama.cpp folder")
    ap.add_argument("--pre", default="jina-v2-en", help="the tokenizer.ggml.pre to write (default: jina-v2-en)")
    args, rest = ap.parse_known_args(argv)
    sys.path[:0] = [str(args.llama_cpp), str(args.llama_cpp / "gguf-py")]
    import conversion.base as base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: args.pre
    base.ModelBase.load_hparams = staticmethod(
        lambda folder, mistral=False, **_: json.loads((Path(folder) / "config.json").read_text()))
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", *rest]
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
