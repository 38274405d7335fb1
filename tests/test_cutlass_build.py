"""CUTLASS attention library on a CPU machine: it compiles for sm_90a, loads through ctypes
without a GPU driver, caches builds, rejects bad arguments, and the host-side layout check of
its index mappings passes; backend selection rules of ``kernels.ops``.

One nvcc compile per test session (``built`` fixture, time printed with ``-s``); skipped with the
reason when nvcc or the CUTLASS headers are missing. The kernel's numerics are tested on a GPU
(tests/test_cutlass_attention.py).
"""

from __future__ import annotations

import ctypes
import shutil
import time
from pathlib import Path

import pytest
import torch

from kernels import cutlass_attention as ca
from kernels import cutlass_build as cb
from kernels import ops

needs_toolchain = pytest.mark.skipif(
    cb.find_nvcc() is None or cb.find_cutlass_include() is None,
    reason="needs nvcc and the CUTLASS headers (pip install nvidia-cutlass)",
)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    if cb.find_nvcc() is None or cb.find_cutlass_include() is None:
        pytest.skip("needs nvcc and the CUTLASS headers (pip install nvidia-cutlass)")
    out = tmp_path_factory.mktemp("fp_cutlass")
    t0 = time.perf_counter()
    result = cb.build(out)
    print(f"\nCUTLASS library built in {time.perf_counter() - t0:.1f} s: {result.path}")
    return result


@pytest.fixture(scope="session")
def built_shared(built):
    """The shared-CUDA-runtime flavour, next to the static one (what --out prebuilds)."""
    t0 = time.perf_counter()
    result = cb.build(built.path.parent, cudart="shared")
    print(f"\nshared-runtime flavour built in {time.perf_counter() - t0:.1f} s")
    return result


@pytest.fixture
def lib(built):
    return cb._load(str(built.path))


def _params(**kw):
    base = dict(num_splits=1, group_size=1, num_qo_heads=1, page_size=16, block_size=128,
                dtype=0, head_dim=128, sq_t=128, sq_h=128, sk_p=2048, sk_s=128, sk_h=128,
                sv_p=2048, sv_s=128, sv_h=128, sv_d=1)
    base.update(kw)
    return cb.FpAttnParams(**base)


# ------------------------------------------------------------------------------------------
# build, load, cache
# ------------------------------------------------------------------------------------------


def test_builds_for_sm90a_without_spills(built):
    assert built.path.is_file() and not built.cached
    usage = cb.ptxas_usage(built.log)
    kernels = {row["kernel"] for row in usage}
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            names = ("ws128", "ws64", "ws128_pingpong", "ws128_persistent",
                     "ws128_persistent_nopingpong", "combine")
            expect = {f"{name}<{dtype},d{d}>" for name in names}
            assert expect <= kernels, kernels
    for row in usage:
        assert row["arch"] == "sm_90a"
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0 and row["stack"] == 0, row
        assert row["registers"] <= 255, row


def test_sass_has_wgmma_and_cp_async(built):
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        try:
            import triton

            cand = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
            cuobjdump = str(cand) if cand.exists() else None
        except ImportError:
            pass
    if cuobjdump is None:
        pytest.skip("cuobjdump not found")
    import subprocess

    sass = subprocess.run([cuobjdump, "-sass", str(built.path)], capture_output=True,
                          text=True).stdout
    assert "HGMMA.64x64x16.F32.BF16" in sass  # S = Q K^T
    assert "HGMMA.64x128x16.F32.BF16" in sass  # O += P V at d = 128
    assert ".tnspB" in sass  # V read MN-major from the K-major buffer
    assert "LDGSTS" in sass  # cp.async K/V gather
    assert "FENCE.VIEW.ASYNC.S" in sass  # generic -> async proxy before wgmma


def test_loads_without_gpu_and_abi_matches(lib):
    assert lib.fp_abi_version() == cb.ABI_VERSION
    assert lib.fp_params_size() == ctypes.sizeof(cb.FpAttnParams)
    assert lib.fp_last_error() == b""


def test_build_cache_hits(built, built_shared, capsys):
    again = cb.build(built.path.parent)
    assert again.cached and again.seconds == 0.0 and again.path == built.path
    assert cb.ptxas_usage(again.log) == cb.ptxas_usage(built.log)
    # the command line prebuild (both flavours) reports the hits too
    assert cb.main(["--out", str(built.path.parent)]) == 0
    assert capsys.readouterr().out.count("cache hit") == 2


