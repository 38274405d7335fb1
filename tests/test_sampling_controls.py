"""Sampling controls (penalties, logit_bias, min_tokens, logprobs, the guided-decoding hook)
against a reference written here, loop by loop, independently of model_executor/sampling.py."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from decode_worker.engine import DecodeEngine, FinishReason
from kernels.config import SparseConfig
from model_executor import ModelRunner, SamplingParams, build_tiny_model
from model_executor.sampling import Sampler
from prefill_worker.engine import PrefillEngine, PrefillRequest
from router.offline import make_pool

VOCAB = 37


def reference_logits(row: torch.Tensor, p: SamplingParams, step: int, history: list[int]) -> list[float]:
    """The documented order, one token at a time, in float64 Python."""
    out = [float(x) for x in row]
    if step < p.min_tokens:
        for t in p.stop_token_ids:
            out[t] = -math.inf
    for t, b in p.logit_bias:
        out[t] += b
    counts = {t: history.count(t) for t in set(history)}
    for t, c in counts.items():
        if p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    temp = p.temperature if p.temperature > 0 else 1.0
    return [x / temp for x in out]


def reference_log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    z = m + math.log(sum(math.exp(x - m) for x in xs if x != -math.inf))
    return [x - z for x in xs]


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    histories = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in (0, 5, 11, 3)]
    return logits, histories


PARAMS = [
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7, logprobs=5),
    SamplingParams(temperature=0.7, repetition_penalty=1.8, logit_bias=((3, 4.0), (9, -50.0)), logprobs=3, seed=5),
    SamplingParams(temperature=1.3, presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=0.6,
                   logprobs=0, seed=1),
    SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=(2, 7), logit_bias={2: 30.0}, logprobs=20),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logprobs_and_greedy_tokens_match_the_reference(seed):
    logits, histories = _case(seed)
    before = logits.clone()
    steps = [len(h) for h in histories]
    out = Sampler().sample(logits, PARAMS, steps, histories)
    assert torch.equal(logits, before)  # not modified
    for i, p in enumerate(PARAMS):
        ref = reference_log_softmax(reference_logits(logits[i], p, steps[i], histories[i]))
        lp = out.logprobs[i]
        assert lp.token == int(out.tokens[i])
        assert lp.logprob == pytest.approx(ref[lp.token], abs=1e-4)
        want_top = sorted(range(VOCAB), key=lambda t: -ref[t])[: p.logprobs]
        assert [t for t, _ in lp.top] == want_top
        for t, v in lp.top:
            assert v == pytest.approx(ref[t], abs=1e-4)
        if p.greedy:
            assert lp.token == max(range(VOCAB), key=lambda t: ref[t])


def test_min_tokens_blocks_stop_tokens_then_releases_them():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 7] = 10.0  # a stop token that would always win
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    s = Sampler()
    assert all(int(s(logits, [p], [k])[0]) != 7 for k in range(3))
    assert int(s(logits, [p], [3])[0]) == 7


def test_logit_bias_forces_and_bans_tokens_under_sampling():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, VOCAB, generator=g)
    forced = SamplingParams(temperature=1.0, seed=2, logit_bias=((11, 100.0),))
    banned = SamplingParams(temperature=1.0, logit_bias=tuple((t, -100.0) for t in range(VOCAB) if t != 4))
    s = Sampler(torch.Generator().manual_seed(0))
    assert all(int(s(logits, [forced], [k])[0]) == 11 for k in range(10))
    assert all(int(s(logits, [banned], [k])[0]) == 4 for k in range(10))


def test_plain_rows_beside_processed_rows_are_unchanged():
    logits, histories = _case(4)
    plain = SamplingParams(temperature=0.9, seed=3)
    mixed = Sampler().sample(logits, [plain, PARAMS[1], plain, PARAMS[0]], [0, 5, 1, 3], histories)
    alone = Sampler().sample(logits[[0, 2]], [plain, plain], [0, 1])
    assert mixed.tokens[[0, 2]].tolist() == alone.tokens.tolist()
    assert mixed.logprobs[0] is None and mixed.logprobs[2] is None


def test_seeded_sampling_draws_from_the_processed_distribution():
    """With one token banned by bias and the rest penalized, many seeded draws never pick the
    banned token and agree with a plain draw over the reference-processed logits."""
    logits, histories = _case(5)
    p = SamplingParams(temperature=0.8, frequency_penalty=1.0, logit_bias=((0, -100.0),), seed=9)
    plain = SamplingParams(temperature=1.0, seed=9)  # the reference already divided by 0.8
    s = Sampler()
    for k in range(20):
        ref = torch.tensor([reference_logits(logits[1], p, k, histories[1])], dtype=torch.float32)
        assert int(s(logits[1:2], [p], [k], [histories[1]])[0]) == int(s(ref, [plain], [k])[0])


def test_min_p_keeps_the_tokens_within_its_ratio_of_the_top_one():
    """Probabilities 0.5, 0.3, 0.15, 0.05 (fresh order) at min_p 0.35: the threshold is 0.175,
    so the two most likely remain, renormalized to 0.625 / 0.375 (computed by hand)."""
    gen = torch.Generator().manual_seed(11)
    perm = torch.randperm(4, generator=gen)
    probs = torch.empty(4, dtype=torch.float64)
    probs[perm] = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = probs.log().float()[None]
    p = SamplingParams(temperature=1.0, min_p=0.35, seed=5)
    kept, order = Sampler.filtered_probs(logits, [p])
    dist = torch.zeros(4, dtype=torch.float64)
    dist[order[0]] = (kept[0] / kept[0].sum()).double()
    want = torch.zeros(4, dtype=torch.float64)
    want[perm[:2]] = torch.tensor([0.625, 0.375], dtype=torch.float64)
    assert dist.tolist() == pytest.approx(want.tolist(), abs=1e-6)
    # at temperature 2 the probabilities flatten to sqrt(p) / sum: 0.35 * sqrt(0.5) = 0.247 > sqrt(0.05)
    # and < sqrt(0.15), so three remain
    kept2, _ = Sampler.filtered_probs(logits, [SamplingParams(temperature=2.0, min_p=0.35)])
    assert int((kept2[0] > 0).sum()) == 3
    # draws only ever pick a kept token; min_p 0 keeps all four, min_p 1 only the top one
    draws = {int(Sampler()(logits, [SamplingParams(temperature=1.0, min_p=0.35, seed=k)], [0])[0]) for k in range(64)}
    assert draws == set(perm[:2].tolist())
    assert int((Sampler.filtered_probs(logits, [SamplingParams(min_p=0.0)])[0] > 0).sum()) == 4
    assert int((Sampler.filtered_probs(logits, [SamplingParams(min_p=1.0)])[0] > 0).sum()) == 1


class _OnlyTheseTokens:
    """A fake guide: allows a fixed set of tokens; ends after ``length`` accepted tokens."""

    built = 0

    def __init__(self, allowed, length):
        self.allowed, self.length, self.accepted = list(allowed), length, []
        _OnlyTheseTokens.built += 1

    def fill_mask(self, row):
        keep = row[self.allowed].clone()
        row.fill_(float("-inf"))
        row[self.allowed] = keep

    def accept(self, token):
        assert token in self.allowed
        self.accepted.append(token)

    def is_terminated(self):
        return len(self.accepted) >= self.length


@pytest.fixture
def fake_grammar(monkeypatch):
    mod = types.ModuleType("model_executor.grammar")
    mod.compile_guide = lambda spec, tokenizer: _OnlyTheseTokens(spec["allowed"], spec["length"])
    monkeypatch.setitem(sys.modules, "model_executor.grammar", mod)
    _OnlyTheseTokens.built = 0
    return mod


def _engines(tiny, tokenizer):
    pool = make_pool(tiny, num_pages=16, page_size=16)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    return pool, PrefillEngine(runner, tokenizer=tokenizer), DecodeEngine(runner, tokenizer=tokenizer)


def test_guide_hook_constrains_prefill_and_decode_and_ends_the_request(fake_grammar):
    tiny = build_tiny_model(seed=0)
    pool, prefill, decode = _engines(tiny, tokenizer=object())
    allowed = [65, 66, 67]
    params = SamplingParams(temperature=1.0, seed=1, max_new_tokens=20, guided={"allowed": allowed, "length": 6})
    free = SamplingParams(temperature=1.0, seed=1, max_new_tokens=6)
    prompt = [256, 1, 2, 3, 4, 5, 6]
    res = prefill.prefill([PrefillRequest("g", prompt, params), PrefillRequest("f", prompt, free)])
    for r, p in zip(res, (params, free)):
        decode.add_request(r.request_id, r.kv_len, r.first_token, p)
    decode.run_until_done()
    g, f = decode.pop_finished("g"), decode.pop_finished("f")
    assert all(t in allowed for t in g.output_ids)
    assert len(g.output_ids) == 6 and g.finish_reason is FinishReason.STOP
    assert f.finish_reason is FinishReason.LENGTH and not all(t in allowed for t in f.output_ids)
    assert _OnlyTheseTokens.built == 2  # one per engine, once per request (not per step)
    assert pool.used_pages == 0


def test_guided_without_the_grammar_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "model_executor.grammar", None)  # import fails
    from model_executor.sampling import make_guide

    with pytest.raises(ValueError, match="guided"):
        make_guide(SamplingParams(guided={"type": "json_object"}), object())
    assert make_guide(SamplingParams(), object()) is None


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"logit_bias": "x"}, "logit_bias"),
    ({"logit_bias": ((1,),)}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"guided": "json"}, "guided"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": True}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampler_rejects_bias_outside_the_vocabulary_and_bad_lengths():
    s = Sampler()
    with pytest.raises(ValueError, match="logit_bias"):
        s(torch.zeros(1, VOCAB), [SamplingParams(logit_bias=((VOCAB, 1.0),))], [0])
    with pytest.raises(ValueError, match="histories"):
        s.sample(torch.zeros(1, VOCAB), [SamplingParams()], [0], histories=[[], []])


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_prompt_logprobs_equal_the_reference_model_log_softmax(chunk_size):
    tiny = build_tiny_model(seed=0)
    pool = make_pool(tiny, num_pages=16, page_size=16)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    prefill = PrefillEngine(runner, chunk_size=chunk_size, prefix_cache=True)
    g = torch.Generator().manual_seed(11)
    prompt = [256] + torch.randint(0, 256, (20,), generator=g).tolist()
    want = SamplingParams(temperature=0.0, prompt_logprobs=3)
    res = prefill.prefill([PrefillRequest("p", prompt, want), PrefillRequest("q", prompt[:9], SamplingParams())])
    assert res[1].prompt_logprobs is None
    lps = res[0].prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    ref_model = build_tiny_model(seed=0).model  # whole-sequence HF forward, no pool
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([prompt])).logits[0].double(), -1)
    for pos in range(1, len(prompt)):
        e = lps[pos]
        assert e.token == prompt[pos]
        assert e.logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert [t for t, _ in e.top] == ref[pos - 1].topk(3).indices.tolist()
    assert res[0].first_token == int(ref[-1].argmax())
    for r in res:
        prefill.release(r.request_id)
    # a second request for the same prompt would hit the prefix cache; with prompt logprobs it
    # recomputes every position (nothing to report otherwise)
    again = prefill.prefill([PrefillRequest("p2", prompt, want)])[0]
    assert again.cached_tokens == 0 and [e.logprob for e in again.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in lps[1:]], abs=1e-5)
    prefill.release("p2")


def test_per_request_sparse_alpha_runs_its_own_forward_and_skips_the_prefix_cache():
    """A sparse runner (alpha 0.95, every length); one prompt asks for dense (alpha 0), one
    for the runner's: in one batch each gets the prompt logprobs of a runner of its own."""
    tiny = build_tiny_model(seed=0)
    sparse = SparseConfig(alpha=0.95, block_size=64, sink_tokens=64, window_tokens=64, mean_correction=False)

    def engine(config):
        pool = make_pool(tiny, num_pages=64, page_size=16)
        runner = ModelRunner(tiny.model, pool, config, dense_below=0)
        return pool, PrefillEngine(runner, prefix_cache=True)

    g = torch.Generator().manual_seed(5)
    prompt = [256] + torch.randint(0, 256, (260,), generator=g).tolist()
    want = SamplingParams(temperature=0.0, prompt_logprobs=0)
    pool, mixed = engine(sparse)
    res = mixed.prefill([PrefillRequest("dense", prompt, want, sparse_alpha=0.0),
                         PrefillRequest("same", prompt, want, sparse_alpha=0.95),
                         PrefillRequest("default", prompt, want)])
    _, dense_engine = engine(SparseConfig(alpha=0.0))
    _, sparse_engine = engine(sparse)
    ref_dense = dense_engine.prefill([PrefillRequest("r", prompt, want)])[0]
    ref_sparse = sparse_engine.prefill([PrefillRequest("r", prompt, want)])[0]
    lp = lambda r: [e.logprob for e in r.prompt_logprobs[1:]]  # noqa: E731
    assert lp(res[0]) == pytest.approx(lp(ref_dense), abs=1e-5)
    assert lp(res[1]) == pytest.approx(lp(ref_sparse), abs=1e-5)
    assert lp(res[2]) == pytest.approx(lp(ref_sparse), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(lp(ref_dense), lp(ref_sparse))) > 1e-4  # sparsity shows
    for r in res:
        mixed.release(r.request_id)
    # the dense prompt cached nothing; a plain repeat finds the pages of the default one
    again = mixed.prefill([PrefillRequest("again", prompt, SamplingParams(temperature=0.0)),
                           PrefillRequest("dense2", prompt, SamplingParams(temperature=0.0), sparse_alpha=0.0)])
    assert again[0].cached_tokens > 0 and again[1].cached_tokens == 0
    with pytest.raises(ValueError, match="sparse_alpha"):
        mixed.prefill([PrefillRequest("bad", prompt, want, sparse_alpha=1.5)])
