"""The open-loop load generator (benchmarks/open_loop.py) against a fake streaming server, and
the shared HTTP client of benchmarks/load_test.py."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

httpx = pytest.importorskip("httpx")

from benchmarks.load_test import Outcome, completion_body, encode_body, http_completion  # noqa: E402
from benchmarks.open_loop import (  # noqa: E402
    CellSpec,
    RequestRecord,
    check_loopback,
    poisson_arrivals,
    run_cell,
    summarize,
)

BASE = "http://127.0.0.1:1"

# ----------------------------------------------------------------------------- arrivals, loopback
def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = poisson_arrivals(4.0, 4000, seed=7)
    assert a == poisson_arrivals(4.0, 4000, seed=7) and a != poisson_arrivals(4.0, 4000, seed=8)
    assert all(x < y for x, y in zip(a, a[1:])) and a[0] > 0
    assert abs(a[-1] / len(a) - 0.25) < 0.0125  # mean gap 1/rate within 5%
    gaps = [y - x for x, y in zip([0.0] + a, a)]
    assert abs(sorted(gaps)[len(gaps) // 2] - math.log(2) / 4.0) < 0.02  # exponential: median ln2/rate
    slow = poisson_arrivals(1.0, 50, seed=7)  # one unit-rate sequence, scaled by 1/rate
    assert all(math.isclose(x, 4 * y) for x, y in zip(slow, poisson_arrivals(4.0, 50, seed=7)))
    assert poisson_arrivals(1.0, 0, seed=0) == []


@pytest.mark.parametrize("rate, count, match", [(0, 3, "rate"), (-1.0, 3, "rate"), (True, 3, "rate"),
                                                (math.inf, 3, "rate"), (1.0, -1, "count"), (1.0, 2.5, "count")])
def test_poisson_arrivals_rejects(rate, count, match):
    with pytest.raises(ValueError, match=match):
        poisson_arrivals(rate, count, seed=0)


def test_check_loopback():
    for url in ("http://127.0.0.1:8000", "http://127.3.2.1", "http://localhost:9", "http://[::1]:8000/v1"):
        check_loopback(url)
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"):
        with pytest.raises(ValueError, match="not a loopback address.*--allow-remote"):
            check_loopback(url)
        check_loopback(url, allow_remote=True)
    for url in ("ftp://127.0.0.1", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError, match="url: expected http"):
            check_loopback(url, allow_remote=True)


@pytest.mark.parametrize("field, value", [("rate", 0), ("rate", True), ("requests", 0), ("requests", 1.5),
                                          ("cell_seconds", -1), ("cell_seconds", math.inf), ("drain_seconds", -0.5),
                                          ("request_timeout_s", 0), ("seed", "1")])
def test_cell_spec_rejects(field, value):
    with pytest.raises(ValueError, match=field):
        CellSpec(**{"rate": 1.0, field: value})


# ----------------------------------------------------------------------------- a fake service
def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def fake_service(delay_s: float = 0.01):
    """A MockTransport speaking the service's SSE completions. The prompt's first id picks the
    behaviour: 1 normal, 2 answers 429, 3 never answers, 4 sends an in-band error, 5 stops short."""
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        kind, n = body["prompt"][0], body["max_tokens"]
        if kind == 2:
            return httpx.Response(429, json={"error": {"message": "overloaded"}}, headers={"Retry-After": "1"})
        if kind == 3:
            await asyncio.sleep(3600)

        async def events():
            timing = {"ttft_s": delay_s, "queue_s": 0.0, "prefill_s": delay_s / 2, "export_s": 0.0,
                      "transfer_s": 0.001, "first_decode_s": 0.001, "total_s": delay_s * (n + 1)}
            for i in range(n):
                await asyncio.sleep(delay_s)
                if kind == 4 and i == 1:
                    yield _sse({"error": {"message": "decode replica failed", "code": "decode_failed"}})
                    break
                if kind == 5 and i == n - 1:
                    break
                last = i == n - 1
                chunk = {"id": "cmpl-x", "choices": [{"index": 0, "text": f"<{i}>", "token_ids": [i],
                                                       "finish_reason": "length" if last else None}]}
                if last:
                    chunk["timing"] = timing
                yield _sse(chunk)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    return httpx.MockTransport(handler)


def _prompts(kinds):
    return [(100 * (k + 1), encode_body(completion_body("m", [k, 9, 9], 4, True))) for k in kinds]


def _cell(spec, kinds, transport, **kw):
    return asyncio.run(run_cell(BASE, spec, _prompts(kinds), max_tokens=4, transport=transport, **kw))


def test_run_cell_measures_and_classifies_every_outcome():
    spec = CellSpec(rate=50.0, requests=5, cell_seconds=5.0, drain_seconds=5.0, request_timeout_s=0.5)
    recs = _cell(spec, [1, 2, 3, 4, 5], fake_service())
    assert [r.status for r in recs] == ["ok", "lost", "lost", "lost", "lost"]
    assert [r.lost_reason for r in recs] == [None, "rejected", "timeout", "error", "incomplete"]
    ok = recs[0]
    assert ok.output_tokens == 4 and ok.ttft_s > 0 and ok.tpot_s > 0 and ok.latency_s >= ok.ttft_s
    assert ok.timing["prefill_s"] == 0.005 and ok.sent_s >= ok.scheduled_s - 1e-3
    assert recs[1].http_status == "429" and recs[2].problem.startswith("no complete answer")
    s = summarize(recs, spec)
    assert (s["sent"], s["completed"], s["lost"], s["not_sent"]) == (5, 1, 4, 0)
    assert s["lost_by_reason"] == {"timeout": 1, "rejected": 1, "error": 1, "incomplete": 1}
    assert s["ttft_p50_s"] == ok.ttft_s and s["output_tokens"] == 4
    assert s["server_median_s"]["prefill_s"] == 0.005 and math.isclose(s["server_median_s"]["other_s"], 0.005)
    assert s["ttft_p50_by_prompt_len"] == {200: {"completed": 1, "ttft_p50_s": ok.ttft_s}}
    # over every sent request: 429 and timeout never saw a token (lower bounds); the in-band
    # error and the short stream did
    assert recs[3].ttft_s is not None and recs[4].ttft_s is not None and recs[1].ttft_s is None
    assert s["ttft_p99_sent_s"] == recs[2].latency_s and s["ttft_sent_lower_bound"]["p99"] is True


def test_run_cell_bounds_count_and_time():
    # arrivals past cell_seconds are not sent; a request still running at cell + drain is cut
    spec = CellSpec(rate=4.0, requests=40, cell_seconds=0.6, drain_seconds=0.3, request_timeout_s=60.0, seed=1)
    arrivals = poisson_arrivals(4.0, 40, seed=1)
    recs = _cell(spec, [3], fake_service())
    sent = [r for r in recs if r.sent_s is not None]
    assert len(sent) == sum(a <= 0.6 for a in arrivals) >= 1
    assert all(r.status == "lost" and r.lost_reason == "cut" for r in sent)
    assert all(r.status == "not_sent" for r in recs[len(sent):])
    assert max(r.finished_s for r in sent) < 0.6 + 0.3 + 0.5
    s = summarize(recs, spec)
    assert s["not_sent"] == 40 - len(sent) and s["completed"] == 0 and s["ttft_p50_s"] is None
    assert s["ttft_p50_sent_s"] >= 0.3 and s["ttft_sent_lower_bound"] == {"p50": True, "p99": True}
    assert s["requests_per_s"] == 0.0


def test_run_cell_rejects_bad_arguments():
    spec = CellSpec(rate=1.0, requests=1)
    with pytest.raises(ValueError, match="not a loopback"):
        asyncio.run(run_cell("http://192.0.2.1:8000", spec, _prompts([1]), max_tokens=4))
    with pytest.raises(ValueError, match="prompts"):
        asyncio.run(run_cell(BASE, spec, [], max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(run_cell(BASE, spec, _prompts([1]), max_tokens=0))


def test_http_completion_non_streaming_keeps_the_timing():
    def handler(request):
        return httpx.Response(200, json={"id": "c1", "choices": [{"text": "<1>", "token_ids": [1],
                                                                 "finish_reason": "length"}], "timing": {"ttft_s": 0.1}})

    async def go():
        out = Outcome(0, "http", 3, 1, ok=False)
        async with httpx.AsyncClient(base_url=BASE, transport=httpx.MockTransport(handler)) as client:
            await http_completion(client, "/v1/completions", b"{}", {}, False, out, 0.0)
        return out

    out = asyncio.run(go())
    assert out.problem == "" and out.token_ids == [1] and out.timing == {"ttft_s": 0.1} and out.status == "200"


def test_summarize_throughput_over_busy_time():
    spec = CellSpec(rate=1.0, requests=3)
    recs = [RequestRecord(0, 10, 0.0, status="ok", sent_s=0.0, finished_s=2.0, ttft_s=0.5, tpot_s=0.1, output_tokens=4),
            RequestRecord(1, 10, 1.0, status="ok", sent_s=1.0, finished_s=4.0, ttft_s=1.5, tpot_s=0.3, output_tokens=4),
            RequestRecord(2, 10, 9.0)]
    s = summarize(recs, spec)
    assert (s["sent"], s["completed"], s["not_sent"], s["busy_s"]) == (2, 2, 1, 4.0)
    assert s["output_tokens_per_s"] == 2.0 and s["requests_per_s"] == 0.5 and s["offered_rps"] == 2.0
    assert s["ttft_p50_s"] in (0.5, 1.5) and s["ttft_p99_s"] == 1.5 and s["tpot_p99_s"] == 0.3
    assert s["ttft_p99_sent_s"] == 1.5 and s["ttft_sent_lower_bound"] == {"p50": False, "p99": False}
    empty = summarize([RequestRecord(0, 10, 5.0)], spec)
    assert empty["sent"] == 0 and empty["ttft_p50_sent_s"] is None and empty["offered_rps"] is None
