"""The accounts every front end renders from (router/accounting.py, protocol.UsageAccount): the
SSE stream, the gRPC stream and both unary answers report one usage, with ``cached_tokens``
counted once per prompt. No service."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("grpc")

from model_executor.tokenizer import ByteTokenizer  # noqa: E402
from router.accounting import ChoiceAccount, Completion, Delta, Logprob, StreamAccount  # noqa: E402
from router.app import sse_chunks  # noqa: E402
from router.grpc_ingress import stream_message  # noqa: E402
from router.proto import flashprefill_pb2 as pb  # noqa: E402
from router.parsing import RequestParser  # noqa: E402
from router.usage import UsageAccount, choices_usage  # noqa: E402
from router.render import completion_response, usage_chunk  # noqa: E402

PARSER = RequestParser(ByteTokenizer(), model_id="m", max_model_len=512, default_max_tokens=8)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(length)]


def _timing(cached: int | None, alpha: float = 0.3, density: float = 0.5) -> dict:
    return {"ttft_s": 0.01, "total_s": 0.02, "cached_tokens": cached,
            "sparse_attention": {"alpha": alpha, "dense": False, "density": density}}


def test_usage_counts_each_prompts_cached_prefix_once_in_any_order():
    rng = random.Random(1)
    req = PARSER.parse({"model": "m", "prompt": [_prompt(rng, 100), _prompt(rng, 50)], "n": 2, "max_tokens": 4},
                       "completion")
    # choices 0, 1 share prompt 0's prefill (64 cached), choices 2, 3 prompt 1's (32 cached)
    reports = [(0, 3, _timing(64)), (1, 4, _timing(64)), (2, 1, _timing(32)), (3, 2, _timing(32))]
    for order in (reports, reports[::-1]):
        account = UsageAccount(req)
        for index, tokens, timing in order:
            account.add(index, tokens, timing)
        assert account.cached_tokens() == 96
        assert account.usage() == {"prompt_tokens": 150, "completion_tokens": 10, "total_tokens": 160,
                                   "prompt_tokens_details": {"cached_tokens": 96}}
    # nothing reported yet: no prompt details at all (not a zero)
    assert UsageAccount(req).usage() == {"prompt_tokens": 150, "completion_tokens": 0, "total_tokens": 150}


def test_usage_reports_sparse_attention_of_the_lowest_choice_only_when_the_request_set_alpha():
    rng = random.Random(2)
    prompt = _prompt(rng, 40)
    asked = PARSER.parse({"model": "m", "prompt": prompt, "n": 2, "sparse_attention": {"alpha": 0.3}}, "completion")
    plain = PARSER.parse({"model": "m", "prompt": prompt, "n": 2}, "completion")
    for req, want in ((asked, {"alpha": 0.3, "dense": False, "density": 0.25}), (plain, None)):
        account = UsageAccount(req)
        account.add(1, 2, _timing(0, density=0.75))
        account.add(0, 2, _timing(0, density=0.25))
        assert account.usage().get("sparse_attention") == want


def _choice_deltas(rng: random.Random) -> list[tuple[int, Delta]]:
    """Two choices of one prompt, interleaved; each finishing delta carries the shared prefill's
    timing (64 cached tokens)."""
    a, b = rng.sample(range(65, 91), 2)
    return [(0, Delta(chr(a), [a], first=True)), (1, Delta(chr(b), [b], first=True)),
            (1, Delta(chr(b) * 2, [b, b], finish_reason="length", timing=_timing(64))),
            (0, Delta(chr(a), [a], finish_reason="stop", timing=_timing(64)))]


def test_sse_and_grpc_streams_render_the_same_usage_and_timing():
    rng = random.Random(3)
    req = PARSER.parse({"model": "m", "prompt": _prompt(rng, 80), "n": 2, "max_tokens": 3, "stream": True,
                        "stream_options": {"include_usage": True}}, "completion")
    deltas = _choice_deltas(rng)
    want = {"prompt_tokens": 80, "completion_tokens": 5, "total_tokens": 85,
            "prompt_tokens_details": {"cached_tokens": 64}}

    sse, chunks = StreamAccount(req), []
    for index, delta in deltas:
        chunks += sse_chunks(req, sse.step(index, delta))
    assert usage_chunk(req, sse.usage.usage())["usage"] == want

    grpc, messages = StreamAccount(req), []
    for index, delta in deltas:
        step = grpc.step(index, delta)
        messages.append(stream_message(pb, req, step, grpc.usage.usage() if step.last else None))
    last = messages[-1]
    assert [m.HasField("usage") for m in messages] == [False, False, False, True]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (80, 5, 85)
    assert last.usage.cached_tokens == last.usage.prompt_tokens_details.cached_tokens == 64
    # each choice's finishing chunk / message carries its timing
    assert [c["choices"][0]["index"] for c in chunks if "timing" in c] == [1, 0]
    assert [(m.index, m.finish_reason, m.timing.total_s) for m in messages if m.finish_reason] == \
        [(1, "length", 0.02), (0, "stop", 0.02)]
    assert "".join(m.text for m in messages if m.index == 0) == "".join(
        c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 0)


def test_unary_answers_report_the_usage_the_streams_do():
    rng = random.Random(4)
    req = PARSER.parse({"model": "m", "prompt": _prompt(rng, 80), "n": 2, "max_tokens": 3}, "completion")
    accounts = [ChoiceAccount.of(req), ChoiceAccount.of(req)]
    for index, delta in _choice_deltas(rng):
        accounts[index].add(delta)
    results = [a.completion() for a in accounts]
    assert [(len(r.token_ids), r.finish_reason) for r in results] == [(2, "stop"), (3, "length")]
    choices = [(k, req.prompt_token_ids, r) for k, r in enumerate(results)]
    want = {"prompt_tokens": 80, "completion_tokens": 5, "total_tokens": 85,
            "prompt_tokens_details": {"cached_tokens": 64}}
    assert completion_response(req, results[0], choices=choices)["usage"] == want
    assert choices_usage(req, choices) == want
    # best_of: the caller counts the discarded choices' tokens too
    assert choices_usage(req, choices[:1], completion_tokens=9)["completion_tokens"] == 9


def test_a_choice_cut_short_reports_what_it_had():
    req = PARSER.parse({"model": "m", "prompt": "hi", "logprobs": 1}, "completion")
    account = ChoiceAccount.of(req)
    lp = Logprob(72, "H", -0.5)
    account.add(Delta("H", [72], first=True, logprobs=[lp]))
    assert account.completion() == Completion("H", [72], "length", {}, None, [lp])
    assert account.cached_tokens is None and not account.finished


def test_an_echo_step_puts_the_prompt_first_and_offsets_follow_it():
    req = PARSER.parse({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1, "stream": True}, "completion")
    prompt_lps = [Logprob(97, "a", None), Logprob(98, "b", -1.0)]
    gen = [Logprob(99, "c", -0.25)]
    account = StreamAccount(req)
    first = account.step(0, Delta("c", [99], first=True, logprobs=gen, prompt_text="ab", prompt_logprobs=prompt_lps))
    assert (first.text, first.text_offset, first.echoed_logprobs) == ("abc", 0, prompt_lps + gen)
    second = account.step(0, Delta("d", [100], finish_reason="length", logprobs=[Logprob(100, "d", -0.125)],
                                   timing=_timing(None)))
    assert (second.text, second.text_offset, second.prompt_logprobs, second.last) == ("d", 3, None, True)
    # gRPC: the echo's scored prompt tokens only (nothing predicts the first)
    msg = stream_message(pb, req, first)
    assert [e.token_id for e in msg.prompt_logprobs] == [98] and [e.token_id for e in msg.logprobs] == [99]
    assert sse_chunks(req, first)[0]["choices"][0]["text"] == "abc"
    # no cached count reported: the usage has no prompt details
    assert "prompt_tokens_details" not in account.usage.usage()
