"""PrefillEngine: the prefill worker's model loop, without Ray, one forward at a time.

Prompts enter with :meth:`add_request` and wait; each :meth:`step` asks the replica's one
:class:`~prefill_worker.scheduler.PrefillScheduler` for the next forward (admission, token
budget, chunking, order: its module doc), runs it through the ModelRunner (a later chunk
attends to the earlier ones through the pool), samples the first token of every prompt it
finished and returns those prompts' results with their page lists and KV lengths. The pages
stay owned by the pool until ``release(request_id)`` (after the KV transfer, or by the
single-process generator). :meth:`prefill` is the whole-batch convenience: reserve every
prompt's pages (all or nothing), then step until all are done.

Request life: WAITING (queued, no pages) -> PREFILLING (pages reserved; zero or more chunks
done) -> DONE (first token sampled), or FAILED (its forward raised; pages released), or
ABORTED (:meth:`abort_request`; pages released at once, or after the forward it is in).
A forward out of device memory (``torch.OutOfMemoryError``) runs its prompts again one at a
time; if that fails too they fail as :class:`~serving.errors.PrefillOutOfMemory` (503), the
CUDA cache emptied and one line logged.

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
import logging
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from serving.costs import prefix_reuse_granule
from model_executor.runner import ModelRunner, PrefillItem
from model_executor.sampling import Sampler, SamplingParams, TokenLogprob, make_guide, prompt_logprobs
from serving.errors import PrefillOutOfMemory

from .scheduler import PrefillScheduler, PromptState

logger = logging.getLogger("ray.serve")  # a name only (no Ray import): a replica's log shows it


class PrefillState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class PrefillRequest:
    """``sparse_alpha``: this prompt's FlashPrefill V2 threshold instead of the runner's (0:
    dense); None: the runner's. ``sparse_options``: its other own sparse options, ``(name,
    value)`` pairs of ``last_dense_tiles``, ``energy_rule``, ``dense_layers``
    (``SparseConfig.with_request``). A prompt run with other options than the runner's neither
    reuses nor fills the prefix cache (its K/V differ from the cached pages').
    ``choices``: the sampling params of each choice of a group (``n`` / ``best_of``): one first
    token per choice, each drawn with its own params from the same last-position logits
    (``params`` still decides prompt logprobs); empty: one first token, with ``params``."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    sparse_alpha: float | None = None
    choices: tuple[SamplingParams, ...] = ()
    sparse_options: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    """``first_token`` was sampled from the last prompt position; ``pages`` hold the prompt's
    K/V (``kv_len`` tokens: the first token is *not* in the pool yet)."""

    request_id: str
    first_token: int
    pages: tuple[int, ...]
    kv_len: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    first_logprob: TokenLogprob | None = None  # with params.logprobs
    # with params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # selected over causal (query tile, 64-key tile) pairs of the prompt's sparse forwards, over
    # every layer and KV head (this rank's under TP); None: no chunk of it ran sparse (dense
    # below sparse.dense_below, alpha 0, or every token came from the prefix cache)
    block_density: float | None = None
    # one per choice (``PrefillRequest.choices``; one entry without): first_token is the first
    first_tokens: tuple[int, ...] = ()
    first_logprobs: tuple[TokenLogprob | None, ...] = ()


def _block_density(seq: PromptState) -> float | None:
    selected, causal = seq.extra.get("tiles", (0, 0))
    return selected / causal if causal else None


@dataclass(frozen=True)
class ScheduledChunk:
    """What one forward computed for one prompt: tokens ``[start, start + num_tokens)``."""

    request_id: str
    start: int
    num_tokens: int


@dataclass
class StepOutput:
    """One forward: its chunks in batch order, the prompts it finished, and the prompts that
    failed with it (``(request_id, error)``: their pages are released)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished: list[PrefillResult] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class PrefillEngine:
    """Runs the prefill scheduler's forwards (see the module doc).

    max_batch_tokens: new tokens per forward, at most. chunk_size: prefill every prompt in
    chunks of at most this many tokens (``None``: whole prompts, except that a prompt longer
    than ``max_batch_tokens`` is split at the budget). policy / max_wait_s: the scheduler's
    (``fcfs`` or ``shortest_first`` with its aging bound). cost: ``(prompt_len, done_tokens)
    -> remaining causal work`` for ``shortest_first`` (the replica passes its routing cost
    model's). interleave: False keeps the earlier batch-level discipline (the scheduler's doc),
for benchmarks. prefix_cache: reuse the pool's cached prefix pages and cache finished prompts'
    pages (see the module doc). clock: the scheduler's time (``time.monotonic``).

    Thread safety: :meth:`add_request`, :meth:`abort_request` and the accounting may be called
    from another thread while :meth:`step` runs (one lock guards the scheduler; the forward
    runs outside it).
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_tokens: int = 8192,
        chunk_size: int | None = None,
        sampler: Sampler | None = None,
        prefix_cache: bool = False,
        policy: str = "fcfs",
        max_wait_s: float = 30.0,
        cost=None,
        clock=time.monotonic,
        interleave: bool = True,
        tokenizer=None,
    ) -> None:
        if not isinstance(prefix_cache, bool):
            raise ValueError(f"prefix_cache: expected a bool, got {prefix_cache!r}")
        self.scheduler = PrefillScheduler(max_batch_tokens=max_batch_tokens, chunk_size=chunk_size, policy=policy,
                                          max_wait_s=max_wait_s, cost=cost, admit=self._admit,
                                          interleave=interleave)
        self.prefix_cache = prefix_cache
        self.reuse_granule = prefix_reuse_granule(runner.page_size, sparse=runner.sparse_config.alpha > 0)
        self.runner = runner
        self.tokenizer = tokenizer  # structured output (params.guided) only
        self.pool = runner.pool
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.sampler = sampler or Sampler()
        self.clock = clock
        self._lock = threading.Lock()
        self.forward_batches = 0  # forward passes run (for tests and stats)
        self.oom_above_tokens = 0  # drills: a forward over this many tokens raises torch.OutOfMemoryError

    # -- admission ---------------------------------------------------------------------
    def _validate(self, requests: Sequence[PrefillRequest], name: str = "requests") -> None:
        seen: set[str] = set()
        for i, r in enumerate(requests):
            at = f"{name}[{i}]" if name == "requests" else name
            if not isinstance(r, PrefillRequest):
                raise ValueError(f"{at}: expected a PrefillRequest, got {type(r).__name__}")
            if not isinstance(r.params, SamplingParams):
                raise ValueError(f"{at}.params: expected SamplingParams, got {type(r.params).__name__}")
            if not isinstance(r.choices, tuple) or not all(isinstance(c, SamplingParams) for c in r.choices):
                raise ValueError(f"{at}.choices: expected a tuple of SamplingParams, got {r.choices!r}")
            if len(r.prompt_token_ids) == 0:
                raise ValueError(f"{at}.prompt_token_ids: expected a non-empty prompt")
            a = r.sparse_alpha
            if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0):
                raise ValueError(f"{at}.sparse_alpha: expected None or a float in [0, 1], got {a!r}")
            if r.sparse_options:
                if "alpha" in dict(r.sparse_options):
                    raise ValueError(f"{at}.sparse_options: alpha goes in sparse_alpha")
                self.runner.sparse_config.with_request(r.sparse_options, f"{at}.sparse_options")
            with self._lock:
                scheduled = self.scheduler.get(r.request_id) is not None
            if r.request_id in seen or scheduled or self.pool.has(r.request_id):
                raise ValueError(f"{at}.request_id: {r.request_id!r} is already in use")
            seen.add(r.request_id)

    def _reserve(self, request: PrefillRequest) -> tuple[int, list[bytes]]:
        """Reserve a prompt's pages (raises PoolExhausted, reserving nothing); returns the
        tokens the prefix cache gave and the prompt's full-page digests."""
        rid, n = request.request_id, len(request.prompt_token_ids)
        if not self.prefix_cache or self._own_config(request) is not None:
            self.runner.ensure_capacity(rid, n)
            return 0, []
        digests = self.pool.prefix_digests(request.prompt_token_ids)
        # the last prompt token is always computed: its logits give the first token; prompt
        # logprobs need every position's logits, so such a prompt reuses nothing
        reusable = (n - 1) // self.reuse_granule * self.reuse_granule
        if request.params.prompt_logprobs is not None:
            reusable = 0
        cached = self.pool.reserve_with_prefix(rid, digests[: reusable // self.pool.page_size], n)
        return cached, digests

    def _own_config(self, request: PrefillRequest):
        """The request's sparse config where it differs from the runner's, else None."""
        base = self.runner.sparse_config
        options = dict(request.sparse_options)
        if request.sparse_alpha is not None:
            options["alpha"] = float(request.sparse_alpha)
        own = base.with_request(options)
        return None if own == base else own

    def _forward_or_split(self, chunks: list, items: list, keep: list[bool]) -> tuple[torch.Tensor, dict]:
        """:meth:`_forward`; a forward of several prompts that runs out of device memory runs again
        one prompt at a time (its activations grow with its tokens), all or nothing: a prompt that
        still does not fit alone fails the whole forward, as any failed forward does. Rewriting a
        prompt's K/V slots is harmless: each forward writes only its own chunks' positions."""
        try:
            return self._forward(chunks, items, keep)
        except torch.OutOfMemoryError as exc:
            if len(chunks) == 1:
                raise
            self._free_device_memory(exc)
        logger.warning("prefill forward of %d prompts (%d tokens) out of memory; running them one at a time",
                       len(chunks), sum(c.num_tokens for c in chunks))
        parts = [self._forward([c], [item], [k]) for c, item, k in zip(chunks, items, keep)]
        return torch.cat([logits for logits, _ in parts]), {i: kept[0] for i, (_, kept) in enumerate(parts) if 0 in kept}

    def _forward(self, chunks: list, items: list, keep: list[bool]) -> tuple[torch.Tensor, dict]:
        """One forward, or one per sparse config when prompts of this batch asked for their own."""
        tokens = sum(len(item.token_ids) for item in items)
        if 0 < self.oom_above_tokens < tokens:  # fault_injection.prefill_out_of_memory_tokens
            raise torch.OutOfMemoryError(f"fault injection: a prefill forward of {tokens} tokens out of memory")
        configs = [self._own_config(c.seq.payload) for c in chunks]
        if all(a is None for a in configs):
            out = (self.runner.prefill(items), {}) if not any(keep) else self.runner.prefill_keeping(items, keep)
            self._count_tiles(chunks)
            return out
        logits: torch.Tensor | None = None
        kept: dict = {}
        for config in dict.fromkeys(configs):
            idx = [i for i, a in enumerate(configs) if a == config]
            part, part_kept = self.runner.prefill_keeping([items[i] for i in idx], [keep[i] for i in idx], config)
            self._count_tiles([chunks[i] for i in idx])
            if logits is None:
                logits = part.new_empty((len(items), part.shape[-1]))
            logits[idx] = part
            kept.update({idx[j]: v for j, v in part_kept.items()})
        return logits, kept

    def _count_tiles(self, chunks: list) -> None:
        """Add the latest forward's index counts to each chunk's prompt (its block density)."""
        counts = self.runner.index_tile_counts()
        for c in chunks:
            got = counts.get(c.request_id)
            if got is not None:
                tiles = c.seq.extra.setdefault("tiles", [0, 0])
                tiles[0] += got[0]
                tiles[1] += got[1]

    def _admit(self, seq: PromptState) -> bool:
        from kv_cache import PoolExhausted

        try:
            cached, digests = self._reserve(seq.payload)
        except PoolExhausted:
            return False
        seq.done_tokens = seq.cached_tokens = cached
        seq.extra["digests"] = digests
        return True

    def add_request(self, request: PrefillRequest) -> None:
        """Queue a prompt (WAITING: its pages are reserved when the scheduler first picks it)."""
        self._validate([request], "request")
        with self._lock:
            self.scheduler.add(request.request_id, len(request.prompt_token_ids), self.clock(), request)

    def abort_request(self, request_id: str) -> bool:
        """Drop an unfinished prompt: its pages go back now, or after the forward it is in.
        Returns False if the engine does not hold it (finished, failed or unknown)."""
        with self._lock:
            seq = self.scheduler.get(request_id)
            if seq is None or seq.aborted:
                return False
            seq.aborted = True
            if seq.in_flight:
                return True  # step() releases it after the forward
            self.scheduler.remove(request_id)
        if seq.admitted and self.pool.has(request_id):
            self.pool.release(request_id)
        return True

    # -- accounting --------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self._lock:
            return any(not s.aborted for s in self.scheduler)

    def state(self, request_id: str) -> PrefillState | None:
        """WAITING or PREFILLING while the engine holds the prompt; None once it is out."""
        with self._lock:
            seq = self.scheduler.get(request_id)
            if seq is None:
                return None
            return PrefillState.ABORTED if seq.aborted else (
                PrefillState.PREFILLING if seq.admitted else PrefillState.WAITING)

    def waiting_tokens(self) -> int:
        with self._lock:
            return sum(s.prompt_len for s in self.scheduler.waiting if not s.aborted)

    def num_waiting(self) -> int:
        with self._lock:
            return sum(1 for s in self.scheduler.waiting if not s.aborted)

    def num_running(self) -> int:
        with self._lock:
            return sum(1 for s in self.scheduler.running if not s.aborted)

    def outstanding_cost(self) -> float:
        """Remaining causal work of every unfinished prompt (the scheduler's cost)."""
        with self._lock:
            return sum(self.scheduler.remaining_cost(s) for s in self.scheduler if not s.aborted)

    # -- the forward -------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Run one forward of the scheduler's choosing (an empty output: nothing can run now,
        e.g. the pool has no room for the waiting prompts and none is running)."""
        with self._lock:
            chunks = self.scheduler.schedule(self.clock())
        out = StepOutput([ScheduledChunk(c.request_id, c.start, c.num_tokens) for c in chunks])
        if not chunks:
            return out
        try:
            items = [PrefillItem(c.request_id, c.seq.payload.prompt_token_ids[c.start : c.start + c.num_tokens],
                                 c.start, len(c.seq.payload.prompt_token_ids)) for c in chunks]
            keep = [c.seq.payload.params.prompt_logprobs is not None and not c.seq.aborted for c in chunks]
            logits, kept = self._forward_or_split(chunks, items, keep)
            for i, chunk_logits in kept.items():
                c = chunks[i]
                prompt = c.seq.payload.prompt_token_ids
                entries = c.seq.extra.setdefault("prompt_logprobs", [None] if c.start == 0 else [])
                # position p predicts prompt[p + 1]; the prompt's last position predicts no prompt token
                targets = list(prompt[c.start + 1 : c.start + c.num_tokens + 1])
                entries.extend(prompt_logprobs(chunk_logits, targets, c.seq.payload.params.prompt_logprobs))
            self.forward_batches += 1
            rows = [i for i, c in enumerate(chunks) if c.last and not c.seq.aborted]
            # one sampled row per choice: a group's choices draw from the same logits row
            draws = [(i, p) for i in rows for p in (chunks[i].seq.payload.choices or (chunks[i].seq.payload.params,))]
            tokens, logprobs = [], []
            if draws:
                params = [p for _, p in draws]
                guides = [make_guide(p, self.tokenizer) for p in params]
                sampled = self.sampler.sample(logits[[i for i, _ in draws]], params, [0] * len(draws),
                                              guides=guides if any(g is not None for g in guides) else None)
                tokens, logprobs = sampled.tokens.tolist(), sampled.logprobs
        except BaseException as exc:
            with self._lock:
                failed = self.scheduler.fail(chunks)
            for seq in failed:
                if self.pool.has(seq.request_id):
                    self.pool.release(seq.request_id)
            if isinstance(exc, torch.OutOfMemoryError):
                self._out_of_memory(chunks, exc)
                batch_tokens = sum(c.num_tokens for c in chunks)
                out.failed.extend((seq.request_id, PrefillOutOfMemory(seq.prompt_len, batch_tokens))
                                  for seq in failed if not seq.aborted)
                return out
            out.failed.extend((seq.request_id, exc) for seq in failed if not seq.aborted)
            if not isinstance(exc, Exception):
                raise
            return out
        with self._lock:
            finished, aborted = self.scheduler.commit(chunks)
        first: dict[str, list[int]] = {}
        first_lp: dict[str, list] = {}
        for (i, _), t, lp in zip(draws, tokens, logprobs):
            first.setdefault(chunks[i].request_id, []).append(int(t))
            first_lp.setdefault(chunks[i].request_id, []).append(lp)
        for seq in aborted:
            if self.pool.has(seq.request_id):
                self.pool.release(seq.request_id)
        for seq in finished:
            rid = seq.request_id
            if seq.extra.get("digests"):  # its full pages serve the prompts that start like it
                self.pool.cache_prefix(rid, seq.extra["digests"])
            out.finished.append(PrefillResult(request_id=rid, first_token=first[rid][0], pages=tuple(self.pool.pages(rid)),
                                              kv_len=seq.prompt_len, cached_tokens=seq.cached_tokens,
                                              first_logprob=first_lp[rid][0], block_density=_block_density(seq),
                                              prompt_logprobs=(tuple(seq.extra["prompt_logprobs"])
                                                               if "prompt_logprobs" in seq.extra else None),
                                              first_tokens=tuple(first[rid]), first_logprobs=tuple(first_lp[rid])))
        return out

    def _free_device_memory(self, exc: BaseException) -> None:
        """Let go of the activations a failed forward's frames still hold and hand the
        allocator's cached blocks back, so the next forward starts from an unfragmented heap."""
        traceback.clear_frames(exc.__traceback__)
        if self.pool.device.type == "cuda":
            torch.cuda.empty_cache()

    def _out_of_memory(self, chunks: list, exc: BaseException) -> None:
        """After a forward ran out of device memory (its prompts' pages are back): free what it
        held (:meth:`_free_device_memory`); log one line."""
        self._free_device_memory(exc)
        mem = ""
        if self.pool.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.pool.device)
            mem = f"; device memory {free / 2**30:.2f} of {total / 2**30:.2f} GiB free after empty_cache"
        logger.error(
            "prefill forward out of memory: %d prompts, %d tokens in the forward (prompt lengths %s); "
            "pool %d of %d pages used after freeing theirs%s; failing them with 503 %s",
            len(chunks), sum(c.num_tokens for c in chunks), [c.seq.prompt_len for c in chunks],
            self.pool.used_pages, self.pool.num_pages, mem, PrefillOutOfMemory.CODE)

    def prefill(self, requests: Sequence[PrefillRequest]) -> list[PrefillResult]:
        """Prefill every request now, all or nothing: their pages are reserved together
        (PoolExhausted reserves nothing), then forwards run until all are done (prompts
        already queued with :meth:`add_request` share those forwards). Results in the order
        given; an error in a forward releases every request's pages and is raised."""
        requests = list(requests)
        self._validate(requests)
        if not requests:
            return []
        reserved: list[tuple[PrefillRequest, int, list[bytes]]] = []
        try:
            for r in requests:
                cached, digests = self._reserve(r)
                reserved.append((r, cached, digests))
        except BaseException:
            for r, _, _ in reserved:
                self.pool.release(r.request_id)
            if self.pool.has(requests[len(reserved)].request_id):
                self.pool.release(requests[len(reserved)].request_id)
            raise
        with self._lock:
            now = self.clock()
            for r, cached, digests in reserved:
                seq = self.scheduler.add(r.request_id, len(r.prompt_token_ids), now, r, admitted=True,
                                         done_tokens=cached, cached_tokens=cached)
                seq.extra["digests"] = digests
        ids = {r.request_id for r in requests}
        results: dict[str, PrefillResult] = {}
        try:
            while len(results) < len(ids):
                out = self.step()
                for rid, exc in out.failed:
                    if rid in ids:
                        raise exc
                for res in out.finished:
                    if res.request_id in ids:
                        results[res.request_id] = res
                if not out.chunks:  # pragma: no cover - reserved prompts always run
                    raise RuntimeError("prefill: the scheduler ran nothing for reserved prompts")
        except BaseException:
            for rid in ids:
                self.abort_request(rid)
                if rid in results and self.pool.has(rid):
                    self.pool.release(rid)
            raise
        return [results[r.request_id] for r in requests]

    def release(self, request_id: str) -> int:
        """Give a finished request's pages back to the pool; returns the page count."""
        if not self.pool.has(request_id):
            raise ValueError(f"request_id: {request_id!r} holds no pages")
        return self.pool.release(request_id)


__all__ = [
    "PrefillEngine", "PrefillRequest", "PrefillResult", "PrefillState", "ScheduledChunk", "StepOutput",
    "prefix_reuse_granule",
]
