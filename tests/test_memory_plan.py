"""The replica memory plan (``model_executor/memory_plan.py``), the pools sized or refused from
it (``serving.runtime``), the launcher's banner and refusal, and admission against the pools.

Expected figures are written by hand below (the small config's arithmetic spelled out), or come
from an independent source (the built model's own parameters)."""

from __future__ import annotations

import types

import pytest
import torch

from model_executor.memory_plan import forward_bytes, ForwardShape, measure_forward_peak, plan_memory, weight_bytes

# 2 layers, hidden 64, MLP 128, 4 query / 2 KV heads of d 16, vocab 100, untied
SMALL = types.SimpleNamespace(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=False)
BF16 = torch.bfloat16


def small_plan(**over):
    args = dict(role="prefill", dtype=BF16, kv_dtype=BF16, page_size=16, forward_tokens=32, max_context=256,
                device_total_bytes=1_000_000, fraction=0.5, reserve_bytes=10_000)
    return plan_memory(SMALL, **{**args, **over})


def test_small_config_by_hand():
    plan = small_plan()
    # per layer: q,k,v 64*16*(4+2+2) = 8192; o 4*16*64 = 4096; gate/up/down 3*64*128 = 24576; norms 128
    # -> 36992; 2 layers + embedding and lm_head 2*100*64 + final norm 64 = 86848 params, 2 bytes each
    assert plan.weight_bytes == 173_696
    # K+V, 2 layers, 16 tokens, 2 KV heads, d 16, bf16
    assert plan.page_bytes == 4096
    # T = 32 tokens at 256 keys; g = 2: one query tile; 2 blocks of 128; 4 key tiles of 64
    # both phases: the layer's input, held by the model's loop, 32*64*2 = 4096
    # attention: residual + normed 2*32*64*2 = 8192; q,k,v 32*8*16*2 = 8192; out 32*4*16*2 = 4096;
    #   lse 32*4*4 = 512; no split (the 256 keys give <= 4 tiles: one split); index: fp32 means
    #   2*2*2*16*4 = 512, K means 2*2*16*2 = 128, two bit sets 2*2*1*1*4 = 16, tiles 2*1*4*4 = 32;
    #   o_proj 32*64*2 = 4096 -> 25776 + 4096 = 29872
    # mlp: 2*32*64*2 = 8192, gate/up/silu 3*32*128*2 = 24576, down + sum 8192 -> 40960 + 4096 = 45056 (the peak)
    # per forward: cos/sin 2*32*16*2 = 2048; one logits row 100*(2+8) = 1000
    assert plan.workspace_bytes == 48_104
    # budget 500000 - 173696 - 48104 - 10000 = 268200 -> 65 pages of 4096
    assert (plan.max_pages, plan.num_pages, plan.fixed_pages) == (65, 65, False)
    assert plan.need_pages == 16 and plan.tokens == 65 * 16
    assert plan.problems() == []
    assert plan.check() is plan


def test_eager_silu_fp8_weights_and_decode_by_hand():
    # eager SiLU: one more 32*128*2 = 8192 in the MLP phase
    assert small_plan(fused_silu=False).workspace_bytes == 48_104 + 8192
    # FP8 projections: per layer 36864 weights at 1 byte instead of 2, plus 512 fp32 row scales
    # (q,k,v 16*8 + o 64 + gate/up 256 + down 64): 173696 - 2*(36864 - 2048)
    assert small_plan(fp8_weights=True).weight_bytes == 104_064
    # decode: 4 sequences of one token at 256 keys, CUDA graphs' pool (one more forward)
    # attention: the layer's input 512 + 1024 + 1024 + 512 + 64 + partials 4*4*128*17*4 = 139264
    #   + o_proj 512 = 142912; mlp 512 + 1024 + 3072 + 1024; per forward 256 + 4 rows * 1000 = 4256
    #   -> (142912 + 4256) * 2
    plan = small_plan(role="decode", forward_tokens=4, sequences=4, logit_rows=4, extra_forwards=1)
    assert plan.workspace_bytes == 294_336


