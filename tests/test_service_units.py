"""Service pieces without a cluster: request validation, detokenization, the cost model, the
routers' ranking (fake replicas), the request state machine, the config."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from model_executor.tokenizer import ByteTokenizer  # noqa: E402
from router.config import ServiceConfig  # noqa: E402
from router.detokenize import TextStream  # noqa: E402
from router.protocol import RequestError, RequestParser, params_from_dict, params_to_dict  # noqa: E402
from router.scheduling import (  # noqa: E402
    DecodeRequestRouter,
    PrefillCostModel,
    PrefillRequestRouter,
    routing_hint,
)
from router.state import IllegalTransition, RequestLifecycle, RequestPhase  # noqa: E402


def parser(max_model_len=64) -> RequestParser:
    return RequestParser(ByteTokenizer(), model_id="m", max_model_len=max_model_len, default_max_tokens=16)


# ----------------------------------------------------------------------------- protocol
def test_parse_completion_defaults_and_fields():
    req = parser().parse({"model": "m", "prompt": "hi", "temperature": 0, "stop": "x", "seed": 5,
                          "top_k": -1, "n": 1, "user": "u", "presence_penalty": 0}, "completion")
    assert req.prompt_token_ids == (256, ord("h"), ord("i"))
    assert req.max_tokens == 16 and req.temperature == 0.0 and req.stop == ("x",) and req.seed == 5 and req.top_k == 0
    assert req.stop_token_ids == ByteTokenizer().stop_token_ids
    sp = req.sampling_params()
    assert params_from_dict(params_to_dict(sp)) == sp
    # batch of one, token ids, default max_tokens clipped to the room left
    req = parser(max_model_len=10).parse({"model": "m", "prompt": [[1, 2, 3]]}, "completion")
    assert req.prompt_token_ids == (1, 2, 3) and req.max_tokens == 7


def test_parse_chat():
    req = parser().parse({"model": "m", "messages": [{"role": "system", "content": "s"},
                                                     {"role": "user", "content": [{"type": "text", "text": "q"}]}],
                          "max_completion_tokens": 3}, "chat")
    assert req.kind == "chat" and req.max_tokens == 3 and req.prompt_token_ids[-1] == ByteTokenizer().special_id("<|assistant|>")


@pytest.mark.parametrize(
    "body,param,status",
    [
        ({"prompt": "x"}, "model", 400),
        ({"model": "other", "prompt": "x"}, "model", 404),
        ({"model": "m"}, "prompt", 400),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt", 400),
        ({"model": "m", "prompt": [True]}, "prompt", 400),
        ({"model": "m", "prompt": "x" * 80}, "prompt", 400),
        ({"model": "m", "prompt": "x", "max_tokens": 70}, "max_tokens", 400),
        ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens", 400),
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature", 400),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature", 400),
        ({"model": "m", "prompt": "x", "top_p": 1.1}, "top_p", 400),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop", 400),
        ({"model": "m", "prompt": "x", "stop": 3}, "stop", 400),
        ({"model": "m", "prompt": "x", "seed": True}, "seed", 400),
        ({"model": "m", "prompt": "x", "n": 3}, "n", 400),
        ({"model": "m", "prompt": "x", "echo": True}, "echo", 400),
        ({"model": "m", "prompt": "x", "logprobs": 5}, "logprobs", 400),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of", 400),
        ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", 400),
        ({"model": "m", "prompt": "x", "request_id": ""}, "request_id", 400),
        ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "stream_options", 400),
    ],
)
def test_parse_rejects(body, param, status):
    with pytest.raises(RequestError) as info:
        parser().parse(body, "completion")
    assert info.value.param == param and info.value.status == status
    err = info.value.to_dict()["error"]
    assert err["param"] == param and err["message"].startswith(param) or status == 404


def test_parse_rejects_chat_and_body():
    with pytest.raises(RequestError) as info:
        parser().parse([], "completion")
    assert info.value.status == 400
    with pytest.raises(RequestError) as info:
        parser().parse({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "chat")
    assert info.value.param == "messages[0].tool_calls"
    with pytest.raises(RequestError) as info:
        parser().parse({"model": "m", "messages": [{"role": "user", "content": 3}]}, "chat")
    assert info.value.param == "messages[0].content"
    with pytest.raises(RequestError):
        parser().parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                        "max_completion_tokens": 2}, "chat")
    with pytest.raises(ValueError, match="kind"):
        parser().parse({}, "embedding")


def test_request_error_pickles_for_ray():
    import pickle  # Ray ships exceptions between processes this way

    err = pickle.loads(pickle.dumps(RequestError("busy", status=429, code="overloaded", retry_after_s=2)))
    assert err.status == 429 and err.retry_after_s == 2 and err.to_dict()["error"]["type"] == "rate_limit_error"


# ----------------------------------------------------------------------------- detokenizer
def test_text_stream_holds_partial_utf8_and_stop_strings():
    tok = ByteTokenizer()
    ts = TextStream(tok)
    euro = list("€".encode())
    assert ts.push([ord("a")]) == "a"
    assert ts.push(euro[:1]) == "" and ts.push(euro[1:2]) == ""
    assert ts.push(euro[2:]) == "€"
    assert ts.push([tok.eos_token_id]) == "" and ts.finish() == ""

    ts = TextStream(tok, stop=["END"])
    out = "".join(ts.push([b]) for b in b"abcEN")
    assert out == "abc"  # "EN" may start "END": held back
    assert ts.push([ord("D")]) == "" and ts.stopped and ts.text == "abc"
    ts = TextStream(tok, stop=["END"])
    out = "".join(ts.push([b]) for b in b"abENx") + ts.finish()
    assert out == "abENx" and not ts.stopped


# ----------------------------------------------------------------------------- scheduling
def test_cost_model():
    m = PrefillCostModel(token_weight=0.0, dense_below=100, expected_density=0.5)
    assert m.cost(10) == 10 * 11 / 2  # dense: every causal pair
    assert m.cost(200) == pytest.approx(200 * 201 / 2 * 0.5)
    assert m.cost(10, cached_prefix=10) == 0 and m.cost(10, 4) == 6 * 15 / 2
    assert PrefillCostModel().cost(4000) > 100 * PrefillCostModel().cost(40)
    with pytest.raises(ValueError):
        m.cost(5, cached_prefix=6)
    with pytest.raises(ValueError):
        PrefillCostModel(expected_density=2.0)


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8

    @property
    def replica_id(self):
        return self.name


def pending(cost=0.0, pages=0, key="r"):
    return SimpleNamespace(args=[], kwargs={"routing": routing_hint(cost=cost, pages=pages)},
                           metadata=SimpleNamespace(internal_request_id=key))


def _router(cls):
    router = cls.__new__(cls)  # the ranking only needs the state initialize_state builds
    router.initialize_state()
    return router


def test_prefill_router_ranks_by_outstanding_causal_work():
    router = _router(PrefillRequestRouter)
    a = FakeReplica("a", {"outstanding_cost": 1e6, "free_pages": 100})
    b = FakeReplica("b", {"outstanding_cost": 10.0, "free_pages": 100})
    c = FakeReplica("c", {"outstanding_cost": 0.0, "free_pages": 1})  # no room for 5 pages
    ranked = asyncio.run(router.choose_replicas([a, b, c], pending(cost=100.0, pages=5)))
    assert [[r.name for r in tier] for tier in ranked] == [["b"], ["a"], ["c"]]
    # requests routed between two stats refreshes count too
    router.on_request_routed(pending(cost=5e6, key="big"), "b", None)
    ranked = asyncio.run(router.choose_replicas([a, b], pending(cost=100.0, pages=5)))
    assert ranked[0][0].name == "a"
    router.on_request_completed("b", "big")
    ranked = asyncio.run(router.choose_replicas([a, b], pending(cost=100.0, pages=5)))
    assert ranked[0][0].name == "b"
    # near-equal replicas share the first tier (Serve then picks by queue length)
    x, y = FakeReplica("x", {"outstanding_cost": 1000.0}), FakeReplica("y", {"outstanding_cost": 1050.0})
    ranked = asyncio.run(router.choose_replicas([x, y], pending(cost=10.0)))
    assert sorted(r.name for r in ranked[0]) == ["x", "y"]
    # no stats yet: everyone is a candidate
    assert len(asyncio.run(router.choose_replicas([FakeReplica("p"), FakeReplica("q")], None))[0]) == 2


def test_prefill_router_pins_calls_for_one_replica():
    import time

    router = _router(PrefillRequestRouter)
    a = FakeReplica("a", {"outstanding_cost": 0.0})
    b = FakeReplica("b", {"outstanding_cost": 1e9, "free_pages": 0})  # the worst choice, but it holds the pages

    def pinned(replica, age_s=0.0):
        return SimpleNamespace(args=[], kwargs={"routing": routing_hint(replica=replica)}, created_at=time.time() - age_s,
                               metadata=SimpleNamespace(internal_request_id="send"))

    assert routing_hint(replica="b") == {"cost": 0.0, "pages": 0, "replica": "b"}
    assert [[r.name for r in t] for t in asyncio.run(router.choose_replicas([a, b], pinned("b")))] == [["b"]]
    # Serve's real replica ids carry the id string in unique_id
    real = FakeReplica(SimpleNamespace(unique_id="abc123"))
    assert asyncio.run(router.choose_replicas([a, real], pinned("abc123"))) == [[real]]
    # not (yet) listed: wait a little for it, then let anyone answer (and refuse at once)
    assert asyncio.run(router.choose_replicas([a], pinned("gone"))) == []
    assert asyncio.run(router.choose_replicas([a], pinned("gone", age_s=10.0))) == [[a]]
    assert asyncio.run(router.choose_replicas([], pinned("gone", age_s=10.0))) == []


def test_decode_router_prefers_room_then_low_load():
    router = _router(DecodeRequestRouter)
    full = FakeReplica("full", {"free_pages": 2, "num_pages": 100, "running": 0, "max_running": 8})
    busy = FakeReplica("busy", {"free_pages": 80, "num_pages": 100, "running": 7, "max_running": 8})
    idle = FakeReplica("idle", {"free_pages": 60, "num_pages": 100, "running": 1, "max_running": 8})
    ranked = asyncio.run(router.choose_replicas([full, busy, idle], pending(pages=10)))
    assert [[r.name for r in t] for t in ranked] == [["idle"], ["busy"], ["full"]]
    for i in range(7):
        router.on_request_routed(pending(pages=8, key=f"k{i}"), "idle", None)
    ranked = asyncio.run(router.choose_replicas([busy, idle], pending(pages=10)))
    assert ranked[0][0].name == "busy"  # idle's free pages after what we routed: 100 - 56 = 44, load 7/8 ~ busy
    ranked = asyncio.run(router.choose_replicas([busy, idle], pending(pages=50)))
    assert ranked[0][0].name == "busy"  # only busy has 50 pages


# ----------------------------------------------------------------------------- state, config
def test_request_lifecycle():
    life = RequestLifecycle("r")
    for phase in (RequestPhase.PREFILLING, RequestPhase.TRANSFERRING, RequestPhase.PREFILLING,
                  RequestPhase.TRANSFERRING, RequestPhase.DECODING, RequestPhase.FINISHED):
        life.to(phase)
    assert life.prefill_attempts == 2 and life.done
    with pytest.raises(IllegalTransition):
        life.to(RequestPhase.FAILED)
    life = RequestLifecycle("s")
    with pytest.raises(IllegalTransition):
        life.to(RequestPhase.DECODING)
    life.to(RequestPhase.CANCELLED)
    assert life.done


def test_service_config():
    cfg = ServiceConfig.from_dict({"alpha": 0.0, "fault_injection": {"corrupt_transfers": 2}})
    assert cfg.sparse_config.alpha == 0.0 and cfg.fault_injection.corrupt_transfers == 2
    assert ServiceConfig.from_dict(cfg.to_dict()) == cfg and cfg.model_id == "builtin:tiny"
    for transport in ("auto", "object_store", "nccl", "gloo"):
        assert ServiceConfig.from_dict({"transport": transport}).transport == transport
    assert ServiceConfig.from_dict({"fault_injection": {"mode": "break"}}).fault_injection.mode == "break"
    for bad in ({"alpha": 2}, {"transport": "carrier-pigeon"}, {"page_size": 0}, {"bogus": 1},
                {"block_size": 100}, {"fault_injection": {"mode": "melt"}}, {"debug_routing": "yes"}):
        with pytest.raises((ValueError, TypeError)):
            ServiceConfig.from_dict(bad)
