"""From logits to a token: a chain of small steps with llama.cpp's semantics and defaults.

The chain (``common_sampler`` in llama.cpp's ``common/sampling.cpp``)::

    logits -> logit_bias -> penalties -> dry -> top_k -> typ_p -> top_p -> min_p -> xtc -> temperature -> dist

``logit_bias`` always runs first; the steps between it and the draw follow ``SamplingParams.samplers``
(llama.cpp's ``--samplers``), default ``("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc",
"temperature")``. A step that is switched off by its parameter is left out of the chain. With
``mirostat`` 1 or 2 the chain is ``logit_bias -> temperature -> mirostat`` and the other steps are not
used, as in llama.cpp.

Defaults (llama.cpp's ``common_params_sampling``)::

    temperature 0.8    top_k 40      top_p 0.95     min_p 0.05     typical_p 1.0 (off)   min_keep 0
    repeat_penalty 1.0 (off)   repeat_last_n 64   frequency_penalty 0.0   presence_penalty 0.0
    dry_multiplier 0.0 (off)   dry_base 1.75   dry_allowed_length 2   dry_penalty_last_n 64
    dry_sequence_breakers ("\\n", ":", '"', "*")
    xtc_probability 0.0 (off)  xtc_threshold 0.1
    mirostat 0 (off)   mirostat_tau 5.0   mirostat_eta 0.1   seed None (a fresh random seed)

What each step does:

- ``logit_bias``: adds ``bias[token]`` to the token's logit; ``-inf`` bans the token.
- ``penalties``: over the last ``repeat_last_n`` tokens of the history (``-1``: all of it, ``0``: off), each
  token seen ``c`` times has its logit divided by ``repeat_penalty`` if positive, multiplied if not,
  then lowered by ``c * frequency_penalty + presence_penalty``.
- ``dry`` ("don't repeat yourself"): a token that would extend a repetition of ``n >= dry_allowed_length``
  tokens found in the last ``dry_penalty_last_n`` tokens loses ``dry_multiplier * dry_base ** (n -
  dry_allowed_length)``; repetitions do not reach across a sequence breaker (strings matched on the
  tokens' text, which is why the sampler needs ``token_text``), and a token containing a breaker is
  never penalised.
- ``top_k``: the k most likely (0: off). ``typ_p``: locally typical sampling (1.0: off). ``top_p``: the
  smallest most-likely set reaching probability p (1.0: off). ``min_p``: tokens with probability at least
  p times the top one (0.0: off). ``xtc``: with probability ``xtc_probability`` removes every token above
  ``xtc_threshold`` except the least likely of them (``> 0.5``: never anything to remove). The
  truncations keep at least ``min_keep`` tokens where llama.cpp does.
- ``temperature``: divides the logits; 0 is greedy: the first maximal logit (the lowest token id among
  equal maxima), no random number drawn. Greedy takes a shortcut (one argmax after the logit processors)
  whenever the chain provably picks the same token.
- ``dist``: a draw from the softmax of what is left, from a numpy ``Generator`` seeded with ``seed``:
  the same seed gives the same tokens (the draw is single-threaded, whatever the thread count). The draw
  and XTC's coin use two streams spawned from the one seed; with ``seed=None`` a random seed is chosen and
  kept in ``Sampler.seed`` so the run can be replayed.
- ``mirostat`` v1 (tau, eta, m = 100) and v2 (tau, eta) pick the token themselves and steer the surprise
  ``-log2 p`` of the picks towards ``tau``; their state ``mu`` (initially ``2 * tau``) is ``Sampler.mu``.

Not carried over from llama.cpp: top-n-sigma, dynamic temperature, the infill and adaptive-p samplers.

Logits at ``-inf`` (a grammar mask, a ban) are never drawn; if nothing is left, ``BadRequestError``.

History: ``Sampler.reset(prompt_tokens)`` seeds the penalty window with the prompt (and restores ``mu``
and the random streams), ``Sampler.accept(token)`` appends each generated token; ``sample`` does not
append by itself (llama.cpp's ``common_sampler_sample`` / ``common_sampler_accept``). A decode loop::

    sampler.reset(prompt_ids)
    while ...:
        token = sampler.sample(logits)          # or sample_with_logprobs(logits, n_top)
        sampler.accept(token)

``Sampler.distribution(logits)`` shows what the draw would choose from (ids and probabilities).

Log-probabilities (``Sampler.sample_with_logprobs``, :func:`token_logprobs`) are those of the model's
distribution: the log-softmax of the raw logits in float64, before bias, penalties or temperature (what
OpenAI's API reports).

Speed: the logit processors touch only the tokens they change; ``top_k`` over the whole vocabulary is
one compiled pass (:mod:`minfer.backends.cpu.top_k`: block maxima bound the k-th value, only the few
values above the bound are sorted), a cut of fewer candidates a partition; ``top_p`` without ``top_k``
probes the mass of the best 256, 2048, ... tokens before sorting any. At a 49152-token vocabulary the
default chain takes about 0.1 ms a token, greedy about 0.02 ms.

The default chain's shape, ``[logit_bias ->] top_k -> [top_p ->] [min_p ->] temperature -> dist`` (in
this order, temperature > 0), also runs compiled (:mod:`minfer.backends.cpu.sample_chain`): the same
candidates, probabilities and draws as the steps, bit for bit where numpy's float64 exp is the C
library's (on AVX-512 CPUs numpy has its own, which may differ in the last bit). :func:`sample_rows`
samples many sequences (a server's batch) in one parallel call: 8 rows in 0.2-0.45 ms against ~1.2 ms
one after the other; in a server step at 8 clients, sampling and the tokens' bookkeeping went from
6.5% of the time to 2.9%.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from minfer.backends.cpu import sample_chain
from minfer.backends.cpu.top_k import prunes_well, top_k_biased, top_k_positions
from minfer.errors import BadRequestError, ModelError

DEFAULT_SAMPLERS: tuple[str, ...] = ("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")
# llama.cpp's alternative spellings of the step names (common_sampler_types_from_names)
_SAMPLER_ALIASES = {
    "top-k": "top_k",
    "top-p": "top_p",
    "nucleus": "top_p",
    "typical_p": "typ_p",
    "typical-p": "typ_p",
    "typical": "typ_p",
    "typ-p": "typ_p",
    "typ": "typ_p",
    "min-p": "min_p",
    "temp": "temperature",
}
MIROSTAT_M = 100  # tokens used to estimate the Zipf exponent in mirostat v1 (llama.cpp's m)


# -- parameters ------------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


@dataclass(frozen=True)
class SamplingParams:
    """Every sampling setting, range-checked on creation (a bad one raises ``BadRequestError`` naming it)."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    seed: int | None = None  # None: a fresh random seed (see Sampler.seed)
    min_p: float = 0.05  # 0.0 disables
    typical_p: float = 1.0  # 1.0 disables
    min_keep: int = 0  # the truncations keep at least this many tokens
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64  # window of the three penalties; 0 disables them, -1 = the whole history
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0.0 disables DRY
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # 0 disables DRY, -1 = the whole history
    dry_sequence_breakers: Sequence[str] = DEFAULT_DRY_SEQUENCE_BREAKERS
    xtc_probability: float = 0.0  # 0.0 disables
    xtc_threshold: float = 0.1  # > 0.5 leaves nothing to remove
    mirostat: int = 0  # 0 off, 1 mirostat, 2 mirostat 2.0
    mirostat_tau: float = 5.0  # target surprise (bits)
    mirostat_eta: float = 0.1  # learning rate of mu
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # token -> added logit
    samplers: Sequence[str] = DEFAULT_SAMPLERS  # order of the steps; also a ";"-separated string

    def __post_init__(self) -> None:
        f = self._number
        f("temperature", lo=0.0, msg="a finite number >= 0 (0 is greedy)")
        self._integer("top_k", lo=0, msg="an integer >= 0 (0 disables it)")
        f("top_p", lo=0.0, hi=1.0, msg="a number in [0, 1] (1 disables it, 0 keeps only the best token)")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise BadRequestError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        f("min_p", lo=0.0, hi=1.0, msg="a number in [0, 1] (0 disables it)")
        f("typical_p", lo=0.0, hi=1.0, lo_open=True, msg="a number in (0, 1] (1 disables it)")
        self._integer("min_keep", lo=0, msg="an integer >= 0")
        f("repeat_penalty", lo=0.0, lo_open=True, msg="a finite number > 0 (1 disables it)")
        self._integer("repeat_last_n", lo=-1, msg="an integer >= -1 (0 disables the penalties, -1 = all tokens)")
        f("frequency_penalty", msg="a finite number (0 disables it)")
        f("presence_penalty", msg="a finite number (0 disables it)")
        f("dry_multiplier", lo=0.0, msg="a finite number >= 0 (0 disables DRY)")
        f("dry_base", lo=1.0, msg="a finite number >= 1")
        self._integer("dry_allowed_length", lo=1, msg="an integer >= 1")
        self._integer("dry_penalty_last_n", lo=-1, msg="an integer >= -1 (0 disables DRY, -1 = all tokens)")
        breakers = self.dry_sequence_breakers
        if isinstance(breakers, str) or not isinstance(breakers, Sequence):
            raise BadRequestError(f"dry_sequence_breakers must be a list of strings, got {breakers!r}")
        if not all(isinstance(b, str) and b for b in breakers):
            raise BadRequestError(f"dry_sequence_breakers must be non-empty strings, got {list(breakers)!r}")
        object.__setattr__(self, "dry_sequence_breakers", tuple(breakers))
        f("xtc_probability", lo=0.0, hi=1.0, msg="a number in [0, 1] (0 disables XTC)")
        f("xtc_threshold", lo=0.0, hi=1.0, msg="a number in [0, 1] (above 0.5 XTC removes nothing)")
        if not (_is_int(self.mirostat) and self.mirostat in (0, 1, 2)):
            raise BadRequestError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat!r}")
        object.__setattr__(self, "mirostat", int(self.mirostat))
        f("mirostat_tau", lo=0.0, msg="a finite number >= 0")
        f("mirostat_eta", lo=0.0, msg="a finite number >= 0")
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        object.__setattr__(self, "samplers", _check_samplers(self.samplers))

    def _number(
        self, name: str, msg: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False
    ) -> None:
        v = getattr(self, name)
        ok = _is_number(v) and math.isfinite(v)
        if ok and lo is not None:
            ok = v > lo if lo_open else v >= lo
        if ok and hi is not None:
            ok = v <= hi
        if not ok:
            raise BadRequestError(f"{name} must be {msg}, got {v!r}")
        object.__setattr__(self, name, float(v))

    def _integer(self, name: str, lo: int, msg: str) -> None:
        v = getattr(self, name)
        if not (_is_int(v) and v >= lo):
            raise BadRequestError(f"{name} must be {msg}, got {v!r}")
        object.__setattr__(self, name, int(v))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_logit_bias(bias: object) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise BadRequestError(f"logit_bias must be a mapping token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for tok, b in bias.items():
        # JSON object keys are strings ("15": -100 in an OpenAI request): digits are taken as the id
        if isinstance(tok, str) and tok.isascii() and tok.isdigit():
            tok = int(tok)
        if not (_is_int(tok) and tok >= 0):
            raise BadRequestError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
        if not (_is_number(b) and (math.isfinite(b) or b == -math.inf)):
            raise BadRequestError(f"logit_bias values must be finite numbers or -inf (a ban), got {b!r} for {tok}")
        out[int(tok)] = float(b)
    return out


def _check_samplers(samplers: object) -> tuple[str, ...]:
    if isinstance(samplers, str):
        samplers = [s for s in samplers.split(";") if s]
    if not isinstance(samplers, Sequence) or not all(isinstance(s, str) for s in samplers):
        raise BadRequestError(f"samplers must be a list of step names, got {samplers!r}")
    out = []
    for s in samplers:
        name = _SAMPLER_ALIASES.get(s, s)
        if name not in DEFAULT_SAMPLERS:
            raise BadRequestError(f"samplers: unknown step {s!r} (known: {', '.join(DEFAULT_SAMPLERS)})")
        out.append(name)
    return tuple(out)


# -- the candidate set -----------------------------------------------------------------------------


class _Candidates:
    """The tokens still in the running and their processed logits.

    While the whole vocabulary is in play ``ids`` is None (position == token id) and ``logits`` may be
    the caller's float32 array, copied only once a step writes to it. The first cut turns the survivors
    into float64 arrays with explicit ids. ``sorted`` means best first, equal logits by lower id.
    """

    __slots__ = ("ids", "logits", "sorted", "owned", "n_vocab")

    def __init__(self, logits: np.ndarray) -> None:
        self.ids: np.ndarray | None = None
        self.logits = logits
        self.sorted = False
        self.owned = False
        self.n_vocab = len(logits)

    def __len__(self) -> int:
        return len(self.logits)

    def writable(self) -> np.ndarray:
        if not self.owned:
            self.logits = self.logits.copy()
            self.owned = True
        return self.logits

    def token(self, pos: int) -> int:
        return int(pos if self.ids is None else self.ids[pos])

    def keep(self, pos: np.ndarray, is_sorted: bool) -> None:
        """Keep the candidates at positions ``pos``, in that order."""
        self.ids = pos if self.ids is None else self.ids[pos]
        self.logits = self.logits[pos].astype(np.float64, copy=False)
        self.owned = True
        self.sorted = is_sorted

    def keep_prefix(self, m: int) -> None:
        """Keep the first ``m`` candidates, in their order: ``keep(np.arange(m), self.sorted)`` without the
        gathers (the cut of a sorted set is a prefix)."""
        if m >= len(self.logits):
            return
        self.ids = np.arange(m) if self.ids is None else self.ids[:m]
        # a view only of an array this set owns: a caller's float64 logits are never written
        self.logits = self.logits[:m].astype(np.float64, copy=not self.owned)
        self.owned = True

    def positions_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, indices into ``tokens``) of those ``tokens`` that are still candidates."""
        if self.ids is None:
            return tokens, np.arange(len(tokens))
        order = np.argsort(self.ids)
        sorted_ids = self.ids[order]
        at = np.minimum(np.searchsorted(sorted_ids, tokens), len(sorted_ids) - 1)
        found = sorted_ids[at] == tokens
        return order[at[found]], np.flatnonzero(found)

    def best(self, k: int) -> np.ndarray:
        """Positions of the ``k`` best candidates, best first (equal logits: lower id first)."""
        x, n = self.logits, len(self.logits)
        k = min(k, n)
        if self.sorted:
            return np.arange(k)
        if self.ids is None and x.dtype == np.float32 and prunes_well(n, k):  # the whole vocabulary
            return top_k_positions(x, k)
        if k < n:
            # a partition finds the k-th value without sorting; only the survivors get sorted
            kth = np.partition(x, n - k)[n - k]
            pos = np.flatnonzero(x >= kth)
            if len(pos) > k:  # ties on the boundary: the lower ids win, whatever order the partition left
                above = pos[x[pos] > kth]
                ties = pos[x[pos] == kth]
                if self.ids is not None:
                    ties = ties[np.argsort(self.ids[ties], kind="stable")]
                pos = np.concatenate((above, ties[: k - len(above)]))
                pos.sort()
        else:
            pos = np.arange(n)
        # with the whole vocabulary, positions ascending are ids ascending
        return pos[_rank(x[pos], None if self.ids is None else self.ids[pos])]

    def sort(self) -> None:
        if not self.sorted:
            self.keep(self.best(len(self)), True)

    def probs(self) -> np.ndarray:
        return _softmax(self.logits)


def _rank(x: np.ndarray, tok: np.ndarray | None) -> np.ndarray:
    """Order of positions by larger ``x`` first, equal ``x`` by lower ``tok`` (None: by position)."""
    n = len(x)
    if n <= 64:
        return np.lexsort((np.arange(n) if tok is None else tok, -x))
    # numpy's default sort is vectorised and several times faster than a stable one; its order among
    # equal values is arbitrary, so it is used only when there are none
    order = np.argsort(-x)
    xs = x[order]
    if not np.any(xs[1:] == xs[:-1]):
        return order
    if tok is None and x.dtype == np.float32:
        # float32 ties (common over a whole vocabulary): sort one uint64 key per position, the float's
        # bits mapped to an order-preserving unsigned integer above the position
        u = (-(x + np.float32(0.0))).view(np.uint32)  # + 0.0 makes -0.0 equal to 0.0
        u = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000))
        key = (u.astype(np.uint64) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
        key.sort()
        return (key & np.uint64(0xFFFFFFFF)).astype(np.intp)
    return np.lexsort((np.arange(n) if tok is None else tok, -x))


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax in float64 (the row max subtracted first; -inf logits get probability exactly 0)."""
    e = np.exp(x - x.max()).astype(np.float64, copy=False)
    return e / e.sum()


