"""DisaggregatedPipeline: the choices of a request through prefill -> KV transfer -> decode,
seen from the ingress. Protocol-free: the HTTP and gRPC front ends consume
:meth:`~DisaggregatedPipeline.stream_choices` (or :meth:`~DisaggregatedPipeline.complete` /
:meth:`~DisaggregatedPipeline.complete_choices`).

A request's life reads as three pieces, each in its own module:
- the request driver (``router/driver.py``, :class:`~router.driver.RequestDriver`): ONE state
  machine for every request, prefill -> transfer -> decode stream per attempt (a single choice
  is a group of one), and who owns the KV pages along the way;
- the retry/resume policy (``router/retry.py``, :class:`~router.retry.RetryPolicy`): which
  failures prefill again, how many times, when a decode replica's death resumes on another
  pair, and which become the client's error;
- the per-choice accounting (``router/reporting.py``, :class:`~router.reporting.ChoiceReporter`):
  each choice's deltas, logprobs, finish reason, timing, routing and metrics.
This module groups the choices (``n``, ``best_of``, a list of prompts) and merges their streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from serving.config import ServiceConfig
from serving.messages import Prefilled
from serving.metrics import Metrics

from .accounting import ChoiceAccount, Completion, Delta, Logprob  # noqa: F401 - Logprob: re-exported
from .driver import RequestDriver, merge, own_serve_request
from .generation import GenerationRequest
from .reporting import ChoiceReporter
from .retry import RetryPolicy


class DisaggregatedPipeline:
    def __init__(self, prefill_handle: Any, decode_handle: Any, config: ServiceConfig, tokenizer: Any,
                 page_size: int | None = None, metrics: Metrics | None = None,
                 release_lease: Callable[[Prefilled], None] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.page_size = page_size or config.kv.page_size
        self.reporter = ChoiceReporter(tokenizer, config, metrics)
        self.metrics = self.reporter.metrics
        self.policy = RetryPolicy(config)
        self.driver = RequestDriver(prefill_handle, decode_handle, config, self.page_size, self.policy,
                                    self.reporter, release_lease)

    async def complete(self, req: GenerationRequest) -> Completion:
        """A single-choice request's answer."""
        return (await self._collect([req]))[0]

    # -- several choices: n, best_of, a list of prompts ---------------------------------
    async def complete_choices(self, req: GenerationRequest) -> tuple[list, int]:
        """Every choice of ``req`` at once: ``([(index, prompt_token_ids, Completion)], tokens
        generated)``. The choices of one prompt are one group (:meth:`stream_group`: one
        prefill, one transfer, forks of the pages on one decode replica); a list of prompts
        runs a group per prompt. ``best_of``: per prompt the ``n`` of highest summed logprob,
        best first. One group failing cancels the others (their streams close, their pages
        are freed)."""
        groups = req.choices()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._complete_group(row)) for row in groups]
        except BaseExceptionGroup as group:  # the first failure, as a single request would raise it
            raise group.exceptions[0] from None
        out, generated = [], 0
        for i, (task, subs) in enumerate(zip(tasks, groups)):
            results = task.result()
            generated += sum(len(r.token_ids) for r in results)
            if req.best_of is not None:
                results = sorted(results, key=lambda r: -sum(e.logprob for e in r.logprobs or ()))[: req.n]
                if req.logprobs is None:
                    results = [dataclasses.replace(r, logprobs=None) for r in results]
            out.extend((i * req.n + j, subs[0].prompt_token_ids, r) for j, r in enumerate(results))
        return out, generated

    async def _complete_group(self, subs: list[GenerationRequest]) -> list[Completion]:
        own_serve_request(subs[0].request_id)
        return await self._collect(subs)

    async def _collect(self, subs: list[GenerationRequest]) -> list[Completion]:
        accounts = [ChoiceAccount.of(sub) for sub in subs]
        async with aclosing(self.stream_group(subs)) as stream:
            async for k, d in stream:
                accounts[k].add(d)
        return [a.completion() for a in accounts]

    async def stream_choices(self, req: GenerationRequest) -> AsyncIterator[tuple[int, Delta]]:
        """``(choice index, Delta)`` of every choice as they come (no ``best_of`` > n: the
        parser refuses to stream it); each choice's last delta has its ``finish_reason``. One
        group per prompt (:meth:`stream_group`; a single-choice request is its own group of
        one, under its own request id). Closing this iterator (or one choice failing) cancels
        every choice still running."""
        groups = [[req]] if req.single else req.choices()
        if len(groups) == 1:
            async with aclosing(self.stream_group(groups[0])) as stream:
                async for item in stream:
                    yield item
            return
        width = len(groups[0])
        streams = {i: self.stream_group(row) for i, row in enumerate(groups)}
        async for i, (k, delta) in merge(streams, {i: row[0].request_id for i, row in enumerate(groups)}):
            yield i * width + k, delta

    async def stream(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """One request's deltas: a group of one (:meth:`stream_group`)."""
        async with aclosing(self.driver.drive([self.reporter.choice(req)])) as stream:
            async for _, delta in stream:
                yield delta

    async def stream_group(self, subs: list[GenerationRequest]) -> AsyncIterator[tuple[int, Delta]]:
        """The choices of one prompt (``req.choices()``'s row: each choice's own seed, logprobs
        and request id), as ``(choice, Delta)`` (:meth:`RequestDriver.drive`). Closing this
        iterator closes the driver at once (its streams close, its lease is released)."""
        async with aclosing(self.driver.drive([self.reporter.choice(sub) for sub in subs])) as stream:
            async for item in stream:
                yield item
