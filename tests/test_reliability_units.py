"""Reliability and security pieces without a cluster: bearer auth, the frame parser and the
request parser under fuzzed input, the gRPC tolerant deserializer, no pickle/eval on the
request and transfer paths, the config's secret handling, the resume state machine."""

from __future__ import annotations

import ast
import dataclasses
import hmac
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from serving.messages import Adopted, ChoiceCancelled, Prefilled, Tokens, TransferFailed

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kv_cache import KVPool, KVPoolConfig  # noqa: E402
from kv_transfer.transfer import (  # noqa: E402
    KVFrameHeader,
    TransferError,
    adopt_frame,
    corrupt_frame,
    pack_pages,
    read_frame,
)
from model_executor.tokenizer import ByteTokenizer  # noqa: E402
from serving.config import ServiceConfig  # noqa: E402
from serving.errors import PrefillOutOfMemory  # noqa: E402
from serving.errors import RequestError  # noqa: E402
from router.parsing import RequestParser  # noqa: E402
from router.security import BearerAuth, _decode_proc_addr  # noqa: E402
from router.state import RequestLifecycle, RequestPhase  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- auth
def test_bearer_auth_checks_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    auth = BearerAuth("s3cret-token")
    assert auth.enabled
    assert auth.check("Bearer s3cret-token") and auth.check("bearer s3cret-token") and auth.check(b"Bearer s3cret-token")
    for bad in (None, "", "Bearer", "Bearer s3cret-toke", "Bearer s3cret-token2", "Basic s3cret-token",
                "s3cret-token", b"\xff\xfe", "Bearer s3cret-tok\u00e9n"):
        assert not auth.check(bad), bad
    assert len(calls) >= 10  # every check, right or wrong, goes through compare_digest
    assert "s3cret" not in repr(auth)


def test_bearer_auth_off_and_from_env(monkeypatch):
    assert BearerAuth(None).check(None) and not BearerAuth(None).enabled
    monkeypatch.setenv("MY_TOKEN_VAR", "from-env")
    auth = BearerAuth.from_config(ServiceConfig.from_dict({"auth_token_env": "MY_TOKEN_VAR"}))
    assert auth.check("Bearer from-env") and not auth.check("Bearer other")
    monkeypatch.delenv("MY_TOKEN_VAR")
    assert not BearerAuth.from_config(ServiceConfig.from_dict({"auth_token_env": "MY_TOKEN_VAR"})).enabled
    # the config value wins over the environment
    monkeypatch.setenv("FLASHPREFILL_API_TOKEN", "env-token")
    assert BearerAuth.from_config(ServiceConfig.from_dict({"auth_token": "cfg"})).check("Bearer cfg")
    with pytest.raises(ValueError, match="auth_token"):
        BearerAuth("   ")


def test_config_hides_the_token_and_keeps_it_from_workers():
    cfg = ServiceConfig.from_dict({"ingress": {"auth_token": "hunter2-secret"}})
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    assert cfg.worker_dict()["ingress"]["auth_token"] is None and cfg.to_dict()["ingress"]["auth_token"] == "hunter2-secret"
    assert ServiceConfig.from_dict(cfg.worker_dict()).ingress.auth_token is None
    for bad in ("", "  "):
        with pytest.raises(ValueError) as info:
            ServiceConfig.from_dict({"auth_token": bad})
        assert str(info.value).startswith("ingress.auth_token: expected a non-empty string")
    with pytest.raises(ValueError) as info:  # a wrong type: the value is not shown either
        ServiceConfig.from_dict({"ingress": {"auth_token": 12345678}})
    assert "ingress.auth_token" in str(info.value) and "12345678" not in str(info.value)
    with pytest.raises(ValueError) as info:  # nor when it conflicts with the flat name
        ServiceConfig.from_dict({"auth_token": "hunter2-a", "ingress": {"auth_token": "hunter2-b"}})
    assert "ingress.auth_token: given twice" in str(info.value) and "hunter2" not in str(info.value)
    for path, value in (("ingress.max_request_bytes", 10), ("ingress.decode_resumes", -1), ("decode.adopt_wait_s", -1.0),
                        ("fault_injection.prefill_delay_ms", -1.0), ("fault_injection.prefill_out_of_memory_tokens", -1)):
        with pytest.raises(ValueError, match=rf"^{path}: Input should be greater than or equal to"):
            ServiceConfig.from_dict({path: value})


def test_proc_net_address_decoding():
    assert _decode_proc_addr("0100007F", v6=False) == "127.0.0.1"
    assert _decode_proc_addr("00000000", v6=False) == "0.0.0.0"
    assert _decode_proc_addr("0000000000000000FFFF00000100007F", v6=True) == "127.0.0.1"
    assert _decode_proc_addr("00000000000000000000000000000000", v6=True) == "::"


# ----------------------------------------------------------------------------- frames
def _pool(num_pages=8, page_size=4) -> KVPool:
    return KVPool(KVPoolConfig(num_layers=2, num_kv_heads=2, head_dim=4, page_size=page_size,
                               dtype=torch.float32, num_pages=num_pages))


