"""The OpenAI API as the official ``openai`` client sends it, against a loopback service:
ids and metadata, logprobs (against the reference model's log_softmax), sampling controls
(against a reference written here), the developer role, validation, and gRPC parity."""

from __future__ import annotations

import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
grpc = pytest.importorskip("grpc")
torch = pytest.importorskip("torch")

from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import prompt_of, replica_stats, wait_pools_idle  # noqa: E402

MODEL = "builtin:tiny"
APP = "api"
# dense by default; a request may ask for sparse prefill at any length (dense_below 0)
CONFIG = ServiceConfig.from_dict({"model": "builtin:tiny", "torch_threads": 1, "prefill_kv_pages": 64, "decode_kv_pages": 64,
                                  "batch_wait_ms": 1.0, "alpha": 0.0, "dense_below": 0, "block_size": 64,
                                  "sink_tokens": 64, "window_tokens": 64})
SMALL = {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}


SERVE_APPS = {APP: {"config": CONFIG, "prefill": {**SMALL, "num_replicas": 1}, "decode": {**SMALL, "num_replicas": 1},
                    "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}


@pytest.fixture(scope="module")
def service(service):
    """The shared service (tests/conftest.py) with the official client on this module's app."""
    client = openai.OpenAI(base_url=f"{service['base']}/{APP}/v1", api_key="unused", timeout=120.0, max_retries=0)
    yield {**service, "client": client, "http_base": f"{service['base']}/{APP}"}
    client.close()


@pytest.fixture(scope="module")
def reference():
    """The single-process reference: the same tiny model run whole (HF sdpa attention, no pool)."""
    from model_executor import build_tiny_model

    model = build_tiny_model(seed=CONFIG.model.seed).model

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].double()

    return logits


def _stub(channel):
    from router.proto import flashprefill_pb2_grpc as pbg

    return pbg.FlashPrefillStub(channel)


META = (("application", APP),)


def _penalized(row: torch.Tensor, out: list[int], *, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """OpenAI's penalties and bias, token by token (the reference for the service)."""
    row = row.clone()
    for t, b in (bias or {}).items():
        row[t] += b
    for t in set(out):
        if repetition != 1:
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        row[t] -= frequency * out.count(t) + presence
    return row


def _greedy_reference(reference, prompt, n, **controls) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(_penalized(reference(prompt + out), out, **controls).argmax()))
    return out


# ----------------------------------------------------------------------------- ids, metadata
def test_ids_fingerprint_and_usage(service):
    client = service["client"]
    c = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.id.startswith("cmpl-") and c.object == "text_completion"
    assert c.system_fingerprint == "fp_flashprefill"
    assert c.usage.prompt_tokens == 6 and c.usage.completion_tokens == 3  # <|bos|> + 5 bytes
    assert c.usage.prompt_tokens_details.cached_tokens == 0
    ch = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                        temperature=0)
    assert ch.id.startswith("chatcmpl-") and ch.system_fingerprint == "fp_flashprefill"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, stream=True))
    assert all(k.id.startswith("chatcmpl-") and k.system_fingerprint == "fp_flashprefill" for k in chunks)

    from router.proto import flashprefill_pb2 as pb

    resp = _stub(service["channel"]).Generate(pb.GenerateRequest(model=MODEL, prompt="hello", max_tokens=2),
                                              metadata=META, timeout=120)
    assert resp.system_fingerprint == "fp_flashprefill"
    assert resp.usage.HasField("prompt_tokens_details")
    assert resp.usage.prompt_tokens_details.cached_tokens == resp.usage.cached_tokens


# ----------------------------------------------------------------------------- logprobs
def test_completion_logprobs_equal_the_reference_log_softmax(service, reference):
    client = service["client"]
    prompt = prompt_of(23, seed=4)
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                                  extra_body={"return_token_ids": True})
    choice = c.choices[0]
    out = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(out) == 6
    for i, tok in enumerate(out):
        ref = torch.log_softmax(reference(prompt + out[:i]), -1)
        assert tok == int(ref.argmax())  # greedy
        assert lp.token_logprobs[i] == pytest.approx(float(ref[tok]), abs=2e-3)
        want_top = sorted(ref.topk(5).values.tolist(), reverse=True)
        got_top = sorted(lp.top_logprobs[i].values(), reverse=True)
        # byte tokens that decode to the same string collapse into one key
        for v in got_top:
            assert any(abs(v - w) < 2e-3 for w in want_top)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(out))]

    # sampled at a temperature: logprobs of the tempered distribution the draw came from
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.5, seed=7, logprobs=0,
                                  extra_body={"return_token_ids": True})
    out = c.choices[0].model_extra["token_ids"]
    for i, tok in enumerate(out):
        ref = torch.log_softmax(reference(prompt + out[:i]) / 0.5, -1)
        assert c.choices[0].logprobs.token_logprobs[i] == pytest.approx(float(ref[tok]), abs=2e-3)
        assert c.choices[0].logprobs.top_logprobs[i] == {}
    wait_pools_idle(APP)


def test_chat_logprobs_streaming_and_not_and_grpc(service, reference):
    client = service["client"]
    messages = [{"role": "user", "content": "count: one two"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    # bytes: the token's own (a piece of a multi-byte character is raw bytes, its text U+FFFD)
    assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content)
    assert all(len(e.bytes) == 1 or e.token.startswith("<|") for e in content)  # byte tokens and specials
    streamed = [e for k in client.chat.completions.create(**kwargs, stream=True) if k.choices
                for e in (k.choices[0].logprobs.content if k.choices[0].logprobs else [])]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]

    from model_executor.tokenizer import ByteTokenizer
    from router.proto import flashprefill_pb2 as pb

    ids = ByteTokenizer().apply_chat_template(messages, add_generation_prompt=True)
    req = pb.GenerateRequest(model=MODEL, messages=[pb.ChatMessage(**m) for m in messages], max_tokens=5,
                             temperature=0.0, logprobs=3)
    resp = _stub(service["channel"]).Generate(req, metadata=META, timeout=120)
    out = list(resp.token_ids)
    assert [e.token_id for e in resp.logprobs] == out
    for i, e in enumerate(resp.logprobs):
        ref = torch.log_softmax(reference(ids + out[:i]), -1)
        assert e.logprob == pytest.approx(float(ref[out[i]]), abs=2e-3)
        assert [t.token_id for t in e.top_logprobs] == ref.topk(3).indices.tolist()
    msgs = list(_stub(service["channel"]).GenerateStream(req, metadata=META, timeout=120))
    assert [e.token_id for m in msgs for e in m.logprobs] == out
    wait_pools_idle(APP)


# ----------------------------------------------------------------------------- sampling controls
@pytest.mark.parametrize("controls", [
    {"frequency": 1.5},
    {"presence": 2.0, "bias": {66: 3.0}},
    {"repetition": 3.0, "frequency": 0.5},
])
def test_penalties_and_bias_match_the_reference(service, reference, controls):
    prompt = prompt_of(17, seed=3)  # its greedy answer repeats a token: penalties matter
    want = _greedy_reference(reference, prompt, 12, **controls)
    body = {"return_token_ids": True, "ignore_eos": True}
    if "repetition" in controls:
        body["repetition_penalty"] = controls["repetition"]
    c = service["client"].completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
        presence_penalty=controls.get("presence", 0.0), frequency_penalty=controls.get("frequency", 0.0),
        logit_bias={str(k): v for k, v in controls.get("bias", {}).items()}, extra_body=body)
    assert c.choices[0].model_extra["token_ids"] == want
    assert want != _greedy_reference(reference, prompt, 12)  # the controls changed the answer


