"""kernels/rope_kv.py: RoPE + paged K/V write in one Triton kernel (under TRITON_INTERPRET=1 on
CPU) against the unfused sequence (eager RoPE, then the pool's write), byte for byte: the rotated
q, every byte of both page tensors (slots not written keep their random bytes), and q's amax.
Page boundaries (page sizes 1, 16, 64 with shuffled slots), odd token counts, GQA and MQA,
strided q/k/v (views of one QKV projection), the bf16, fp32 and e4m3 (token-major V) pools."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import rope_kv
from kernels.elementwise import rotary_reference
from kernels.fp8 import FP8_DTYPE

needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t, hq, hkv, d, page_size, dtype, pool_dtype, *, seed, fused_qkv=False, extra_pages=3):
    g = torch.Generator().manual_seed(seed)
    if fused_qkv:  # q, k, v as column views of one projection output: token stride (hq + 2 hkv) d
        qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    else:
        q, k, v = ((torch.randn(t, h, d, generator=g) * 3).to(dtype) for h in (hq, hkv, hkv))
    pos = torch.randint(0, 60000, (t,), generator=g).double()
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], dim=1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    num_pages = -(-t // page_size) + extra_pages
    slots = torch.randperm(num_pages * page_size, generator=g)[:t]  # scattered over pages, across boundaries
    # pages full of random bytes: a slot the write must not touch keeps them
    elem = torch.empty((), dtype=pool_dtype).element_size()
    nbytes = num_pages * page_size * hkv * d * elem

    def random_pages():
        raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
        if pool_dtype == FP8_DTYPE:
            raw[(raw & 0x7F) == 0x7F] = 0  # no NaN bytes: their quantized values could not be compared
        return raw

    k_pages = random_pages().view(pool_dtype).view(num_pages, page_size, hkv, d)
    if pool_dtype == FP8_DTYPE:  # the FP8 pool's token-major V: [P, Hkv, d, page_size] underneath
        v_pages = random_pages().view(pool_dtype).view(num_pages, hkv, d, page_size).permute(0, 3, 1, 2)
        descales = (torch.rand(hkv, generator=g) * 0.05 + 0.01, torch.rand(hkv, generator=g) * 0.05 + 0.01)
    else:
        v_pages = random_pages().view(pool_dtype).view(num_pages, page_size, hkv, d)
        descales = (None, None)
        if pool_dtype.is_floating_point:  # no NaN/inf from random bytes in the comparison
            k_pages.copy_(torch.randn(k_pages.shape, generator=g))
            v_pages.copy_(torch.randn(v_pages.shape, generator=g))
    return q, k, v, cos, sin, slots, k_pages, v_pages, descales


def _run(backend, case, q_amax, slots_dtype=torch.int64):
    q, k, v, cos, sin, slots, k_pages, v_pages, (kd, vd) = case
    kp, vp = k_pages.clone(), v_pages.clone()  # clone keeps the strides (the token-major view)
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    kp, vp = kp.to(DEVICE), vp.to(DEVICE)
    out = rope_kv.rope_kv_write(dev(q), dev(k), dev(v), dev(cos), dev(sin), dev(slots.to(slots_dtype)), kp, vp,
                                k_descale=dev(kd), v_descale=dev(vd), q_amax=q_amax, backend=backend)
    q_rot, amax = out if q_amax else (out, None)
    return q_rot.cpu(), None if amax is None else amax.cpu(), kp.cpu(), vp.cpu()


def _bytes(x):
    return x.contiguous().view(torch.uint8)


@needs_triton
@pytest.mark.parametrize("t,hq,hkv,d,page_size", [
    (37, 8, 2, 64, 16), (1, 4, 1, 128, 1), (70, 4, 1, 64, 64), (129, 8, 8, 64, 16), (5, 6, 2, 128, 7),
], ids=["gqa-p16", "mqa-single-token-p1", "mqa-p64", "mha-p16", "odd-p7"])
@pytest.mark.parametrize("dtype,pool", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                        (torch.bfloat16, FP8_DTYPE), (torch.float16, FP8_DTYPE)],
                         ids=["bf16", "fp32", "bf16-e4m3", "fp16-e4m3"])
def test_matches_rope_then_write_byte_for_byte(t, hq, hkv, d, page_size, dtype, pool):
    case = _case(t, hq, hkv, d, page_size, dtype, pool, seed=t * 7 + d + page_size, fused_qkv=t % 2 == 1)
    q_amax = pool == FP8_DTYPE
    got = _run("triton", case, q_amax)
    want = _run("reference", case, q_amax)
    assert torch.equal(_bytes(got[0]), _bytes(want[0]))  # rotated q
    if q_amax:
        assert torch.equal(got[1], want[1])
    assert torch.equal(_bytes(got[2]), _bytes(want[2]))  # every byte of K's pages
    assert torch.equal(_bytes(got[3].permute(0, 2, 3, 1) if pool == FP8_DTYPE else got[3]),
                       _bytes(want[3].permute(0, 2, 3, 1) if pool == FP8_DTYPE else want[3]))
    # and the reference itself is RoPE then a write at the slots: read back the written rows
    q, k, v, cos, sin, slots, *_ = case
    assert torch.equal(want[0], rotary_reference(q, cos, sin))
    page, off = slots // page_size, slots % page_size
    if pool != FP8_DTYPE:
        assert torch.equal(want[2][page, off], rotary_reference(k, cos, sin).to(pool))
        assert torch.equal(want[3][page, off], v.to(pool))
        untouched = torch.ones(want[2].shape[:2], dtype=torch.bool)
        untouched[page, off] = False
        assert torch.equal(want[2][untouched], case[6][untouched])


@needs_triton
def test_int32_slots_and_empty_batch():
    case = _case(9, 4, 2, 64, 4, torch.bfloat16, torch.bfloat16, seed=1)
    got, want = _run("triton", case, False, torch.int32), _run("reference", case, False)
    assert all(torch.equal(a, b) for a, b in zip((got[0], got[2], got[3]), (want[0], want[2], want[3])))
    empty = _case(0, 4, 2, 64, 4, torch.bfloat16, FP8_DTYPE, seed=2)
    q_rot, amax, kp, vp = _run("triton", empty, True)
    assert q_rot.shape == (0, 4, 64) and float(amax) == 0.0
    assert torch.equal(_bytes(kp), _bytes(empty[6]))


def _good(**over):
    q, k, v, cos, sin, slots, kp, vp, (kd, vd) = _case(6, 4, 2, 64, 4, torch.bfloat16, FP8_DTYPE, seed=3)
    args = dict(q=q, k=k, v=v, cos=cos, sin=sin, slots=slots, k_pages=kp, v_pages=vp, k_descale=kd, v_descale=vd)
    args.update(over)
    return args


def _bf16_pages():
    return torch.zeros(4, 4, 2, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("over,name", [
    (dict(q=torch.zeros(6, 4, 64, dtype=torch.int32)), "q"),
    (dict(q=torch.zeros(6, 64, dtype=torch.bfloat16)), "q"),
    (dict(k=torch.zeros(6, 2, 64, dtype=torch.float32)), "k"),
    (dict(k=torch.zeros(5, 2, 64, dtype=torch.bfloat16)), "k"),
    (dict(v=torch.zeros(6, 1, 64, dtype=torch.bfloat16)), "v"),
    (dict(cos=torch.zeros(6, 32, dtype=torch.bfloat16)), "cos"),
    (dict(sin=torch.zeros(6, 64, dtype=torch.float32)), "sin"),
    (dict(q=torch.zeros(6, 4, 48, dtype=torch.bfloat16), k=torch.zeros(6, 2, 48, dtype=torch.bfloat16),
          v=torch.zeros(6, 2, 48, dtype=torch.bfloat16), cos=torch.zeros(6, 48, dtype=torch.bfloat16),
          sin=torch.zeros(6, 48, dtype=torch.bfloat16)), "q"),
    (dict(slots=torch.zeros(5, dtype=torch.int64)), "slots"),
    (dict(slots=torch.zeros(6, dtype=torch.float32)), "slots"),
    (dict(k_pages=torch.zeros(4, 4, 3, 64, dtype=FP8_DTYPE)), "k_pages"),
    (dict(k_pages=torch.zeros(4, 4, 2, 64, dtype=torch.float16)), "k_pages"),
    (dict(v_pages=torch.zeros(3, 4, 2, 64, dtype=FP8_DTYPE)), "v_pages"),
    (dict(k_descale=None), "k_descale"),
    (dict(v_descale=torch.ones(3)), "v_descale"),
    (dict(k_descale=torch.ones(2, dtype=torch.float64)), "k_descale"),
    (dict(k_pages=_bf16_pages(), v_pages=_bf16_pages()), "k_descale"),
    (dict(q_amax=1), "q_amax"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_names_the_argument(over, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        rope_kv.rope_kv_write(**_good(**over))


@pytest.mark.gpu
@pytest.mark.parametrize("pool", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "e4m3"])
def test_gpu_llama8b_shape_matches_rope_then_write(pool):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = _case(1000, 32, 8, 128, 64, torch.bfloat16, pool, seed=11, fused_qkv=True)
    q_amax = pool == FP8_DTYPE
    got, want = _run("triton", case, q_amax), _run("reference", case, q_amax)
    assert torch.equal(_bytes(got[0]), _bytes(want[0]))
    assert not q_amax or torch.equal(got[1], want[1])
    assert torch.equal(_bytes(got[2]), _bytes(want[2])) and torch.equal(_bytes(got[3]), _bytes(want[3]))


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_rope_kv as t
ints = ("T", "HQ", "HKV", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
        "stride_oh", "stride_ct", "stride_st", "stride_kpp", "stride_kps", "stride_kph", "stride_vpp", "stride_vps",
        "stride_vph", "stride_vpd")
for pool, fp8 in (("bf16", False), ("fp8e4nv", True)):
    sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "COS": "*bf16", "SIN": "*bf16", "SLOTS": "*i64", "QO": "*bf16",
           "KP": "*" + pool, "VP": "*" + pool, "KD": "*fp32", "VD": "*fp32", "AMAX": "*i32", **{n: "i32" for n in ints},
           "PAGE_SIZE": "constexpr", "HALF": "constexpr", "BLOCK_T": "constexpr", "FP8": "constexpr", "Q_AMAX": "constexpr"}
    c = triton.compile(ASTSource(fn=t._rope_kv_kernel, signature=sig, constexprs={
        "PAGE_SIZE": 64, "HALF": 64, "BLOCK_T": t.BLOCK_T, "FP8": fp8, "Q_AMAX": fp8}),
        target=GPUTarget("cuda", 90, 64), options=dict(t.LAUNCH))
    print(pool, "fma" in c.asm["ptx"].replace("fma.rn.f32", ""))
"""


def test_kernel_compiles_for_sm90_without_contraction():
    """The kernel as built for Hopper (compiled here on CPU, in a process of its own: the
    interpreter's patches break real compiles): the interpreter accepts what the compiler may
    not (a name bound to tensors of two shapes in two branches), and the rotation's products
    must stay apart from its sums (no fused multiply-add of 16-bit values)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=os.path.dirname(os.path.dirname(__file__)),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["bf16", "False", "fp8e4nv", "False"]