def _frame(tokens=6) -> np.ndarray:
    src = _pool()
    src.reserve("r", tokens)
    src.set_seq_len("r", tokens)
    src.k.normal_()
    src.v.normal_()
    return pack_pages(src, "r")


GOOD_FRAME = _frame()


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_never_get_past_the_frame_checks(raw):
    pool = _pool()
    with pytest.raises(TransferError):
        adopt_frame(pool, np.frombuffer(raw, dtype=np.uint8) if raw else np.zeros(0, np.uint8), request_id="r")
    assert pool.free_pages == pool.num_pages and pool.stats()["requests"] == 0


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(GOOD_FRAME) - 1), st.integers(1, 255)), min_size=1, max_size=4),
       st.integers(0, 16))
def test_mutated_frames_are_refused_or_exact(flips, cut):
    """Any flipped byte or cut tail is caught (header checks, length, CRC-32); nothing leaks."""
    bad = GOOD_FRAME.copy()
    for pos, mask in flips:
        bad[pos] ^= mask
    if cut:
        bad = bad[:-cut]
    pool = _pool()
    try:
        adopt_frame(pool, bad, request_id="r")
    except TransferError:
        assert pool.free_pages == pool.num_pages
        return
    # the only way through is a frame whose bytes all check out again (e.g. a flip inside
    # the header's padding-free msgpack that keeps it valid is impossible; CRC covers payload)
    header, _ = read_frame(bad)
    assert header.request_id == "r"


@FUZZ
@given(st.one_of(st.binary(max_size=200),
                 st.dictionaries(st.text(max_size=12), st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=8), st.none(),
                                                                  st.floats(), st.binary(max_size=8)), max_size=14)))
def test_header_decoder_only_raises_transfer_errors(obj):
    import msgpack

    raw = obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(TransferError):
        KVFrameHeader.decode(raw)


def test_header_decoder_refuses_ext_types_and_oversized_fields():
    import msgpack

    good = msgpack.unpackb(KVFrameHeader("r", 4, 1, 4, 2, 2, 4, "float32", 256, 0).encode(), raw=False)
    for patch in ({"request_id": msgpack.ExtType(1, b"x")}, {"request_id": "x" * 5000},
                  {"crc32": b"\0" * 64}, {"k_scale": [0.0] * 5000}, {"extra": 1}):
        with pytest.raises(TransferError, match="malformed"):
            KVFrameHeader.decode(msgpack.packb({**good, **patch}, use_bin_type=True))
    for mode in ("flip", "truncate"):
        with pytest.raises(TransferError) as info:
            read_frame(corrupt_frame(GOOD_FRAME, mode))
        assert info.value.retryable


def test_no_pickle_or_eval_on_request_and_transfer_paths():
    """Nothing a client or a peer sends is unpickled or evaluated: the modules on those paths
    import no pickle/marshal/dill and call no eval/exec; msgpack is only read with limits."""
    cli = {"__main__.py", "client.py", "launcher.py"}  # command-line tools, not request paths
    # every transport's folder (kv_transfer/registry.py), the frame codec and the wire messages
    files = [*sorted(p for p in (ROOT / "router").glob("*.py") if p.name not in cli),
             *sorted((ROOT / "kv_transfer").rglob("*.py")),
             ROOT / "prefill_worker" / "deployment.py", ROOT / "decode_worker" / "deployment.py"]
    assert ROOT / "kv_transfer" / "channel" / "recv.py" in files and ROOT / "kv_transfer" / "frame.py" in files
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not {"pickle", "cPickle", "marshal", "dill", "cloudpickle", "shelve"} & set(names), path
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "compile", "__import__"), (path, node.lineno)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "unpackb":
                kws = {k.arg for k in node.keywords}
                assert {"max_str_len", "max_bin_len", "max_array_len", "max_map_len", "ext_hook"} <= kws, path


# ----------------------------------------------------------------------------- request parser
PARSER = RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=4)
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                      st.text(max_size=20))
JSON = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "request_id", "user", "logprobs", "echo", "bogus",
          "best_of", "top_logprobs", "logit_bias", "presence_penalty", "min_tokens", "stop_token_ids", "ignore_eos"]


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8), st.sampled_from(["completion", "chat"]),
       st.booleans())
def test_parser_answers_every_body_with_a_request_or_a_named_4xx(body, kind, fix_model):
    if fix_model:
        body = {**body, "model": "m"}
    try:
        req = PARSER.parse(body, kind)
    except RequestError as err:
        assert err.status in (400, 404) and err.message and len(err.message) <= 512
        assert err.param is None or isinstance(err.param, str)
        json.dumps(err.to_dict())
        return
    longest = max(len(p) for p in req.batch or (req.prompt_token_ids,))  # each prompt runs alone
    assert 1 <= req.max_tokens and longest + req.max_tokens <= 64 and req.prompt_len >= 1
    assert 0 <= req.temperature <= 2 and 0 < req.top_p <= 1 and math.isfinite(req.temperature)