# -- steps -----------------------------------------------------------------------------------------


class _State:
    """What the steps share and what ``Sampler.reset`` restores: history, random streams, mirostat's mu."""

    def __init__(self) -> None:
        self.history: list[int] = []
        self.rng = np.random.default_rng()
        self.xtc_rng = np.random.default_rng()
        self.mu = 0.0

    def window(self, last_n: int) -> list[int]:
        return self.history if last_n < 0 else self.history[len(self.history) - last_n :]


class _Step:
    name = ""

    def apply(self, cand: _Candidates) -> int | None:
        """Transform ``cand`` in place; a selecting step (dist, mirostat) returns the chosen token."""
        raise NotImplementedError


def _check_in_vocab(tokens: np.ndarray, n_vocab: int, what: str) -> None:
    if len(tokens) and int(tokens.max()) >= n_vocab:
        raise BadRequestError(f"{what}: token {int(tokens.max())} is outside the vocabulary of {n_vocab} tokens")


class _LogitBias(_Step):
    name = "logit_bias"

    def __init__(self, bias: Mapping[int, float]) -> None:
        self.tokens = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.values = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    def apply(self, cand: _Candidates) -> None:
        _check_in_vocab(self.tokens, cand.n_vocab, "logit_bias")
        pos, which = cand.positions_of(self.tokens)
        x = cand.writable()
        x[pos] += self.values[which]
        cand.sorted = False
        _check_drawable(cand)  # only a ban can leave nothing to sample; say so before any step divides by 0


