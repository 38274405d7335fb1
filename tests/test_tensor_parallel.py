"""Tensor parallelism (model_executor/parallel.py, kv_cache/heads.py): the head layout, the
shard slices, and TP=2 against TP=1 over gloo in two spawned processes.

The TP=1 references are computed in this process by the same runner on the unsharded model; the
two ranks run the same scenarios on their shards (dense and sparse prefill, chunked prefill, the
prefix cache, greedy decode) for the tiny model (8/2 heads) and a model with one KV head (KV head
replicated on both ranks), and load a saved checkpoint shard by shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.config import SparseConfig
from kv_cache.heads import HeadLayout, check_tp_size, divisors
from kv_transfer.routes import head_routes, transfer_routes
from model_executor import ModelRunner, PrefillItem
from model_executor import parallel
from model_executor.loading import LoadedModel, build_tiny_model, make_pool, tiny_config
from tests.helpers import run_tp_ranks

SEED = 1234
TOL = 2e-4  # fp32 logits: a sum of partial products in another order
SPARSE = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64)
PAGE = 16


def mqa_model() -> LoadedModel:
    """4 query heads, 1 KV head: at TP=2 the KV head is replicated."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config(2)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, cfg.head_dim = 4, 1, 128, 32
    cfg.intermediate_size = 256
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = LlamaForCausalLM(cfg).eval()
    return LoadedModel(name="mqa", model=model, tokenizer=None, config=model.config)


def mqa_repeated_model() -> LoadedModel:
    """The MQA model with its KV head repeated twice (4/2 heads, equal weights): the TP=1 model
    whose sparse index groups are the query heads of one rank at TP=2 (each replica selects
    blocks from its own query heads)."""
    from transformers import LlamaForCausalLM

    base = mqa_model().model
    cfg = base.config.__class__(**base.config.to_dict())
    cfg.num_key_value_heads = 2
    model = LlamaForCausalLM(cfg).eval()
    state = base.state_dict()
    for k in list(state):
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            state[k] = state[k].repeat(2, 1)
    model.load_state_dict(state)
    return LoadedModel(name="mqa-repeated", model=model, tokenizer=None, config=model.config)


def models() -> dict[str, LoadedModel]:
    return {"tiny": build_tiny_model(num_layers=2, seed=3), "mqa": mqa_model()}


