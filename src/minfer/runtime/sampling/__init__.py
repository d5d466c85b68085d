"""From logits to a token: a chain of small steps with llama.cpp's semantics and defaults.

The modules, one job each:

- :mod:`.params`: :class:`SamplingParams`, every setting in one dataclass whose field metadata (help,
  check, CLI flags, server field) the CLI and the server are generated from; one row per step
  ``samplers`` orders (the parameters that switch it on, llama.cpp's aliases), in llama.cpp's default
  order.
- :mod:`.step`: what a step is: its one declared property, its :class:`~.step.Kind` (what it may do to
  the ranking); the state the steps share.
- the steps: :mod:`.processors` (logit_bias, penalties, DRY), :mod:`.filters` (top_k, top_n_sigma,
  typical-p, top_p, min_p, XTC, temperature), :mod:`.pickers` (the draw, mirostat).
- :mod:`.registry`: the class of each step ``samplers`` orders.
- :mod:`.chain`: :class:`Sampler`, one sequence's chain (reset / accept / sample / sample_with_logprobs)
  and the route it takes (compiled, greedy, fused or steps); :mod:`.candidates`: the candidate set the
  steps work on.
- :mod:`.batched`: :func:`sample_batch`, the one entry for a batch's rows (the engine's step samples
  through it), each row by its sampler's route, the compiled ones in one parallel call;
  :mod:`.compiled`: the default chain's compiled form (the stages its kernel runs).
- :mod:`.logprobs`: the model's log-probabilities (:class:`TokenLogprob`).
- :mod:`.top_k_kernel` and :mod:`.chain_kernel`: the numba kernels of the sampler (top-k over a whole
  vocabulary, the default chain over many rows), compiled whatever kernel set the backend runs;
  :func:`warm_up` loads them before the first request.

Adding a step: its class (declaring its ``kind``, with ``from_params``; ``compile_into`` only if the
compiled kernel runs it) in the registry, its row in
:data:`.params.STEPS`, and its ``SamplingParams`` field with metadata; ``minfer run/chat/serve`` flags, the
server's request field and ``model.generate(...)`` keywords follow from those.

Not carried over from llama.cpp: dynamic temperature, the infill and adaptive-p samplers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from minfer.compiling import CompileJob
from minfer.runtime.sampling.params import DEFAULT_DRY_SEQUENCE_BREAKERS, DEFAULT_SAMPLERS, PARAMS, SamplingParams

if TYPE_CHECKING:
    from minfer.runtime.sampling.batched import sample_batch
    from minfer.runtime.sampling.chain import Sampler
    from minfer.runtime.sampling.logprobs import TokenLogprob, token_logprobs

# imported on first use: the chain's modules load numba (~1 s), which the parameters (the CLI's flags,
# `minfer --help`) do not need
_LAZY = {"Sampler": "chain", "sample_batch": "batched", "TokenLogprob": "logprobs", "token_logprobs": "logprobs"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "DEFAULT_DRY_SEQUENCE_BREAKERS",
    "DEFAULT_SAMPLERS",
    "PARAMS",
    "Sampler",
    "SamplingParams",
    "TokenLogprob",
    "sample_batch",
    "compile_jobs",
    "token_logprobs",
    "warm_up",
]

_HERE = "minfer.runtime.sampling"


def compile_jobs(batched: bool = False) -> list[CompileJob]:
    """The sampler's kernels as compile jobs: top-k over the vocabulary and the default chain of one row
    (every sampled sequence; one job, since the chain's kernel compiles top-k's inside it), and with
    ``batched`` (a server) the chain over many rows and the logit-bias cut."""
    jobs = [CompileJob("sampling", f"{_HERE}:compile_sampler", "sampling",
                       (f"{_HERE}.top_k_kernel:top_k_kernel", f"{_HERE}.chain_kernel:_truncate_one"), 7.0, (False,))]
    if batched:
        jobs.append(CompileJob("sampling:batched", f"{_HERE}:compile_sampler", "sampling",
                               (f"{_HERE}.chain_kernel:_truncate_rows", f"{_HERE}.top_k_kernel:biased_kernel"),
                               6.0, (True,)))
    return jobs


def compile_sampler(batched: bool) -> None:
    """A compile job's body: one sequence's kernels, or (``batched``) those of a batch of rows."""
    from minfer.runtime.sampling import chain_kernel, top_k_kernel

    if batched:
        chain_kernel.warmup_rows(2)
        top_k_kernel.warmup_biased()
    else:
        chain_kernel.warmup_rows(1)
        top_k_kernel.warmup_positions()


def warm_up() -> None:
    """Compile (or load from numba's cache) every sampler kernel, in this process."""
    from minfer.runtime.sampling import chain_kernel, top_k_kernel

    top_k_kernel.warmup()
    chain_kernel.warmup()