def _bias_then_top_k(cand: _Candidates, bias: _LogitBias, k: int) -> bool:
    """``bias.apply(cand)`` then ``_TopK(k).apply(cand)`` without copying the vocabulary (see
    ``top_k_biased``); False (nothing done) where that does not apply: candidates already cut, logits
    other than float32, or a k the compiled top-k does not prune well."""
    x, n = cand.logits, len(cand.logits)
    if cand.ids is not None or x.dtype != np.float32 or k >= n or not prunes_well(n, k + len(bias.tokens)):
        return False
    _check_in_vocab(bias.tokens, n, "logit_bias")
    ids, vals = top_k_biased(x, k, bias.tokens, bias.values)
    if vals[0] == -np.inf:
        raise BadRequestError(_NOTHING_DRAWABLE)
    cand.ids = ids
    cand.logits = vals.astype(np.float64)
    cand.owned = cand.sorted = True
    return True


class _Penalties(_Step):
    name = "penalties"

    def __init__(self, state: _State, last_n: int, repeat: float, freq: float, present: float) -> None:
        self.state, self.last_n, self.repeat, self.freq, self.present = state, last_n, repeat, freq, present

    def apply(self, cand: _Candidates) -> None:
        window = self.state.window(self.last_n)
        if not window:
            return
        tokens, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        _check_in_vocab(tokens, cand.n_vocab, "penalties (sampler history)")
        pos, which = cand.positions_of(tokens)
        if not len(pos):
            return
        x = cand.writable()
        v = x[pos].astype(np.float64)
        # dividing a negative logit would make the token more likely: llama.cpp multiplies those
        v = np.where(v <= 0, v * self.repeat, v / self.repeat)
        v -= counts[which] * self.freq + self.present
        x[pos] = v
        cand.sorted = False