def test_fallback_to_shared_runtime(built_shared, tmp_path):
    """A static-runtime library that does not load (here: not a library at all) falls back to
    the shared-runtime one next to it, which finds libcudart.so.13 already loaded (as in a CUDA
    torch process; here the toolkit's, preloaded)."""
    roots = [Path(cb.find_nvcc()).resolve().parent.parent, Path("/usr/local/cuda")]
    found = [r / "lib64" / "libcudart.so.13" for r in roots if (r / "lib64" / "libcudart.so.13").exists()]
    if not found:
        pytest.skip("no libcudart.so.13 to stand in for torch's CUDA runtime")
    cudart = found[0]
    ctypes.CDLL(str(cudart), mode=ctypes.RTLD_GLOBAL)
    shutil.copy(built_shared.path, tmp_path / cb.LIB_NAME_SHARED_RT)
    (tmp_path / cb.LIB_NAME).write_text("not a shared object")
    lib = cb._open(str(tmp_path / cb.LIB_NAME))
    assert lib.fp_abi_version() == cb.ABI_VERSION
    assert lib.fp_params_size() == ctypes.sizeof(cb.FpAttnParams)
    (tmp_path / cb.LIB_NAME_SHARED_RT).unlink()
    with pytest.raises(OSError):
        cb._open(str(tmp_path / cb.LIB_NAME))


def test_build_key_tracks_sources(tmp_path, monkeypatch):
    nvcc, include = cb.find_nvcc(), cb.find_cutlass_include()
    if nvcc is None or include is None:
        pytest.skip("needs nvcc and the CUTLASS headers")
    key = cb.build_key(nvcc, include)
    assert cb.build_key(nvcc, include) == key
    src = tmp_path / "csrc"
    shutil.copytree(cb.SRC_DIR, src)
    (src / cb.MAIN_SOURCE).write_text((src / cb.MAIN_SOURCE).read_text() + "\n// edit\n")
    monkeypatch.setattr(cb, "SRC_DIR", src)
    assert cb.build_key(nvcc, include) != key
    assert cb.build_key(nvcc, include, ("-DX",)) != cb.build_key(nvcc, include)


def test_explicit_library_path(built, monkeypatch, tmp_path):
    monkeypatch.setenv(cb.ENV_LIB, str(built.path))
    assert cb.unavailable_reason() is None and ca.available()
    assert cb.library_path() == built.path
    monkeypatch.setenv(cb.ENV_LIB, str(tmp_path / "missing.so"))
    assert "is not a file" in cb.unavailable_reason()
    assert not ca.available()
    with pytest.raises(RuntimeError, match="not a file"):
        cb.library_path()


def test_unavailable_without_nvcc(monkeypatch):
    monkeypatch.delenv(cb.ENV_LIB, raising=False)
    monkeypatch.setattr(cb, "find_nvcc", lambda: None)
    assert "nvcc not found" in cb.unavailable_reason()
    with pytest.raises(RuntimeError, match="nvcc not found"):
        cb.build()


def test_unavailable_without_headers(monkeypatch, tmp_path):
    monkeypatch.delenv(cb.ENV_LIB, raising=False)
    monkeypatch.setattr(cb, "find_nvcc", lambda: "/usr/bin/true")
    monkeypatch.setenv(cb.ENV_INCLUDE, str(tmp_path))
    assert cb.find_cutlass_include() is None
    assert "headers not found" in cb.unavailable_reason()