@FUZZ
@given(st.binary(max_size=300))
def test_grpc_deserializer_never_raises(raw):
    from router.grpc_service import MalformedMessage, parse_generate_request
    from router.proto import flashprefill_pb2 as pb

    msg = parse_generate_request(raw)
    assert isinstance(msg, (pb.GenerateRequest, MalformedMessage))


def test_grpc_deserializer_flags_garbage():
    from router.grpc_service import MalformedMessage, parse_generate_request

    bad = parse_generate_request(b"\x0a\xff\xff\xff\xff\x0f")  # a length running past the end
    assert isinstance(bad, MalformedMessage) and bad.size == 6
    assert struct  # keep the import used when the test above is trimmed


# ----------------------------------------------------------------------------- state machine
def test_lifecycle_allows_resume_after_decoding():
    life = RequestLifecycle("r")
    for phase in (RequestPhase.PREFILLING, RequestPhase.TRANSFERRING, RequestPhase.DECODING,
                  RequestPhase.PREFILLING, RequestPhase.TRANSFERRING, RequestPhase.DECODING, RequestPhase.FINISHED):
        life.to(phase)
    assert life.prefill_attempts == 2 and life.done


# ----------------------------------------------------------------------------- pipeline faults
class _Stream:
    """A handle stream: events, then optionally an exception (a replica dying)."""

    def __init__(self, events, exc=None):
        self._events, self._exc, self.cancelled = list(events), exc, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._events:
            return self._events.pop(0)
        if self._exc is not None:
            raise self._exc
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True

    def __await__(self):  # a unary call (prefill): its one event, or the exception
        return self.__anext__().__await__()


class _Method:
    def __init__(self, fn):
        self.fn, self.calls, self.streams = fn, [], []

    def remote(self, payload, routing=None):
        self.calls.append(payload)
        stream = self.fn(payload, len(self.calls))
        self.streams.append(stream)
        return stream


class _Handle:
    def __init__(self, **methods):
        for name, fn in methods.items():
            setattr(self, name, _Method(fn))

    def options(self, **_):
        return self


def _nxt(seq):
    return 65 + (seq[-1] * 7 + len(seq)) % 26  # letters: a deterministic "model"


def _reference(prompt, max_tokens):
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(_nxt(seq))
    return seq[len(prompt):]


def _prefill(payload, n, die=lambda n: False):
    from ray.exceptions import ActorDiedError

    if die(n):
        return _Stream([], ActorDiedError())
    ctx = list(payload.prompt_token_ids)
    return _Stream([Prefilled(request_id=payload.request_id, first_token=_nxt(ctx), kv_len=len(ctx), cached_tokens=0,
                              ticket=ctx, replica_id=f"p{n}", queue_s=0.0, prefill_s=0.0, export_s=0.0)])


def _decode(payload, n, die_after=None, full=False):
    from ray.exceptions import ActorDiedError

    if full:
        return _Stream([TransferFailed(reason="pool_exhausted", retryable=True, message="full", replica_id=f"d{n}")])
    seq = list(payload.ticket) + [payload.first_token]
    events = [Adopted(replica_id=f"d{n}", transfer_s=0.0, num_pages=1)]
    for _ in range(payload.params.max_new_tokens - 1 - len(payload.history)):  # the history counts as output
        seq.append(_nxt(seq))
        events.append(Tokens(tokens=(seq[-1],), finished=False))
    events[-1] = Tokens(tokens=events[-1].tokens, finished=True, finish_reason="length")
    if die_after is not None and die_after(n) is not None:
        return _Stream(events[: 1 + die_after(n)], ActorDiedError())
    return _Stream(events)


def _run(pipeline, req):
    import asyncio

    out, error = [], None

    async def go():
        nonlocal error
        try:
            async for d in pipeline.stream(req):
                out.append(d)
        except RequestError as err:
            error = err

    asyncio.run(go())
    return out, error


def _pipeline(prefill, decode, metrics=None, **config):
    from router.pipeline import DisaggregatedPipeline

    cfg = ServiceConfig.from_dict({"transfer_retries": 2, "decode_resumes": 2, **config})
    released = []
    pipe = DisaggregatedPipeline(_Handle(prefill=prefill), _Handle(generate=decode), cfg, ByteTokenizer(),
                                 metrics=metrics, release_lease=released.append)
    pipe.released = released  # the leases the ingress ended (attempts it abandoned before decode took them)
    return pipe


REQ = PARSER.parse({"model": "m", "prompt": [256, 72, 105], "max_tokens": 12, "temperature": 0}, "completion")


