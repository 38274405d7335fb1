"""Backpressure and replica-death handling without a cluster: the ingress's admission gate
(router/admission.py), the options that size it and the worker deployments, the request
routers' back-off flag, one WARNING per dead replica (router/retry.py ``ReplicaDeaths``),
and readiness that follows Ray's actor-death notifications (router/health.py)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from router.admission import Admission
from router.health import DeathWatch, ReadinessProbe
from serving.config import ServiceConfig
from serving.errors import RequestError
from tests.helpers import FakeMetricsBackend
from serving.metrics import Metrics

ROLES = {"prefill": "PrefillServer", "decode": "DecodeServer"}


# ----------------------------------------------------------------------------- admission
def test_admission_runs_the_bound_queues_in_order_and_refuses_past_the_queue():
    rng = random.Random(7)
    inflight, queued = rng.randint(2, 5), rng.randint(1, 6)
    backend = FakeMetricsBackend()

    async def run():
        gate = Admission(inflight, queued, retry_after_s=3, metrics=Metrics(backend))
        running = [await gate.acquire() for _ in range(inflight)]
        order: list[int] = []

        async def wait(i):
            ticket = await gate.acquire()
            order.append(i)
            return ticket

        waiters = [asyncio.ensure_future(wait(i)) for i in range(queued)]
        await asyncio.sleep(0)
        assert gate.stats()["running"] == inflight and gate.queued == queued and order == []
        with pytest.raises(RequestError) as info:  # one past the queue: at once, not queued
            await gate.acquire()
        err = info.value
        assert err.status == 429 and err.code == "overloaded" and err.retry_after_s == 3
        assert "ingress.max_inflight" in err.message and "ingress.max_queued" in err.message
        running[0].release()
        running[0].release()  # a second release gives nothing back twice
        await asyncio.sleep(0)
        assert order == [0] and gate.running == inflight
        for t in running[1:]:
            t.release()
        tickets = await asyncio.gather(*waiters)
        assert order == list(range(queued))  # arrival order
        for t in tickets:
            t.release()
        assert gate.running == 0 and gate.queued == 0 and gate.rejected == 1

    asyncio.run(run())
    assert backend.calls("ingress_rejected_requests_total") == [("inc", 1.0, None)]
    queued_levels = [v for _, v, _ in backend.calls("ingress_queued_requests")]
    assert max(queued_levels) == queued and queued_levels[-1] == 0
    assert [v for _, v, _ in backend.calls("ingress_running_requests")][-1] == 0


def test_admission_a_cancelled_waiter_leaves_the_queue_and_a_big_request_runs_alone():
    async def run():
        gate = Admission(3, 4, retry_after_s=1)
        first = await gate.acquire(2)
        big = asyncio.ensure_future(gate.acquire(10))  # capped at the bound: waits for all 3
        small = asyncio.ensure_future(gate.acquire(1))  # behind it: arrival order, no overtaking
        await asyncio.sleep(0)
        assert gate.queued == 2 and not small.done()
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        ticket = await asyncio.wait_for(small, 5)  # the cancelled one no longer blocks it
        assert gate.running == 3 and gate.queued == 0
        first.release()
        ticket.release()
        whole = await gate.acquire(10)
        assert whole.weight == 3 and gate.running == 3
        whole.release()
        assert gate.running == 0

    asyncio.run(run())


def test_admission_without_a_queue_refuses_at_once_and_a_dropped_ticket_gives_back():
    async def run():
        gate = Admission(1, 0, retry_after_s=0)
        ticket = await gate.acquire()
        with pytest.raises(RequestError) as info:
            await gate.acquire()
        assert info.value.retry_after_s == 1  # Retry-After is never 0
        del ticket  # a response dropped before its body ran
        await asyncio.sleep(0)
        assert gate.running == 0
        (await gate.acquire()).release()

    asyncio.run(run())


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_inflight": 0}, "max_inflight"), ({"max_inflight": 1.5}, "max_inflight"),
    ({"max_queued": -1}, "max_queued"), ({"retry_after_s": -2}, "retry_after_s")])
def test_admission_rejects_bad_arguments(kwargs, name):
    args = {"max_inflight": 2, "max_queued": 2, "retry_after_s": 1, **kwargs}
    with pytest.raises(ValueError, match=f"^{name}"):
        Admission(args.pop("max_inflight"), args.pop("max_queued"), **args)

    async def bad_weight():
        await Admission(2, 2, retry_after_s=1).acquire(0)
    with pytest.raises(ValueError, match="^weight"):
        asyncio.run(bad_weight())


# ----------------------------------------------------------------------------- options, sizing
def test_ingress_bound_options_and_their_errors():
    cfg = ServiceConfig.from_dict({"ingress": {"max_inflight": 8, "max_queued": 0}})
    assert (cfg.ingress.max_inflight, cfg.ingress.max_queued) == (8, 0)
    for bad, name in (({"max_inflight": 0}, "ingress.max_inflight"), ({"max_queued": -1}, "ingress.max_queued"),
                      ({"max_inflight": "8"}, "ingress.max_inflight"), ({"max_queued": 2.5}, "ingress.max_queued"),
                      ({"max_inflight": 10**6}, "ingress.max_inflight")):
        with pytest.raises(ValueError, match=f"^{name}"):
            ServiceConfig.from_dict({"ingress": bad})


def test_worker_deployments_hold_every_admitted_request():
    pytest.importorskip("ray.serve")
    from router.app import (CONTROL_HEADROOM, build_application, ingress_max_ongoing, ingress_replicas_bound,
                            worker_max_ongoing)

    cfg = ServiceConfig.from_dict({"model": "builtin:tiny", "ingress": {"max_inflight": 12, "max_queued": 30}})
    assert ingress_replicas_bound({}) == 1 and ingress_replicas_bound({"num_replicas": 3}) == 3
    assert ingress_replicas_bound({"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}) == 4
    # a request's call plus one side call per admitted request, for every ingress replica
    assert worker_max_ongoing(cfg, 3) == 2 * 12 * 3
    assert ingress_max_ongoing(cfg) == 12 + 30 + CONTROL_HEADROOM
    with pytest.raises(ValueError, match="^ingress_replicas"):
        worker_max_ongoing(cfg, 0)
    app = build_application(cfg, ingress={"num_replicas": 2})
    ingress = app._bound_deployment
    prefill, decode = (a._bound_deployment for a in ingress.init_args[:2])
    assert ingress.max_ongoing_requests == 12 + 30 + CONTROL_HEADROOM
    assert prefill.max_ongoing_requests == decode.max_ongoing_requests == 2 * 12 * 2
    explicit = build_application(cfg, decode={"max_ongoing_requests": 5})._bound_deployment.init_args[1]
    assert explicit._bound_deployment.max_ongoing_requests == 5  # an explicit option wins


def test_both_request_routers_let_serve_back_off():
    pytest.importorskip("ray.serve")
    from ray.serve._private.request_router.common import RequestRoutingContext

    from router.scheduling import DecodeRequestRouter, PrefillRequestRouter

    class Pending:
        kwargs: dict = {}
        created_at = 0.0

        def __init__(self):
            self.routing_context = RequestRoutingContext()

    for cls in (PrefillRequestRouter, DecodeRequestRouter):
        router = cls.__new__(cls)  # the ranking alone: no Serve internals
        router.initialize_state()
        pending = Pending()
        assert pending.routing_context.should_backoff is False  # Serve's default
        assert asyncio.run(router.choose_replicas([], pending)) == []
        assert pending.routing_context.should_backoff is True, cls.__name__


# ----------------------------------------------------------------------------- replica deaths
def test_a_dead_replica_logs_one_warning_for_all_its_requests(caplog):
    ray_exceptions = pytest.importorskip("ray.exceptions")
    from router.retry import ReplicaDeaths

    deaths = ReplicaDeaths()
    a = ray_exceptions.ActorDiedError()
    a.actor_id = "aa" * 16
    b = ray_exceptions.ActorDiedError()
    b.actor_id = "bb" * 16
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for i in range(40):
            deaths.log("prefill", a, "%s: prefilling again", f"req-{i}")
        deaths.log("decode", b, "%s: resuming", "req-x")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(" died")[0] for r in warnings] == [f"prefill replica {'aa' * 16}",
                                                                   f"decode replica {'bb' * 16}"]
    assert "req-0: prefilling again" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"req-{i}: prefilling again" for i in range(1, 40)]


# ----------------------------------------------------------------------------- readiness
def details(app: str, replicas: dict[str, list[tuple[str, str]]]) -> dict:
    return {"applications": {app: {"deployments": {
        name: {"replicas": [{"actor_id": aid, "state": st} for aid, st in reps]} for name, reps in replicas.items()}}}}


class FakeSubscriber:
    """Stands in for Ray's GcsAioActorSubscriber: ``push`` delivers actor-table updates."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.queue: asyncio.Queue = asyncio.Queue()

    async def subscribe(self):
        if self.fail:
            raise ConnectionError("no GCS")

    async def poll(self, batch_size, timeout=None):
        return [await self.queue.get()]

    def push(self, actor_hex: str, state: str):
        from ray.core.generated import gcs_pb2

        self.queue.put_nowait((bytes.fromhex(actor_hex), gcs_pb2.ActorTableData(state=getattr(gcs_pb2.ActorTableData, state))))