class _Dry(_Step):
    """DRY, ported from llama.cpp (itself from koboldcpp), with the sequence breakers matched on text.

    llama.cpp turns each breaker into token sequences by tokenizing; matching the breaker strings on the
    bytes of the tokens' text gives the same answer for any tokenization, and only the texts of tokens
    in the history and of penalised tokens are ever looked up.
    """

    name = "dry"

    def __init__(
        self,
        state: _State,
        multiplier: float,
        base: float,
        allowed_length: int,
        last_n: int,
        breakers: Sequence[str],
        token_text: Callable[[int], str | bytes] | None,
    ) -> None:
        if breakers and token_text is None:
            raise BadRequestError(
                "dry_sequence_breakers need the tokens' text: create the Sampler with token_text=..."
            )
        self.state, self.multiplier, self.base = state, multiplier, base
        self.allowed_length, self.last_n = allowed_length, last_n
        self.breakers = [b.encode("utf-8") for b in breakers]
        self.max_breaker = max((len(b) for b in self.breakers), default=0)
        self.token_text = token_text
        self._texts: dict[int, bytes] = {}
        # exponent cap so that base ** exponent stays below float32's max, as llama.cpp does
        self.max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0

    def _text(self, token: int) -> bytes:
        t = self._texts.get(token)
        if t is None:
            assert self.token_text is not None
            s = self.token_text(token)
            t = s.encode("utf-8", "surrogateescape") if isinstance(s, str) else bytes(s)
            self._texts[token] = t
        return t

    def _contains_breaker(self, token: int) -> bool:
        if not self.breakers:
            return False
        text = self._text(token)
        return any(b in text for b in self.breakers)

    def _repeat_limit(self, window: Sequence[int]) -> int:
        """Tokens after the most recent sequence breaker (the window's length if there is none)."""
        n = len(window)
        if not self.breakers:
            return n
        following: list[bytes] = []  # texts of the tokens after token i, nearest first
        tail = b""  # their first max_breaker - 1 bytes: enough for an occurrence starting in token i
        for i in range(n):  # i tokens back from the most recent
            text = self._text(window[n - 1 - i])
            s = text + tail
            longest = -1  # most tokens after token i that an occurrence starting in token i runs into
            for b in self.breakers:
                start = s.find(b)
                while 0 <= start < len(text):
                    over, spans = start + len(b) - len(text), 0
                    while over > 0:
                        over -= len(following[spans])
                        spans += 1
                    longest = max(longest, spans)
                    start = s.find(b, start + 1)
            if longest >= 0:
                return i - longest
            following.insert(0, text)
            while len(following) > 1 and sum(map(len, following[:-1])) >= self.max_breaker - 1:
                following.pop()
            tail = s[: self.max_breaker - 1]
        return n

    def apply(self, cand: _Candidates) -> None:
        window = self.state.window(self.last_n)
        n = len(window)
        if n <= self.allowed_length:
            return
        rep_limit = self._repeat_limit(window)
        if rep_limit < self.allowed_length:
            return
        # z[k]: length of the longest common prefix of the reversed window and the reversed window from k,
        # i.e. how many tokens before position k repeat the most recent tokens (the Z-algorithm, linear)
        rev = window[::-1]
        z = _z_function(rev)
        longest: dict[int, int] = {}
        for k in range(1, n):
            length = min(z[k], rep_limit)
            if length >= self.allowed_length:
                token = rev[k - 1]  # the token that followed the earlier occurrence
                if longest.get(token, -1) < length:
                    longest[token] = length
        if not longest:
            return
        tokens, amounts = [], []
        for token, length in longest.items():
            if self._contains_breaker(token):
                continue  # llama.cpp never penalises a token that is a sequence breaker by itself
            exponent = length - self.allowed_length
            if self.max_exponent > 0:
                exponent = min(exponent, self.max_exponent)
            tokens.append(token)
            amounts.append(self.multiplier * self.base**exponent)
        if not tokens:
            return
        tok = np.asarray(tokens, dtype=np.int64)
        _check_in_vocab(tok, cand.n_vocab, "dry (sampler history)")
        pos, which = cand.positions_of(tok)
        x = cand.writable()
        x[pos] -= np.asarray(amounts)[which]
        cand.sorted = False


