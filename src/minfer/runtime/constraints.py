"""Constrained decoding: a GBNF grammar or a JSON Schema, applied as a mask over the next token's logits.

The grammar work is done by `llguidance <https://github.com/guidance-ai/llguidance>`_ (Rust, on PyPI as
``llguidance``): it compiles GBNF (through its own GBNF -> Lark converter), Lark and JSON Schema into
an Earley parser over a lexer, and computes, for each step, the set of vocabulary entries whose bytes
keep the output a prefix of some sentence of the grammar. We measured it against xgrammar on SmolLM2's
49152-token vocabulary (``bench/constraint_bench.py``): both kept every random walk valid, and both
compute a mask in tens of microseconds (xgrammar about twice as fast on an arithmetic GBNF grammar, the
same on JSON Schema), which is small beside applying the mask to the logits (~40 us) and nothing beside
a decode step. xgrammar cannot be imported without torch and transformers, which this project does
not depend on; llguidance is one self-contained wheel.

Where llguidance departs from llama.cpp's own GBNF engine (the same as llama.cpp built with
llguidance, which converts GBNF the same way):

* it lexes: a GBNF rule made only of literals and character classes becomes one lexeme (a regex), and
  a repeated class directly followed by text the class also matches (``[0-9]+ "1"``,
  ``[a-z]+ "ing"``) can refuse strings llama.cpp accepts ("11", "singing"), or make the grammar
  unsatisfiable. Ordinary grammars (JSON, lists, expressions, chess moves) are not affected;
* where the grammar forces the next bytes it allows only the tokens of their canonical tokenization
  (``{"`` rather than ``{`` then ``"``), so the model stays on token sequences it was trained on;
* JSON strings exclude a raw DEL and the ``\\/`` escape, and ``\\u`` escapes only for control
  characters: all valid JSON, a little stricter than the spec;
* rules named ``start``, or names equal after its case folding (``fooBar`` and ``foo_bar``), are
  refused with an error.

One :class:`Constraint` follows one generated sequence. Per decode step the generation loop calls
:meth:`Constraint.mask_logits` before sampling and :meth:`Constraint.accept` with the sampled token;
when :meth:`Constraint.is_finished` says nothing may follow, the mask already allows only the
end-of-generation tokens. Grammar and schema mistakes are :class:`~minfer.errors.BadRequestError`\\ s
whose one-line message starts with the parameter's name (``grammar: ...``, ``json_schema: ...``).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any, Literal, Protocol

import llguidance
import numpy as np
from llguidance import gbnf_to_lark as _gbnf
from tokenizers import Tokenizer as HFTokenizer

from minfer.errors import BadRequestError, ModelError

__all__ = ["Constraint", "TokenizerVocab", "JSON_WHITESPACE", "apply_bitmask"]

Param = Literal["grammar", "json_schema", "tools"]


class TokenizerVocab(Protocol):
    """What a constraint needs from a tokenizer; :class:`minfer.formats.tokenizer.Tokenizer` has it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eog_ids(self) -> frozenset[int]: ...

    @property
    def backend(self) -> HFTokenizer: ...


# JSON whitespace as llama.cpp's json-schema-to-grammar allows it (one space, or one or two newlines and
# up to 20 spaces/tabs of indentation) rather than llguidance's default of any amount: small models
# otherwise can fall into emitting whitespace until they run out of tokens. llguidance matches this
# regex at most once at each place JSON allows whitespace, so the bounds hold. A schema may override it
# with llguidance's top-level "x-guidance" options.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})"
_JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": JSON_WHITESPACE}

# llguidance's default limits, but with one-line error messages: the verbose ones dump the parser state
# and the whole grammar, which is no message for a user (nor for a log line).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

_MASK_CACHE_SIZE = 32  # compiled grammars kept per vocabulary (a server sees the same schema repeatedly)


