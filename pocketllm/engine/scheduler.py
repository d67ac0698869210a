"""Continuous batching: requests wait, are admitted into a free slot of the engine when the KV
blocks of their prompt fit in the pool, run together in packed passes, and leave their slot the
moment they finish, so the next waiting request can take it between two passes.

The rule for what a pass carries: every running sequence in admission order, each with either
its next decode row (its prompt is all in) or its next prompt chunk, prompt chunks taking no more
than `prefill_budget` rows of the pass in all. So decode steps and prefill share passes, no
running sequence misses a pass while another's prompt is read, and a prompt longer than the
budget is read over several passes.

KV memory on demand: a sequence takes KV blocks as its positions are written. When the pool cannot
give the running sequences the blocks their next pass needs, the last admitted is preempted: its
blocks are freed and it waits again, first in line, to be recomputed from its prompt and the
tokens it has so far (then it goes on as if never stopped). No request fails for want of blocks.

Prefix caching (prefix_cache.py, when given a budget): where a request finished, and at the end
of each prompt chunk before the last, its positions so far are cached (KV blocks held, GDN state
copied); a request whose tokens start with a cached prefix starts from it and runs only the rest.
Cached blocks no running sequence holds are given back, least recently used first, before any
running request is preempted.

Batch-invariant (the default, engine.invariant; docs/batching.md): a request's tokens depend on
it alone, not on what else runs or how busy the server is. A prompt is read in chunks that end on
multiples of the engine's prefill_chunk (the engine runs each in calls of its own), one chunk of a
sequence per pass, taken when it fits in the budget beside the others' (the first always fits);
a preempted sequence reads its prompt again in the same chunks and then replays the tokens it had
chosen as the decode rows they were, several a pass, so it goes on with the state it had; the
prefix cache keeps only what a prompt's own chunks computed, at a chunk's end (a request that
starts from it gets the bits it would have computed), not where a request stopped after decode
steps. Otherwise (POCKETLLM_BATCH_INVARIANT=0) prompt chunks fill the budget, a preempted
sequence is recomputed as one prompt, and the cache keeps where requests stopped too.

Under TP, rank 0 schedules and samples; each pass's plan (the block and cache operations since the
last, then slots, positions and ids: plan.py) goes to the other ranks in one broadcast of a
fixed-size tensor, and they run the same operations and the same pass (follow), so every rank's
blocks and cache entries are taken and freed alike."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections import deque

import torch

from pocketllm.distributed.state import broadcast_, tp
from pocketllm.engine.budgets import DEFAULT_PREFILL_BUDGET
from pocketllm.engine.pass_plan import EVICT, RELEASE, REPLAY_ROWS, RESTORE, SNAPSHOT, apply, pass_plan_for, run_pass_plan
from pocketllm.engine.prefix_cache import PrefixCache
from pocketllm.engine.request import KVUsage, Request
from pocketllm.engine.sampling import SamplingParams, choose
from pocketllm.errors import CheckpointError, exception_line
from pocketllm.inputs import request_problem
from pocketllm.layers.kv_layout import blocks_for
from pocketllm.ops.fused import step as native_step

# An idle rank 0 sends an empty plan this often, so the other ranks' wait for the next pass never
# reaches the collective timeout however long no request comes.
KEEP_ALIVE_SECONDS = 1.0


class Scheduler:
    """Rank 0's side (every rank's, in lockstep): submit and cancel from any thread, step from one.
    Its step is the one generation loop: generate, the timed runs and serve all make their tokens
    through it."""

    def __init__(
        self, engine, max_running: int, max_len: int, prefill_budget: int = DEFAULT_PREFILL_BUDGET, kv_blocks: int | None = None, prefix_cache_bytes: int = 0,
        lockstep: bool = False,
    ):
        """kv_blocks: the KV pool's size in blocks (Engine.reserve_slots: default, and at most,
        what max_running sequences of max_len fill). prefix_cache_bytes: what the prefix cache's
        copies of GDN state may take (0: no prefix caching); its KV blocks are the pool's.
        lockstep: every rank runs a scheduler of its own on the same requests (generate, the
        timed runs), so no plan is sent: a sampled token is drawn on rank 0 and broadcast, and a
        prompt is read in as few passes as the budget allows (no cache entry needs a pass to end
        at a chunk's end; the engine cuts the chunks inside the pass, with the same bits)."""
        if max_running < 1 or max_len < 1 or prefill_budget < 1:
            raise ValueError(f"max_running, max_len and prefill_budget must be >= 1, got {max_running}, {max_len}, {prefill_budget}")
        if lockstep and prefix_cache_bytes:
            raise ValueError("a lockstep scheduler keeps no prefix cache")
        # A sequence's last token is never fed back, so max_len - 1 positions are read at most: a
        # bench's N timed steps after the prompt's token hold prompt + N + 1 tokens in prompt + N
        # positions. (serve's --max-len and generate's prompt + new tokens are held to the
        # positions themselves, the stricter count users know from transformers and vLLM.)
        if max_len - 1 > engine.cfg.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} would read {max_len - 1} positions, over the model's max_position_embeddings ({engine.cfg.max_position_embeddings})"
            )
        self.engine, self.max_running, self.max_len, self.prefill_budget = engine, max_running, max_len, prefill_budget
        self.lockstep = lockstep
        self.vocab = engine.cfg.vocab_size
        self.invariant, self.chunk = engine.invariant, engine.prefill_chunk
        engine.reserve_slots(max_running, max_len, kv_blocks)
        self.slots = engine.slots
        self.plan = None if lockstep else pass_plan_for(engine, max_running, prefill_budget)
        self._ops: list[tuple[int, int, int, int]] = []  # run here, not yet sent to the other ranks
        self._replay_left = REPLAY_ROWS  # replayed rows this pass may still take
        self.preemptions = 0
        entries = prefix_cache_bytes // max(1, engine.slots.sequence_bytes())
        self.prefix = PrefixCache(entries, self.slots.block_size) if entries > 0 else None
        self.free_slots = list(range(max_running))
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._incoming: deque[Request] = deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.closed = False
        self.last_rows = self.last_spans = 0  # the last step's pass: its rows, and the spans they came in
        self._last_broadcast = time.monotonic()

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(), eos_ids=(), prompt_logits=None) -> Request:
        """Queue a request; it runs from the next step on. ValueError (one line) for what cannot
        run: an empty prompt, a token id outside the vocab, more positions than a slot holds.
        prompt_logits: Request.prompt_logits."""
        problem = request_problem(prompt, max_new_tokens, self.vocab, self.max_len)
        if problem:
            raise ValueError(problem)
        with self._lock:
            if self.closed:
                raise ValueError("the scheduler is closed")
            req = Request(next(self._ids), list(prompt), max_new_tokens, sampling, tuple(eos_ids), prompt_logits=prompt_logits)
            req.generator = torch.Generator().manual_seed(sampling.seed)
            req.stop_ids = sampling.stop_ids(req.eos_ids)
            self._incoming.append(req)
        return req

    def cancel(self, request: Request) -> None:
        """End `request` at the next step, freeing its slot; it ends with finish_reason
        "cancelled" unless it finished first."""
        with self._lock:
            self._cancelled.add(request.id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._incoming)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._incoming)

    def step(self) -> list[tuple[Request, int | None]]:
        """One pass (when any sequence is running): returns each request that got a token with
        it, and (request, None) for one that ended without a token."""
        events: list[tuple[Request, int | None]] = []
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            cancelled, self._cancelled = self._cancelled, set()
        if cancelled:
            for req in [r for r in self.waiting if r.id in cancelled]:
                self.waiting.remove(req)
                events.append((self._finish(req, "cancelled"), None))
            for req in [r for r in self.running if r.id in cancelled]:
                events.append((self._finish(req, "cancelled"), None))
        spans, fed = self._schedule(events)
        self.last_rows = sum(len(ids) for _, _, ids in spans)
        self.last_spans = len(spans)
        if not spans:
            return events
        keep = [req.prompt_logits is not None and start < len(req.prompt) for req, (_, start, _) in zip(fed, spans)]
        self._broadcast(spans, any(keep))
        direct = self._direct_row(spans, fed)
        if direct is None:
            logits = self._run(spans, fed, keep)
            greedy = native_step.argmax_rows(logits) or torch.argmax(logits, dim=-1).tolist()
        # A request's spans are consecutive (replayed rows are one span each): its last one's
        # logits are the ones that may choose a token.
        ends = {id(req): i for i, req in enumerate(fed)}
        host = {}
        if direct is None and logits.device.type != "cpu":
            # A device's rows that sample, to the host where sampling runs in one copy (one wait
            # for it), not one a request.
            sampled = [i for i, req in enumerate(fed) if ends[id(req)] == i and not req.sampling.plain_greedy]
            if sampled:
                host = dict(zip(sampled, logits[sampled].cpu()))
        for req, (_, _, rows) in zip(fed, spans):
            req.fed += len(rows)
        chosen = []
        for i, req in enumerate(fed):
            if ends[id(req)] != i:
                continue
            if self.invariant or req.fed < req.length:
                self._cache(req)
            if req.fed < req.length:
                continue  # a chunk before the last, or a replayed row: its logits choose nothing
            if req.max_new_tokens == 0:
                events.append((self._finish(req, "length"), None))  # read for its prompt's logits alone
                continue
            if direct is None and not req.output and not bool(torch.isfinite(logits[i]).all()):
                # The first token's logits, once per request: weights holding NaN (a corrupt file)
                # make every logit NaN, and argmax would pick token 0 for ever without a word.
                exc = CheckpointError("the model's logits for the prompt are not finite (NaN or inf): its weights are corrupt, "
                                      "or overflow in this --dtype")
                if self.lockstep:
                    raise exc
                events.append((self._fail(req, exc), None))
                continue
            if direct is not None:
                token = direct
            elif req.sampling.plain_greedy:
                token = greedy[i]
            else:
                try:
                    token, logprob = choose(host.get(i, logits[i]), req.sampling, req.prompt, req.output, req.eos_ids, req.generator)
                except Exception as exc:
                    if self.lockstep:
                        raise  # every rank drew alike and fails alike: the run's own error
                    events.append((self._fail(req, exc), None))
                    continue
                if logprob is not None:
                    req.logprobs.append(logprob)
            chosen.append([req, token])
        if self.lockstep and tp().world > 1 and any(not req.sampling.plain_greedy for req, _ in chosen):
            # Every rank drew from the same logits; rank 0's draws are the ones every rank keeps
            # (host data: over the group's CPU backend, as the pass plans go).
            drawn = torch.tensor([token for _, token in chosen], dtype=torch.long)
            broadcast_(drawn)
            for pair, token in zip(chosen, drawn.tolist()):
                pair[1] = token
        for req, token in chosen:
            req.output.append(token)
            events.append((req, token))
            if token in req.stop_ids:
                self._finish(req, "stop")
            elif len(req.output) >= req.max_new_tokens:
                self._finish(req, "length")
        return events

    def _direct_row(self, spans: list, fed: list[Request]) -> int | None:
        """The greedy token of a pass that is one sequence's decode row, where nothing but its
        argmax is read: the engine's greedy_row, which takes it straight to the decode-step
        backend where there is one. None: the pass runs as a whole (_run)."""
        if len(spans) != 1:
            return None
        (slot, start, ids), req = spans[0], fed[0]
        if len(ids) != 1 or start == 0 or start + 1 != req.length or not req.sampling.plain_greedy or req.prompt_logits is not None:
            return None
        return self.engine.greedy_row(slot, start, ids[0])

    def _run(self, spans: list, fed: list[Request], keep: list[bool]) -> torch.Tensor:
        """The pass: the logits of each span's last row [len(spans), V], after handing every
        prompt row's logits to the requests that keep them (keep: per span)."""
        tensors = [(slot, start, torch.tensor(ids, dtype=torch.long)) for slot, start, ids in spans]
        if not any(keep):
            return run_pass_plan(self.engine, [], tensors)
        every = self.engine.run_packed(tensors, all_logits=True)
        ends, row = [], 0
        for req, (_, start, ids), kept in zip(fed, spans, keep):
            if kept:
                req.prompt_logits(start, every[row : row + min(len(ids), len(req.prompt) - start)])
            row += len(ids)
            ends.append(row - 1)
        return every[ends]

    def _schedule(self, events: list) -> tuple[list[tuple[int, int, list[int]]], list[Request]]:
        """This pass's spans and the requests they feed. The running sequences first, preempting
        the last admitted while the pool cannot give them the blocks their rows need; then, if
        none was preempted, waiting requests in order while a slot is free and the blocks of all
        they have (prompt, and tokens so far after a preemption) fit beside what the running
        ones still need for theirs."""
        preempted = False
        while True:
            self._replay_left = REPLAY_ROWS
            spans, fed, budget = self._spans(self.running, self.prefill_budget)
            ends = {req.slot: start + len(rows) for req, (_, start, rows) in zip(fed, spans)}
            need = sum(self.slots.blocks_needed(slot, end) for slot, end in ends.items())
            self._reclaim(need - self.slots.free_blocks)
            if need <= self.slots.free_blocks:
                break
            self._preempt(self.running[-1])
            preempted = True
        if preempted:
            return spans, fed
        bs = self.slots.block_size
        room = self.slots.free_blocks - sum(self.slots.blocks_needed(req.slot, req.length) for req in self.running)
        admitted = []
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.max_new_tokens == 0 and req.prompt_logits is None:
                self.waiting.popleft()
                events.append((self._finish(req, "length"), None))
                continue
            # Batch-invariant, every entry is a prompt's own chunk ends: one for this request's
            # prompt, never into the tokens it chose (it replays those as decode rows). A request
            # that keeps its prompt's logits runs the whole prompt: a cached prefix would skip them.
            hit = None
            if self.prefix is not None and req.prompt_logits is None:
                hit = self.prefix.lookup(req.prompt if self.invariant else req.tokens(req.length))
                if self._wait_for_its_prefix(req, hit):
                    break
            # A hit shares the cached prefix's whole blocks; its partial last block is copied, or,
            # when the pool has no block for the copy and nothing else holds it, taken over.
            cost = blocks_for(req.length, bs) - (hit.length // bs if hit else 0)
            room += self._reclaim(cost - room, keep=hit)
            take = hit is not None and cost > room and self.slots.sole_holder_of_last_block(hit.id)
            if take:
                cost -= 1
            if cost > room:
                break
            room -= cost
            self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            if self.prefix is not None and not req.prefix_counted:
                # A request's hit or miss, at its first admission: a preempted one readmitted is
                # the same request (the counters are of requests).
                self.prefix.count(hit)
                req.prefix_counted = True
            if hit is not None:
                if take:
                    self.prefix.remove(hit.id)
                self._do(RESTORE, req.slot, hit.id, int(take))
                req.fed = hit.length
            self.running.append(req)
            admitted.append(req)
        more, more_fed, _ = self._spans(admitted, budget)
        if self.invariant:
            # Decode and replayed rows first, then the prompt chunks.
            every = sorted(zip(spans + more, fed + more_fed), key=lambda sr: sr[1].prefilling(True))  # stable
            return [s for s, _ in every], [r for _, r in every]
        return spans + more, fed + more_fed

    def _wait_for_its_prefix(self, req: Request, hit) -> bool:
        """Whether `req` should wait for a running request still reading the same prompt to cache a
        chunk end of it that `req` has no entry for yet (a request's n choices, a harness's
        prompts sharing a context): started now, it would read those chunks again beside it, the
        same rows twice; started after, from the entry, bit for bit as a cold start
        (batch-invariant: entries sit at chunk ends only)."""
        if not self.invariant:
            return False
        have = hit.length if hit is not None else 0
        for other in self.running:
            if other.fed >= len(other.prompt) or other.prompt_logits is not None:
                continue  # past its prompt, or caching none of it
            # The last entry `req` could start from: a lookup leaves it one position to run.
            common = min(len(os.path.commonprefix([req.prompt, other.prompt])), len(req.prompt) - 1)
            end = common // self.chunk * self.chunk
            if end > max(other.fed, have) and end >= self.slots.block_size:
                return True
        return False

    def _spans(self, requests: list[Request], budget: int) -> tuple[list, list[Request], int]:
        """(slot, start, ids) for each span of rows this pass feeds, and the request of each, the
        prefill chunks taking at most `budget` rows in all; the budget left."""
        if self.invariant:
            return self._invariant_spans(requests, budget)
        spans, fed = [], []
        for req in requests:
            prefilling = req.prefilling(False)
            if prefilling and budget == 0:
                continue
            rows = req._next_rows(budget)
            if prefilling:
                budget -= len(rows)
            spans.append((req.slot, req.fed, rows))
            fed.append(req)
        return spans, fed, budget

    def _invariant_spans(self, requests: list[Request], budget: int) -> tuple[list, list[Request], int]:
        """Batch-invariant spans: a prompt chunk ending at the next multiple of the engine's chunk
        (or the prompt's end) when it fits the budget (the first one of the pass always does),
        else nothing this pass; after a preemption, the tokens chosen before it as one-row spans
        (up to REPLAY_ROWS of them a pass, in all), the last of which is the decode row that
        chooses the next token; else the decode row. Decode and replayed rows come first in the
        pass, so the engine runs them as one part."""
        rows_first, chunks, fed_first, fed_chunks = [], [], [], []
        for req in requests:
            if req.prefilling(True):
                end = min(len(req.prompt), (req.fed // self.chunk + 1) * self.chunk)
                if self.lockstep and end < len(req.prompt):
                    # As many of its chunks as the budget holds (the engine cuts them in the pass).
                    reach = req.fed + max(budget, end - req.fed)
                    end = len(req.prompt) if reach >= len(req.prompt) else max(end, reach // self.chunk * self.chunk)
                # Past the budget only as the pass's first chunk (a chunk bigger than the budget).
                if end - req.fed > budget and budget < self.prefill_budget:
                    continue
                chunks.append((req.slot, req.fed, req.ids(req.fed, end)))
                fed_chunks.append(req)
                budget -= end - req.fed
                continue
            end = req.fed + 1
            if req.fed < req.length - 1:
                if self._replay_left == 0:
                    continue
                end = min(req.length, req.fed + self._replay_left)
                self._replay_left -= end - req.fed
            for pos in range(req.fed, end):
                rows_first.append((req.slot, pos, req.ids(pos, pos + 1)))
                fed_first.append(req)
        return rows_first + chunks, fed_first + fed_chunks, max(budget, 0)

    def _preempt(self, req: Request) -> None:
        """Take `req`'s blocks and slot back; it waits first in line, to be recomputed."""
        self.running.remove(req)
        self._release(req.slot)
        req.slot, req.fed = None, 0
        req.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, slot: int) -> None:
        self._do(RELEASE, slot)
        self.free_slots.append(slot)

    def _do(self, code: int, a: int, b: int = 0, c: int = 0) -> None:
        """Run a block or cache operation here now, and send it to the other ranks with the next
        plan."""
        op = (code, a, b, c)
        apply(self.engine, [op])
        self._ops.append(op)

    def _cache(self, req: Request) -> None:
        """Cache the positions `req` has run so far (it has at least a block of them), making
        room under the cache's budget by forgetting the least recently used. Batch-invariant, only
        at the end of one of its prompt's chunks that ends on a multiple of the chunk: what any
        request with this prefix computes there in its own prompt's chunks, bit for bit. Not a
        request that keeps its prompt's logits: it never reads the cache (a hit would skip the rows
        it scores), and an evaluation harness sends thousands of them, each of whose chunk ends
        would copy a sequence's state (147 MiB at the 27B) and push out prefixes others read."""
        if self.prefix is None or req.fed < self.slots.block_size or self.closed or req.prompt_logits is not None:
            return
        if self.invariant and (req.fed > len(req.prompt) or req.fed % self.chunk):
            return
        tokens = req.tokens(req.fed)
        known = self.prefix.find(tokens)
        if known is not None:
            self.prefix.touch(known)
            return
        while self.prefix.full:
            self._evict(next(iter(self.prefix.entries)))
        self._do(SNAPSHOT, req.slot, self.prefix.add(tokens).id, req.fed)

    def _evict(self, entry_id: int) -> None:
        self.prefix.remove(entry_id)
        self._do(EVICT, entry_id)

    def _reclaim(self, short: int, keep=None) -> int:
        """Forget cached prefixes, least recently used first, whose blocks nothing else holds,
        until `short` blocks are freed (or none is left to forget); the blocks freed."""
        if self.prefix is None or short <= 0:
            return 0
        before = self.slots.free_blocks
        progress = True
        # Again while it frees something: a prefix's blocks may be held by a longer one too.
        while progress and self.slots.free_blocks - before < short:
            progress = False
            for entry_id in list(self.prefix.entries):
                if self.slots.free_blocks - before >= short:
                    break
                if (keep is None or entry_id != keep.id) and self.slots.frees_a_block(entry_id):
                    self._evict(entry_id)
                    progress = True
        return self.slots.free_blocks - before

    def kv_usage(self) -> KVUsage:
        """The pool's use (read from any thread: a moment's view, not a locked one)."""
        total, running, used = self.slots.block_use()
        usage = KVUsage(total, running, self.slots.block_size, self.preemptions)
        if self.prefix is not None:
            usage.prefix_caching = True
            usage.prefix_hits, usage.prefix_misses, usage.prefix_hit_tokens = self.prefix.hits, self.prefix.misses, self.prefix.hit_tokens
            usage.prefix_entries = len(self.prefix.entries)
            usage.prefix_blocks = max(0, used - running)
        return usage

    def keep_alive(self) -> None:
        """Call while idle (no step to run): tells the other ranks rank 0 is still there."""
        if time.monotonic() - self._last_broadcast >= KEEP_ALIVE_SECONDS:
            self._broadcast([], False)

    def _broadcast(self, spans: list, all_logits: bool) -> None:
        """Send the other ranks the plan: the operations since the last one, the spans, and
        whether the pass reads every row's logits."""
        ops, self._ops = self._ops, []
        if tp().world > 1 and not self.lockstep:
            self.plan.send(ops, spans, all_logits)
            self._last_broadcast = time.monotonic()

    def _finish(self, req: Request, reason: str) -> Request:
        req.finished, req.finish_reason = True, reason
        if req.slot is not None:
            self.running.remove(req)
            # Where it stopped is where a follow-up (a chat's next turn) starts.
            self._cache(req)
            self._release(req.slot)
            req.slot = None
        return req

    def _fail(self, req: Request, exc: Exception) -> Request:
        """End `req` alone for what went wrong choosing its token (its sampling settings met a
        case the sampler does not handle): the pass it was in ran, and every other request goes
        on. Said on stderr in one line, as the error its client gets."""
        req.error = exception_line(exc)
        print(f"pocketllm: request {req.id} failed choosing its token ({req.error}); the others go on", file=sys.stderr, flush=True)
        return self._finish(req, "error")

    def close(self, tell_ranks: bool = True) -> None:
        """End the run for the other ranks (their follow returns). Requests still queued or
        running end as cancelled. tell_ranks False: a pass failed or was interrupted, and may
        have left the other ranks inside one of its collectives, where a broadcast to end their
        follow would meet nothing (this rank would wait out --dist-timeout and fail again): they
        see this rank gone instead."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for req in list(self.running) + list(self.waiting) + list(self._incoming):
            self._finish(req, "cancelled")
        self.waiting.clear()
        self._incoming.clear()
        if tp().world > 1 and not self.lockstep and tell_ranks:
            self.plan.close()
            broadcast_(self.plan.buf)
