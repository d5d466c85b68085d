"""Every sampling setting in one dataclass, :class:`SamplingParams`, each field described by its metadata.

A field's :class:`Param` is the one place that says what the field is: its help text, the check of its
values (type, range, choices; a bad value raises a one-line ``BadRequestError`` naming the field), its
command-line flags, and whether and how a server request body sets it. ``minfer run/chat/serve`` make
their sampling flags from it (``minfer.cli``), the server its request fields and their checks
(``minfer.server.protocols.openai``); :data:`PARAMS` holds it by field name. The defaults are llama.cpp's
(``common_params_sampling``).

The steps ``samplers`` orders are :data:`STEPS`, one row each: the step's name, which parameters switch
it on, and llama.cpp's other spellings of its name (``common_sampler_types_from_names``). Its place in
the table is its place in llama.cpp's default order (``common_params_sampling::samplers``);
:mod:`.registry` gives each its class.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from minfer.errors import BadRequestError

DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")


def is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def is_number(v: object) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)


# -- checks ---------------------------------------------------------------------------------------------


class Check:
    """A field's check: ``check(name, value)`` is the value as stored, or a ``BadRequestError`` naming it."""

    cli_type: ClassVar[Callable[[str], Any]] = str  # parses one command-line value

    def __call__(self, name: str, value: Any) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Real(Check):
    """A finite number within bounds, stored as a float."""

    what: str  # "{name} must be {what}, got ..."
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is outside
    cli_type = float

    def __call__(self, name: str, value: Any) -> float:
        ok = is_number(value) and math.isfinite(value)
        if ok and self.lo is not None:
            ok = value > self.lo if self.lo_open else value >= self.lo
        if ok and self.hi is not None:
            ok = value <= self.hi
        if not ok:
            raise BadRequestError(f"{name} must be {self.what}, got {value!r}")
        return float(value)


@dataclass(frozen=True)
class Whole(Check):
    """An integer at least ``lo`` or one of ``choices``, stored as an int; ``optional``: None too."""

    what: str
    lo: int | None = None
    choices: tuple[int, ...] = ()
    optional: bool = False
    cli_type = int

    def __call__(self, name: str, value: Any) -> int | None:
        if value is None and self.optional:
            return None
        ok = is_int(value) and (self.lo is None or value >= self.lo) and (not self.choices or value in self.choices)
        if not ok:
            raise BadRequestError(f"{name} must be {self.what}, got {value!r}")
        return int(value)


class Texts(Check):
    """A list of non-empty strings, stored as a tuple."""

    def __call__(self, name: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise BadRequestError(f"{name} must be a list of strings, got {value!r}")
        if not all(isinstance(s, str) and s for s in value):
            raise BadRequestError(f"{name} must be non-empty strings, got {list(value)!r}")
        return tuple(value)


class TokenBiases(Check):
    """token id -> bias added to its logit (-inf bans it); None is no bias."""

    def __call__(self, name: str, value: Any) -> dict[int, float]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise BadRequestError(f"{name} must be a mapping token id -> bias, got {type(value).__name__}")
        out: dict[int, float] = {}
        for tok, b in value.items():
            # JSON object keys are strings ("15": -100 in an OpenAI request): digits are taken as the id
            if isinstance(tok, str) and tok.isascii() and tok.isdigit():
                tok = int(tok)
            if not (is_int(tok) and tok >= 0):
                raise BadRequestError(f"{name} keys must be token ids (integers >= 0), got {tok!r}")
            if not (is_number(b) and (math.isfinite(b) or b == -math.inf)):
                raise BadRequestError(f"{name} values must be finite numbers or -inf (a ban), got {b!r} for {tok}")
            out[int(tok)] = float(b)
        return out


class StepOrder(Check):
    """Names of the steps of :data:`STEPS` (or llama.cpp's aliases), a list or one ";"-separated string,
    stored as the steps' names."""

    def __call__(self, name: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = [s for s in value.split(";") if s]
        if not isinstance(value, Sequence) or not all(isinstance(s, str) for s in value):
            raise BadRequestError(f"{name} must be a list of step names, got {value!r}")
        for s in value:
            if s not in BY_NAME:
                known = ", ".join(row.name for row in STEPS)
                raise BadRequestError(f"{name}: unknown step {s!r} (known: {known})")
        return tuple(BY_NAME[s].name for s in value)


def logit_bias_flags(items: list[str]) -> dict[int, float]:
    """``-l TOKEN+BIAS`` / ``TOKEN-BIAS`` (``inf`` for a ban), repeated, as a bias mapping."""
    bias = {}
    for item in items:
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|\d+(?:\.\d*)?|\.\d+)\s*", item)
        if not m:
            raise BadRequestError(f"--logit-bias takes TOKEN+BIAS or TOKEN-BIAS (e.g. 15043+1), got {item!r}")
        value = float(m.group(3))
        bias[int(m.group(1))] = value if m.group(2) == "+" else -value
    return bias


# -- the steps ``samplers`` orders ---------------------------------------------------------------------


@dataclass(frozen=True)
class StepRow:
    name: str  # what ``samplers`` and ``Sampler.describe`` call the step: its class's ``name``
    enabled: Callable[[SamplingParams], bool]  # whether the parameters switch the step on
    aliases: tuple[str, ...] = ()  # llama.cpp's other names for the step
    # named in DEFAULT_SAMPLERS. minfer's default order predates top-n-sigma: a step added since joins
    # the default order only while it is on (at its place in llama.cpp's), so that the default
    # ``samplers`` of every setting without it stays as it was. The chain is the same either way: a
    # step that is off is left out of it.
    listed_when_off: bool = True


STEPS: tuple[StepRow, ...] = (
    StepRow("penalties", lambda p: p.repeat_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)),
    StepRow("dry", lambda p: p.dry_multiplier != 0.0 and p.dry_penalty_last_n != 0),
    StepRow("top_n_sigma", lambda p: p.top_n_sigma > 0, ("top-n-sigma",), listed_when_off=False),
    StepRow("top_k", lambda p: p.top_k > 0, ("top-k",)),
    StepRow("typ_p", lambda p: p.typical_p < 1.0, ("typical_p", "typical-p", "typical", "typ-p", "typ")),
    StepRow("top_p", lambda p: p.top_p < 1.0, ("top-p", "nucleus")),
    StepRow("min_p", lambda p: p.min_p > 0.0, ("min-p",)),
    StepRow("xtc", lambda p: p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5),  # above 0.5 nothing to remove
    StepRow("temperature", lambda p: True, ("temp",)),  # temperature 0 builds the greedy pick
)

