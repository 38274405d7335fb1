"""The request and response models (router/openai_models.py) and the OpenAPI description
generated from them: every field the parser accepts is described, what real clients send is
valid by the description and parsed, what the service answers is valid by it."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from model_executor.tokenizer import ByteTokenizer
from router.accounting import Completion, Logprob
from serving.errors import RequestError
from router.parsing import RequestParser
from router.render import (completion_response, openapi_extra, stream_chunk, tool_stream_chunks, ToolChoiceStream,
                           usage_chunk)
from router.usage import usage

# docs/API.md's "Request fields" table, written out by hand: the fields each endpoint accepts
BOTH = ["model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n", "logprobs", "logit_bias",
        "presence_penalty", "frequency_penalty", "response_format", "stream_options", "top_k", "min_p",
        "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "add_special_tokens",
        "return_tokens_as_token_ids", "request_id", "return_token_ids", "sparse_attention", "user", "metadata",
        "store", "service_tier", "prompt_cache_key", "safety_identifier", "priority", "cache_salt",
        "kv_transfer_params", "vllm_xargs", "skip_special_tokens", "spaces_between_special_tokens",
        "guided_decoding_backend", "guided_whitespace_pattern", "use_beam_search", "include_stop_str_in_output",
        "length_penalty", "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "prompt_logprobs",
        "logits_processors", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"]
FIELDS = {
    "completion": BOTH + ["prompt", "echo", "best_of", "suffix", "tools", "tool_choice", "parallel_tool_calls",
                          "prompt_embeds"],
    "chat": BOTH + ["messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                    "reasoning_effort", "verbosity", "modalities", "prediction", "functions", "function_call",
                    "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs", "best_of", "echo",
                    "add_generation_prompt", "continue_final_message", "chat_template", "documents", "audio",
                    "web_search_options"],
}
BASE = {"completion": {"model": "m", "prompt": "hi"}, "chat": {"model": "m", "messages": [{"role": "user",
                                                                                             "content": "hi"}]}}


def strict() -> RequestParser:
    return RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=8, strict_fields=True)


def request_schema(kind: str) -> dict:
    return openapi_extra(kind)["requestBody"]["content"]["application/json"]["schema"]


def response_schema(kind: str, media: str = "application/json") -> dict:
    return openapi_extra(kind)["responses"]["200"]["content"][media]["schema"]


def test_schemas_are_self_contained_json_schemas():
    for kind in FIELDS:
        extra = openapi_extra(kind)
        text = json.dumps(extra)
        assert '"$ref"' not in text and '"$defs"' not in text  # FastAPI's openapi_extra resolves no reference
        for schema in (request_schema(kind), response_schema(kind), response_schema(kind, "text/event-stream"),
                       extra["responses"]["400"]["content"]["application/json"]["schema"]):
            jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_every_field_the_parser_accepts_is_in_the_schema(kind):
    schema = request_schema(kind)
    assert set(schema["properties"]) == set(FIELDS[kind])
    assert set(schema["required"]) == {"model", "prompt" if kind == "completion" else "messages"}
    parser = strict()
    for name in FIELDS[kind]:  # null is every optional field's "not given": none is an unknown argument
        if name not in schema["required"]:
            parser.parse({**BASE[kind], name: None}, kind)
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):  # a name the schema does not have: refused under strict_fields
        name = "x" + "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (8,), generator=gen))
        assert name not in schema["properties"]
        with pytest.raises(RequestError) as info:
            parser.parse({**BASE[kind], name: 1}, kind)
        assert info.value.param == name and "unrecognized" in info.value.message


# bodies as the clients serialize them (the calls tests/test_openai_api.py makes)
CLIENT_BODIES = [
    # lm-eval local-completions: loglikelihood (token ids, echo, max_tokens 0), generate_until (a prompt list)
    ("completion", {"model": "m", "prompt": [256, 72, 105, 33], "max_tokens": 0, "echo": True, "logprobs": 1,
                    "temperature": 0, "seed": 1234}),
    ("completion", {"model": "m", "prompt": ["Question: 1+1?\nAnswer:", "Q: 2?"], "max_tokens": 8,
                    "temperature": 0, "stop": ["\n\n", "Q"], "seed": 1234}),
    # guidellm: streaming completions with vLLM's continuous usage; chat with text parts
    ("completion", {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True,
                    "min_p": 0.05}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
              "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True},
              "ignore_eos": True}),
    # the openai SDK: the fields it sends, tools, a history with the response message echoed back
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5,
              "temperature": 1.0, "seed": 7, "metadata": {"run": "t"}, "store": False, "service_tier": "auto",
              "reasoning_effort": "low", "modalities": ["text"], "verbosity": "low",
              "prediction": {"type": "content", "content": "hello"}, "prompt_cache_key": "k1",
              "safety_identifier": "user-1",
              "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}],
              "min_p": 1.0, "add_special_tokens": False}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
              "stream_options": {"include_usage": True, "include_obfuscation": True}, "logprobs": True,
              "top_logprobs": 2, "n": 2}),
    ("chat", {"model": "m", "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "lookup", "description": "find a record",
                                          "parameters": {"type": "object", "properties": {"id": {"type": "integer"}},
                                                         "required": ["id"]}}}],
              "tool_choice": "auto", "parallel_tool_calls": True, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "find 7"},
        {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
         "annotations": [], "tool_calls": [{"id": "call_1", "type": "function",
                                            "function": {"name": "lookup", "arguments": "{\"id\": 7}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "id 7: found"}]}),
    ("completion", {"model": "m", "prompt": "x", "max_tokens": 2, "logit_bias": {"65": 5}, "user": "u",
                    "sparse_attention": {"alpha": 0.3}, "return_token_ids": True, "response_format": {"type": "text"},
                    "presence_penalty": 0.5, "frequency_penalty": -0.5, "n": 2, "best_of": 3, "top_k": -1}),
]


@pytest.mark.parametrize("kind, body", CLIENT_BODIES)
def test_what_clients_send_is_valid_by_the_schema_and_parsed(kind, body):
    jsonschema.validate(body, request_schema(kind))
    parser = RequestParser(ByteTokenizer(), model_id="m", max_model_len=1024, default_max_tokens=8,
                           model_type="qwen2")
    req = parser.parse(body, kind)
    assert req.kind == kind and len(req.prompt_token_ids) >= 1


@pytest.mark.parametrize("kind, body", [
    ("completion", {"model": "m", "prompt": "x", "temperature": 2.5}),
    ("completion", {"model": "m", "prompt": [], "max_tokens": 1}),
    ("completion", {"model": "m", "prompt": "x", "stop": ["a"] * 5}),
    ("completion", {"model": "m", "prompt": "x", "use_beam_search": True}),
    ("completion", {"model": "m", "prompt": "x", "sparse_attention": {"alpha": 0.1, "beta": 1}}),
    ("chat", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x", "refusal": "no"}]}),
    ("chat", {"model": "m", "messages": []}),
])
def test_the_schema_and_the_parser_refuse_the_same_bad_values(kind, body):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, request_schema(kind))
    with pytest.raises(RequestError) as info:
        RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=8).parse(body, kind)
    assert info.value.status == 400


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages[0].refusal"),
    ({"messages": [{"role": "user", "content": "x", "\ud800": 1}]}, "messages[0]"),  # a key UTF-8 cannot encode
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s", "tool_call_id": "c"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": None, "parallel_tool_calls": "yes"},
     "parallel_tool_calls"),
])
def test_chat_message_errors_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        strict().parse({"model": "m", **body}, "chat")
    assert info.value.status == 400 and info.value.param == param and info.value.message.startswith(f"{param}: ")
    json.dumps(info.value.to_dict()).encode("utf-8")  # renders: no lone surrogate left in it


@pytest.mark.parametrize("body, param", [
    ({"prompt": [[1, -2]]}, "prompt"),  # a list of one prompt is named as the prompt
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ({"prompt": [1, 2, True]}, "prompt"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "top_k": 265}, "top_k"),  # above the byte tokenizer's vocabulary
    ({"prompt": "x", "seed": 1 << 63}, "seed"),
    ({"prompt": "x", "request_id": "a\nb"}, "request_id"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "zz": 1}}, "stream_options.zz"),
])
def test_completion_errors_name_the_field(body, param):
    with pytest.raises(RequestError) as info:
        strict().parse({"model": "m", **body}, "completion")
    assert info.value.status == 400 and info.value.param == param and info.value.message.startswith(f"{param}: ")


def _parse(kind, **fields):
    parser = RequestParser(ByteTokenizer(), model_id="m", max_model_len=1024, default_max_tokens=8, model_type="qwen2")
    return parser.parse({**BASE[kind], **fields}, kind)


def test_responses_and_chunks_are_valid_by_the_schema():
    top = ((65, "A", -0.5), (66, "B", -1.5))
    lps = [Logprob(65, "A", -0.5, top), Logprob(66, "B", -2.0, top[:1])]
    timing = {"cached_tokens": 1, "sparse_attention": {"alpha": 0.2, "dense": False, "density": 0.5}}
    comp = _parse("completion", logprobs=2, return_token_ids=True, sparse_attention={"alpha": 0.2}, n=2)
    result = Completion("AB", [65, 66], "length", timing, {"prefill": "p0"}, lps)
    whole = completion_response(comp, result, choices=[(0, comp.prompt_token_ids, result),
                                                      (1, comp.prompt_token_ids, result)])
    jsonschema.validate(whole, response_schema("completion"))
    events = [stream_chunk(comp, "A", [65], None, logprobs=lps[:1]), stream_chunk(comp, "B", [66], "length"),
              usage_chunk(comp, usage(comp.prompt_len, 2, 1, {"alpha": 0.2, "dense": False, "density": 0.5}))]
    chat = _parse("chat", logprobs=True, top_logprobs=2)
    whole_chat = completion_response(chat, Completion("hi", [104, 105], "stop", {}, None, lps))
    jsonschema.validate(whole_chat, response_schema("chat"))
    chat_events = [stream_chunk(chat, "h", [104], None, first=True, logprobs=lps[:1]),
                   stream_chunk(chat, None, [], "stop"), usage_chunk(chat, usage(chat.prompt_len, 2))]
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    called = _parse("chat", tools=tools)
    reply = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    with_call = completion_response(called, Completion(reply, [1], "stop", {}))
    assert with_call["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "ping"
    jsonschema.validate(with_call, response_schema("chat"))
    chat_events += tool_stream_chunks(called, ToolChoiceStream(called), reply, [1], "stop", first=True)
    for kind, chunks in (("completion", events), ("chat", chat_events)):
        for chunk in chunks:
            jsonschema.validate(chunk, response_schema(kind, "text/event-stream"))
    bad = {**whole, "choices": [{**whole["choices"][0], "finish_reason": "done"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, response_schema("completion"))
    error = RequestError("n: bad", param="n", status=400, code="invalid_value").to_dict()
    jsonschema.validate(error, openapi_extra("chat")["responses"]["400"]["content"]["application/json"]["schema"])


def test_a_long_unknown_message_key_gives_a_short_error():
    with pytest.raises(RequestError) as info:
        strict().parse({"model": "m", "messages": [{"role": "user", "content": "x", "k" * 5000: 1}]}, "chat")
    assert info.value.param.startswith("messages[0].kkk") and len(info.value.message) <= 512


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_unknown_field_whose_name_has_a_lone_surrogate_is_ignored_or_named_when_strict(kind):
    """JSON lets a client send ``"\\ud800x"`` as a key: ignored like any unknown field (the
    request's own fields still checked), and under strict_fields a 400 naming it escaped."""
    body = {**json.loads('{"\\ud800x": 1}'), "max_tokens": 3, **BASE[kind]}
    assert _parse(kind, **body).max_tokens == 3
    with pytest.raises(RequestError) as info:
        _parse(kind, **{**body, "max_tokens": -1})
    assert info.value.param == "max_tokens"
    with pytest.raises(RequestError) as info:
        strict().parse(body, kind)
    assert info.value.status == 400 and info.value.param == "\\ud800x"


def test_response_objects_keep_their_key_order_and_refuse_fields_their_model_lacks():
    """router/render.py writes every object by its model (router/openai_models.py): the keys
    in the order clients have seen (written out here by hand), a field given out of order put
    in its place, a field the model lacks or a required one left out refused."""
    from router.openai_models import ChatChunkChoice, Usage
    from router.render import _object

    envelope = ["id", "object", "created", "model", "system_fingerprint", "choices"]
    lps = [Logprob(65, "A", -0.5, ((65, "A", -0.5),))]
    comp = _parse("completion", logprobs=1, return_token_ids=True, sparse_attention={"alpha": 0.2})
    timing = {"cached_tokens": 1, "sparse_attention": {"alpha": 0.2, "dense": False, "density": 0.5}}
    whole = completion_response(comp, Completion("A", [65], "stop", timing, {"prefill": "p0"}, lps))
    assert list(whole) == envelope + ["usage", "timing", "routing"]
    assert list(whole["choices"][0]) == ["index", "text", "finish_reason", "logprobs", "token_ids", "prompt_token_ids"]
    assert list(whole["choices"][0]["logprobs"]) == ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    assert list(whole["usage"]) == ["prompt_tokens", "completion_tokens", "total_tokens", "sparse_attention",
                                    "prompt_tokens_details"]
    chat = _parse("chat", logprobs=True, top_logprobs=1, return_token_ids=True)
    chunk = stream_chunk(chat, "A", [65], "stop", first=True, logprobs=lps)
    assert list(chunk) == envelope
    assert list(chunk["choices"][0]) == ["index", "delta", "finish_reason", "logprobs", "token_ids"]
    assert list(chunk["choices"][0]["delta"]) == ["role", "content"]
    assert list(chunk["choices"][0]["logprobs"]) == ["content", "refusal"]
    assert list(chunk["choices"][0]["logprobs"]["content"][0]) == ["token", "logprob", "bytes", "top_logprobs"]
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    called = _parse("chat", tools=tools)
    reply = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    streamed = tool_stream_chunks(called, ToolChoiceStream(called), reply, [1], "stop", first=True)
    call = next(c["choices"][0]["delta"]["tool_calls"][0] for c in streamed if "tool_calls" in c["choices"][0]["delta"])
    assert list(call) == ["index", "id", "type", "function"] and list(call["function"]) == ["name", "arguments"]
    message = completion_response(called, Completion(reply, [1], "stop", {}))["choices"][0]["message"]
    assert list(message) == ["role", "content", "tool_calls"] and list(message["tool_calls"][0]) == ["id", "type",
                                                                                                    "function"]
    assert list(usage_chunk(chat, usage(3, 1))) == envelope + ["usage"]

    written = _object(Usage, total_tokens=3, completion_tokens=1, prompt_tokens=2)
    assert list(written) == ["prompt_tokens", "completion_tokens", "total_tokens"]
    with pytest.raises(ValueError, match="Usage"):
        _object(Usage, prompt_tokens=2, completion_tokens=1, total_tokens=3, cached_tokens=1)  # not a field of it
    with pytest.raises(ValueError, match="ChatChunkChoice"):
        _object(ChatChunkChoice, index=0, delta={}, logprobs=None)  # finish_reason is required
