"""Step-level prefill on the tiny model: a short prompt that arrives while a long one is being
chunked gets its first token before the long prompt's prefill ends (shortest_first), or shares
the long prompt's steps (fcfs); both give what they give alone. And the replica's step loop:
arrivals join between forwards, a cancelled prompt's pages come back, a failed forward fails
only its own prompts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kernels.config import SparseConfig
from model_executor import ModelRunner, SamplingParams
from model_executor.loading import make_pool
from prefill_worker.engine import PrefillEngine, PrefillRequest, PrefillState
from prefill_worker.scheduler import PREFILL_POLICIES
from serving.config import PREFILL_SCHEDULES

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
PAGE = 16


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


def _engine(tiny, *, alpha=0.0, max_batch_tokens=8192, chunk_size=None, **kw):
    pool = make_pool(tiny, num_pages=64, page_size=PAGE)
    # sparse: the tiny model's head dim is 64; block 64 keeps its blocks whole within chunks
    cfg = SparseConfig(alpha=alpha) if alpha == 0.0 else SparseConfig(alpha=alpha, block_size=64,
                                                                       sink_tokens=64, window_tokens=128)
    runner = ModelRunner(tiny.model, pool, cfg, dense_below=0)
    return PrefillEngine(runner, max_batch_tokens=max_batch_tokens, chunk_size=chunk_size, **kw)


def _kv(engine, rid, n):
    """The request's K and V in the pool, token-major: [layers, n, heads, dim]."""
    pool = engine.pool
    pages = torch.tensor(pool.pages(rid))
    k = pool.k[:, pages].flatten(1, 2)[:, :n]
    v = pool.v[:, pages].flatten(1, 2)[:, :n]
    return k.clone(), v.clone()


def _alone(tiny, rid, prompt, chunks, **kw):
    """The prompt alone in its pool, run through the same chunks: (first token, K, V)."""
    from model_executor.runner import PrefillItem

    e = _engine(tiny, **kw)
    e.runner.ensure_capacity(rid, len(prompt))
    for start, n in chunks:
        logits = e.runner.prefill([PrefillItem(rid, prompt[start : start + n], start)])
    return int(logits[0].argmax()), _kv(e, rid, len(prompt))


def _check_alone(tiny, engine, log, prompts, exact, **kw):
    """Each prompt's first token and K/V equal the prompt's run alone over its own chunks:
    bit for bit (dense) or within the tile rules' tolerance (sparse). Also close to the prompt
    prefilled whole (other chunk boundaries round differently)."""
    results = {f.request_id: f for _, _, out in log for f in out.finished}
    for rid, p in prompts.items():
        chunks = [(st, n) for cs, _, _ in log for (r, st, n) in cs if r == rid]
        tok, (k0, v0) = _alone(tiny, rid, p, chunks, **kw)
        k, v = _kv(engine, rid, len(p))
        assert results[rid].first_token == tok
        if exact:
            assert torch.equal(k, k0) and torch.equal(v, v0)
        else:
            torch.testing.assert_close(k, k0, atol=2e-3, rtol=0)
            torch.testing.assert_close(v, v0, atol=2e-3, rtol=0)
        tok_w, (kw_, vw) = _alone(tiny, rid, p, [(0, len(p))], **kw)
        assert tok_w == tok
        torch.testing.assert_close(k, kw_, atol=2e-3, rtol=1e-4)
        torch.testing.assert_close(v, vw, atol=2e-3, rtol=1e-4)