def test_decode_death_mid_stream_resumes_without_gap_or_repeat():
    pipe = _pipeline(_prefill, lambda p, n: _decode(p, n, die_after=lambda n: 4 if n == 1 else None))
    out, error = _run(pipe, REQ)
    assert error is None
    tokens = [t for d in out for t in d.token_ids]
    assert tokens == _reference(REQ.prompt_token_ids, 12)
    assert "".join(d.text for d in out) == bytes(tokens).decode()
    assert out[-1].finish_reason == "length" and out[-1].timing["decode_resumes"] == 1
    prefills, decodes = pipe.driver.prefill.prefill.calls, pipe.driver.decode.generate.calls
    sent = tokens[:5]  # first token + 4 decoded before the death
    assert list(prefills[1].prompt_token_ids) == list(REQ.prompt_token_ids) + sent[:-1]
    # the resumed decode continues the whole output: the tokens before its first are its history
    assert decodes[1].first_token == sent[-1] and decodes[1].history == tuple(sent[:-1])
    assert decodes[1].params.max_new_tokens == 12 and decodes[0].history == ()
    # both decode replicas took their tickets: the ingress ends no lease (the decode side does)
    assert len(prefills) == 2 and pipe.released == []


def _preempting(after, when=lambda n: True):
    """A decode replica that preempts the request (kv_exhausted) after ``after`` tokens on the
    calls ``when`` names, and decodes it to the end otherwise."""
    def decode(payload, n):
        stream = _decode(payload, n)
        if not when(n):
            return stream
        events = stream._events[: 1 + after]
        last = events[-1]
        events[-1] = Tokens(tokens=last.tokens, finished=True, finish_reason="kv_exhausted")
        return _Stream(events)
    return decode


def test_a_preempted_request_is_recomputed_without_gap_or_repeat():
    """The decode pool ran out of pages (decode_worker/scheduler.py preempts the newest
    sequence): the ingress recomputes it as a resume (prefill of prompt + output, decode on)
    instead of ending it with "abort"."""
    pipe = _pipeline(_prefill, _preempting(3, when=lambda n: n == 1))
    out, error = _run(pipe, REQ)
    assert error is None
    tokens = [t for d in out for t in d.token_ids]
    assert tokens == _reference(REQ.prompt_token_ids, 12)
    assert out[-1].finish_reason == "length" and out[-1].timing["decode_resumes"] == 1
    sent = tokens[:4]  # first token + the 3 decoded before the preemption
    prefills, decodes = pipe.driver.prefill.prefill.calls, pipe.driver.decode.generate.calls
    assert list(prefills[1].prompt_token_ids) == list(REQ.prompt_token_ids) + sent[:-1]
    assert decodes[1].first_token == sent[-1] and decodes[1].history == tuple(sent[:-1])


def test_preempted_every_time_ends_as_abort_after_decode_resumes():
    pipe = _pipeline(_prefill, _preempting(2))
    out, error = _run(pipe, REQ)
    assert error is None and out[-1].finish_reason == "abort"
    tokens = [t for d in out for t in d.token_ids]
    assert tokens == _reference(REQ.prompt_token_ids, 12)[: len(tokens)] and len(tokens) == 1 + 2 * 3
    assert len(pipe.driver.decode.generate.calls) == 3  # first try + decode_resumes (2)


def test_decode_dying_every_time_ends_with_a_clean_error_after_the_tokens_sent():
    pipe = _pipeline(_prefill, lambda p, n: _decode(p, n, die_after=lambda n: 2))
    out, error = _run(pipe, REQ)
    assert error is not None and error.status == 502 and error.code == "decode_failed"
    tokens = [t for d in out for t in d.token_ids]
    assert tokens == _reference(REQ.prompt_token_ids, 12)[: len(tokens)] and len(tokens) == 1 + 3 * 2
    assert len(pipe.driver.decode.generate.calls) == 3  # first try + decode_resumes
    assert all(s.cancelled for s in pipe.driver.decode.generate.streams[:-1]) and pipe.released == []


def test_replica_failures_before_adoption_are_retried_then_503():
    pipe = _pipeline(lambda p, n: _prefill(p, n, die=lambda n: n == 1),
                     lambda p, n: _decode(p, n, die_after=lambda n: 0 if n == 1 else None))
    out, error = _run(pipe, REQ)
    assert error is None and [t for d in out for t in d.token_ids] == _reference(REQ.prompt_token_ids, 12)
    assert out[-1].timing["prefill_attempts"] == 3  # prefill died, then decode died before adopting
    assert pipe.released == []  # the decode replica that died had taken (adopted) the pages

    def decode_dead_first(payload, n):
        from ray.exceptions import ActorDiedError

        return _Stream([], ActorDiedError()) if n == 1 else _decode(payload, n)

    pipe = _pipeline(_prefill, decode_dead_first)
    out, error = _run(pipe, REQ)
    assert error is None and [t for d in out for t in d.token_ids] == _reference(REQ.prompt_token_ids, 12)
    # the decode replica died before answering for the ticket: the ingress ends that lease
    assert [lease.request_id for lease in pipe.released] == [pipe.driver.prefill.prefill.calls[0].request_id]
    pipe = _pipeline(lambda p, n: _prefill(p, n, die=lambda n: True), _decode)
    out, error = _run(pipe, REQ)
    assert out == [] and error.status == 503 and error.code == "prefill_unavailable" and error.retry_after_s == 1


