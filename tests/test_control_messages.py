"""The typed side-call messages (serving/messages.py, kv_transfer/wire.py): each field's check
names the field, a message survives pickling (Ray's hop) and is checked again after it, and
``checked`` refuses what is not the message."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest

from kv_transfer.transfer import MAX_REQUEST_ID_LEN
from kv_transfer.wire import MAX_PULLS, SendPages, StagePages, send_pulls
from serving.messages import CancelChoice, ReleasePages, checked


def _send(rng: random.Random) -> SendPages:
    return SendPages(request_id=f"req-{rng.randrange(10**6)}", sender_id="P", receiver_id="D", host="10.0.0.2",
                     port=rng.randrange(1, 65536), prefix=f"fpkv/P/D/{rng.randrange(1, 99)}/",
                     generation=rng.randrange(1, 1 << 20), backend=rng.choice(["gloo", "nccl"]),
                     timeout_s=rng.uniform(0.1, 60.0), layers_per_chunk=rng.randrange(1, 64))


def test_well_formed_messages_pass_their_checks_after_pickling():
    rng = random.Random(0)
    for _ in range(20):
        send = _send(rng)
        tp = replace(send, rank=rng.randrange(4), heads=tuple(rng.sample(range(16), rng.randrange(1, 8))),
                     pulls=rng.randrange(1, 9))
        stage = StagePages(request_id=send.request_id, sender_id="P", transport=send.backend)
        release, cancel = ReleasePages(send.request_id), CancelChoice(send.request_id, rng.randrange(8))
        for msg in (send, tp, stage, release, cancel):
            back = pickle.loads(pickle.dumps(msg))
            assert back == msg and back.check() is back and checked(back, type(msg)) is None
        assert send_pulls(tp) == tp.pulls and send_pulls(send) == 1


@pytest.mark.parametrize("change,field", [
    ({"request_id": ""}, "request_id"),
    ({"request_id": 7}, "request_id"),
    ({"sender_id": "x" * 1025}, "sender_id"),
    ({"receiver_id": None}, "receiver_id"),
    ({"host": ""}, "host"),
    ({"backend": b"gloo"}, "backend"),
    ({"prefix": "elsewhere/"}, "prefix"),
    ({"prefix": "fpkv/no-slash"}, "prefix"),
    ({"port": 0}, "port"),
    ({"port": 65536}, "port"),
    ({"port": True}, "port"),
    ({"generation": 0}, "generation"),
    ({"generation": 1.0}, "generation"),
    ({"layers_per_chunk": 0}, "layers_per_chunk"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": 86401}, "timeout_s"),
    ({"timeout_s": False}, "timeout_s"),
    ({"rank": 0}, "rank, heads"),
    ({"heads": (0,)}, "rank, heads"),
    ({"pulls": 2}, "pulls"),
    ({"rank": -1, "heads": (0,)}, "rank"),
    ({"rank": 1 << 16, "heads": (0,)}, "rank"),
    ({"rank": 0, "heads": ()}, "heads"),
    ({"rank": 0, "heads": [0]}, "heads"),
    ({"rank": 0, "heads": (1, 1)}, "heads"),
    ({"rank": 0, "heads": (True,)}, "heads"),
    ({"rank": 0, "heads": (1 << 12,)}, "heads"),
    ({"rank": 0, "heads": (0,), "pulls": 0}, "pulls"),
    ({"rank": 0, "heads": (0,), "pulls": MAX_PULLS + 1}, "pulls"),
])
def test_send_pages_check_names_the_field(change, field):
    bad = replace(_send(random.Random(1)), **change)
    with pytest.raises(ValueError, match=field):
        bad.check()
    with pytest.raises(ValueError, match=field):
        SendPages.parse(pickle.loads(pickle.dumps(bad)))  # the check is not skipped by the hop


@pytest.mark.parametrize("change,field", [
    ({"request_id": ""}, "request_id"),
    ({"sender_id": 3}, "sender_id"),
    ({"transport": "x" * (MAX_REQUEST_ID_LEN + 1)}, "transport"),
])
def test_stage_pages_check_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        replace(StagePages("r", "P", "gloo"), **change).check()


@pytest.mark.parametrize("msg,field", [
    (ReleasePages(""), "request_id"),
    (ReleasePages(None), "request_id"),
    (ReleasePages("r" * (MAX_REQUEST_ID_LEN + 1)), "request_id"),
    (CancelChoice(5, 0), "request_id"),
    (CancelChoice("g", -1), "choice"),
    (CancelChoice("g", True), "choice"),
    (CancelChoice("g", 1.0), "choice"),
])
def test_release_and_cancel_checks_name_the_field(msg, field):
    with pytest.raises(ValueError, match=field):
        msg.check()
    assert field in checked(msg, type(msg))


def test_only_the_message_type_itself_is_accepted():
    send = _send(random.Random(2))
    for kind, good in ((SendPages, send), (StagePages, StagePages("r", "P", "gloo")), (ReleasePages, ReleasePages("r")),
                       (CancelChoice, CancelChoice("g", 0))):
        as_dict = {f: getattr(good, f) for f in good.__dataclass_fields__}
        assert checked(as_dict, kind) == f"request: expected a {kind.__name__}, got dict"
        assert checked(None, kind).startswith("request: expected")
    for kind in (SendPages, StagePages):
        with pytest.raises(ValueError, match="request"):
            kind.parse({"request_id": "r"})
    assert send_pulls({"pulls": 3}) == 1 and send_pulls(replace(send, pulls="x")) == 1
