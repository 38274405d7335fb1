"""CPU tests of benchmarks/bench_peer.py's pieces: index conversion between our format and the
peer's (qhfan/FlashPrefillv2), the CPU model of the peer's selection rule, the sampled exact
reference, and a tiny end-to-end dry run writing JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import bench_peer  # noqa: E402
from kernels import fidelity, reference  # noqa: E402
from kernels.config import SparseConfig  # noqa: E402
from kernels.ops import plan_prefill  # noqa: E402
from kernels.synthetic import structured_inputs  # noqa: E402
from peers import convert  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _setup(seqlens=(1024,), page_size=64, target=0.3, seed=0):
    cfg = bench_peer.Cfg(device="cpu", target_density=target, seed=seed, rows=16)
    case = bench_peer.make_case("t", tuple(seqlens), cfg, torch.device("cpu"))
    kp, vp, table, cu, lens = bench_peer.paged(case, page_size)
    plan = plan_prefill(case.q, kp, vp, table, cu, lens, SparseConfig())
    return case, kp, vp, plan


@pytest.fixture(scope="module")
def varlen():
    case, kp, vp, plan = _setup((640, 1024))
    return case, kp, vp, plan, reference.build_index(case.q, kp, vp, plan)


def _entries(index, plan):
    seg, n, *_ = convert._entries(index.seg_offsets, index.kv_tiles, plan)
    return set(zip(seg.tolist(), n.tolist()))


def test_round_trip_is_identity(varlen):
    case, kp, vp, plan, ours = varlen
    peer = convert.ours_to_peer(ours, plan, torch.bfloat16)
    back = convert.peer_to_ours(peer, plan)
    assert torch.equal(back.seg_offsets, ours.seg_offsets)
    assert torch.equal(back.kv_tiles[: ours.nnz], ours.kv_tiles[: ours.nnz])
    # means go through bf16: within its rounding
    assert torch.allclose(back.means.kbar, ours.means.kbar, rtol=1e-2, atol=1e-2)
    assert peer.k_mean.shape == (plan.batch_size, plan.max_blocks, HKV, D)


def test_peer_format_expands_whole_blocks(varlen):
    _, _, _, plan, ours = varlen
    peer = convert.ours_to_peer(ours, plan, torch.bfloat16, with_means=False)
    off = peer.block_sparse_cu.tolist()
    tiles_kv = [-(-n // 64) for n in plan.seqlens_kv]
    for seg in range(plan.num_segments):
        t = peer.block_sparse_idx[off[seg] : off[seg + 1]].tolist()
        b = int(plan.tile_seq[seg % plan.total_tiles])
        assert t == sorted(t) and len(set(t)) == len(t)
        for j in {x // 2 for x in t}:  # every tile of a selected 128-token block below Lkv
            assert {2 * j, 2 * j + 1} & set(range(tiles_kv[b])) <= set(t)
    # our index drops tiles no row sees: the peer's has at least as many, same visible pairs
    assert off[-1] >= ours.nnz
    back = convert.peer_to_ours(peer, plan, ours.means)
    assert fidelity.index_density(back, plan) == pytest.approx(fidelity.index_density(ours, plan))


def test_peer_rule_window_five_blocks_is_our_512_tokens(varlen):
    case, kp, vp, plan, ours = varlen
    w5 = convert.peer_to_ours(convert.peer_rule_index(case.q, kp, vp, plan, alpha=0.1,
                                                      window_blocks=5), plan)
    assert _entries(w5, plan) == _entries(ours, plan)
    w4 = convert.peer_to_ours(convert.peer_rule_index(case.q, kp, vp, plan, alpha=0.1,
                                                      window_blocks=4), plan)
    a, b = _entries(w4, plan), _entries(ours, plan)
    assert a < b  # the nominal 4-block window keeps one block less per query tile
    ov = convert.overlap(ours, w4, plan)
    assert ov["only_b"] == 0 and ov["only_a"] == len(b - a) > 0 and ov["jaccard"] < 1.0


def test_peer_rule_last_n_is_dense(varlen):
    case, kp, vp, plan, _ = varlen
    dense = convert.peer_to_ours(convert.peer_rule_index(case.q, kp, vp, plan, alpha=1.0,
                                                         window_blocks=1, last_n_blocks=10**6), plan)
    assert fidelity.index_density(dense, plan) == pytest.approx(1.0)


def test_means_fp8_round_trip(varlen):
    _, _, _, plan, ours = varlen
    kd, vd = 0.02, 0.03
    km, vm = convert.means_to_peer(ours.means, plan, convert.FP8, kd, vd)
    assert km.dtype == convert.FP8
    back = convert.means_from_peer(km, vm, plan, kd, vd)
    rel = (back.kbar - ours.means.kbar).norm() / ours.means.kbar.norm()
    assert rel < 0.07  # e4m3 has 3 mantissa bits


def test_mismatched_tiling_is_rejected(varlen):
    _, _, _, plan, ours = varlen
    peer = convert.ours_to_peer(ours, plan, torch.bfloat16)
    bad = convert.PeerIndex(peer.block_sparse_cu, peer.block_sparse_idx, peer.total_q_tiles + 1,
                            peer.cu_q_tiles, peer.k_mean, peer.v_mean)
    with pytest.raises(ValueError, match="query tiles"):
        convert.peer_to_ours(bad, plan)


def test_exact_rows_matches_reference_dense():
    case, kp, vp, plan = _setup((256, 384), target=None)
    pos = bench_peer.sample_rows(case.seqlens, 8)
    assert all(p[-1] == n - 1 for p, n in zip(pos, case.seqlens))
    ref = bench_peer.exact_rows(case.q, case.ks, case.vs, case.seqlens, pos, SparseConfig().softmax_scale(D))
    full, _ = reference.dense_attention(case.q.float(), kp.float(), vp.float(), plan)
    ids = bench_peer.row_ids(case.seqlens, pos)
    err = bench_peer.errors(full, ids, ref)
    assert err["finite"] and err["rel_l2"] < 1e-5 and err["max_abs"] < 1e-4
    assert bench_peer.errors(full.to(torch.bfloat16), ids, ref)["rel_l2"] > 0  # sees rounding


def test_cases_and_table():
    cfg, _ = bench_peer.parse_args(["--lengths", "8192,131072", "--varlen", "4096,8192",
                                    "--page1", "131072"])
    assert bench_peer.cases_of(cfg) == [("L8192", (8192,), (16, 64)), ("L131072", (131072,), (16, 64, 1)),
                                        ("varlen", (4096, 8192), (16, 64))]
    cfg, _ = bench_peer.parse_args(["--lengths", "1024", "--varlen", "", "--page-sizes", "1,64", "--page1", "1024"])
    assert bench_peer.cases_of(cfg) == [("L1024", (1024,), (1, 64))]  # page 1 once
    text = bench_peer.table([{"case": "L1", "kernel": "peer", "skipped": "why"},
                             {"case": "L1", "kernel": "ours", "density": 0.5, "rel_l2": 1e-3, "correction": "none"}])
    assert "why" in text and "0.5000" in text and "none" in text and text.count("\n") == 2


@pytest.mark.parametrize("bad", ["0,64", "", "-16"])
def test_page_sizes_must_be_positive(bad, capsys):
    with pytest.raises(SystemExit):
        bench_peer.parse_args(["--page-sizes", bad])
    assert "--page-sizes" in capsys.readouterr().err


def test_peer_corrects_only_off_the_64_key_tile():
    """The peer's TMA paged kernel (page % 64 == 0 and more than 128 packed query rows) has no
    correction (FLASHPREFILLV2.md); the non-TMA one, every other page size, has it."""
    g = HQ // HKV
    for page in (1, 16, 32, 48, 80, 96):
        assert bench_peer.peer_corrects(page, 8192, g)
    for page in (64, 128, 256):
        assert not bench_peer.peer_corrects(page, 8192, g)
    assert bench_peer.peer_corrects(64, 32, g)  # 32 x 4 = 128 packed rows: not the TMA kernel


def test_row_plan_puts_both_sides_on_equal_terms():
    g = HQ // HKV
    for page in (16, 1):
        plan = bench_peer.row_plan(page, 8192, g)
        assert [(r.kernel, r.correction) for r in plan] == [
            ("ours", "ours"), ("peer", "peer"), ("ours@peer", "ours"), ("peer@ours", "peer")]
        assert all(r.correction == r.attention_of for r in plan)  # each side runs its own correction
    plan = bench_peer.row_plan(64, 8192, g)
    none = [r for r in plan if r.correction == "none"]
    assert {(r.attention_of, r.index_of) for r in none} == {("ours", "ours"), ("peer", "peer"),
                                                           ("ours", "peer"), ("peer", "ours")}
    assert [(r.kernel, r.attention_of, r.correction) for r in plan if r.correction != "none"] == [
        ("ours", "ours", "ours")]  # ours corrected beside; never the peer (it would drop it)
    assert all(r.kernel == (r.attention_of if r.attention_of == r.index_of else f"{r.attention_of}@{r.index_of}")
               for r in plan)


def test_dry_run_writes_json(tmp_path):
    """The row plan at pages 16 (correction on both sides) and 64 (off on both, ours corrected
    beside), our side on the reference path with FP8 V token-major, the CPU model of the peer's
    index standing in for its own."""
    out = tmp_path / "peer.json"
    res = bench_peer.main(["--dry-run", "--lengths", "", "--varlen", "256,320", "--page1", "",
                           "--rows", "8", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["num_qo_heads"] == 4 and data["config"]["page_sizes"] == [16, 64]
    rows = data["rows"]
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    by = {(r["page_size"], r["dtype"], r["kernel"], r.get("correction")): r for r in rows}
    for dt in ("bfloat16", "fp8_e4m3"):
        got16 = {(k, c) for (p, d, k, c) in by if p == 16 and d == dt}
        assert got16 == {("peer", None), ("peer_model", None), ("ours", "ours"), ("ours@peer", "ours")}
        got64 = {(k, c) for (p, d, k, c) in by if p == 64 and d == dt}
        assert got64 == {("peer", None), ("peer_model", None), ("ours", "none"), ("ours@peer", "none"),
                         ("ours", "ours"), ("ours_shipped", "ours"), ("peer_shipped_model", "none")}
        for p in (16, 64):
            assert "does not import" in by[(p, dt, "peer", None)]["skipped"]
            assert by[(p, dt, "ours", "ours")]["v_layout"] == ("token_major" if dt == "fp8_e4m3" else "row_major")
    for (p, dt, k, c), r in by.items():
        if k.startswith("ours"):
            assert r["rel_l2"] < (5e-2 if dt == "fp8_e4m3" else 5e-3) and r["finite"], (p, dt, k, c)
            # the correction's cost where it ran (the shipped rows time each side as it ships)
            assert ("attention_nocorr_ms" in r) == (c == "ours" and k != "ours_shipped")
            assert ("total_ms" in r) == (k == "ours")  # ours_shipped: timed on CUDA only
    # the model of the peer's rule (window 5) selects exactly our blocks
    assert by[(16, "bfloat16", "ours@peer", "ours")]["agree"] == 1.0
    assert data["env"]["gpu"] == "cpu" and data["env"]["commit"]
    assert res["rows"] == data["rows"]


def test_index_parts_dry_run(tmp_path, monkeypatch):
    """``--index-parts``: bench_index's parts of our index on the first ``ours`` row of each
    (page size, dtype) only, the Triton index under the interpreter, its nnz that of the
    reference index, and the parts' columns in the table."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "peer.json"
    res = bench_peer.main(["--dry-run", "--lengths", "", "--varlen", "256,320", "--page1", "", "--page-sizes", "64",
                           "--rows", "8", "--index-parts", "--no-shipped", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["index_parts"] is True
    rows = [r for r in data["rows"] if "index_means_ms" in r]
    assert [(r["page_size"], r["dtype"], r["kernel"], r["correction"]) for r in rows] == [
        (64, "bfloat16", "ours", "none"), (64, "fp8_e4m3", "ours", "none")]
    case = bench_peer.make_case("t", (256, 320), bench_peer.Cfg(device="cpu", target_density=0.3, num_qo_heads=4,
                                                                num_kv_heads=1), torch.device("cpu"))
    kp, vp, table, cu, lens = bench_peer.paged(case, 64)
    plan = plan_prefill(case.q, kp, vp, table, cu, lens, SparseConfig())
    assert rows[0]["index_nnz"] == reference.build_index(case.q, kp, vp, plan).nnz
    for r in rows:
        assert all(r[k] > 0 for k in ("index_means_ms", "index_select_ms", "index_nosync_ms", "index_sync_ms"))
        assert r["index_kernels"] == [] and "index_num_device_alloc" not in r  # CUDA figures only
    text = bench_peer.table(res["rows"])
    assert "means" in text.splitlines()[0] and "select" in text.splitlines()[0]
    assert "means" not in bench_peer.table([{"case": "L1", "kernel": "ours"}]).splitlines()[0]


def test_index_parts_need_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = bench_peer.Cfg(device="cpu")
    got = bench_peer.our_index_parts(None, None, None, None, None, cfg, torch.device("cpu"))
    assert got == {"index_parts_skipped": "the Triton index needs CUDA or TRITON_INTERPRET=1"}


def test_index_alloc_delta():
    before = {"num_device_alloc": 3, "num_alloc_retries": 0, "num_sync_all_streams": 7}
    after = {"num_device_alloc": 5, "num_alloc_retries": 1, "num_sync_all_streams": 7}
    assert bench_peer.index_alloc_delta(before, after) == {
        "index_num_device_alloc": 2, "index_num_alloc_retries": 1, "index_num_sync_all_streams": 0}
    assert bench_peer.index_alloc_delta({}, {}) == {}  # off CUDA
    assert bench_peer.allocator_counters(torch.device("cpu")) == {}


def test_the_served_page_size_is_the_services_default():
    from serving.config import KVOptions

    assert bench_peer.SERVED_PAGE_SIZE == KVOptions().page_size


def test_shipped_rows_compare_our_served_defaults_with_the_peers_sglang_defaults():
    cfg = bench_peer.Cfg(device="cpu", target_density=0.3, seed=3, rows=16, num_qo_heads=4, num_kv_heads=1)
    dev = torch.device("cpu")
    case = bench_peer.make_case("s", (2048,), cfg, dev)
    kp, vp, table, cu, lens = bench_peer.paged(case, 64)
    pos = bench_peer.sample_rows(case.seqlens, cfg.rows)
    ids = bench_peer.row_ids(case.seqlens, pos)
    ref = bench_peer.exact_rows(case.q, case.ks, case.vs, case.seqlens, pos, SparseConfig().softmax_scale(D))
    rows = bench_peer.shipped_rows({"case": "s"}, case, case.q, kp, vp, vp, table, cu, lens, ids, ref, None,
                                   cfg, dev, None, "auto", "auto")
    ours, peer = rows
    assert [ours["kernel"], peer["kernel"]] == ["ours_shipped", "peer_shipped_model"]
    assert "error" not in ours and "error" not in peer
    # ours as the service's sparse options default them; the peer as its SGLang server's flags do
    assert ours["shipped"]["last_dense_tiles"] == 2 and ours["shipped"]["energy_rule"] == "first_key"
    assert ours["correction"] == "ours" and peer["correction"] == "none"
    assert peer["shipped"]["abs_threshold"] == 1.0 and peer["shipped"]["k_block_n"] == 64
    # threshold 1.0, a 256-token window and 128 sink tokens keep fewer pairs than alpha 0.1,
    # a 512-token window and 256 sink tokens; the fewer pairs cost accuracy on these inputs
    assert 0 < peer["density"] < ours["density"] < 1
    assert ours["finite"] and peer["finite"] and ours["rel_l2"] < peer["rel_l2"]