def test_failed_channel_transfer_is_retried_over_the_object_store():
    def decode(payload, n):
        if n == 1:  # the first attempt's channel broke
            return _Stream([TransferFailed(reason="lost", retryable=True, message="channel down", replica_id="d1",
                                           transport="nccl", fallback="object_store")])
        return _decode(payload, n)

    pipe = _pipeline(_prefill, decode)
    out, error = _run(pipe, REQ)
    assert error is None and [t for d in out for t in d.token_ids] == _reference(REQ.prompt_token_ids, 12)
    prefills = pipe.driver.prefill.prefill.calls
    assert prefills[0].transport is None and prefills[1].transport == "object_store"
    assert out[-1].timing["prefill_attempts"] == 2
    # a full decode pool is no reason to leave the channel: no fallback asked
    pipe = _pipeline(_prefill, lambda p, n: _decode(p, n, full=n == 1))
    out, error = _run(pipe, REQ)
    assert error is None and all(c.transport is None for c in pipe.driver.prefill.prefill.calls)


def test_decode_pool_full_everywhere_is_429_with_retry_hint():
    pipe = _pipeline(_prefill, lambda p, n: _decode(p, n, full=True), retry_after_s=3)
    out, error = _run(pipe, REQ)
    assert error.status == 429 and error.code == "kv_capacity_exhausted" and error.retry_after_s == 3
    assert len(pipe.driver.prefill.prefill.calls) == 3 and pipe.released == []  # the decode replicas release them


def test_an_attempt_abandoned_between_prefill_and_decode_releases_its_lease():
    """The client leaves after the first token, before any decode replica took the ticket: the
    ingress ends that lease itself; a prefill that shipped no ticket (max_tokens 1) has none."""
    import asyncio

    pipe = _pipeline(_prefill, _decode)

    async def first_then_leave():
        stream = pipe.stream(REQ)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(first_then_leave())
    assert [lease.request_id for lease in pipe.released] == [pipe.driver.prefill.prefill.calls[0].request_id]
    assert pipe.driver.decode.generate.calls == []

    def no_ticket(payload, n):
        stream = _prefill(payload, n)
        stream._events[0] = dataclasses.replace(stream._events[0], ticket=None)
        return stream

    one = PARSER.parse({"model": "m", "prompt": [256, 72], "max_tokens": 1, "temperature": 0}, "completion")
    pipe = _pipeline(no_ticket, _decode)
    out, error = _run(pipe, one)
    assert error is None and out[-1].finish_reason == "length" and pipe.released == []


def test_timing_breakdown_comes_from_where_each_step_runs():
    """queue/prefill/export from the prefill replica's ``Prefilled``, transfer from ``Adopted``,
    the first decode step from the first ``Tokens``; a decode that reports no first step gives None."""
    from dataclasses import replace

    def prefill(payload, n):
        stream = _prefill(payload, n)
        stream._events[0] = replace(stream._events[0], queue_s=0.25, prefill_s=0.5, export_s=0.125)
        return stream

    def decode(payload, n):
        stream = _decode(payload, n)
        stream._events[0] = replace(stream._events[0], transfer_s=0.0625)
        stream._events[1] = replace(stream._events[1], first_step_s=0.03125)
        return stream

    out, error = _run(_pipeline(prefill, decode), REQ)
    assert error is None
    t = out[-1].timing
    assert (t["queue_s"], t["prefill_s"], t["export_s"], t["transfer_s"], t["first_decode_s"]) == \
        (0.25, 0.5, 0.125, 0.0625, 0.03125)
    assert t["total_s"] >= t["ttft_s"] >= 0 and t["prefill_attempts"] == 1
    out, error = _run(_pipeline(_prefill, _decode), REQ)
    assert error is None and out[-1].timing["export_s"] == 0.0 and out[-1].timing["first_decode_s"] is None