def test_logit_bias_min_tokens_stop_token_ids_and_ignore_eos(service, reference):
    client = service["client"]
    prompt = prompt_of(11, seed=2)
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.9, seed=3,
                                  logit_bias={"65": 100})
    assert c.choices[0].text == "AAAAA" and c.choices[0].finish_reason == "length"

    first = _greedy_reference(reference, prompt, 3)
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [first[0]], "return_token_ids": True})
    assert c.choices[0].model_extra["token_ids"] == [first[0]] and c.choices[0].finish_reason == "stop"
    # min_tokens: the stop token is banned for the first 3 tokens, so the answer differs there
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [first[0]], "min_tokens": 3, "return_token_ids": True})
    got = c.choices[0].model_extra["token_ids"]
    assert first[0] not in got[:3] and len(got) >= 3
    banned = reference(prompt).clone()
    banned[first[0]] = -math.inf
    assert got[0] == int(banned.argmax())

    # ignore_eos: the chat template's end-of-turn never ends the answer; max_tokens does
    msgs = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                       logit_bias={"262": 100}, extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 12
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                       logit_bias={"262": 100})
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens == 1
    wait_pools_idle(APP)


def test_developer_role_is_rendered_as_system(service):
    client = service["client"]
    answers = []
    for role in ("developer", "system"):
        c = client.chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
        answers.append((c.choices[0].model_extra["prompt_token_ids"], c.choices[0].message.content))
    assert answers[0] == answers[1]


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kind, kwargs, param", [
    ("completion", {"logprobs": 6}, "logprobs"),
    ("completion", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completion", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completion", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completion", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completion", {"extra_body": {"min_tokens": 9}}, "min_tokens"),
    ("completion", {"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ("completion", {"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
    ("completion", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
])
def test_bad_controls_answer_400_naming_the_field(service, kind, kwargs, param):
    client = service["client"]
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "completion":
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, **kwargs)
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_bad_controls_over_grpc_are_invalid_argument(service):
    from router.proto import flashprefill_pb2 as pb

    stub = _stub(service["channel"])
    cases = [({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"presence_penalty": 3.0}, "presence_penalty"),
             ({"logprobs": 6}, "logprobs"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
             ({"min_tokens": 50}, "min_tokens")]
    for fields, name in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, **fields), metadata=META, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith(name)
    chat = [pb.ChatMessage(role="user", content="hi")]
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(model=MODEL, messages=chat, logprobs=21), metadata=META, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("logprobs")


# ----------------------------------------------------------------------------- n, best_of, prompt lists
def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_n_greedy_equals_n1_and_sampled_choices_differ(service):
    client = service["client"]
    prompt = prompt_of(13, seed=6)
    extra = {"return_token_ids": True, "ignore_eos": True}
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    calls = lambda: [sum(s["completed"] for s in replica_stats(APP, d)) for d in ("PrefillServer", "DecodeServer")]  # noqa: E731
    before = calls()
    many = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3, extra_body=extra)
    assert [b - a for a, b in zip(before, calls())] == [1, 1]  # one prefill, one decode stream for the group
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(_ids(c) == _ids(one.choices[0]) for c in many.choices)
    assert many.usage.completion_tokens == 18 and many.usage.prompt_tokens == 13

    seeded1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5,
                                        extra_body=extra)
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3,
                                        extra_body=extra)
    answers = [tuple(_ids(c)) for c in sampled.choices]
    assert len(set(answers)) == 3  # distinct seeds (5, 6, 7)
    assert list(answers[0]) == _ids(seeded1.choices[0])  # choice 0 is the n=1 answer

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3,
                                            stream=True, extra_body=extra))
    streamed = {i: [t for k in chunks for c in k.choices if c.index == i for t in c.model_extra["token_ids"]]
                for i in range(3)}
    assert [tuple(streamed[i]) for i in range(3)] == answers
    finals = [c for k in chunks for c in k.choices if c.finish_reason is not None]
    assert sorted(c.index for c in finals) == [0, 1, 2] and all(c.finish_reason == "length" for c in finals)
    wait_pools_idle(APP)


def test_a_stop_string_ends_one_choice_of_a_group_alone(service):
    """A stop string found at the ingress ends that choice (its pages freed on the decode replica);
    the others run on. Reference: each choice's answer without the stop, cut at its first match."""
    client = service["client"]
    prompt = prompt_of(17, seed=4)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=21, n=3,
                  extra_body={"ignore_eos": True})
    free = client.completions.create(**kwargs)
    texts = [c.text for c in free.choices]
    stop = texts[0][3:5]  # found in choice 0 early; the others end where (if) they contain it
    assert stop
    stopped = client.completions.create(**kwargs, stop=[stop])
    for c, t in zip(stopped.choices, texts):
        cut = t.find(stop)
        assert (c.text, c.finish_reason) == ((t[:cut], "stop") if cut >= 0 else (t, "length"))
    wait_pools_idle(APP)


def test_prompt_lists_with_n_and_chat_n(service, reference):
    client = service["client"]
    prompts = ["abc", prompt_of(9, seed=1)]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    from model_executor.tokenizer import ByteTokenizer

    ids = [ByteTokenizer().encode("abc"), prompts[1]]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        p = ids[c.index // 2]
        assert c.model_extra["prompt_token_ids"] == p
        assert _ids(c) == _greedy_reference(reference, p, 4)
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and r.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0.8, seed=1, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)


