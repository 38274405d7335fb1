"""Cancellation through to the engines, and no head-of-line blocking under the default options.

A prefill replica's step loop (``PrefillLoop``) and engine on the tiny model, each forward held
at a gate in the model runner so that the test decides what is in flight when a cancel comes:
a cancelled prompt runs no chunk after the forward it is in, its pages come back, a prompt
waiting in the queue leaves it at once, and the next prompt runs in the next forward. The
defaults' scheduler lets a short prompt in at the next chunk boundary of a long one (the old
defaults did not). A cancelled decode request frees its pages between steps. Each stage's
cancellations are counted. Order and content are asserted, never durations.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kernels.config import SparseConfig
from model_executor import ModelRunner, SamplingParams
from model_executor.loading import make_pool
from prefill_worker.engine import PrefillEngine, PrefillRequest, PrefillState
from prefill_worker.scheduler import PrefillScheduler
from serving.config import ServiceConfig
from serving.metrics import Metrics
from tests.helpers import FakeMetricsBackend

pytest.importorskip("ray.serve")  # prefill_worker.deployment imports Serve

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
PAGE = 16
CHUNK = 64


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


class _Gate:
    """Holds every forward inside the runner until the test lets it go; logs each forward's
    chunks as ``(request id, start, tokens)``."""

    def __init__(self, runner, monkeypatch):
        self._real = runner.prefill
        self.entered = threading.Semaphore(0)
        self._go = threading.Semaphore(0)
        self.log: list[list[tuple[str, int, int]]] = []
        monkeypatch.setattr(runner, "prefill", self._prefill)

    def _prefill(self, items):
        self.log.append([(it.request_id, it.cached_len, len(it.token_ids)) for it in items])
        self.entered.release()
        self._go.acquire()
        return self._real(items)

    async def in_flight(self, n):
        """Wait until the ``n``-th forward is held at the gate."""
        while len(self.log) < n:
            await asyncio.to_thread(self.entered.acquire)

    def release(self, forwards=1):
        self._go.release(forwards)


def _setup(tiny, monkeypatch, *, policy="shortest_first"):
    from prefill_worker.deployment import PrefillLoop

    pool = make_pool(tiny, num_pages=64, page_size=PAGE)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    # a forward's budget is one chunk: a prompt that arrives shares no forward with a running one
    engine = PrefillEngine(runner, max_batch_tokens=CHUNK, chunk_size=CHUNK, policy=policy)
    backend = FakeMetricsBackend()
    loop = PrefillLoop(engine, max_batch_tokens=CHUNK, batch_wait_s=0.0, max_queued_tokens=10**6, retry_after_s=1,
                       metrics=Metrics(backend))
    return engine, loop, _Gate(runner, monkeypatch), backend


def _cancelled_calls(backend):
    return backend.calls("requests_cancelled_total")


@pytest.mark.parametrize("policy", ["fcfs", "shortest_first"])
def test_a_cancelled_prompt_stops_after_its_forward_and_the_next_runs_at_once(tiny, monkeypatch, policy):
    engine, loop, gate, backend = _setup(tiny, monkeypatch, policy=policy)
    free0 = engine.pool.free_pages
    long_p, short_p = _prompt(640, 1), _prompt(30, 2)  # long: 10 chunks

    async def main():
        long_task = asyncio.create_task(loop.submit(PrefillRequest("long", long_p, GREEDY)))
        await gate.in_flight(1)
        gate.release()  # chunk 0 runs
        await gate.in_flight(2)  # chunk 1 is in the forward: the client gives up now
        long_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_task
        # still in the forward that runs: dropped when it ends; it holds its pages until then
        assert engine.state("long") is PrefillState.ABORTED and engine.pool.has("long")
        assert not engine.has_unfinished() and loop.cancelled == {"queued": 0, "prefilling": 1}
        short_task = asyncio.create_task(loop.submit(PrefillRequest("short", short_p, GREEDY)))
        await asyncio.sleep(0)
        gate.release()  # chunk 1 ends
        await gate.in_flight(3)
        gate.release()
        result, _, _ = await short_task
        return result

    result = asyncio.run(main())
    # the long prompt ran the forward it was in and no other; the short one ran in the next forward
    assert gate.log == [[("long", 0, CHUNK)], [("long", CHUNK, CHUNK)], [("short", 0, 30)]]
    assert loop.batches == 3 and result.kv_len == 30
    engine.release("short")
    assert engine.pool.free_pages == free0 and engine.pool.stats()["requests"] == 0
    assert _cancelled_calls(backend) == [("inc", 1.0, {"stage": "prefilling"})]


def test_a_cancelled_prompt_between_its_chunks_frees_its_pages_at_once(tiny, monkeypatch):
    """Admitted (chunks done, pages held) but not in the forward that runs: its pages go back
    with the cancel, before that forward ends."""
    engine, loop, gate, backend = _setup(tiny, monkeypatch, policy="shortest_first")
    free0 = engine.pool.free_pages

    async def main():
        long_task = asyncio.create_task(loop.submit(PrefillRequest("long", _prompt(320, 3), GREEDY)))
        await gate.in_flight(1)
        gate.release()  # long's chunk 0: its pages are reserved for all 320 tokens
        await gate.in_flight(2)
        mid_task = asyncio.create_task(loop.submit(PrefillRequest("mid", _prompt(200, 4), GREEDY)))
        await asyncio.sleep(0)  # queued
        gate.release()  # long's chunk 1 ends; mid (less work left) goes first from here
        await gate.in_flight(3)
        assert gate.log[-1] == [("mid", 0, CHUNK)]
        held = engine.pool.free_pages
        long_task.cancel()  # long: admitted, not in this forward
        with pytest.raises(asyncio.CancelledError):
            await long_task
        assert engine.state("long") is None and not engine.pool.has("long")
        assert engine.pool.free_pages == held + engine.pool.pages_for(320)
        gate.release(10)
        result, _, _ = await mid_task
        return result

    result = asyncio.run(main())
    assert [f[0][0] for f in gate.log] == ["long", "long", "mid", "mid", "mid", "mid"]
    assert result.kv_len == 200
    engine.release("mid")
    assert engine.pool.free_pages == free0
    assert _cancelled_calls(backend) == [("inc", 1.0, {"stage": "prefilling"})]


def test_a_queued_prompt_cancelled_leaves_the_queue_at_once(tiny, monkeypatch):
    engine, loop, gate, backend = _setup(tiny, monkeypatch, policy="fcfs")

    async def main():
        long_task = asyncio.create_task(loop.submit(PrefillRequest("long", _prompt(192, 5), GREEDY)))
        await gate.in_flight(1)
        queued = asyncio.create_task(loop.submit(PrefillRequest("queued", _prompt(100, 6), GREEDY)))
        await asyncio.sleep(0)
        assert engine.state("queued") is PrefillState.WAITING and loop.num_queued == 1 and loop.queued_tokens == 100
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        # gone before the forward in flight ends: nothing queued, no pages, nothing to run
        assert engine.state("queued") is None and loop.num_queued == 0 and loop.queued_tokens == 0
        assert not engine.pool.has("queued") and len(gate.log) == 1
        gate.release(10)
        await long_task

    asyncio.run(main())
    assert [c for f in gate.log for c in f] == [("long", 0, 64), ("long", 64, 64), ("long", 128, 64)]
    assert loop.cancelled == {"queued": 1, "prefilling": 0}
    assert _cancelled_calls(backend) == [("inc", 1.0, {"stage": "queued"})]
    engine.release("long")
    assert engine.pool.used_pages == 0


def test_a_result_that_comes_with_the_cancel_has_its_pages_freed(tiny, monkeypatch):
    """The forward that finishes a prompt ends in the same turn as its caller's cancel: the
    result is there, nobody takes it, its pages go back (they used to stay in the pool)."""
    from prefill_worker.deployment import _Pending

    engine, loop, gate, backend = _setup(tiny, monkeypatch)
    gate.release(5)
    engine.add_request(PrefillRequest("a", _prompt(40, 7), GREEDY))
    out = engine.step()
    assert [r.request_id for r in out.finished] == ["a"] and engine.pool.has("a")

    async def main():
        item = _Pending(PrefillRequest("a", [1], GREEDY), asyncio.get_running_loop().create_future())
        # the loop has set the result (the caller was still there), then the caller is cancelled
        item.future.set_result(out.finished[0])
        loop._drop("a", item)

    asyncio.run(main())
    assert not engine.pool.has("a") and engine.pool.used_pages == 0
    assert _cancelled_calls(backend) == [("inc", 1.0, {"stage": "prefilling"})]


# ----------------------------------------------------------------------------- the defaults
def _schedule_log(sched, plan, steps):
    """Run ``steps`` forwards of a scheduler alone; ``plan[i]``: (id, length) added before forward
    ``i``. Returns each forward's chunks as (id, start, tokens)."""
    log = []
    for i in range(steps):
        for rid, n in plan.get(i, ()):
            sched.add(rid, n, now=float(i))
        chunks = sched.schedule(now=float(i))
        log.append([(c.request_id, c.start, c.num_tokens) for c in chunks])
        sched.commit(chunks)
    return log


