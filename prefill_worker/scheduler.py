"""PrefillScheduler: the one prefill scheduler of a replica (no model, no pool, no Ray).

It owns admission, the token budget, chunking and ordering, one forward at a time: each
:meth:`schedule` call picks the chunks of the next forward from the waiting and the running
prompts together, at most ``max_batch_tokens`` new tokens in all and one chunk per prompt. A
running prompt (admitted, some chunks done) keeps its KV pages between forwards, so a prompt
that is passed over for a step loses nothing: it resumes where it stopped (preemption at chunk
granularity, no recompute).

Policies (``policy``):

``fcfs``
    Arrival order. A running prompt's chunk goes first; the budget it leaves goes to the next
    prompts in arrival order in the same forward (split at the budget with chunked prefill).
    Admission is in arrival order too: a waiting prompt the pool has no room for holds back
    the ones behind it (no overtaking, no starvation).
``shortest_first``
    Each forward picks by *remaining* causal work (``cost(prompt_len, done_tokens)``; ties in
    arrival order), so a short prompt that arrives while a long one is being chunked runs at
    the next chunk boundary and the long one resumes after it (with what budget is left in
    that forward). A prompt that has waited ``max_wait_s`` since its arrival without finishing
    goes ahead of every younger one (arrival order among them), which bounds how long a long
    prompt can be passed over; such an overdue prompt that the pool has no room for stops
    younger prompts from being admitted until it is.

vLLM's default chunked prefill keeps a running prompt's chunk first whatever arrives (no
preemption); ``shortest_first`` preempts at chunk boundaries.

Admission reserves a prompt's pages for its whole length the first time the scheduler picks
it (the ``admit`` callback: the engine reserves them, reusing cached prefix pages, and says
how many tokens are already done); a prompt is never admitted before it can run. Without
``chunk_size`` a prompt runs whole (with others while the budget holds), except that a prompt
longer than ``max_batch_tokens`` is split at the budget. ``interleave=False`` keeps the
earlier batch-level discipline for comparison (:meth:`PrefillScheduler._admit_batch`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PREFILL_POLICIES = ("fcfs", "shortest_first")


@dataclass(eq=False)
class PromptState:
    """One prompt in the scheduler. ``done_tokens`` counts prompt tokens whose K/V are in the
    pool (cached prefix included); ``cached_tokens`` those that came from the prefix cache."""

    request_id: str
    prompt_len: int
    arrival: float
    order: int  # arrival order (ties of ``arrival``)
    payload: Any = None  # the engine's request
    admitted: bool = False
    done_tokens: int = 0
    cached_tokens: int = 0
    aborted: bool = False
    in_flight: bool = False  # a chunk of it is in the forward that is running
    extra: dict = field(default_factory=dict)  # the engine's per-prompt state (prefix digests)

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.done_tokens


@dataclass(frozen=True)
class Chunk:
    """``num_tokens`` prompt tokens of ``seq`` from position ``start`` in the next forward."""

    seq: PromptState
    start: int
    num_tokens: int

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def last(self) -> bool:
        """The prompt's last chunk: its logits give the first token."""
        return self.start + self.num_tokens == self.seq.prompt_len


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