def test_best_of_returns_the_highest_logprob_choices(service):
    client = service["client"]
    prompt = prompt_of(10, seed=8)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=11,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    every = client.completions.create(**kwargs, n=4, logprobs=0)
    score = {tuple(_ids(c)): sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(**kwargs, n=2, best_of=4)
    want = sorted(score, key=lambda k: -score[k])[:2]
    assert [tuple(_ids(c)) for c in best.choices] == want and [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage.completion_tokens == 20  # all four were generated
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs, n=3, best_of=2)
    assert info.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs, n=1, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of"


def test_disconnect_during_n_stream_frees_every_page(service):
    import httpx

    base = str(service["client"].base_url).rstrip("/")
    body = {"model": MODEL, "prompt": prompt_of(30, seed=3), "max_tokens": 60, "n": 3, "stream": True,
            "ignore_eos": True, "temperature": 1.0}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{base}/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then the client goes away
    wait_pools_idle(APP)


# ----------------------------------------------------------------------------- echo, prompt logprobs
def test_echo_with_prompt_logprobs_as_loglikelihood_evaluations_send_it(service, reference):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs, max_tokens 0 (or 1)."""
    from model_executor import build_tiny_model

    client = service["client"]
    prompt = prompt_of(21, seed=12)
    model = build_tiny_model(seed=CONFIG.model.seed).model
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(prompt)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=2e-3)
        assert len(lp.top_logprobs[pos]) == 1
    from model_executor.tokenizer import ByteTokenizer

    assert r.choices[0].text == ByteTokenizer().decode(prompt)

    # with a generated token after the prompt, streaming too; a list of two prompts at once
    r1 = client.completions.create(model=MODEL, prompt=[prompt, prompt[:10]], max_tokens=1, echo=True, logprobs=0,
                                   temperature=0)
    assert [len(c.logprobs.token_logprobs) for c in r1.choices] == [len(prompt) + 1, 11]
    assert r1.choices[0].logprobs.token_logprobs[:-1] == pytest.approx(lp.token_logprobs, abs=1e-5)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for k in chunks for c in k.choices if c.logprobs for v in c.logprobs.token_logprobs]
    assert len(streamed) == len(prompt) + 3 and streamed[:len(prompt)][1:] == pytest.approx(lp.token_logprobs[1:],
                                                                                          abs=1e-5)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    wait_pools_idle(APP)


def test_generate_until_as_evaluations_send_it(service, reference):
    """lm-eval's generate_until: a list of prompts, greedy, stop strings, max_tokens."""
    client = service["client"]
    prompts = ["Question: 1+1?\nAnswer:", "Question: 2+2?\nAnswer:"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stop=["\n\n", "Q"],
                                  seed=1234)
    assert [c.index for c in r.choices] == [0, 1]
    from model_executor.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for c, p in zip(r.choices, prompts):
        ids = _greedy_reference(reference, tok.encode(p), 8)
        ends = [i for i, t in enumerate(ids) if t in tok.stop_token_ids]
        want = tok.decode(ids[: ends[0] + 1] if ends else ids)
        for s in ("\n\n", "Q"):
            want = want.split(s)[0]
        assert c.text == want


# ----------------------------------------------------------------------------- lm-eval
class _ByteTokenizerForLmEval:
    """lm-eval's Hugging Face tokenizer calls, answered by the built-in byte tokenizer."""

    def __init__(self):
        from model_executor.tokenizer import ByteTokenizer

        self.tok = ByteTokenizer()
        self.eos_token_id, self.bos_token_id, self.eos_token = self.tok.eos_token_id, self.tok.bos_token_id, "<|eos|>"

    def __call__(self, text, add_special_tokens=False, **_):
        import types

        enc = lambda s: self.tok.encode(s, add_bos=add_special_tokens)  # noqa: E731
        return types.SimpleNamespace(input_ids=enc(text) if isinstance(text, str) else [enc(s) for s in text])

    def decode(self, ids, **_):
        return self.tok.decode(ids)

    def batch_decode(self, seqs, **_):
        return [self.decode(s) for s in seqs]


LL_DOCS = [{"question": "Colour of the sky:", "choices": ["blue", "green", "red"], "gold": 0},
           {"question": "2 + 2 =", "choices": ["4", "five"], "gold": 1},
           {"question": "The cat sat on the", "choices": ["mat", "moon", "sofa"], "gold": 2}]
GEN_DOCS = [{"question": "Say A:", "answer": "A"}, {"question": "abc", "answer": "def"}]


def test_lm_eval_local_completions_scores_a_loglikelihood_and_a_generate_until_task(service, reference, tmp_path,
                                                                                   monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    import json

    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name, docs in (("ll", LL_DOCS), ("gen", GEN_DOCS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {{path}}\ntest_split: test\n"
    (tmp_path / "ll.yaml").write_text(
        "task: fp_tiny_ll\n" + common.format(path=tmp_path / "ll.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text(
        "task: fp_tiny_gen\n" + common.format(path=tmp_path / "gen.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")
    base = str(service["client"].base_url).rstrip("/")
    lm = LocalCompletionsAPI(model=MODEL, base_url=f"{base}/completions", tokenizer_backend="none",
                             add_bos_token=True, max_length=512, max_retries=1)
    lm.tokenizer, lm.tokenizer_backend, lm.tokenized_requests = _ByteTokenizerForLmEval(), "huggingface", True
    out = lm_eval.simple_evaluate(model=lm, tasks=["fp_tiny_ll", "fp_tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), limit=None)

    # the expected scores, from the reference model run whole
    from model_executor.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    hits = 0
    for d in LL_DOCS:
        ctx = tok.encode(d["question"])
        scores = []
        for c in d["choices"]:
            cont = tok.encode(" " + c, add_bos=False)
            scores.append(sum(float(torch.log_softmax(reference(ctx + cont[:i]), -1)[t]) for i, t in enumerate(cont)))
        hits += max(range(len(scores)), key=scores.__getitem__) == d["gold"]
    assert out["results"]["fp_tiny_ll"]["acc,none"] == pytest.approx(hits / len(LL_DOCS))
    matches = 0
    for d in GEN_DOCS:
        ids = _greedy_reference(reference, tok.encode(d["question"]), 6)
        ends = [i for i, t in enumerate(ids) if t in tok.stop_token_ids]
        text = tok.decode(ids[: ends[0] + 1] if ends else ids).split("\n")[0]
        matches += text == d["answer"]
    assert out["results"]["fp_tiny_gen"]["exact_match,none"] == pytest.approx(matches / len(GEN_DOCS))
    wait_pools_idle(APP)


def test_grpc_echo_with_prompt_logprobs(service):
    from router.proto import flashprefill_pb2 as pb

    client, stub = service["client"], _stub(service["channel"])
    prompt = prompt_of(15, seed=5)
    http = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    req = pb.GenerateRequest(model=MODEL, prompt_token_ids=prompt, max_tokens=0, echo=True, logprobs=2,
                             temperature=0.0)
    resp = stub.Generate(req, metadata=META, timeout=120)
    assert resp.text == http.choices[0].text and list(resp.token_ids) == [] and resp.finish_reason == "length"
    assert [e.token_id for e in resp.prompt_logprobs] == prompt[1:]
    assert [e.logprob for e in resp.prompt_logprobs] == pytest.approx(http.choices[0].logprobs.token_logprobs[1:],
                                                                     abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in resp.prompt_logprobs)
    msgs = list(stub.GenerateStream(req, metadata=META, timeout=120))
    assert [e.token_id for m in msgs for e in m.prompt_logprobs] == prompt[1:]
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=0), metadata=META, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("max_tokens")


# ----------------------------------------------------------------------------- per-request sparsity
def _offline_prefill(prompt: list[int], alpha: float, **options) -> tuple[list[float], float | None]:
    """The single-process prefill engine at ``alpha`` (and the request's other sparse options),
    the oracle for a sparse request: its prompt logprobs and block density."""
    import dataclasses

    from model_executor import ModelRunner, SamplingParams, build_tiny_model
    from prefill_worker.engine import PrefillEngine, PrefillRequest
    from router.offline import make_pool

    tiny = build_tiny_model(seed=CONFIG.model.seed)
    pool = make_pool(tiny, num_pages=64, page_size=CONFIG.kv.page_size)
    config = dataclasses.replace(CONFIG.sparse_config, alpha=alpha, **options)
    runner = ModelRunner(tiny.model, pool, config, dense_below=0)
    res = PrefillEngine(runner).prefill([PrefillRequest("o", prompt, SamplingParams(temperature=0.0, prompt_logprobs=0))])
    return [e.logprob for e in res[0].prompt_logprobs[1:]], res[0].block_density


def test_per_request_sparse_attention_over_http_and_grpc(service):
    from router.proto import flashprefill_pb2 as pb

    client, stub = service["client"], _stub(service["channel"])
    prompt = [256] + list(range(7, 250)) + [5] * 10

    def echo(sparse):
        extra = {} if sparse is None else {"sparse_attention": sparse}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0,
                                      extra_body=extra)
        return r, r.choices[0].logprobs.token_logprobs[1:]

    plain, dense_lp = echo(None)
    assert "sparse_attention" not in plain.usage.model_extra
    forced_dense, lp = echo(False)
    assert lp == pytest.approx(dense_lp, abs=1e-5)
    assert forced_dense.usage.model_extra["sparse_attention"] == {"alpha": 0.0, "dense": True, "density": 1.0}
    # the service's safeguards keep this short prompt's last tiles dense: the request turns them off
    own = {"last_dense_tiles": 0, "energy_rule": "visible"}
    sparse, sparse_lp = echo({"alpha": 0.95, **own})
    want_lp, want_density = _offline_prefill(prompt, 0.95, **own)
    assert 0.0 < want_density < 1.0
    assert sparse.usage.model_extra["sparse_attention"] == {"alpha": 0.95, "dense": False, **own,
                                                            "density": pytest.approx(want_density, abs=1e-6)}
    guarded, _ = echo({"alpha": 0.95})  # the service's safeguards: more of the prompt dense
    assert guarded.usage.model_extra["sparse_attention"]["density"] > want_density
    assert sparse_lp == pytest.approx(want_lp, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(sparse_lp, dense_lp)) > 1e-2  # what sparsity costs, per request

    req = pb.GenerateRequest(model=MODEL, prompt_token_ids=prompt, max_tokens=0, echo=True, logprobs=0,
                             temperature=0.0, sparse_attention=pb.SparseAttention(alpha=0.95, **own))
    resp = stub.Generate(req, metadata=META, timeout=120)
    assert [e.logprob for e in resp.prompt_logprobs] == pytest.approx(sparse_lp, abs=1e-5)
    assert resp.usage.sparse_attention.dense is False
    assert resp.usage.sparse_attention.alpha == pytest.approx(0.95)
    assert resp.usage.sparse_attention.density == pytest.approx(want_density, abs=1e-6)
    assert (resp.usage.sparse_attention.last_dense_tiles, resp.usage.sparse_attention.energy_rule) == (0, "visible")
    for bad_value in ({"alpha": 2}, {"beta": 1}, 0.5):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"sparse_attention": bad_value})
        assert info.value.body["param"] == "sparse_attention"
    for sa in (pb.SparseAttention(alpha=1.5), pb.SparseAttention(dense=True, alpha=0.5),
               pb.SparseAttention(energy_rule="max")):
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=2, sparse_attention=sa),
                          metadata=META, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("sparse_attention")
    wait_pools_idle(APP)


def test_structured_output_through_response_format(service):
    """``response_format`` json_schema (strict) on chat, our ``choice`` extension on completions:
    every output parses and validates, under sampling with several seeds; a schema the grammar
    library cannot take is a 400 naming the field."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    client = service["client"]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
              "properties": {"name": {"type": "string", "enum": ["ab", "cd"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for seed in (3, 4, 5):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a thing"}],
                                           max_tokens=80, temperature=1.0, seed=seed, response_format=fmt)
        choice = r.choices[0]
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.finish_reason == "stop"
    for seed in (1, 2):
        r = client.completions.create(model=MODEL, prompt="yes or no?", max_tokens=10, temperature=1.0, seed=seed,
                                      extra_body={"response_format": {"type": "choice", "choices": ["yes", "no"]}})
        assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="free", max_tokens=3, temperature=0,
                                  extra_body={"response_format": {"type": "text"}})  # greedy: no sampled EOS
    assert r.choices[0].finish_reason == "length"  # text: unconstrained
    for bad_format, param in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
                               "response_format.json_schema.schema"),
                              ({"type": "yaml"}, "response_format.type"),
                              ({"type": "regex", "pattern": "("}, "response_format.pattern")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"response_format": bad_format})
        assert info.value.status_code == 400 and info.value.body["param"].startswith(param), info.value.body
    wait_pools_idle(APP)


# ----------------------------------------------------------------------------- tool calls
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the forecast for a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"type": "string", "enum": ["C", "F"]}}}}}
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "additionalProperties": False, "required": ["id", "exact"],
                                     "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "exact": {"type": "boolean"}}}}}


def _calls(message_calls):
    return [(c.function.name, c.function.arguments) for c in message_calls]


def test_tool_calls_with_the_openai_client(service):
    """``tool_choice`` required (one call) and named: the reply is a tool call whose arguments
    validate (jsonschema) against the tool's parameters; streaming with the same seed yields the
    same call, in ``delta.tool_calls`` chunks; the follow-up turn with the ``tool`` result is
    accepted and rendered into the prompt; bad tool fields are 400s naming them."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    client = service["client"]
    tools = [WEATHER_TOOL, LOOKUP_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "lookup"}}
    for seed, choice, parallel in ((1, "required", False), (2, "required", False), (3, named, None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        kwargs = dict(model=MODEL, messages=messages, tools=tools, tool_choice=choice, max_tokens=200,
                      temperature=1.0, seed=seed, **extra)
        r = client.chat.completions.create(**kwargs)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if choice is named:
            assert call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        # streamed: the same call (same seed), a whole call in one delta.tool_calls chunk
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        streamed = [tc for k in chunks for ch in k.choices for tc in (ch.delta.tool_calls or [])]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
            [(0, call.function.name, call.function.arguments)]
        assert streamed[0].id.startswith("call_") and streamed[0].type == "function"
        assert [ch.finish_reason for k in chunks for ch in k.choices if ch.finish_reason] == ["tool_calls"]
        assert not any(ch.delta.content for k in chunks for ch in k.choices)
    # n choices streamed: each choice's calls come in its own chunks (chunks of both interleave)
    kwargs = dict(model=MODEL, messages=messages, tools=tools, tool_choice=named, max_tokens=200, temperature=1.0,
                  seed=11, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for ch in whole.choices:
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        streamed = [(tc.function.name, tc.function.arguments) for k in chunks for c in k.choices
                    if c.index == ch.index for tc in (c.delta.tool_calls or [])]
        assert streamed == _calls(ch.message.tool_calls)
        jsonschema.validate(json.loads(streamed[0][1]), schemas["lookup"])
    # auto: free decoding (the random tiny model writes no call); the content streams as it comes
    # (several chunks before the finish), and it is the whole reply's content
    kwargs = dict(model=MODEL, messages=messages, tools=tools, max_tokens=40, temperature=1.0, seed=12)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert whole.message.tool_calls is None and whole.finish_reason in ("stop", "length")
    assert "".join(c.delta.content or "" for k in chunks for c in k.choices) == whole.message.content
    assert not any(c.delta.tool_calls for k in chunks for c in k.choices)
    assert [c.finish_reason for k in chunks for c in k.choices if c.finish_reason] == [whole.finish_reason]
    assert sum(1 for k in chunks for c in k.choices if c.delta.content and c.finish_reason is None) > 1
    # the follow-up turn: the assistant's message as the client got it, then the tool's result
    follow = messages + [r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "id 7: found"}]
    f = client.chat.completions.create(model=MODEL, messages=follow, tools=tools, max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert f.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = bytes(t for t in f.choices[0].model_extra["prompt_token_ids"] if t < 256).decode()
    assert prompt.endswith("<tool_response>\nid 7: found\n</tool_response>")
    assert f'{{"name": "lookup", "arguments": {call.function.arguments}}}' in prompt
    for kwargs, param in (({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
                          ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "tool_choice.function.name"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": tools, "response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **kwargs)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


# ----------------------------------------------------------------------------- gRPC: choices, prompt lists, formats
def _random_prompt(rng, n: int) -> list[int]:
    return [256] + [rng.randrange(256) for _ in range(n - 1)]  # <|bos|> + bytes


def _grpc_raw(channel, method: str):
    """The method with the request as bytes: for what a Python client cannot build."""
    return channel.unary_unary(f"/flashprefill.v1.FlashPrefill/{method}", request_serializer=None,
                               response_deserializer=None) if method == "Generate" else \
        channel.unary_stream(f"/flashprefill.v1.FlashPrefill/{method}", request_serializer=None,
                             response_deserializer=None)


def test_grpc_n_greedy_equals_the_single_answer_and_streams_carry_indices(service, reference):
    import random

    from router.proto import flashprefill_pb2 as pb

    stub = _stub(service["channel"])
    prompt = _random_prompt(random.Random(31), 12)
    want = _greedy_reference(reference, prompt, 5)
    base = dict(model=MODEL, prompt_token_ids=prompt, max_tokens=5, ignore_eos=True)
    one = stub.Generate(pb.GenerateRequest(**base, temperature=0), metadata=META, timeout=120)
    assert list(one.token_ids) == want and [c.index for c in one.choices] == [0]
    assert list(one.choices[0].token_ids) == want and one.choices[0].text == one.text
    two = stub.Generate(pb.GenerateRequest(**base, temperature=0, n=2), metadata=META, timeout=120)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(list(c.token_ids) == want and c.finish_reason == "length" for c in two.choices)
    assert list(two.token_ids) == want and two.text == two.choices[0].text  # choice 0 for old clients
    assert (two.usage.prompt_tokens, two.usage.completion_tokens, two.usage.total_tokens) == (12, 10, 22)

    # sampled with a seed: choice j draws with seed + j, streamed or not
    sampled = stub.Generate(pb.GenerateRequest(**base, temperature=1.0, seed=9, n=2), metadata=META, timeout=120)
    seeded = [stub.Generate(pb.GenerateRequest(**base, temperature=1.0, seed=s), metadata=META, timeout=120)
              for s in (9, 10)]
    assert [list(c.token_ids) for c in sampled.choices] == [list(r.token_ids) for r in seeded]
    msgs = list(stub.GenerateStream(pb.GenerateRequest(**base, temperature=1.0, seed=9, n=2), metadata=META, timeout=120))
    assert {m.index for m in msgs} == {0, 1}
    streamed = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in (0, 1)}
    assert [streamed[0], streamed[1]] == [list(c.token_ids) for c in sampled.choices]
    finals = [m for m in msgs if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1] and all(m.finish_reason == "length" for m in finals)
    assert all(m.timing.total_s > 0 for m in finals)
    with_usage = [m for m in msgs if m.HasField("usage")]
    assert with_usage == [msgs[-1]] and msgs[-1].usage.completion_tokens == 10 and msgs[-1].usage.prompt_tokens == 12
    wait_pools_idle(APP)


def test_grpc_prompt_list_answers_every_prompt_in_order(service, reference):
    import random

    from model_executor.tokenizer import ByteTokenizer
    from router.proto import flashprefill_pb2 as pb

    stub = _stub(service["channel"])
    rng = random.Random(7)
    text = "".join(rng.choice("abcdefgh ") for _ in range(6))
    ids = [ByteTokenizer().encode(text), _random_prompt(rng, 9)]
    want = [_greedy_reference(reference, p, 4) for p in ids]
    req = pb.GenerateRequest(model=MODEL, prompts=[pb.Prompt(text=text), pb.Prompt(token_ids=ids[1])], max_tokens=4,
                             temperature=0, ignore_eos=True)
    r = stub.Generate(req, metadata=META, timeout=120)
    assert [c.index for c in r.choices] == [0, 1] and [list(c.token_ids) for c in r.choices] == want
    assert r.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and r.usage.completion_tokens == 8
    req.n = 2
    msgs = list(stub.GenerateStream(req, metadata=META, timeout=120))
    streamed = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in range(4)}
    assert [streamed[i] for i in range(4)] == [want[0], want[0], want[1], want[1]]  # choice i * n + j
    assert sorted(m.index for m in msgs if m.finish_reason) == [0, 1, 2, 3]
    assert msgs[-1].usage.completion_tokens == 16 and msgs[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1])
    # chat takes n too
    chat = pb.GenerateRequest(model=MODEL, max_tokens=3, temperature=0.8, seed=1, n=2)
    chat.messages.add(role="user", content="hi")
    assert [c.index for c in stub.Generate(chat, metadata=META, timeout=120).choices] == [0, 1]
    wait_pools_idle(APP)


def test_grpc_best_of_returns_the_highest_logprob_choices(service):
    import random

    from router.proto import flashprefill_pb2 as pb

    stub = _stub(service["channel"])
    base = dict(model=MODEL, prompt_token_ids=_random_prompt(random.Random(5), 10), max_tokens=5, temperature=1.0,
                seed=11, ignore_eos=True)
    every = stub.Generate(pb.GenerateRequest(**base, n=4, logprobs=0), metadata=META, timeout=120)
    score = {tuple(c.token_ids): sum(e.logprob for e in c.logprobs) for c in every.choices}
    best = stub.Generate(pb.GenerateRequest(**base, n=2, best_of=4), metadata=META, timeout=120)
    assert [tuple(c.token_ids) for c in best.choices] == sorted(score, key=lambda k: -score[k])[:2]
    assert [c.index for c in best.choices] == [0, 1] and all(not c.logprobs for c in best.choices)
    assert best.usage.completion_tokens == 20  # all four were generated
    wait_pools_idle(APP)


def test_grpc_response_format_outputs_validate(service):
    import json
    import re

    from google.protobuf import struct_pb2

    from router.proto import flashprefill_pb2 as pb

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    stub = _stub(service["channel"])
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
              "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}}}
    as_struct = struct_pb2.Struct()
    as_struct.update(schema)  # its numbers travel as doubles
    for js in (pb.JsonSchema(name="thing", schema_json=json.dumps(schema), strict=True),
               pb.JsonSchema(name="thing", schema=as_struct, strict=True)):
        req = pb.GenerateRequest(model=MODEL, max_tokens=80, temperature=1.0, seed=3, n=2,
                                 response_format=pb.ResponseFormat(type="json_schema", json_schema=js))
        req.messages.add(role="user", content="a thing")
        r = stub.Generate(req, metadata=META, timeout=120)
        for c in r.choices:
            jsonschema.validate(json.loads(c.text), schema)
            assert c.finish_reason == "stop"
        msgs = list(stub.GenerateStream(req, metadata=META, timeout=120))
        for i in (0, 1):
            jsonschema.validate(json.loads("".join(m.text for m in msgs if m.index == i)), schema)
    r = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="yes or no?", max_tokens=10, temperature=1.0, seed=2, n=2,
                                         response_format=pb.ResponseFormat(type="choice", choices=["yes", "no"])),
                      metadata=META, timeout=120)
    assert all(c.text in ("yes", "no") for c in r.choices)
    r = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="digits", max_tokens=10, temperature=1.0, seed=4,
                                         response_format=pb.ResponseFormat(type="regex", pattern=r"[0-9]{2,4}")),
                      metadata=META, timeout=120)
    assert re.fullmatch(r"[0-9]{2,4}", r.text) and r.finish_reason == "stop"
    r = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="j", max_tokens=30, temperature=1.0, seed=4,
                                         response_format=pb.ResponseFormat(type="json_object")), metadata=META, timeout=120)
    assert r.finish_reason == "length" or isinstance(json.loads(r.text), dict)
    wait_pools_idle(APP)