def _scheduler(cfg):
    p = cfg.prefill
    return PrefillScheduler(max_batch_tokens=p.max_batch_tokens, chunk_size=p.chunk_size, policy=p.schedule,
                            max_wait_s=p.max_wait_s)


def test_under_the_defaults_a_short_prompt_waits_at_most_one_chunk():
    """Four long prompts take the whole forward budget in chunks; a short prompt that arrives
    runs in the very next forward (one chunk of the long ones later). Under the old defaults
    (whole prompts, arrival order) it waited for every long prompt ahead of it."""
    cfg = ServiceConfig()
    chunk, budget = cfg.prefill.chunk_size, cfg.prefill.max_batch_tokens
    assert cfg.prefill.schedule == "shortest_first" and chunk is not None and budget % chunk == 0
    longs = [(f"long{i}", 3 * budget) for i in range(budget // chunk)]  # together they fill a forward
    log = _schedule_log(_scheduler(cfg), {0: longs, 1: [("short", 40)]}, steps=3)
    assert log[0] == [(rid, 0, chunk) for rid, _ in longs]
    assert log[1][0] == ("short", 0, 40)  # first in the forward after its arrival
    assert sum(n for _, _, n in log[1]) == budget  # the long prompts resume in the same forward
    old = ServiceConfig(prefill={"chunk_tokens": 0, "schedule": "fcfs"})
    log = _schedule_log(_scheduler(old), {0: longs, 1: [("short", 40)]}, steps=len(longs) * 3 + 1)
    first = next(i for i, f in enumerate(log) if any(rid == "short" for rid, _, _ in f))
    assert first == len(longs) * 3  # behind 4 x 3 whole-budget forwards


def test_default_chunk_is_cut_to_a_smaller_budget_and_explicit_values_stay():
    from serving.config import DEFAULT_CHUNK_TOKENS

    assert ServiceConfig().prefill.chunk_tokens == DEFAULT_CHUNK_TOKENS <= ServiceConfig().prefill.max_batch_tokens
    small = ServiceConfig(prefill={"max_batch_tokens": 1000})
    assert small.prefill.chunk_size == 1000 and ServiceConfig.from_dict(small.to_dict()) == small
    assert ServiceConfig(max_batch_tokens=512).prefill.chunk_size == 512  # the flat name too
    assert ServiceConfig(prefill={"chunk_tokens": 0}).prefill.chunk_size is None  # off
    assert ServiceConfig(prefill={"chunk_tokens": None}).prefill.chunk_size is None
    with pytest.raises(ValueError, match=r"^prefill.chunk_tokens: expected at most prefill.max_batch_tokens \(1000\)"):
        ServiceConfig(prefill={"max_batch_tokens": 1000, "chunk_tokens": 2048})


# ----------------------------------------------------------------------------- decode
def test_a_cancelled_decode_request_frees_its_pages_between_steps(tiny):
    from decode_worker.deployment import DecodeLoop
    from decode_worker.engine import DecodeEngine, FinishReason
    from model_executor import PrefillItem

    pool = make_pool(tiny, num_pages=16, page_size=PAGE)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    engine = DecodeEngine(runner, max_running=4)
    loop = DecodeLoop(engine)
    free0 = pool.free_pages
    prompt = _prompt(30, 8)

    async def main():
        runner.ensure_capacity("d", len(prompt) + 1)  # as an adoption leaves it: the prompt's K/V in the pool
        first = int(runner.prefill([PrefillItem("d", prompt)]).argmax())
        outbox = loop.submit("d", len(prompt), first, SamplingParams(temperature=0.0, max_new_tokens=200))
        tokens = [await outbox.get() for _ in range(3)]
        assert all(t.token is not None and not t.finished for t in tokens)
        loop.cancel("d")  # the stream closed: DecodeServer.generate's finally
        while True:
            out = await outbox.get()
            if out.finished:
                return out, loop.steps

    out, steps = asyncio.run(main())
    assert out.finish_reason is FinishReason.CANCELLED and out.token is None
    assert steps < 200 and pool.free_pages == free0 and not engine.has_unfinished()