def _z_function(s: Sequence[int]) -> list[int]:
    n = len(s)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


class _TopK(_Step):
    name = "top_k"

    def __init__(self, k: int) -> None:
        self.k = k

    def apply(self, cand: _Candidates) -> None:
        if self.k < len(cand):
            cand.keep(cand.best(self.k), True)


class _TypicalP(_Step):
    name = "typ_p"

    def __init__(self, p: float, min_keep: int) -> None:
        self.p, self.min_keep = p, min_keep

    def apply(self, cand: _Candidates) -> None:
        probs = cand.probs()
        nz = probs > 0
        logp = np.full_like(probs, -np.inf)
        logp[nz] = np.log(probs[nz])
        entropy = -float(np.sum(probs[nz] * logp[nz]))
        shifted = np.abs(-logp - entropy)  # |surprise - entropy|: how typical each token is
        ids = np.arange(len(cand)) if cand.ids is None else cand.ids
        order = np.argsort(shifted)
        ss = shifted[order]
        if np.any(ss[1:] == ss[:-1]):  # equal scores: order them by logit, then id, whatever the sort did
            order = np.lexsort((ids, -cand.logits, shifted))
        cum = np.cumsum(probs[order])
        over = np.flatnonzero(cum > self.p)
        # the first index where the mass exceeds p and at least min_keep tokens are in
        start = max(self.min_keep - 1, 0)
        over = over[over >= start]
        last = int(over[0]) + 1 if len(over) else len(order)
        cand.keep(order[:last], False)


class _TopP(_Step):
    name = "top_p"

    def __init__(self, p: float, min_keep: int) -> None:
        self.p, self.min_keep = p, min_keep

    def apply(self, cand: _Candidates) -> None:
        n = len(cand)
        probs = cand.probs()
        if cand.sorted:  # the loop below with k = n: the first prefix whose mass reaches p
            # probabilities are >= 0, so the running sum never decreases: its first index at or above p
            # is where the mass is reached, and every later index reaches it too
            last = max(int(np.searchsorted(np.cumsum(probs), self.p)), self.min_keep - 1)
            if last < n:
                cand.keep_prefix(last + 1)
            return
        k = 256
        while True:
            k = min(k, n)
            # the kept set is usually small: the mass of the k best (a partition, no sort) tells whether
            # they reach p before any sorting; only then are those k sorted and summed in order
            if k < n and (k < self.min_keep or np.partition(probs, n - k)[n - k :].sum() < self.p):
                k *= 8
                continue
            pos = cand.best(k)
            cum = np.cumsum(probs[pos])
            reach = np.flatnonzero(cum >= self.p)
            reach = reach[reach + 1 >= self.min_keep]
            if len(reach):
                cand.keep(pos[: int(reach[0]) + 1], True)
                return
            if k >= n:
                cand.keep(pos, True)  # rounding kept the total under p: everything stays
                return
            k *= 8


class _MinP(_Step):
    name = "min_p"

    def __init__(self, p: float, min_keep: int) -> None:
        self.p, self.min_keep = p, min_keep
        self.log_p = math.log(p)

    def apply(self, cand: _Candidates) -> None:
        x = cand.logits
        if cand.sorted:  # best first: the kept tokens are a prefix
            kept = int(np.count_nonzero(x >= x[0] + self.log_p))
            cand.keep_prefix(max(kept, min(self.min_keep, len(x))))
            return
        # p_i >= p * p_max  <=>  logit_i >= max_logit + log(p): no softmax needed
        keep = np.flatnonzero(x >= x.max() + self.log_p)
        if len(keep) < self.min_keep:
            keep = np.sort(cand.best(self.min_keep)) if not cand.sorted else np.arange(min(self.min_keep, len(x)))
        if len(keep) < len(x):
            cand.keep(keep, cand.sorted)  # positions ascending: the order (sorted or not) is preserved


class _Xtc(_Step):
    name = "xtc"

    def __init__(self, state: _State, probability: float, threshold: float, min_keep: int) -> None:
        self.state, self.probability, self.threshold, self.min_keep = state, probability, threshold, min_keep

    def apply(self, cand: _Candidates) -> None:
        n = len(cand)
        if n < 2:
            return
        if self.state.xtc_rng.random() > self.probability:
            return
        above = np.flatnonzero(cand.probs() >= self.threshold)
        remove = len(above) - 1  # every token above the threshold but the least likely of them
        if remove <= 0 or n - remove < self.min_keep:
            return
        tok = above if cand.ids is None else cand.ids[above]
        order = np.lexsort((tok, -cand.logits[above]))
        mask = np.ones(n, dtype=bool)
        mask[above[order[:remove]]] = False
        cand.keep(np.flatnonzero(mask), cand.sorted)