def test_grpc_bad_choices_and_formats_are_invalid_argument_naming_the_field(service):
    from google.protobuf import struct_pb2

    from router.proto import flashprefill_pb2 as pb

    stub = _stub(service["channel"])
    G, RF = pb.GenerateRequest, pb.ResponseFormat
    bad_struct = struct_pb2.Struct()
    bad_struct.update({"type": 7})
    chat = G(model=MODEL, best_of=2)
    chat.messages.add(role="user", content="hi")
    cases = [
        (G(model=MODEL, prompt="hi", n=0), "n"), (G(model=MODEL, prompt="hi", n=17), "n"),
        (G(model=MODEL, prompt="hi", n=3, best_of=2), "best_of"), (G(model=MODEL, prompt="hi", best_of=0), "best_of"),
        (chat, "best_of"),
        (G(model=MODEL, prompts=[pb.Prompt(text="a"), pb.Prompt(text="b", token_ids=[1])]), "prompts[1]"),
        (G(model=MODEL, prompts=[pb.Prompt(text="a"), pb.Prompt()]), "prompts[1]"),
        (G(model=MODEL, prompts=[pb.Prompt(text="a"), pb.Prompt(token_ids=[999])]), "prompts[1].token_ids"),
        (G(model=MODEL, prompts=[pb.Prompt(token_ids=[-1])]), "prompts[0].token_ids"),
        (G(model=MODEL, prompts=[pb.Prompt(text="a")] * 33), "prompts"),
        (G(model=MODEL, prompt="a", prompts=[pb.Prompt(text="a")]), "prompt"),
        (G(model=MODEL, prompt="x", response_format=RF(type="yaml")), "response_format.type"),
        (G(model=MODEL, prompt="x", response_format=RF(type="json_object", pattern="a")), "response_format.pattern"),
        (G(model=MODEL, prompt="x", response_format=RF(type="regex", pattern="(")), "response_format.pattern"),
        (G(model=MODEL, prompt="x", response_format=RF(type="choice")), "response_format.choices"),
        (G(model=MODEL, prompt="x", response_format=RF(type="json_schema", json_schema=pb.JsonSchema(
            name="x", schema=bad_struct))), "response_format.json_schema.schema"),
        (G(model=MODEL, prompt="x", response_format=RF(type="json_schema", json_schema=pb.JsonSchema(
            name="x", schema_json="{"))), "response_format.json_schema.schema_json"),
        (G(model=MODEL, prompt="x", response_format=RF(type="json_schema", json_schema=pb.JsonSchema(
            name="x", schema_json="[1]"))), "response_format.json_schema.schema_json"),
        (G(model=MODEL, prompt="x", response_format=RF(type="json_schema", json_schema=pb.JsonSchema(  # JSON's escape
            name="x", schema_json='{"enum": ["\\ud800"]}'))), "response_format.json_schema.schema_json"),
        (G(model=MODEL, prompt="x", response_format=RF(type="json_schema", json_schema=pb.JsonSchema(
            schema_json="{}"))), "response_format.json_schema.name"),
    ]
    for req, param in cases:
        for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, metadata=META, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, info.value.details())
            assert info.value.details().startswith(param + ":"), (param, info.value.details())
    # best_of > n cannot be streamed (the best are known at the end); unary takes it
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(G(model=MODEL, prompt="hi", max_tokens=2, n=1, best_of=2), metadata=META, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("best_of:")
    assert len(stub.Generate(G(model=MODEL, prompt="hi", max_tokens=2, n=1, best_of=2), metadata=META,
                             timeout=60).choices) == 1

    # strings that are not UTF-8 (a lone surrogate, as a non-Python client may send it): U+0800 is
    # E0 A0 80 in UTF-8, a surrogate U+D800 would be ED A0 80: same length, so the bytes swap in place
    marked = "q\u0800q"
    req = G(model=MODEL, prompts=[pb.Prompt(text="fine"), pb.Prompt(text=marked)], max_tokens=2)
    chat = G(model=MODEL, max_tokens=2, stop=["ok", marked])
    chat.messages.add(role="user", content="hi")
    fmt = G(model=MODEL, prompt="x", response_format=RF(type="choice", choices=["a", marked]))
    for msg, param in ((req, "prompts[1].text"), (chat, "stop[1]"), (fmt, "response_format.choices[1]")):
        raw = msg.SerializeToString().replace(marked.encode(), b"q\xed\xa0\x80q")
        for method in ("Generate", "GenerateStream"):
            with pytest.raises(grpc.RpcError) as info:
                call = _grpc_raw(service["channel"], method)(raw, metadata=META, timeout=60)
                if method == "GenerateStream":
                    list(call)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, info.value.details())
            assert info.value.details().startswith(param + ":"), (param, info.value.details())
    wait_pools_idle(APP)


