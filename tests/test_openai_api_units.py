"""The request parser's OpenAI extensions (no service): prompt lists, n / best_of, sampling
controls, logprobs, the developer role, response ids and logprobs shapes."""

from __future__ import annotations

import pytest

from model_executor.tokenizer import ByteTokenizer
from router.pipeline import Completion, Logprob
from router.protocol import RequestError, RequestParser, completion_response, stream_chunk


def parser() -> RequestParser:
    return RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=8)


def parse(body, kind="completion"):
    return parser().parse({"model": "m", **body}, kind)


def test_prompt_lists_n_and_choices():
    req = parse({"prompt": ["ab", [256, 1, 2, 3]], "n": 2, "seed": 9, "max_tokens": 4})
    assert req.batch == ((256, 97, 98), (256, 1, 2, 3)) and req.prompt_len == 7 and not req.single
    groups = req.choices()
    assert [[c.prompt_token_ids for c in row] for row in groups] == [[(256, 97, 98)] * 2, [(256, 1, 2, 3)] * 2]
    assert [c.seed for row in groups for c in row] == [9, 10, 9, 10]
    assert len({c.request_id for row in groups for c in row}) == 4
    assert all(c.single for row in groups for c in row)
    one = parse({"prompt": ["ab"]})
    assert one.single and one.prompt_token_ids == (256, 97, 98)
    best = parse({"prompt": "x", "n": 1, "best_of": 3})
    assert [c.logprobs for c in best.choices()[0]] == [0, 0, 0]  # scored by logprob
    assert parse({"prompt": "x", "n": 2, "best_of": 2}).best_of is None


def test_sampling_controls_reach_the_sampling_params():
    req = parse({"prompt": "x", "presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                 "logit_bias": {"5": 2, "7": -100}, "min_tokens": 2, "stop_token_ids": [9, 257], "logprobs": 3})
    p = req.sampling_params()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.0, -0.5, 1.2)
    assert p.logit_bias == ((5, 2.0), (7, -100.0)) and p.min_tokens == 2 and p.logprobs == 3
    assert p.stop_token_ids == (257, 262, 9)  # the tokenizer's end of text, then the request's
    assert parse({"prompt": "x", "ignore_eos": True, "stop_token_ids": [9]}).stop_token_ids == (9,)
    assert parse({"prompt": "x", "ignore_eos": True}).stop_token_ids == ()
    chat = parse({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 4}, "chat")
    assert chat.logprobs == 4
    assert parse({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, "chat").logprobs == 0
    assert parse({"messages": [{"role": "user", "content": "a"}], "logprobs": False}, "chat").logprobs is None


def test_developer_role_renders_as_system():
    dev = parse({"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]}, "chat")
    sys_ = parse({"messages": [{"role": "system", "content": "d"}, {"role": "user", "content": "u"}]}, "chat")
    assert dev.prompt_token_ids == sys_.prompt_token_ids


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", 3]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a"] * 33}, "prompt"),
    ({"prompt": ["a", "\ud800"]}, "prompt[1]"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "x", "logit_bias": {"264": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"\ud800": 1}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": 9}, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [264]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 3}, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
])
def test_bad_fields_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param
    info.value.to_dict()  # renders (no lone surrogate left in it)
    import json

    json.dumps(info.value.to_dict()).encode("utf-8")


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 1}, "top_logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),  # tool results name their call
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
])
def test_bad_chat_fields(body, param):
    with pytest.raises(RequestError) as info:
        parse({"messages": [{"role": "user", "content": "a"}], **body}, "chat")
    assert info.value.param == param