def _steps(engine, plan):
    """Run steps; ``plan[i]``: requests to add before step ``i``. Returns per step the chunks
    (id, start, tokens) and the ids finished."""
    log = []
    i = 0
    while engine.has_unfinished() or i < len(plan):
        for r in plan[i] if i < len(plan) else ():
            engine.add_request(r)
        out = engine.step()
        log.append(([(c.request_id, c.start, c.num_tokens) for c in out.chunks],
                    [f.request_id for f in out.finished], out))
        i += 1
    return log


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_shortest_first_lets_an_arrival_in_at_the_next_chunk_boundary(tiny, alpha):
    long_p, short_p = _prompt(384, 1), _prompt(40, 2)
    kw = dict(alpha=alpha, max_batch_tokens=128, chunk_size=128)
    e = _engine(tiny, policy="shortest_first", max_wait_s=600.0, **kw)
    log = _steps(e, [[PrefillRequest("long", long_p, GREEDY)], [PrefillRequest("short", short_p, GREEDY)]])
    assert [chunks for chunks, _, _ in log] == [
        [("long", 0, 128)],
        [("short", 0, 40), ("long", 128, 88)],  # the arrival first, the long prompt resumes after it
        [("long", 216, 128)],
        [("long", 344, 40)],
    ]
    assert [fin for _, fin, _ in log] == [[], ["short"], [], ["long"]]  # short's first token before long's
    # dense: the same numbers whatever shares the forward; sparse: within the tile rules
    _check_alone(tiny, e, log, {"long": long_p, "short": short_p}, exact=alpha == 0.0, **kw)


def test_fcfs_shares_the_long_prompts_steps_with_an_arrival(tiny):
    long_p, short_p = _prompt(300, 3), _prompt(50, 4)
    kw = dict(max_batch_tokens=160, chunk_size=128)
    e = _engine(tiny, policy="fcfs", **kw)
    log = _steps(e, [[PrefillRequest("long", long_p, GREEDY)], [PrefillRequest("short", short_p, GREEDY)]])
    assert [chunks for chunks, _, _ in log] == [
        [("long", 0, 128)],
        [("long", 128, 128), ("short", 0, 32)],  # the budget left after the long chunk
        [("long", 256, 44), ("short", 32, 18)],
    ]
    assert [fin for _, fin, _ in log] == [[], [], ["long", "short"]]
    _check_alone(tiny, e, log, {"long": long_p, "short": short_p}, exact=True, **kw)


def test_abort_frees_pages_now_or_after_the_forward_and_states(tiny):
    e = _engine(tiny, max_batch_tokens=64, chunk_size=64)
    e.add_request(PrefillRequest("a", _prompt(200, 5), GREEDY))
    e.add_request(PrefillRequest("b", _prompt(30, 6), GREEDY))
    assert e.state("a") is PrefillState.WAITING and e.num_waiting() == 2
    e.step()  # a: 64 tokens, pages for all 200 reserved
    assert e.state("a") is PrefillState.PREFILLING and e.pool.has("a") and e.num_running() == 1
    assert e.abort_request("a") and not e.pool.has("a") and e.state("a") is None
    assert not e.abort_request("a")  # no longer held
    assert e.abort_request("b") and e.pool.used_pages == 0 and not e.has_unfinished()
    with pytest.raises(ValueError, match="request.prompt_token_ids"):
        e.add_request(PrefillRequest("c", [], GREEDY))
    with pytest.raises(ValueError, match="request.params"):
        e.add_request(PrefillRequest("c", [1], params={"temperature": 0}))


def test_a_failed_forward_fails_its_prompts_only(tiny, monkeypatch):
    e = _engine(tiny, max_batch_tokens=64, chunk_size=64)
    e.add_request(PrefillRequest("a", _prompt(100, 7), GREEDY))
    e.step()
    e.add_request(PrefillRequest("b", _prompt(20, 8), GREEDY))
    real = e.runner.prefill

    def boom(items):
        raise RuntimeError("device lost")

    monkeypatch.setattr(e.runner, "prefill", boom)
    out = e.step()
    assert [rid for rid, _ in out.failed] == ["a", "b"] and out.finished == []
    assert e.pool.used_pages == 0 and not e.has_unfinished()
    monkeypatch.setattr(e.runner, "prefill", real)
    e.add_request(PrefillRequest("c", _prompt(20, 9), GREEDY))
    assert [f.request_id for f in e.step().finished] == ["c"]