def test_cli_client_prints_every_choice_over_grpc_and_http(service, capsys):
    from router.__main__ import main
    from router.proto import flashprefill_pb2 as pb

    one = _stub(service["channel"]).Generate(pb.GenerateRequest(model=MODEL, prompt="hello", max_tokens=4, temperature=0),
                                             metadata=META, timeout=120)
    common = ["hello", "--n", "2", "--temperature", "0", "--max-tokens", "4", "--model", MODEL]
    for extra in (["--grpc", "--grpc-target", service["target"], "--application", APP],
                  ["--url", service["http_base"]]):
        for stream in ([], ["--stream"]):
            capsys.readouterr()
            assert main(["client", *common, *extra, *stream]) == 0
            assert capsys.readouterr().out == f"[0] {one.text}\n[1] {one.text}\n", (extra, stream)  # any bytes
    wait_pools_idle(APP)


# ----------------------------------------------------------------------------- gRPC: tool calls
def _pb_tool(tool: dict, *, struct: bool = False):
    """An HTTP ``tools[]`` entry as a ``Tool`` message (parameters as JSON text, or as a Struct)."""
    import json

    from router.proto import flashprefill_pb2 as pb

    fn = tool["function"]
    out = pb.Tool(type=tool["type"], function=pb.FunctionDefinition(name=fn["name"]))
    if "description" in fn:
        out.function.description = fn["description"]
    if struct:
        out.function.parameters.update(fn["parameters"])
    else:
        out.function.parameters_json = json.dumps(fn["parameters"])
    if "strict" in fn:
        out.function.strict = fn["strict"]
    return out