def test_fixed_pages_and_refusals_name_the_argument():
    plan = small_plan(num_pages=65)
    assert plan.fixed_pages and plan.problems() == []
    with pytest.raises(ValueError, match=r"^num_pages: 66 pages .* at most 65 pages; lower num_pages or raise fraction"):
        small_plan(num_pages=66).check()
    with pytest.raises(ValueError, match=r"^max_context: 256 tokens need 16 KV pages .* holds 15 \(240 tokens"):
        small_plan(num_pages=15).check()
    # the share holds no page after the weights: the fraction is what to change
    with pytest.raises(ValueError, match=r"^fraction: prefill needs .* its share 0.2 x"):
        small_plan(fraction=0.2).check()
    names = {"num_pages": "kv.prefill_pages", "fraction": "prefill.gpu_memory_fraction"}
    (line,) = small_plan(num_pages=100).problems(names)
    assert line.startswith("kv.prefill_pages: 100 pages") and "raise prefill.gpu_memory_fraction" in line


@pytest.mark.parametrize("bad, match", [
    ({"role": "both"}, "role"), ({"forward_tokens": 0}, "forward_tokens"), ({"max_context": 0}, "max_context"),
    ({"fraction": 0.0}, "fraction"), ({"fraction": 1.5}, "fraction"), ({"fraction": True}, "fraction"),
    ({"num_pages": 0}, "num_pages"), ({"page_size": 0}, "page_size"), ({"extra_forwards": -1}, "extra_forwards"),
    ({"device_total_bytes": 0}, "device_total_bytes"),
])
def test_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=rf"^{match}:"):
        small_plan(**bad)


@pytest.mark.parametrize("name", ["builtin:tiny", "builtin:structured-tiny"])
def test_weights_match_the_built_model(name):
    from model_executor.loading import load_model, model_shape

    loaded = load_model(name, dtype=BF16, device="cpu", seed=0)
    params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert weight_bytes(model_shape(name), dtype=BF16) == params


def test_measure_needs_cuda():
    runner = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="^runner: expected a runner on CUDA"):
        measure_forward_peak(runner, 16, 64)
    with pytest.raises(ValueError, match="^max_context"):
        measure_forward_peak(runner, 64, 16)


# ------------------------------------------------------------------------------- serving: pools
def _config(**options):
    from serving.config import ServiceConfig

    return ServiceConfig(model="builtin:tiny", **options)