def _oom_batch(tiny):
    """An engine whose next forward holds a's second chunk (36 tokens) and b (28 tokens), while w
    waits for room (the 64-token budget is taken)."""
    e = _engine(tiny, max_batch_tokens=64, chunk_size=64)
    prompts = {"a": _prompt(100, 21), "b": _prompt(28, 22), "w": _prompt(90, 23)}
    e.add_request(PrefillRequest("a", prompts["a"], GREEDY))
    e.step()  # a's first chunk: a holds its pages from here on
    for rid in ("b", "w"):
        e.add_request(PrefillRequest(rid, prompts[rid], GREEDY))
    return e, prompts


def _drain(e):
    done = {}
    while e.has_unfinished():
        done.update({r.request_id: r for r in e.step().finished})
    return done


def test_an_out_of_memory_forward_of_several_prompts_runs_them_one_at_a_time(tiny, caplog):
    e, prompts = _oom_batch(tiny)
    e.oom_above_tokens = 40  # the batched forward (64 tokens) does not fit, a (36) and b (28) alone do
    with caplog.at_level("WARNING", logger="ray.serve"):
        out = e.step()
    assert out.failed == [] and sorted(r.request_id for r in out.finished) == ["a", "b"] 
    assert [r.getMessage() for r in caplog.records] == [
        "prefill forward of 2 prompts (64 tokens) out of memory; running them one at a time"]
    got = {r.request_id: r for r in out.finished}
    assert got["a"].first_token == _alone(tiny, "a", prompts["a"], [(0, 64), (64, 36)])[0]
    assert got["b"].first_token == _alone(tiny, "b", prompts["b"], [(0, 28)])[0]
    e.oom_above_tokens = 0
    done = _drain(e)
    assert sorted(done) == ["w"]
    for rid in ("a", "b", "w"):
        e.release(rid)
    assert e.pool.used_pages == 0


def test_an_out_of_memory_forward_frees_its_pages_and_fails_typed(tiny, caplog):
    from serving.errors import PrefillOutOfMemory

    e, prompts = _oom_batch(tiny)
    assert e.pool.used_pages > 0
    e.oom_above_tokens = 30  # a's 36 tokens do not fit alone either: the forward fails all or nothing
    with caplog.at_level("ERROR", logger="ray.serve"):
        out = e.step()
    assert [rid for rid, _ in out.failed] == ["a", "b"] and out.finished == []
    for rid, exc in out.failed:
        assert isinstance(exc, PrefillOutOfMemory) and exc.status == 503 and exc.code == "prefill_out_of_memory"
        assert exc.prompt_tokens == len(prompts[rid]) and exc.batch_tokens == 36 + 28
        assert f"{len(prompts[rid])}-token prompt" in exc.message and "prefill.max_batch_tokens" in exc.message
        assert e.state(rid) is None and not e.pool.has(rid)
    assert e.pool.used_pages == 0 and e.pool.free_pages == e.pool.num_pages
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "2 prompts, 64 tokens" in lines[0] and "0 of 64 pages" in lines[0]
    # the waiting prompt and a new one are served once memory allows
    e.oom_above_tokens = 0
    e.add_request(PrefillRequest("c", prompts["b"], GREEDY))
    done = _drain(e)
    assert sorted(done) == ["c", "w"]
    assert done["c"].first_token == _alone(tiny, "c", prompts["b"], [(0, 28)])[0]
    for rid in done:
        e.release(rid)
    assert e.pool.used_pages == 0