def test_pipeline_records_each_request_once_with_its_outcome():
    from serving.metrics import Metrics
    from tests.helpers import FakeMetricsBackend

    backend = FakeMetricsBackend()
    metrics = Metrics(backend)
    # one resumed after a decode death, one whose prefill keeps dying (503), one cut by the client
    out, error = _run(_pipeline(_prefill, lambda p, n: _decode(p, n, die_after=lambda n: 4 if n == 1 else None),
                                metrics=metrics), REQ)
    assert error is None
    out, error = _run(_pipeline(lambda p, n: _prefill(p, n, die=lambda n: True), _decode, metrics=metrics), REQ)
    assert error.status == 503

    async def first_then_leave():
        stream = _pipeline(_prefill, _decode, metrics=metrics).stream(REQ)
        await stream.__anext__()
        await stream.aclose()

    import asyncio

    asyncio.run(first_then_leave())
    assert [c[2]["finish_reason"] for c in backend.calls("requests_total")] == ["length", "failed", "cancelled"]
    # prompt tokens of the two requests that were prefilled; 12 + 1 tokens sent
    assert backend.calls("prompt_tokens_total") == [("inc", 3, None), ("inc", 3, None)]
    assert backend.calls("generation_tokens_total") == [("inc", 12, None), ("inc", 1, None)]
    assert len(backend.calls("time_to_first_token_seconds")) == 2  # the failed one had no first token
    assert len(backend.calls("time_per_output_token_seconds")) == 1  # needs two tokens
    assert len(backend.calls("e2e_request_latency_seconds")) == 3
    assert all(c[1] >= 0 for c in backend.calls("e2e_request_latency_seconds"))
    retries = backend.calls("request_retries_total")
    assert ("inc", 1, {"kind": "resume"}) in retries  # the decode death
    assert ("inc", 2, {"kind": "prefill"}) in retries  # the prefill tried three times



def test_the_ingress_counts_cancellations_after_the_prefill_by_stage():
    """Before the first token the prefill replica counts a cancellation (above); after it the
    ingress does: while the pages are on their way (the lease is released), and mid-decode."""
    import asyncio

    from serving.metrics import Metrics
    from tests.helpers import FakeMetricsBackend

    backend = FakeMetricsBackend()
    metrics = Metrics(backend)

    async def leave_after(deltas):
        pipe = _pipeline(_prefill, _decode, metrics=metrics)
        stream = pipe.stream(REQ)
        for _ in range(deltas):
            await stream.__anext__()
        await stream.aclose()
        return pipe

    pipe = asyncio.run(leave_after(1))  # the first token out, the lease not yet taken by a decode replica
    assert len(pipe.released) == 1
    asyncio.run(leave_after(4))  # three tokens decoded
    assert backend.calls("requests_cancelled_total") == [("inc", 1.0, {"stage": "transferring"}),
                                         ("inc", 1.0, {"stage": "decoding"})]
    assert [c[2]["finish_reason"] for c in backend.calls("requests_total")] == ["cancelled", "cancelled"]


# ----------------------------------------------------------------------------- n choices as one group
def _group_prefill(payload, n):
    ctx = list(payload.prompt_token_ids)
    k = len(payload.choices) or 1
    firsts = tuple(65 + (_nxt(ctx) - 65 + j) % 26 for j in range(k))  # choice j: its own first token
    return _Stream([Prefilled(request_id=payload.request_id, first_token=firsts[0], kv_len=len(ctx), cached_tokens=0,
                              ticket=ctx, replica_id=f"p{n}", queue_s=0.0, prefill_s=0.0, export_s=0.0,
                              first_tokens=firsts if payload.choices else ())])


def _group_decode(payload, n, die_after=None, full_first=False):
    """A group's decode stream: per step one Tokens event per choice (``choice`` = its place in
    ``payload.choices``); ``die_after`` steps, then the replica dies."""
    from ray.exceptions import ActorDiedError

    if full_first and n == 1:
        return _Stream([TransferFailed(reason="pool_exhausted", retryable=True, message="full", replica_id="d1")])
    if not payload.choices:
        return _decode(payload, n)
    seqs = [list(payload.ticket) + [tok] for tok, _ in payload.choices]
    events = [Adopted(replica_id=f"d{n}", transfer_s=0.0, num_pages=1)]
    steps = payload.choices[0][1].max_new_tokens - 1
    for step in range(steps):
        if die_after is not None and step == die_after:
            return _Stream(events, ActorDiedError())
        for j, seq in enumerate(seqs):
            seq.append(_nxt(seq))
            last = step == steps - 1
            events.append(Tokens(tokens=(seq[-1],), finished=last, finish_reason="length" if last else None, choice=j))
    return _Stream(events)


def _group_reference(prompt, first, max_tokens):
    seq = list(prompt) + [first]
    while len(seq) < len(prompt) + max_tokens:
        seq.append(_nxt(seq))
    return seq[len(prompt):]


def _run_choices(pipeline, req):
    import asyncio

    out, error = {}, None

    async def go():
        nonlocal error
        try:
            async for k, d in pipeline.stream_choices(req):
                out.setdefault(k, []).append(d)
        except RequestError as err:
            error = err

    asyncio.run(go())
    return out, error


NREQ = PARSER.parse({"model": "m", "prompt": [256, 72, 105], "max_tokens": 9, "temperature": 0, "n": 3, "seed": 7},
                    "completion")


def _cancel_handle(pipe):
    cancels = []

    class _Cancels:
        def remote(self, request, routing=None):
            cancels.append((request, routing))

            async def answer():
                return ChoiceCancelled(True)
            return answer()

    pipe.driver.decode_calls.cancel_choice = _Cancels()
    return cancels


