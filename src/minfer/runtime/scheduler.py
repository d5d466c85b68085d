"""The scheduler: what runs in each step, and what each sequence does with its outputs.

:meth:`Scheduler.schedule` decides one forward pass: every running sequence's next token (with its draft,
when it speculates), then as much waiting prompt as the budget allows, padded to a bucket on a padded
engine. :meth:`Scheduler.update` takes that pass's logits (and hidden states) and the tokens the batched
sampler already drew, and advances each sequence: its token, the text it releases, a verified draft, a
stop, a context shift, or the end of its slot. Admission (:meth:`Scheduler.add`, a free slot with the
longest cached prefix) and speculation's draft budgets are decided here too, so this is the one module
that decides what a step runs; the engine only calls it around the forward pass and the sampler.
A pass's records (:class:`~minfer.runtime.batching.Batch`) and the arithmetic of a padded engine's pass
shapes (buckets, the prompt budget's cut) are in :mod:`minfer.runtime.batching`.

On a unified cache (every sequence may grow to the whole context, all drawing blocks from one pool) a
step first makes room for its decode tokens: the cached tokens of idle slots are dropped, least recently
used first, then drafts, then the most recently admitted sequence is preempted (its blocks freed, its
tokens kept); prompt chunks take only the blocks left. A preempted sequence evaluates its tokens again
as a prompt when blocks are free (a *replay*, with no token sampled at its end) and goes on where it was.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from minfer.errors import BadRequestError, ContextOverflowError, MinferError
from minfer.runtime.batching import Batch, PassOutput, batch_buckets, bucket_of, pad_to_buckets, prompt_budget
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.pooling import Pooler
from minfer.runtime.prompt_cache import PromptCache
from minfer.runtime.requests import (
    Embedded,
    EmbeddingRequest,
    EngineHooks,
    Failed,
    Finished,
    GenerationRequest,
    Request,
    Started,
    Token,
)
from minfer.runtime.sequence import Continuation, TokenStep
from minfer.runtime.slots import Slots
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.speculative.draft import Draft
from minfer.runtime.speculative.draft_model import DraftJob, DraftModel
from minfer.runtime.speculative.policy import DRAFT_TOKEN_PRIOR, PassCosts, expected_tokens
from minfer.runtime.speculative.state import SequenceSpeculation, verify_size, verify_sizes
from minfer.runtime.vision import PassImage, check_prompt_images, images_in, whole_images

EndOfContext = Literal["error", "length"]


@dataclass(eq=False)
class Running:
    """A request that holds a slot: how far its prompt is in the cache, and its next token."""

    request: Request
    slot: int
    out: Continuation | None  # None for an embedding, which has ``pool`` instead
    cached: int  # prompt tokens reused from the cache
    n_done: int  # prompt tokens in the cache so far
    next_token: int | None = None  # sampled, to be evaluated at ``pos`` in the next pass
    pos: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    spec: SequenceSpeculation | None = None
    pool: Pooler | None = None
    replay: list[int] | None = None  # preempted: the tokens it held, evaluated again before it goes on
    resume_token: int | None = None  # preempted while decoding: its next token, evaluated after the replay

    @property
    def prompt(self) -> Sequence[int]:
        """What the sequence evaluates as its prompt: the request's, or after a preemption its replay."""
        return self.request.prompt_ids if self.replay is None else self.replay