# every name and alias -> its row
BY_NAME: Mapping[str, StepRow] = MappingProxyType(
    {name: row for row in STEPS for name in (row.name, *row.aliases)}
)

# the default order of SamplingParams.samplers (llama.cpp's --samplers) while no later step is on
DEFAULT_SAMPLERS: tuple[str, ...] = tuple(row.name for row in STEPS if row.listed_when_off)


def default_samplers(params: SamplingParams) -> tuple[str, ...]:
    """The default order for ``params``: DEFAULT_SAMPLERS, with each step it lists only while on (see
    ``StepRow.listed_when_off``) at its place in llama.cpp's order where ``params`` switch it on."""
    return tuple(row.name for row in STEPS if row.listed_when_off or row.enabled(params))


# -- the metadata ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """What a SamplingParams field says of itself."""

    help: str  # one line, without the default
    check: Check
    flags: tuple[str, ...]  # command-line flags (minfer run/chat/serve)
    repeatable: bool = False  # the flag may be given again and again; the field gets the list of values
    from_cli: Callable[[list[str]], Any] | None = None  # the field's value from a repeatable flag's values
    metavar: str | None = None
    default_help: str | None = None  # the default as --help shows it; None: the field's default itself
    # a request body sets the field under its name, checked by ``check``; False: the server reads it by
    # OpenAI's rules itself (seed, logit_bias)
    request: bool = True
    openai_range: tuple[float, float] | None = None  # an OpenAI field's narrower range, checked first


def _param(default: Any, help: str, check: Check, *, hashed: bool = True, **metadata: Any) -> Any:
    return field(default=default, hash=None if hashed else False,
                 metadata={"param": Param(help, check, **metadata)})


