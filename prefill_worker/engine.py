"""PrefillEngine: the prefill worker's model loop, without Ray.

Takes a batch of prompts, reserves their pages (all or nothing), runs the prompts through
the ModelRunner in forward batches bounded by a token budget (optionally in chunks: a later
chunk attends to the earlier ones through the pool), samples each request's first token and
returns it with the request's page list and KV length. The pages stay owned by the pool
until ``release(request_id)`` (after the KV transfer, or by the single-process generator).

Request life: WAITING (pages reserved) -> PREFILLING (some chunks done) -> DONE (first token
sampled), or FAILED (error; pages released).

Prefix cache (``prefix_cache=True``): a prompt whose leading full pages match a prompt prefilled
before (``KVPool.prefix_digests``: same tokens from the first one) takes those pages from the
pool's cache and computes only the rest, as a chunk after a cached prefix (``cached_len``); at
least its last token is always computed (its logits give the first token). A prompt that
finishes registers its full pages for the next ones. ``PrefillResult.cached_tokens`` says how
many tokens were reused. With sparse prefill (``alpha > 0``) the reused prefix is a multiple of
the operator's query tile (``Q_TILE`` = 128 packed rows, so a multiple of 128 tokens also for
any GQA group): the new tokens' tiles then line up with the tiles of a whole-prompt prefill,
and SPEC.md's block selection (per tile, over absolute key blocks) is the same, so a hit
computes what a miss would in the same batch (what else shares a forward still matters as
without the cache: ``dense_below`` is decided per batch, and FP8 quantizes q per batch).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kernels.config import Q_TILE
from model_executor.runner import ModelRunner, PrefillItem
from model_executor.sampling import Sampler, SamplingParams


def prefix_reuse_granule(page_size: int, *, sparse: bool) -> int:
    """Tokens a prefix-cache hit reuses at a time: whole pages; with sparse prefill whole query
    tiles too (see the module doc). The router estimates a hit's saving with it."""
    return math.lcm(page_size, Q_TILE) if sparse else page_size


class PrefillState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class PrefillResult:
    """``first_token`` was sampled from the last prompt position; ``pages`` hold the prompt's
    K/V (``kv_len`` tokens: the first token is *not* in the pool yet)."""

    request_id: str
    first_token: int
    pages: tuple[int, ...]
    kv_len: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


@dataclass
class _Prefilling:
    request: PrefillRequest
    state: PrefillState = PrefillState.WAITING
    done_tokens: int = 0
    first_token: int | None = None
    cached_tokens: int = 0
    digests: list[bytes] = field(default_factory=list)  # prefix cache: the prompt's full pages

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.done_tokens