class Scheduler:
    """The running sequences in ``slots``, and the decisions of every step (see the module's text).

    The slots are the sequences of ``runner.kv`` (the runner also shifts a full slot's context): all of
    them when ``batch_size`` is None, all but the last, the padding scratch, otherwise. ``batch_size``,
    ``end_of_context``, ``speculative`` and ``draft``: as :class:`~minfer.runtime.engine.Engine` takes them."""

    def __init__(
        self,
        runner: ForwardRunner,
        tokenizer: Any,
        batch_size: int | None = None,
        end_of_context: EndOfContext = "error",
        hooks: EngineHooks | None = None,
        speculative: SpeculativeSettings | None = None,
        draft: DraftModel | None = None,
        prompt_cache: PromptCache | None = None,
        measure_costs: bool = True,
        cache_idle_slots: bool = True,
    ) -> None:
        kv = runner.kv
        self.pad_seq: int | None = None  # the cache's scratch sequence that padding tokens go to
        if batch_size is not None:
            if kv.n_seq < 2:
                raise BadRequestError("a padded engine needs a cache with a scratch sequence (slots_kv_cache)")
            self.pad_seq = kv.n_seq - 1
        self.slots = Slots(runner, kv.n_seq if self.pad_seq is None else self.pad_seq, prompt_cache,
                           cache_idle_slots)
        self.kv = kv
        self.tokenizer = tokenizer
        self.n_vocab = runner.model.hparams.n_vocab
        self.model = runner.model
        self.batch_size = batch_size
        self.end_of_context = end_of_context
        self.hooks = hooks or EngineHooks()
        self.buckets = batch_buckets(batch_size) if batch_size is not None else []
        # speculative decoding: what a request without its own settings gets, and the draft model if any
        self.speculative = speculative or SpeculativeSettings()
        self.draft = draft
        # what decode and verifying passes cost: how long a draft pays (measure_costs False: the prior alone)
        self.pass_costs = PassCosts(measure=measure_costs)
        if draft is not None and (draft.capacity != self.slots.capacity or draft.kv.n_seq < self.slots.n_slots):
            raise BadRequestError("the draft model's cache does not match the engine's slots")
        self.check_speculative(self.speculative)
        # replaced, never mutated: another thread may read a consistent list at any time (metrics)
        self.running: list[Running] = []
        self.n_steps = 0
        self.n_preempted = 0
        if self.pad_seq is not None and kv.unified:  # the padding's block (position 0), taken for good
            kv.rows(np.zeros(1, np.int64), self.pad_seq)

    # -- admission ---------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuse a request this engine can never serve (thread-safe: reads only sizes). A bad id is
        refused here: inside a shared forward pass it would fail every sequence of the pass."""
        prompt = request.prompt_ids
        if len(prompt) == 0:
            raise BadRequestError("the prompt is empty (no tokens to start from)")
        images = request.images if isinstance(request, GenerationRequest) else ()
        if images:
            if not self.model.takes_images:
                raise BadRequestError(f"{self.model.path} has no vision model: it cannot take images")
            check_prompt_images(prompt, images, self.n_vocab, self.model.hparams.n_embd)
            longest = max(img.vectors.shape[0] for img in images)
            if self.batch_size is not None and longest > self.batch_size:
                raise BadRequestError(f"an image of {longest} tokens does not fit a pass of the batch size "
                                      f"{self.batch_size} (an image is evaluated in one pass)")
        else:
            for i, t in enumerate(prompt):
                if not 0 <= t < self.n_vocab:
                    raise BadRequestError(f"token id {t} at index {i} is outside the vocabulary "
                                          f"(0..{self.n_vocab - 1})")
        if len(prompt) > self.slots.capacity:
            per_sequence = " tokens per sequence" if self.slots.n_slots > 1 and not self.kv.unified else ""
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens, more than the context of {self.slots.capacity}{per_sequence}",
                n_prompt_tokens=len(prompt), n_ctx=self.slots.capacity,
            )
        if isinstance(request, GenerationRequest) and request.speculative is not None:
            self.check_speculative(request.speculative)

    def check_speculative(self, settings: SpeculativeSettings) -> None:
        """Refuse settings this engine cannot serve: a draft model it does not have, a draft too long."""
        if settings.mode == "draft" and self.draft is None:
            raise BadRequestError("speculative mode 'draft' needs a draft model (load the model with a draft)")
        settings.check_context(self.slots.capacity)

    def add(self, request: Request) -> None:
        """Give ``request`` a free slot (reusing the cached prefix it shares) and emit ``Started``."""
        self.check(request)
        if isinstance(request, EmbeddingRequest):
            slot, _ = self.slots.take(request.prompt_ids, reuse=False)
            request.stats.prompt_tokens = len(request.prompt_ids)
            pool = Pooler(request.pooling, request.normalize)
            self.running = [*self.running, Running(request, slot, None, cached=0, n_done=0, pool=pool)]
            request.emit(Started(0, slot))
            return
        prompt = list(request.prompt_ids)
        room = self.slots.capacity - len(prompt) + 1  # the first token comes from the prompt's last logits
        max_tokens = request.max_tokens
        if max_tokens is None or (self.end_of_context == "length" and max_tokens > room):
            max_tokens = room
        out = Continuation(self.tokenizer, request.sampler, max_tokens, request.stats, request.stop_ids,
                           request.stop, request.logprobs, request.constraint)
        slot, cached = self.slots.take(prompt, reuse=request.reuse_prefix, lora=request.lora)
        out.start(prompt)
        settings = request.speculative or self.speculative
        # drafts never follow an image (a draft model reads none; lookup would copy an image's own ids)
        on = settings.on and not request.images
        spec = SequenceSpeculation(settings, prompt, request.sampler) if on else None
        request.stats.speculative = settings.mode if spec is not None and spec.enabled else "off"
        self.running = [*self.running, Running(request, slot, out, cached=cached, n_done=cached, spec=spec)]
        request.emit(Started(cached, slot))

    def cancel_all(self) -> None:
        """End every running sequence now (reason "cancelled")."""
        for run in self.running:
            self._finish(run, "cancelled")

    def fail_all(self, error: Exception) -> None:
        """A pass failed: its sequences fail with ``error`` (logged unless it is the user's mistake)."""
        if not isinstance(error, MinferError):
            traceback.print_exception(error)
        for run in self.running:
            run.request.emit(Failed(error))
            self._release(run)

    def drop_cancelled(self) -> None:
        """End the sequences whose requests were cancelled (reason "cancelled")."""
        for run in [r for r in self.running if r.request.cancelled.is_set()]:
            self._finish(run, "cancelled")

    def cells_in_use(self) -> int:
        """KV cache positions held by running sequences."""
        return sum(r.n_done if r.next_token is None else r.pos for r in self.running)

    def after_prompt_sizes(self) -> list[int]:
        """The token counts (each with an output per token) of the passes an unpadded engine runs after a
        prompt, for a request with the default settings: the verifying passes' sizes when it speculates,
        largest first (the smaller ones then fit in the arrays its plan took), and one-token decode."""
        sizes = verify_sizes(self.speculative.draft_max) if self.speculative.on else []
        return [*reversed(sizes), 1]

    def bucket(self, n: int) -> int:
        """The token count a padded pass of ``n`` tokens evaluates."""
        return bucket_of(self.buckets, n)

    # -- what a step runs --------------------------------------------------------------------------

    def schedule(self) -> Batch[Running] | None:
        """This step's batch (None: nothing to run). Sequences that were cancelled, or that may produce
        no token (``max_tokens`` 0), end first."""
        self.drop_cancelled()
        for run in [r for r in self.running if r.out is not None and r.out.done]:
            self._finish(run)
        drafts = self._drafts()
        if not self.kv.unified:
            return self._assemble(drafts)
        while True:
            drafts, need = self._make_room(drafts)
            batch = self._assemble(drafts, self.kv.blocks_free - need)
            if batch is not None or not self.running:
                return batch
            # nothing could run: every sequence waits for blocks that others' prompts hold
            victim = self._youngest_holding_blocks()
            if victim is None:
                return None
            self._preempt(victim)

    # -- the blocks of a unified cache -------------------------------------------------------------

    def _decode_blocks(self, drafts: dict[int, Draft] | None) -> int:
        """Blocks this step's decode tokens (with their drafts) take from the pool."""
        n = 0
        for i, run in enumerate(self.running):
            if run.next_token is None:
                continue
            draft = drafts.get(i) if drafts else None
            k = len(draft.tokens) + self._verify_padding(run, len(draft.tokens)) if draft is not None else 0
            n += self.kv.blocks_needed(run.slot, run.pos, run.pos + k)
        return n

    def _make_room(self, drafts: dict[int, Draft] | None) -> tuple[dict[int, Draft] | None, int]:
        """Free blocks for this step's decode tokens: idle slots' cached tokens, then the drafts, then
        running sequences, the most recently admitted first. The drafts that are kept, and the blocks
        the decode tokens take."""
        need = self._decode_blocks(drafts)
        self.slots.reclaim(need)
        if drafts and need > self.kv.blocks_free:
            drafts, need = None, self._decode_blocks(None)
        while need > self.kv.blocks_free:
            victim = self._youngest_holding_blocks()
            if victim is None:  # cannot happen: one sequence never outgrows the pool
                break
            self._preempt(victim)
            need = self._decode_blocks(None)
        return drafts, need

    def _youngest_holding_blocks(self) -> Running | None:
        for run in reversed(self.running):
            if self.kv.n_blocks_held(run.slot):
                return run
        return None

    def _preempt(self, run: Running) -> None:
        """Free ``run``'s blocks; it keeps its slot and its tokens, evaluated again once blocks are free."""
        if run.next_token is not None:
            run.replay = self.kv.tokens(run.slot)[: run.pos]
            run.resume_token, run.next_token = run.next_token, None
        run.n_done = 0
        if run.pool is not None:  # an embedding pools its hidden states again from the first position
            run.pool = Pooler(run.request.pooling, run.request.normalize)  # type: ignore[union-attr]
        self.slots.save(run.slot)  # its blocks into the prompt cache, if there is one, for its resumption
        self.kv.truncate(run.slot, 0)
        run.request.stats.preempted += 1
        self.n_preempted += 1
        if self.hooks.on_preempted:
            self.hooks.on_preempted()

    def _prompt_chunk(self, run: Running, chunk: int, blocks_left: int) -> tuple[int, int]:
        """(tokens, blocks) of the prompt chunk of at most ``chunk`` tokens that ``run`` can write with
        ``blocks_left`` blocks from the pool (idle slots' cached tokens dropped for it if need be)."""
        want = self.kv.blocks_needed(run.slot, run.n_done, run.n_done + chunk - 1)
        if want > blocks_left:
            before = self.kv.blocks_free
            self.slots.reclaim(self.kv.blocks_free + want - blocks_left)
            blocks_left += self.kv.blocks_free - before
            chunk = min(chunk, self.kv.writable_end(run.slot, run.n_done, blocks_left) - run.n_done)
        if chunk <= 0:
            return 0, 0
        return chunk, self.kv.blocks_needed(run.slot, run.n_done, run.n_done + chunk - 1)

    def _assemble(self, drafts: dict[int, Draft] | None, blocks_left: int = 0) -> Batch[Running] | None:
        """Every running sequence's next token (and its draft, if any), then as much waiting prompt as the
        budget allows (on a unified cache, as its ``blocks_left`` free blocks after the decode tokens
        allow)."""
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        outputs: list[int] = []
        sampled: list[Running] = []
        rows: list[int] = []
        drafted: list[Draft | None] = []
        pooled: list[tuple[Running, int, int]] = []
        batch_images: list[PassImage] = []
        n_padding = 0
        for i, run in enumerate(self.running):
            if run.next_token is not None:
                rows.append(len(outputs))
                outputs.append(len(tokens))
                sampled.append(run)
                tokens.append(run.next_token)
                positions.append(run.pos)
                seqs.append(run.slot)
                draft = drafts.get(i) if drafts else None
                drafted.append(draft)
                if draft is not None:  # each draft token is evaluated after the one before, its row sampled
                    k = len(draft.tokens) + self._verify_padding(run, len(draft.tokens))
                    outputs.extend(range(len(tokens), len(tokens) + k))
                    tokens.extend(draft.tokens)
                    tokens.extend([draft.tokens[-1]] * (k - len(draft.tokens)))
                    positions.extend(range(run.pos + 1, run.pos + 1 + k))
                    seqs.extend([run.slot] * k)
                    n_padding += k - len(draft.tokens)
        waiting = sum(len(r.prompt) - r.n_done for r in self.running if r.next_token is None)
        budget = prompt_budget(waiting, len(tokens), self.batch_size, self.buckets)
        n_decode = len(tokens)
        for run in self.running:
            if run.next_token is not None or budget <= 0:
                continue
            prompt = run.prompt
            if run.replay is not None and run.n_done == 0:  # resumed: what other slots and the prompt cache hold
                before = self.kv.blocks_free
                run.n_done = self.slots.resume(run.slot, prompt, max(0, blocks_left))
                blocks_left -= before - self.kv.blocks_free
            chunk = min(len(prompt) - run.n_done, budget)
            images = run.request.images if isinstance(run.request, GenerationRequest) else ()
            if images:  # a pass never ends inside an image, nor grows past the batch size for one
                chunk = whole_images(images, run.n_done, chunk, extend=True)
                if self.batch_size is not None and len(tokens) + chunk > self.batch_size:
                    continue
            if self.kv.unified:
                chunk, taken = self._prompt_chunk(run, chunk, blocks_left)
                if images and chunk and whole_images(images, run.n_done, chunk, extend=False) != chunk:
                    chunk, taken = self._prompt_chunk(run, whole_images(images, run.n_done, chunk, extend=False),
                                                      blocks_left)
                if not chunk:
                    continue
                blocks_left -= taken
            if images:
                batch_images.extend(images_in(images, run.n_done, run.n_done + chunk, len(tokens)))
            tokens.extend(prompt[run.n_done : run.n_done + chunk])
            positions.extend(range(run.n_done, run.n_done + chunk))
            seqs.extend([run.slot] * chunk)
            run.n_done += chunk
            budget -= chunk
            if run.pool is not None:  # an embedding: its hidden states, no logits
                pooled.append((run, len(tokens) - chunk, chunk))
            elif run.n_done == len(prompt) and run.replay is not None:
                # a preempted sequence holds its tokens again: its next token is decoded from the next step
                # on (one preempted during its prompt evaluates the prompt again and samples as any prompt)
                run.next_token, run.pos = run.resume_token, len(prompt)
                run.replay = run.resume_token = None
            elif run.n_done == len(prompt):
                rows.append(len(outputs))
                outputs.append(len(tokens) - 1)
                sampled.append(run)
                drafted.append(None)
        if not tokens:
            return None
        n_real = len(tokens) - n_padding
        spec = drafted if drafts else None
        if not outputs and not pooled:  # a preempted sequence's replay alone: one unused row, as padding has
            outputs.append(len(tokens) - 1)
        if self.pad_seq is None:
            one_seq = len(set(seqs)) == 1  # then the runner records the tokens in one go
            return Batch(tokens, positions, seqs[0] if one_seq else seqs, outputs, sampled, rows, n_real, spec, pooled,
                         n_real - n_decode, batch_images)
        return pad_to_buckets(Batch(tokens, positions, seqs, outputs, sampled, rows, n_real, spec, pooled,
                                    n_real - n_decode, batch_images), self.buckets, self.pad_seq)

    def _verify_padding(self, run: Running, k: int) -> int:
        """Padding rows after a draft of ``k`` tokens in an unpadded engine: its verifying pass is padded to
        the bucket of its settings (:func:`~minfer.runtime.speculative.state.verify_size`), whose plan is
        prepared, by more positions of the same sequence. Their K/V are overwritten later, like those of
        rejected draft tokens, and their rows are not read. 0 where those positions do not fit in the
        slot, or in a padded engine (its whole pass is bucketed)."""
        if self.pad_seq is not None:
            return 0
        assert run.spec is not None
        pad = verify_size(1 + k, run.spec.settings.draft_max) - 1 - k
        return pad if run.pos + 1 + k + pad <= self.slots.capacity else 0

    def _drafts(self) -> dict[int, Draft] | None:
        """Speculation's policy: this step's drafts of the decoding sequences that speculate (by index in
        ``running``), each as long as its sequence's room, its acceptance history and the batch allow.

        A draft must pay for the whole pass (:func:`~minfer.runtime.speculative.policy.best_length`): the
        sequences are taken in turn, each against the pass as it stands with the drafts before it, the
        tokens that pass is expected to give and what it costs; beside many decodes a draft must be kept
        more often than alone, and a batch where none pays runs plain."""
        jobs: list[tuple[int, DraftJob]] = []
        drafts: dict[int, Draft] = {}
        decoding = [r for r in self.running if r.next_token is not None]
        budget = None if self.batch_size is None else self.batch_size - len(decoding)
        n_pass = len(decoding)  # tokens the pass evaluates so far (each draft with its verifying padding)
        expected = float(len(decoding))  # tokens it is expected to give
        drafting = 0.0  # the draft model's passes for the drafts so far, in one-token passes of the target
        for i, run in enumerate(self.running):
            spec = run.spec
            if spec is None or not spec.enabled or run.next_token is None:
                continue
            out = run.out
            assert out is not None
            # a pass emits at most 1 + k tokens; the draft's positions pos+1..pos+k must fit in the slot
            room = min(out.max_tokens - out.stats.generated_tokens - 1, self.slots.capacity - 1 - run.pos)
            if budget is not None:
                room = min(room, budget)
            cost, evaluated, per_token = self._draft_cost(run, n_pass, drafting)
            others = expected - 1
            if spec.settings.mode == "lookup":
                draft = spec.lookup(out.stats.tokens, room, cost, others)
                if draft is not None and out.constraint is not None:  # the grammar's allowed prefix only
                    draft = spec.kept(Draft(draft.tokens[: out.constraint.valid_prefix(draft.tokens)]))
                if draft is None:
                    continue
                drafts[i] = draft
                k = len(draft.tokens)
            else:
                k = spec.draft_length(room, cost, others)
                if not k:
                    continue
                assert spec.draft_sampler is not None
                context = self.kv.tokens(run.slot)[: run.pos] + [run.next_token]
                jobs.append((i, DraftJob(run.slot, context, k, spec.draft_sampler, spec.settings.draft_p_min,
                                         out.stop_ids, out.constraint)))
            if budget is not None:
                budget -= k
            n_pass += evaluated(k)
            expected += expected_tokens(spec.kept_chance(spec.matched), k) - 1
            drafting += k * per_token
        if jobs:
            assert self.draft is not None
            for (i, _), draft in zip(jobs, self.draft.propose([job for _, job in jobs]), strict=True):
                if draft is not None:
                    kept = self.running[i].spec.kept(draft)  # type: ignore[union-attr]
                    if kept is not None:
                        drafts[i] = kept
        return drafts or None

    def _draft_cost(self, run: Running, n_pass: int, drafting: float
                    ) -> tuple[Callable[[int], float], Callable[[int], int], float]:
        """What the pass costs, in one-token passes of the target, with a draft of d tokens from ``run``
        added to its ``n_pass`` tokens and the ``drafting`` its drafts so far cost; the tokens a draft of d
        adds to the pass (with its verifying padding, :meth:`_verify_padding`); and a draft model's cost
        per drafted token. A padded engine's pass is evaluated as its bucket."""
        spec = run.spec
        assert spec is not None
        costs = self.pass_costs
        size = self.bucket if self.pad_seq is not None else (lambda n: n)
        evaluated = lambda d: d + self._verify_padding(run, d) if d else 0  # noqa: E731
        per_token = 0.0
        if spec.settings.mode == "draft":
            assert self.draft is not None
            theirs, ours = self.draft.costs.seconds(1), costs.seconds(1)
            per_token = theirs / ours if theirs and ours else DRAFT_TOKEN_PRIOR
        return (lambda d: costs.relative(size(n_pass + evaluated(d))) + drafting + d * per_token), evaluated, per_token

    # -- what each sequence does with the pass's outputs -------------------------------------------

    def update(self, batch: Batch[Running], output: PassOutput, picks: list[int | Exception | None]) -> None:
        """Advance every sequence of ``batch`` by the pass's ``output``: pool the embeddings' hidden
        states, then give each sampled sequence its token (or verify its draft against its rows).
        ``picks``: the token sampling drew from each sampled sequence's row, or the error that fails it
        (None: a sequence with a draft)."""
        for run, start, n in batch.pooled:
            assert run.pool is not None and output.hidden is not None
            run.pool.add(output.hidden[start : start + n])
            if run.n_done == len(run.request.prompt_ids):
                self._embedded(run, output.ended)
        for run in batch.sampled:
            run.request.stats.target_passes += 1
            if run.next_token is None:
                run.request.stats.prefill_seconds = output.ended - run.started_at
        self.n_steps += 1
        if not batch.n_prompt and not batch.pooled:
            self.pass_costs.record(len(batch.tokens), output.ended - output.started)
        if self.hooks.on_step:
            self.hooks.on_step(batch.n_real, len(batch.sampled), output.ended - output.started)
        logits = output.logits
        for i, (run, row) in enumerate(zip(batch.sampled, batch.rows, strict=True)):
            draft = batch.drafts[i] if batch.drafts is not None else None
            if draft is None:
                self._advance(run, logits[row], picks[i])  # type: ignore[arg-type]
            else:
                self._verify(run, logits[row : row + 1 + len(draft.tokens)], draft)

    def _advance(self, run: Running, logits: np.ndarray, token: int | Exception) -> None:
        assert run.out is not None
        try:
            if isinstance(token, Exception):
                raise token
            step = run.out.take(logits, token)
        except Exception as e:  # noqa: BLE001 - e.g. a constraint with no allowed token: this request only
            run.request.emit(Failed(e))
            self._release(run)
            return
        self._emit(run, step)
        if run.out.done:
            self._finish(run)
            return
        assert step is not None and step.token is not None
        # the token just sampled is evaluated next, right after the prompt or the token before it
        self._move_on(run, step.token, len(run.request.prompt_ids) if run.next_token is None else run.pos + 1)

    def _verify(self, run: Running, rows: np.ndarray, draft: Draft) -> None:
        """Speculation's verify stage. The target's rows after the next token and each draft token (see
        ``Continuation.verify``): the draft tokens it keeps, then its own token in place of the first
        rejected one or after them all."""
        assert run.out is not None and run.spec is not None
        k = len(draft.tokens)
        accepted = 0
        try:
            steps, accepted = run.out.verify(rows, draft)
        except Exception as e:  # noqa: BLE001 - e.g. a constraint with no allowed token: this request only
            run.request.emit(Failed(e))
            self._release(run)
            return
        finally:
            # the cache holds the next token and the kept draft tokens; the rows after them are stale
            self.kv.truncate(run.slot, run.pos + 1 + accepted)
            stats = run.request.stats
            stats.drafted_tokens += k
            stats.accepted_tokens += accepted
            run.spec.verified(k, accepted)
            if self.hooks.on_verified:
                self.hooks.on_verified(k, accepted)
        for step in steps:
            self._emit(run, step)
        if run.out.done:
            self._finish(run)
            return
        last = steps[-1]
        assert last is not None and last.token is not None
        self._move_on(run, last.token, run.pos + len(steps))

    def _emit(self, run: Running, step: TokenStep | None) -> None:
        """Hand a token's step to the request, with its timings."""
        now = time.perf_counter()
        hooks = self.hooks
        if run.first_token_at is None:
            run.first_token_at = now
            if hooks.on_first_token:
                hooks.on_first_token(now - run.request.submitted_at)
        elif hooks.on_token_gap and run.last_token_at is not None:
            hooks.on_token_gap(now - run.last_token_at)
        run.last_token_at = now
        run.request.stats.decode_seconds = now - run.first_token_at
        if step is not None:
            run.request.emit(Token(step))

    def _move_on(self, run: Running, token: int, next_pos: int) -> None:
        """``token`` is evaluated in the next pass, at ``next_pos`` (or after a context shift)."""
        if next_pos >= self.slots.capacity:
            if run.request.context_shift:  # type: ignore[union-attr]
                next_pos = self.slots.shift(run.slot, run.request.n_keep, next_pos)  # type: ignore[union-attr]
            elif self.end_of_context == "length":  # not reached: max_tokens is capped by the room left
                self._finish(run, "length")
                return
            else:
                run.request.emit(Failed(ContextOverflowError(
                    f"generation reached the end of the context: the next token would be at position {next_pos}, "
                    f"n_ctx is {self.slots.capacity} (use a larger context)"
                )))
                self._release(run)
                return
        run.next_token, run.pos = token, next_pos

    def _embedded(self, run: Running, now: float) -> None:
        assert run.pool is not None
        stats = run.request.stats
        stats.prefill_seconds, stats.finish_reason = now - run.started_at, "stop"
        try:
            vector = run.pool.result()
        except Exception as e:  # noqa: BLE001 - this request only
            run.request.emit(Failed(e))
        else:
            if self.hooks.on_finished:
                self.hooks.on_finished(stats, 0)
            run.request.emit(Embedded(vector, stats))
        self._release(run)

    def _finish(self, run: Running, reason: str | None = None) -> None:
        if run.out is None:  # an embedding ended before its vector (cancelled)
            run.request.stats.finish_reason = reason or "cancelled"
            run.request.emit(Finished(run.request.stats, 0))
            self._release(run)
            return
        tail = run.out.finish(reason)
        if tail is not None:
            run.request.emit(Token(tail))
        if self.hooks.on_finished:
            self.hooks.on_finished(run.request.stats, run.cached)
        run.request.emit(Finished(run.request.stats, run.cached))
        self._release(run)

    def _release(self, run: Running) -> None:
        self.running = [r for r in self.running if r is not run]
        self.slots.release(run.slot, self.n_steps)
