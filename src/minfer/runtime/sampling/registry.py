"""The steps ``SamplingParams.samplers`` orders: one row each, in llama.cpp's default order.

A row names the step's class (whose ``name`` is what ``samplers`` and ``Sampler.describe`` call it, whose
``from_params`` builds it), which parameters switch it on, and llama.cpp's other spellings of its name
(``common_sampler_types_from_names``). Its place in the table is its place in llama.cpp's default
order (``common_params_sampling::samplers``). The frame around these steps is ``Sampler``'s, as in
llama.cpp's ``common_sampler``: ``logit_bias`` first whatever the order, the draw (``dist``) last; with
``mirostat`` only ``temperature`` and mirostat, none of these steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from minfer.runtime.sampling.filters import MinP, Temperature, TopK, TopNSigma, TopP, TypicalP, Xtc
from minfer.runtime.sampling.processors import Dry, Penalties
from minfer.runtime.sampling.step import Step

if TYPE_CHECKING:
    from minfer.runtime.sampling.params import SamplingParams


@dataclass(frozen=True)
class StepRow:
    step: type[Step]
    enabled: Callable[[SamplingParams], bool]  # whether the parameters switch the step on
    aliases: tuple[str, ...] = ()  # llama.cpp's other names for the step
    # named in DEFAULT_SAMPLERS. minfer's default order predates top-n-sigma: a step added since joins
    # the default order only while it is on (at its place in llama.cpp's), so that the default
    # ``samplers`` of every setting without it stays as it was. The chain is the same either way: a
    # step that is off is left out of it.
    listed_when_off: bool = True

    @property
    def name(self) -> str:
        return self.step.name


STEPS: tuple[StepRow, ...] = (
    StepRow(Penalties, lambda p: p.repeat_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)),
    StepRow(Dry, lambda p: p.dry_multiplier != 0.0 and p.dry_penalty_last_n != 0),
    StepRow(TopNSigma, lambda p: p.top_n_sigma > 0, ("top-n-sigma",), listed_when_off=False),
    StepRow(TopK, lambda p: p.top_k > 0, ("top-k",)),
    StepRow(TypicalP, lambda p: p.typical_p < 1.0, ("typical_p", "typical-p", "typical", "typ-p", "typ")),
    StepRow(TopP, lambda p: p.top_p < 1.0, ("top-p", "nucleus")),
    StepRow(MinP, lambda p: p.min_p > 0.0, ("min-p",)),
    StepRow(Xtc, lambda p: p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5),  # above 0.5 nothing to remove
    StepRow(Temperature, lambda p: True, ("temp",)),  # temperature 0 builds the greedy pick
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