@dataclass(frozen=True)
class SamplingParams:
    """Every sampling setting, checked on creation (a bad one raises ``BadRequestError`` naming it)."""

    temperature: float = _param(0.8, "temperature, 0 = greedy", Real("a finite number >= 0 (0 is greedy)", lo=0.0),
                                flags=("--temp", "--temperature"), openai_range=(0.0, 2.0))
    top_k: int = _param(40, "keep the k most likely tokens, 0 = off", Whole("an integer >= 0 (0 disables it)", lo=0),
                        flags=("--top-k",))
    top_p: float = _param(0.95, "nucleus sampling mass, 1 = off",
                          Real("a number in [0, 1] (1 disables it, 0 keeps only the best token)", lo=0.0, hi=1.0),
                          flags=("--top-p",), openai_range=(0.0, 1.0))
    seed: int | None = _param(None, "random seed", Whole("a non-negative integer or None", lo=0, optional=True),
                              flags=("-s", "--seed"), default_help="a fresh one", request=False)
    min_p: float = _param(0.05, "drop tokens below min_p x the best one's probability, 0 = off",
                          Real("a number in [0, 1] (0 disables it)", lo=0.0, hi=1.0), flags=("--min-p",))
    typical_p: float = _param(1.0, "locally typical sampling mass, 1 = off",
                              Real("a number in (0, 1] (1 disables it)", lo=0.0, hi=1.0, lo_open=True),
                              flags=("--typical",))
    min_keep: int = _param(0, "the truncations keep at least this many tokens", Whole("an integer >= 0", lo=0),
                           flags=("--min-keep",))
    repeat_penalty: float = _param(1.0, "penalize repeated tokens, 1 = off",
                                   Real("a finite number > 0 (1 disables it)", lo=0.0, lo_open=True),
                                   flags=("--repeat-penalty",))
    repeat_last_n: int = _param(64, "window of the penalties, -1 = all",
                                Whole("an integer >= -1 (0 disables the penalties, -1 = all tokens)", lo=-1),
                                flags=("--repeat-last-n",))
    frequency_penalty: float = _param(0.0, "subtract count x this", Real("a finite number (0 disables it)"),
                                      flags=("--frequency-penalty",), openai_range=(-2.0, 2.0))
    presence_penalty: float = _param(0.0, "subtract this once a token appeared",
                                     Real("a finite number (0 disables it)"), flags=("--presence-penalty",),
                                     openai_range=(-2.0, 2.0))
    dry_multiplier: float = _param(0.0, "DRY repetition penalty strength, 0 = off",
                                   Real("a finite number >= 0 (0 disables DRY)", lo=0.0), flags=("--dry-multiplier",))
    dry_base: float = _param(1.75, "DRY exponential base", Real("a finite number >= 1", lo=1.0), flags=("--dry-base",))
    dry_allowed_length: int = _param(2, "DRY: repeats up to this length are free", Whole("an integer >= 1", lo=1),
                                     flags=("--dry-allowed-length",))
    dry_penalty_last_n: int = _param(64, "DRY window, -1 = all",
                                     Whole("an integer >= -1 (0 disables DRY, -1 = all tokens)", lo=-1),
                                     flags=("--dry-penalty-last-n",))
    dry_sequence_breakers: Sequence[str] = _param(DEFAULT_DRY_SEQUENCE_BREAKERS, "DRY sequence breaker", Texts(),
                                                  flags=("--dry-sequence-breaker",), repeatable=True,
                                                  default_help="newline, ':', '\"', '*'")
    xtc_probability: float = _param(0.0, "XTC: chance to exclude top choices",
                                    Real("a number in [0, 1] (0 disables XTC)", lo=0.0, hi=1.0),
                                    flags=("--xtc-probability",))
    xtc_threshold: float = _param(0.1, "XTC: probability threshold",
                                  Real("a number in [0, 1] (above 0.5 XTC removes nothing)", lo=0.0, hi=1.0),
                                  flags=("--xtc-threshold",))
    mirostat: int = _param(0, "mirostat version, 0 = off, 1 or 2", Whole("0 (off), 1 or 2", choices=(0, 1, 2)),
                           flags=("--mirostat",))
    mirostat_tau: float = _param(5.0, "mirostat target entropy tau", Real("a finite number >= 0", lo=0.0),
                                 flags=("--mirostat-ent",))
    mirostat_eta: float = _param(0.1, "mirostat learning rate eta", Real("a finite number >= 0", lo=0.0),
                                 flags=("--mirostat-lr",))
    logit_bias: Mapping[int, float] | None = _param(
        None, "add BIAS to TOKEN's logit, e.g. 15043+1 or 15043-inf", TokenBiases(), hashed=False,
        flags=("-l", "--logit-bias"), repeatable=True, from_cli=logit_bias_flags, metavar="TOKEN(+|-)BIAS",
        request=False)
    samplers: Sequence[str] = _param(DEFAULT_SAMPLERS, "order of the steps, ';'-separated", StepOrder(),
                                     flags=("--samplers",), default_help=";".join(DEFAULT_SAMPLERS))
    top_n_sigma: float = _param(-1.0, "keep the tokens whose logit is within N standard deviations of the best, "
                                "<= 0 = off", Real("a finite number (<= 0 disables it)"),
                                flags=("--top-n-sigma", "--top-nsigma"), metavar="N")

    def __post_init__(self) -> None:
        for name, param in PARAMS.items():
            object.__setattr__(self, name, param.check(name, getattr(self, name)))
        if self.samplers == DEFAULT_SAMPLERS:  # the default order takes in the steps it lists only while on
            object.__setattr__(self, "samplers", default_samplers(self))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# field name -> its metadata, in the dataclass's order
PARAMS: Mapping[str, Param] = MappingProxyType({f.name: f.metadata["param"] for f in fields(SamplingParams)})


def flag_help(name: str) -> str:
    """``--help``'s line for field ``name``: its help and its default."""
    param = PARAMS[name]
    default = param.default_help or SamplingParams.__dataclass_fields__[name].default
    notes = (["repeatable"] if param.repeatable else []) + ([f"default: {default}"] if default is not None else [])
    return f"{param.help} ({'; '.join(notes)})" if notes else param.help
