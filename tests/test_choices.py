"""n / best_of groups without Ray: one prefill samples every choice's first token from the same
logits, the decode engine forks the prompt's pages copy-on-write into one running request per
choice. Oracle: ``router.offline.generate`` of each choice alone (its own prefill, its own pages)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decode_worker.engine import DecodeEngine, FinishReason
from kernels.config import SparseConfig
from kv_cache import PoolExhausted
from model_executor import ModelRunner, SamplingParams
from prefill_worker.engine import PrefillEngine, PrefillRequest
from router.offline import generate, make_pool

PAGE = 16


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


def _engines(tiny, num_pages=40):
    pool = make_pool(tiny, num_pages=num_pages, page_size=PAGE)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    return pool, PrefillEngine(runner), DecodeEngine(runner)


def _oracle(tiny, prompt, params):
    return list(generate([prompt], params, model=tiny, sparse_config=SparseConfig(alpha=0.0), dense_below=0,
                         page_size=PAGE, ignore_eos=True)[0].output_token_ids)  # the engines add no EOS


def _group(tiny, prompt, choices, num_pages=40):
    """Prefill once for every choice, fork into the decode engine: (pool, decode engine, ids, start free)."""
    pool, prefill, decode = _engines(tiny, num_pages)
    start = pool.free_pages
    [res] = prefill.prefill([PrefillRequest("g", prompt, choices[0], choices=tuple(choices))])
    assert len(res.first_tokens) == len(choices) and res.first_token == res.first_tokens[0]
    ids = [f"g#{k}" for k in range(len(choices))]
    decode.add_group("g", res.kv_len, list(zip(ids, res.first_tokens, choices)))
    return pool, decode, ids, start


@pytest.mark.parametrize("length", [21, 32])  # a partial last page (copied per choice), page-aligned
def test_greedy_group_equals_n1_for_every_choice(tiny, length):
    prompt = _prompt(length, seed=length)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    pool, decode, ids, start = _group(tiny, prompt, [greedy] * 3)
    assert not pool.has("g")  # the first choice took the prompt's pages over
    shared = set(pool.pages(ids[0])[: length // PAGE])
    assert all(set(pool.pages(i)[: length // PAGE]) == shared for i in ids)
    decode.run_until_done()
    want = _oracle(tiny, prompt, greedy)
    assert [list(decode.pop_finished(i).output_ids) for i in ids] == [want] * 3
    assert pool.free_pages == start and pool.stats()["requests"] == 0


def test_seeded_choices_differ_and_each_equals_its_oracle(tiny):
    prompt = _prompt(27, seed=3)
    seed = int(torch.randint(0, 2**31, (1,)).item())
    choices = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed + k, max_new_tokens=10) for k in range(3)]
    pool, decode, ids, start = _group(tiny, prompt, choices)
    decode.run_until_done()
    got = [list(decode.pop_finished(i).output_ids) for i in ids]
    assert got == [_oracle(tiny, prompt, p) for p in choices]
    assert len({tuple(g) for g in got}) == 3
    assert pool.free_pages == start


def test_one_choice_ending_early_frees_only_its_own_pages(tiny):
    prompt = _prompt(21, seed=8)
    long = SamplingParams(temperature=0.0, max_new_tokens=30)
    short = dataclasses.replace(long, max_new_tokens=14)  # grows past its copied page, then ends
    pool, decode, ids, start = _group(tiny, prompt, [long, short, long])
    while not decode.get(ids[1]).is_done:
        before = {i: pool.pages(i) for i in ids}
        free = pool.free_pages
        decode.step()
    others = {p for i in (ids[0], ids[2]) for p in pool.pages(i)}
    own = [p for p in before[ids[1]] if p not in others]
    assert own and not set(own) & {p for i in (ids[0], ids[2]) for p in before[i]}
    grown = sum(len(pool.pages(i)) - len(before[i]) for i in (ids[0], ids[2]))
    assert pool.free_pages == free + len(own) - grown  # its pages back; the shared ones still held
    assert all(pool.page_holders(p) == 2 for p in pool.pages(ids[0])[: 21 // PAGE])
    decode.pop_finished(ids[1])
    for i in (ids[0], ids[2]):
        decode.cancel(i)
        decode.pop_finished(i)
    assert pool.free_pages == start and pool.stats()["requests"] == 0


def test_cancelling_every_choice_returns_the_pool(tiny):
    prompt = _prompt(40, seed=9)
    params = [SamplingParams(temperature=0.7, seed=k, max_new_tokens=20) for k in range(4)]
    pool, decode, ids, start = _group(tiny, prompt, params)
    for _ in range(3):
        decode.step()
    assert pool.free_pages < start
    for i in reversed(ids):
        assert decode.cancel(i)
        assert decode.pop_finished(i).finish_reason is FinishReason.CANCELLED
    assert pool.free_pages == start and not decode.has_unfinished()


def test_add_group_errors_change_nothing(tiny):
    pool, prefill, decode = _engines(tiny, num_pages=3)
    prompt = _prompt(21, seed=1)  # 2 pages, the second partial: 1 page free
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    [res] = prefill.prefill([PrefillRequest("g", prompt, greedy, choices=(greedy,) * 3)])
    pages = pool.pages("g")
    with pytest.raises(PoolExhausted):  # two copies needed, one page free
        decode.add_group("g", res.kv_len, [(f"c{k}", res.first_tokens[k], greedy) for k in range(3)])
    assert pool.pages("g") == pages and not decode.has_unfinished() and pool.free_pages == 1
    bad = [
        ("choices", "g", res.kv_len, []),
        ("choices", "g", res.kv_len, [("a", 1, greedy), ("a", 1, greedy)]),
        ("choices", "g", res.kv_len, [("a", 1, "greedy")]),
        ("choices", "g", res.kv_len, [("a", tiny.config.vocab_size, greedy)]),
        ("prompt_len", "g", res.kv_len + 1, [("a", 1, greedy)]),
        ("request_id", "nope", res.kv_len, [("a", 1, greedy)]),
    ]
    for name, rid, n, choices in bad:
        with pytest.raises(ValueError, match=name):
            decode.add_group(rid, n, choices)
        assert pool.pages("g") == pages and pool.free_pages == 1
    with pytest.raises(ValueError, match="choices"):
        prefill.add_request(PrefillRequest("h", prompt, greedy, choices=[greedy]))
    decode.add_group("g", res.kv_len, [("a", res.first_tokens[0], greedy), ("b", res.first_tokens[1], greedy)])
    decode.run_until_done()
    assert pool.free_pages == 3


def test_prefill_choices_share_one_forward_and_match_single_prefills(tiny):
    prompt = _prompt(30, seed=5)
    choices = tuple(SamplingParams(temperature=1.0, seed=40 + k, max_new_tokens=1, logprobs=2) for k in range(5))
    _, prefill, _ = _engines(tiny)
    [res] = prefill.prefill([PrefillRequest("g", prompt, choices[0], choices=choices)])
    assert prefill.forward_batches == 1 and len(res.first_logprobs) == 5
    for k, p in enumerate(choices):
        _, alone, _ = _engines(tiny)
        [one] = alone.prefill([PrefillRequest("x", prompt, p)])
        assert res.first_tokens[k] == one.first_token
        assert res.first_logprobs[k].token == one.first_logprob.token
        assert res.first_logprobs[k].logprob == pytest.approx(one.first_logprob.logprob, abs=1e-6)


@pytest.mark.parametrize("kv_len, news, want", [
    (21, [10, 10, 10], 1 + 3 * (2 - 1)),  # one shared full page; each choice: its copy (31 tokens: page 2)
    (32, [1, 1], 2 + 2 * 1),  # page-aligned: all shared, each choice one page for its token
    (21, [40], 4),  # one choice: as a single request, ceil(61 / 16)
    (5, [3, 30], 0 + 1 + 3),  # no full page: nothing shared
])
def test_decode_call_footprint_counts_shared_pages_once(kv_len, news, want):
    from serving.messages import DecodeCall

    choices = tuple((1, SamplingParams(max_new_tokens=m)) for m in news)
    call = DecodeCall(request_id="g", ticket=None, kv_len=kv_len, first_token=1, params=choices[0][1],
                      choices=choices if len(news) > 1 else ())
    assert call.footprint(PAGE) == want