class PrefillScheduler:
    """See the module doc. ``cost(prompt_len, done_tokens)``: the remaining causal work that
    ``shortest_first`` orders by (default: the causal pairs left, ``(L - d) * (L + d + 1) / 2``).
    ``admit(seq)``: reserve the prompt's pages and set ``seq.done_tokens`` / ``cached_tokens``;
    returns False when the pool has no room (nothing reserved)."""

    def __init__(
        self,
        *,
        max_batch_tokens: int,
        chunk_size: int | None = None,
        policy: str = "fcfs",
        max_wait_s: float = 30.0,
        cost: Callable[[int, int], float] | None = None,
        admit: Callable[[PromptState], bool] | None = None,
        interleave: bool = True,
    ) -> None:
        _check_int("max_batch_tokens", max_batch_tokens, 1)
        if chunk_size is not None:
            _check_int("chunk_size", chunk_size, 1)
        if policy not in PREFILL_POLICIES:
            raise ValueError(f"policy: expected one of {PREFILL_POLICIES}, got {policy!r}")
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s >= 0:
            raise ValueError(f"max_wait_s: expected a number >= 0, got {max_wait_s!r}")
        if not isinstance(interleave, bool):
            raise ValueError(f"interleave: expected a bool, got {interleave!r}")
        self.interleave = interleave
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.policy = policy
        self.max_wait_s = float(max_wait_s)
        self.cost = cost or (lambda n, done: (n - done) * (n + done + 1) / 2.0)
        self.admit = admit or (lambda seq: True)
        self._seqs: dict[str, PromptState] = {}  # unfinished prompts, in arrival order
        self._order = itertools.count()
        self.steps = 0  # forwards scheduled

    # -- the queue ---------------------------------------------------------------------
    def add(self, request_id: str, prompt_len: int, now: float, payload: Any = None, *,
            admitted: bool = False, done_tokens: int = 0, cached_tokens: int = 0) -> PromptState:
        """A new prompt (``admitted``: its pages are already reserved, e.g. by a caller that
        reserves a whole batch at once)."""
        if request_id in self._seqs:
            raise ValueError(f"request_id: {request_id!r} is already scheduled")
        _check_int("prompt_len", prompt_len, 1)
        if not 0 <= done_tokens < prompt_len:
            raise ValueError(f"done_tokens: expected 0 <= done_tokens < prompt_len ({prompt_len}), got {done_tokens}")
        seq = PromptState(request_id, prompt_len, float(now), next(self._order), payload, admitted=admitted,
                        done_tokens=done_tokens, cached_tokens=cached_tokens)
        self._seqs[request_id] = seq
        return seq

    def get(self, request_id: str) -> PromptState | None:
        return self._seqs.get(request_id)

    def remove(self, request_id: str) -> PromptState | None:
        """Take a prompt out (finished, failed or aborted); returns it, or None if unknown."""
        return self._seqs.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self):
        return iter(list(self._seqs.values()))

    @property
    def waiting(self) -> list[PromptState]:
        return [s for s in self._seqs.values() if not s.admitted]

    @property
    def running(self) -> list[PromptState]:
        return [s for s in self._seqs.values() if s.admitted]

    def remaining_cost(self, seq: PromptState) -> float:
        return float(self.cost(seq.prompt_len, seq.done_tokens))

    # -- one forward -------------------------------------------------------------------
    def ordered(self, now: float) -> list[PromptState]:
        """The unfinished prompts in the order the policy serves them at ``now``."""
        live = [s for s in self._seqs.values() if not s.aborted]
        if self.policy == "fcfs":
            return live  # dict order is arrival order
        overdue = [s for s in live if now - s.arrival >= self.max_wait_s]
        younger = [s for s in live if now - s.arrival < self.max_wait_s]
        return overdue + sorted(younger, key=lambda s: (self.remaining_cost(s), s.order))

    def _admit_batch(self, now: float) -> None:
        """``interleave=False``: the batch-level discipline of the engine before this scheduler
        (kept to measure against, ``benchmarks/bench_scheduler.py``): when nothing runs, admit
        whole prompts in the policy's order while their lengths fit the budget (the first one
        always) or the pool has room; they then run, chunked, until all are done, and nothing
        else is admitted meanwhile."""
        budget = self.max_batch_tokens
        first = True
        for seq in self.ordered(now):
            if not first and seq.prompt_len > budget:
                break
            if not self.admit(seq):
                break
            seq.admitted = True
            budget -= seq.prompt_len
            first = False

    def schedule(self, now: float) -> list[Chunk]:
        """The chunks of the next forward (empty: nothing can run, e.g. no room in the pool)."""
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        admitting = self.interleave
        if not self.interleave and not any(s.admitted and not s.aborted for s in self._seqs.values()):
            self._admit_batch(now)
        for seq in self.ordered(now):
            if budget == 0:
                break
            take = seq.remaining if seq.admitted else seq.prompt_len  # before admission: the whole prompt
            if self.chunk_size is not None:
                take = min(take, self.chunk_size)
            if take > budget:
                if self.chunk_size is None and chunks:
                    # whole prompts: it waits for a forward of its own
                    if self.policy == "fcfs":
                        break
                    continue
                take = budget
            if not seq.admitted:
                if not admitting:
                    continue
                if not self.admit(seq):
                    # no room: under fcfs nothing behind it is admitted; under shortest_first an
                    # overdue prompt keeps its turn the same way
                    if self.policy == "fcfs" or now - seq.arrival >= self.max_wait_s:
                        admitting = False
                    continue
                seq.admitted = True
                # a cached prefix may leave less to do
                take = min(take, seq.remaining)
            if take <= 0:  # pragma: no cover - a prompt with nothing left is never kept
                continue
            chunks.append(Chunk(seq, seq.done_tokens, take))
            budget -= take
        for c in chunks:
            c.seq.in_flight = True
        if chunks:
            self.steps += 1
        return chunks

    def commit(self, chunks: list[Chunk]) -> tuple[list[PromptState], list[PromptState]]:
        """The forward of ``chunks`` ran: advance them. Returns ``(finished, aborted)``, both
        taken out: the prompts it finished, and those aborted while it ran (the caller releases
        their pages)."""
        finished, aborted = [], []
        for c in chunks:
            seq = c.seq
            seq.in_flight = False
            seq.done_tokens = c.start + c.num_tokens
            if seq.aborted:
                aborted.append(seq)
                self._seqs.pop(seq.request_id, None)
            elif seq.remaining == 0:
                finished.append(seq)
                self._seqs.pop(seq.request_id, None)
        return finished, aborted

    def fail(self, chunks: list[Chunk]) -> list[PromptState]:
        """The forward of ``chunks`` failed: its prompts are taken out (the caller releases)."""
        out = []
        for c in chunks:
            c.seq.in_flight = False
            if self._seqs.pop(c.seq.request_id, None) is not None:
                out.append(c.seq)
        return out


def tokens_in(chunks: list[Chunk]) -> int:
    return sum(c.num_tokens for c in chunks)


__all__ = ["PREFILL_POLICIES", "Chunk", "PrefillScheduler", "PromptState", "tokens_in"]
