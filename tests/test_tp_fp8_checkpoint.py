"""FP8 checkpoint directories at TP > 1 (model_executor/checkpoint.py ``load_fp8_shard``): each of
2 ranks (gloo, spawned processes) reads only its shard of the e4m3 weights and the matching slice
of their scales (per tensor, per channel, 128x128 blocks); its layers hold exactly the slices of
the TP=1 load, its logits equal those of the TP=1 model sharded in memory and the TP=1 logits
within FP8 tolerance, and it reads and holds only its shard's elements. A block-scaled shard
boundary off a multiple of 128 is a ValueError naming the option."""

from __future__ import annotations


import pytest
import torch

from model_executor import fp8_linear, parallel
from tests.helpers import run_tp_ranks
from tests.test_fp8_linear import write_checkpoint

PROMPTS = [[5, 9, 11, 40, 3, 7, 90, 2], [100, 101, 7, 7, 7, 200, 13, 1, 66, 31, 250]]
FORMATS = ("hf_fp8_tensor", "ct_fp8_channel", "hf_fp8_block")


def model_for(fmt: str):
    """A float32 model whose shards fit the format: the block scheme needs 128-row KV shards
    (head_dim 128); the others take the built-in tiny shape (64-row KV shards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_executor.loading import tiny_config

    cfg = tiny_config(2)
    if fmt == "hf_fp8_block":
        cfg = LlamaConfig(**{**cfg.to_dict(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128})
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return model


@torch.inference_mode()
def logits(model) -> torch.Tensor:
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])


def _rank_main(rank: int, tp, ckpts: dict) -> dict:
    from model_executor.loading import load_model_dir

    out = {}
    for fmt, path in ckpts.items():
        shard = load_model_dir(path, load_tokenizer=False, tp=tp, dtype=torch.float32)
        layers = fp8_linear.fp8_layers(shard.model)
        out[fmt] = {
            "logits": logits(shard.model),
            "read": shard.model._fpv2_loaded_elements,
            "held": sum(t.numel() for t in shard.model.state_dict().values()),
            "layers": {n: (m.weight.view(torch.uint8).clone(), m.weight_scale.clone()) for n, m in layers.items()},
        }
        # the TP=1 load of the same directory, sharded in memory (Fp8Linear.narrow)
        whole = load_model_dir(path, load_tokenizer=False, dtype=torch.float32)
        parallel.shard_model(whole.model, tp)
        out[fmt]["narrowed"] = logits(whole.model)
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from model_executor.loading import load_model_dir

    tmp = tmp_path_factory.mktemp("fp8tp2")
    ckpts = {fmt: str(write_checkpoint(tmp / fmt, model_for(fmt), fmt)) for fmt in FORMATS}
    ranks = run_tp_ranks(_rank_main, 2, tmp, ckpts)
    refs = {fmt: load_model_dir(path, load_tokenizer=False, dtype=torch.float32) for fmt, path in ckpts.items()}
    return refs, ranks


def _slices(name: str, cfg, rank: int, scheme: str, w: torch.Tensor, s: torch.Tensor):
    """The test's own shard of a TP=1 weight and scale: q/k/v/gate/up rows, o/down columns."""
    proj = name.rpartition(".")[2]
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rows = {"q_proj": hq * d // 2, "k_proj": hkv * d // 2, "v_proj": hkv * d // 2,
            "gate_proj": cfg.intermediate_size // 2, "up_proj": cfg.intermediate_size // 2}
    if proj in rows:
        n = rows[proj]
        ws = w[rank * n:(rank + 1) * n]
        if scheme == "channel":
            s = s[rank * n:(rank + 1) * n]
        elif scheme == "block":
            s = s[rank * n // 128:(rank + 1) * n // 128]
    else:
        k = w.shape[1] // 2
        ws = w[:, rank * k:(rank + 1) * k]
        if scheme == "block":
            s = s[:, rank * k // 128:(rank + 1) * k // 128]
    return ws, s


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_shards_hold_the_slices_and_match_tp1(tp2, fmt, capsys):
    refs, ranks = tp2
    ref = refs[fmt]
    want = logits(ref.model)
    cfg = ref.model.config
    whole = fp8_linear.fp8_layers(ref.model)
    scheme = next(iter(whole.values())).scheme
    for r, rank in enumerate(ranks):
        got = rank[fmt]
        assert set(got["layers"]) == set(whole)
        for name, (w8, scale) in got["layers"].items():
            ws, ss = _slices(name, cfg, r, scheme, whole[name].weight.view(torch.uint8), whole[name].weight_scale)
            assert torch.equal(w8, ws), (fmt, name)
            assert torch.equal(scale, ss), (fmt, name)
        # the same computation as the TP=1 load cut in memory
        assert torch.allclose(got["logits"], got["narrowed"], atol=1e-4, rtol=0), fmt
        # and TP=1: per-token activation scales of a row-parallel shard's half differ from the whole
        # row's (tensor, channel schemes), so within FP8 rounding; blocks quantize the same tiles
        rel = ((got["logits"] - want).abs().max() / want.abs().max()).item()
        with capsys.disabled():
            print(f"\n[{fmt}] rank {r}: max |TP2 - TP1| = {rel:.4f} of max |logit|")
        assert rel <= (1e-4 if scheme == "block" else 0.2), (fmt, rel)
        if scheme == "block":
            assert torch.equal(got["logits"].argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_rank_reads_and_holds_only_its_shard(tp2, fmt):
    refs, ranks = tp2
    cfg = refs[fmt].model.config
    hidden, inter, vocab, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    scheme = {"hf_fp8_tensor": "tensor", "ct_fp8_channel": "channel", "hf_fp8_block": "block"}[fmt]
    replicated = 2 * vocab * hidden + layers * 2 * hidden + hidden  # embeddings, lm_head, norms
    shapes = [(hq * d // 2, hidden), (hkv * d // 2, hidden), (hkv * d // 2, hidden), (hidden, hq * d // 2),
              (inter // 2, hidden), (inter // 2, hidden), (hidden, inter // 2)]  # q k v o gate up down
    col = [True, True, True, False, True, True, False]
    weights = sum(n * k for n, k in shapes)

    def scale_elems(n, k, is_col):
        if scheme == "tensor":
            return 1
        if scheme == "channel":
            return n
        return -(-n // 128) * -(-k // 128)

    scales = sum(scale_elems(n, k, c) for (n, k), c in zip(shapes, col))
    want = replicated + layers * (weights + scales)
    for rank in ranks:
        assert rank[fmt]["held"] == want, (fmt, rank[fmt]["held"], want)
        assert rank[fmt]["read"] == want, (fmt, rank[fmt]["read"], want)  # input_scale tensors: not read


def test_block_scales_off_128_boundaries_name_the_option(tmp_path):
    from model_executor.loading import fp8_scale_slice, load_model_dir

    fmt = fp8_linear.checkpoint_format({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert fp8_scale_slice("w", fmt, (256, 512), (0, 128, 128)) == (0, 1, 1)
    assert fp8_scale_slice("w", fmt, (256, 512), (1, 256, 256)) == (1, 2, 2)
    assert fp8_scale_slice("w", fmt, (200, 512), (0, 128, 72)) == (0, 1, 1)  # the last, partial tile
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: the shard \[64, 128\) of w"):
        fp8_scale_slice("w", fmt, (128, 512), (0, 64, 64))
    chan = fp8_linear.checkpoint_format({"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                             "strategy": "channel"}}}})
    assert fp8_scale_slice("w", chan, (128, 256), (0, 64, 64)) == (0, 64, 64)
    assert fp8_scale_slice("w", chan, (128, 256), (1, 128, 128)) is None
    tensor = fp8_linear.checkpoint_format({"quant_method": "fp8"})
    assert fp8_scale_slice("w", tensor, (128, 256), (0, 64, 64)) is None
    # the built-in tiny shape at TP 2: 64-row KV shards cannot carry 128x128 block scales
    path = write_checkpoint(tmp_path / "blk", model_for("hf_fp8_tensor"), "hf_fp8_block")
    tp = parallel.TensorParallel(1, 2, group=object())  # rank 1 of 2: the error comes before any collective
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: .*k_proj\.weight.*128 boundaries"):
        load_model_dir(path, load_tokenizer=False, tp=tp)