def test_a_group_is_one_prefill_one_decode_call_and_each_choice_its_own_stream():
    pipe = _pipeline(_group_prefill, _group_decode)
    out, error = _run_choices(pipe, NREQ)
    assert error is None and sorted(out) == [0, 1, 2]
    prefills, decodes = pipe.driver.prefill.prefill.calls, pipe.driver.decode.generate.calls
    assert len(prefills) == 1 and len(decodes) == 1 and len(prefills[0].choices) == 3
    firsts = [65 + (_nxt(list(NREQ.prompt_token_ids)) - 65 + j) % 26 for j in range(3)]
    assert [tok for tok, _ in decodes[0].choices] == firsts
    for k in range(3):
        tokens = [t for d in out[k] for t in d.token_ids]
        assert tokens == _group_reference(NREQ.prompt_token_ids, firsts[k], 9)
        assert out[k][0].first and out[k][-1].finish_reason == "length"
        assert [d.finish_reason is not None for d in out[k]].count(True) == 1
    # choice k's sampling params are its own: seeds seed, seed + 1, ... (choice 0 is the n=1 answer)
    assert [p.seed for p in prefills[0].choices] == [7, 8, 9] and prefills[0].params.seed == 7


def test_group_decode_death_resumes_every_choice_on_its_own():
    pipe = _pipeline(_group_prefill, lambda p, n: _group_decode(p, n, die_after=3 if n == 1 else None))
    out, error = _run_choices(pipe, NREQ)
    assert error is None
    firsts = [tok for tok, _ in pipe.driver.decode.generate.calls[0].choices]
    for k in range(3):
        assert [t for d in out[k] for t in d.token_ids] == _group_reference(NREQ.prompt_token_ids, firsts[k], 9)
        assert out[k][-1].finish_reason == "length" and out[k][-1].timing["decode_resumes"] == 1
    prefills, decodes = pipe.driver.prefill.prefill.calls, pipe.driver.decode.generate.calls
    assert len(prefills) == 4 and all(not p.choices for p in prefills[1:])  # the group, then one per choice
    sent = {tuple(p.prompt_token_ids[3:]) for p in prefills[1:]}  # each choice's first + 3 decoded, less the last
    assert sent == {tuple(_group_reference(NREQ.prompt_token_ids, f, 4)[:-1]) for f in firsts}
    # each resumed choice carries the tokens it had before its first as history
    assert all(not d.choices and d.params.max_new_tokens == 9 and len(d.history) == 3 for d in decodes[1:])
    assert {tuple(d.history) for d in decodes[1:]} == {tuple(_group_reference(NREQ.prompt_token_ids, f, 4)[:-1])
                                                      for f in firsts}


def test_group_transfer_retry_keeps_the_first_tokens_sent():
    pipe = _pipeline(_group_prefill, lambda p, n: _group_decode(p, n, full_first=True))
    out, error = _run_choices(pipe, NREQ)
    assert error is None
    prefills, decodes = pipe.driver.prefill.prefill.calls, pipe.driver.decode.generate.calls
    assert len(prefills) == 2 and len(prefills[0].choices) == 3 and prefills[1].choices == ()
    assert decodes[1].choices == decodes[0].choices  # the first tokens the client already has
    assert all(len([t for d in out[k] for t in d.token_ids]) == 9 for k in range(3))


def test_a_stop_string_in_one_choice_cancels_it_alone_on_its_decode_replica():
    firsts = [65 + (_nxt([256, 72, 105]) - 65 + j) % 26 for j in range(3)]
    texts = ["".join(map(chr, _group_reference([256, 72, 105], f, 9))) for f in firsts]
    stop = texts[1][2:4]
    req = PARSER.parse({"model": "m", "prompt": [256, 72, 105], "max_tokens": 9, "temperature": 0, "n": 3,
                        "stop": [stop]}, "completion")
    pipe = _pipeline(_group_prefill, _group_decode)
    cancels = _cancel_handle(pipe)
    out, error = _run_choices(pipe, req)
    assert error is None
    for k in range(3):
        text = "".join(d.text for d in out[k])
        cut = texts[k].find(stop)
        assert (text, out[k][-1].finish_reason) == ((texts[k][:cut], "stop") if cut >= 0 else (texts[k], "length"))
    stopped_early = [k for k in range(3) if 0 <= texts[k].find(stop) < len(texts[k]) - len(stop)]
    assert 1 in stopped_early
    rid = pipe.driver.decode.generate.calls[0].request_id
    assert sorted(c[0].choice for c in cancels) == stopped_early
    assert all(c[0].request_id == rid and c[1]["replica"] == "d1" for c in cancels)