@needs_toolchain
def test_layout_check(tmp_path):
    """csrc/layout_check.cu: accumulator row/col views, the P -> A-operand register map, the
    swizzled shared-memory layouts, evaluated on the CPU with the kernel's own CuTe types."""
    t0 = time.perf_counter()
    proc = cb.run_layout_check(tmp_path)
    print(f"\nlayout check ({time.perf_counter() - t0:.1f} s):\n{proc.stdout}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layout checks passed" in proc.stdout


def test_layout_check_compiles_on_the_host_compiler(monkeypatch, tmp_path):
    """Host code only: the host C++ compiler with the include flags of nvcc's dry run; nvcc
    itself without a host compiler or when the dry run names no includes."""
    top = tmp_path / "cuda 13"  # a space: the flags are shell-quoted in the dry run
    nvcc, exe, include = tmp_path / "nvcc", tmp_path / "lc", tmp_path / "cutlass"
    nvcc.write_text("#!/bin/sh\n"
                    f"echo '#$ TOP={top}/bin/..' >&2\n"
                    f"echo '#$ INCLUDES=\"-I{top}/include\"  ' >&2\n"
                    f"echo '#$ SYSTEM_INCLUDES=\"-isystem\" \"{top}/include/cccl\"  ' >&2\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(cb.shutil, "which", lambda name: f"/opt/{name}" if name == "g++" else None)
    assert cb.nvcc_host_includes(str(nvcc)) == [f"-I{top}/include", "-isystem", f"{top}/include/cccl"]
    cmd = cb.layout_check_command(str(nvcc), include, exe)
    assert cmd[0] == "/opt/g++" and str(nvcc) not in cmd
    assert cmd[cmd.index("-isystem") + 1] == f"{top}/include/cccl" and f"-I{top}/include" in cmd
    assert f"-I{include}" in cmd and cmd[cmd.index("-o") + 1] == str(exe)
    nvcc.write_text("#!/bin/sh\necho '#$ TOP=/x' >&2\n")
    assert cb.layout_check_command(str(nvcc), include, exe)[0] == str(nvcc)
    nvcc.write_text("#!/bin/sh\nexit 1\n")  # never asked: no host compiler
    monkeypatch.setattr(cb.shutil, "which", lambda name: None)
    cmd = cb.layout_check_command(str(nvcc), include, exe)
    assert cmd[0] == str(nvcc) and "--expt-relaxed-constexpr" in cmd and cmd[cmd.index("-o") + 1] == str(exe)


# ------------------------------------------------------------------------------------------
# C ABI errors (checked before any CUDA call, so they run without a GPU)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(num_splits=0), b"num_splits"),
    (dict(head_dim=96), b"head_dim 96"),
    (dict(dtype=7), b"dtype 7"),
    (dict(group_size=3, num_qo_heads=4), b"group_size"),
    (dict(page_size=0), b"page_size"),
    (dict(block_size=96), b"block_size"),
    (dict(sk_s=100), b"strides"),
    (dict(q=8), b"16-byte aligned"),
    (dict(correction=1), b"mean correction needs"),
    (dict(max_ctas=-1), b"max_ctas"),
    (dict(sv_d=2), b"sv_d 1"),
    (dict(dtype=2, head_dim=64), b"e4m3: 128"),
    (dict(dtype=2), b"token-major"),  # row-major V (slot stride 128)
    (dict(dtype=2, sv_s=1, sv_d=16, sv_h=2048, page_size=8), b"page_size % 16"),
    (dict(dtype=2, sv_s=1, sv_d=16, sv_h=2048), b"descales"),
    (dict(dtype=2, sv_s=1, sv_d=16, sv_h=2048, q_descale=16, k_descale=16, v_descale=16, sq_t=8),
     b"multiples of 16 bytes (16 elements)"),
    (dict(dtype=2, sv_s=1, sv_d=16, sv_h=2048, q_descale=16, k_descale=16, v_descale=16,
          correction=1, kbar=16, vbar=16, corr_bits=16, skb_t=128, skb_h=128, svb_t=128,
          svb_h=128, svb_d=1), b"block-major"),
])
def test_abi_argument_errors(lib, kw, match):
    p = _params(**kw)
    status = lib.fp_sparse_attn_fwd(ctypes.byref(p), None)
    assert status == cb.FP_ERR_ARGUMENT
    assert match in lib.fp_last_error()


def test_abi_null_params(lib):
    assert lib.fp_sparse_attn_fwd(None, None) == cb.FP_ERR_ARGUMENT
    assert b"NULL" in lib.fp_last_error()


def test_abi_cuda_error_is_reported(lib):
    if torch.cuda.is_available():
        pytest.skip("checks the no-driver path")
    p = _params()
    assert lib.fp_sparse_attn_fwd(ctypes.byref(p), None) == cb.FP_ERR_CUDA
    assert b"cudaGetDevice" in lib.fp_last_error()


# ------------------------------------------------------------------------------------------
# Python-side input checks and backend selection
# ------------------------------------------------------------------------------------------


