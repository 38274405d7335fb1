"""Tool calls parsed out of a streamed reply (``model_executor.tools.ToolCallStream``, the
router's ``ToolChoiceStream`` / ``tool_stream_chunks``): whatever the split of a reply into
deltas, the streamed content and calls are what the whole-reply parser gives; content goes out
before the reply ends; chunks have OpenAI's shapes."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_executor.tools import ToolCallStream, extract_tool_calls
from router.accounting import Logprob
from router.generation import GenerationRequest
from router.render import ToolChoiceStream, split_tool_calls, tool_stream_chunks

CALLS = ['{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}', '{"name": "ping", "arguments": {}}',
         '{"name": "lookup", "arguments": "{\\"id\\": 3}"}', '{"name": "x", "arguments": {"s": "</tool_call"}}']
BAD = ["{not json}", '{"arguments": {}}', '["f"]', '{"name": "f", "arguments": [1]}', ""]
TEXT = ["Sure.", "It is sunny", " ", "\n", "\n\n", "  x  ", "<", "<tool_c", "<tool_call", "</tool_call>", "a < b",
        "<tool_callx", "é", "tool_call>", "{", "}", "{\"name\": 1}", ";"]


def _hermes_piece(draw_kind: int, i: int) -> str:
    if draw_kind == 0:
        return TEXT[i % len(TEXT)]
    if draw_kind == 1:
        return "<tool_call>" + ["\n", "", " "][i % 3] + CALLS[i % len(CALLS)] + ["\n", ""][i % 2] + "</tool_call>"
    return "<tool_call>" + BAD[i % len(BAD)] + "</tool_call>"


@st.composite
def hermes_replies(draw):
    pieces = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 200)), max_size=8))
    text = "".join(_hermes_piece(k, i) for k, i in pieces)
    tail = draw(st.integers(0, 3))  # an unclosed last block: a call cut by a stop / max_tokens, or not
    if tail == 1:
        text += "<tool_call>\n" + CALLS[draw(st.integers(0, len(CALLS) - 1))]
    elif tail == 2:
        text += "<tool_call>{\"name\": \"f\", \"argu"
    return text


@st.composite
def llama_replies(draw):
    calls = ['{"name": "get_weather", "parameters": {"city": "Lima"}}', '{"name": "ping", "arguments": {}}',
             '{"name": "f", "parameters": "{\\"a\\": 1}"}']
    pieces = draw(st.lists(st.sampled_from(calls + ["; ", " ", "\n", "and more", "[1]", '{"city": "Oslo"}',
                                                    "<|python_tag|>", "<|python", "It is sunny.", "{"]), max_size=5))
    return "".join(pieces)


def _split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _streamed(fmt: str, deltas: list[str]) -> tuple[str, list[dict]]:
    stream, events = ToolCallStream(fmt), []
    for d in deltas:
        events += stream.push(d)
    events += stream.finish()
    assert all(kind in ("content", "call") for kind, _ in events)
    assert all(value for kind, value in events if kind == "content")  # no empty content event
    return "".join(v for k, v in events if k == "content"), [v["function"] for k, v in events if k == "call"]


def _whole(fmt: str, text: str) -> tuple[str, list[dict]]:
    content, calls = extract_tool_calls(text, fmt)
    return content or "", [c["function"] for c in calls or ()]


FUZZ = settings(max_examples=400, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(hermes_replies(), st.lists(st.integers(0, 400), max_size=12))
def test_hermes_stream_equals_the_whole_reply_parse_for_any_split(text, cuts):
    assert _streamed("hermes", _split(text, cuts)) == _whole("hermes", text)
    assert _streamed("qwen2", list(text)) == _whole("hermes", text)  # one character at a time


@FUZZ
@given(llama_replies(), st.lists(st.integers(0, 200), max_size=8))
def test_llama_stream_equals_the_whole_reply_parse_for_any_split(text, cuts):
    assert _streamed("llama3_json", _split(text, cuts)) == _whole("llama3_json", text)
    assert _streamed("llama", list(text)) == _whole("llama", text)


def test_fixed_replies_stream_as_the_whole_parse():
    """Hand-picked cases, each split at every position and character by character."""
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    cases = ["plain text, no calls  \n", "  leading space kept", call, f"Let me check.\n{call}\n{call}\n",
             f"\n\n{call}\n\nDone.\n", f"A \n{call}\n B", "<tool_c never a marker", "x <tool_call",
             "<tool_call>{bad}</tool_call> then text", f"<tool_call>{{bad}}</tool_call>\n{call}", "", "   ",
             f"{call}<tool_call>\n" + '{"name": "f", "arguments": {"a": 1}}', f"{call}<tool_call>{{cut", "é<tool_call>é"]
    rng = random.Random(0)
    for text in cases:
        want = _whole("hermes", text)
        for at in range(len(text) + 1):
            assert _streamed("hermes", _split(text, [at])) == want, (text, at)
        assert _streamed("hermes", list(text)) == want
        for _ in range(20):
            assert _streamed("hermes", _split(text, [rng.randrange(len(text) + 1) for _ in range(4)])) == want


def test_whitespace_the_calls_leave_at_the_ends_goes():
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    # independent expectations, written out (not from the parser)
    assert extract_tool_calls(f"\n {call}\n\nDone. \n", "hermes")[0] == "Done."
    assert extract_tool_calls(f"  Hi \n{call}\n", "hermes")[0] == "  Hi"  # a reply starting with text keeps it
    assert extract_tool_calls(f"Hi\n{call}\nthere", "hermes")[0] == "Hi\n\nthere"
    assert extract_tool_calls(f"\n{call}\n", "hermes")[0] is None
    assert extract_tool_calls("  no calls \n", "hermes") == ("  no calls \n", None)


def test_content_goes_out_before_the_reply_ends_and_holds_only_a_marker_prefix():
    stream = ToolCallStream("hermes")
    assert stream.push("Hello") == [("content", "Hello")]
    assert stream.push(" wor") == [("content", " wor")]
    assert stream.push("ld <tool_") == [("content", "ld")]  # " <tool_": a space and a marker prefix held
    assert stream.push("cat") == [("content", " <tool_cat")]  # not a marker after all
    assert stream.push(" <tool_call>{\"name\": \"f\", ") == []  # inside a call: held
    (kind, call), = stream.push('"arguments": {"a": [1]}}</tool_call>')
    assert kind == "call" and call["function"] == {"name": "f", "arguments": '{"a": [1]}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert stream.push(" ok") == [("content", "  ok")]  # whitespace between text and text is kept (both sides)
    assert stream.finish() == []
    assert stream.finish() == []
    llama = ToolCallStream("llama")
    assert llama.push("  ") == [] and llama.push("It") == [("content", "  It")] and llama.push(" is") == [("content", " is")]
    maybe = ToolCallStream("llama3_json")
    assert maybe.push("<|py") == [] and maybe.push('thon_tag|>{"name": "f", "parameters": {}}') == []
    (kind, call), = maybe.finish()
    assert kind == "call" and call["function"]["name"] == "f"


def test_stream_errors_name_the_argument():
    with pytest.raises(ValueError, match="^model_type: "):
        ToolCallStream("gpt2")
    stream = ToolCallStream("hermes")
    with pytest.raises(ValueError, match="^text: expected a str, got bytes"):
        stream.push(b"x")
    stream.finish()
    with pytest.raises(ValueError, match="^text: the stream has finished"):
        stream.push("x")


# -- the router's per-choice stream and its chunks -------------------------------------------------
def _req(**kw):
    return GenerationRequest(request_id="r", kind="chat", model="m", prompt_token_ids=(1,), max_tokens=8,
                             tool_format="hermes", **kw)


def _lp(ids):
    return [Logprob(token_id=i, token=chr(i), logprob=-1.0) for i in ids]


REPLY = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_choice_stream_equals_split_tool_calls_and_keeps_one_call_without_parallel():
    rng = random.Random(1)
    for parallel in (True, False):
        req = _req(parallel_tool_calls=parallel)
        for finish in ("stop", "length"):
            want_content, want_calls, want_finish = split_tool_calls(req, REPLY, finish)
            for _ in range(30):
                deltas = _split(REPLY, [rng.randrange(len(REPLY) + 1) for _ in range(rng.randrange(6))])
                stream, events = ToolChoiceStream(req), []
                for i, d in enumerate(deltas):
                    out, fin = stream.push(d, finish if i == len(deltas) - 1 else None)
                    events += out
                assert fin == want_finish
                assert "".join(v for k, v in events if k == "content") == want_content
                calls = [v for k, v in events if k == "call"]
                assert [c["index"] for c in calls] == list(range(len(calls)))
                assert [c["function"] for c in calls] == [c["function"] for c in want_calls]
    plain = ToolChoiceStream(_req())
    assert plain.push("no calls", "stop") == ([("content", "no calls")], "stop")


def test_tool_stream_chunks_shapes():
    req = _req(return_token_ids=True, logprobs=0)
    stream = ToolChoiceStream(req)
    first = tool_stream_chunks(req, stream, "Sure.\n<tool", [1, 2], None, first=True, logprobs=_lp([83, 117]), index=2)
    assert len(first) == 1
    choice = first[0]["choices"][0]
    assert choice["delta"] == {"role": "assistant", "content": "Sure."} and choice["finish_reason"] is None
    assert choice["index"] == 2 and choice["token_ids"] == [1, 2]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["S", "u"]
    held = tool_stream_chunks(req, stream, '_call>\n{"name": "ping", ', [3], None, logprobs=_lp([95]), index=2)
    assert len(held) == 1 and held[0]["choices"][0]["delta"] == {} and held[0]["choices"][0]["token_ids"] == [3]
    assert len(held[0]["choices"][0]["logprobs"]["content"]) == 1  # the tokens' logprobs, though the text is held
    end = tool_stream_chunks(req, stream, '"arguments": {"a": 1}}\n</tool_call>', [4, 5], "stop",
                             logprobs=_lp([34, 125]), index=2)
    assert len(end) == 2
    call_choice, last = end[0]["choices"][0], end[1]["choices"][0]
    (tc,) = call_choice["delta"]["tool_calls"]
    assert tc["index"] == 0 and tc["type"] == "function" and tc["id"].startswith("call_")
    assert tc["function"] == {"name": "ping", "arguments": json.dumps({"a": 1})}
    assert call_choice["token_ids"] == [4, 5] and len(call_choice["logprobs"]["content"]) == 2
    assert call_choice["finish_reason"] is None
    assert last["delta"] == {} and last["finish_reason"] == "tool_calls" and last["token_ids"] == []
    assert last["logprobs"] is None
    # a plain reply: the finish rides on the last content chunk
    plain = ToolChoiceStream(req)
    (chunk,) = tool_stream_chunks(req, plain, "It is", [6], "length", first=True, index=0)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "It is"}
    assert chunk["choices"][0]["finish_reason"] == "length"