class _Temperature(_Step):
    name = "temperature"

    def __init__(self, t: float) -> None:
        self.t = t

    def apply(self, cand: _Candidates) -> None:
        if self.t > 0:
            if cand.owned:
                cand.logits /= self.t
            else:
                cand.logits = cand.logits / self.t
                cand.owned = True
            return
        # greedy: only the first maximal logit survives (the lowest id among equal maxima)
        if cand.sorted:
            first = 0
        elif cand.ids is None:
            first = int(np.argmax(cand.logits))
        else:
            ties = np.flatnonzero(cand.logits == cand.logits.max())
            first = int(ties[np.argmin(cand.ids[ties])])
        cand.keep(np.array([first]), True)


def _draw(cand: _Candidates, rng: np.random.Generator) -> tuple[int, float]:
    """(position, probability) of a token drawn from the softmax of the candidates (llama.cpp's dist)."""
    n = len(cand)
    if n == 1:
        return 0, 1.0  # llama.cpp draws no number for a single candidate
    probs = cand.probs()
    i = _search(np.cumsum(probs), rng)
    return i, float(probs[i])


def _search(cum: np.ndarray, rng: np.random.Generator) -> int:
    """The position a draw picks from the cumulative masses ``cum`` of two or more candidates: side="right",
    the first position whose cumulative mass exceeds the target, so a zero-probability (banned) token can
    never be picked, even for a draw of exactly 0."""
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(cum) - 1)


_NOTHING_DRAWABLE = "no token can be sampled: every candidate is at -inf (banned by logit_bias or masked)"


def _check_drawable(cand: _Candidates) -> None:
    if (cand.logits[0] if cand.sorted else cand.logits.max()) == -np.inf:
        raise BadRequestError(_NOTHING_DRAWABLE)


class _Dist(_Step):
    name = "dist"

    def __init__(self, state: _State) -> None:
        self.state = state

    def apply(self, cand: _Candidates) -> int:
        _check_drawable(cand)
        return cand.token(_draw(cand, self.state.rng)[0])


class _Mirostat(_Step):
    """Mirostat v1: estimate the Zipf exponent from the top m tokens, pick k from it and mu, draw."""

    name = "mirostat"

    def __init__(self, state: _State, tau: float, eta: float, m: int = MIROSTAT_M) -> None:
        self.state, self.tau, self.eta, self.m = state, tau, eta, m

    def apply(self, cand: _Candidates) -> int:
        _check_drawable(cand)
        st, n_vocab = self.state, cand.n_vocab
        n = len(cand)
        if n > 1:
            probs = cand.probs()
            top = probs[cand.best(self.m)]
            top = top[top > 0]
            i = np.arange(len(top) - 1)
            t = np.log((i + 2) / (i + 1))
            b = np.log(top[:-1] / top[1:])
            s_hat = float(np.sum(t * b) / np.sum(t * t)) if len(top) > 1 else 1.0
            eps = s_hat - 1
            # k = (eps * 2^mu / (1 - N^-eps)) ^ (1 / s_hat); the eps -> 0 limit of the ratio is 1 / ln N
            ratio = eps / (1 - n_vocab ** (-eps)) if eps != 0 else 1 / math.log(n_vocab)
            with np.errstate(all="ignore"):
                k = float(np.power(ratio * np.exp2(st.mu), 1 / s_hat)) if s_hat > 0 else math.inf
            if k < n:  # NaN or inf: no truncation
                cand.keep(cand.best(max(int(k), 1)), True)
        pos, p = _draw(cand, st.rng)
        st.mu -= self.eta * (-math.log2(p) - self.tau)
        return cand.token(pos)


class _MirostatV2(_Step):
    """Mirostat 2.0: keep tokens whose surprise -log2 p is at most mu, draw, move mu towards tau."""

    name = "mirostat_v2"

    def __init__(self, state: _State, tau: float, eta: float) -> None:
        self.state, self.tau, self.eta = state, tau, eta

    def apply(self, cand: _Candidates) -> int:
        _check_drawable(cand)
        st = self.state
        probs = cand.probs()
        keep = np.flatnonzero(probs >= np.exp2(-st.mu))  # -log2 p <= mu
        if not len(keep):
            keep = cand.best(1)
        if len(keep) < len(cand):
            cand.keep(keep, cand.sorted or len(keep) == 1)
        pos, p = _draw(cand, st.rng)
        st.mu -= self.eta * (-math.log2(p) - self.tau)
        return cand.token(pos)


# -- the sampler -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``n_top`` most likely tokens, best first."""

    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
    """Log-probabilities of the model's distribution (log-softmax of the raw logits, float64)."""
    raw = _check_logits(logits)
    x = raw.astype(np.float64)
    if not (_is_int(n_top) and 0 <= n_top <= len(x)):
        raise BadRequestError(f"n_top must be an integer in [0, {len(x)}] (the vocabulary size), got {n_top!r}")
    if not (_is_int(token) and 0 <= token < len(x)):
        raise BadRequestError(f"token must be an id in [0, {len(x)}), got {token!r}")
    m = x.max()
    log_z = float(m + np.log(np.sum(np.exp(x - m))))
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        c = _Candidates(raw)  # ranked on the logits as given: float32 partitions faster, same order
        top = tuple((int(i), float(x[i] - log_z)) for i in c.best(int(n_top)))
    return TokenLogprob(int(token), float(x[token] - log_z), top)