def test_a_group_records_each_choice_and_its_prompt_once():
    import asyncio

    from serving.metrics import Metrics
    from tests.helpers import FakeMetricsBackend

    backend = FakeMetricsBackend()
    pipe = _pipeline(_group_prefill, _group_decode, metrics=Metrics(backend))
    out, error = _run_choices(pipe, NREQ)
    assert error is None
    assert [c[2]["finish_reason"] for c in backend.calls("requests_total")] == ["length"] * 3
    assert backend.calls("prompt_tokens_total") == [("inc", 3, None)]  # once per prompt, as OpenAI's usage
    assert backend.calls("generation_tokens_total") == [("inc", 9, None)] * 3

    backend = FakeMetricsBackend()
    pipe = _pipeline(_group_prefill, _group_decode, metrics=Metrics(backend))

    async def first_then_leave():
        stream = pipe.stream_choices(NREQ)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(first_then_leave())
    assert [c[2]["finish_reason"] for c in backend.calls("requests_total")] == ["cancelled"] * 3
    # gone after the first tokens, before a decode replica took the ticket: the ingress ends the one lease
    assert pipe.driver.decode.generate.calls == [] and len(pipe.released) == 1


def test_a_single_choice_is_a_group_of_one_under_its_own_request_id():
    """stream_choices takes a single-choice request as it is: one driver, the worker calls
    named after the request (not a choice's ``-0`` id) and without a choices tuple."""
    pipe = _pipeline(_prefill, _decode)
    out, error = _run_choices(pipe, REQ)
    assert error is None and sorted(out) == [0]
    assert [t for d in out[0] for t in d.token_ids] == _reference(REQ.prompt_token_ids, 12)
    prefill, decode = pipe.driver.prefill.prefill.calls[0], pipe.driver.decode.generate.calls[0]
    assert prefill.request_id.startswith(REQ.request_id + ":") and prefill.choices == () and decode.choices == ()


@pytest.mark.parametrize("req", [REQ, NREQ], ids=["single", "group"])
def test_closing_a_stream_ends_its_driver_at_once(req):
    """The lease of an attempt the client left is released when the stream is closed, not
    when the event loop later finalizes the inner generators."""
    import asyncio

    pipe = _pipeline(_group_prefill, _group_decode)

    async def first_then_leave():
        stream = pipe.stream_choices(req)
        await stream.__anext__()
        await stream.aclose()
        return list(pipe.released)  # before asyncio.run finalizes anything left open

    released = asyncio.run(first_then_leave())
    assert [lease.request_id for lease in released] == [pipe.driver.prefill.prefill.calls[0].request_id]


# ----------------------------------------------------------------------------- out of memory
def _ray_wrapped(cause):
    """``cause`` as a Ray handle call raises it: a RayTaskError that is also an instance of it."""
    from ray.exceptions import RayTaskError

    return RayTaskError("PrefillServer.prefill", "Traceback ...", cause).as_instanceof_cause()


def test_a_prefill_out_of_memory_is_a_503_at_once_never_retried():
    """The retry policy: an OOM of a prefill forward fails the request on its first attempt
    (another replica of the same size would fail the same prompt); the client retries after
    Retry-After. Only a replica's death or a retryable transfer failure is prefilled again."""
    def prefill(payload, n):
        return _Stream([], _ray_wrapped(PrefillOutOfMemory(len(payload.prompt_token_ids), 4096, retry_after_s=2)))

    pipe = _pipeline(prefill, _decode)
    assert pipe.config.transfer.retries == 2
    out, error = _run(pipe, REQ)
    assert out == [] and (error.status, error.code, error.retry_after_s) == (503, "prefill_out_of_memory", 2)
    assert "3-token prompt" in error.message
    assert len(pipe.driver.prefill.prefill.calls) == 1 and pipe.driver.decode.generate.calls == []


def _grpc_code_of(err):
    from router.grpc_ingress import GrpcIngress

    class Context:
        def set_code(self, code):
            self.code = code

        def set_details(self, details):
            self.details = details

        def set_trailing_metadata(self, metadata):
            self.trailing = metadata

    ctx = Context()
    GrpcIngress._grpc_fail(ctx, err)
    return ctx


@pytest.mark.parametrize("make, code", [
    (lambda: _ray_wrapped(PrefillOutOfMemory(131072, 131072, retry_after_s=5)), "prefill_out_of_memory"),
    (lambda: _ray_wrapped(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB")), "out_of_memory"),
    (lambda: torch.OutOfMemoryError("CUDA out of memory"), "out_of_memory"),
])
def test_out_of_memory_reaches_clients_as_http_503_and_grpc_unavailable(make, code):
    import grpc

    from router.app import error_response
    from router.errors import as_request_error

    err = as_request_error(make())
    resp = error_response(err)
    body = json.loads(resp.body)
    assert resp.status_code == 503 and body["error"]["code"] == code and body["error"]["type"] == "server_error"
    assert int(resp.headers["Retry-After"]) >= 1
    ctx = _grpc_code_of(err)
    assert ctx.code == grpc.StatusCode.UNAVAILABLE and ctx.details == body["error"]["message"]
    assert ctx.trailing == [("retry-after", resp.headers["Retry-After"])]


def test_other_worker_errors_stay_500():
    from router.app import error_response
    from router.errors import as_request_error

    assert error_response(as_request_error(_ray_wrapped(RuntimeError("device lost")))).status_code == 500
