"""A resumed decode (``DecodeEngine.add_request(..., history=)``, what the ingress sends after a
decode replica died) continues exactly as the uninterrupted request: penalties, seeded draws,
``min_tokens`` and structured output see the tokens generated before the death."""

from __future__ import annotations

import pytest
import torch

from decode_worker.engine import DecodeEngine
from kernels.config import SparseConfig
from model_executor import ModelRunner, SamplingParams
from model_executor.tokenizer import ByteTokenizer
from prefill_worker.engine import PrefillEngine, PrefillRequest
from router.offline import make_pool


def _engines(tiny):
    pool = make_pool(tiny, num_pages=64, page_size=16)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    return pool, PrefillEngine(runner, tokenizer=ByteTokenizer()), DecodeEngine(runner, tokenizer=ByteTokenizer())


def _run(tiny, prompt, params, *, sent=None, history=True):
    """Tokens of one request; with ``sent`` (tokens the client had), run it as a resume:
    prefill prompt + sent[:-1], decode from sent[-1] (with or without the history)."""
    pool, prefill, decode = _engines(tiny)
    context = list(prompt) + (list(sent[:-1]) if sent else [])
    (res,) = prefill.prefill([PrefillRequest("r", context, params)])
    first = sent[-1] if sent else res.first_token
    req = decode.add_request("r", len(context), first, params, history=tuple(sent[:-1]) if sent and history else ())
    decode.run_until_done()
    assert pool.used_pages == 0
    out = list(req.output_ids)
    return list(sent[:-1]) + out if sent and not history else out


def _prompt(seed, n=40):
    g = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


PENALIZED = SamplingParams(temperature=0.9, seed=11, max_new_tokens=24, presence_penalty=1.5,
                           frequency_penalty=1.2, repetition_penalty=1.4, min_tokens=20, stop_token_ids=(10,))


@pytest.mark.parametrize("cut", [1, 7, 15])
def test_resume_continues_penalties_seeded_draws_and_min_tokens(tiny, cut):
    prompt = _prompt(cut)
    whole = _run(tiny, prompt, PENALIZED)
    assert len(whole) == PENALIZED.max_new_tokens
    resumed = _run(tiny, prompt, PENALIZED, sent=whole[:cut])
    assert resumed == whole


def test_resume_without_the_history_diverges(tiny):
    """The test above has teeth: a resume that forgets the history (the earlier behaviour)
    draws other tokens under the same seed and penalties."""
    prompt = _prompt(3)
    whole = _run(tiny, prompt, PENALIZED)
    assert _run(tiny, prompt, PENALIZED, sent=whole[:7], history=False)[:len(whole)] != whole


def test_resume_continues_structured_output(tiny):
    allowed = ["alpha", "beta", "gamma"]
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=30, guided={"type": "choice", "choices": allowed})
    prompt = _prompt(9)
    whole = _run(tiny, prompt, params)
    text = bytes(t for t in whole if t < 256).decode()
    assert text in allowed
    for cut in sorted({1, len(text) // 2, len(text) - 1}):
        resumed = _run(tiny, prompt, params, sent=whole[:cut])
        assert resumed == whole
        assert bytes(t for t in resumed if t < 256).decode() == text


def test_history_is_validated(tiny):
    pool, prefill, decode = _engines(tiny)
    prompt = _prompt(1, 8)
    prefill.prefill([PrefillRequest("r", prompt, SamplingParams(temperature=0.0))])
    for bad in ([tiny.model.config.vocab_size], [-1], [True], "ab", list(range(8))):
        with pytest.raises(ValueError, match="history"):
            decode.add_request("r", len(prompt), 1, SamplingParams(), history=bad)
    assert pool.used_pages == pool.pages_for(len(prompt))  # a refused request keeps what it was given
    pool.release("r")