def _token_major(stored):
    """[num_pages, Hkv, d, page_size] storage seen as [num_pages, page_size, Hkv, d]."""
    return stored.permute(0, 3, 1, 2)


def _qkv(dtype=torch.bfloat16, d=128, hq=4, hkv=1):
    q = torch.zeros(10, hq, d, dtype=dtype)
    k = torch.zeros(3, 16, hkv, d, dtype=dtype)
    return q, k, k.clone()


@pytest.mark.parametrize("make,match", [
    (lambda: _qkv(dtype=torch.float32), "q: .*bfloat16, float16 and float8_e4m3fn"),
    (lambda: _qkv(d=96), "q: .*head_dim"),
    (lambda: (_qkv()[0], _qkv()[1].half(), _qkv()[2]), "k_pages: expected dtype"),
    (lambda: (_qkv()[0], _qkv()[1], _qkv(d=64)[2]), "v_pages: expected head_dim"),
    (lambda: (_qkv()[0].transpose(1, 2).contiguous().transpose(1, 2), *_qkv()[1:]),
     "q: expected a contiguous last dimension"),
    (lambda: (torch.zeros(10, 4, 132, dtype=torch.bfloat16)[..., 2:130], *_qkv()[1:]),
     "q: expected 16-byte aligned rows"),
    (lambda: _qkv(), "q: the CUTLASS kernel needs a CUDA tensor"),
    (lambda: _qkv(dtype=torch.float8_e4m3fn, d=64), "q: .*head_dim in \\(128,\\)"),
    (lambda: _qkv(dtype=torch.float8_e4m3fn), "v_pages: .*token-major"),
    (lambda: (*_qkv(dtype=torch.float8_e4m3fn)[:2], _token_major(torch.zeros(3, 1, 128, 8, dtype=torch.float8_e4m3fn))),
     "v_pages: .*page_size % 16"),
    (lambda: (*_qkv(dtype=torch.float8_e4m3fn)[:2], _token_major(torch.zeros(3, 1, 128, 16, dtype=torch.float8_e4m3fn))),
     "q: the CUTLASS kernel needs a CUDA tensor"),  # token-major fp8 passes every format check
])
def test_check_inputs_raise(make, match):
    q, k, v = make()
    with pytest.raises(ValueError, match=match):
        ca.check_inputs(q, k, v)
    assert not ca.supports(q, k, v)


def test_forced_cutlass_on_cpu_raises():
    with pytest.raises(ValueError, match="backend: 'cutlass' needs a CUDA tensor"):
        ops.resolve_backend("cutlass", torch.device("cpu"))
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="cutlass"):
        ops.attention_planned(q, k, v, None, None, backend="cutlass")


