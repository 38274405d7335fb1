"""PrefillEngine and DecodeEngine (no Ray): batching, chunking, request states, page accounting."""

from __future__ import annotations

import pytest
import torch

from decode_worker.engine import DecodeEngine, FinishReason, RequestState, StepOutput
from kernels.config import SparseConfig
from kv_cache import PoolExhausted
from model_executor import ModelRunner, SamplingParams
from router.offline import generate, make_pool
from prefill_worker.engine import PrefillEngine, PrefillRequest

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[256] + torch.randint(0, 256, (n - 1,), generator=g).tolist() for n in lengths]


def _engines(tiny, *, num_pages=32, page_size=16, chunk_size=None, max_batch_tokens=8192, max_running=256):
    pool = make_pool(tiny, num_pages=num_pages, page_size=page_size)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    return (
        pool,
        PrefillEngine(runner, max_batch_tokens=max_batch_tokens, chunk_size=chunk_size),
        DecodeEngine(runner, max_running=max_running),
    )


def test_prefill_results_pages_and_release(tiny):
    pool, prefill, _ = _engines(tiny)
    prompts = _prompts([40, 7, 17])
    res = prefill.prefill([PrefillRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert [r.request_id for r in res] == ["r0", "r1", "r2"]
    for r, p in zip(res, prompts):
        assert r.kv_len == len(p) == pool.seq_len(r.request_id)
        assert list(r.pages) == pool.pages(r.request_id)
        assert len(r.pages) == -(-len(p) // 16)
        assert 0 <= r.first_token < tiny.config.vocab_size
    assert len({pg for r in res for pg in r.pages}) == sum(len(r.pages) for r in res)
    for r in res:
        prefill.release(r.request_id)
    assert pool.used_pages == 0
    with pytest.raises(ValueError, match="request_id"):
        prefill.release("r0")


@pytest.mark.parametrize("chunk_size, budget", [(16, 8192), (None, 32), (5, 12)])
def test_chunked_and_budgeted_prefill_equal_one_piece(tiny, chunk_size, budget):
    prompts = _prompts([70, 33, 9], seed=1)
    reqs = lambda: [PrefillRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]  # noqa: E731
    _, whole, _ = _engines(tiny)
    want = whole.prefill(reqs())
    _, chunked, _ = _engines(tiny, chunk_size=chunk_size, max_batch_tokens=budget)
    got = chunked.prefill(reqs())
    assert [r.first_token for r in got] == [r.first_token for r in want]
    assert chunked.forward_batches > whole.forward_batches == 1


def test_chunked_generation_equals_whole(tiny):
    prompts = _prompts([90, 25], seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    a = generate(prompts, params, model=tiny, sparse_config=SparseConfig(alpha=0.0), dense_below=0)
    b = generate(prompts, params, model=tiny, sparse_config=SparseConfig(alpha=0.0), dense_below=0,
                 chunk_size=32, page_size=16)
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]


def test_pool_exhaustion_allocates_nothing(tiny):
    pool, prefill, _ = _engines(tiny, num_pages=4, page_size=16)
    reqs = [PrefillRequest("a", _prompts([30])[0], GREEDY), PrefillRequest("b", _prompts([40])[0], GREEDY)]
    with pytest.raises(PoolExhausted) as info:
        prefill.prefill(reqs)
    assert info.value.requested == 3 and info.value.free == 2
    assert pool.used_pages == 0 and not pool.has("a") and not pool.has("b")
    # the pool still works afterwards
    prefill.prefill(reqs[:1])
    assert pool.used_pages == 2


def test_prefill_rejects_bad_requests(tiny):
    _, prefill, _ = _engines(tiny)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        prefill.prefill([PrefillRequest("a", [], GREEDY)])
    with pytest.raises(ValueError, match="request_id"):
        prefill.prefill([PrefillRequest("a", [1], GREEDY), PrefillRequest("a", [2], GREEDY)])
    with pytest.raises(ValueError, match="params"):
        prefill.prefill([PrefillRequest("a", [1], params={"temperature": 0})])
    with pytest.raises(ValueError, match="chunk_size"):
        PrefillEngine(prefill.runner, chunk_size=0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        PrefillEngine(prefill.runner, max_batch_tokens=0)


def test_decode_states_stop_length_cancel_and_pages(tiny):
    pool, prefill, decode = _engines(tiny, max_running=2)
    prompts = _prompts([20, 31, 12, 5], seed=2)
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=6),
        SamplingParams(temperature=0.0, max_new_tokens=30),
        SamplingParams(temperature=0.9, max_new_tokens=30, seed=7),
        SamplingParams(temperature=0.0, max_new_tokens=1),
    ]
    res = prefill.prefill([PrefillRequest(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    reqs = [decode.add_request(r.request_id, r.kv_len, r.first_token, sp) for r, sp in zip(res, params)]
    # max_new_tokens=1: the prefill token ends it at once, pages released
    assert reqs[3].state is RequestState.FINISHED and reqs[3].finish_reason is FinishReason.LENGTH
    assert not pool.has("r3")
    assert [r.state for r in reqs[:3]] == [RequestState.WAITING] * 3
    decode.step()
    assert decode.num_running == 2 and decode.num_waiting == 1
    assert reqs[2].state is RequestState.WAITING
    assert decode.cancel("r1") is True
    assert reqs[1].state is RequestState.CANCELLED and not pool.has("r1")
    assert decode.cancel("r1") is False
    decode.run_until_done()
    assert reqs[0].state is RequestState.FINISHED and len(reqs[0].output_ids) == 6
    assert reqs[2].state is RequestState.FINISHED and len(reqs[2].output_ids) == 30
    assert pool.used_pages == 0
    assert decode.pop_finished("r0") is reqs[0]
    with pytest.raises(ValueError, match="request_id"):
        decode.get("r0")
    with pytest.raises(ValueError, match="request_id"):
        decode.cancel("unknown")


def test_decode_stops_on_stop_token(tiny):
    prompts = _prompts([15], seed=9)
    free_run = generate(prompts, SamplingParams(temperature=0, max_new_tokens=12), model=tiny)
    tokens = free_run[0].output_token_ids
    stop = tokens[5]
    cut = tokens.index(stop) + 1
    out = generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)), model=tiny)
    assert out[0].output_token_ids == tokens[:cut]
    assert out[0].finish_reason == "stop"


def test_decode_add_request_validation(tiny):
    pool, prefill, decode = _engines(tiny)
    res = prefill.prefill([PrefillRequest("a", [1, 2, 3], GREEDY)])[0]
    with pytest.raises(ValueError, match="prompt_len"):
        decode.add_request("a", 4, res.first_token, GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        decode.add_request("ghost", 3, 1, GREEDY)
    with pytest.raises(ValueError, match="first_token"):
        decode.add_request("a", 3, 10**6, GREEDY)
    decode.add_request("a", 3, res.first_token, GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        decode.add_request("a", 3, res.first_token, GREEDY)
    decode.cancel("a")
    assert pool.used_pages == 0


def test_decode_pool_exhaustion_ends_the_newest_request(tiny):
    # 16-token pages; each prompt fills its only page, so the first decode step needs new pages
    pool, prefill, decode = _engines(tiny, num_pages=2, page_size=16)
    res = prefill.prefill([PrefillRequest("a", _prompts([16])[0], GREEDY),
                           PrefillRequest("b", _prompts([16], seed=1)[0], GREEDY)])
    for r in res:
        decode.add_request(r.request_id, r.kv_len, r.first_token, SamplingParams(temperature=0, max_new_tokens=4))
    out = decode.step()
    assert out[0] == StepOutput("b", None, True, FinishReason.KV_EXHAUSTED)
    assert decode.get("b").state is RequestState.FINISHED and not pool.has("b")
    assert out[1].request_id == "a" and out[1].token is not None
    decode.run_until_done()
    assert len(decode.get("a").output_ids) == 4
    assert pool.used_pages == 0 and not decode.has_unfinished()
