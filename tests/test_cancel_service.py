"""Cancellation through the service (a real local Ray + Serve, CPU): a client that gives up on
a long prompt mid-prefill frees the prefill engine.

One application, ``cancel``: the tiny model, 1 prefill + 1 decode, a 64-token forward budget (the
default chunking cuts its chunks to it) and every prefill forward held 200 ms (``fault_injection.prefill_step_delay_ms``),
so that a 1920-token prompt (30 chunks) takes at least 6 s to prefill and the cancel lands in
the middle of it. The replica's own counters say what happened: forwards run, cancellations by
stage, pages. The engine-level order (the forward in flight finishes, no later chunk runs, the
next prompt runs in the next forward) is tests/test_cancellation.py's.
"""

from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")

from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import oracle_tokens, prompt_of, replica_stats  # noqa: E402

MODEL = "builtin:tiny"
CHUNK = 64
CONFIG = ServiceConfig.from_dict({
    "model": MODEL, "torch_threads": 1, "alpha": 0.0, "batch_wait_ms": 1.0, "prefill_kv_pages": 64,
    "decode_kv_pages": 64, "prefill": {"max_batch_tokens": CHUNK},  # chunks: the default, cut to the budget
    "fault_injection": {"prefill_step_delay_ms": 200},
})
SMALL = {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}
SERVE_APPS = {"cancel": {"config": CONFIG, "prefill": {**SMALL, "num_replicas": 1},
                         "decode": {**SMALL, "num_replicas": 1}, "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}
LONG = prompt_of(30 * CHUNK, seed=71)


def _prefill() -> dict:
    (stats,) = replica_stats("cancel", "PrefillServer")
    return stats


def _wait(pred, what: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _prefill()
        if pred(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {stats}")
        time.sleep(0.05)


def _idle(s: dict) -> bool:
    return s["active"] == 0 and s["queued"] == 0 and s["free_pages"] == s["num_pages"] and s["pool_requests"] == 0


def test_a_client_gone_mid_prefill_frees_the_engine_for_the_next_request(service):
    before = _wait(_idle, "not idle at the start")
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "temperature": 0}

    async def give_up_mid_prefill():
        async with httpx.AsyncClient(base_url=service["base"], timeout=120) as client:
            task = asyncio.create_task(client.post("/cancel/v1/completions", json=body))
            # its prefill has begun (a forward ran) and has many chunks to go: the client leaves
            await asyncio.to_thread(_wait, lambda s: s["batches"] > before["batches"], "the prefill never started")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(give_up_mid_prefill())
    after = _wait(lambda s: _idle(s) and s["cancelled"]["prefilling"] > before["cancelled"]["prefilling"],
                  "the cancelled prompt was not dropped")
    assert after["cancelled"] == {"queued": before["cancelled"]["queued"],
                                  "prefilling": before["cancelled"]["prefilling"] + 1}
    # it stopped early: fewer forwards than its 30 chunks, and its pages are back (idle above)
    assert after["batches"] - before["batches"] < 30
    # the next request is served by the freed engine, in one forward
    short = prompt_of(30, seed=72)
    r = httpx.post(f"{service['base']}/cancel/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": short, "max_tokens": 5, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(CONFIG, short, 5)
    done = _wait(_idle, "not idle after the short request")
    assert done["batches"] - after["batches"] == 1


def test_a_grpc_deadline_mid_prefill_frees_the_engine(service):
    from router.proto import flashprefill_pb2 as pb
    from router.proto import flashprefill_pb2_grpc

    before = _wait(_idle, "not idle at the start")
    stub = flashprefill_pb2_grpc.FlashPrefillStub(service["channel"])
    with pytest.raises(grpc.RpcError) as info:  # 30 forwards take 6 s or more: the deadline comes first
        stub.Generate(pb.GenerateRequest(model=MODEL, prompt_token_ids=LONG, max_tokens=4, temperature=0.0),
                      metadata=(("application", "cancel"),), timeout=2.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = _wait(lambda s: _idle(s) and sum(s["cancelled"].values()) > sum(before["cancelled"].values()),
                  "the cancelled prompt was not dropped")
    assert sum(after["cancelled"].values()) == sum(before["cancelled"].values()) + 1
    assert after["batches"] - before["batches"] < 30
