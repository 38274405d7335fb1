"""Our operator beside the paper's own (qhfan/FlashPrefillv2) on the H200, stage by stage.

Built by ``benchmarks/peers/stage_flashprefillv2.sh`` into ``.peer/build`` (carried to the device);
the semantic differences are in ``benchmarks/peers/FLASHPREFILLV2.md``. One run:

- Inputs: ``kernels.synthetic.structured_inputs`` (paper density per length), 32/8 heads, d=128,
  bf16; B=1 at each ``--lengths`` and one varlen batch (``--varlen``, each sequence its own seed);
  the same paged K/V for every kernel, at page sizes 16 and 64 (``--page-sizes``) and, for the
  ``--page1`` cases, 1 (the peer's token-level paging).
- Equal terms: the peer applies its mean correction only in its non-TMA paged kernel, i.e. when
  the page size is *not* a multiple of 64 (``peer_corrects``; FLASHPREFILLV2.md). So at pages 16
  and 1 every row runs with correction; at page 64 every row runs without it (the peer would
  drop it silently), plus ``ours`` with correction beside them. The ``corr`` column says whose
  correction ran in each row (``ours``, ``peer`` or ``none``).
- Kernels (``kernel`` column): ``ours`` (Triton index + attention; the CUTLASS attention stage
  when its library loads and takes the inputs, ``--attention``), ``peer`` (``FlashPrefill``:
  block 128, sink 2 blocks, window ``--peer-window`` blocks, ``abs_threshold = alpha``,
  ``last_n_blocks = --peer-last-n``), ``ours@peer`` / ``peer@ours`` (each attention stage on the
  *other's* index, converted by ``benchmarks/peers/convert.py``), FA4 dense and block-sparse on
  our mask (B=1; when ``flash_attn.cute`` imports), SDPA flash (B=1). At the service's page size
  (64), each side also as it ships (``--no-shipped`` skips them): ``ours_shipped`` with the
  service's ``sparse.*`` defaults (last 2 tiles dense, the first-key energy rule, correction on),
  ``peer_shipped`` with its SGLang server's ``flashprefill_*`` defaults (block 64, threshold 1.0,
  sink 2 and window 4 blocks, last 2 tiles dense, no correction); off CUDA the peer's row is the
  CPU model of that rule through our attention (``peer_shipped_model``).
- bf16 and FP8 (e4m3, per-tensor descales, the same quantized values for both operators). Our
  side reads FP8 V token-major as the service's pool stores it (``kv_cache/tensors.py``), which
  is what the CUTLASS e4m3 path takes (``page_size % 16 == 0``; page 1 runs on Triton); the
  ``backend`` column says which ran.
- ``--index-parts``: on the first ``ours`` row of each (case, page size, dtype) our index stage
  is also timed by parts with bench_index's own calls (``bench_index.index_parts``: ``means``,
  ``select`` and the whole stage without the host sync, beside ``index_ms``, which has it), the
  caching allocator's counters are read around ``index_ms`` (cudaMalloc calls, retries), and the
  registers of the index kernels as the driver loaded them are recorded with the programs per SM
  they allow (``index_resources.launched_resources``).
- Per row: median ms of the attention stage with the row's correction (``attention_ms``), without
  it where a correction ran (``attention_nocorr_ms``: its cost), and for an operator on its own
  index ``index_ms`` and ``total_ms`` (same correction as the row); the error against exact fp32 attention on ``--rows`` sampled query positions
  per sequence (all heads; for FP8 on the dequantized inputs), and for each index its density
  (visible selected pairs over causal pairs) and needle recall; ``agree``: Jaccard of the two
  indexes' visible tiles.

Usage (H200, ``PYTHONPATH=$PWD``; ``--peer-path`` defaults to ``.peer/build``)::

    python3 benchmarks/bench_peer.py      # longer than the earlier 5-7 min: two page sizes a case
    python3 benchmarks/bench_peer.py --lengths 131072 --varlen '' --page1 ''
    python3 benchmarks/bench_peer.py --dry-run   # CPU, 4/1 heads, our reference path, no peer

Writes ``benchmarks/results/peer_h200.json`` (``--dry-run``: ``peer_cpu_dryrun.json``) and
prints a table last. Every baseline that cannot run is a row with ``skipped`` and the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
from evals.report import git_commit  # noqa: E402
from kernels import fidelity  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402
from kernels.ops import attention_planned, build_index_planned, plan_descales, plan_prefill  # noqa: E402
from kernels.paged import contiguous_to_paged  # noqa: E402
from peers import convert  # noqa: E402

HQ, HKV, D = 32, 8, 128
SERVED_PAGE_SIZE = 64  # the service's kv.page_size default (tests/test_bench_peer.py keeps them equal)
FP8 = torch.float8_e4m3fn


@dataclasses.dataclass
class Cfg:
    lengths: tuple[int, ...] = (8192, 32768, 65536, 131072)
    varlen: tuple[int, ...] = (8192, 16384, 32768, 65536)
    # 16: the peer corrects (page % 64 != 0) and CUTLASS takes FP8; 64: ours' serving page, the
    # peer drops its correction there
    page_sizes: tuple[int, ...] = (16, 64)
    page1: tuple[str, ...] = ("131072", "varlen")  # cases that also run at page size 1
    fp8: bool = True
    alpha: float = SparseConfig().alpha
    peer_window: int = 5  # blocks; 5 reproduces our window_tokens=512 (FLASHPREFILLV2.md)
    peer_last_n: int = 0  # the peer's dense last query tiles; ours has no such rule
    attention: str = "auto"  # our attention stage: auto (cutlass when it loads), cutlass, triton
    rows: int = 256  # sampled query positions per sequence for the exact reference
    fa4: bool = True
    fa4_min_len: int = 32768
    sdpa: bool = True
    budget_ms: float = 200.0
    seed: int = 0
    target_density: float | None = None  # None: the paper's density for each length
    device: str = "cuda"
    peer_path: str = str(ROOT / ".peer/build")
    # our index also timed by parts (bench_index.index_parts), with the allocator's counters
    # around index_ms and the registers of the loaded index kernels (#38: why bench_peer's index
    # differs from bench_index's)
    index_parts: bool = False
    # each side as it ships (``shipped_rows``): ours with the service's default sparse options, the
    # peer with its SGLang backend's defaults; at the service's page size only
    shipped: bool = True
    # the 8B model's attention shape; the dry run shrinks the heads so the CPU reference finishes
    num_qo_heads: int = HQ
    num_kv_heads: int = HKV
    head_dim: int = D


# ---------------------------------------------------------------------------------------------
# timing, environment
# ---------------------------------------------------------------------------------------------


def bench_ms(fn, device, budget_ms: float) -> float:
    """Median ms: ``do_bench`` under 20 ms a call, else a few CUDA-event-timed calls; on the CPU
    one timed call (the dry run checks plumbing, not speed)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = s.elapsed_time(e)
    if est < 20.0:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=max(40, int(budget_ms / 3)), return_mode="median"))
    times = [est]
    for _ in range(max(2, min(10, int(budget_ms / est)))):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return float(sorted(times)[len(times) // 2])


def peer_build_info(path: str) -> str | None:
    try:
        return (Path(path) / "BUILD_INFO.txt").read_text().splitlines()[0]
    except OSError:
        return None


def import_peer(path: str):
    """``(FlashPrefill, None)`` or ``(None, reason)``."""
    if path and path not in sys.path and Path(path).is_dir():
        sys.path.insert(0, path)
    try:
        from flashprefill import FlashPrefill

        return FlashPrefill, None
    except Exception as e:  # noqa: BLE001
        return None, f"flashprefill does not import from {path!r}: {e!r}"[:300]


def import_fa4():
    try:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func, None
    except Exception as e:  # noqa: BLE001
        return None, f"flash_attn.cute does not import: {e!r}"[:200]


def environment(cfg: Cfg, device) -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": git_commit(), "peer_build": peer_build_info(cfg.peer_path)}
    try:
        import flash_attn

        env["flash_attn"] = getattr(flash_attn, "__version__", "?")
    except Exception:  # noqa: BLE001
        env["flash_attn"] = None
    return env


# ---------------------------------------------------------------------------------------------
# inputs and the exact reference
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    name: str
    seqlens: tuple[int, ...]
    q: torch.Tensor  # [Tq, Hq, d] packed
    ks: list  # per sequence [L, Hkv, d]
    vs: list
    needles: torch.Tensor  # [N, 6] (batch relabelled)
    predicted_density: float


def make_case(name: str, seqlens: tuple[int, ...], cfg: Cfg, device) -> Case:
    from kernels.synthetic import structured_inputs

    qs, ks, vs, needles, dens = [], [], [], [], []
    for i, length in enumerate(seqlens):
        x = structured_inputs(length, batch=1, num_qo_heads=cfg.num_qo_heads,
                              num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              dtype=torch.bfloat16, device=device, seed=cfg.seed + i,
                              target_density=cfg.target_density)
        qs.append(x.q[0])
        ks.append(x.k[0])
        vs.append(x.v[0])
        nb = x.needle_blocks.clone()
        nb[:, 0] = i
        needles.append(nb)
        dens.append((x.predicted_density, length))
        del x
    pred = sum(d * n * n for d, n in dens) / sum(n * n for _, n in dens)
    return Case(name, tuple(seqlens), torch.cat(qs, 0), ks, vs, torch.cat(needles, 0), pred)


def paged(case: Case, page_size: int, ks=None, vs=None):
    """``(k_pages, v_pages, page_table, cu_seqlens_q, seqlens_kv)`` of the case's sequences."""
    ks = case.ks if ks is None else ks
    vs = case.vs if vs is None else vs
    kp, vp, tables = [], [], []
    base = 0
    for k, v in zip(ks, vs):
        k1, t1 = contiguous_to_paged(k[None], page_size)
        v1, _ = contiguous_to_paged(v[None], page_size)
        kp.append(k1)
        vp.append(v1)
        tables.append(t1[0] + base)
        base += k1.shape[0]
    width = max(t.numel() for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32, device=case.q.device)
    for b, t in enumerate(tables):
        table[b, : t.numel()] = t
    dev = case.q.device
    lens = torch.tensor(case.seqlens, dtype=torch.int32, device=dev)
    cu = torch.zeros(len(case.seqlens) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(lens, 0)
    return torch.cat(kp, 0), torch.cat(vp, 0), table, cu, lens


def sample_rows(seqlens: tuple[int, ...], rows: int) -> list[torch.Tensor]:
    """Per sequence, ``rows`` positions spread over it (the first and last included)."""
    out = []
    for n in seqlens:
        pos = torch.linspace(0, n - 1, min(rows, n)).round().long()
        out.append(torch.unique(torch.cat([pos, torch.tensor([n - 1])])))
    return out


def exact_rows(q: torch.Tensor, ks: list, vs: list, seqlens, positions, scale: float) -> torch.Tensor:
    """Exact fp32 causal attention of the sampled query rows: ``[sum R_b, Hq, d]``."""
    _, hq, d = q.shape
    hkv = ks[0].shape[1]
    g = hq // hkv
    outs = []
    q0 = 0
    for b, n in enumerate(seqlens):
        pos = positions[b].to(q.device)
        qq = q[q0 + pos].float()  # [R, Hq, d]
        k, v = ks[b].float(), vs[b].float()
        o = torch.empty(pos.numel(), hq, d, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] > pos[:, None]  # [R, L]
        for h in range(hkv):
            s = torch.einsum("rgd,ld->grl", qq[:, h * g : (h + 1) * g], k[:, h]) * scale
            s.masked_fill_(mask[None], float("-inf"))
            o[:, h * g : (h + 1) * g] = torch.einsum("grl,ld->rgd", torch.softmax(s, -1), v[:, h])
            del s
        outs.append(o)
        q0 += n
    return torch.cat(outs, 0)


def row_ids(seqlens, positions) -> torch.Tensor:
    starts = [0]
    for n in seqlens[:-1]:
        starts.append(starts[-1] + n)
    return torch.cat([p + s for p, s in zip(positions, starts)])


def errors(out: torch.Tensor, ids: torch.Tensor, ref: torch.Tensor) -> dict:
    got = out[ids.to(out.device)].float()
    diff = got - ref
    return {"rel_l2": float(diff.norm() / ref.norm().clamp_min(1e-30)),
            "max_abs": float(diff.abs().max()), "finite": bool(torch.isfinite(got).all())}


# ---------------------------------------------------------------------------------------------
# one case at one page size and dtype
# ---------------------------------------------------------------------------------------------


def our_attention_backend(cfg: Cfg, device, q, kp, vp) -> str:
    """``vp`` as our side stores it (token-major for FP8): CUTLASS takes FP8 V only that way,
    with ``page_size % 16 == 0``; anything it does not take runs on Triton."""
    if device.type != "cuda":
        return "auto"  # the reference on the CPU
    if cfg.attention in ("cutlass", "triton"):
        return cfg.attention
    try:
        from kernels import cutlass_attention, cutlass_build

        if cutlass_attention.supports(q, kp, vp):
            cutlass_build.load_library()
            return "cutlass"
    except Exception:  # noqa: BLE001
        pass
    return "triton"


def token_major(v_pages: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_size, Hkv, d]`` values stored ``[num_pages, Hkv, d, page_size]`` (the
    FP8 pool's V, ``kv_cache/tensors.py``), seen in the logical shape."""
    return v_pages.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


PEER_KBLOCK_M, PEER_KBLOCK_N = 128, 64  # its SM90 tile (tile_size.h: one size for every d/dtype)


def peer_corrects(page_size: int, max_seqlen_q: int, group: int) -> bool:
    """Whether the peer's attention applies the mean correction it is given. Only its non-TMA
    paged kernel compiles the correction in (``mainloop_fwd_sm90_tma_gmma_ws.hpp``: the producer's
    mean loads and the consumer's fold are ``if constexpr (... PagedKVNonTMA ...)``); its API
    picks the TMA kernel, silently dropping ``k_mean``/``v_mean``, when ``page_size`` is a multiple
    of the 64-key tile and ``max_seqlen_q * group > 128`` (``get_pagedkv_tma`` in
    ``flash_api_stable.cpp``). Without a page table it is never non-TMA. See FLASHPREFILLV2.md."""
    return page_size % PEER_KBLOCK_N != 0 or max_seqlen_q * group <= PEER_KBLOCK_M


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One row of a (case, page size, dtype): whose attention, on whose index, and whose mean
    correction runs in it (``"ours"``, ``"peer"`` or ``"none"``)."""

    kernel: str
    attention_of: str
    index_of: str
    correction: str


def row_plan(page_size: int, max_seqlen_q: int, group: int) -> list[RowSpec]:
    """Rows on equal terms: where the peer corrects, both sides with correction; where it would
    drop it (page % 64 == 0), both sides without, and ours with correction beside them."""
    if peer_corrects(page_size, max_seqlen_q, group):
        return [RowSpec("ours", "ours", "ours", "ours"), RowSpec("peer", "peer", "peer", "peer"),
                RowSpec("ours@peer", "ours", "peer", "ours"), RowSpec("peer@ours", "peer", "ours", "peer")]
    return [RowSpec("ours", "ours", "ours", "none"), RowSpec("peer", "peer", "peer", "none"),
            RowSpec("ours@peer", "ours", "peer", "none"), RowSpec("peer@ours", "peer", "ours", "none"),
            RowSpec("ours", "ours", "ours", "ours")]


def run_one(case: Case, page_size: int, dtype: str, cfg: Cfg, device, peer_cls, peer_why,
            fa4, fa4_why) -> list[dict]:
    t_case = time.time()
    base = {"case": case.name, "seqlens": list(case.seqlens), "batch": len(case.seqlens),
            "tokens": sum(case.seqlens), "page_size": page_size, "dtype": dtype}
    rows: list[dict] = []
    scale = SparseConfig().softmax_scale(cfg.head_dim)
    group = cfg.num_qo_heads // cfg.num_kv_heads
    positions = sample_rows(case.seqlens, cfg.rows)
    ids = row_ids(case.seqlens, positions)
    is_fp8 = dtype == "fp8_e4m3"
    q, ks, vs = case.q, case.ks, case.vs
    cdesc = None
    if is_fp8:
        from kernels import fp8

        def scale_of(xs):  # one per-tensor descale over every sequence
            amax = torch.stack([x.detach().abs().amax().float() for x in xs]).amax()
            return fp8.descale_from_amax(amax.reshape(1))

        qd, kd, vd = scale_of([case.q]), scale_of(case.ks), scale_of(case.vs)
        q = fp8.quantize(case.q, qd)
        ks = [fp8.quantize(k, kd) for k in case.ks]
        vs = [fp8.quantize(v, vd) for v in case.vs]
        cdesc = (float(qd), float(kd), float(vd))
        ref = exact_rows((q.float() * qd), [k.float() * kd for k in ks], [v.float() * vd for v in vs],
                         case.seqlens, positions, scale)
    else:
        ref = exact_rows(q, ks, vs, case.seqlens, positions, scale)
    kp, vp, table, cu, lens = paged(case, page_size, ks, vs)
    config = SparseConfig(alpha=cfg.alpha)
    plan = plan_prefill(q, kp, vp, table, cu, lens, config)
    plan_nc = dataclasses.replace(plan, config=dataclasses.replace(config, mean_correction=False))
    plans = {True: plan, False: plan_nc}
    ds = None
    if is_fp8:
        one = lambda x: torch.tensor([x], dtype=torch.float32, device=device)  # noqa: E731
        ds = plan_descales(q, plan, one(cdesc[0]), one(cdesc[1]), one(cdesc[2]))
    # our side reads K/V as the service's pool stores them: FP8 V token-major (the CUTLASS e4m3
    # path's operand); the peer reads its own row-major pages
    vp_ours = token_major(vp) if is_fp8 else vp
    v_layout = "token_major" if is_fp8 else "row_major"
    idx_backend = "triton" if device.type == "cuda" else "auto"
    att_backend = our_attention_backend(cfg, device, q, kp, vp_ours)

    def our_index():
        return build_index_planned(q, kp, vp_ours, plan, backend=idx_backend, descales=ds)

    def our_attend(index, corr=True):
        return attention_planned(q, kp, vp_ours, plans[corr], index, backend=att_backend, descales=ds)[0]

    def metrics(index):
        recall, pairs = fidelity.needle_recall(index, plan, case.needles)
        return {"density": fidelity.index_density(index, plan), "needle_recall": recall,
                "needle_pairs": pairs}

    ours_idx = our_index()
    kvd = {} if cdesc is None else {"k_descale": cdesc[1], "v_descale": cdesc[2]}
    peer_live = peer_cls is not None and device.type == "cuda"
    peer_idx = None  # convert.PeerIndex: the peer's own, or the CPU model of its rule
    peer_index = peer_attend = None
    if peer_live:
        fp = peer_cls(k_block_m=PEER_KBLOCK_M, k_block_n=config.block_size, abs_threshold=cfg.alpha,
                      attention_sink=config.sink_tokens // config.block_size,
                      window_size=cfg.peer_window, last_n_blocks=cfg.peer_last_n,
                      use_mean_correction=True, causal=True, softmax_scale=scale)
        q_lens = list(case.seqlens)
        max_k = max(case.seqlens)
        idx_kw = {} if cdesc is None else {"q_descale": cdesc[0], "k_descale": cdesc[1]}
        att_kw = {}
        if cdesc is not None:
            att_kw = {n: torch.full((len(q_lens), cfg.num_kv_heads), c, dtype=torch.float32, device=device)
                      for n, c in zip(("q_descale", "k_descale", "v_descale"), cdesc)}

        def peer_index():
            return fp.index_select(q, kp, table, lens, cu, v_cache=vp, q_lens=q_lens,
                                   max_cache_seqlen=max_k, **idx_kw)

        def peer_attend(index: convert.PeerIndex, corr: bool):
            if not corr:  # no means: the peer's attention skips the correction
                index = dataclasses.replace(index, k_mean=None, v_mean=None)
            return fp.block_sparse_attention(q, kp, vp, table, lens, cu, index.to_peer(),
                                             max_seqlen_q=max_k, **att_kw)

        try:
            pidx = peer_index()
            # the peer's workspace is reused by the next index_select: keep a copy
            peer_idx = convert.PeerIndex(pidx.block_sparse_cu.clone(), pidx.block_sparse_idx.clone(),
                                         int(pidx.total_q_tiles), pidx.cu_q_tiles.clone(),
                                         pidx.k_mean.clone(), pidx.v_mean.clone())
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            peer_why = f"index_select: {e!r}"[:400]
            peer_live = False
    if not peer_live:
        rows.append({**base, "kernel": "peer", "skipped": peer_why or "needs CUDA"})
        if device.type != "cuda":  # the CPU model of the peer's rule stands in for its index
            peer_idx = convert.peer_rule_index(q, kp, vp, plan, alpha=cfg.alpha,
                                               window_blocks=cfg.peer_window,
                                               last_n_blocks=cfg.peer_last_n,
                                               **({} if cdesc is None else
                                                  {"q_descale": cdesc[0], "k_descale": cdesc[1]}))
            rows.append({**base, "kernel": "peer_model", "index_of": "peer_model",
                         **metrics(convert.peer_to_ours(peer_idx, plan, ours_idx.means))})
    theirs = agree = None
    if peer_idx is not None:  # the peer's index in our format (its own means when it made them)
        if peer_idx.k_mean is not None and peer_idx.k_mean.dtype == q.dtype:
            theirs = convert.peer_to_ours(peer_idx, plan, **kvd)
        else:
            theirs = convert.peer_to_ours(peer_idx, plan, ours_idx.means)
        agree = convert.overlap(ours_idx, theirs, plan)
    mine = convert.ours_to_peer(ours_idx, plan, q.dtype, **kvd) if peer_live else None

    parts_done = False
    for spec in row_plan(page_size, max(case.seqlens), group):
        if spec.attention_of == "peer" and not peer_live:
            continue  # one "skipped" row above says why
        if spec.index_of == "peer" and peer_idx is None:
            continue
        corr = spec.correction != "none"
        row = {**base, "kernel": spec.kernel, "index_of": spec.index_of, "correction": spec.correction}
        if spec.attention_of == "ours":
            row.update(attention_backend=att_backend, v_layout=v_layout)
        else:
            row.update(peer_window=cfg.peer_window, peer_last_n=cfg.peer_last_n, v_layout="row_major",
                       peer_corrects=peer_corrects(page_size, max(case.seqlens), group))
        if spec.index_of != spec.attention_of:
            row.update(agree=agree["jaccard"], overlap=agree)
        try:
            if spec.attention_of == "ours":
                idx = ours_idx if spec.index_of == "ours" else theirs
                attend = lambda c=corr, idx=idx: our_attend(idx, c)  # noqa: E731
                build = our_index
                total = lambda c=corr: our_attend(our_index(), c)  # noqa: E731
            else:
                idx = peer_idx if spec.index_of == "peer" else mine
                attend = lambda c=corr, idx=idx: peer_attend(idx, c)  # noqa: E731
                build = peer_index
                total = lambda c=corr: peer_attend(convert.PeerIndex.from_peer(peer_index()), c)  # noqa: E731
            out = attend()
            row.update(errors(out, ids, ref))
            del out
            row.update(metrics(ours_idx if spec.index_of == "ours" else theirs))
            row["attention_ms"] = bench_ms(attend, device, cfg.budget_ms)
            if corr:  # what the correction costs this side
                row["attention_nocorr_ms"] = bench_ms(lambda: attend(False), device, cfg.budget_ms)
            if spec.index_of == spec.attention_of:
                alloc0 = allocator_counters(device)
                row["index_ms"] = bench_ms(build, device, cfg.budget_ms)
                if cfg.index_parts and spec.attention_of == "ours" and not parts_done:
                    parts_done = True
                    row.update(index_alloc_delta(alloc0, allocator_counters(device)))
                    row.update(our_index_parts(q, kp, vp_ours, plan, ds, cfg, device))
                row["total_ms"] = bench_ms(total, device, cfg.budget_ms)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = repr(e)[:400]
        rows.append(row)

    if cfg.shipped and page_size == SERVED_PAGE_SIZE:
        rows.extend(shipped_rows(base, case, q, kp, vp, vp_ours, table, cu, lens, ids, ref, cdesc, cfg, device,
                                 peer_cls if peer_live else None, att_backend, idx_backend))

    # ---- dense and block-sparse baselines (bf16, B=1, contiguous K/V; first page size only)
    single = len(case.seqlens) == 1
    n = case.seqlens[0]
    if not is_fp8 and page_size == cfg.page_sizes[0]:
        if cfg.sdpa and single and device.type == "cuda":
            rows.append(sdpa_row(base, case, ids, ref, cfg, device))
        elif cfg.sdpa:
            rows.append({**base, "kernel": "sdpa_flash", "skipped": "B=1 on CUDA only"})
        if cfg.fa4 and (fa4 is None or not single or n < cfg.fa4_min_len):
            why = fa4_why or ("B=1 only" if not single else f"L < {cfg.fa4_min_len}")
            rows.append({**base, "kernel": "fa4", "skipped": why})
        elif cfg.fa4:
            rows.extend(fa4_rows(base, case, plan, ours_idx, ids, ref, cfg, device, fa4))
    for r in rows:
        r["case_s"] = round(time.time() - t_case, 1)
    del ours_idx, peer_idx, theirs, mine, kp, vp, vp_ours
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# The peer's SGLang backend as it ships (``sglang/srt/server_args.py``: the ``flashprefill_*``
# fields; FLASHPREFILLV2.md): selection block 64, sink 2 and window 4 blocks of it, threshold 1.0
# (only each tile's strongest block passes it), the last 2 query tiles dense, no mean correction,
# dense below 4096 query tokens (every case here is longer).
PEER_SGLANG = {"k_block_n": 64, "abs_threshold": 1.0, "attention_sink": 2, "window_size": 4,
               "last_n_blocks": 2, "use_mean_correction": False}
PEER_SGLANG_MIN_SPARSE_Q_LEN = 4096


def served_sparse() -> SparseConfig:
    """Our operator as the service runs it by default: ``sparse.*`` options' defaults (no
    calibrated profile: the 8B-shaped inputs are no model that ships one)."""
    from serving.config import SparseOptions

    return SparseOptions().operator_config()


def shipped_rows(base, case, q, kp, vp, vp_ours, table, cu, lens, ids, ref, cdesc, cfg: Cfg, device,
                 peer_cls, att_backend: str, idx_backend: str) -> list[dict]:
    """``ours_shipped`` and ``peer_shipped``: each operator with the defaults a user gets (our
    service's ``sparse.*`` defaults with the correction they imply; the peer's SGLang defaults),
    on the same inputs and pages: error at the sampled rows, density and needle recall of its own
    index, and on CUDA ``index_ms``/``attention_ms``/``total_ms``. Off CUDA the peer's row is its
    rule's CPU model (``convert.peer_rule_index`` at block 64) through our attention without
    correction, so the error column still compares what each side's defaults select."""
    out = []
    served = served_sparse()
    scale = served.softmax_scale(cfg.head_dim)
    ds = None
    if cdesc is not None:
        one = lambda x: torch.tensor([x], dtype=torch.float32, device=device)  # noqa: E731
    plan = plan_prefill(q, kp, vp, table, cu, lens, served)
    if cdesc is not None:
        ds = plan_descales(q, plan, one(cdesc[0]), one(cdesc[1]), one(cdesc[2]))
    row = {**base, "kernel": "ours_shipped", "index_of": "ours",
           "correction": "ours" if served.mean_correction else "none", "attention_backend": att_backend,
           "shipped": {"alpha": served.alpha, "block": served.block_size, "sink_tokens": served.sink_tokens,
                       "window_tokens": served.window_tokens, "last_dense_tiles": served.last_dense_tiles,
                       "energy_rule": served.energy_rule, "mean_correction": served.mean_correction}}
    try:
        build = lambda: build_index_planned(q, kp, vp_ours, plan, backend=idx_backend, descales=ds)  # noqa: E731
        index = build()
        attend = lambda: attention_planned(q, kp, vp_ours, plan, index, backend=att_backend,  # noqa: E731
                                           descales=ds)[0]
        row.update(errors(attend(), ids, ref))
        recall, pairs = fidelity.needle_recall(index, plan, case.needles)
        row.update(density=fidelity.index_density(index, plan), needle_recall=recall, needle_pairs=pairs)
        if device.type == "cuda":
            row["index_ms"] = bench_ms(build, device, cfg.budget_ms)
            row["attention_ms"] = bench_ms(attend, device, cfg.budget_ms)
            row["total_ms"] = bench_ms(lambda: attention_planned(q, kp, vp_ours, plan, build(), backend=att_backend,
                                                                 descales=ds)[0], device, cfg.budget_ms)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = repr(e)[:400]
    out.append(row)

    # the peer's index as ours at its own block (64) for density, recall and the CPU stand-in
    plan64 = plan_prefill(q, kp, vp, table, cu, lens, SparseConfig(alpha=served.alpha, block_size=64,
                                                                   mean_correction=False))
    ds64 = None if cdesc is None else plan_descales(q, plan64, one(cdesc[0]), one(cdesc[1]), one(cdesc[2]))
    row = {**base, "kernel": "peer_shipped", "index_of": "peer", "correction": "none",
           "shipped": dict(PEER_SGLANG, min_sparse_q_len=PEER_SGLANG_MIN_SPARSE_Q_LEN)}
    try:
        means64 = build_index_planned(q, kp, vp_ours, plan64, backend=idx_backend, descales=ds64).means
        kvd = {} if cdesc is None else {"k_descale": cdesc[1], "v_descale": cdesc[2]}
        if peer_cls is not None:
            fp = peer_cls(k_block_m=PEER_KBLOCK_M, causal=True, softmax_scale=scale, **PEER_SGLANG)
            q_lens, max_k = list(case.seqlens), max(case.seqlens)
            idx_kw = {} if cdesc is None else {"q_descale": cdesc[0], "k_descale": cdesc[1]}
            att_kw = {} if cdesc is None else {
                n: torch.full((len(q_lens), cfg.num_kv_heads), c, dtype=torch.float32, device=device)
                for n, c in zip(("q_descale", "k_descale", "v_descale"), cdesc)}
            build_p = lambda: fp.index_select(q, kp, table, lens, cu, v_cache=vp, q_lens=q_lens,  # noqa: E731
                                              max_cache_seqlen=max_k, **idx_kw)
            p = build_p()
            pidx = convert.PeerIndex(p.block_sparse_cu.clone(), p.block_sparse_idx.clone(), int(p.total_q_tiles),
                                     p.cu_q_tiles.clone(), None, None)
            attend_p = lambda idx=pidx: fp.block_sparse_attention(  # noqa: E731
                q, kp, vp, table, lens, cu, idx.to_peer(), max_seqlen_q=max_k, **att_kw)
            row.update(errors(attend_p(), ids, ref), attention_backend="peer")
            row["index_ms"] = bench_ms(build_p, device, cfg.budget_ms)
            row["attention_ms"] = bench_ms(attend_p, device, cfg.budget_ms)
            row["total_ms"] = bench_ms(lambda: fp.block_sparse_attention(
                q, kp, vp, table, lens, cu, build_p(), max_seqlen_q=max_k, **att_kw), device, cfg.budget_ms)
            theirs = convert.peer_to_ours(pidx, plan64, means64, **kvd)
        else:
            row["kernel"] = "peer_shipped_model"  # the CPU model of its rule, through our attention
            pidx = convert.peer_rule_index(q, kp, vp, plan64, alpha=PEER_SGLANG["abs_threshold"],
                                           sink_blocks=PEER_SGLANG["attention_sink"],
                                           window_blocks=PEER_SGLANG["window_size"],
                                           last_n_blocks=PEER_SGLANG["last_n_blocks"], block=64,
                                           **({} if cdesc is None else
                                              {"q_descale": cdesc[0], "k_descale": cdesc[1]}))
            theirs = convert.peer_to_ours(pidx, plan64, means64, **kvd)
            out_p = attention_planned(q, kp, vp_ours, plan64, theirs, backend=att_backend, descales=ds64)[0]
            row.update(errors(out_p, ids, ref), attention_backend=att_backend)
        recall, pairs = fidelity.needle_recall(theirs, plan64, case.needles)
        row.update(density=fidelity.index_density(theirs, plan64), needle_recall=recall, needle_pairs=pairs)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = repr(e)[:400]
    out.append(row)
    return out


ALLOC_COUNTERS = ("num_device_alloc", "num_alloc_retries", "num_sync_all_streams")


def allocator_counters(device) -> dict:
    """The caching allocator's cumulative counters (``{}`` off CUDA): a cudaMalloc inside a
    timed loop would show as a ``num_device_alloc`` step, memory pressure as retries."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats[k]) for k in ALLOC_COUNTERS if k in stats}


def index_alloc_delta(before: dict, after: dict) -> dict:
    """``index_<counter>``: how much each counter grew while ``index_ms`` was timed."""
    return {f"index_{k}": after[k] - before[k] for k in ALLOC_COUNTERS if k in before and k in after}


def our_index_parts(q, kp, vp, plan, ds, cfg, device) -> dict:
    """bench_index's parts of our index stage on this row's inputs (``index_means_ms``,
    ``index_select_ms``, ``index_nosync_ms``, ``index_sync_ms``) and the loaded index kernels'
    registers; ``index_parts_skipped`` where the Triton index cannot run (CPU without
    ``TRITON_INTERPRET=1``)."""
    from kernels.backend import triton_available

    if not triton_available(device):
        return {"index_parts_skipped": "the Triton index needs CUDA or TRITON_INTERPRET=1"}
    import bench_index
    import index_resources
    from kernels import triton_index

    parts = bench_index.index_parts(q, kp, vp, plan, lambda fn: bench_ms(fn, device, cfg.budget_ms), descales=ds)
    out = {"index_means_ms": parts["means_ms"], "index_select_ms": parts["select_ms"],
           "index_nosync_ms": parts["total_ms"], "index_sync_ms": parts["total_sync_ms"],
           "index_nnz": parts["nnz"], "index_kernels": []}
    for fn in (triton_index._block_means_kernel, triton_index._score_select_kernel, triton_index._compact_kernel):
        out["index_kernels"].extend(index_resources.launched_resources(fn))
    return out


def sdpa_row(base, case, ids, ref, cfg, device) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = cfg.num_qo_heads // cfg.num_kv_heads
    qt = case.q[None].transpose(1, 2)
    kt = case.ks[0][None].transpose(1, 2).repeat_interleave(g, 1)
    vt = case.vs[0][None].transpose(1, 2).repeat_interleave(g, 1)
    row = {**base, "kernel": "sdpa_flash"}
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
            out = fn()[0].transpose(0, 1)
            row.update(errors(out, ids, ref))
            row["total_ms"] = row["attention_ms"] = bench_ms(fn, device, cfg.budget_ms)
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
    return row


def fa4_rows(base, case, plan, index, ids, ref, cfg, device, fa4) -> list[dict]:
    import bench_operator as bo

    n = case.seqlens[0]
    q, k, v = case.q[None], case.ks[0][None], case.vs[0][None]
    out_rows = []
    row = {**base, "kernel": "fa4_dense"}
    try:
        def dense():
            o = fa4(q, k, v, causal=True)
            return o[0] if isinstance(o, tuple) else o

        row.update(errors(dense()[0], ids, ref))
        row["total_ms"] = row["attention_ms"] = bench_ms(dense, device, cfg.budget_ms)
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
    out_rows.append(row)
    row = {**base, "kernel": "fa4_sparse", "index_of": "ours (128x128 union)"}
    try:
        sel = bo.selection_tensor(plan, index, 1, n)
        bst, dens = bo.fa4_block_sparse(sel, 1, n, plan.group_size)

        def sparse():
            o = fa4(q, k, v, causal=True, block_sparse_tensors=bst)
            return o[0] if isinstance(o, tuple) else o

        row.update(errors(sparse()[0], ids, ref))
        row["density"] = dens
        row["attention_ms"] = bench_ms(sparse, device, cfg.budget_ms)
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
    out_rows.append(row)
    return out_rows


# ---------------------------------------------------------------------------------------------
# table, arguments, main
# ---------------------------------------------------------------------------------------------

PARTS_COLUMNS = [("means", "index_means_ms", "{:.2f}"), ("select", "index_select_ms", "{:.2f}"),
                 ("nosync", "index_nosync_ms", "{:.2f}")]
COLUMNS = [
    ("case", "case", "{}"), ("page", "page_size", "{}"), ("dtype", "dtype", "{}"),
    ("kernel", "kernel", "{}"), ("index", "index_of", "{}"), ("corr", "correction", "{}"),
    ("backend", "attention_backend", "{}"), ("dens", "density", "{:.4f}"),
    ("recall", "needle_recall", "{:.3f}"), ("agree", "agree", "{:.3f}"),
    ("idx_ms", "index_ms", "{:.2f}"), ("attn_ms", "attention_ms", "{:.2f}"),
    ("nocorr", "attention_nocorr_ms", "{:.2f}"), ("total", "total_ms", "{:.2f}"),
    ("rel_l2", "rel_l2", "{:.4f}"), ("max_abs", "max_abs", "{:.3g}"),
    ("note", "note", "{}"),
]


def table(rows: list[dict]) -> str:
    """One line a row; the index parts' columns after ``idx_ms`` only when a row has them."""
    columns = COLUMNS
    if any("index_means_ms" in r for r in rows):
        at = [c[1] for c in COLUMNS].index("index_ms") + 1
        columns = COLUMNS[:at] + PARTS_COLUMNS + COLUMNS[at:]
    body = []
    for r in rows:
        r = dict(r)
        r["note"] = r.get("skipped") or r.get("error")
        if isinstance(r["note"], str):
            r["note"] = r["note"][:60]
        cells = []
        for _, key, fmt in columns:
            val = r.get(key)
            cells.append("-" if val is None else (val if isinstance(val, str) else fmt.format(val)))
        body.append(cells)
    head = [c[0] for c in columns]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def parse_args(argv=None) -> tuple[Cfg, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default=None, help="B=1 lengths (default 8192,32768,65536,131072)")
    ap.add_argument("--varlen", default=None, help="lengths of the varlen batch ('' for none)")
    ap.add_argument("--page-sizes", default=None, help="page sizes of every case (default 16,64)")
    ap.add_argument("--page1", default=None,
                    help="cases also run at page size 1: lengths and/or 'varlen' (default 131072,varlen)")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--alpha", type=float, default=None)
    ap.add_argument("--peer-window", type=int, default=None, help="peer window_size in blocks (default 5)")
    ap.add_argument("--peer-last-n", type=int, default=None, help="peer last_n_blocks (default 0)")
    ap.add_argument("--attention", choices=("auto", "cutlass", "triton"), default="auto")
    ap.add_argument("--target-density", type=float, default=None,
                    help="structured inputs' target density (default: the paper's per length)")
    ap.add_argument("--rows", type=int, default=None, help="sampled query rows per sequence")
    ap.add_argument("--skip-fa4", action="store_true")
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--no-shipped", action="store_true",
                    help="skip the rows of each side with its shipped defaults (ours as served, the peer's SGLang)")
    ap.add_argument("--index-parts", action="store_true",
                    help="time our index by parts (means, select, no-sync total) on the first 'ours' row of "
                         "each case/page/dtype, with allocator counters and the index kernels' registers")
    ap.add_argument("--peer-path", default=None, help="folder holding flashprefill/ (default .peer/build)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test (tiny sizes, 4/1 heads): the row plan, our reference path, the "
                         "CPU model of the peer's index")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = Cfg()
    if args.dry_run:
        cfg = dataclasses.replace(cfg, lengths=(1024,), varlen=(384, 512), page1=("varlen",),
                                  rows=24, device="cpu", fa4=False, sdpa=False, target_density=0.3,
                                  num_qo_heads=4, num_kv_heads=1)
    rep = {}
    if args.lengths is not None:
        rep["lengths"] = _ints(args.lengths)
    if args.varlen is not None:
        rep["varlen"] = _ints(args.varlen)
    if args.page_sizes is not None:
        rep["page_sizes"] = _ints(args.page_sizes)
    if args.page1 is not None:
        rep["page1"] = tuple(x for x in args.page1.split(",") if x)
    for name in ("alpha", "peer_window", "peer_last_n", "rows", "peer_path", "target_density"):
        if getattr(args, name) is not None:
            rep[name] = getattr(args, name)
    rep["attention"] = args.attention
    if args.no_fp8:
        rep["fp8"] = False
    if args.skip_fa4:
        rep["fa4"] = False
    if args.skip_sdpa:
        rep["sdpa"] = False
    if args.index_parts:
        rep["index_parts"] = True
    if args.no_shipped:
        rep["shipped"] = False
    cfg = dataclasses.replace(cfg, **rep)
    if not cfg.page_sizes or any(p < 1 for p in cfg.page_sizes):
        ap.error(f"--page-sizes: expected page sizes >= 1, got {args.page_sizes!r}")
    if args.out is None:
        args.out = str(ROOT / "benchmarks/results" / ("peer_cpu_dryrun.json" if args.dry_run else "peer_h200.json"))
    return cfg, args


def cases_of(cfg: Cfg) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(name, seqlens, page sizes)`` in run order."""
    out = []
    def sizes(name: str) -> tuple[int, ...]:
        extra = (1,) if name in cfg.page1 and 1 not in cfg.page_sizes else ()
        return cfg.page_sizes + extra

    for n in cfg.lengths:
        out.append((f"L{n}", (n,), sizes(str(n))))
    if cfg.varlen:
        out.append(("varlen", cfg.varlen, sizes("varlen")))
    return out


def main(argv=None) -> dict:
    cfg, args = parse_args(argv)
    device = torch.device(cfg.device)
    env = environment(cfg, device)
    print(env, flush=True)
    peer_cls, peer_why = import_peer(cfg.peer_path)
    fa4, fa4_why = import_fa4() if cfg.fa4 else (None, "--skip-fa4")
    print({"peer": peer_why or "ok", "fa4": fa4_why or "ok"}, flush=True)
    rows: list[dict] = []
    result = {"env": env, "config": dataclasses.asdict(cfg), "argv": sys.argv[1:] if argv is None else argv,
              "rows": rows}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    dtypes = ("bfloat16", "fp8_e4m3") if cfg.fp8 else ("bfloat16",)
    for name, seqlens, page_sizes in cases_of(cfg):
        try:
            case = make_case(name, seqlens, cfg, device)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"case": name, "seqlens": list(seqlens), "error": f"inputs: {e!r}"[:300]})
            continue
        for ps in page_sizes:
            for dt in dtypes:
                try:
                    new = run_one(case, ps, dt, cfg, device, peer_cls, peer_why, fa4, fa4_why)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    new = [{"case": name, "page_size": ps, "dtype": dt, "error": repr(e)[:400]}]
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                for r in new:
                    r["predicted_density"] = case.predicted_density
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
                rows.extend(new)
                result["wall_s"] = time.time() - t0
                out_path.write_text(json.dumps(result, indent=1))  # keep what we have if killed
        del case
    result["wall_s"] = time.time() - t0
    out_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out_path} ({result['wall_s']:.0f} s)")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
