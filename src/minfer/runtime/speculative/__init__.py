"""Speculative decoding: a cheap drafter proposes the next tokens, the target model checks them all in one pass.

A verifying pass over k drafted tokens reads the weights once, as a one-token pass does, so every accepted
draft token is a decode step saved. The engine step (:mod:`minfer.runtime.engine`) does the verification:
a decoding sequence with a draft evaluates its next token and the draft tokens at their positions (several
sequences share the pass), and each output row decides one drafted token. Rows past a rejection hold
K/V nobody reads: positions are data, so they are overwritten by the next pass.

The modules, one job each:

- :mod:`.settings`: :class:`SpeculativeSettings`, the mode (off, lookup, draft) and its limits.
- :mod:`.lookup`: prompt lookup, n-gram drafts taken from the prompt and the text generated so far.
- :mod:`.draft_model`: a second, smaller model with its own KV cache drafting for the target.
- :mod:`.verify`: the acceptance rule (speculative rejection sampling) that keeps the output distributed
  exactly as the target's sampler chain, and identical to plain decoding at temperature 0.
- :mod:`.state`: one sequence's drafting state (its token history, its draft length, its counters).
"""

from minfer.runtime.speculative.settings import MODES, SpeculativeSettings, resolve

__all__ = ["MODES", "SpeculativeSettings", "resolve"]