def _pb_calls(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls]


def test_grpc_tool_calls_equal_http_and_stream_the_same(service):
    """required and named ``tool_choice`` over gRPC: the call validates (jsonschema) against the
    tool's parameters and equals HTTP's answer with the same seed; GenerateStream gives the same
    call whole in the choice's last message; the follow-up turn (the assistant's calls, a
    ``tool`` message) renders as HTTP renders it (the same greedy answer)."""
    import json

    from router.proto import flashprefill_pb2 as pb

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    client, stub = service["client"], _stub(service["channel"])
    # the fields in the order the gRPC conversion writes them (the prompt shows tools as JSON)
    tools = [{"type": "function", "function": {k: t["function"][k] for k in ("name", "description", "parameters",
                                                                              "strict") if k in t["function"]}}
             for t in (WEATHER_TOOL, LOOKUP_TOOL)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    user = {"role": "user", "content": "weather in Oslo?"}
    for seed, choice, parallel in ((1, "required", False), (2, "required", False), (3, "lookup", None)):
        req = pb.GenerateRequest(model=MODEL, tools=[_pb_tool(t) for t in tools], max_tokens=200, temperature=1.0,
                                 seed=seed)
        req.messages.add(**user)
        http = dict(model=MODEL, messages=[user], tools=tools, max_tokens=200, temperature=1.0, seed=seed)
        if choice == "required":
            req.tool_choice.mode, http["tool_choice"] = "required", "required"
        else:
            req.tool_choice.function.name = choice
            http["tool_choice"] = {"type": "function", "function": {"name": choice}}
        if parallel is not None:
            req.parallel_tool_calls, http["parallel_tool_calls"] = parallel, parallel
        want = client.chat.completions.create(**http).choices[0]
        r = stub.Generate(req, metadata=META, timeout=120)
        assert r.finish_reason == "tool_calls" and r.choices[0].finish_reason == "tool_calls", r
        assert r.text == "" and r.choices[0].text == ""  # HTTP's content null: no text outside the calls
        assert list(r.tool_calls) == list(r.choices[0].tool_calls) and len(r.tool_calls) >= 1
        assert _pb_calls(r.tool_calls) == _calls(want.message.tool_calls)
        for call in r.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice != "required":
            assert [c.function.name for c in r.tool_calls] == [choice]
        if parallel is False:
            assert len(r.tool_calls) == 1
        msgs = list(stub.GenerateStream(req, metadata=META, timeout=120))
        last = msgs[-1]  # a message per delta; each call in the message where it completed
        assert last.finish_reason == "tool_calls" and all(m.index == 0 for m in msgs)
        assert [m.finish_reason for m in msgs[:-1]] == [""] * (len(msgs) - 1)
        assert "".join(m.text for m in msgs) == ""  # a forced reply is all call
        streamed = [c for m in msgs for c in m.tool_calls]
        assert _pb_calls(streamed) == _pb_calls(r.tool_calls) and streamed[0].id.startswith("call_")
        assert [t for m in msgs for t in m.token_ids] == list(r.token_ids)
        assert last.usage.completion_tokens == len(r.token_ids) == r.usage.completion_tokens

    # the parameters as a Struct: the same grammar (integral numbers read as integers)
    req.tools[1].CopyFrom(_pb_tool(LOOKUP_TOOL, struct=True))
    r = stub.Generate(req, metadata=META, timeout=120)
    assert [c.function.name for c in r.tool_calls] == ["lookup"]
    jsonschema.validate(json.loads(r.tool_calls[0].function.arguments), schemas["lookup"])

    # n = 2, logprobs: each choice's calls, streamed or not; each message's logprobs are its tokens'
    req.n, req.logprobs = 2, 1
    whole = stub.Generate(req, metadata=META, timeout=120)
    msgs = list(stub.GenerateStream(req, metadata=META, timeout=120))
    assert sorted({m.index for m in msgs}) == [0, 1]
    for c in whole.choices:
        mine = [m for m in msgs if m.index == c.index]
        assert c.finish_reason == "tool_calls" and [m.finish_reason for m in mine if m.finish_reason] == ["tool_calls"]
        assert _pb_calls([t for m in mine for t in m.tool_calls]) == _pb_calls(c.tool_calls) and len(c.tool_calls) == 1
        assert all(len(m.logprobs) == len(m.token_ids) for m in mine)
        assert [lp.token_id for m in mine for lp in m.logprobs] == [t for m in mine for t in m.token_ids] \
            == list(c.token_ids)
        jsonschema.validate(json.loads(c.tool_calls[0].function.arguments), schemas["lookup"])

    # auto (the default with tools): free decoding; the text streams as it comes (several messages
    # with text before the finish) and is the whole text
    auto = pb.GenerateRequest(model=MODEL, tools=[_pb_tool(t) for t in tools], max_tokens=40, temperature=1.0,
                              seed=12)
    auto.messages.add(**user)
    whole = stub.Generate(auto, metadata=META, timeout=120)
    want = client.chat.completions.create(model=MODEL, messages=[user], tools=tools, max_tokens=40, temperature=1.0,
                                          seed=12).choices[0]
    assert (whole.text, whole.finish_reason) == (want.message.content or "", want.finish_reason)
    assert _pb_calls(whole.tool_calls) == _calls(want.message.tool_calls or [])
    msgs = list(stub.GenerateStream(auto, metadata=META, timeout=120))
    assert "".join(m.text for m in msgs) == whole.text and [m.finish_reason for m in msgs][-1] == whole.finish_reason
    assert not any(m.tool_calls for m in msgs)
    assert sum(1 for m in msgs if m.text and not m.finish_reason) > 1

    # the follow-up turn: the assistant's calls and the tool's result, rendered as over HTTP
    call = r.tool_calls[0]
    follow = pb.GenerateRequest(model=MODEL, tools=[_pb_tool(t) for t in tools], max_tokens=4, temperature=0)
    follow.messages.add(**user)
    follow.messages.add(role="assistant", tool_calls=[call])
    follow.messages.add(role="tool", tool_call_id=call.id, content="id 7: found")
    got = stub.Generate(follow, metadata=META, timeout=120)
    assert got.finish_reason in ("stop", "length", "tool_calls")
    http_follow = [user, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "id 7: found"}]
    want = client.chat.completions.create(model=MODEL, messages=http_follow, tools=tools, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True}).choices[0]
    assert list(got.token_ids) == want.model_extra["token_ids"]
    assert got.usage.prompt_tokens == len(want.model_extra["prompt_token_ids"])
    prompt = bytes(t for t in want.model_extra["prompt_token_ids"] if t < 256).decode()
    assert prompt.endswith("<tool_response>\nid 7: found\n</tool_response>")
    wait_pools_idle(APP)


