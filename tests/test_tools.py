"""Tool calling (model_executor/tools.py): request checks, template support, calls forced by a
grammar on the tiny model and parsed back (validated with jsonschema against each tool's
parameters), and the parsers on hand-written replies of each format."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from model_executor.grammar import compile_guide
from model_executor.runner import PrefillItem
from model_executor.tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer
from model_executor.tools import (
    apply_chat_template_with_tools,
    chat_template_supports_tools,
    extract_tool_calls,
    parse_tool_calls,
    require_tool_support,
    tools_to_guided,
    validate_tools,
)

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]},
}, "required": ["city", "days", "unit"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "exact": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
}, "required": ["id", "exact", "tags"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER,
                                      "strict": True}},
    {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: an empty object
]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP, "ping": {"type": "object", "properties": {},
                                                               "additionalProperties": False}}


def _generate(tiny, guided, prompt, *, seed, max_tokens=200):
    """Sampled decode under ``guided``: from the tiny model when ``tiny`` is given, else from
    fresh random logits (the grammar alone decides validity; this keeps the test fast)."""
    tok = ByteTokenizer() if tiny is None else tiny[0].tokenizer
    guide = compile_guide(guided, tok)
    gen = torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt)
    if tiny is not None:
        runner = tiny[1]
        runner.ensure_capacity("t", len(ids) + max_tokens + 1)
    out: list[int] = []
    try:
        logits = runner.prefill([PrefillItem("t", ids)])[0] if tiny else torch.randn(264, generator=gen) * 2
        for _ in range(max_tokens):
            logits = logits.clone()
            logits[list(tok.stop_token_ids)] += 4.0  # parallel calls end sooner
            guide.fill_mask(logits)
            t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            guide.accept(t)
            out.append(t)
            if guide.is_terminated():
                break
            logits = runner.decode(["t"], [t])[0] if tiny else torch.randn(264, generator=gen) * 2
    finally:
        if tiny is not None:
            runner.pool.release("t")
    assert guide.is_terminated()
    return tok.decode(out)


def _check_calls(calls, names):
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def test_required_tool_call_from_the_tiny_model(tiny_runner):
    guided = tools_to_guided(TOOLS, "required", model_type="qwen2")
    content, calls = extract_tool_calls(_generate(tiny_runner, guided, "call a tool", seed=60), "qwen2")
    assert content is None
    _check_calls(calls, set(SCHEMAS))


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_required_tool_calls_are_forced_and_parse(model_type):
    guided = tools_to_guided(TOOLS, "required", model_type=model_type)
    seen = set()
    for seed in (61, 62, 63, 64, 65, 66):
        text = _generate(None, guided, "call a tool", seed=seed)
        content, calls = extract_tool_calls(text, model_type)
        assert content is None, text
        _check_calls(calls, set(SCHEMAS))
        seen.update(c["function"]["name"] for c in calls)
    assert len(seen) >= 2  # the grammar leaves the choice of tool to the model


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_named_tool_choice_forces_that_function(model_type):
    guided = tools_to_guided(TOOLS, {"type": "function", "function": {"name": "lookup"}}, model_type=model_type)
    for seed in (71, 72, 73):
        calls = parse_tool_calls(_generate(None, guided, "look it up", seed=seed), model_type)
        assert len(calls) == 1
        _check_calls(calls, {"lookup"})


def test_free_choices_give_no_grammar():
    for choice in (None, "auto", "none"):
        assert tools_to_guided(TOOLS, choice, model_type="qwen2") is None


def test_single_call_without_parallel_tool_calls():
    guided = tools_to_guided(TOOLS, "required", model_type="qwen2", parallel_tool_calls=False)
    guide = compile_guide(guided, ByteTokenizer())
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for b in call.encode():
        guide.accept(b)
    with pytest.raises(ValueError, match="token_id"):
        guide.accept(ord("\n"))  # a second call would start here
    guide.accept(ByteTokenizer().eos_token_id)


BAD_TOOLS = [
    ((None, None), "tools: expected a non-empty list"),
    (([], None), "tools: expected a non-empty list"),
    ((["f"], None), r"tools\[0\]: expected an object"),
    (([{"type": "retrieval"}], None), r"tools\[0\].type"),
    (([{"type": "function"}], None), r"tools\[0\].function: expected an object"),
    (([{"type": "function", "function": {"name": "a b"}}], None), r"tools\[0\].function.name"),
    (([{"type": "function", "function": {"name": "x" * 65}}], None), r"tools\[0\].function.name"),
    (([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}], None),
     r"tools\[1\].function.name: 'f' names two tools"),
    (([{"type": "function", "function": {"name": "f", "parameters": []}}], None), r"tools\[0\].function.parameters"),
    (([{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}], None),
     r"tools\[0\].function.parameters: Invalid type"),
    (([{"type": "function", "function": {"name": "f", "strict": True,
                                          "parameters": {"type": "array", "uniqueItems": True}}}], None),
     r"tools\[0\].function.parameters: Unimplemented"),
    (([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None), r"tools\[0\].function.strict"),
    (([{"type": "function", "function": {"name": "f", "description": 3}}], None), r"tools\[0\].function.description"),
    (([{"type": "function", "function": {"name": "f", "description": "\ud800"}}], None),
     r"tools\[0\].function.description: not valid Unicode"),
    (([{"type": "function", "function": {"name": "f", "extra": 1}}], None), r"tools\[0\].function.extra"),
    (([{"type": "function", "function": {"name": "f"}, "extra": 1}], None), r"tools\[0\].extra"),
    (([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], None), "tools: 129 tools"),
    ((TOOLS, "always"), "tool_choice"),
    ((TOOLS, {"type": "function"}), "tool_choice.function.name"),
    ((TOOLS, {"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    ((TOOLS, {"type": "tool"}), "tool_choice"),
    ((TOOLS, 3), "tool_choice"),
]


@pytest.mark.parametrize("args,match", BAD_TOOLS, ids=[m for _, m in BAD_TOOLS])
def test_bad_tools_name_the_field(args, match):
    with pytest.raises(ValueError, match=f"^{match}"):
        validate_tools(*args)
    with pytest.raises(ValueError, match=f"^{match}"):
        tools_to_guided(*args, model_type="qwen2")


def test_bad_parallel_flag_and_model_type():
    with pytest.raises(ValueError, match="^parallel_tool_calls"):
        validate_tools(TOOLS, "auto", parallel_tool_calls="yes")
    with pytest.raises(ValueError, match="^model_type"):
        tools_to_guided(TOOLS, "required", model_type="mistral")
    with pytest.raises(ValueError, match="^model_type"):
        parse_tool_calls("{}", "gpt2")
    with pytest.raises(ValueError, match="^text"):
        parse_tool_calls(b"{}", "llama")


# -- templates ----------------------------------------------------------------------------------
TEMPLATE_WITH_TOOLS = (
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEMPLATE_WITHOUT = "{% for m in messages %}{{ m.content }}{% endfor %}"


def _hf(template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", bos_token="<s>")
    fast.add_special_tokens({"eos_token": "</s>", "bos_token": "<s>"})
    fast.chat_template = template
    return HFTokenizer(fast)


def test_template_support_and_the_400_for_models_without():
    with_tools, without = _hf(TEMPLATE_WITH_TOOLS), _hf(TEMPLATE_WITHOUT)
    assert chat_template_supports_tools(with_tools)
    assert not chat_template_supports_tools(without)
    assert not chat_template_supports_tools(_hf(None))
    assert chat_template_supports_tools(ByteTokenizer())  # the built-in tiny model: Hermes
    assert not chat_template_supports_tools(IdTokenizer(512))  # the structured models: no chat at all
    assert require_tool_support(with_tools, "qwen2") == "hermes"
    assert require_tool_support(with_tools, "llama") == "llama3_json"
    assert require_tool_support(ByteTokenizer(), "llama") == "hermes"  # the declared format wins
    for tok in (without, IdTokenizer(512)):
        with pytest.raises(ValueError, match="^tools: this model's chat template does not take tools"):
            require_tool_support(tok, "llama")
    with pytest.raises(ValueError, match="^tools: no tool-call parser"):
        require_tool_support(with_tools, "mistral")
    assert chat_template_supports_tools(_hf(None).__class__(_named_templates()))


def _named_templates():
    tok = _hf(None).hf_tokenizer
    tok.chat_template = {"default": TEMPLATE_WITHOUT, "tool_use": TEMPLATE_WITH_TOOLS}
    return tok


def test_tools_reach_the_prompt_through_the_template():
    tok = _hf(TEMPLATE_WITH_TOOLS)
    ids = apply_chat_template_with_tools(tok, [{"role": "user", "content": "weather?"}], TOOLS)
    text = tok.decode(ids)
    assert text == "<|system|>tools: get_weather lookup ping <|end|><|user|>weather?<|end|><|assistant|>"
    with pytest.raises(ValueError, match="^tools"):
        apply_chat_template_with_tools(_hf(TEMPLATE_WITHOUT), [{"role": "user", "content": "x"}], TOOLS)
    raising = _hf("{% if tools %}{{ raise_exception('no system role') }}{% endif %}")
    with pytest.raises(ValueError, match="^messages: the chat template rejected them: no system role"):
        apply_chat_template_with_tools(raising, [{"role": "user", "content": "x"}], TOOLS)


# -- parsers on hand-written replies --------------------------------------------------------------
def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"id\\": 3}"}</tool_call>')
    content, calls = extract_tool_calls(text, "qwen2")
    assert content == "Let me check."
    assert _names_args(calls) == [("get_weather", {"city": "Oslo"}), ("lookup", {"id": 3})]
    # a malformed call stays in the content; an unterminated last one (cut by a stop) still parses
    bad = "<tool_call>{not json}</tool_call>"
    assert extract_tool_calls(bad, "qwen3") == (bad, None)
    assert extract_tool_calls("hello", "qwen3") == ("hello", None)
    assert extract_tool_calls("", "qwen3") == (None, None)
    assert _names_args(parse_tool_calls('<tool_call>\n{"name": "ping", "arguments": {}}\n', "qwen2")) == [("ping", {})]
    assert parse_tool_calls('<tool_call>{"name": "", "arguments": {}}</tool_call>', "qwen2") is None
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "qwen2") is None
    assert parse_tool_calls('<tool_call>["f"]</tool_call>', "qwen2") is None


def test_llama_parser():
    one = '{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}'
    assert extract_tool_calls(one, "llama")[0] is None
    assert _names_args(parse_tool_calls(one, "llama")) == [("get_weather", {"city": "Lima", "days": 2})]
    two = '<|python_tag|>{"name": "ping", "parameters": {}}; {"name": "lookup", "arguments": {"id": 1}}'
    assert _names_args(parse_tool_calls(two, "llama")) == [("ping", {}), ("lookup", {"id": 1})]
    for text in ("It is sunny.", '{"name": "f", "parameters": {}} and more', '{"city": "Oslo"}', "[1, 2]",
                 '[get_weather(city="Oslo")]', ""):
        content, calls = extract_tool_calls(text, "llama")
        assert calls is None and content == (text or None)
