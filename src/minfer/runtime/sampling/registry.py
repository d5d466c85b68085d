"""The class of each step ``SamplingParams.samplers`` orders (:data:`.params.STEPS` names them, in
llama.cpp's default order, and says which parameters switch each on).

A class's ``name`` is its row's (what ``samplers`` and ``Sampler.describe`` call the step), its
``from_params`` builds it. The frame around these steps is ``Sampler``'s, as in llama.cpp's
``common_sampler``: ``logit_bias`` first whatever the order, the draw (``dist``) last; with ``mirostat``
only ``temperature`` and mirostat, none of these steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from minfer.runtime.sampling.filters import MinP, Temperature, TopK, TopNSigma, TopP, TypicalP, Xtc
from minfer.runtime.sampling.params import STEPS
from minfer.runtime.sampling.processors import Dry, Penalties
from minfer.runtime.sampling.step import Step

# step name -> its class
STEP_CLASSES: Mapping[str, type[Step]] = MappingProxyType(
    {step.name: step for step in (Penalties, Dry, TopNSigma, TopK, TypicalP, TopP, MinP, Xtc, Temperature)}
)
if STEP_CLASSES.keys() != {row.name for row in STEPS}:
    raise TypeError(f"the step classes ({', '.join(STEP_CLASSES)}) are not the steps samplers names "
                    f"({', '.join(row.name for row in STEPS)})")