def test_grpc_bad_tool_fields_are_invalid_argument_naming_the_field(service):
    from google.protobuf import struct_pb2

    from router.proto import flashprefill_pb2 as pb

    pytest.importorskip("llguidance")
    stub = _stub(service["channel"])
    T, F = pb.Tool, pb.FunctionDefinition
    good = _pb_tool(LOOKUP_TOOL)
    bad_struct = struct_pb2.Struct()
    bad_struct.update({"type": 7})

    def chat(*turns, **fields):
        req = pb.GenerateRequest(model=MODEL, max_tokens=2, **fields)
        req.messages.add(role="user", content="hi")
        for turn in turns:
            req.messages.add().CopyFrom(turn)
        return req

    def turn(**kw):
        return pb.ChatMessage(**kw)

    call = pb.ToolCall(id="c1", function=pb.FunctionCall(name="lookup", arguments='{"id": 1, "exact": true}'))
    cases = [
        (chat(tools=[T(function=F(name="a b"))]), "tools[0].function.name"),
        (chat(tools=[good, T(function=F(name="lookup"))]), "tools[1].function.name"),  # twice
        (chat(tools=[T(type="method", function=F(name="f"))]), "tools[0].type"),
        (chat(tools=[T()]), "tools[0].function.name"),
        (chat(tools=[T(function=F(name="f", parameters_json="{"))]), "tools[0].function.parameters_json"),
        (chat(tools=[T(function=F(name="f", parameters_json="[1]"))]), "tools[0].function.parameters_json"),
        (chat(tools=[good, T(function=F(name="f", parameters_json='{"type": 7}'))]),
         "tools[1].function.parameters_json"),
        (chat(tools=[T(function=F(name="f", parameters=bad_struct))]), "tools[0].function.parameters"),
        (chat(tools=[good], tool_choice=pb.ToolChoice(mode="always")), "tool_choice.mode"),
        (chat(tool_choice=pb.ToolChoice(mode="required")), "tool_choice.mode"),  # no tools
        (chat(tools=[good], tool_choice=pb.ToolChoice()), "tool_choice"),  # neither mode nor function
        (chat(tools=[good], tool_choice=pb.ToolChoice(function=pb.NamedFunction(name="nope"))),
         "tool_choice.function.name"),
        (chat(tools=[good], response_format=pb.ResponseFormat(type="json_object")), "response_format"),
        (pb.GenerateRequest(model=MODEL, prompt="x", tools=[good]), "tools"),  # completions take no tools
        (chat(turn(role="tool", content="r")), "messages[1].tool_call_id"),
        (chat(turn(role="user", content="r", tool_call_id="c1")), "messages[1].tool_call_id"),
        (chat(turn(role="user", content="r", tool_calls=[call])), "messages[1].tool_calls"),
        (chat(turn(role="assistant", tool_calls=[call, pb.ToolCall(function=call.function)])),
         "messages[1].tool_calls[1].id"),
        (chat(turn(role="assistant", tool_calls=[pb.ToolCall(id="c", type="fn", function=call.function)])),
         "messages[1].tool_calls[0].type"),
        (chat(turn(role="assistant", tool_calls=[pb.ToolCall(id="c")])), "messages[1].tool_calls[0].function.name"),
        (chat(turn(role="assistant", tool_calls=[pb.ToolCall(id="c", function=pb.FunctionCall(
            name="lookup", arguments="[1]"))])), "messages[1].tool_calls[0].function.arguments"),
        (chat(tools=[good], parallel_tool_calls=True, logprobs=21), "logprobs"),  # not every error is a tool's
    ]
    for req, param in cases:
        for method in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                method(req, metadata=META, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, info.value.details())
            assert info.value.details().startswith(param + ":"), (param, info.value.details())

    # a lone surrogate in a tool field (as a non-Python client may send it) is named, not INTERNAL
    marked = "f\u0800"
    req = chat(tools=[good, T(function=F(name=marked))])
    raw = req.SerializeToString().replace(marked.encode(), b"f\xed\xa0\x80")
    for method in ("Generate", "GenerateStream"):
        with pytest.raises(grpc.RpcError) as info:
            answer = _grpc_raw(service["channel"], method)(raw, metadata=META, timeout=60)
            if method == "GenerateStream":
                list(answer)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("tools[1].function.name:"), info.value.details()
    wait_pools_idle(APP)