class PrefillEngine:
    """Batches prompts by ``max_batch_tokens`` new tokens per forward.

    chunk_size: prefill every prompt in chunks of at most this many tokens (``None``: whole
    prompts, except that a prompt longer than ``max_batch_tokens`` is split at the budget).
    prefix_cache: reuse the pool's cached prefix pages and cache finished prompts' pages (see
    the module doc).
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_tokens: int = 8192,
        chunk_size: int | None = None,
        sampler: Sampler | None = None,
        prefix_cache: bool = False,
    ) -> None:
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: expected an int >= 1, got {max_batch_tokens!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache: expected a bool, got {prefix_cache!r}")
        self.prefix_cache = prefix_cache
        self.reuse_granule = prefix_reuse_granule(runner.page_size, sparse=runner.sparse_config.alpha > 0)
        self.runner = runner
        self.pool = runner.pool
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.sampler = sampler or Sampler()
        self.forward_batches = 0  # forward passes run (for tests and stats)

    def _validate(self, requests: Sequence[PrefillRequest]) -> None:
        seen: set[str] = set()
        for i, r in enumerate(requests):
            if not isinstance(r, PrefillRequest):
                raise ValueError(f"requests[{i}]: expected a PrefillRequest, got {type(r).__name__}")
            if not isinstance(r.params, SamplingParams):
                raise ValueError(f"requests[{i}].params: expected SamplingParams, got {type(r.params).__name__}")
            if len(r.prompt_token_ids) == 0:
                raise ValueError(f"requests[{i}].prompt_token_ids: expected a non-empty prompt")
            if r.request_id in seen or self.pool.has(r.request_id):
                raise ValueError(f"requests[{i}].request_id: {r.request_id!r} is already in use")
            seen.add(r.request_id)

    def _reserve_all(self, live: Sequence[_Prefilling]) -> None:
        """All or nothing: on PoolExhausted, the pages reserved here are given back. With the
        prefix cache, each request starts past its cached prefix."""
        reserved: list[str] = []
        try:
            for s in live:
                rid, n = s.request.request_id, s.prompt_len
                if self.prefix_cache:
                    s.digests = self.pool.prefix_digests(s.request.prompt_token_ids)
                    # the last prompt token is always computed: its logits give the first token
                    reusable = (n - 1) // self.reuse_granule * self.reuse_granule
                    usable = s.digests[: reusable // self.pool.page_size]
                    s.cached_tokens = s.done_tokens = self.pool.reserve_with_prefix(rid, usable, n)
                else:
                    self.runner.ensure_capacity(rid, n)
                reserved.append(rid)
        except BaseException:
            for rid in reserved:
                self.pool.release(rid)
            if self.pool.has(live[len(reserved)].request.request_id):
                self.pool.release(live[len(reserved)].request.request_id)
            raise

    def _next_batch(self, live: list[_Prefilling]) -> list[tuple[_Prefilling, int]]:
        budget = self.max_batch_tokens
        batch: list[tuple[_Prefilling, int]] = []
        for s in live:
            if s.remaining == 0:
                continue
            take = min(s.remaining, self.chunk_size or s.remaining)
            if take > budget:
                if batch and self.chunk_size is None:
                    break  # whole prompts: wait for the next forward
                take = budget
            if take == 0:
                break
            batch.append((s, take))
            budget -= take
        return batch

    def prefill(self, requests: Sequence[PrefillRequest]) -> list[PrefillResult]:
        """Prefill every request; results in the order given."""
        requests = list(requests)
        self._validate(requests)
        if not requests:
            return []
        live = [_Prefilling(r) for r in requests]
        self._reserve_all(live)
        try:
            while any(s.remaining for s in live):
                batch = self._next_batch(live)
                items = [
                    PrefillItem(
                        s.request.request_id,
                        s.request.prompt_token_ids[s.done_tokens : s.done_tokens + take],
                        s.done_tokens,
                    )
                    for s, take in batch
                ]
                logits = self.runner.prefill(items)
                self.forward_batches += 1
                finishing = []
                for row, (s, take) in enumerate(batch):
                    s.done_tokens += take
                    s.state = PrefillState.PREFILLING
                    if s.remaining == 0:
                        finishing.append((row, s))
                if finishing:
                    rows = [row for row, _ in finishing]
                    tokens = self.sampler(
                        logits[rows], [s.request.params for _, s in finishing], [0] * len(rows)
                    ).tolist()
                    for (_, s), tok in zip(finishing, tokens):
                        s.first_token = int(tok)
                        s.state = PrefillState.DONE
                        if s.digests:  # its full pages serve the prompts that start like it
                            self.pool.cache_prefix(s.request.request_id, s.digests)
        except BaseException:
            for s in live:
                s.state = PrefillState.FAILED
                if self.pool.has(s.request.request_id):
                    self.pool.release(s.request.request_id)
            raise
        return [
            PrefillResult(
                request_id=s.request.request_id,
                first_token=s.first_token,
                pages=tuple(self.pool.pages(s.request.request_id)),
                kv_len=s.prompt_len,
                cached_tokens=s.cached_tokens,
            )
            for s in live
        ]

    def release(self, request_id: str) -> int:
        """Give a finished request's pages back to the pool; returns the page count."""
        if not self.pool.has(request_id):
            raise ValueError(f"request_id: {request_id!r} holds no pages")
        return self.pool.release(request_id)
