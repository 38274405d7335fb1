"""The FP8 path's Triton quantization kernels (kernels/triton_fp8.py) against the eager PyTorch
versions they replace: the same e4m3 bytes. Runs the real kernels under TRITON_INTERPRET=1 on
CPU (the conftest makes the interpreter's fp32 -> e4m3 cast round to nearest even, as the GPU
does), and on CUDA where there is one."""

from __future__ import annotations

import zlib

import pytest
import torch

from kernels import fp8
from kernels.ops import triton_available
from kv_cache import KVPool, KVPoolConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not triton_available(device):
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    return device


def _wide(shape, gen, dtype):
    """Random values over many binades (e4m3 subnormals up to past the saturation point)."""
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    return x.to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("margin", [1.0, 0.25])  # 0.25: a quarter of the values saturate
def test_quantize_per_tensor_matches_eager(device, dtype, margin):
    device = _device(device)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{margin}".encode()))
    x = _wide((257, 3, 40), gen, dtype)
    x.view(-1)[:4] = x.abs().max() * torch.tensor([1.0, -0.9, 0.6, -0.3]).to(dtype)  # past amax / 4
    x = x.to(device)
    want, want_d = fp8.quantize_per_tensor(x, margin=margin, backend="reference")
    got, got_d = fp8.quantize_per_tensor(x, margin=margin, backend="triton")
    assert got.dtype == fp8.FP8_DTYPE and got.shape == x.shape
    assert torch.equal(got_d, want_d)
    assert torch.equal(_bits(got), _bits(want))
    # margin 1: the largest value lands on 448 exactly; 0.25: every value past amax / 4 saturates
    assert int((got.float().abs() == fp8.FP8_MAX).sum()) >= (1 if margin == 1.0 else 4)
    # a non-contiguous view quantizes like its contiguous copy
    t = x.transpose(0, 2)
    assert torch.equal(_bits(fp8.quantize_per_tensor(t, margin=margin, backend="triton")[0]),
                       _bits(fp8.quantize_per_tensor(t.contiguous(), margin=margin, backend="reference")[0]))


def test_quantize_per_tensor_empty_and_bad_backend():
    _device("cpu")
    x8, d = fp8.quantize_per_tensor(torch.empty(0, 4), backend="triton")
    assert x8.shape == (0, 4) and d.shape == (1,)
    with pytest.raises(ValueError, match="backend: expected one of"):
        fp8.quantize_per_tensor(torch.ones(3), backend="fast")


def _pool(device, page_size, head_dim, num_heads=3):
    return KVPool(KVPoolConfig(num_layers=2, num_kv_heads=num_heads, head_dim=head_dim, page_size=page_size,
                               dtype=torch.float8_e4m3fn, device=str(device), num_pages=12))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size, head_dim, tokens", [(16, 64, 70), (4, 96, 33), (64, 128, 100)])
def test_pool_write_kernel_matches_eager(device, page_size, head_dim, tokens):
    device = _device(device)
    gen = torch.Generator().manual_seed(page_size * 1000 + head_dim)
    pools = [_pool(device, page_size, head_dim) for _ in range(2)]
    scales = torch.rand(2, 2, 3, generator=gen) * 0.5 + 0.01  # not powers of two: the division rounds
    for pool in pools:
        for layer in range(2):
            pool.set_scales(layer, scales[0, layer], scales[1, layer])
    capacity = pools[0].num_pages * page_size
    slots = torch.randperm(capacity, generator=gen)[:tokens].to(device)  # tokens land all over the pages
    for layer in range(2):
        k = _wide((tokens, 3, head_dim), gen, torch.bfloat16).to(device)
        v = _wide((tokens, 3, head_dim), gen, torch.bfloat16).to(device)
        pools[0].write(layer, slots, k, v, backend="reference")
        pools[1].write(layer, slots, k, v, backend="triton")
    assert torch.equal(_bits(pools[1].k_raw), _bits(pools[0].k_raw))
    assert torch.equal(_bits(pools[1].v_raw), _bits(pools[0].v_raw))
    assert int((pools[0].k_raw.float().abs() == fp8.FP8_MAX).sum()) > 0  # saturation was exercised


def test_pool_write_backend_errors(monkeypatch):
    pool = _pool("cpu", 4, 32)
    slots, x = torch.arange(2), torch.ones(2, 3, 32)
    with pytest.raises(ValueError, match="backend: expected 'auto', 'triton' or 'reference'"):
        pool.write(0, slots, x, x, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend: 'triton' needs a CUDA pool or TRITON_INTERPRET=1"):
        pool.write(0, slots, x, x, backend="triton")
    pool.write(0, slots, x, x)  # auto on a CPU pool: the eager write
    assert torch.equal(pool.k[0].view(-1, 3, 32)[:2].float(), fp8.quantize(x, pool.k_scale[0].view(1, -1, 1)).float())


def test_model_prefill_writes_the_same_fp8_pages_with_either_backend(monkeypatch):
    """The runner's FP8 path end to end: backend "triton" quantizes q and writes the pool with the
    kernels above, "reference" eagerly; layer 0's pages after a prefill must agree byte for byte
    (later layers' K/V follow attention outputs, which the two backends' kernels round apart)."""
    _device("cpu")
    from kernels.config import SparseConfig
    from model_executor import ModelRunner, PrefillItem, build_tiny_model
    from model_executor.loading import make_pool

    from kernels import triton_fp8

    calls = {"write_pages": 0, "quantize_per_tensor": 0}
    for name in calls:
        real = getattr(triton_fp8, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_fp8, name, counted)
    loaded = build_tiny_model(seed=0)
    prompt = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    pools, logits = [], []
    for backend in ("reference", "triton"):
        pool = make_pool(loaded, num_pages=8, page_size=16, dtype=torch.float8_e4m3fn)
        runner = ModelRunner(loaded.model, pool, SparseConfig(alpha=0.0), dense_below=4096, backend=backend,
                             fused_ops=False)
        runner.calibrate_kv_scales()
        before = dict(calls)
        runner.ensure_capacity("r", len(prompt))
        logits.append(runner.prefill([PrefillItem("r", prompt)]))
        pools.append(pool)
        layers = loaded.num_layers
        used = {k: calls[k] - before[k] for k in calls}
        assert used == ({"write_pages": layers, "quantize_per_tensor": layers} if backend == "triton"
                        else {"write_pages": 0, "quantize_per_tensor": 0})
    assert torch.equal(pools[0].k_scale, pools[1].k_scale)
    assert torch.equal(_bits(pools[1].k_raw[0]), _bits(pools[0].k_raw[0]))
    assert torch.equal(_bits(pools[1].v_raw[0]), _bits(pools[0].v_raw[0]))
    assert pools[1].k_raw[0].float().abs().sum() > 0  # something was written
    # the attention itself differs (Triton vs reference kernels on the same e4m3 inputs)
    assert int(logits[0].argmax()) == int(logits[1].argmax())
