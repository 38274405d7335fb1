"""The one transport factory: which sender / receivers a replica gets for each placement and
``transfer.transport`` (kv_transfer.choice), and what serving.transports builds from that."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.choice import Placement, TransportChoice, choose_transports

# (requested, device, prefill TP, decode TP) -> the prefill replica's sender; hand-written from
# docs/ARCHITECTURE.md: a TP group on either side never uses CUDA IPC, auto on CPU is the
# object store, auto on CUDA is IPC with the NCCL channel behind it.
PREFILL = [
    ("auto", "cpu", 1, 1, "object_store"),
    ("object_store", "cpu", 1, 1, "object_store"),
    ("gloo", "cpu", 1, 1, "channel"),
    ("gloo", "cpu", 1, 2, "channel"),
    ("gloo", "cpu", 2, 1, "tp_channel"),
    ("gloo", "cpu", 2, 2, "tp_channel"),
    ("auto", "cpu", 2, 1, "object_store"),
    ("auto", "cuda", 1, 1, "cuda_ipc+channel"),
    ("auto", "cuda:1", 1, 2, "channel"),
    ("auto", "cuda", 2, 1, "tp_channel"),
    ("nccl", "cuda", 1, 1, "channel"),
    ("nccl", "cuda", 4, 2, "tp_channel"),
    ("cuda_ipc", "cuda", 1, 1, "cuda_ipc"),
    ("cuda_ipc", "cuda", 1, 2, "object_store"),
    ("cuda_ipc", "cuda", 2, 1, "object_store"),
    ("object_store", "cuda", 2, 2, "object_store"),
]


@pytest.mark.parametrize("requested,device,ptp,dtp,sender", PREFILL)
def test_the_prefill_sender_per_placement(requested, device, ptp, dtp, sender):
    got = choose_transports(requested, Placement("prefill", device, prefill_tp=ptp, decode_tp=dtp))
    assert got.sender == sender and got.receivers == () and got.grouped == (ptp > 1)
    # only cuda_ipc pushed onto the object store by a group is worth a warning
    assert (got.warning is not None) == (requested == "cuda_ipc" and sender == "object_store")
    if got.warning:
        assert "cuda_ipc" in got.warning and ("TP prefill" if ptp > 1 else "TP decode") in got.warning


DECODE = [
    ("auto", "cpu", 1, 1, ("object_store",)),
    ("gloo", "cpu", 1, 1, ("object_store", "channel")),
    ("gloo", "cpu", 2, 1, ("object_store", "channel")),
    ("gloo", "cpu", 1, 2, ("object_store", "channel")),
    ("auto", "cuda", 1, 1, ("object_store", "channel", "cuda_ipc")),
    # a TP=1 decode replica keeps its device's receivers whatever the prefill side is
    ("auto", "cuda", 4, 1, ("object_store", "channel", "cuda_ipc")),
    ("cuda_ipc", "cuda", 2, 1, ("object_store", "cuda_ipc")),
    ("auto", "cuda", 1, 2, ("object_store", "channel")),
    ("cuda_ipc", "cuda", 1, 2, ("object_store",)),
    ("nccl", "cuda", 1, 1, ("object_store", "channel")),
    ("object_store", "cuda", 1, 1, ("object_store",)),
]


@pytest.mark.parametrize("requested,device,ptp,dtp,receivers", DECODE)
def test_the_decode_receivers_per_placement(requested, device, ptp, dtp, receivers):
    got = choose_transports(requested, Placement("decode", device, prefill_tp=ptp, decode_tp=dtp))
    assert (got.sender, got.receivers, got.grouped, got.warning) == (None, receivers, dtp > 1, None)


@pytest.mark.parametrize("requested,device", [("nccl", "cpu"), ("cuda_ipc", "cpu"), ("gloo", "cuda"),
                                              ("rdma", "cpu")])
def test_a_transport_the_device_cannot_do_is_refused(requested, device):
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match="transport"):
            choose_transports(requested, Placement(role, device))


@pytest.mark.parametrize("kwargs,name", [
    ({"role": "router"}, "role"),
    ({"device": "tpu:0"}, "device"),
    ({"device": 3.5}, "device"),
    ({"prefill_tp": 0}, "prefill_tp"),
    ({"prefill_tp": True}, "prefill_tp"),
    ({"decode_tp": 2.0}, "decode_tp"),
])
def test_placement_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Placement(**{"role": "prefill", "device": "cpu", **kwargs})


def test_choose_needs_a_placement_and_placement_normalises_the_device():
    with pytest.raises(ValueError, match="placement"):
        choose_transports("auto", {"role": "prefill", "device": "cpu"})
    p = Placement("decode", "cuda:1", decode_tp=2)
    assert p.device == torch.device("cuda", 1) and p.grouped
    assert not Placement("prefill", "cpu", decode_tp=2).grouped  # its own side is TP=1


def test_the_factory_builds_what_the_choice_names_on_cpu():
    from kv_transfer.channel.recv import ChannelReceiver
    from kv_transfer.channel.send import ChannelSender
    from kv_transfer.transfer import ObjectStoreTransport
    from serving.config import ServiceConfig
    from serving.transports import make_decode_receivers, make_prefill_transports, placement_of

    class Client:
        async def send_pages(self, sender, request): ...
        async def stage_pages(self, sender, request): ...

    client = Client()
    for transport, sender_type, names in (("object_store", ObjectStoreTransport, {"object_store"}),
                                          ("gloo", ChannelSender, {"object_store", "gloo"})):
        cfg = ServiceConfig.from_dict({"transfer": {"transport": transport, "object_store": {"fetch_timeout_s": 7.0}}})
        pre = make_prefill_transports(cfg, placement_of(cfg, "prefill", "cpu"), identity={"replica_id": "P"},
                                      host="127.0.0.1")
        rx = make_decode_receivers(cfg, placement_of(cfg, "decode", "cpu"), identity={"replica_id": "D"},
                                   host="127.0.0.1", prefill=client)
        try:
            assert type(pre.sender) is sender_type and type(pre.object_store) is ObjectStoreTransport
            assert pre.object_store.fetch_timeout_s == 7.0 and (pre.sender is pre.object_store) == (transport != "gloo")
            assert set(rx) == names and rx["object_store"].fetch_timeout_s == 7.0
            assert pre.sender.serves_sends == (transport == "gloo") and not pre.sender.serves_stages
            if "gloo" in rx:
                assert type(rx["gloo"]) is ChannelReceiver
                assert rx["gloo"].call_sender == client.send_pages and not rx["gloo"].releases_after_receive
        finally:
            pre.sender.close()
            for r in rx.values():
                r.close()
    cfg = ServiceConfig.from_dict({"transfer": {"transport": "gloo"}, "prefill": {"tensor_parallel_size": 3}})
    with pytest.raises(ValueError, match="group"):
        make_prefill_transports(cfg, placement_of(cfg, "prefill", "cpu"), identity={}, host="h")