def test_readiness_turns_unready_on_a_death_notification_before_the_controller_knows():
    pytest.importorskip("ray.core.generated.gcs_pb2")
    rng = random.Random(3)
    p1, p2, d1 = (rng.randbytes(16).hex() for _ in range(3))
    fetches = []

    def fetch():  # the controller: still lists every replica as RUNNING
        fetches.append(1)
        return details("a", {"PrefillServer": [(p1, "RUNNING"), (p2, "RUNNING")], "DecodeServer": [(d1, "RUNNING")]})

    async def run():
        sub = FakeSubscriber()
        probe = ReadinessProbe("a", ROLES, refresh_s=3600.0, fetch_status=fetch, deaths=lambda: sub)
        first = await probe.check()
        assert first.ready and first.replicas == {"prefill": 2, "decode": 1}
        sub.push(rng.randbytes(16).hex(), "DEAD")  # someone else's actor
        sub.push(p1, "ALIVE")
        sub.push(p1, "DEAD")
        for _ in range(100):
            await asyncio.sleep(0)
        one = await probe.check()
        assert one.ready and one.replicas == {"prefill": 1, "decode": 1}
        sub.push(p2, "DEAD")
        for _ in range(100):
            await asyncio.sleep(0)
        down = await probe.check()
        assert not down.ready and down.replicas == {"prefill": 0, "decode": 1}
        assert "actor death notification" in down.reason and p2 in down.reason
        assert len(fetches) == 1  # the cache was not refreshed: the notification changed the answer
        assert probe.watch.state == "watching" and probe.watch.deaths == 3 and probe.noticed == 2
        probe.refresh_s = 0.0
        again = await probe.check()  # the controller still says RUNNING: the dead stay out
        assert not again.ready and len(fetches) == 2

    asyncio.run(run())


def test_readiness_without_death_notifications_follows_the_controller():
    pytest.importorskip("ray.core.generated.gcs_pb2")

    def fetch():
        return details("a", {"PrefillServer": [("p", "RUNNING")], "DecodeServer": [("d", "STARTING")]})

    async def run():
        probe = ReadinessProbe("a", ROLES, refresh_s=0.0, fetch_status=fetch, deaths=lambda: FakeSubscriber(fail=True))
        r = await probe.check()
        await asyncio.sleep(0)
        assert not r.ready and r.replicas == {"prefill": 1, "decode": 0} and r.reason == "no running decode replica"
        assert probe.watch.state == "unavailable (ConnectionError)"
        missing = ReadinessProbe("b", ROLES, refresh_s=0.0, fetch_status=fetch, deaths=False)
        assert "not deployed" in (await missing.check()).reason and missing.watch is None

    asyncio.run(run())


def test_death_watch_outside_ray_is_unavailable_and_starts_no_ray(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    async def run():
        watch = DeathWatch(lambda _: None)
        watch.start()
        for _ in range(10):
            await asyncio.sleep(0)
        return watch.state

    assert asyncio.run(run()) == "unavailable (RuntimeError)"