class _Compiled:
    """llguidance's view of one vocabulary, and the grammars already compiled against it."""

    def __init__(self, vocab: TokenizerVocab) -> None:
        n_vocab = int(vocab.vocab_size)
        eog = sorted(int(i) for i in vocab.eog_ids)
        if not eog:
            # Without an end token a finished grammar could never end the generation.
            raise ModelError("constrained decoding needs an end-of-generation token; the vocabulary has none")
        # llguidance reads the token bytes from the tokenizer's own JSON (ByteLevel decoding, added
        # tokens marked special so that grammar text can never produce "<|im_end|>" and the like), the
        # same bytes Tokenizer.token_bytes gives; the tests check that they agree for every id. All
        # end-of-generation ids count as EOS: any of them may end a finished grammar.
        self.tokenizer = llguidance.LLTokenizer(vocab.backend.to_str(), n_vocab=n_vocab, eos_token=eog)
        if self.tokenizer.vocab_size != n_vocab:
            raise ModelError(
                f"llguidance sees {self.tokenizer.vocab_size} tokens in a vocabulary of {n_vocab}; "
                "cannot build a token mask for it"
            )
        self.n_vocab = n_vocab
        self.eog = eog
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, grammar: str, param: Param) -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar`` (llguidance's grammar JSON), compiled once and then copied."""
        with self._lock:
            pristine = self._matchers.get(grammar)
            if pristine is not None:
                self._matchers.move_to_end(grammar)
                return pristine.deep_copy()
        # Compiling can take from a millisecond to a good fraction of a second (llguidance drops the GIL
        # meanwhile); it is done outside the lock so that other sequences are not held up. Validating
        # first gives the compiler's message for a bad grammar.
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=_LIMITS)
        if error:
            raise BadRequestError(f"{param}: {_one_line(error)}")
        pristine = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if pristine.is_error():
            raise BadRequestError(f"{param}: {_one_line(pristine.get_error())}")
        with self._lock:
            self._matchers[grammar] = pristine
            while len(self._matchers) > _MASK_CACHE_SIZE:
                self._matchers.popitem(last=False)
        return pristine.deep_copy()


# One llguidance tokenizer per vocabulary object: building it walks the whole vocabulary (~0.5 s for
# SmolLM2's 49152 tokens), so it is done once per loaded model and dropped with the tokenizer.
_compiled: weakref.WeakKeyDictionary[Any, _Compiled] = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()


def _compiled_for(vocab: TokenizerVocab) -> _Compiled:
    with _compiled_lock:
        try:
            found = _compiled.get(vocab)
        except TypeError:  # not weak-referenceable or not hashable: build it each time
            return _Compiled(vocab)
        if found is None:
            found = _Compiled(vocab)
            _compiled[vocab] = found
        return found


def _one_line(message: str) -> str:
    """An llguidance error as one line (its messages may span several, or carry a trailing newline)."""
    text = " ".join(str(message).split())
    # The GBNF converter's prefix says nothing the parameter name does not.
    text = text.removeprefix("Failed to convert the grammar from GBNF to Lark: ")
    return text or "invalid"


class _GbnfParser(_gbnf.GrammarParser):
    """llguidance's GBNF parser, with ``\\uXXXX`` and ``\\UXXXXXXXX`` escapes that its Lark accepts.

    llguidance 1.9.1's converter writes them with the leading zeros stripped ("\\ue9", "\\U10FFFF"),
    which neither its Lark strings nor its regexes parse, so any GBNF using them (llama.cpp's own
    json.gbnf did) fails. The character itself is valid in both places once past ASCII; below that
    the converter's ``\\xHH`` form is.
    """

    def _parse_char(self, pos: _gbnf.Position) -> tuple[str, _gbnf.Position]:
        width = {"u": 4, "U": 8}.get(pos.peek(2)[1:]) if pos.current() == "\\" else None
        if width is None:
            return super()._parse_char(pos)
        digits = pos.peek(2 + width)[2:]
        if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise _gbnf.GbnfToLarkError(pos, f"invalid escape {pos.peek(2 + width)!r}")
        code = int(digits, 16)
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise _gbnf.GbnfToLarkError(pos, f"escape {pos.peek(2 + width)!r} is not a Unicode scalar value")
        return (f"\\x{code:02x}" if code < 0x80 else chr(code)), pos.advance(2 + width)


def _gbnf_to_lark(text: str) -> str:
    """GBNF -> llguidance Lark, as ``llguidance.gbnf_to_lark.gbnf_to_lark`` but with :class:`_GbnfParser`."""
    rules = _GbnfParser().parse(text)
    _gbnf.resolve(rules)
    out = "%llguidance {}\n\n"
    prev_nl = True
    for rule in sorted(rules.values(), key=lambda r: r.order):
        rendered = str(rule)
        if not prev_nl and "\n" in rendered:
            out += "\n"
        out += rendered + "\n"
        prev_nl = "\n" in rendered
        if prev_nl:
            out += "\n"
    return out