class Sampler:
    """Runs the chain of :class:`SamplingParams` over one sequence's logits, step after step.

    ``token_text(id)`` gives a token's text (str, or the bytes it decodes to, e.g. the tokenizer's
    ``token_bytes``); only DRY with sequence breakers needs it.
    """

    def __init__(
        self, params: SamplingParams | None = None, token_text: Callable[[int], str | bytes] | None = None
    ) -> None:
        self.params = params if params is not None else SamplingParams()
        p = self.params
        # the effective seed is kept so that a run with seed=None can be reported and replayed
        self.seed: int = p.seed if p.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        self._state = _State()
        self._processors: list[_Step] = []  # logit_bias, penalties, dry: used by the greedy fast path
        self._steps = self._build(token_text)
        self._greedy_fast = self._can_take_argmax()
        # logit_bias right before top_k: ``sample`` runs the two as one (see _bias_then_top_k)
        steps = self._steps
        self._bias_top_k = (
            (steps[0], steps[1].k)
            if len(steps) > 2 and isinstance(steps[0], _LogitBias) and isinstance(steps[1], _TopK)
            else None
        )
        self._chain = _CompiledChain.of(steps)
        self.reset()

    # -- chain -------------------------------------------------------------------------------------

    def _build(self, token_text: Callable[[int], str | bytes] | None) -> list[_Step]:
        p, st = self.params, self._state
        steps: list[_Step] = []
        if p.logit_bias:
            steps.append(_LogitBias(p.logit_bias))
        if p.mirostat:
            steps.append(_Temperature(p.temperature))
            steps.append(_Mirostat(st, p.mirostat_tau, p.mirostat_eta) if p.mirostat == 1 else
                         _MirostatV2(st, p.mirostat_tau, p.mirostat_eta))
            return steps
        for name in p.samplers:
            step: _Step | None = None
            if name == "penalties":
                if p.repeat_last_n != 0 and (
                    p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                ):
                    step = _Penalties(st, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)
            elif name == "dry":
                if p.dry_multiplier != 0.0 and p.dry_penalty_last_n != 0:
                    step = _Dry(st, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                                p.dry_sequence_breakers, token_text)
            elif name == "top_k":
                step = _TopK(p.top_k) if p.top_k > 0 else None
            elif name == "typ_p":
                step = _TypicalP(p.typical_p, p.min_keep) if p.typical_p < 1.0 else None
            elif name == "top_p":
                step = _TopP(p.top_p, p.min_keep) if p.top_p < 1.0 else None
            elif name == "min_p":
                step = _MinP(p.min_p, p.min_keep) if p.min_p > 0.0 else None
            elif name == "xtc":
                if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5:
                    step = _Xtc(st, p.xtc_probability, p.xtc_threshold, p.min_keep)
            elif name == "temperature":
                step = _Temperature(p.temperature)
            if step is not None:
                steps.append(step)
        steps.append(_Dist(st))
        return steps

    def _can_take_argmax(self) -> bool:
        """Whether greedy sampling is the argmax of the processed full-vocabulary logits.

        top_k, top_p and min_p always keep the best token, so they cannot change the greedy pick unless a
        logit processor runs after them (it would then rank only their survivors); typical-p and XTC can
        drop the best token, so with them the whole chain runs.
        """
        if self.params.mirostat or self.params.temperature != 0:
            return False
        truncated = False
        for step in self._steps:
            if isinstance(step, _Temperature):
                return True
            if isinstance(step, _LogitBias | _Penalties | _Dry):
                if truncated:
                    return False
                self._processors.append(step)
            elif isinstance(step, _TypicalP | _Xtc):
                return False
            else:
                truncated = True
        return False  # no temperature step: llama.cpp then samples at temperature 1

    def describe(self) -> str:
        """The active chain, as llama.cpp prints it: ``logits -> top_k -> ... -> dist``."""
        return " -> ".join(["logits", *(s.name for s in self._steps)])

    # -- state -------------------------------------------------------------------------------------

    @property
    def mu(self) -> float:
        """Mirostat's running surprise bound (2 * tau after a reset)."""
        return self._state.mu

    @property
    def history(self) -> tuple[int, ...]:
        return tuple(self._state.history)

    def reset(self, prompt_tokens: Iterable[int] = ()) -> None:
        """Start a new sequence: history = ``prompt_tokens``, mu and the random streams restored."""
        st = self._state
        st.history = [_check_token(t) for t in prompt_tokens]
        # separate streams for the draw and XTC's coin, both from the one seed
        draw_seq, xtc_seq = np.random.SeedSequence(self.seed).spawn(2)
        st.rng = np.random.default_rng(draw_seq)
        st.xtc_rng = np.random.default_rng(xtc_seq)
        st.mu = 2.0 * self.params.mirostat_tau

    def accept(self, token: int) -> None:
        """Append a generated token to the history the penalties and DRY look at."""
        h = self._state.history
        h.append(_check_token(token))
        keep = self._history_needed()
        if keep is not None and len(h) > 2 * keep + 64:
            del h[: len(h) - keep]  # trimmed in batches, not every step

    def _history_needed(self) -> int | None:
        p = self.params
        if p.repeat_last_n < 0 or p.dry_penalty_last_n < 0:
            return None
        return max(p.repeat_last_n, p.dry_penalty_last_n)

    # -- sampling ----------------------------------------------------------------------------------

    def sample(self, logits: np.ndarray) -> int:
        """The next token from ``logits`` ([n_vocab]); does not add it to the history (see ``accept``)."""
        if self._chain is not None and isinstance(logits, np.ndarray) and logits.ndim == 1:
            token = sample_rows([self], logits[None, :])[0]
            if token is not None:
                return token
        cand = _Candidates(_check_logits(logits))
        if self._greedy_fast:
            for step in self._processors:
                step.apply(cand)
            best = int(np.argmax(cand.logits))  # numpy returns the first maximum: the lowest id
            if cand.logits[best] == -np.inf:
                _check_drawable(cand)
            return best
        steps = self._steps
        if self._bias_top_k is not None and _bias_then_top_k(cand, *self._bias_top_k):
            steps = steps[2:]
        for step in steps:
            token = step.apply(cand)
            if token is not None:
                return token
        raise AssertionError("the chain ends with a selecting step")

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) the draw would choose from, most likely first; for inspection.

        Runs every step but the draw (with mirostat: the distribution mirostat starts from, mu untouched).
        Like ``sample`` it advances XTC's random stream.
        """
        cand = _Candidates(_check_logits(logits))
        for step in self._steps:
            if isinstance(step, _Dist | _Mirostat | _MirostatV2):
                break
            step.apply(cand)
        _check_drawable(cand)
        cand.sort()
        ids = np.arange(len(cand)) if cand.ids is None else cand.ids
        return ids.copy(), cand.probs()

    def sample_with_logprobs(self, logits: np.ndarray, n_top: int = 0) -> tuple[int, TokenLogprob]:
        """The next token and its log-probability with the ``n_top`` most likely alternatives."""
        x = _check_logits(logits)
        if not (_is_int(n_top) and 0 <= n_top <= len(x)):
            raise BadRequestError(f"n_top must be an integer in [0, {len(x)}] (the vocabulary size), got {n_top!r}")
        token = self.sample(x)
        return token, token_logprobs(x, token, n_top)


class _CompiledChain:
    """A chain ``[logit_bias ->] top_k -> [top_p ->] [min_p ->] temperature -> dist`` (llama.cpp's default
    order, temperature > 0), which ``sample_chain.truncate_rows`` runs compiled: the same candidates and
    probabilities as the steps, for many sequences in one call."""

    __slots__ = ("k", "bias_tokens", "bias_values", "top_p", "min_p", "log_min_p", "min_keep", "temperature",
                 "checked_vocab", "alone")

    @classmethod
    def of(cls, steps: list[_Step]) -> _CompiledChain | None:
        rest = list(steps)
        bias = rest.pop(0) if rest and isinstance(rest[0], _LogitBias) else None
        kinds = [type(step) for step in rest]
        if kinds not in ([_TopK, _Temperature, _Dist], [_TopK, _TopP, _Temperature, _Dist],
                         [_TopK, _MinP, _Temperature, _Dist], [_TopK, _TopP, _MinP, _Temperature, _Dist]):
            return None
        temperature = rest[-2]
        assert isinstance(temperature, _Temperature)
        if not temperature.t > 0:
            return None
        chain = cls()
        top_k = rest[0]
        assert isinstance(top_k, _TopK)
        chain.k = top_k.k
        chain.bias_tokens = bias.tokens if bias is not None else np.zeros(0, np.int64)
        chain.bias_values = bias.values if bias is not None else np.zeros(0, np.float64)
        top_p = next((step for step in rest if isinstance(step, _TopP)), None)
        min_p = next((step for step in rest if isinstance(step, _MinP)), None)
        chain.top_p = top_p.p if top_p is not None else 1.0
        chain.min_p = min_p is not None
        chain.log_min_p = min_p.log_p if min_p is not None else 0.0
        cut = top_p or min_p  # both take SamplingParams.min_keep
        chain.min_keep = cut.min_keep if cut is not None else 0
        chain.temperature = temperature.t
        chain.checked_vocab = 0  # the vocabulary size the bias tokens were checked against
        chain.alone = chain.arguments([chain])  # a sequence sampled alone: built once, not per token
        return chain

    @staticmethod
    def arguments(chains: Sequence[_CompiledChain]) -> tuple[np.ndarray, ...]:
        """``truncate_rows``' arguments after the rows, one entry per chain."""
        return (
            np.array([c.k for c in chains], np.int64),
            np.cumsum([0] + [len(c.bias_tokens) for c in chains]),
            np.concatenate([c.bias_tokens for c in chains]).astype(np.int64, copy=False),
            np.concatenate([c.bias_values for c in chains]).astype(np.float64, copy=False),
            np.array([c.top_p for c in chains], np.float64),
            np.array([c.min_p for c in chains], np.bool_),
            np.array([c.log_min_p for c in chains], np.float64),
            np.array([c.min_keep for c in chains], np.int64),
            np.array([c.temperature for c in chains], np.float64),
        )

    def fits(self, n_vocab: int) -> bool:
        if self.checked_vocab != n_vocab:
            if len(self.bias_tokens) and int(self.bias_tokens.max()) >= n_vocab:
                return False  # the steps say so (a bias outside the vocabulary)
            if not sample_chain.compiles(n_vocab, self.k, len(self.bias_tokens)):
                return False
            self.checked_vocab = n_vocab
        return True


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray) -> list[int | None]:
    """``samplers[i].sample(logits[i])`` for every row at once, where the sampler's chain compiles (see
    ``_CompiledChain``): one parallel call for those rows, then each sampler's draw from its own random
    stream. None for a row it leaves to ``sample``: another chain, or logits that fail a check (``sample``
    then raises the error)."""
    out: list[int | None] = [None] * len(samplers)
    if logits.ndim != 2 or logits.dtype != np.float32 or not logits.flags.c_contiguous:
        return out
    n_vocab = logits.shape[1]
    rows = [i for i, s in enumerate(samplers) if s._chain is not None and s._chain.fits(n_vocab)]
    if not rows:
        return out
    chains = [samplers[i]._chain for i in rows]
    args = chains[0].alone if len(chains) == 1 else _CompiledChain.arguments(chains)
    codes, counts, ids, cum = sample_chain.truncate_rows(logits, np.array(rows, np.int64), *args)
    for j, i in enumerate(rows):
        if codes[j]:
            continue
        n = int(counts[j])  # no number drawn for a single candidate, as _draw
        out[i] = int(ids[j, 0 if n == 1 else _search(cum[j, :n], samplers[i]._state.rng)])
    return out


def _check_token(token: object) -> int:
    if not (_is_int(token) and token >= 0):
        raise BadRequestError(f"token ids must be integers >= 0, got {token!r}")
    return int(token)


def _check_logits(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise BadRequestError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    if x.dtype != np.float32 and x.dtype != np.float64:
        x = x.astype(np.float32)
    m = float(x.max())
    if m != m or m == math.inf:  # NaN
        raise ModelError("the logits contain NaN or +inf: the forward pass broke down")
    if m == -math.inf:  # said here, before a softmax of nothing turns into NaNs
        raise BadRequestError("no token can be sampled: every logit is -inf (everything masked or banned)")
    return x