# ----------------------------------------------------------------------------- what real clients send
def test_fields_openai_vllm_and_guidellm_clients_send_get_200(service):
    """Each field the openai SDK, vLLM clients and guidellm send: accepted; min_p 1 keeps only
    the top token (so it samples the greedy answer); usage in every chunk with vLLM's
    continuous_usage_stats; GET /v1/models/{id}."""
    client = service["client"]
    messages = [{"role": "user", "content": "hello there"}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=1.0, seed=7, metadata={"run": "t"}, store=False,
        service_tier="auto", reasoning_effort="low", modalities=["text"], verbosity="low",
        prediction={"type": "content", "content": "hello"}, prompt_cache_key="k1", safety_identifier="user-1",
        functions=[{"name": "f", "parameters": {"type": "object", "properties": {}}}],
        extra_body={"min_p": 1.0, "add_special_tokens": False, "ignore_eos": True})
    assert chat.choices[0].message.content == greedy.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4 and all(k.usage is None for k in chunks[:-1])
    # guidellm's streaming completions: vLLM's continuous usage stats, usage in every chunk
    chunks = list(client.completions.create(
        model=MODEL, prompt="hello", max_tokens=4, temperature=0, stream=True, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True, "min_p": 0.05}))
    counts = [k.usage.completion_tokens for k in chunks]
    assert counts[-1] == 4 and counts == sorted(counts) and all(k.usage.prompt_tokens == 6 for k in chunks)
    assert sum(1 for k in chunks if k.choices) == len(chunks) - 1  # each token's chunk, then the usage one
    # add_special_tokens false: the byte tokenizer's BOS is not added (5 bytes, no BOS)
    c = client.completions.create(model=MODEL, prompt="hello", max_tokens=1, temperature=0,
                                  extra_body={"add_special_tokens": False})
    assert c.usage.prompt_tokens == 5
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"min_p": 2})
    assert info.value.body["param"] == "min_p"
    wait_pools_idle(APP)


def test_string_and_token_prompts_echo_the_same_continuation_logprobs(service, reference):
    """lm-eval's loglikelihood in string mode (the text) and token mode (the ids): the echo has
    one entry per client token, so slicing at the context's length gives the same scores."""
    from model_executor.tokenizer import ByteTokenizer

    client, tok = service["client"], ByteTokenizer()
    ctx, cont = "The cat sat on the", " mat"
    ids = tok.encode(ctx + cont, add_bos=False)
    ctxlen = len(tok.encode(ctx, add_bos=False))

    def echoed(prompt, **extra):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                      temperature=0, extra_body=extra)
        return r.choices[0].logprobs

    text, token = echoed(ctx + cont, add_special_tokens=False), echoed(ids)
    assert text.tokens == token.tokens and len(text.token_logprobs) == len(ids) + 1
    assert text.token_logprobs[ctxlen:-1] == pytest.approx(token.token_logprobs[ctxlen:-1], abs=1e-5)
    # the tokenizer's default adds a BOS: not echoed, the first client token gets its logprob given it
    with_bos, sent_bos = echoed(ctx + cont), echoed([tok.bos_token_id, *ids])
    assert len(with_bos.token_logprobs) == len(ids) + 1 and with_bos.text_offset[:2] == [0, 1]
    assert with_bos.token_logprobs[:-1] == pytest.approx(sent_bos.token_logprobs[1:-1], abs=1e-5)
    cont_ids = ids[ctxlen:]
    want = [float(torch.log_softmax(reference([tok.bos_token_id, *ids[:ctxlen + i]]), -1)[t])
            for i, t in enumerate(cont_ids)]
    assert with_bos.token_logprobs[ctxlen:-1] == pytest.approx(want, abs=2e-3)
    for lp, top in zip(with_bos.token_logprobs[ctxlen:-1], with_bos.top_logprobs[ctxlen:-1]):
        assert max(top.values()) >= lp  # lm-eval's is_greedy compares these
    wait_pools_idle(APP)


def test_logprobs_as_token_ids_and_grpc_models_min_p_add_special_tokens(service, capsys):
    from router.__main__ import main
    from router.proto import flashprefill_pb2 as pb

    client, stub = service["client"], _stub(service["channel"])
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0, logprobs=3,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    lp, out = r.choices[0].logprobs, r.choices[0].model_extra["token_ids"]
    assert lp.tokens == [f"token_id:{t}" for t in out]
    assert all(len(top) == 3 and all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    models = stub.ListModels(pb.ListModelsRequest(), metadata=META, timeout=60)
    assert [m.id for m in models.models] == [MODEL]
    greedy = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, temperature=0.0,
                                              ignore_eos=True), metadata=META, timeout=120)
    top_only = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, temperature=1.0, seed=3,
                                                min_p=1.0, ignore_eos=True), metadata=META, timeout=120)
    assert list(top_only.token_ids) == list(greedy.token_ids) and greedy.usage.prompt_tokens == 3
    plain = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=1, add_special_tokens=False),
                          metadata=META, timeout=120)
    assert plain.usage.prompt_tokens == 2
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=1, min_p=1.5), metadata=META,
                      timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("min_p")
    # the CLI asks the server for its model; a model it does not serve fails cleanly
    target = ["--grpc", "--grpc-target", service["target"], "--application", APP]
    capsys.readouterr()
    assert main(["client", "hi", "--max-tokens", "2", "--temperature", "0", *target]) == 0
    assert main(["client", "hi", "--max-tokens", "2", "--model", "nope", *target]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    wait_pools_idle(APP)
