"""The transport registry (kv_transfer.registry): transports by name, what selection reads from
their declared capabilities, and a test-only transport (tests/toy_transport.py) added with one
registry line, picked by name and round-tripping pages through the same interfaces as the
built-in ones."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kv_transfer.choice import Placement, choose_transports, group_transport, select_transport
from kv_transfer.factory import build_receivers, build_retry_sender, build_sender
from kv_transfer.interfaces import KVReceiver, KVSender
from kv_transfer.object_store.transport import ObjectStoreTransport
from kv_transfer.registry import get_transport, register_transport, transport_names, unregister_transport
from kv_transfer.spec import BuildContext, TransportSpec
from tests.test_kv_transfer import fill, make_pool, tokens_of

BUILTIN = ("object_store", "nccl", "cuda_ipc", "gloo", "local")


@pytest.fixture
def toy():
    register_transport("toy", "tests.toy_transport:TOY")  # the one registry line
    import tests.toy_transport as module

    module.WIRE.clear()
    try:
        yield module
    finally:
        unregister_transport("toy")
        module.WIRE.clear()


def test_the_built_in_transports_by_name():
    assert transport_names() == BUILTIN
    assert transport_names(options_only=True) == BUILTIN[:-1]  # "local": tests and tools only
    # hand-written from docs/ARCHITECTURE.md: which devices, and which run between TP groups
    want = {"object_store": ((), True), "nccl": (("cuda",), True), "gloo": (("cpu",), True),
            "cuda_ipc": (("cuda",), False), "local": ((), False)}
    for name, (devices, in_groups) in want.items():
        spec = get_transport(name)
        assert isinstance(spec, TransportSpec) and spec.name == name
        assert (spec.devices, spec.in_groups) == (devices, in_groups), name
    assert get_transport("nccl").family == get_transport("gloo").family == "channel"


def test_an_unknown_transport_names_the_option_and_the_registered_ones():
    for bad in ("rdma", "auto", "", None, 3):
        with pytest.raises(ValueError, match=r"^transfer\.transport: expected one of \('object_store', 'nccl', "
                                             r"'cuda_ipc', 'gloo', 'local'\) \(or 'auto'\), got"):
            get_transport(bad)
    with pytest.raises(ValueError, match="^transfer.transport: expected one of .*'rdma'"):
        choose_transports("rdma", Placement("decode", "cpu"))


@pytest.mark.parametrize("name, spec, match", [
    ("Toy", "tests.toy_transport:TOY", "^name"),
    ("auto", "tests.toy_transport:TOY", "^name"),
    ("a+b", "tests.toy_transport:TOY", "^name"),
    ("x" * 33, "tests.toy_transport:TOY", "^name"),
    ("gloo", "tests.toy_transport:TOY", "^name: a transport 'gloo' is already registered"),
    ("toy", "tests.toy_transport.TOY", "^spec"),
    ("toy", 42, "^spec"),
    ("other", TransportSpec(name="toy", family="toy"), "^spec: its name is 'toy', registered as 'other'"),
])
def test_register_errors(name, spec, match):
    with pytest.raises(ValueError, match=match):
        register_transport(name, spec)
    assert transport_names() == BUILTIN


def test_unregister_only_what_was_registered_and_a_wrong_target_is_found_at_first_use():
    for name in ("gloo", "toy"):
        with pytest.raises(ValueError, match="^name"):
            unregister_transport(name)
    register_transport("wrong", "tests.toy_transport:ToyConfig")
    try:
        with pytest.raises(TypeError, match="TransportSpec of 'wrong'"):
            get_transport("wrong")
    finally:
        unregister_transport("wrong")


def test_selection_picks_the_toy_by_name_from_what_it_declares(toy):
    assert "toy" in transport_names(options_only=True)
    assert get_transport("toy") is toy.TOY
    assert select_transport("toy", device="cpu") == "toy"
    with pytest.raises(ValueError, match=r"^transfer\.transport: 'toy' moves CPU KV pools, this one is on cuda"):
        select_transport("toy", device="cuda")
    pre = choose_transports("toy", Placement("prefill", "cpu"))
    assert (pre.sender, pre.kind, pre.warning) == ("toy", "toy", None)
    dec = choose_transports("toy", Placement("decode", "cpu"))
    assert (dec.receivers, dec.kind) == (("object_store", "toy"), "toy")
    # it does not declare in_groups: TP groups on either side ship over the object store
    assert group_transport("toy", 2, 1) == group_transport("toy", 1, 2) == "object_store"
    tp = choose_transports("toy", Placement("prefill", "cpu", decode_tp=2))
    assert tp.sender == "object_store" and "'toy'" in tp.warning and "'gloo'" in tp.warning
    # ... and no TP group end is built for it
    with pytest.raises(ValueError, match="^transfer.transport: 'toy' has no TP group sender"):
        toy.TOY.build_sender(BuildContext("cpu", group=object()))


@pytest.mark.parametrize("num_tokens", [1, 13])
def test_a_transfer_round_trips_through_the_toy(toy, num_tokens):
    src, dst = make_pool(), make_pool()
    dst.reserve("other", 9)  # the receiver's page ids differ from the sender's
    fill(src, "r", num_tokens, seed=num_tokens)
    context = BuildContext("cpu", options={"toy": {"capacity": 1}, "object_store": {"fetch_timeout_s": 3.0}})
    pre, dec = choose_transports("toy", Placement("prefill", "cpu")), choose_transports("toy", Placement("decode", "cpu"))
    retry = build_retry_sender(pre, context)
    sender = build_sender(pre, context, retry=retry)
    receivers = build_receivers(dec, context)
    assert type(retry) is ObjectStoreTransport and retry.fetch_timeout_s == 3.0
    assert type(sender) is toy.ToySender and sender.config == toy.ToyConfig(capacity=1)  # its own section
    assert set(receivers) == {"object_store", "toy"} and type(receivers["toy"]) is toy.ToyReceiver
    assert isinstance(sender, KVSender) and isinstance(receivers["toy"], KVReceiver)

    ticket = sender.export(src, "r")
    assert (ticket.transport, ticket.num_tokens, ticket.num_pages) == ("toy", num_tokens, src.pages_for(num_tokens))
    fill(src, "q", 3)
    with pytest.raises(Exception, match="the toy wire is full"):  # capacity 1: the option reached it
        sender.export(src, "q")
    pages = asyncio.run(receivers[ticket.transport].receive(ticket, dst))
    assert pages == dst.pages("r") and dst.seq_len("r") == num_tokens
    for a, b in zip(tokens_of(src, "r"), tokens_of(dst, "r")):
        assert torch.equal(a, b)
    assert toy.WIRE == {}
    # received once: a second receive finds nothing and leaves nothing allocated
    dst.release("r")
    with pytest.raises(Exception, match="not on the toy wire") as info:
        asyncio.run(receivers["toy"].receive(ticket, dst))
    assert info.value.retryable and not dst.has("r")
