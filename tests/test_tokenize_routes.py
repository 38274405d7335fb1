"""vLLM's /tokenize and /detokenize (router/tokenize.py), driven without a service."""

from __future__ import annotations

import random

import pytest

from model_executor.tokenizer import ByteTokenizer
from serving.errors import RequestError
from router.parsing import RequestParser
from router.tokenize import detokenize, tokenize
from tests.test_tokenizer_export import random_text

BOS, SYSTEM, USER, ASSISTANT, END = 256, 259, 260, 261, 262


def parser() -> RequestParser:
    return RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=8)


def test_prompt_tokens_count_and_round_trip():
    rng = random.Random(5)
    for _ in range(20):
        text = random_text(rng, rng.randint(1, 120))  # longer than max_model_len too: still counted
        raw = list(text.encode("utf-8"))
        out = tokenize(parser(), {"model": "m", "prompt": text})
        assert out == {"count": len(raw) + 1, "max_model_len": 64, "tokens": [BOS, *raw]}
        plain = tokenize(parser(), {"prompt": text, "add_special_tokens": False})
        assert plain["tokens"] == raw
        assert detokenize(parser(), {"model": "m", "tokens": plain["tokens"]}) == {"prompt": text}
    assert detokenize(parser(), {"tokens": [BOS, 104, 105, 257]}) == {"prompt": "<|bos|>hi<|eos|>"}
    assert detokenize(parser(), {"tokens": []}) == {"prompt": ""}


def test_messages_render_as_the_chat_prompt():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hé"}]
    body = {"model": "m", "messages": messages}
    turn = [BOS, SYSTEM, ord("s"), END, USER, ord("h"), 0xC3, 0xA9, END]
    assert tokenize(parser(), body) == {"count": 10, "max_model_len": 64, "tokens": turn + [ASSISTANT]}
    assert tokenize(parser(), {**body, "add_generation_prompt": False})["tokens"] == turn
    assert tokenize(parser(), {**body, "add_special_tokens": True})["tokens"] == [BOS, *turn, ASSISTANT]
    assert tokenize(parser(), {**body, "add_generation_prompt": True})["tokens"] == \
        list(parser().parse(body, "chat").prompt_token_ids)  # what a chat completion runs
    strs = tokenize(parser(), {**body, "return_token_strs": True})["token_strs"]
    assert strs[:4] == ["<|bos|>", "<|system|>", "s", "<|end|>"] and strs[-1] == "<|assistant|>"


@pytest.mark.parametrize("body, param", [
    ({"prompt": 3}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
    ({"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": None}, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": {}}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "prompt": "a"}, "prompt"),
])
def test_tokenize_bad_input_names_the_field(body, param):
    with pytest.raises(RequestError) as info:
        tokenize(parser(), body)
    assert info.value.status == 400 and info.value.param == param and param in info.value.message


@pytest.mark.parametrize("body, param", [
    ({"tokens": [1, 264]}, "tokens"),
    ({"tokens": [-1]}, "tokens"),
    ({"tokens": [True]}, "tokens"),
    ({"tokens": ["a"]}, "tokens"),
    ({"tokens": "ab"}, "tokens"),
    ({}, "tokens"),
    ({"tokens": [1], "prompt": "a"}, "prompt"),
])
def test_detokenize_bad_input_names_the_field(body, param):
    with pytest.raises(RequestError) as info:
        detokenize(parser(), body)
    assert info.value.status == 400 and info.value.param == param and param in info.value.message


def test_other_model_is_404_and_body_must_be_an_object():
    for call, body in ((tokenize, {"model": "x", "prompt": "a"}), (detokenize, {"model": "x", "tokens": [1]})):
        with pytest.raises(RequestError) as info:
            call(parser(), body)
        assert info.value.status == 404 and info.value.param == "model"
        with pytest.raises(RequestError) as info:
            call(parser(), ["a"])
        assert info.value.status == 400 and info.value.param == "body"
