"""Prefill page leases: state with a deadline, swept by a timer, ended by the transfer.

Units of ``prefill_worker/leases.py``, then a prefill and a decode replica in this process
(no Ray: their Serve calls to each other are made directly) over a gloo channel, and over the
object store (Ray's store replaced by a dict: the frame's lease protocol, not Ray's).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from model_executor.sampling import SamplingParams
from prefill_worker.leases import END_REASONS, LeaseTable
from serving.messages import (
    Adopted,
    CancelChoice,
    DecodeCall,
    PagesReleased,
    PrefillCall,
    Prefilled,
    ReleasePages,
    SendPages,
    Tokens,
    TransferFailed,
)


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _table(timeout_s=10.0):
    ended, clock = [], _Clock()
    return LeaseTable(timeout_s, lambda lease, why: ended.append((lease.request_id, why)), clock=clock), ended, clock


def test_leases_end_once_each_at_the_first_of_their_endings():
    table, ended, clock = _table()
    for rid in ("a", "b", "c"):
        table.grant(rid, ticket=object(), exporter=None)
        clock.now += 1.0
    assert len(table) == 3 and "b" in table
    with pytest.raises(ValueError, match="request_id"):
        table.grant("a", ticket=None, exporter=None)
    assert table.end("b", "sent") is True and table.end("b", "released") is False  # idempotent
    clock.now += 8.5  # a expired (granted at 1000, deadline 1010); c not (1012)
    assert table.sweep() == ["a"] and table.sweep() == []
    assert ended == [("b", "sent"), ("a", "expired")] and list(table._leases) == ["c"]
    assert table.ended == {"sent": 1, "released": 0, "expired": 1, "stopped": 0}
    assert table.end_all() == 1 and ended[-1] == ("c", "stopped") and len(table) == 0
    with pytest.raises(ValueError, match="reason"):
        table.end("c", "adopted")
    assert set(END_REASONS) == set(table.ended)


def test_a_lease_ends_after_the_last_announced_pull_or_the_first_failed_send():
    table, ended, _ = _table()
    table.grant("group", ticket=object(), exporter=None)  # a decode group pulls 4 times (2 ranks x 2 sources)
    assert [table.sent("group", True, 4) for _ in range(3)] == [False] * 3
    assert "group" in table and ended == []  # never before every decode rank has pulled
    assert table.sent("group", True, 4) is True and ended == [("group", "sent")]
    assert table.sent("group", True, 4) is False  # ended already: no second end
    table.grant("broken", ticket=object(), exporter=None)
    assert table.sent("broken", True, 3) is False
    assert table.sent("broken", False, 3) is True and ended[-1] == ("broken", "sent")  # the first failure ends it
    table.grant("one", ticket=object(), exporter=None)
    assert table.sent("one", True) is True and ended[-1] == ("one", "sent")  # a whole-replica pull: one send
    assert table.sent("never-granted", True, 2) is False
    for bad in (0, -1, True, 1.0, None):
        with pytest.raises(ValueError, match="^pulls"):
            table.sent("x", True, bad)
    assert table.ended["sent"] == 3


@pytest.mark.parametrize("bad", [0, -1.0, True, "10", None])
def test_lease_timeout_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match="timeout_s"):
        LeaseTable(bad, lambda lease, why: None)


def test_a_failing_cleanup_does_not_stop_the_sweep():
    ended = []

    def on_end(lease, why):
        ended.append(lease.request_id)
        if lease.request_id == "a":
            raise RuntimeError("boom")

    clock = _Clock()
    table = LeaseTable(1.0, on_end, clock=clock)
    table.grant("a", None, None)
    table.grant("b", None, None)
    clock.now += 2.0
    assert table.sweep() == ["a", "b"] and ended == ["a", "b"] and len(table) == 0


def test_the_timer_ends_an_expired_lease_with_no_call_open():
    ended = []
    table = LeaseTable(0.2, lambda lease, why: ended.append((lease.request_id, why)))

    async def go():
        table.grant("r", None, None)
        table.start()
        table.start()  # idempotent: one timer
        for _ in range(200):  # bounded wait for the outcome; nothing here asserts a duration
            if ended:
                break
            await asyncio.sleep(0.05)
        table.stop()

    asyncio.run(go())
    assert ended == [("r", "expired")] and len(table) == 0


# ------------------------------------------------------------------ replicas in this process
OPTS = {"model": "builtin:tiny", "alpha": 0.0, "torch_threads": 1, "prefill_kv_pages": 16, "decode_kv_pages": 16, "transport": "gloo",
        "lease_timeout_s": 30.0}


def _prompt(seed, n=40):
    rng = random.Random(seed)
    return [256] + [rng.randrange(256) for _ in range(n - 1)]


def _call(rid, prompt, **kw):
    return PrefillCall(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(temperature=0.0, max_new_tokens=4),
                       **kw)


@pytest.fixture
def prefill_server():
    from prefill_worker.deployment import PrefillServer

    server = PrefillServer(OPTS)
    yield server
    server.close()


def test_prefill_returns_and_the_pages_stay_under_a_lease_until_its_deadline(prefill_server):
    pre = prefill_server
    event = asyncio.run(pre.prefill(_call("r", _prompt(1))))
    assert isinstance(event, Prefilled) and event.ticket is not None and event.ticket.transport == "gloo"
    # the call is over (no slot of max_ongoing_requests taken), the pages are leased
    assert pre.active == 0 and len(pre.leases) == 1 and pre.pool.has("r")
    stats = pre.record_routing_stats()
    assert stats["leased"] == 1 and stats["active"] == 0
    # the deadline passes: the sweep frees the pages and forgets the export
    pre.leases._clock = lambda: float("inf")
    assert pre.leases.sweep() == ["r"]
    assert not pre.pool.has("r") and pre.pool.free_pages == pre.pool.num_pages
    assert pre.record_routing_stats()["leases_ended"]["expired"] == 1
    reply = asyncio.run(pre.send_pages(SendPages(request_id="r", sender_id=pre.transport.replica_id, receiver_id="D",
                                                 host="127.0.0.1", port=1, prefix="fpkv/x/", generation=1,
                                                 backend="gloo", timeout_s=1.0, layers_per_chunk=1)))
    assert reply.ok is False and reply.reason == "lost"  # too late: nothing left to send


def test_release_pages_ends_a_lease_and_is_idempotent(prefill_server):
    pre = prefill_server
    asyncio.run(pre.prefill(_call("r", _prompt(2))))
    assert asyncio.run(pre.release_pages(ReleasePages("r"))) == PagesReleased(True)
    assert asyncio.run(pre.release_pages(ReleasePages("r"))) == PagesReleased(False)
    assert pre.pool.free_pages == pre.pool.num_pages and pre.leases.ended["released"] == 1
    bad = asyncio.run(pre.release_pages(ReleasePages(7)))
    assert bad.ended is False and "request_id" in bad.message
    bad = asyncio.run(pre.release_pages({"request_id": "r"}))  # a dict is not the message
    assert bad.ended is False and "ReleasePages" in bad.message


def test_no_lease_without_a_ticket_or_when_the_export_fails(prefill_server, monkeypatch):
    pre = prefill_server
    event = asyncio.run(pre.prefill(_call("one", _prompt(3), skip_transfer=True)))
    assert event.ticket is None and len(pre.leases) == 0 and pre.pool.free_pages == pre.pool.num_pages

    def broken(pool, rid, fault=None):
        raise RuntimeError("export failed")

    monkeypatch.setattr(pre.transport, "export", broken)
    with pytest.raises(RuntimeError, match="export failed"):
        asyncio.run(pre.prefill(_call("x", _prompt(4))))
    assert len(pre.leases) == 0 and pre.pool.free_pages == pre.pool.num_pages and pre.active == 0


def test_a_first_token_that_stops_every_choice_exports_nothing(prefill_server):
    """``ends_at_stop``: a first attempt whose first tokens end the request (each one of its
    choice's stop tokens) leaves no ticket, no lease and no page behind; a retry's call (not
    ``ends_at_stop``), or a group with one choice that goes on, is exported as before."""
    pre = prefill_server
    prompt = _prompt(11)
    first = asyncio.run(pre.prefill(_call("probe", prompt, skip_transfer=True))).first_token  # greedy
    stops = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=(first,))
    other = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=((first + 1) % 256,))
    event = asyncio.run(pre.prefill(PrefillCall("ends", prompt, stops, ends_at_stop=True)))
    assert event.first_token == first and event.ticket is None
    assert len(pre.leases) == 0 and pre.pool.free_pages == pre.pool.num_pages
    kept = []
    for rid, call in [("retry", PrefillCall("retry", prompt, stops)),
                      ("goes-on", PrefillCall("goes-on", prompt, other, ends_at_stop=True)),
                      ("group", PrefillCall("group", prompt, stops, ends_at_stop=True, choices=(stops, other)))]:
        event = asyncio.run(pre.prefill(call))
        assert event.ticket is not None and rid in pre.leases, rid
        kept.append(rid)
    assert len(pre.leases) == len(kept)
    for rid in kept:
        assert asyncio.run(pre.release_pages(ReleasePages(rid))) == PagesReleased(True)
    assert pre.pool.free_pages == pre.pool.num_pages
    # both choices of a group stopping: nothing exported
    event = asyncio.run(pre.prefill(PrefillCall("both", prompt, stops, ends_at_stop=True, choices=(stops, stops))))
    assert event.first_tokens == (first, first) and event.ticket is None and len(pre.leases) == 0


def test_ended_by_is_the_reporters_rule():
    p = SamplingParams(stop_token_ids=(5, 9))
    q = SamplingParams(stop_token_ids=(7,))
    assert PrefillCall("a", [1], p, skip_transfer=True).ended_by([3]) is True
    assert PrefillCall("a", [1], p).ended_by([5]) is False  # not the answer's first token
    assert PrefillCall("a", [1], p, ends_at_stop=True).ended_by([9]) is True
    assert PrefillCall("a", [1], p, ends_at_stop=True).ended_by([7]) is False
    assert PrefillCall("a", [1], p, ends_at_stop=True, choices=(p, q)).ended_by([5, 7]) is True
    assert PrefillCall("a", [1], p, ends_at_stop=True, choices=(p, q)).ended_by([5, 5]) is False
    assert PrefillCall("a", [1], p, ends_at_stop=True, choices=(p, q)).ended_by([5]) is False  # one token for two


def test_what_each_transport_holds_after_export():
    """Pages under a lease for the transports that read them later; the object store copies
    them into a frame but keeps the frame's reference until the receiver's release; a local
    frame holds nothing."""
    from kv_transfer.channel.send import ChannelSender
    from kv_transfer.cuda_ipc.recv import CudaIpcReceiver
    from kv_transfer.cuda_ipc.send import CudaIpcSender
    from kv_transfer.transfer import LocalTransport, ObjectStoreTransport

    assert not ObjectStoreTransport.reads_pages_after_export and not LocalTransport.reads_pages_after_export
    assert ChannelSender.reads_pages_after_export and CudaIpcSender.reads_pages_after_export
    assert ObjectStoreTransport.keeps_frame_until_released and ObjectStoreTransport.releases_after_receive
    assert not LocalTransport.keeps_frame_until_released and not LocalTransport.releases_after_receive
    assert CudaIpcReceiver.releases_after_receive


class _FakeObjectStore:
    """Ray's object store for ObjectStoreTransport in this process: ``put`` keeps the frame
    under a key, ``fetch`` reads it back (what the decode replica's fetch does with an
    ObjectRef); what a test checks is the replicas' lease protocol, not Ray's."""

    def __init__(self, monkeypatch):
        import ray

        from kv_transfer.transfer import ObjectStoreTransport

        self.frames: dict[int, object] = {}
        monkeypatch.setattr(ray, "put", self.put)

        async def fetch(transport, ticket):
            return self.frames[ticket.handle[0]]

        monkeypatch.setattr(ObjectStoreTransport, "fetch", fetch)

    def put(self, frame):
        key = len(self.frames)
        self.frames[key] = frame
        return key


OBJECT_STORE = {**OPTS, "transport": "object_store"}


@pytest.fixture
def object_store_prefill(monkeypatch):
    from prefill_worker.deployment import PrefillServer

    _FakeObjectStore(monkeypatch)
    server = PrefillServer(OBJECT_STORE)
    yield server
    server.close()


def test_an_object_store_export_frees_the_pages_and_holds_the_frame_under_a_lease(object_store_prefill):
    pre = object_store_prefill

    async def go():  # one event loop: the replica's batching loop lives on it
        event = await pre.prefill(_call("r", _prompt(21)))
        assert event.ticket.transport == "object_store" and event.ticket.sender == pre.identity
        assert not pre.pool.has("r") and pre.pool.free_pages == pre.pool.num_pages  # the frame is a copy
        assert "r" in pre.leases and pre.leases.holds_pages("r") is False
        assert pre.record_routing_stats()["leased"] == 1
        assert pre.leases._leases["r"].ticket.handle == event.ticket.handle  # the owner's reference to the frame
        # a new attempt of the request (its transfer failed) while the old frame is still held:
        # the old lease ends, the new one holds the new frame
        again = await pre.prefill(_call("r", _prompt(21)))
        assert pre.leases.ended["released"] == 1 and len(pre.leases) == 1
        assert pre.leases._leases["r"].ticket.handle == again.ticket.handle != event.ticket.handle
        assert await pre.release_pages(ReleasePages("r")) == PagesReleased(True)
        assert len(pre.leases) == 0 and pre.pool.free_pages == pre.pool.num_pages

    asyncio.run(go())


def test_ending_a_frame_lease_never_frees_pages_the_request_holds_now(object_store_prefill):
    """A frame's lease ends (a late release, the deadline) while a new attempt of the same
    request is being prefilled into pages of this pool: those pages stay."""
    pre = object_store_prefill
    asyncio.run(pre.prefill(_call("r", _prompt(22))))
    pre.pool.reserve("r", 40)  # as a new attempt's prefill would
    pre.leases._clock = lambda: float("inf")
    assert pre.leases.sweep() == ["r"]
    assert pre.pool.has("r") and pre.leases.ended["expired"] == 1
    pre.pool.release("r")


def test_decode_releases_the_frame_right_after_its_fetch_not_after_the_stream(object_store_prefill, monkeypatch):
    from decode_worker.deployment import DecodeServer

    pre = object_store_prefill
    dec = DecodeServer(OBJECT_STORE)
    calls = _wire(monkeypatch, pre)
    try:
        event = asyncio.run(pre.prefill(_call("r", _prompt(23))))
        call = DecodeCall(request_id="r", ticket=event.ticket, kv_len=event.kv_len, first_token=event.first_token,
                          params=SamplingParams(temperature=0.0, max_new_tokens=6))

        async def go():
            stream = dec.generate(call)
            first = await stream.__anext__()
            await asyncio.gather(*dec._background)
            at_adoption = (list(calls), dict(pre.leases.ended), len(pre.leases))
            rest = [e async for e in stream]
            await asyncio.gather(*dec._background)
            return first, at_adoption, rest

        first, at_adoption, rest = asyncio.run(go())
        assert isinstance(first, Adopted)
        # while the request has tokens to go, the frame's lease has already ended
        assert at_adoption == ([("release_pages", pre.identity["replica_id"], "r")],
                               {"sent": 0, "released": 1, "expired": 0, "stopped": 0}, 0)
        assert all(isinstance(e, Tokens) for e in rest) and rest[-1].finished
        assert len(calls) == 1  # released once
        assert dec.pool.free_pages == dec.pool.num_pages
    finally:
        for r in dec.receivers.values():
            r.close()


def test_a_failed_fetch_releases_the_frame(object_store_prefill, monkeypatch):
    from decode_worker.deployment import DecodeServer
    from kv_transfer.transfer import ObjectStoreTransport, TransferError, TransferFailure

    pre = object_store_prefill
    dec = DecodeServer(OBJECT_STORE)
    calls = _wire(monkeypatch, pre)

    async def lost(transport, ticket):
        raise TransferError(TransferFailure.LOST, "ObjectLostError: gone", ticket.request_id)

    monkeypatch.setattr(ObjectStoreTransport, "fetch", lost)
    try:
        event = asyncio.run(pre.prefill(_call("r", _prompt(24))))
        events = _drive(dec, DecodeCall(request_id="r", ticket=event.ticket, kv_len=event.kv_len,
                                        first_token=event.first_token,
                                        params=SamplingParams(temperature=0.0, max_new_tokens=4)))
        assert len(events) == 1 and isinstance(events[0], TransferFailed) and events[0].reason == "lost"
        assert events[0].retryable and "ObjectLostError" in events[0].message
        assert calls == [("release_pages", pre.identity["replica_id"], "r")] and len(pre.leases) == 0
        assert dec.pool.free_pages == dec.pool.num_pages
    finally:
        for r in dec.receivers.values():
            r.close()


def _wire(monkeypatch, pre):
    """The decode replica's Serve calls to the prefill replica, made directly."""
    from serving.prefill_client import PrefillClient

    calls = []

    async def call(self, method, sender, request):
        calls.append((method, sender["replica_id"], request.request_id))
        return await getattr(pre, method)(request)

    monkeypatch.setattr(PrefillClient, "_call", call)
    return calls


def _drive(dec, call):
    async def go():
        events = [e async for e in dec.generate(call)]
        await asyncio.gather(*dec._background)  # the fire-and-forget release, if any
        return events

    return asyncio.run(go())


def test_decode_fetches_once_over_the_channel_and_the_send_ends_the_lease(prefill_server, monkeypatch):
    from decode_worker.deployment import DecodeServer

    pre = prefill_server
    dec = DecodeServer(OPTS)
    calls = _wire(monkeypatch, pre)
    try:
        prompt = _prompt(5)
        event = asyncio.run(pre.prefill(_call("r", prompt)))
        events = _drive(dec, DecodeCall(request_id="r", ticket=event.ticket, kv_len=event.kv_len,
                                        first_token=event.first_token,
                                        params=SamplingParams(temperature=0.0, max_new_tokens=4)))
        assert isinstance(events[0], Adopted) and all(isinstance(e, Tokens) for e in events[1:])
        assert events[-1].finished
        # one call back to the holder, the send itself; it ended the lease: no release message
        assert calls == [("send_pages", pre.replica_id, "r")]
        assert pre.leases.ended == {"sent": 1, "released": 0, "expired": 0, "stopped": 0}
        assert pre.pool.free_pages == pre.pool.num_pages and dec.pool.free_pages == dec.pool.num_pages
    finally:
        for r in dec.receivers.values():
            r.close()


def test_a_decode_replica_with_no_room_releases_the_lease(prefill_server, monkeypatch):
    from decode_worker.deployment import DecodeServer

    pre = prefill_server
    dec = DecodeServer({**OPTS, "decode_kv_pages": 1, "adopt_wait_s": 0.0})
    calls = _wire(monkeypatch, pre)
    try:
        event = asyncio.run(pre.prefill(_call("r", _prompt(6, n=100))))
        events = _drive(dec, DecodeCall(request_id="r", ticket=event.ticket, kv_len=event.kv_len,
                                        first_token=event.first_token,
                                        params=SamplingParams(temperature=0.0, max_new_tokens=4)))
        assert len(events) == 1 and isinstance(events[0], TransferFailed) and events[0].reason == "pool_exhausted"
        assert calls == [("release_pages", pre.replica_id, "r")]
        assert pre.leases.ended["released"] == 1 and pre.pool.free_pages == pre.pool.num_pages
    finally:
        for r in dec.receivers.values():
            r.close()


def test_a_stopping_replica_lets_open_leases_be_fetched_then_frees_them(monkeypatch):
    """Serve awaits what ``__del__`` returns: with a lease open it waits for the lease to end
    (here: released while it waits), then closes; with none it closes at once."""
    import prefill_worker.deployment as pd

    pre = pd.PrefillServer(OPTS)
    asyncio.run(pre.prefill(_call("r", _prompt(7))))

    async def stop():
        drain = pre.__del__()
        assert asyncio.iscoroutine(drain)
        task = asyncio.ensure_future(drain)
        await asyncio.sleep(0.2)
        assert not task.done() and len(pre.leases) == 1  # still waiting for the fetch
        await pre.release_pages(ReleasePages("r"))
        await task

    asyncio.run(stop())
    assert pre.leases.ended["released"] == 1 and pre.pool.free_pages == pre.pool.num_pages
    monkeypatch.setattr(pd, "LEASE_DRAIN_S", 0.0)  # a lease nobody fetches: freed when the drain ends
    asyncio.run(pre.prefill(_call("s", _prompt(8))))

    async def stop_now():
        await pre.__del__()

    asyncio.run(stop_now())
    assert pre.leases.ended["stopped"] == 1 and pre.pool.free_pages == pre.pool.num_pages
    assert pre.__del__() is None  # outside an event loop: closes at once


def test_decode_admission_waits_on_its_ledger_and_wakes_when_a_request_leaves():
    """One ledger of page claims (DecodeScheduler); a request that does not fit waits (bounded by
    ``decode.adopt_wait_s``) and is admitted when another leaves it, with no polling."""
    from decode_worker.deployment import DecodeServer

    dec = DecodeServer({**OPTS, "decode_kv_pages": 8, "adopt_wait_s": 30.0})
    try:
        async def go():
            assert await dec._admit("a", 6) is True and dec.committed_pages == 6
            waiter = asyncio.ensure_future(dec._admit("b", 4))
            await asyncio.sleep(0.05)
            assert not waiter.done()  # 6 + 4 > 8: waits
            await dec._leave("a")
            assert await asyncio.wait_for(waiter, 10) is True
            assert dec.committed_pages == 4  # b's claim alone
            assert await dec._admit("huge", 9) is False  # larger than the pool: refused at once

        asyncio.run(go())
        quick = DecodeServer({**OPTS, "decode_kv_pages": 8, "adopt_wait_s": 0.0})
        try:
            async def no_wait():
                assert await quick._admit("a", 8) is True  # room now: admitted with no wait
                assert await quick._admit("b", 1) is False  # none, and no time to wait

            asyncio.run(no_wait())
        finally:
            for r in quick.receivers.values():
                r.close()
    finally:
        for r in dec.receivers.values():
            r.close()


def test_a_group_is_adopted_once_forked_per_choice_and_one_choice_cancelled_alone(prefill_server, monkeypatch):
    """n choices through the replicas: one prefill samples each choice's first token, the decode
    replica adopts the pages once, decodes the choices as forks and stops one on request; the
    others equal the single-process oracle of each choice alone; every page comes back."""
    from decode_worker.deployment import DecodeServer
    from model_executor.loading import load_model
    from router.offline import generate
    from serving.config import ServiceConfig

    pre = prefill_server
    dec = DecodeServer(OPTS)
    _wire(monkeypatch, pre)
    cfg = ServiceConfig.from_dict(OPTS)
    prompt = _prompt(11)
    choices = tuple(SamplingParams(temperature=1.0, seed=70 + k, max_new_tokens=12) for k in range(3))
    try:
        event = asyncio.run(pre.prefill(PrefillCall(request_id="g", prompt_token_ids=prompt, params=choices[0],
                                                    choices=choices)))
        assert pre.completed == 1 and len(event.first_tokens) == 3
        call = DecodeCall(request_id="g", ticket=event.ticket, kv_len=event.kv_len, first_token=event.first_tokens[0],
                          params=choices[0], choices=tuple(zip(event.first_tokens, choices)))

        async def go():
            out = {k: [tok] for k, tok in enumerate(event.first_tokens)}
            reasons, replies = {}, []
            async for e in dec.generate(call):
                if isinstance(e, Adopted):
                    # its adoption's pages (shared once, a partial page copy per extra choice), not
                    # its growth to max_new_tokens (DecodeScheduler)
                    assert dec.committed_pages == dec.scheduler.adoption_pages(call.kv_len, len(call.choices))
                    continue
                out[e.choice].extend(e.tokens)
                if e.finished:
                    reasons[e.choice] = e.finish_reason
                if e.choice == 1 and not replies:
                    replies.append(await dec.cancel_choice(CancelChoice("g", 1)))
                    replies.append(await dec.cancel_choice(CancelChoice("g", 1)))  # ended: no-op
                    replies.append(await dec.cancel_choice(CancelChoice("g", 7)))
                    replies.append(await dec.cancel_choice(CancelChoice(3, 0)))
            await asyncio.gather(*dec._background)
            return out, reasons, replies

        out, reasons, replies = asyncio.run(go())
        assert [r.cancelled for r in replies] == [True, False, False, False] and "request_id" in replies[-1].message
        assert reasons == {0: "length", 1: "cancelled", 2: "length"}
        model = load_model(None)
        for k in (0, 2):
            [want] = generate([prompt], choices[k], model=model, sparse_config=cfg.sparse_config,
                              dense_below=cfg.sparse.dense_below, page_size=cfg.kv.page_size, ignore_eos=True)
            assert out[k] == list(want.output_token_ids)
        assert len(out[1]) < 12
        assert dec.pool.free_pages == dec.pool.num_pages and dec.committed_pages == 0 and dec.loop.num_streams == 0
        assert pre.pool.free_pages == pre.pool.num_pages
    finally:
        for r in dec.receivers.values():
            r.close()
