"""Reliability and security of the service under load, faults and bad input.

The session's local Ray + Serve on 127.0.0.1 (tests/conftest.py; CPU, tiny model), four applications:
- ``main``: 1 prefill + 1 decode, dense; bad input, size limits, the 200-request load test;
- ``secure``: bearer-token auth, 4 KiB request limit, max_model_len 64; auth and fuzzing;
- ``overload``: tiny KV pools and prefill queue, first KV frame truncated; 429s, retries;
- ``faults``: 2 prefill + 2 decode, prefill held 1.2 s and decode steps slowed (fault hooks)
  so that replicas can be killed mid-prefill and mid-stream; disconnects.
After every scenario the pools of both sides must be back at their idle values.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import oracle_tokens, prompt_of, replica_actors  # noqa: E402

MODEL = "builtin:tiny"
TOKEN = "tok-REL-" + os.urandom(8).hex()  # must never show up in a log
MARKER = "QZXV-private-prompt-7781"  # a prompt text that must never show up in a log
COMMON = {"model": "builtin:tiny", "torch_threads": 1, "debug_routing": True, "batch_wait_ms": 1.0, "alpha": 0.0}
CONFIGS = {
    "main": ServiceConfig.from_dict({**COMMON, "prefill_kv_pages": 256, "decode_kv_pages": 512, "max_model_len": 2048}),
    "secure": ServiceConfig.from_dict({**COMMON, "prefill_kv_pages": 64, "decode_kv_pages": 64, "max_model_len": 64,
                                       "default_max_tokens": 4, "auth_token": TOKEN, "max_request_bytes": 4096}),
    "overload": ServiceConfig.from_dict({**COMMON, "page_size": 16, "prefill_kv_pages": 24, "decode_kv_pages": 16,
                                         "max_model_len": 1024, "max_queued_prefill_tokens": 300, "adopt_wait_s": 0.3,
                                         "transfer_retries": 1, "retry_after_s": 2,
                                         "fault_injection": {"corrupt_transfers": 1, "mode": "truncate",
                                                             "decode_step_delay_ms": 10}}),
    "faults": ServiceConfig.from_dict({**COMMON, "prefill_kv_pages": 128, "decode_kv_pages": 128, "max_model_len": 1024,
                                       "transfer_retries": 2, "decode_resumes": 2,
                                       "fault_injection": {"prefill_delay_ms": 1200, "decode_step_delay_ms": 40}}),
}
REPLICAS = {"main": (1, 1), "secure": (1, 1), "overload": (1, 1), "faults": (2, 2)}
SMALL = {"ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0}}
FIGURES: dict = {}  # what RELIABILITY.md reports; printed at the end of the module


SERVE_APPS = {name: {"config": CONFIGS[name], "prefill": {**SMALL, "num_replicas": p}, "decode": {**SMALL, "num_replicas": d},
                     "ingress": {"ray_actor_options": {"num_cpus": 0.1}}} for name, (p, d) in REPLICAS.items()}


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    print("\nRELIABILITY FIGURES", json.dumps(FIGURES, indent=1, default=str))


# ----------------------------------------------------------------------------- helpers
def stats(app: str, deployment: str) -> list[tuple[object, dict]]:
    out = []
    for actor in replica_actors(app, deployment):
        try:
            out.append((actor, ray.get(actor.record_routing_stats.remote(), timeout=10)))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
            pass  # a replica stopping or starting right now
    return out


def idle(app: str) -> tuple[bool, list, list]:
    pre = [s for _, s in stats(app, "PrefillServer")]
    dec = [s for _, s in stats(app, "DecodeServer")]
    want_p, want_d = REPLICAS[app]
    ok = len(pre) == want_p and len(dec) == want_d and all(
        s["free_pages"] == s["num_pages"] and s["pool_requests"] == 0 and s["leased"] == 0 and s["queued"] == 0
        and s["active"] == 0 for s in pre) and all(
        s["free_pages"] == s["num_pages"] and s["pool_requests"] == 0 and s["streams"] == 0 and s["running"] == 0
        and s["room_pages"] == s["num_pages"] for s in dec)
    return ok, pre, dec


def wait_idle(app: str, timeout_s: float = 60.0) -> None:
    """Both sides back at idle values: every page free, nothing leased, queued or running,
    and every replica of the deployment up (Serve replaced the killed ones)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok, pre, dec = idle(app)
        if ok:
            FIGURES.setdefault("idle_checks", 0)
            FIGURES["idle_checks"] += 1
            return
        if time.monotonic() > deadline:
            keys = ("free_pages", "num_pages", "pool_requests", "leased", "queued", "active", "streams", "running",
                    "room_pages", "replica_id")
            raise AssertionError(f"{app}: not idle: prefill {[{k: s.get(k) for k in keys} for s in pre]}, "
                                 f"decode {[{k: s.get(k) for k in keys} for s in dec]}")
        time.sleep(0.2)