def prompts(vocab: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(SEED)
    return {n: torch.randint(0, vocab, (k,), generator=g).tolist()
            for n, k in (("a", 37), ("b", 70), ("long", 300), ("shared", 2 * PAGE + 5))}


def scenarios(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Logits and greedy tokens of every scenario (the same code at TP=1 and on each rank)."""
    p = prompts(int(loaded.config.vocab_size))
    out = {}
    pool = make_pool(loaded, num_pages=64, page_size=PAGE)
    dense = ModelRunner(loaded.model, pool, SPARSE, dense_below=1 << 20)
    for rid in ("a", "b"):
        dense.ensure_capacity(rid, len(p[rid]) + 8)
    out["dense"] = dense.prefill([PrefillItem("a", p["a"]), PrefillItem("b", p["b"])])
    tokens, last = [], out["dense"].argmax(-1).tolist()
    for _ in range(6):  # greedy decode on both requests
        logits = dense.decode(["a", "b"], last)
        last = logits.argmax(-1).tolist()
        tokens.append(last)
    out["decode_logits"], out["greedy"] = logits, torch.tensor(tokens)
    pool.release("a"), pool.release("b")

    sparse = ModelRunner(loaded.model, pool, SPARSE, dense_below=0)
    sparse.ensure_capacity("long", 300)
    out["sparse"] = sparse.prefill([PrefillItem("long", p["long"])])
    pool.release("long")
    dense.ensure_capacity("long", 300)
    out["long_dense"] = dense.prefill([PrefillItem("long", p["long"])])
    pool.release("long")
    sparse.ensure_capacity("chunked", 300)
    for lo in range(0, 300, 128):  # chunked prefill: each chunk attends to the earlier ones
        out["chunked"] = sparse.prefill([PrefillItem("chunked", p["long"][lo:lo + 128], cached_len=lo)])
    pool.release("chunked")

    # prefix cache: the second request takes the first one's two full pages and computes the rest
    ids = p["shared"]
    digests = pool.prefix_digests(ids)
    dense.ensure_capacity("first", len(ids))
    out["prefix_first"] = dense.prefill([PrefillItem("first", ids)])
    pool.cache_prefix("first", digests[: len(ids) // PAGE])
    pool.release("first")
    cached = pool.reserve_with_prefix("second", digests[: len(ids) // PAGE], len(ids))
    out["prefix_cached"] = torch.tensor(cached)
    out["prefix_second"] = dense.prefill([PrefillItem("second", ids[cached:], cached_len=cached)])
    pool.release("second")
    pool.clear_prefix_cache()
    out["pages_left"] = torch.tensor(pool.used_pages)
    return out


def _rank_main(rank: int, tp, ckpt: str) -> dict:
    results = {}
    for name, loaded in models().items():
        full = sum(t.numel() for t in loaded.model.state_dict().values())
        parallel.shard_model(loaded.model, tp)
        results[name] = scenarios(loaded)
        results[name]["elements"] = torch.tensor(
            [sum(t.numel() for t in loaded.model.state_dict().values()), full])
    from model_executor.loading import load_model_dir

    shard = load_model_dir(ckpt, load_tokenizer=False, tp=tp)
    results["ckpt"] = scenarios(shard)
    results["ckpt"]["read"] = torch.tensor(shard.model._fpv2_loaded_elements)
    results["ckpt"]["held"] = torch.tensor(sum(t.numel() for t in shard.model.state_dict().values()))
    results["ckpt"]["q_rows"] = torch.tensor(shard.model.model.layers[0].self_attn.q_proj.weight.shape[0])
    return results


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Both ranks' results, and the TP=1 references."""
    tmp = tmp_path_factory.mktemp("tp2")
    ckpt = tmp / "ckpt"
    build_tiny_model(num_layers=2, seed=3).model.save_pretrained(ckpt)
    ranks = run_tp_ranks(_rank_main, 2, tmp, str(ckpt))
    refs = {name: scenarios(loaded) for name, loaded in models().items()}
    refs["mqa-repeated"] = scenarios(mqa_repeated_model())
    return refs, ranks


@pytest.mark.parametrize("name", ["tiny", "mqa", "ckpt"])
def test_tp2_logits_and_greedy_tokens_equal_tp1(tp2, name):
    refs, ranks = tp2
    ref = refs["tiny" if name == "ckpt" else name]
    for rank in ranks:
        got = rank[name]
        for key in ("sparse", "chunked"):
            # N > Hkv: each replica of the KV head selects blocks from its own query heads, as the
            # TP=1 model with the KV head repeated does (whose dense logits are the model's)
            want = refs["mqa-repeated"][key] if name == "mqa" else ref[key]
            err = (got[key] - want).abs().max().item()
            assert err <= TOL, f"{name} rank {ranks.index(rank)} {key}: max |TP2 - TP1| = {err}"
        for key in ("dense", "decode_logits", "long_dense", "prefix_first", "prefix_second"):
            err = (got[key] - ref[key]).abs().max().item()
            assert err <= TOL, f"{name} rank {ranks.index(rank)} {key}: max |TP2 - TP1| = {err}"
        assert torch.equal(got["greedy"], ref["greedy"])
        assert int(got["prefix_cached"]) == 2 * PAGE == int(ref["prefix_cached"])
        assert int(got["pages_left"]) == 0
    if name == "mqa":
        rep = refs["mqa-repeated"]
        assert (rep["long_dense"] - ref["long_dense"]).abs().max() <= TOL
        assert (rep["sparse"] - ref["sparse"]).abs().max() > 10 * TOL  # the selection differs
    # the sparse path really drops blocks (else it would not be told apart from dense)
    assert (ref["sparse"] - ref["long_dense"]).abs().max() > 10 * TOL


def test_each_rank_holds_and_reads_only_its_shard(tp2):
    _, ranks = tp2
    cfg = tiny_config(2)
    hidden, inter, vocab, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    # by hand: embedding + lm_head + 2 x (2 norms) + final norm, whole; q/k/v/o and MLP halved
    replicated = 2 * vocab * hidden + 2 * 2 * hidden + hidden
    per_layer_full = hidden * d * (8 + 2 + 2) + 8 * d * hidden + 3 * hidden * inter
    want = replicated + 2 * per_layer_full // 2
    for rank in ranks:
        assert int(rank["ckpt"]["read"]) == want
        assert int(rank["ckpt"]["held"]) == want
        assert int(rank["ckpt"]["q_rows"]) == 4 * d
        held, full = rank["tiny"]["elements"].tolist()
        assert held == want and full == replicated + 2 * per_layer_full
    assert parallel.shard_param_bytes(cfg, 2, bytes_per_param=1) == want


def test_head_layouts():
    lay = HeadLayout(8, 2, 2)
    assert [list(lay.q_heads(r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(lay.kv_heads(r)) for r in range(2)] == [[0], [1]]
    rep = HeadLayout(8, 2, 4)  # replicated: 2 ranks per KV head
    assert [list(rep.kv_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert rep.kv_replicas == 2 and rep.holders(1) == [2, 3] and rep.local_kv_heads == 1
    assert divisors(40, 8) == [1, 2, 4, 8, 40]
    assert divisors(8, 2) == [1, 2, 4, 8]


def test_head_routes_cover_every_destination_head_once():
    for p, d in ((2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (8, 2)):
        src, dst = HeadLayout(8, 2, p), HeadLayout(8, 2, d)
        routes = head_routes(src, dst)
        for r in range(d):
            mine = [x for x in routes if x.dst_rank == r]
            assert [x.kv_head for x in mine] == list(dst.kv_heads(r))
            for x in mine:
                assert x.kv_head == src.kv_heads(x.src_rank)[x.src_local]
                assert x.kv_head == dst.kv_heads(x.dst_rank)[x.dst_local]
        assert sum(len(v) for v in transfer_routes(src, dst).values()) == len(routes)
    # 4 -> 2: decode rank 0 needs head 0, held by prefill ranks 0 and 1 (replicas): one sends it
    assert {(x.src_rank, x.dst_rank) for x in head_routes(HeadLayout(8, 2, 8), HeadLayout(8, 2, 2))} == {(0, 0), (5, 1)}


@pytest.mark.parametrize("size, msg", [(3, "query heads"), (0, "int >= 1"), (True, "int >= 1"), (16, "query heads")])
def test_bad_tp_sizes_name_the_option(size, msg):
    with pytest.raises(ValueError, match=f"decode.tensor_parallel_size: .*{msg}"):
        check_tp_size(size, 8, 2, name="decode.tensor_parallel_size")


def test_bad_layouts_and_ranks():
    with pytest.raises(ValueError, match="KV heads or be a multiple"):
        check_tp_size(4, 12, 6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        HeadLayout(8, 3)
    with pytest.raises(ValueError, match="rank"):
        HeadLayout(8, 2, 2).kv_heads(2)
    with pytest.raises(ValueError, match="kv_head"):
        HeadLayout(8, 2, 2).holders(2)
    with pytest.raises(ValueError, match="dst"):
        head_routes(HeadLayout(8, 2), HeadLayout(8, 4))
    with pytest.raises(ValueError, match="group"):
        parallel.TensorParallel(0, 2)
    with pytest.raises(ValueError, match="rank"):
        parallel.TensorParallel(2, 2, group=object())
    with pytest.raises(ValueError, match="tp"):
        parallel.shard_model(build_tiny_model(num_layers=1).model, "2")
    with pytest.raises(ValueError, match="MLP width"):
        cfg = tiny_config(1)
        cfg.intermediate_size = 510
        parallel.layout_of(cfg, 4)


def test_shard_on_meta_and_fp8_shards_keep_their_scales():
    from model_executor.fp8_linear import Fp8Linear, quantize_model

    loaded = build_tiny_model(num_layers=1)
    quantize_model(loaded.model, "channel")
    full_q = loaded.model.model.layers[0].self_attn.q_proj
    full_o = loaded.model.model.layers[0].self_attn.o_proj
    tp = parallel.TensorParallel(1, 2, group=object())  # rank 1 of 2; no forward runs here
    parallel.shard_model(loaded.model, tp)
    q = loaded.model.model.layers[0].self_attn.q_proj
    o = loaded.model.model.layers[0].self_attn.o_proj
    assert isinstance(q, Fp8Linear) and q.weight.shape == (4 * 64, 256)
    assert torch.equal(q.weight.view(torch.uint8), full_q.weight[4 * 64:].view(torch.uint8))
    assert torch.equal(q.weight_scale, full_q.weight_scale[4 * 64:])
    assert o.weight.shape == (256, 4 * 64) and torch.equal(o.weight_scale, full_o.weight_scale)
    pool = make_pool(loaded, num_pages=4, page_size=PAGE)
    assert pool.num_kv_heads == 1
    with pytest.raises(ValueError, match="already sharded"):
        parallel.shard_model(loaded.model, tp)
    with pytest.raises(ValueError, match="rank 1's shard of 2"):
        ModelRunner(loaded.model, make_pool(build_tiny_model(num_layers=1), num_pages=4, page_size=PAGE))