def test_backend_selection(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(cb, "unavailable_reason", lambda: None)  # buildable here
    assert ops.cutlass_available(cuda) and ca.available()
    assert ops.resolve_backend("cutlass", cuda) == "cutlass"
    assert not ops.cutlass_available(torch.device("cpu"))
    assert ops.resolve_backend("auto", torch.device("cpu")) == "reference"
    monkeypatch.setattr(cb, "unavailable_reason", lambda: "nvcc not found (test)")
    assert not ca.available()
    with pytest.raises(ValueError, match="its library: nvcc not found"):
        ops.resolve_backend("cutlass", cuda)
    with pytest.raises(ValueError, match="backend: expected one of"):
        ops.resolve_backend("cuda", cuda)


def test_auto_prefers_cutlass_only_when_supported(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(ops, "cutlass_available", lambda device: True)
    monkeypatch.setattr(ca, "supports", lambda q, k, v: True)
    monkeypatch.setattr(ops, "_cutlass_loads", lambda: True)
    monkeypatch.delenv("FLASHPREFILL_CUTLASS_LIB", raising=False)
    assert ops._auto_cutlass(q, k, v)  # buildable or cached is enough: v1 beats Triton
    monkeypatch.setattr(ca, "supports", lambda q, k, v: False)  # e.g. fp32 or d = 80: Triton
    assert not ops._auto_cutlass(q, k, v)
    monkeypatch.setattr(ops, "cutlass_available", lambda device: False)
    monkeypatch.setattr(ca, "supports", lambda q, k, v: True)
    assert not ops._auto_cutlass(q, k, v)


def test_auto_falls_back_once_when_the_library_does_not_load(monkeypatch, caplog):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("nvcc failed (1): test")

    monkeypatch.setattr(cb, "load_library", broken)
    ops._cutlass_loads.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kernels.ops"):
            assert ops._cutlass_loads() is False
            assert ops._cutlass_loads() is False
        assert len(calls) == 1  # decided once per process
        assert "nvcc failed (1): test" in caplog.text and "using Triton" in caplog.text
        q, k, v = _qkv()
        monkeypatch.setattr(ops, "cutlass_available", lambda device: True)
        monkeypatch.setattr(ca, "supports", lambda q, k, v: True)
        assert not ops._auto_cutlass(q, k, v)
    finally:
        ops._cutlass_loads.cache_clear()


# ------------------------------------------------------------------------------------------
# the wrapper's parameter block, on CPU tensors with the library call recorded (no GPU)
# ------------------------------------------------------------------------------------------


class _FakeLib:
    def __init__(self):
        self.calls = []

    def fp_sparse_attn_fwd(self, params_ref, stream):
        p = params_ref._obj
        self.calls.append({name: getattr(p, name) for name, _ in cb.FpAttnParams._fields_})
        return cb.FP_OK


class _FakePrepass:
    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        def run(seg_offsets, kv_tiles, bits, words, **kw):
            self.grids.append((grid, words, kw))
        return run


@pytest.mark.parametrize("dense,splits,corr", [(False, 1, True), (False, 3, False), (True, 2, True)])
def test_wrapper_parameter_block(monkeypatch, dense, splits, corr):
    from kernels import SparseConfig, plan_prefill
    from kernels import reference as ref
    from kernels import schedule
    from tests.helpers import make_batch

    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=64, window_tokens=64,
                       mean_correction=corr)
    batch = make_batch([150, 1], [70, 300], num_qo_heads=8, num_kv_heads=2, head_dim=64,
                       page_size=16, seed=0, dtype=torch.bfloat16, needles=1, block_size=128)
    plan = plan_prefill(*batch.args(), cfg)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    fake, prepass = _FakeLib(), _FakePrepass()
    monkeypatch.setattr(ca, "check_inputs", lambda q, k, v: None)
    monkeypatch.setattr(cb, "load_library", lambda: fake)
    monkeypatch.setattr(schedule, "selected_blocks", prepass)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    out, lse = ca.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan,
                                   None if dense else index, num_splits=splits, dense=dense)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert lse.shape == batch.q.shape[:2] and lse.dtype == torch.float32
    (p,) = fake.calls
    q, k = batch.q, batch.k_pages
    assert p["q"] == q.data_ptr() and p["k"] == k.data_ptr() and p["v"] == batch.v_pages.data_ptr()
    assert p["out"] == out.data_ptr() and p["lse"] == lse.data_ptr()
    assert (p["sq_t"], p["sq_h"]) == (8 * 64, 64)
    assert (p["sk_p"], p["sk_s"], p["sk_h"]) == (16 * 2 * 64, 2 * 64, 64)
    assert p["s_pt"] == plan.page_table.stride(0)
    assert p["total_q"] == 151 and p["num_qo_heads"] == 8 and p["group_size"] == 4
    assert p["total_tiles"] == plan.total_tiles and p["num_segments"] == plan.num_segments
    assert p["num_splits"] == splits and p["dense"] == int(dense)
    assert p["head_dim"] == 64 and p["page_size"] == 16 and p["block_size"] == 128
    assert p["dtype"] == 0 and p["device"] == 0
    assert p["qk_scale_log2"] == pytest.approx(1.4426950408889634 / 8.0)
    assert (p["o_part"] is not None) == (splits > 1) and (p["lse_part"] is not None) == (splits > 1)
    correction = corr and not dense
    assert p["correction"] == int(correction)
    if correction:
        words = max(1, -(-plan.max_blocks // 64)) * 2
        assert p["words_per_seg"] == words
        assert prepass.grids == [((plan.num_segments,), words, dict(TPB=2, BLOCK_E=128, num_warps=4))]
        assert (p["skb_t"], p["skb_h"]) == (2 * 64, 64) and p["kbar"] and p["corr_bits"]
        # 16-bit means as hi + lo: 2 * total_blocks rows at kbar (fp_attn_api.h)
        assert p["total_blocks"] == plan.total_blocks
    else:
        assert p["kbar"] is None and p["corr_bits"] is None and not prepass.grids
    if dense:
        assert p["seg_offsets"] is None and p["kv_tiles"] is None
    else:
        assert p["seg_offsets"] == index.seg_offsets.data_ptr()
        assert p["kv_tiles"] == index.kv_tiles.data_ptr()


def test_wrapper_parameter_block_fp8(monkeypatch):
    """FP8: descale pointers and strides, token-major V strides, e4m3 means with V's block-major
    with each sequence's columns 64-aligned (whole TMA boxes), bf16 output."""
    from kernels import SparseConfig
    from kernels import reference as ref
    from kernels import schedule
    from tests.test_fp8 import _plan, fp8_batch

    batch = fp8_batch([150, 1], [70, 300], hq=8, hkv=2, d=128, page_size=16, granularity="head",
                      needles=1, seed=0, block_size=128, token_major_v=True, device="cpu")
    cfg = SparseConfig(alpha=0.1, block_size=128, sink_tokens=64, window_tokens=64)
    plan, ds = _plan(batch, cfg)
    index = ref.build_index(batch.q, batch.k_pages, batch.v_pages, plan, descales=ds)
    fake, prepass = _FakeLib(), _FakePrepass()
    monkeypatch.setattr(ca, "check_inputs", lambda q, k, v: None)
    monkeypatch.setattr(cb, "load_library", lambda: fake)
    monkeypatch.setattr(schedule, "selected_blocks", prepass)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    out, lse = ca.sparse_attention(batch.q, batch.k_pages, batch.v_pages, plan, index,
                                   num_splits=1, descales=ds)
    assert out.dtype == torch.bfloat16 and out.shape == batch.q.shape
    (p,) = fake.calls
    assert p["dtype"] == 2 and p["head_dim"] == 128 and p["correction"] == 1
    assert (p["sv_p"], p["sv_s"], p["sv_h"], p["sv_d"]) == (2 * 128 * 16, 1, 128 * 16, 16)
    assert (p["q_descale"], p["k_descale"], p["v_descale"]) == (
        ds.q.data_ptr(), ds.k.data_ptr(), ds.v.data_ptr())
    # per-KV-head descales: broadcast over sequences (stride 0), one per head
    assert (p["sqd_b"], p["sqd_h"], p["skd_b"], p["skd_h"], p["svd_b"], p["svd_h"]) == (0, 1, 0, 1, 0, 1)
    nb = int(plan.cu_blocks[-1])
    width = -(-nb // 64) * 64 + 64 * 2  # room for each of the 2 sequences' 64-column alignment
    assert (p["skb_t"], p["skb_h"]) == (2 * 128, 128)
    assert (p["svb_t"], p["svb_h"], p["svb_d"]) == (1, 128 * width, width)
    assert p["total_blocks"] == nb and p["cu_blocks_v"]
    words = max(1, -(-plan.max_blocks // 64)) * 2
    assert p["corr_bits"] and p["words_per_seg"] == words and len(prepass.grids) == 1


def test_aligned_block_columns():
    """Each sequence's V means move to the next multiple of 64 columns; empty sequences take
    none."""
    cu = torch.tensor([0, 5, 5, 75, 76], dtype=torch.int32)  # 5, 0, 70, 1 blocks
    cu_v, column = ca._aligned_block_columns(cu, 76)
    assert cu_v.tolist() == [0, 64, 64, 192, 256]
    want = list(range(0, 5)) + list(range(64, 134)) + [192]
    assert column.tolist() == want


def test_cutlass_backend_decodes_with_triton(monkeypatch):
    """backend='cutlass' flows from the model executor into decode too: Triton's decode kernel,
    not the reference's."""
    import sys
    import types

    from kernels import decode

    called = []
    fake = types.ModuleType("kernels.triton_decode")
    fake.paged_decode = lambda *a, **kw: called.append(True) or ("out", "lse")
    import kernels

    monkeypatch.setitem(sys.modules, "kernels.triton_decode", fake)
    monkeypatch.setattr(kernels, "triton_decode", fake, raising=False)
    monkeypatch.setattr(decode, "resolve_backend", lambda backend, device: backend)
    q = torch.zeros(2, 4, 64)
    k = torch.zeros(3, 16, 1, 64)
    table = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    assert decode.paged_decode(q, k, k.clone(), table, lens, backend="cutlass") == ("out", "lse")
    assert called
