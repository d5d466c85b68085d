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

from minfer.runtime.sampling.filters import MinP, Temperature, TopK, TopP, TypicalP, Xtc
from minfer.runtime.sampling.processors import Dry, Penalties
from minfer.runtime.sampling.step import Step

if TYPE_CHECKING:
    from minfer.runtime.sampling.params import SamplingParams


@dataclass(frozen=True)
class StepRow:
    step: type[Step]
    enabled: Callable[[SamplingParams], bool]  # whether the parameters switch the step on
    aliases: tuple[str, ...] = ()  # llama.cpp's other names for the step

    @property
    def name(self) -> str:
        return self.step.name


STEPS: tuple[StepRow, ...] = (
    StepRow(Penalties, lambda p: p.repeat_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)),
    StepRow(Dry, lambda p: p.dry_multiplier != 0.0 and p.dry_penalty_last_n != 0),
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

# the default order of SamplingParams.samplers (llama.cpp's --samplers)
DEFAULT_SAMPLERS: tuple[str, ...] = tuple(row.name for row in STEPS)