def test_prefill_out_of_memory_survives_pickling_as_ray_ships_it():
    import pickle

    from serving.errors import PrefillOutOfMemory, RequestError

    got = pickle.loads(pickle.dumps(PrefillOutOfMemory(131072, 131072, retry_after_s=3)))
    assert isinstance(got, PrefillOutOfMemory) and isinstance(got, RequestError)
    assert (got.status, got.code, got.retry_after_s, got.prompt_tokens) == (503, "prefill_out_of_memory", 3, 131072)
    assert "131072-token prompt" in got.message and got.to_dict()["error"]["type"] == "server_error"


def test_the_service_and_the_scheduler_name_the_same_policies():
    assert tuple(PREFILL_SCHEDULES) == tuple(PREFILL_POLICIES)


# -- the replica's step loop (asyncio; no Ray actors) -------------------------------------
ray_serve = pytest.importorskip("ray.serve")


def _loop(engine, **kw):
    from prefill_worker.deployment import PrefillLoop

    opts = dict(max_batch_tokens=engine.max_batch_tokens, batch_wait_s=0.0, max_queued_tokens=10**9, retry_after_s=1)
    return PrefillLoop(engine, **{**opts, **kw})


def test_loop_lets_an_arrival_finish_before_a_long_prompt(tiny):
    e = _engine(tiny, policy="shortest_first", max_batch_tokens=64, chunk_size=64)
    loop = _loop(e)
    order = []

    async def main():
        async def one(rid, p):
            res, queue_s, prefill_s = await loop.submit(PrefillRequest(rid, p, GREEDY))
            order.append(rid)
            assert queue_s >= 0 and prefill_s >= 0 and res.kv_len == len(p)
            e.release(rid)

        long_task = asyncio.create_task(one("long", _prompt(640, 10)))
        while loop.batches < 1:
            await asyncio.sleep(0.001)
        await one("short", _prompt(30, 11))
        await long_task

    asyncio.run(main())
    assert order == ["short", "long"] and e.pool.used_pages == 0


def test_loop_cancel_releases_pages_and_overload_is_429(tiny):
    from serving.errors import RequestError

    e = _engine(tiny, max_batch_tokens=64, chunk_size=64)
    loop = _loop(e, max_queued_tokens=300)

    async def main():
        task = asyncio.create_task(loop.submit(PrefillRequest("a", _prompt(500, 12), GREEDY)))
        while loop.batches < 1:
            await asyncio.sleep(0.001)
        queued = asyncio.create_task(loop.submit(PrefillRequest("b", _prompt(200, 13), GREEDY)))
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as err:  # b's 200 waiting + 150 > 300
            await loop.submit(PrefillRequest("c", _prompt(150, 14), GREEDY))
        assert err.value.status == 429
        task.cancel()
        queued.cancel()
        for t in (task, queued):
            with pytest.raises(asyncio.CancelledError):
                await t
        for _ in range(200):  # the forward in flight ends, then the loop goes idle
            if not e.has_unfinished():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as err:
            await loop.submit(PrefillRequest("d", [1] * (64 * PAGE + 1), GREEDY))
        assert err.value.status == 400 and err.value.param == "prompt"

    asyncio.run(main())
    assert e.pool.used_pages == 0 and not e.has_unfinished()


def test_loop_answers_an_out_of_memory_forward_503_and_serves_on(tiny):
    from serving.errors import PrefillOutOfMemory

    e = _engine(tiny, max_batch_tokens=64, chunk_size=64)
    loop = _loop(e, retry_after_s=7)
    e.oom_above_tokens = 40

    async def main():
        with pytest.raises(PrefillOutOfMemory) as err:
            await loop.submit(PrefillRequest("a", _prompt(41, 31), GREEDY))
        assert err.value.status == 503 and err.value.retry_after_s == 7 and e.pool.used_pages == 0
        res, _, _ = await loop.submit(PrefillRequest("b", _prompt(40, 32), GREEDY))  # fits: served on
        assert res.kv_len == 40
        e.release("b")

    asyncio.run(main())
    assert e.pool.used_pages == 0 and not e.has_unfinished()
