"""PrefillBatcher: batch formation and the two schedules (fcfs, shortest_first with its aging
bound), on a fake engine that records the batches it runs (no model, no Ray actors)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("ray.serve")

from prefill_worker.deployment import PrefillBatcher, _Queued  # noqa: E402
from prefill_worker.engine import PrefillRequest, PrefillResult  # noqa: E402
from router.config import ServiceConfig  # noqa: E402


class FakePool:
    page_size = 64

    def __init__(self, num_pages: int) -> None:
        self.num_pages = self.free_pages = num_pages

    def pages_for(self, n: int) -> int:
        return -(-n // self.page_size)

    def release(self, request_id: str) -> None:
        pass


class FakeEngine:
    """Runs batches in order; the first one waits for ``gate`` so that the others queue."""

    def __init__(self, num_pages: int = 1000) -> None:
        self.pool = FakePool(num_pages)
        self.batches: list[list[str]] = []
        self.gate = threading.Event()

    def prefill(self, requests):
        if not self.batches:
            assert self.gate.wait(10), "the test never opened the gate"
        self.batches.append([r.request_id for r in requests])
        return [PrefillResult(r.request_id, 1, (), len(r.prompt_token_ids)) for r in requests]


def _batcher(engine, **kw):
    opts = dict(max_batch_tokens=1000, batch_wait_s=0.0, max_queued_tokens=10**9, retry_after_s=1)
    return PrefillBatcher(engine, **{**opts, **kw})


def _run(engine, batcher, prompts):
    """Submit ``prompts`` ((id, tokens, cost), the first alone ahead of the rest, which queue
    while it runs), open the gate, wait for all. Returns the engine's batches."""
    async def main():
        first = asyncio.create_task(batcher.submit(PrefillRequest(prompts[0][0], [1] * prompts[0][1]), prompts[0][2]))
        while not engine.batches and batcher.num_queued:  # the first batch has started
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        rest = []
        for rid, n, cost in prompts[1:]:
            rest.append(asyncio.create_task(batcher.submit(PrefillRequest(rid, [1] * n), cost)))
            await asyncio.sleep(0.002)  # distinct arrival times
        engine.gate.set()
        await asyncio.gather(first, *rest)

    asyncio.run(main())
    return engine.batches


# (id, prompt tokens, cost): costs grow with length, as the router's causal-work model does
PROMPTS = [("a", 600, 36.0), ("big", 900, 81.0), ("mid", 500, 25.0), ("small", 100, 1.0), ("tiny", 50, 0.25)]


def test_fcfs_takes_arrival_order():
    engine = FakeEngine()
    batches = _run(engine, _batcher(engine), PROMPTS)
    # 1000 tokens a batch: big alone (mid would not fit), then mid+small+tiny
    assert batches == [["a"], ["big"], ["mid", "small", "tiny"]]


def test_shortest_first_takes_least_work_first_and_fills_batches():
    engine = FakeEngine()
    batches = _run(engine, _batcher(engine, schedule="shortest_first", max_wait_s=60.0), PROMPTS)
    assert batches == [["a"], ["tiny", "small", "mid"], ["big"]]


def test_shortest_first_serves_overdue_prompts_in_arrival_order():
    """max_wait_s=0: every waiting prompt is overdue, so the order is arrival order again."""
    engine = FakeEngine()
    batches = _run(engine, _batcher(engine, schedule="shortest_first", max_wait_s=0.0), PROMPTS)
    assert batches == [["a"], ["big"], ["mid", "small", "tiny"]]


def _queued(rid, n, cost, age_s):
    item = _Queued(PrefillRequest(rid, [1] * n), cost, future=None)
    item.enqueued_at = time.monotonic() - age_s
    return item


def test_aging_and_page_shortage_in_batch_formation():
    engine = FakeEngine(num_pages=12)  # 768 tokens of pages
    b = _batcher(engine, schedule="shortest_first", max_wait_s=5.0)
    b._queue.extend([_queued("young-big", 640, 100.0, 1.0), _queued("old-mid", 320, 25.0, 9.0),
                     _queued("young-small", 64, 1.0, 0.5), _queued("older-big", 700, 120.0, 20.0)])
    # overdue first, in arrival order (old-mid arrived before older-big), then younger by cost
    assert [q.request.request_id for q in b._in_order()] == ["old-mid", "older-big", "young-small", "young-big"]
    # old-mid takes 5 pages; older-big needs 11 of the 7 left: the batch stops there (nothing
    # younger overtakes an overdue prompt that waits for pages)
    assert [q.request.request_id for q in b._next_batch()] == ["old-mid"]
    assert [q.request.request_id for q in b._queue] == ["young-big", "young-small", "older-big"]


def test_schedule_is_validated():
    with pytest.raises(ValueError, match="schedule"):
        _batcher(FakeEngine(), schedule="lifo")
    with pytest.raises(ValueError, match="prefill_schedule"):
        ServiceConfig(prefill_schedule="sjf")
    with pytest.raises(ValueError, match="prefill_max_wait_s"):
        ServiceConfig(prefill_max_wait_s=-1.0)
    assert ServiceConfig(prefill_schedule="shortest_first").prefill_max_wait_s == 30.0
