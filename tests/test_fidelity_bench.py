"""benchmarks/bench_fidelity.py (CPU smoke mode) and benchmarks/plot_accuracy.py.

The smoke run's numbers must be sane: on graded inputs the density falls as alpha grows, the
mean correction lowers the error at every alpha, the retained mass falls with alpha, and the
planted needles are found. The metric shortcuts (retained mass from the uncorrected lse, the
dense reference on sampled query blocks) must agree with kernels.fidelity's direct versions.
"""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from kernels import fidelity
from kernels.config import SparseConfig

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load("bench_fidelity")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smoke(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("fid") / "fidelity.json"
    result = bench.main(["--device", "cpu", "--lengths", "2048", "--out", str(out)])
    return result, json.loads(out.read_text())


CPU_CFG = dict(block_size=64, sink_tokens=64, window_tokens=128)


def test_smoke_json_shape(bench, smoke):
    result, saved = smoke
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert saved["mode"] == "cpu-smoke" and saved["backend"] == "reference"
    assert saved["environment"]["torch"] == torch.__version__
    dtypes = ("bf16", "fp8") if bench.fp8_dtype() else ("bf16",)
    assert [(r["family"], r["dtype"], r["alpha"]) for r in saved["rows"]] == [
        (f, dt, a) for f in ("structured", "graded") for dt in dtypes for a in bench.ALPHAS
    ]
    assert {r["dtype"] for r in saved["rows"]} == ({"bf16", "fp8"} if bench.fp8_dtype() else {"bf16"})
    assert ("skipped" in saved["fp8"]) == (bench.fp8_dtype() is None)
    for meta in saved["inputs"]:
        assert meta["reference"]["query_rows"] == "all"
        assert meta["reference"]["measured_positions"] == 2048
    keys = {"density", "retained_mass", "retained_mass_min", "rel_l2_corrected", "rel_l2_uncorrected",
            "max_abs_corrected", "max_abs_uncorrected", "rel_l2_dtype_floor", "needle_recall", "needle_pairs"}
    assert all(keys <= set(r) for r in saved["rows"])


def test_smoke_numbers_are_sane(smoke):
    _, saved = smoke
    for fam in ("structured", "graded"):
        rows = sorted((r for r in saved["rows"] if r["family"] == fam and r["dtype"] == "bf16"),
                      key=lambda r: r["alpha"])
        dens = [r["density"] for r in rows]
        mass = [r["retained_mass"] for r in rows]
        assert all(0 < d < 1 for d in dens)
        # density and retained mass never grow with alpha
        assert all(a >= b - 1e-12 for a, b in zip(dens, dens[1:])), dens
        assert all(a >= b - 1e-6 for a, b in zip(mass, mass[1:])), mass
        for r in rows:
            assert r["needle_recall"] == 1.0 and r["needle_pairs"] > 0
            # mean correction helps, and both errors sit above bf16 rounding and well below 1
            assert r["rel_l2_corrected"] < 0.7 * r["rel_l2_uncorrected"], r
            assert r["rel_l2_dtype_floor"] < r["rel_l2_corrected"] < 0.05
            assert r["max_abs_corrected"] < r["max_abs_uncorrected"]
            assert 0.5 < r["retained_mass_min"] <= r["retained_mass"] < 1.0
        # FP8 (inputs quantized, errors against the unquantized fp32 reference): correction
        # still helps, and the error stays a few percent
        for r in (r for r in saved["rows"] if r["family"] == fam and r["dtype"] == "fp8"):
            assert r["rel_l2_corrected"] < r["rel_l2_uncorrected"], r
            assert r["rel_l2_corrected"] < 0.08, r
    graded = sorted((r for r in saved["rows"] if r["family"] == "graded" and r["dtype"] == "bf16"),
                    key=lambda r: r["alpha"])
    # graded inputs: alpha moves the density and the error (0.0125 -> 0.2)
    assert graded[0]["density"] > graded[-1]["density"] + 0.03
    assert graded[0]["rel_l2_uncorrected"] < graded[-1]["rel_l2_uncorrected"]
    structured = [r for r in saved["rows"] if r["family"] == "structured" and r["dtype"] == "bf16"]
    meta = next(m for m in saved["inputs"] if m["family"] == "structured")
    # calibrated inputs: the index selects what the generator planted, whatever alpha
    assert all(abs(r["density"] - meta["predicted_density"]) < 0.02 for r in structured)


def test_metrics_match_kernels_fidelity(bench):
    cfg = SparseConfig(**CPU_CFG)
    x, _ = bench.make_inputs("graded", 1024, bench.CPU_SHAPE, cfg, torch.bfloat16, torch.device("cpu"),
                             3, None, bench.GRADED_MEAN)
    rows, ref = bench.measure_length(x, [0.1], cfg, "reference", 0, 0, {"bf16": torch.bfloat16})
    (row,) = rows
    assert ref["query_rows"] == "all"
    want = fidelity.fidelity_report(x.q, x.k, x.v, dataclasses.replace(cfg, alpha=0.1),
                                    backend="reference", needle_blocks=x.needle_blocks)
    assert row["density"] == pytest.approx(want["density"], abs=1e-12)
    assert row["needle_recall"] == want["needle_recall"]
    assert row["retained_mass"] == pytest.approx(want["retained_mass"], abs=2e-5)
    assert row["retained_mass_min"] == pytest.approx(want["retained_mass_min"], abs=2e-4)
    for k in ("rel_l2_corrected", "rel_l2_uncorrected", "max_abs_corrected", "max_abs_uncorrected"):
        assert row[k] == pytest.approx(want[k], rel=2e-3), k


def test_sampled_reference_equals_full_rows(bench):
    cfg = SparseConfig(**CPU_CFG)
    x, _ = bench.make_inputs("structured", 1000, bench.CPU_SHAPE, cfg, torch.bfloat16,
                             torch.device("cpu"), 1, 0.4, bench.GRADED_MEAN)
    qf, kp, vp, plan = fidelity.prepare_paged(x.q, x.k, x.v, cfg)
    blocks = bench.reference_blocks(1000, 3, torch.Generator().manual_seed(0))
    assert len(blocks) == 3 and blocks[-1] == (896, 1000)
    assert blocks == sorted(set(blocks)) and all(e - s <= 128 for s, e in blocks)
    rows, out, lse = bench.dense_reference(qf.float(), kp.float(), vp.float(), plan.page_table,
                                           blocks, cfg, "reference")
    full_rows, full_out, full_lse = bench.dense_reference(
        qf.float(), kp.float(), vp.float(), plan.page_table, [(0, 1000)], cfg, "reference")
    assert torch.equal(full_rows, torch.arange(1000))
    torch.testing.assert_close(out, full_out[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, full_lse[rows], rtol=1e-5, atol=1e-5)
    assert bench.reference_blocks(1000, 0, torch.Generator()) == [(0, 1000)]
    assert bench.reference_blocks(1000, 8, torch.Generator()) == [(0, 1000)]


def test_graded_inputs_touch_only_background_blocks(bench):
    cfg = SparseConfig(**CPU_CFG)
    shape = dict(num_qo_heads=8, num_kv_heads=4, head_dim=64)
    x, info = bench.graded_inputs(2048, **shape, config=cfg, dtype=torch.float32,
                                  device=torch.device("cpu"), seed=2)
    base = bench.structured_inputs(2048, **shape, target_density=1e-6, dtype=torch.float32,
                                   device="cpu", seed=2, config=cfg)
    assert info["graded_kv_heads"] == [h for h in range(4) if base.slash_offsets[h] is None] == [0, 2]
    diff = (x.k - base.k).abs().amax(dim=(0, 3))  # [L, Hkv]
    assert torch.equal(x.q, base.q) and torch.equal(x.v, base.v)
    for h in range(4):
        blocks = diff[:, h].reshape(-1, 64).amax(1)
        if h not in info["graded_kv_heads"]:
            assert blocks.max() == 0
            continue
        assert blocks[0] == 0  # sink
        needles = {int(r[2]) // 64 for r in x.needle_blocks.tolist() if r[1] == h}
        assert all(blocks[j] == 0 for j in needles)
        assert (blocks > 0).float().mean() > 0.8
    # the offset adds about c_J nats to every query's block-mean logit: scores of a graded head
    h, g = info["graded_kv_heads"][0], 2
    kbar = lambda k: k[0, :, h].reshape(-1, 64, 64).mean(1)  # noqa: E731
    s = (x.q[0, :, h * g] @ (kbar(x.k) - kbar(base.k)).T) * cfg.softmax_scale(64)  # [L, nb]
    levels = s.mean(0)
    assert levels.max() <= bench.GRADED_CAP * 1.1 and levels.min() >= -1e-3
    assert 0.7 * bench.GRADED_MEAN < float(levels[levels > 0].mean()) < 1.3 * bench.GRADED_MEAN
    assert float(s[:, levels > 1].std(0).max()) < 0.5  # the same shift for every query


def bench_alphas(saved):
    return saved["alphas"]


def test_plot_niah_merges_runs(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load("plot_accuracy")

    def run(lengths, trials=1):
        modes = [{"name": "dense", "config": {}}, {"name": "sparse_a0.1", "config": {}}]
        rows = [{"length": n, "depth": d, "mode": m["name"], "accuracy": 1.0 if m["name"] == "dense" else 0.5,
                 "trials": trials, "correct": trials} for n in lengths for d in (0.0, 1.0) for m in modes]
        summary = [{"length": n, "mode": m["name"], "accuracy": 0.75, "density": None if m["name"] == "dense"
                    else 0.2} for n in lengths for m in modes]
        return {"environment": {}, "model": {"name": "/models/Some-Model"}, "modes": modes, "rows": rows,
                "summary": summary, "density": [], "samples": [],
                "settings": {"lengths": lengths, "depths": [0.0, 1.0], "trials": trials, "chat_template": True}}

    merged = plot.merge_niah([run([8192, 4096]), None, run([65536], trials=2)])
    assert merged["settings"]["lengths"] == [4096, 8192, 65536] and merged["settings"]["trials"] == [1, 2]
    assert len(merged["rows"]) == 3 * 2 * 2
    (png,) = plot.plot_niah(merged, tmp_path, "")
    assert png.name == "niah_accuracy.png" and png.stat().st_size > 10_000
    table = plot.markdown_niah(merged)
    assert "| 64K | 0.75 | 0.75 | 0.200 |" in table and "1/2 trials" in table
    with pytest.raises(ValueError, match="more than one file"):
        plot.merge_niah([run([4096]), run([4096])])
    other = run([8192])
    other["modes"] = other["modes"][:1]
    with pytest.raises(ValueError, match="differ in modes"):
        plot.merge_niah([run([4096]), other])
    assert plot.merge_niah([None]) is None


def test_bench_errors(bench):
    cfg = SparseConfig(**CPU_CFG)
    with pytest.raises(ValueError, match="family"):
        bench.make_inputs("random", 512, bench.CPU_SHAPE, cfg, torch.bfloat16, torch.device("cpu"), 0, None, 1.5)
    with pytest.raises(SystemExit, match="alphas"):
        bench.main(["--device", "cpu", "--alphas", "0", "--lengths", "512"])


def test_plot_accuracy_writes_pngs(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    _, saved = smoke
    plot = _load("plot_accuracy")
    fid = tmp_path / "fidelity.json"
    fid.write_text(json.dumps(saved))
    retrieval = {"environment": {}, "device": "cpu", "rows": [
        {"length": n, "needle_repeats": r, "variant": v, "trials": 4, "accuracy": a,
         "needle_selected": 0.5, "density_layer2": 0.2, "seconds": 1.0}
        for r in (1, 16) for n in (4096, 8192)
        for v, a in (("dense", 1.0), ("sparse", 0.75), ("sparse_nocorr", 0.5))]}
    (tmp_path / "retrieval.json").write_text(json.dumps(retrieval))
    written = plot.main(["--fidelity", str(fid), "--retrieval", str(tmp_path / "retrieval.json"),
                         "--niah", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path / "img"),
                         "--suffix", "_t"])
    names = sorted(p.name for p in written)
    assert names == ["fidelity_error_vs_length_t.png", "fidelity_vs_alpha_t.png", "retrieval_accuracy_t.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    table = plot.markdown_fidelity({**saved, "rows": [r for r in saved["rows"] if r["dtype"] == "bf16"]})
    # structured inputs: one row for all alphas (same selection); graded: one row per alpha
    assert table.count("| 2K | all (0.0125-0.2) |") == 1 and table.count("| 2K |") == 1 + len(bench_alphas(saved))
    if any(r["dtype"] == "fp8" for r in saved["rows"]):
        assert "**graded inputs, fp8**" in plot.markdown_fidelity(saved)
    assert "0.75" in plot.markdown_retrieval(retrieval)


def test_git_commit_prefers_the_environment_then_the_checkout(monkeypatch):
    import re
    import subprocess

    from evals.report import git_commit

    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("GIT_COMMIT")
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        assert git_commit().startswith("unknown")
        return
    got = git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", got) and got.startswith(head)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no git")))
    assert git_commit() == "unknown (no git checkout, GIT_COMMIT unset)"