def test_auto_pool_from_a_fake_device():
    from serving.runtime import replica_memory_plan

    config = _config(max_batch_tokens=1024, page_size=16)
    small = replica_memory_plan(config, "prefill", device_total_bytes=4 << 30, share=0.5)
    # builtin:tiny: K+V of 4 layers, 16 tokens, 2 KV heads, d 64, bf16 on CUDA
    assert small.page_bytes == 2 * 4 * 16 * 2 * 64 * 2 == 32768
    assert small.fraction == pytest.approx(0.45) and not small.fixed_pages
    # 1 GiB more device memory: 0.45 GiB more share, all of it pages
    big = replica_memory_plan(config, "prefill", device_total_bytes=5 << 30, share=0.5)
    assert big.num_pages - small.num_pages in ((0.45 * (1 << 30)) // 32768, (0.45 * (1 << 30)) // 32768 + 1)
    own = replica_memory_plan(_config(prefill={"gpu_memory_fraction": 0.25}), "prefill", device_total_bytes=4 << 30,
                              share=0.5)
    assert own.fraction == 0.25
    fixed = replica_memory_plan(_config(decode_kv_pages=300), "decode", device_total_bytes=4 << 30)
    assert fixed.fixed_pages and fixed.num_pages == 300 and fixed.fraction == pytest.approx(0.9)


def test_refusals_name_the_options():
    from serving.runtime import check_plan, replica_memory_plan

    config = _config(decode_kv_pages=1 << 20)
    plan = replica_memory_plan(config, "decode", device_total_bytes=4 << 30)
    with pytest.raises(ValueError, match=r"^kv.decode_pages: 1048576 pages .* lower kv.decode_pages or raise "
                                         r"decode.gpu_memory_fraction"):
        check_plan(config, plan)
    # a configured prompt length the pool cannot hold is refused; left unset, the limit is the pool's
    config = _config(max_model_len=4096, prefill_kv_pages=10, page_size=16)
    plan = replica_memory_plan(config, "prefill", device_total_bytes=4 << 30)
    with pytest.raises(ValueError, match=r"^model.max_model_len: 4096 tokens need 256 KV pages"):
        check_plan(config, plan)
    unset = _config(prefill_kv_pages=10, page_size=16)
    check_plan(unset, replica_memory_plan(unset, "prefill", device_total_bytes=4 << 30))


def test_cpu_pools():
    from serving.runtime import CPU_AUTO_PAGES, pool_pages

    cpu = torch.device("cpu")
    assert pool_pages(_config(), "prefill", cpu) == CPU_AUTO_PAGES == 1024
    assert pool_pages(_config(decode_kv_pages=77), "decode", cpu) == 77


def test_page_options():
    from serving.config import ConfigError, parse_option_value

    assert _config().kv.prefill_pages == "auto" and _config().decode.gpu_memory_fraction is None
    assert parse_option_value("kv.decode_pages", "auto") == "auto" and parse_option_value("kv.decode_pages", "9") == 9
    with pytest.raises(ConfigError, match=r"^kv.prefill_pages: expected \"auto\" or an int >= 1, got 0"):
        _config(prefill_kv_pages=0)
    with pytest.raises(ConfigError, match=r"^prefill.gpu_memory_fraction:"):
        _config(prefill={"gpu_memory_fraction": 0.0})


# ------------------------------------------------------------------------------- the launcher
H100 = (1, 81559 << 20)  # nvidia-smi's memory.total of an H100 80GB HBM3, in MiB
CELL = {"model": "builtin:structured-8b", "max_model_len": 131072 + 64, "max_batch_tokens": 131072,
        "prefill_chunk_tokens": 0}  # bench_service's sparse_bf16_sjf: whole 128K prompts per forward


def test_launcher_plans_the_bf16_cell_on_one_h100():
    from router.launcher import memory_plan
    from serving.config import ServiceConfig

    # whole 128K prompts: the forward's activations leave the prefill pool no room for one of them
    lines, problems = memory_plan(ServiceConfig(**CELL), H100)
    assert [line.split(":")[0] for line in lines] == ["prefill", "decode"]
    assert len(problems) == 1 and problems[0].startswith("model.max_model_len: 131136 tokens need 2049 KV pages")
    assert "lower prefill.max_batch_tokens" in problems[0]
    # 8K chunks: both replicas fit the card, each pool holding a whole 128K sequence
    lines, problems = memory_plan(ServiceConfig(**{**CELL, "max_batch_tokens": 8192, "prefill_chunk_tokens": 8192}),
                                  H100)
    assert problems == []
    pages = [int(line.split("KV ")[1].split(" pages")[0]) for line in lines]
    assert all(p >= 2049 for p in pages), lines
    # the H200's pools by hand (2560 / 5120 pages of 8 MiB) do not fit an H100's halves
    _, problems = memory_plan(ServiceConfig(**{**CELL, "max_batch_tokens": 8192, "prefill_kv_pages": 2560,
                                               "decode_kv_pages": 5120}), H100)
    assert [p.split(":")[0] for p in problems] == ["kv.prefill_pages", "kv.decode_pages"]
    # no GPU: nothing to plan, nothing refused
    lines, problems = memory_plan(ServiceConfig(), None)
    assert problems == [] and "not planned" in lines[0]


def test_launcher_refuses_before_ray(monkeypatch, capsys):
    from router import launcher
    from serving.config import ServiceConfig

    monkeypatch.setattr(launcher, "local_gpus", lambda: H100)
    monkeypatch.setattr(launcher, "prepare_environment", lambda *a, **k: pytest.fail("Ray must not start"))
    rc = launcher.serve_forever(ServiceConfig(**{**CELL, "decode_kv_pages": 5120}), launcher.LocalServeOptions(),
                                wait=lambda: pytest.fail("must not serve"))
    err = capsys.readouterr().err
    assert rc == 2 and "not starting" in err and "kv.decode_pages: 5120 pages" in err
    assert "model.max_model_len: 131136 tokens" in err


# ------------------------------------------------------------------------------- admission
def _ingress(**options):
    return types.SimpleNamespace(config=_config(**options))


def _request(prompt_len, max_tokens):
    return types.SimpleNamespace(batch=None, prompt_token_ids=[1] * prompt_len, max_tokens=max_tokens)


def test_admission_refuses_beyond_a_fixed_pool():
    from router.app import OpenAIIngress, decode_tokens
    from serving.errors import RequestError

    ingress = _ingress(page_size=16, prefill_kv_pages=4, decode_kv_pages=8)
    OpenAIIngress._check_capacity(ingress, _request(64, 64))  # 4 pages prefill, 8 decode: fits exactly
    with pytest.raises(RequestError, match="^prompt: 65 tokens need 5 KV pages") as err:
        OpenAIIngress._check_capacity(ingress, _request(65, 1))
    assert err.value.status == 400
    with pytest.raises(RequestError, match=r"^max_tokens: prompt \(64\) \+ max_tokens \(65\) need 9") as err:
        OpenAIIngress._check_capacity(ingress, _request(64, 65))
    assert err.value.status == 400
    assert decode_tokens(ingress.config) == 128
    # "auto" pools: the ingress cannot know them; the replicas refuse (below)
    OpenAIIngress._check_capacity(_ingress(), _request(1 << 20, 1))
    assert decode_tokens(_config()) is None


def test_a_decode_pool_too_small_is_bad_input_not_overload():
    from router.retry import RetryPolicy
    from serving.errors import RequestError
    from serving.messages import TransferFailed

    policy = RetryPolicy(_config())
    never = TransferFailed(reason="pool_exhausted", retryable=False, message="300 pages exceed this replica's 256",
                           replica_id="d0")
    with pytest.raises(RequestError, match="^max_tokens: the request needs more KV pages") as err:
        policy.after_transfer_failure(never, 0, "r")
    assert err.value.status == 400 and "300 pages exceed" in str(err.value)
    full = TransferFailed(reason="pool_exhausted", retryable=True, message="full", replica_id="d0")
    with pytest.raises(RequestError) as err:
        policy.after_transfer_failure(full, policy.config.transfer.retries, "r")
    assert err.value.status == 429


# ------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens, context", [(8192, 32768), (2048, 32768), (16384, 16384)])
def test_analytic_peak_bounds_a_real_forward(tokens, context):
    """The arithmetic against ``torch.cuda.max_memory_allocated`` of the worst-case forward, on
    the 8B shape cut to 2 layers (a layer's peak is the forward's): the plan may not be below
    the measurement, nor above it by more than 1.5x + 256 MiB (it rounds up: every visible tile
    in the index, split partials where the kernel may split)."""
    from kv_cache import KVPool, KVPoolConfig
    from model_executor.loading import model_shape
    from model_executor.runner import ModelRunner
    from model_executor.structured_model import build_structured_llama, llama31_8b_spec

    from kernels.config import SparseConfig

    device = torch.device("cuda")
    model = build_structured_llama(llama31_8b_spec(num_layers=2), device=device, dtype=BF16).eval()
    config = model.config
    pool = KVPool(KVPoolConfig(num_layers=2, num_kv_heads=8, head_dim=128, page_size=64, dtype=BF16,
                               device="cuda", num_pages=context // 64 + 1))
    runner = ModelRunner(model, pool, SparseConfig(alpha=0.1), dense_below=0, device=device)
    measure_forward_peak(runner, tokens, context)  # compile and autotune outside the measurement
    measured = measure_forward_peak(runner, tokens, context)
    shape = ForwardShape(tokens=tokens, sequences=1, max_context=context, logit_rows=1)
    planned = forward_bytes(config, shape, dtype=BF16, fused_silu=bool(runner.fused_counts.get("silu_mul")))
    assert model_shape("builtin:structured-8b").hidden_size == config.hidden_size
    print(f"T={tokens} keys={context}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
    assert measured <= planned <= 1.5 * measured + (256 << 20)