def healthy(client: httpx.Client, app: str, slow_controller_s: float = 20.0) -> None:
    """``/health`` says ok. A Serve controller too slow to answer the probe (a loaded CI
    machine: router/health.py gives it 0.5 s once its last answer is stale) is asked again; any
    other "unavailable" (a role without a running replica) fails at once."""
    deadline = time.monotonic() + slow_controller_s
    while True:
        got = client.get(f"/{app}/health").json()
        if not str(got.get("reason", "")).startswith("Serve controller did not answer") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == {"status": "ok"}


def auth(headers: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {TOKEN}", **(headers or {})}


def post(client, app: str, body: dict, path: str = "/v1/completions", **kw):
    return client.post(f"/{app}{path}", json={"model": MODEL, **body}, **kw)


def stub(channel):
    from router.proto import flashprefill_pb2_grpc

    return flashprefill_pb2_grpc.FlashPrefillStub(channel)


def pb():
    from router.proto import flashprefill_pb2

    return flashprefill_pb2


def meta(app: str, token: str | None = None) -> tuple:
    return (("application", app),) + ((("authorization", f"Bearer {token}"),) if token else ())


def is_error_object(obj: dict) -> bool:
    err = obj.get("error")
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def count(name: str, n: int = 1) -> None:
    FIGURES[name] = FIGURES.get(name, 0) + n


# ----------------------------------------------------------------------------- security
def test_listens_on_loopback_only(service):
    from router.security import listening_addresses

    for name in ("http_port", "grpc_port"):
        addrs = listening_addresses(service[name])
        assert addrs and set(addrs) <= {"127.0.0.1", "::1"}, (name, addrs)
    FIGURES["listen"] = {n: listening_addresses(service[n]) for n in ("http_port", "grpc_port")}


def test_http_bearer_auth(service):
    client = service["http"]
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic x"}):
        r = post(client, "secure", body, headers=headers)
        assert r.status_code == 401 and is_error_object(r.json()), r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in r.text
    assert client.get("/secure/v1/models").status_code == 401
    assert client.get("/secure/v1/models", headers=auth()).json()["data"][0]["id"] == MODEL
    r = post(client, "secure", body, headers=auth())
    assert r.status_code == 200, r.text
    healthy(client, "secure")  # health stays open for load balancers
    count("auth_cases", 6)


def test_grpc_bearer_auth(service):
    s = stub(service["channel"])
    req = pb().GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, temperature=0.0)
    for token in (None, "wrong"):
        for call in (s.Generate, lambda r, **kw: list(s.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, metadata=meta("secure", token), timeout=60)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in (info.value.details() or "")
    assert list(s.Generate(req, metadata=meta("secure", TOKEN), timeout=60).token_ids)
    count("auth_cases", 5)


def test_request_size_limits(service):
    client = service["http"]
    big = {"prompt": "x" * 5000}
    r = post(client, "secure", big, headers=auth())  # 4 KiB limit, Content-Length known
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text

    def chunks():  # no Content-Length: the limit applies while reading
        yield b'{"model": "builtin:tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = client.post("/secure/v1/completions", content=chunks(), headers=auth({"content-type": "application/json"}))
    assert r.status_code == 413, r.text
    r = client.post("/main/v1/completions", content=b" " * (2 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and is_error_object(r.json())
    s = stub(service["channel"])
    with pytest.raises(grpc.RpcError) as info:  # over max_request_bytes (1 MiB), under the proxy's 4 MiB
        s.Generate(pb().GenerateRequest(model=MODEL, prompt="z" * (1536 << 10)), metadata=meta("main"), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("request:")
    with pytest.raises(grpc.RpcError) as info:  # over the proxy's limit: refused before any replica
        s.Generate(pb().GenerateRequest(model=MODEL, prompt="z" * (5 << 20)), metadata=meta("main"), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    healthy(client, "main")
    count("size_limit_cases", 5)


# ----------------------------------------------------------------------------- bad input
BAD_HTTP = [
    # (raw body or dict, status, param)
    (b"", 400, "body"), (b"{not json", 400, "body"), (b"\xff\xfe{}", 400, "body"), (b"[1, 2]", 400, None),
    (b'"prompt"', 400, None), (b"42", 400, None), (b"null", 400, None), (b"[" * 100000 + b"]" * 100000, 400, "body"),
    (b'{"model": "builtin:tiny", "prompt": "x", "max_tokens": NaN}', 400, "max_tokens"),
    (b'{"model": "builtin:tiny", "prompt": "x", "temperature": Infinity}', 400, "temperature"),
    (b'{"model": "builtin:tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "body"),
    ({"prompt": "x", "model": "nope"}, 404, "model"), ({"prompt": "x", "model": 7}, 400, "model"),
    ({"prompt": "x", "model": ""}, 400, "model"), ({"model": MODEL}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"), ({"prompt": []}, 400, "prompt"), ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [1.5]}, 400, "prompt"), ({"prompt": {"a": 1}}, 400, "prompt"), ({"prompt": [[1], []]}, 400, "prompt[1]"),
    ({"prompt": 12}, 400, "prompt"), ({"prompt": "x" * 3000}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2**63}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"), ({"prompt": "x", "temperature": 2.01}, 400, "temperature"),
    ({"prompt": "x", "temperature": [1]}, 400, "temperature"), ({"prompt": "x", "top_p": 0.0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.0001}, 400, "top_p"), ({"prompt": "x", "top_p": -1}, 400, "top_p"),
    ({"prompt": "x", "top_k": -3}, 400, "top_k"), ({"prompt": "x", "top_k": 10**9}, 400, "top_k"),
    ({"prompt": "x", "top_k": 2.5}, 400, "top_k"), ({"prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"prompt": "x", "stop": [1]}, 400, "stop"), ({"prompt": "x", "stop": "s" * 300}, 400, "stop"),
    ({"prompt": "x", "stream": 1}, 400, "stream"), ({"prompt": "x", "stream_options": []}, 400, "stream_options"),
    ({"prompt": "x", "request_id": "\n"}, 400, "request_id"), ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"), ({"prompt": "x", "messages": []}, 400, "messages"),
]


def test_bad_input_http_gets_named_4xx(service):
    client = service["http"]
    for body, status, param in BAD_HTTP:
        if isinstance(body, bytes):
            r = client.post("/main/v1/completions", content=body, headers={"content-type": "application/json"})
        else:
            r = client.post("/main/v1/completions", json={"model": MODEL, **body})
        assert r.status_code == status, (body if isinstance(body, dict) else body[:60], r.text)
        assert is_error_object(r.json()), r.text
        if param is not None:
            assert r.json()["error"]["param"] == param, (body if isinstance(body, dict) else body[:60], r.text)
    chat = [({"messages": "hi"}, "messages"), ({"messages": [{"role": "user"}]}, "messages[0].content"),
            ({"messages": [{"role": "god", "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": "x", "tool": 1}]}, "messages[0].tool"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
            ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2},
             "max_completion_tokens")]
    for body, param in chat:
        r = post(client, "main", body, path="/v1/chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # unknown paths and methods answer error objects too
    r = client.get("/main/v1/nothing")
    assert r.status_code == 404 and is_error_object(r.json())
    r = client.get("/main/v1/completions")
    assert r.status_code == 405 and is_error_object(r.json())
    # requests no replica could ever hold: 400, not 429
    r = post(client, "overload", {"prompt": prompt_of(400, seed=1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = post(client, "overload", {"prompt": prompt_of(100, seed=1), "max_tokens": 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    healthy(client, "main")
    count("bad_input_http_cases", len(BAD_HTTP) + len(chat) + 4)
    wait_idle("main")


def test_bad_input_grpc_gets_invalid_argument_naming_the_field(service):
    s = stub(service["channel"])
    G = pb().GenerateRequest
    cases = [
        (G(model=MODEL), "prompt"), (G(model=MODEL, prompt="x", prompt_token_ids=[1]), "prompt"),
        (G(model="", prompt="x"), "model"), (G(model=MODEL, prompt_token_ids=[-1]), "prompt_token_ids"),
        (G(model=MODEL, prompt_token_ids=[2**31 - 1]), "prompt_token_ids"), (G(model=MODEL, prompt="x" * 3000), "prompt"),
        (G(model=MODEL, prompt="x", max_tokens=0), "max_tokens"), (G(model=MODEL, prompt="x", max_tokens=2**32 - 1), "max_tokens"),
        (G(model=MODEL, prompt="x", temperature=-0.1), "temperature"), (G(model=MODEL, prompt="x", temperature=float("nan")), "temperature"),
        (G(model=MODEL, prompt="x", temperature=float("inf")), "temperature"), (G(model=MODEL, prompt="x", top_p=0.0), "top_p"),
        (G(model=MODEL, prompt="x", top_p=1.5), "top_p"), (G(model=MODEL, prompt="x", top_k=-7), "top_k"),
        (G(model=MODEL, prompt="x", seed=2**64 - 1), "seed"), (G(model=MODEL, prompt="x", stop=["a"] * 5), "stop"),
        (G(model=MODEL, prompt="x", stop=[""]), "stop"), (G(model=MODEL, request_id="\x00", prompt="x"), "request_id"),
    ]
    bad_role = G(model=MODEL)
    bad_role.messages.add(role="root", content="x")
    cases.append((bad_role, "messages[0].role"))
    for req, param in cases:
        for call in (s.Generate, lambda r, **kw: list(s.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, metadata=meta("main"), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, info.value.details())
            assert info.value.details().startswith(param.split("[")[0]), (param, info.value.details())
    with pytest.raises(grpc.RpcError) as info:
        s.Generate(G(model="gpt-9", prompt="x"), metadata=meta("main"), timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    healthy(service["http"], "main")
    count("bad_input_grpc_cases", 2 * len(cases) + 1)


def from_schema(schema: dict):
    """A Hypothesis strategy for the JSON-schema subset our OpenAPI description uses (object
    with properties/required/additionalProperties, anyOf, enum, typed scalars with bounds,
    arrays; a schema of none of these, any JSON value). Optional properties are present or absent
    at random."""
    if not {"anyOf", "enum", "type"} & set(schema):  # pydantic's Any: the ignored fields
        return st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=8))
    if "anyOf" in schema:
        return st.one_of(*[from_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        req = st.fixed_dictionaries({k: from_schema(props[k]) for k in props if k in required},
                                    optional={k: from_schema(props[k]) for k in props if k not in required})
        return req
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 8), 8))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(lo, schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    raise ValueError(f"schema: unsupported {schema}")


def _servable(body: dict, path: str) -> dict:
    body = {k: v for k, v in body.items() if k != "request_id"}
    body["model"] = MODEL
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(body["max_tokens"], 6)
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "fuzz"}]
    return body


def _http_fuzz_strategy(openapi: dict):
    paths = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=30),
                     st.lists(st.integers(-5, 300), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
    strategies = []
    for path in paths:
        schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        # what the schema cannot say: a message's fields depend on its role (tool_calls only on
        # assistant turns, content on user turns), and request_id must be printable; the mutated
        # and dropped cases below still send such bodies
        valid = from_schema(schema).map(lambda b, path=path: _servable(b, path))
        fields = sorted(schema["properties"]) + ["bogus"]
        mutated = st.tuples(from_schema(schema), st.sampled_from(fields), junk).map(lambda t: {**t[0], t[1]: t[2]})
        dropped = st.tuples(from_schema(schema), st.sampled_from(schema["required"])).map(
            lambda t: {k: v for k, v in t[0].items() if k != t[1]})
        strategies.append(st.tuples(st.just(path), st.one_of(valid, mutated, dropped)))
    return st.one_of(*strategies)


def test_fuzz_http_api_from_its_openapi_description(service):
    client = service["http"]
    openapi = client.get("/secure/openapi.json").json()
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(_http_fuzz_strategy(openapi))
    def fuzz(case):
        path, body = case
        if body.get("stream") is True:
            with client.stream("POST", f"/secure{path}", json=body, headers=auth()) as r:
                raw = r.read()
            status = r.status_code
            if status == 200:
                assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
                assert b'"error"' not in raw, raw[-300:]
        else:
            r = client.post(f"/secure{path}", json=body, headers=auth())
            status = r.status_code
            obj = r.json()
            if status == 200:
                assert obj["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
            else:
                assert is_error_object(obj), obj
        assert status in (200, 400, 404, 413, 429), (status, body)
        seen[status] = seen.get(status, 0) + 1

    fuzz()
    healthy(client, "secure")
    wait_idle("secure")
    FIGURES["fuzz_http"] = {"examples": sum(seen.values()), "by_status": seen}
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 10, seen


def _proto_requests():
    G = pb().GenerateRequest
    u32, i32, u64 = st.integers(0, 2**32 - 1), st.integers(-2**31, 2**31 - 1), st.integers(0, 2**64 - 1)
    small_tokens = st.one_of(st.integers(1, 8), u32)
    f32 = st.one_of(st.floats(width=32), st.floats(0, 2, width=32))
    msgs = st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "x", ""]), st.text(max_size=20)), max_size=3)

    @st.composite
    def valid(draw):  # inside every bound: must succeed
        req = G(model=MODEL, prompt=draw(st.text(min_size=1, max_size=30)), max_tokens=draw(st.integers(1, 6)))
        for name, strat in (("temperature", st.floats(0, 2, width=32)), ("top_p", st.floats(0.5, 1, width=32)),
                            ("top_k", st.integers(-1, 50)), ("seed", st.integers(0, 2**63 - 1))):
            if draw(st.booleans()):
                setattr(req, name, draw(strat))
        req.stop.extend(draw(st.lists(st.text(min_size=1, max_size=4), max_size=4)))
        return req

    @st.composite
    def build(draw):
        req = G(model=draw(st.sampled_from([MODEL, MODEL, "", "other"])), request_id=draw(st.sampled_from(["", "r-1", "\x07"])))
        which = draw(st.sampled_from(["prompt", "ids", "messages", "none", "both", "prompts"]))
        if which in ("prompt", "both"):
            req.prompt = draw(st.text(max_size=40))
        if which in ("ids", "both"):
            req.prompt_token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 258), i32), max_size=20)))
        if which == "messages":
            for role, content in draw(msgs):
                req.messages.add(role=role, content=content)
        for name, strat in (("max_tokens", small_tokens), ("temperature", f32), ("top_p", f32), ("top_k", i32),
                            ("seed", u64)):
            if draw(st.booleans()):
                setattr(req, name, draw(strat))
        req.stop.extend(draw(st.lists(st.text(max_size=6), max_size=5)))
        if which == "prompts":  # each Prompt: text, token ids, both or neither
            for text, ids in draw(st.lists(st.tuples(st.text(max_size=8), st.lists(st.one_of(st.integers(0, 258), i32),
                                                                                  max_size=4)), min_size=1, max_size=3)):
                req.prompts.add(text=text, token_ids=ids)
        for name in ("n", "best_of"):
            if draw(st.booleans()):
                setattr(req, name, draw(st.sampled_from([0, 1, 2, 3, 17, 2**32 - 1])))
        if draw(st.booleans()):
            rf = req.response_format
            rf.type = draw(st.sampled_from(["text", "json_object", "json_schema", "regex", "choice", "", "yaml"]))
            if draw(st.booleans()):
                rf.pattern = draw(st.sampled_from(["[ab]{1,3}", "(", "", "\\d+"]))
            rf.choices.extend(draw(st.lists(st.text(max_size=4), max_size=3)))
            if draw(st.booleans()):
                rf.json_schema.name = draw(st.sampled_from(["s", "", "bad name"]))
                rf.json_schema.schema_json = draw(st.sampled_from(["{}", "{", '{"type": "integer"}', "[]", '{"type": 7}']))
        return req

    return st.one_of(valid(), build())


def test_fuzz_grpc_api_with_generated_messages_and_random_bytes(service):
    s = stub(service["channel"])
    seen: dict[str, int] = {}
    allowed = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"}

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(_proto_requests(), st.booleans())
    def fuzz_messages(req, streaming):
        try:
            if streaming:
                msgs = list(s.GenerateStream(req, metadata=meta("secure", TOKEN), timeout=60))
                assert msgs and msgs[-1].finish_reason in ("stop", "length")
            else:
                assert s.Generate(req, metadata=meta("secure", TOKEN), timeout=60).finish_reason in ("stop", "length")
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            assert exc.details(), code
        assert code in allowed, (code, req)
        seen[code] = seen.get(code, 0) + 1

    fuzz_messages()
    raw_unary = service["channel"].unary_unary("/flashprefill.v1.FlashPrefill/Generate",
                                               request_serializer=None, response_deserializer=None)
    raw_seen: dict[str, int] = {}

    @settings(max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.binary(max_size=200))
    def fuzz_bytes(raw):
        try:
            raw_unary(raw, metadata=meta("secure", TOKEN), timeout=60)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        assert code in allowed, (code, raw)
        raw_seen[code] = raw_seen.get(code, 0) + 1

    fuzz_bytes()
    with pytest.raises(grpc.RpcError) as info:  # a length prefix running past the end
        raw_unary(b"\x12\xff\xff\xff\x0f", metadata=meta("secure", TOKEN), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("request:")
    healthy(service["http"], "secure")
    wait_idle("secure")
    FIGURES["fuzz_grpc"] = {"messages": seen, "random_bytes": raw_seen}
    assert seen.get("OK", 0) >= 5 and seen.get("INVALID_ARGUMENT", 0) >= 10, seen


# ----------------------------------------------------------------------------- overload
def test_truncated_kv_frame_is_retried(service):
    """The overload app's prefill replica truncates its first frame: re-prefilled, same answer."""
    ids = prompt_of(40, seed=11)
    r = post(service["http"], "overload", {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(CONFIGS["overload"], ids, 5)
    assert r.json()["timing"]["prefill_attempts"] == 2
    assert sum(s["transfer_failures"] for _, s in stats("overload", "DecodeServer")) == 1
    wait_idle("overload")
    count("faults_injected")


def test_kv_exhaustion_and_full_queue_give_429_with_retry_hint(service):
    """Decode pool for 2 requests, prefill pool for 6 prompts, queue for 5: a burst of 14 gets
    answers (200 equal to the oracle) or 429s with Retry-After; nothing else, nothing leaked."""
    client, s = service["http"], stub(service["channel"])
    rss_before = {st_["replica_id"]: st_["rss_bytes"] for d in ("PrefillServer", "DecodeServer")
                  for _, st_ in stats("overload", d)}
    ids = [prompt_of(60, seed=20 + i) for i in range(14)]
    want = {i: oracle_tokens(CONFIGS["overload"], ids[i], 60) for i in range(14)}
    results: dict[int, tuple] = {}

    def http(i):
        r = post(client, "overload", {"prompt": ids[i], "max_tokens": 60, "temperature": 0, "return_token_ids": True})
        results[i] = ("http", r.status_code, r.json(), r.headers.get("retry-after"))

    def rpc(i):
        req = pb().GenerateRequest(model=MODEL, prompt_token_ids=ids[i], max_tokens=60, temperature=0.0)
        try:
            resp, call = s.Generate.with_call(req, metadata=meta("overload"), timeout=60)
            results[i] = ("grpc", 200, list(resp.token_ids), None)
        except grpc.RpcError as exc:
            hint = dict(exc.trailing_metadata() or ()).get("retry-after")
            results[i] = ("grpc", exc.code().name, exc.details(), hint)

    threads = [threading.Thread(target=http if i % 2 == 0 else rpc, args=(i,)) for i in range(14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 14
    codes = {}
    for i, (kind, status, payload, hint) in results.items():
        codes[status] = codes.get(status, 0) + 1
        if status == 200:
            got = payload["choices"][0]["token_ids"] if kind == "http" else payload
            assert got == want[i], (i, kind)
        elif status in (429, "RESOURCE_EXHAUSTED"):
            assert hint == "2", (i, kind, payload)
            if kind == "http":
                assert payload["error"]["type"] == "rate_limit_error"
                assert payload["error"]["code"] in ("overloaded", "kv_capacity_exhausted")
        else:
            raise AssertionError((i, kind, status, payload))
    assert codes.get(200, 0) >= 2 and (codes.get(429, 0) + codes.get("RESOURCE_EXHAUSTED", 0)) >= 1, codes
    healthy(client, "overload")
    wait_idle("overload")
    rss_after = {st_["replica_id"]: st_["rss_bytes"] for d in ("PrefillServer", "DecodeServer")
                 for _, st_ in stats("overload", d)}
    growth = max(rss_after[k] - rss_before.get(k, rss_after[k]) for k in rss_after)
    assert growth < 256 << 20, growth
    dec = [st_ for _, st_ in stats("overload", "DecodeServer")]
    FIGURES["overload"] = {"burst": 14, "outcomes": {str(k): v for k, v in codes.items()},
                           "decode_refused_full": sum(d["refused_full"] for d in dec),
                           "max_rss_growth_mb": round(growth / 2**20, 1)}
    count("requests_sent", 14)


# ----------------------------------------------------------------------------- disconnects
def test_client_disconnects_cancel_and_free_pages(service):
    client, s = service["http"], stub(service["channel"])
    body = {"model": MODEL, "prompt": prompt_of(50, seed=3), "max_tokens": 300, "temperature": 0}
    # HTTP stream, mid-decode
    with client.stream("POST", "/faults/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    wait_idle("faults")
    # HTTP, no stream, client gives up during the (held) prefill and during decode
    for timeout in (0.5, 3.0):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{service['base']}/faults/v1/completions", json=body, timeout=timeout)
        wait_idle("faults")
    # gRPC stream, cancelled mid-decode
    call = s.GenerateStream(pb().GenerateRequest(model=MODEL, prompt_token_ids=body["prompt"], max_tokens=300,
                                                 temperature=0.0), metadata=meta("faults"), timeout=60)
    for i, _ in enumerate(call):
        if i >= 2:
            call.cancel()
            break
    wait_idle("faults")
    # gRPC unary past its deadline (greedy, like the HTTP requests above: an unset temperature
    # samples at 1.0 and may stop early on a stop token, finishing inside the deadline)
    with pytest.raises(grpc.RpcError) as info:
        s.Generate(pb().GenerateRequest(model=MODEL, prompt_token_ids=body["prompt"], max_tokens=300,
                                        temperature=0.0),
                   metadata=meta("faults"), timeout=2.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle("faults")
    FIGURES["disconnects"] = 5
    count("requests_sent", 5)


# ----------------------------------------------------------------------------- replica faults
def _kill_when(app: str, deployment: str, busy_key: str, timeout_s: float = 20.0) -> str:
    """Kill the replica of ``deployment`` whose stats show ``busy_key`` > 0; its replica id."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for actor, st_ in stats(app, deployment):
            if st_[busy_key] > 0:
                ray.kill(actor, no_restart=True)  # Serve's controller must replace it
                count("faults_injected")
                return st_["replica_id"]
        time.sleep(0.05)
    raise AssertionError(f"no busy {deployment} replica in {app}")


def _replaced(app: str, deployment: str, killed: str, timeout_s: float = 90.0) -> None:
    want = REPLICAS[app][0 if deployment == "PrefillServer" else 1]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = [st_["replica_id"] for _, st_ in stats(app, deployment)]
        if len(ids) == want and killed not in ids:
            return
        time.sleep(0.5)
    raise AssertionError(f"{app}/{deployment}: replica {killed} not replaced")


def test_prefill_replica_killed_mid_prefill_is_reprefilled(service):
    ids = prompt_of(70, seed=31)
    result = {}

    def send():
        result["r"] = post(service["http"], "faults", {"prompt": ids, "max_tokens": 6, "temperature": 0,
                                                       "return_token_ids": True})

    t = threading.Thread(target=send)
    t.start()
    killed = _kill_when("faults", "PrefillServer", "active")
    t.join(timeout=120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(CONFIGS["faults"], ids, 6)
    assert r.json()["timing"]["prefill_attempts"] >= 2 and r.json()["routing"]["prefill_replica"] != killed
    _replaced("faults", "PrefillServer", killed)
    wait_idle("faults")
    count("requests_sent")


def _stream_tokens_killing_decode(service, ids: list[int], max_tokens: int, kill_after: int, use_grpc: bool):
    tokens, text, finals, errors = [], "", [], []
    killed = None
    if use_grpc:
        call = stub(service["channel"]).GenerateStream(
            pb().GenerateRequest(model=MODEL, prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0),
            metadata=meta("faults"), timeout=120)
        for msg in call:
            tokens.extend(msg.token_ids)
            text += msg.text
            if msg.finish_reason:
                finals.append(msg.finish_reason)
            if killed is None and len(tokens) >= kill_after:
                killed = _kill_when("faults", "DecodeServer", "streams")
        return tokens, text, finals, errors, killed, None
    timing = None
    with service["http"].stream("POST", "/faults/v1/completions",
                                json={"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                      "stream": True, "return_token_ids": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk)
                continue
            tokens.extend(chunk["choices"][0]["token_ids"])
            text += chunk["choices"][0]["text"]
            if chunk["choices"][0]["finish_reason"]:
                finals.append(chunk["choices"][0]["finish_reason"])
                timing = chunk["timing"]
            if killed is None and len(tokens) >= kill_after:
                killed = _kill_when("faults", "DecodeServer", "streams")
    return tokens, text, finals, errors, killed, timing


@pytest.mark.parametrize("use_grpc", [False, True], ids=["http_sse", "grpc_stream"])
def test_decode_replica_killed_mid_stream_resumes_without_gap_or_repeat(service, use_grpc):
    from benchmarks.load_test import detokenize
    from model_executor.tokenizer import ByteTokenizer

    ids = prompt_of(45, seed=41 + use_grpc)
    want = oracle_tokens(CONFIGS["faults"], ids, 40)
    tokens, text, finals, errors, killed, timing = _stream_tokens_killing_decode(service, ids, 40, 6, use_grpc)
    assert killed is not None and not errors, errors
    assert tokens == want, (tokens, want)  # no gap, no duplicate, same continuation
    assert text == detokenize(ByteTokenizer(), want)
    assert finals == ["length"] or finals == ["stop"]
    if timing is not None:
        assert timing["decode_resumes"] == 1, timing
    _replaced("faults", "DecodeServer", killed)
    wait_idle("faults")
    count("requests_sent")
    count("decode_resumes_ok")


def test_services_recovered_after_faults(service):
    """After every kill: all replicas back, a fresh request on each app succeeds, pools idle."""
    client = service["http"]
    for app in ("faults", "main", "overload"):
        ids = prompt_of(20, seed=99)
        r = post(client, app, {"prompt": ids, "max_tokens": 3, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == oracle_tokens(CONFIGS[app], ids, 3)
        wait_idle(app)
    count("requests_sent", 3)


# ----------------------------------------------------------------------------- load
def test_load_200_requests_32_concurrent_nothing_lost(service, tmp_path):
    from benchmarks.load_test import LoadSpec, Oracle, format_report, run_load

    spec = LoadSpec(requests=200, concurrency=32, app="main", wall_limit_s=240.0)
    rep = run_load(spec, service["base"], service["target"], Oracle(CONFIGS["main"]))
    print("\n" + format_report(rep))
    assert rep.sent == 200 and rep.lost == 0 and rep.duplicated == 0 and rep.garbled == 0, rep.problems
    assert rep.ok == 200
    wait_idle("main")
    FIGURES["load"] = {k: getattr(rep, k) for k in ("sent", "ok", "lost", "duplicated", "garbled", "wall_s",
                                                    "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s",
                                                    "throughput_rps")}
    count("requests_sent", 200)


# ----------------------------------------------------------------------------- logs (last)
def test_no_prompts_tokens_or_secrets_in_logs(service):
    """By default nothing a client sends reaches a log: not the prompt text, not its token ids,
    not the bearer token, on success or on failure paths (bad input, retries, kills above)."""
    client = service["http"]
    ids = prompt_of(33, seed=4242)
    r = post(client, "secure", {"prompt": MARKER, "max_tokens": 3}, headers=auth())
    assert r.status_code == 200
    post(client, "secure", {"prompt": MARKER, "stop": [MARKER + "!" * 300]}, headers=auth())  # 400 quoting it
    post(client, "secure", {"prompt": MARKER}, headers={"Authorization": f"Bearer {TOKEN}x"})  # 401
    post(client, "main", {"prompt": ids, "max_tokens": 3})
    post(client, "main", {"prompt": ids, "max_tokens": "x"})
    time.sleep(2.0)  # log handlers flush
    session = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    needles = {"prompt": MARKER.encode(), "token": TOKEN.encode(), "token_ids": ", ".join(map(str, ids[1:9])).encode()}
    scanned = 0
    for path in session.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        scanned += 1
        for what, needle in needles.items():
            assert needle not in data, f"{what} found in {path}"
    assert scanned > 5
    FIGURES["log_files_scanned"] = scanned