# Bit b of byte v, as a float that leaves a logit alone (+inf) or removes it (-inf) under np.minimum.
# Expanding the packed mask through this table into a reused buffer and taking one minimum is a few
# branch-free passes, several times faster than a boolean-indexed store on a mixed mask.
_BIT_FLOOR = np.where(
    (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1, np.float32(np.inf), np.float32(-np.inf)
).astype(np.float32)


def apply_bitmask(words: np.ndarray, logits: np.ndarray, n: int, floor: np.ndarray | None = None) -> None:
    """Set ``logits[i]`` to -inf for each ``i < n`` whose bit is clear in ``words``, in place.

    ``words`` is a packed bitmask (bit ``i % 32`` of ``words[i // 32]``, int32, as llguidance and
    xgrammar both write it); ``floor``, float32 of ``32 * len(words)``, is scratch space to reuse.
    """
    if floor is None:
        floor = np.empty(words.size * 32, dtype=np.float32)
    np.take(_BIT_FLOOR, words.view(np.uint8), axis=0, out=floor.reshape(-1, 8))
    np.minimum(logits[:n], floor[:n], out=logits[:n])


class Constraint:
    """The grammar state of one generated sequence, as a mask over next-token logits.

    Build one with :meth:`from_grammar` or :meth:`from_json_schema` per sequence (they are cheap after
    the first for a given grammar and vocabulary), then per step: ``mask_logits(logits)``, sample,
    ``accept(token)``. Not thread-safe: one sequence, one thread at a time.
    """

    def __init__(self, compiled: _Compiled, matcher: llguidance.LLMatcher, param: Param) -> None:
        """Use :meth:`from_grammar` or :meth:`from_json_schema`."""
        self._compiled = compiled
        self._matcher = matcher
        self._param = param
        self._eog = frozenset(compiled.eog)
        self._ended = False  # an end-of-generation token was accepted
        n = compiled.n_vocab
        self._n_vocab = n
        self._words = np.zeros((n + 31) // 32, dtype=np.int32)  # llguidance's packed mask, reused
        self._floor = np.empty(self._words.size * 32, dtype=np.float32)  # the mask as +-inf, reused

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def from_grammar(cls, gbnf: str, vocab: TokenizerVocab, param: Param = "grammar") -> Constraint:
        """A constraint to a GBNF grammar (llama.cpp's format; the start rule is ``root``).

        A grammar starting with ``%llguidance`` is taken as llguidance's Lark dialect, as llama.cpp
        does when built with llguidance. Raises :class:`BadRequestError` ("grammar: ...")
        for a grammar that does not parse or that llguidance refuses (``param`` names what the grammar
        came from in messages: the tool-call grammar of a chat request says "tools").
        """
        if not isinstance(gbnf, str):
            raise BadRequestError(f"grammar: must be a string, got {type(gbnf).__name__}")
        if not gbnf.strip():
            raise BadRequestError("grammar: is empty")
        try:
            lark = gbnf if gbnf.lstrip().startswith("%llguidance") else _gbnf_to_lark(gbnf)
        except Exception as e:  # the converter raises bare Exceptions for undefined rules and the like
            # Its messages locate the problem: "<why> at line N, '<before>' ^ '<after>'".
            raise BadRequestError(f"{param}: {_one_line(str(e))}") from None
        return cls._build(llguidance.LLMatcher.grammar_from_lark(lark), vocab, param)

    @classmethod
    def from_json_schema(cls, schema: str | dict[str, Any] | None, vocab: TokenizerVocab) -> Constraint:
        """A constraint to JSON text valid under ``schema`` (a JSON Schema, as a dict or JSON text).

        ``None`` means any JSON object. Object properties come in the order the schema lists them,
        and, as the JSON Schema spec says, properties the schema does not list are allowed after them
        unless ``additionalProperties`` is false. Whitespace between tokens is bounded (see
        :data:`JSON_WHITESPACE`). Raises :class:`BadRequestError` ("json_schema: ...") for text that
        is not JSON, a schema that is not an object, or one llguidance cannot compile (including
        keywords it does not implement, rather than silently ignoring them).
        """
        if schema is None:
            schema = {"type": "object"}
        elif isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise BadRequestError(f"json_schema: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise BadRequestError(f"json_schema: must be a JSON object, got {type(schema).__name__}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise BadRequestError(f"json_schema: {_one_line(str(e))}") from None
        return cls._build(grammar, vocab, "json_schema")

    @classmethod
    def _build(cls, grammar: str, vocab: TokenizerVocab, param: Param) -> Constraint:
        compiled = _compiled_for(vocab)
        return cls(compiled, compiled.matcher(grammar, param), param)

    # --- per step ----------------------------------------------------------------------------------
    def mask_logits(self, logits: np.ndarray) -> None:
        """Set the logits of tokens the grammar does not allow next to -inf, in place.

        ``logits`` is the model's float32 ``[n_vocab]`` row; ids past the tokenizer's vocabulary
        (models pad their output layer) are never allowed. At least one token always stays: when the
        grammar is complete the end-of-generation tokens are allowed, and when it is finished they are
        the only ones.
        """
        if logits.ndim != 1 or logits.dtype != np.float32:
            raise ModelError(f"constraint: logits must be float32 [n_vocab], got {logits.dtype} {logits.shape}")
        n = self._n_vocab
        if logits.shape[0] < n:
            raise ModelError(f"constraint: {logits.shape[0]} logits for a vocabulary of {n} tokens")
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            # A parser limit reached while computing the mask (a pathological grammar): no token may
            # follow, and an all -inf row would only turn into NaNs in the sampler.
            raise BadRequestError(f"{self._param}: {_one_line(m.get_error())}")
        apply_bitmask(self._words, logits, n, self._floor)
        logits[n:] = -np.inf

    def accept(self, token: int) -> None:
        """Advance past ``token``; :class:`BadRequestError` if the grammar does not allow it here.

        A refused token leaves the state unchanged, so the caller may still pick another one.
        """
        if isinstance(token, np.integer):
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self._n_vocab:
            raise BadRequestError(f"{self._param}: token {token!r} is outside the vocabulary (size {self._n_vocab})")
        m = self._matcher
        if self._ended:
            raise BadRequestError(f"{self._param}: token {token} after the end of the output")
        if token in self._eog:
            # llguidance's validate_tokens refuses EOS once the grammar is finished, although that is
            # exactly when it must come; whether it may end here is the accepting state.
            if not m.is_accepting():
                raise BadRequestError(f"{self._param}: the output is incomplete; token {token} cannot end it here")
            if not m.consume_token(token):
                raise BadRequestError(f"{self._param}: {_one_line(m.get_error())}")
            self._ended = True
            return
        # consume_token on a refused token would leave the matcher in an error state for good; checking
        # first keeps a refusal recoverable.
        if m.validate_tokens([token]) != 1:
            text = self._compiled.tokenizer.dbg_tokens([token])
            if m.is_stopped():
                why = "the output is complete and only an end-of-generation token may follow"
            else:
                why = "it does not continue the output the grammar allows"
            raise BadRequestError(f"{self._param}: token {token} {text} is not allowed here: {why}")
        if not m.consume_token(token):
            raise BadRequestError(f"{self._param}: {_one_line(m.get_error())}")

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (none of them an end-of-generation token): a draft model
        advances the grammar over its draft to mask the next draft token, then hands it back."""
        if n and not self._matcher.rollback(n):
            raise BadRequestError(f"{self._param}: {_one_line(self._matcher.get_error())}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row from here (the state is left unchanged)."""
        return int(self._matcher.validate_tokens(tokens)) if tokens and not self._ended else 0

    def is_finished(self) -> bool:
        """Whether the output is complete and nothing may follow but an end-of-generation token."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar (it may end here).

        Unlike :meth:`is_finished` more may still follow (another array item, more digits...). A
        generation cut short (max tokens, a stop string) while this is false has incomplete output.
        """
        return self._matcher.is_accepting()

    @property
    def eog_ids(self) -> tuple[int, ...]:
        """The end-of-generation ids the mask allows once the grammar is complete."""
        return tuple(self._compiled.eog)