def test_response_ids_fingerprint_and_logprobs_shapes():
    req = parse({"prompt": "x", "logprobs": 2, "request_id": "abc"})
    lps = [Logprob(65, "A", -0.5, ((65, "A", -0.5), (66, "B", -1.5))), Logprob(66, "B", -2.0, ((65, "A", -0.1),))]
    out = completion_response(req, Completion("AB", [65, 66], "length", {}, None, lps))
    assert out["id"] == "cmpl-abc" and out["system_fingerprint"] == "fp_flashprefill"
    assert out["choices"][0]["logprobs"] == {"tokens": ["A", "B"], "token_logprobs": [-0.5, -2.0],
                                             "top_logprobs": [{"A": -0.5, "B": -1.5}, {"A": -0.1}],
                                             "text_offset": [0, 1]}
    chat = parse({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 1,
                  "request_id": "chatcmpl-q"}, "chat")
    chunk = stream_chunk(chat, "A", [65], None, logprobs=lps[:1], index=3)
    assert chunk["id"] == "chatcmpl-q" and chunk["choices"][0]["index"] == 3
    assert chunk["choices"][0]["logprobs"]["content"][0] == {
        "token": "A", "logprob": -0.5, "bytes": [65],
        "top_logprobs": [{"token": "A", "logprob": -0.5, "bytes": [65]}, {"token": "B", "logprob": -1.5, "bytes": [66]}]}
    plain = parse({"prompt": "x"})
    assert completion_response(plain, Completion("A", [65], "stop", {}))["choices"][0]["logprobs"] is None


def test_echo_and_max_tokens_zero():
    req = parse({"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert req.echo and req.max_tokens == 0
    p = req.sampling_params()
    assert p.prompt_logprobs == 1 and p.max_new_tokens == 1
    assert parse({"prompt": "ab", "echo": True}).sampling_params().prompt_logprobs is None
    with pytest.raises(RequestError) as info:
        parse({"prompt": "ab", "max_tokens": 0})
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        parse({"messages": [{"role": "user", "content": "a"}], "echo": True}, "chat")
    assert info.value.param == "echo"
    lps = [Logprob(256, "<|bos|>", None), Logprob(97, "a", -1.0, ((97, "a", -1.0),))]
    out = completion_response(req, Completion("", [], "length", {}, None, [], "ab", lps))
    assert out["choices"][0]["text"] == "ab"
    assert out["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]
    assert out["choices"][0]["logprobs"]["top_logprobs"] == [None, {"a": -1.0}]


@pytest.mark.parametrize("value, alpha", [(None, None), (True, None), (False, 0.0), ({"alpha": 0.25}, 0.25),
                                          ({"alpha": 0}, 0.0)])
def test_sparse_attention_field(value, alpha):
    req = parse({"prompt": "x", "sparse_attention": value})
    assert req.sparse_alpha == alpha
    assert [c.sparse_alpha for row in parse({"prompt": ["a", "b"], "sparse_attention": value}).choices()
            for c in row] == [alpha, alpha]


@pytest.mark.parametrize("value", [{"alpha": 1.5}, {"alpha": "x"}, {"beta": 0.1}, {}, 0.1, "dense", [0.1],
                                   {"alpha": 0.1, "x": 1}])
def test_sparse_attention_rejects(value):
    with pytest.raises(RequestError) as info:
        parse({"prompt": "x", "sparse_attention": value})
    assert info.value.param == "sparse_attention" and info.value.message.startswith("sparse_attention")


def test_usage_reports_sparse_attention_only_when_asked():
    timing = {"sparse_attention": {"alpha": 0.0, "dense": True}}
    asked = parse({"prompt": "x", "sparse_attention": False})
    out = completion_response(asked, Completion("A", [65], "stop", timing))
    assert out["usage"]["sparse_attention"] == {"alpha": 0.0, "dense": True}
    assert "sparse_attention" not in completion_response(parse({"prompt": "x"}), Completion("A", [65], "stop", timing))["usage"]


def test_cost_model_sees_dense_requests():
    from serving.costs import PrefillCostModel

    m = PrefillCostModel(dense_below=100, expected_density=0.25)
    assert m.cost(1000, alpha=0.0) == m.token_weight * 1000 + 1000 * 1001 / 2
    assert m.cost(1000) == m.token_weight * 1000 + 1000 * 1001 / 2 * 0.25 == m.cost(1000, alpha=0.3)
