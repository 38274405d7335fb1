"""Channel transfers from a TP prefill group (kv_transfer/tp_transfer.TPChannelTransport and
ChannelReceiver.receive_heads) over gloo, in process: every prefill rank sends its own heads
over its own channel; the decode pool (TP 1, or one rank of a TP decode group) ends up holding
exactly the unsharded pool's pages, bit for bit; a failure on any rank fails the whole transfer
and leaves no page reserved; tickets and send requests are checked strictly."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from dataclasses import replace

import pytest
import torch

from kv_cache.heads import HeadLayout
from kv_transfer.channel.recv import ChannelReceiver
from kv_transfer.channel.send import ChannelSender
from kv_transfer.channel.config import ChannelConfig
from kv_transfer.channel.pages import gather_heads, scatter_heads
from kv_transfer.transfer import KVFrameHeader, TransferError, TransferFailure, TransferTicket
from kv_transfer.wire import SendPages, SendReply, send_pulls
from kv_transfer.channel.group import RankChannel, TPChannelTransport, receive_group
from kv_transfer.choice import group_transport
from prefill_worker.leases import LeaseTable
from tests.test_tp_transfer import HKV, HQ, PAGE, RID, assert_rank_holds_its_heads, full_pool, rank_pool

# a well-formed send request for rank 0's sender (tests vary one field)
BASE = SendPages(request_id=RID, sender_id="P:tp0", receiver_id="D0", host="127.0.0.1", port=1, prefix="fpkv/x/",
                 generation=1, backend="gloo", timeout_s=1.0, layers_per_chunk=1)

# torch's TCPStore reverse-resolves peer addresses while it connects
# (getnameinfo on ::ffff:127.0.0.1), and a sandbox's resolver can take 5 s per lookup under a
# burst of them (a decode group opens several channels at once): room for two lookups.
ROOMY = ChannelConfig(connect_timeout_s=20.0, transfer_timeout_s=5.0, idle_reopen_s=60.0)


class Group:
    """A TP prefill group of ``p`` ranks (their pools cut from ``full``) and ``d`` decode
    receivers (one transport per decode rank, named as a TP decode replica's ranks are:
    ``D:tp<r>``), wired in process. ``plain``: the sender is a TP=1 prefill replica's own
    ``ChannelSender`` (``p`` must be 1; its tickets carry no ``tp``). The prefill side keeps
    its lease as the replica does (``LeaseTable``: ``send_pages`` counts the sends; ending it
    discards the exports and frees every prefill rank's pages)."""

    def __init__(self, full, p: int, d: int = 1, config: ChannelConfig = ROOMY, *, plain: bool = False) -> None:
        assert not plain or p == 1
        self.src, self.dst = HeadLayout(HQ, HKV, p), HeadLayout(HQ, HKV, d)
        self.src_pools = [rank_pool(full, self.src.kv_heads(r), with_request=True) for r in range(p)]
        self.dst_pools = [rank_pool(full, self.dst.kv_heads(r), with_request=False) for r in range(d)]
        ident = lambda r: TPChannelTransport.rank_identity("P", r)  # noqa: E731
        who = {"replica_id": "P", "app": "a", "deployment": "Prefill"}
        if plain:
            self.rank_transports = [ChannelSender("cpu", identity=who, config=config)]
            self.followers = []
            self.sender = self.rank_transports[0]
        else:
            self.rank_transports = [ChannelSender("cpu", identity=ident(r), config=config) for r in range(p)]
            self.followers = [RankChannel(t, pool) for t, pool in zip(self.rank_transports[1:], self.src_pools[1:])]
            self.sender = TPChannelTransport(self.rank_transports[0], self.src, self.followers, identity=who,
                                             host="127.0.0.1")
        self.calls: list[dict] = []
        self.leased_at_call: list[bool] = []  # was the lease still open when each send was asked for
        self.lease_ended = False

        def end_lease(lease, reason):  # PrefillServer._end_lease
            self.lease_ended = reason
            self.sender.discard(lease.ticket)
            for pool in self.src_pools:
                pool.release(lease.request_id)

        self.leases = LeaseTable(60.0, end_lease)

        async def call_sender(sender: dict, request: SendPages) -> SendReply:  # PrefillServer.send_pages
            assert sender["replica_id"] == "P"  # routed to the leader, which relays
            self.calls.append(request)
            self.leased_at_call.append(request.request_id in self.leases)
            reply = await self.sender.serve_send(request)
            self.leases.sent(request.request_id, reply.ok, send_pulls(request))
            return reply

        self.receivers = [ChannelReceiver("cpu", identity=TPChannelTransport.rank_identity("D", r),
                                          call_sender=call_sender, config=config) for r in range(d)]

    def export(self, fault=None):
        ticket = self.sender.export(self.src_pools[0], RID, fault=fault)
        if RID not in self.leases:  # some tests export again, to build bad tickets
            self.leases.grant(RID, ticket, self.sender)
        return ticket

    async def receive_group(self, ticket):
        """Every decode rank pulls its heads at once; all or nothing over the group."""
        await receive_group([rx.receive_heads(ticket, pool, dst_layout=self.dst, dst_rank=r)
                             for r, (rx, pool) in enumerate(zip(self.receivers, self.dst_pools))],
                            lambda: [pool.release(RID) for pool in self.dst_pools])

    def close(self) -> None:
        for t in self.rank_transports + self.receivers:
            t.close()
        time.sleep(0.1)  # see tests/test_kv_channel.py Pair.close


@pytest.fixture(autouse=True)
def _collect_garbage():
    """Collect each test's garbage (transports, replicas with ``__del__``) right after it: a
    collection that happens later inside an unrelated ``ast.parse`` (pytest rewriting a late
    import) runs those finalizers there and trips CPython 3.11's "AST constructor recursion depth
    mismatch" SystemError."""
    yield
    gc.collect()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("p", [2, 4])
def test_tp_group_to_one_decode_replica_is_bit_exact(dtype, p):
    full = full_pool(dtype, seed=11 + p)
    g = Group(full, p)
    try:
        ticket = g.export()
        assert ticket.transport == "gloo" and ticket.nbytes == sum(
            2 * full.num_layers * len(full.pages(RID)) * full.page_size * full.head_dim * full.k.element_size()
            for _ in range(HKV))
        pages = run(g.receivers[0].receive(ticket, g.dst_pools[0]))
        assert len(pages) == full.pages_for(full.seq_len(RID))
        assert_rank_holds_its_heads(full, g.dst_pools[0], range(HKV))
        assert sorted(c.rank for c in g.calls) == list(range(p))  # one send per rank, each its own heads
        assert [c.sender_id for c in g.calls] == [f"P:tp{r}" for r in range(p)]
        assert g.lease_ended  # every rank sent
        assert all(t.counters()["channel_sends"] == 1 for t in g.rank_transports)
    finally:
        g.close()


@pytest.mark.parametrize("p,d", [(2, 2), (1, 2), (4, 2)])
def test_each_decode_rank_receives_only_its_heads(p, d):
    full = full_pool(torch.bfloat16, seed=5 * p + d)
    g = Group(full, p, d)
    try:
        ticket = g.export()
        for r in range(d):
            run(g.receivers[r].receive_heads(ticket, g.dst_pools[r], dst_layout=g.dst, dst_rank=r))
            assert_rank_holds_its_heads(full, g.dst_pools[r], g.dst.kv_heads(r))
        with pytest.raises(ValueError, match="^dst_rank"):
            run(g.receivers[0].receive_heads(ticket, g.dst_pools[0], dst_layout=g.dst, dst_rank=d))
        # a decode rank whose pool holds other heads than its layout says takes no page
        wrong = rank_pool(full, range(HKV), with_request=False)
        with pytest.raises(TransferError, match="the routes fill heads") as info:
            run(g.receivers[0].receive_heads(ticket, wrong, dst_layout=g.dst, dst_rank=0))
        assert info.value.reason is TransferFailure.SHAPE and wrong.used_pages == 0
        # bytes each decode rank pulled: its own heads only
        for r, t in enumerate(g.receivers):
            per_head = 2 * full.num_layers * len(full.pages(RID)) * full.page_size * full.head_dim * 2
            assert t.counters()["channel_bytes_received"] == per_head * g.dst.local_kv_heads
    finally:
        g.close()


@pytest.mark.parametrize("fault", ["flip", "break"])
def test_a_fault_on_one_rank_fails_the_whole_transfer_and_frees_every_page(fault):
    full = full_pool(torch.float32, seed=3)
    g = Group(full, 2)
    try:
        ticket = g.export(fault=fault)
        with pytest.raises(TransferError) as info:
            run(g.receivers[0].receive(ticket, g.dst_pools[0]))
        assert info.value.retryable
        assert info.value.reason is (TransferFailure.CHECKSUM if fault == "flip" else TransferFailure.LOST)
        assert g.dst_pools[0].used_pages == 0 and not g.dst_pools[0].has(RID)
        assert g.lease_ended  # the failed rank's send ended the lease (flip: both sent, the check failed)
        # the lease's end discards every rank's export; the prefill pages then go back
        g.sender.discard(ticket)
        assert all(t.counters()["channel_staged"] == 0 for t in g.rank_transports)
        # a later transfer of the same pages is refused (the ranks no longer export them)
        with pytest.raises(TransferError) as again:
            run(g.receivers[0].receive(ticket, g.dst_pools[0]))
        assert again.value.reason is TransferFailure.LOST
        assert g.dst_pools[0].used_pages == 0
    finally:
        g.close()


def test_discard_before_a_send_fails_that_rank_and_the_transfer():
    full = full_pool(torch.float32, seed=4)
    g = Group(full, 2)
    try:
        ticket = g.export()
        g.followers[0].discard(RID)  # rank 1's lease state gone (as after a release)
        with pytest.raises(TransferError) as info:
            run(g.receivers[0].receive(ticket, g.dst_pools[0]))
        assert info.value.reason is TransferFailure.LOST and "no exported pages" in str(info.value)
        assert g.dst_pools[0].used_pages == 0
        assert [c.rank for c in g.calls] == [0, 1]
    finally:
        g.close()


def _ticket(g: Group, **tp_changes):
    ticket = g.export()
    handle = dict(ticket.handle)
    handle["tp"] = {**handle["tp"], **tp_changes}
    return dataclasses.replace(ticket, handle=handle)


def test_bad_tp_tickets_are_refused_before_any_page_is_taken():
    full = full_pool(torch.float32, seed=6)
    g = Group(full, 2)
    try:
        good = g.export()
        hdr = KVFrameHeader.decode(good.handle["tp"]["ranks"][1])
        wrong_tokens = dataclasses.replace(hdr, num_tokens=hdr.num_tokens - 1).encode()
        cases = [
            ({"tp_size": 4}, TransferFailure.MALFORMED, "rank headers"),
            ({"tp_size": 3}, TransferFailure.MALFORMED, "must divide"),
            ({"ranks": "x"}, TransferFailure.MALFORMED, "tp: expected"),
            ({"ranks": [good.handle["tp"]["ranks"][0], wrong_tokens]}, TransferFailure.MALFORMED, "rank 1"),
            ({"num_kv_heads": HKV * 2}, TransferFailure.MALFORMED, "rank 0"),
        ]
        for change, reason, words in cases:
            g.calls.clear()
            with pytest.raises(TransferError) as info:
                run(g.receivers[0].receive(_ticket(g, **change), g.dst_pools[0]))
            assert info.value.reason is reason and words in str(info.value), (change, info.value)
            assert not g.calls and g.dst_pools[0].used_pages == 0
        # a pool with other heads (here half of them) cannot take the group's heads
        half = rank_pool(full, range(HKV // 2), with_request=False)
        with pytest.raises(TransferError, match="num_kv_heads") as info:
            run(g.receivers[0].receive(good, half))
        assert info.value.reason is TransferFailure.SHAPE and half.used_pages == 0 and not g.calls
        extra = dataclasses.replace(good, handle={**good.handle, "more": 1})
        with pytest.raises(TransferError) as info:
            run(g.receivers[0].receive(extra, g.dst_pools[0]))
        assert info.value.reason is TransferFailure.MALFORMED
        # FP8 scales that differ on one head are refused before any page is taken
        f8 = full_pool(torch.float8_e4m3fn, seed=7)
        g8 = Group(f8, 2)
        try:
            t8 = g8.export()
            g8.dst_pools[0].set_scales(0, f8.k_scale[0] * 2, f8.v_scale[0])
            with pytest.raises(TransferError, match="FP8 scales of KV head") as info:
                run(g8.receivers[0].receive(t8, g8.dst_pools[0]))
            assert info.value.reason is TransferFailure.SHAPE and not g8.calls
        finally:
            g8.close()
    finally:
        g.close()


def test_leader_refuses_send_requests_for_no_rank():
    full = full_pool(torch.float32, seed=8)
    g = Group(full, 2)
    try:
        for rank in (None, -1, 2, True, "0"):
            reply = run(g.sender.serve_send(replace(BASE, rank=rank, heads=(0,))))
            assert reply.ok is False and reply.reason == "unavailable" and "rank" in reply.message
        reply = run(g.sender.serve_send({"rank": 0}))  # not a SendPages
        assert reply.ok is False and reply.reason == "unavailable" and "rank" in reply.message
    finally:
        g.close()


def test_send_request_heads_are_checked():
    full = full_pool(torch.float32, seed=9)
    g = Group(full, 2)
    try:
        g.export()
        for extra, words in (({"rank": 0}, "rank, heads"), ({"rank": 0, "heads": ()}, "heads"),
                             ({"rank": 0, "heads": (0, 0)}, "heads"), ({"rank": 0, "heads": (True,)}, "heads"),
                             ({"rank": 0, "heads": [0]}, "heads"),
                             ({"rank": -1, "heads": (0,)}, "rank"), ({"rank": 0, "heads": (HKV,)}, "heads")):
            reply = run(g.rank_transports[0].serve_send(replace(BASE, **extra)))
            assert reply.ok is False and words in reply.message, (extra, reply)
    finally:
        g.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_gather_scatter_heads_roundtrip_against_plain_indexing(dtype):
    full = full_pool(dtype, seed=10)
    pages = full.pages(RID)
    heads = [3, 0, 2]
    got = gather_heads(full, pages, (1, 2), heads)
    hd = 2 if full.config.v_token_major else 3
    idx = torch.tensor(pages)
    want = torch.cat([src.view(torch.uint8)[1:2].index_select(1, idx).index_select(d, torch.tensor(heads)).reshape(-1)
                      for src, d in ((full.k_raw, 3), (full.v_raw, hd))])
    assert torch.equal(got, want)
    other = full_pool(dtype, seed=12)
    before_k = other.k_raw.clone()
    scatter_heads(other, pages, got, (1, 2), heads)
    assert torch.equal(gather_heads(other, pages, (1, 2), heads), want)
    assert torch.equal(other.k_raw[:, :, :, 1], before_k[:, :, :, 1])  # an untouched head stays
    with pytest.raises(ValueError, match="heads"):
        gather_heads(full, pages, (0, 1), [0, 0])
    with pytest.raises(ValueError, match="heads"):
        gather_heads(full, pages, (0, 1), [HKV])
    with pytest.raises(ValueError, match="payload"):
        scatter_heads(other, pages, got[:-1], (1, 2), heads)
    with pytest.raises(ValueError, match="followers"):
        TPChannelTransport(ChannelSender("cpu"), HeadLayout(HQ, HKV, 2), [], identity={}, host="h")


def test_the_tp_group_sender_is_a_sender_only():
    from kv_transfer.transfer import KVReceiver, KVSender

    leader = ChannelSender("cpu", identity=TPChannelTransport.rank_identity("P", 0))
    sender = TPChannelTransport(leader, HeadLayout(HQ, HKV, 1), [], identity={"replica_id": "P"}, host="h")
    try:
        assert isinstance(sender, KVSender) and not isinstance(sender, KVReceiver) and not hasattr(sender, "receive")
        assert sender.name == "gloo" and sender.serves_sends and sender.counters() == leader.counters()
    finally:
        sender.close()


def test_tp_prefill_transport_choice():
    from kv_transfer.transfer import select_transport
    from kv_transfer.choice import tp_transport_choice

    # CPU: gloo is the channel; auto means the object store
    assert tp_transport_choice(select_transport("gloo", device="cpu")) == "channel"
    assert tp_transport_choice(select_transport("auto", device="cpu")) == "object_store"
    assert tp_transport_choice(select_transport("object_store", device="cpu")) == "object_store"
    # CUDA (the choice only, no GPU needed): auto's IPC part does not apply to a TP group, its
    # NCCL channel does; cuda_ipc alone has no channel and ships the merged frame
    assert tp_transport_choice(select_transport("auto", device="cuda")) == "channel"
    assert tp_transport_choice(select_transport("nccl", device="cuda")) == "channel"
    assert tp_transport_choice(select_transport("cuda_ipc", device="cuda")) == "object_store"
    with pytest.raises(ValueError, match="^kind"):
        tp_transport_choice("carrier pigeon")


class _DeadRank:
    """A follower whose process is gone: every call fails."""

    def export(self, request_id, fault=None):
        raise RuntimeError("rank actor died")

    async def send(self, request):
        raise RuntimeError("rank actor died")

    def discard(self, request_id):
        raise RuntimeError("rank actor died")


def test_a_dead_rank_fails_the_export_and_leaves_no_export_behind():
    full = full_pool(torch.float32, seed=13)
    g = Group(full, 2)
    try:
        g.sender.followers[0] = _DeadRank()
        with pytest.raises(RuntimeError, match="died"):
            g.export()
        assert g.rank_transports[0].counters()["channel_staged"] == 0  # the leader's record is gone too
        assert RID not in g.leases  # no ticket, no lease
    finally:
        g.close()


def test_discard_reaches_every_live_rank_past_a_dead_one_and_a_dead_rank_send_is_lost():
    full = full_pool(torch.float32, seed=14)
    g = Group(full, 4)
    try:
        ticket = g.export()
        live = g.sender.followers[1]
        g.sender.followers[0] = _DeadRank()
        reply = run(g.sender.serve_send(replace(BASE, rank=1, heads=(0,))))
        assert reply.ok is False and reply.reason == "lost" and "TP rank 1" in reply.message
        g.sender.discard(ticket)  # must not stop at the dead rank 1
        assert live.transport.counters()["channel_staged"] == 0
        assert g.rank_transports[0].counters()["channel_staged"] == 0
        assert g.rank_transports[3].counters()["channel_staged"] == 0
    finally:
        g.close()


# -- channels into a TP decode group: every decode rank pulls its own heads at once ------------
def _pairs(src: HeadLayout, dst: HeadLayout) -> set[tuple[int, int]]:
    """(prefill rank, decode rank) pairs whose heads meet (no replicated heads here: HKV >= 4)."""
    return {(s, d) for s in range(src.tp_size) for d in range(dst.tp_size)
            if set(src.kv_heads(s)) & set(dst.kv_heads(d))}


@pytest.mark.parametrize("p,d,plain", [(1, 2, True), (2, 2, False), (4, 2, False), (1, 4, True), (2, 4, False)])
def test_a_decode_group_pulls_every_rank_at_once_bit_exact_and_the_lease_ends_after_the_last_pull(p, d, plain):
    full = full_pool(torch.bfloat16, seed=31 * p + d)
    g = Group(full, p, d, plain=plain)
    try:
        ticket = g.export()
        assert ("tp" in ticket.handle) is not plain
        run(g.receive_group(ticket))
        for r in range(d):  # each decode rank: exactly its heads, bit for bit (against the unsharded pool)
            assert_rank_holds_its_heads(full, g.dst_pools[r], g.dst.kv_heads(r))
        pairs = _pairs(g.src, g.dst)
        assert len(g.calls) == len(pairs) and all(c.pulls == len(pairs) for c in g.calls)
        # one channel per (prefill rank, decode rank) pair, each decode rank hosting its own store
        assert {(c.sender_id, c.receiver_id) for c in g.calls} == {
            (f"P:tp{s}" if not plain else "P", f"D:tp{r}") for s, r in pairs}
        assert len({(c.port, c.prefix) for c in g.calls}) == len(pairs)
        assert len({c.port for c in g.calls}) == d
        assert all(g.leased_at_call)  # the lease outlived every pull but the last...
        assert g.lease_ended == "sent" and RID not in g.leases  # ...whose success ended it
        assert all(pool.used_pages == 0 for pool in g.src_pools)  # freed on every prefill rank
        assert all(t.counters()["channel_staged"] == 0 for t in g.rank_transports)
        # a second group transfer from the same prefill replica reuses each pair's channel
        for pool in g.dst_pools:
            pool.release(RID)
        for pool, src in zip(g.src_pools, [rank_pool(full, g.src.kv_heads(r), with_request=True) for r in range(p)]):
            pool.adopt(RID, full.seq_len(RID))
            pool.k_raw.copy_(src.k_raw)
            pool.v_raw.copy_(src.v_raw)
        run(g.receive_group(g.export()))
        for r in range(d):
            assert_rank_holds_its_heads(full, g.dst_pools[r], g.dst.kv_heads(r))
        assert sum(t.counters()["channels_opened"] for t in g.receivers) == len(pairs)
    finally:
        g.close()


@pytest.mark.parametrize("p,d,fault", [(2, 2, "flip"), (4, 2, "flip"), (2, 2, "break"), (1, 2, "flip")])
def test_a_fault_on_one_pair_fails_every_decode_rank_leaves_no_page_and_ends_the_lease(p, d, fault):
    full = full_pool(torch.float32, seed=17 * p + d)
    g = Group(full, p, d, plain=p == 1)
    try:
        ticket = g.export(fault=fault)  # the last prefill rank's sends are damaged
        with pytest.raises(TransferError) as info:
            run(g.receive_group(ticket))
        assert info.value.retryable
        assert info.value.reason is (TransferFailure.CHECKSUM if fault == "flip" else TransferFailure.LOST)
        # the decode ranks that pulled clean heads released them too: nothing on any rank
        assert all(pool.used_pages == 0 and not pool.has(RID) for pool in g.dst_pools)
        assert g.lease_ended == "sent" and RID not in g.leases  # flip: every send ran; break: the first failure
        assert all(pool.used_pages == 0 for pool in g.src_pools)
        assert all(t.counters()["channel_staged"] == 0 for t in g.rank_transports)
    finally:
        g.close()


def test_a_decode_rank_that_fails_before_pulling_releases_the_group_and_the_lease_ends_by_release():
    full = full_pool(torch.float32, seed=41)
    g = Group(full, 2, 2)
    try:
        ticket = g.export()
        g.dst_pools[1].reserve("other", 12 * PAGE)  # decode rank 1 has no room: it never asks for a send
        with pytest.raises(TransferError) as info:
            run(g.receive_group(ticket))
        assert info.value.reason is TransferFailure.POOL_EXHAUSTED
        assert not g.dst_pools[0].has(RID) and g.dst_pools[0].used_pages == 0
        assert g.dst_pools[1].pages("other") and not g.dst_pools[1].has(RID)
        # rank 0 pulled (1 of 2 sends): the lease stays until the decode leader releases it
        assert RID in g.leases and len(g.calls) == 1
        assert g.leases.end(RID, "released") and all(pool.used_pages == 0 for pool in g.src_pools)
    finally:
        g.close()


class _Boom(RuntimeError):
    pass


def test_receive_group_settles_after_every_rank_and_releases_once():
    err = TransferError(TransferFailure.CHECKSUM, "bad chunk", RID)
    log = []

    async def rank(i, outcome, delay):
        await asyncio.sleep(delay)
        log.append(i)
        if isinstance(outcome, BaseException) and i != 2:
            raise outcome
        return outcome  # rank 2 returns its error (a follower's outcome comes back as a value)

    async def go(outcomes):
        released = []
        try:
            await receive_group([rank(i, o, 0.03 * (3 - i)) for i, o in enumerate(outcomes)],
                                lambda: released.append(sorted(log)))
        finally:
            log.clear()
        return released

    assert run(go([[1], [2], [3]])) == []  # every rank succeeded: nothing released
    with pytest.raises(TransferError) as info:
        run(go([[1], None, err]))
    assert info.value is err
    # a dead rank (not a transfer failure) wins over another rank's TransferError, after the release
    seen = []

    async def dead():
        released = []
        try:
            await receive_group([rank(0, err, 0.0), rank(1, _Boom("rank died"), 0.05)],
                                lambda: released.append(sorted(log)))
        except _Boom:
            seen.append(released)

    run(dead())
    assert seen == [[[0, 1]]]  # released once, after both ranks were done
    log.clear()

    async def release_async():
        done = []

        async def rel():
            done.append(sorted(log))

        with pytest.raises(TransferError):
            await receive_group([rank(0, None, 0.0), rank(1, err, 0.01)], rel)
        return done

    assert run(release_async()) == [[0, 1]]


def test_a_cancelled_group_receive_releases_every_rank_once_the_ranks_are_done():
    async def go():
        released, done = [], []

        async def rank(delay):
            await asyncio.sleep(delay)
            done.append(delay)

        task = asyncio.ensure_future(receive_group([rank(0.01), rank(0.2)], lambda: released.append(len(done))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert released == []  # rank 1 is still receiving: its pages would leak if released now
        await asyncio.sleep(0.3)
        return released

    assert run(go()) == [2]


def test_transport_choice_for_groups_on_either_side():
    from kv_transfer.transfer import select_transport

    cpu = {k: select_transport(k, device="cpu") for k in ("auto", "gloo", "object_store")}
    cuda = {k: select_transport(k, device="cuda") for k in ("auto", "nccl", "cuda_ipc", "object_store")}
    for p, d in ((2, 1), (1, 2), (2, 2), (4, 2)):
        assert group_transport(cpu["gloo"], p, d) == "gloo"
        assert group_transport(cpu["auto"], p, d) == "object_store"
        assert group_transport(cpu["object_store"], p, d) == "object_store"
        assert group_transport(cuda["auto"], p, d) == "nccl"  # never CUDA IPC into or from a group
        assert group_transport(cuda["nccl"], p, d) == "nccl"
        assert group_transport(cuda["cuda_ipc"], p, d) == "object_store"
        assert group_transport(cuda["object_store"], p, d) == "object_store"
    assert group_transport(cuda["auto"], 1, 1) == cuda["auto"]  # no group: IPC with the NCCL fallback
    assert group_transport(cuda["cuda_ipc"], 1, 1) == "cuda_ipc"
    for bad in ((0, 1), (1, True), (1, 2.0)):
        with pytest.raises(ValueError, match="_tp"):
            group_transport("gloo", *bad)


def test_send_request_pulls_are_checked():
    full = full_pool(torch.float32, seed=42)
    g = Group(full, 2)
    try:
        g.export()
        for extra in ({"pulls": 2}, {"rank": 0, "heads": (0,), "pulls": 0}, {"rank": 0, "heads": (0,), "pulls": True},
                      {"rank": 0, "heads": (0,), "pulls": 1 << 17}):
            reply = run(g.rank_transports[0].serve_send(replace(BASE, **extra)))
            assert reply.ok is False and "pulls" in reply.message, (extra, reply)
        assert send_pulls(replace(BASE, rank=0, heads=(0,), pulls=3)) == 3
        assert send_pulls(BASE) == 1 and send_pulls(replace(BASE, pulls="x")) == 1 and send_pulls(None) == 1
    finally:
        g.close()


def test_a_tp1_prefill_replica_feeding_tp_decode_groups_exports_over_channels_never_cuda_ipc(monkeypatch):
    """The prefill side of the choice (the CUDA kinds forced onto a CPU pool: the channel is then
    gloo): with ``decode.tensor_parallel_size`` 2 the replica exports over its channel (before:
    always the object store), ``auto`` on CUDA without its CUDA IPC part, ``cuda_ipc`` alone over
    the object store."""
    import kv_transfer.choice as choice
    import prefill_worker.deployment as pd
    from kv_transfer.cuda_ipc.send import CudaIpcSender
    from kv_transfer.transfer import IPC_OR_NCCL

    opts = {"model": "builtin:tiny", "alpha": 0.0, "torch_threads": 1, "prefill_kv_pages": 16, "decode_kv_pages": 16,
            "decode": {"tensor_parallel_size": 2}}
    for kind, want in ((IPC_OR_NCCL, "channel"), ("gloo", "channel"), ("cuda_ipc", "object_store"),
                       ("object_store", "object_store")):
        monkeypatch.setattr(choice, "select_transport", lambda requested, device, kind=kind: kind)
        pre = pd.PrefillServer(opts)
        try:
            assert not isinstance(pre.transport, CudaIpcSender), kind
            if want == "channel":
                assert isinstance(pre.transport, ChannelSender) and pre.transport.name == "gloo", kind
            else:
                assert pre.transport is pre.object_store, kind
        finally:
            pre.close()
