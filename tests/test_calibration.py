"""model_executor/calibration: the metrics and scorers against hand-computed values, the grid and
the selection rule, the command end to end on the built-in tiny model (a valid profile whose
chosen setting meets the budget by its own recorded measurements; an impossible budget; the time
guard), bad arguments, the Pareto table, and that a profile changes what a prefill selects."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kernels.config import SparseConfig
from model_executor.calibration import calibrate as cal
from model_executor.calibration import cli, forwards, lastword, needle, table
from model_executor.calibration.grid import GRIDS, Axes, GridPoint, sensitivity_schedule
from model_executor.calibration.metrics import compare_logits, summarize
from model_executor.calibration.text import ending_windows
from model_executor.loading import load_model, make_pool
from model_executor.runner import ModelRunner, PrefillItem
from model_executor.sparse_profile import SparseProfile
from model_executor.tokenizer import ByteTokenizer
from router.__main__ import main

# what the tiny model needs to have blocks to prune at a few hundred tokens (its attention is flat)
SMALL = ["--block-size", "64", "--sink", "64", "--window", "64", "--alphas", "0.5"]
TINY = ["--model", "builtin:tiny", "--device", "cpu", "--threads", "1", "--grid", "quick", *SMALL,
        "--prompts", "2", "--needles", "2", "--needle-new-tokens", "3", "--lastword-items", "2",
        "--lastword-chars", "100"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- metrics and scorers -------------------------------------------------------------------------
def test_kl_of_known_distributions():
    p, q = [0.5, 0.5], [0.9, 0.1]
    ref = torch.tensor([[math.log(x) for x in p], [math.log(x) for x in q]])
    other = torch.tensor([[math.log(x) for x in q], [math.log(x) for x in q]])
    c = compare_logits(ref, other, torch.tensor([0, 1]))
    assert c.kl[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-6)
    assert c.kl[1].item() == pytest.approx(0.0, abs=1e-12)
    assert c.agree.tolist() == [True, True]  # argmax 0 (first of a tie) and 0
    assert c.nll_ref.tolist() == pytest.approx([-math.log(0.5), -math.log(0.1)], rel=1e-6)
    assert c.nll.tolist() == pytest.approx([-math.log(0.9), -math.log(0.1)], rel=1e-6)
    s = summarize([c.tail(1)])
    assert s["scored_positions"] == 1 and s["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert s["ppl"] == pytest.approx(10.0, rel=1e-6)


def test_ending_windows_spread_their_ends_and_name_bad_arguments():
    ids = list(range(100))
    got = ending_windows(ids, 10, 4)
    # ends spread over [10, 99]: starts round(i * 89 / 3) = 0, 30, 59, 89
    assert [w[0] for w, _ in got] == [0, 30, 59, 89]
    assert all(w == list(range(w[0], w[0] + 10)) and nxt == w[0] + 10 for w, nxt in got)
    assert ending_windows(ids, 10, 1) == [(list(range(10)), 10)]
    with pytest.raises(ValueError, match="length"):
        ending_windows(ids, 100, 1)
    with pytest.raises(ValueError, match="prompts"):
        ending_windows(ids, 10, 91)
    with pytest.raises(ValueError, match="prompts"):
        ending_windows(ids, 10, 0)


def test_needle_scoring_strings():
    assert needle.is_correct("1234567", " 1234567.")
    assert needle.is_correct("1234567", "The number is 1234567 and more")
    assert not needle.is_correct("1234567", "11234567")
    assert not needle.is_correct("1234567", "12345678")
    assert not needle.is_correct("1234567", "123 4567")


def test_lastword_items_and_greedy_hit():
    tok = ByteTokenizer()
    item = {"context": "the end of the", "target": " story"}
    ids, n = lastword.encode_item(tok, item)
    assert ids == tok.encode("the end of the story", add_bos=False) and n == len(" story")
    logits = torch.zeros(len(ids), 300)
    for p in range(len(ids) - 1):  # a model that always predicts the next byte
        logits[p, ids[p + 1]] = 1.0
    assert lastword.greedy_hit(logits, ids, n)
    logits[len(ids) - 3, ids[-2]] = 0.0
    logits[len(ids) - 3, 0] = 2.0  # one target byte wrong
    assert not lastword.greedy_hit(logits, ids, n)
    assert lastword.greedy_hit(logits, ids, 1)  # the last byte alone is still right
    with pytest.raises(ValueError, match="n_target"):
        lastword.greedy_hit(logits, ids, 0)
    with pytest.raises(ValueError, match="logits"):
        lastword.greedy_hit(logits[1:], ids, 1)


# -- grid and selection --------------------------------------------------------------------------
def test_sensitivity_schedule_by_thirds():
    # ranks: layer 0 (3) > layer 2 (2) > layer 1 (1) > layer 3 (0); n = 4: top 2 at alpha/4, bottom 1 at 2 alpha
    assert sensitivity_schedule(0.2, [3.0, 1.0, 2.0, 0.0]) == (0.05, 0.2, 0.05, 0.4)
    assert sensitivity_schedule(0.8, [0.0, 0.0, 0.0]) == (0.2, 0.8, 1.0)  # ties: the earlier layer first; capped at 1
    with pytest.raises(ValueError, match="sensitivity"):
        sensitivity_schedule(0.1, [])
    with pytest.raises(ValueError, match=r"sensitivity\[1\]"):
        sensitivity_schedule(0.1, [0.1, float("nan")])


def test_grid_points_and_their_configs():
    assert len(GRIDS["full"].points()) == 3 * 4 * 2 * 3 * 2
    p = GridPoint(0.2, 2, "first_key", 1, "sensitivity")
    c = p.config(SparseConfig(block_size=64), [3.0, 1.0, 2.0, 0.0])
    assert (c.alpha, c.last_dense_tiles, c.energy_rule, c.dense_layers, c.block_size) == (0.2, 2, "first_key", 1, 64)
    assert c.layer_alpha == (0.05, 0.2, 0.05, 0.4) and c.alpha_of_layer(0) == 0.0  # dense_layers wins
    assert GridPoint(0.2, 0, "visible", 0, "uniform").config(SparseConfig()).layer_alpha is None
    with pytest.raises(ValueError, match="sensitivity"):
        p.config(SparseConfig())
    for kwargs, name in (({"alphas": (0.0,)}, "alphas"), ({"energy_rules": ("nearest",)}, "energy_rules"),
                         ({"dense_layers": (-1,)}, "dense_layers"), ({"schedules": ()}, "schedules"),
                         ({"last_dense_tiles": (2, 2)}, "last_dense_tiles")):
        with pytest.raises(ValueError, match=name):
            Axes(**{**vars(GRIDS["quick"]), **kwargs})


def _row(setting, length, density, kl, kl8, needle=None, dense=None):
    return {"kind": "grid", "setting": setting, "length": length, "density": density, "kl_last256": kl,
            "kl_last8": kl8, "needle": needle, "needle_dense": dense, "needles": 20}


def test_judge_checks_every_length_and_the_last_word():
    budget = cal.Budget(kl=0.02, kl_last=0.01, needle_slack=1, lastword_slack=1)
    rows = [_row("a", 2048, 0.5, 0.02, 0.01, 15, 16), _row("a", 4096, 0.3, 0.01, 0.0, 16, 16),
            {"kind": "lastword", "setting": "a", "correct": 99, "dense_correct": 100, "items": 300}]
    v = cal.judge(rows, "a", [2048, 4096], budget, True)
    assert v["failures"] == [] and v["density"] == pytest.approx(0.4) and v["kl_sum"] == pytest.approx(0.03)
    rows[0]["needle"] = 14  # two below dense
    rows[1]["kl_last8"] = 0.011
    rows[2]["correct"] = 98
    v = cal.judge(rows, "a", [2048, 4096], budget, True)
    assert len(v["failures"]) == 3 and "needle 14/20" in v["failures"][0] and "KL last 8" in v["failures"][1]
    assert "last word 98/300" in v["failures"][2]
    assert cal.judge(rows, "a", [4096], budget, False)["failures"] == ["L=4096: KL last 8 1.100e-02 > 0.01"]
    missing = cal.judge(rows, "a", [2048, 8192], budget, False)
    assert "L=8192: not measured" in missing["failures"] and missing["density"] == math.inf


def test_pareto_front():
    rows = [{"setting": "a", "density": 0.3, "kl_last256": 0.05}, {"setting": "b", "density": 0.4, "kl_last256": 0.01},
            {"setting": "c", "density": 0.5, "kl_last256": 0.02}, {"setting": "d", "density": 0.3, "kl_last256": 0.06}]
    assert table.pareto_front(rows) == {"a", "b"}


# -- the command ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib") / "profile.json"
    with_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["calibrate", *TINY, "--lengths", "384", "448", "--budget-kl", "0.15",
                     "--budget-kl-last", "0.05", "--out", str(out)])
    finally:
        torch.set_num_threads(with_threads)
    return code, out


def test_end_to_end_writes_a_profile_that_meets_its_budget(calibrated):
    code, out = calibrated
    assert code == 0
    profile = SparseProfile.load(out)
    assert profile.model == "builtin:tiny" and profile.num_layers == 4
    assert profile.budget["met"] and profile.budget["failures"] == []
    grid = [r for r in profile.measured if r["kind"] == "grid"]
    settings = {r["setting"] for r in grid}
    assert len(settings) == len(GRIDS["quick"].points()) and {r["length"] for r in grid} == {384, 448}
    # every row a setting measured; the chosen one meets the budget by its own recorded figures
    chosen = profile.budget["chosen"]
    rows = [r for r in grid if r["setting"] == chosen]
    assert len(rows) == 2 and all(r["chosen"] for r in rows)
    for r in rows:
        assert r["kl_last256"] <= 0.15 and r["kl_last8"] <= 0.05 and r["needle"] >= r["needle_dense"] - 1
        assert 0 < r["density"] < 1 and r["sparse"] == dict(profile.sparse)
    lw = next(r for r in profile.measured if r["kind"] == "lastword" and r["setting"] == chosen)
    assert lw["correct"] >= lw["dense_correct"] - 1 and lw["items"] == 2
    # ... and is the sparsest of those that meet it
    def meets(s):
        rs = [r for r in grid if r["setting"] == s]
        return all(r["kl_last256"] <= 0.15 and r["kl_last8"] <= 0.05 for r in rs)
    density = {s: sum(r["density"] for r in grid if r["setting"] == s) / 2 for s in settings}
    assert density[chosen] == min(density[s] for s in settings if meets(s))
    assert profile.expected_density == pytest.approx(density[chosen], abs=1e-6)
    assert {s for s in settings if meets(s)} == {r["setting"] for r in grid if r["meets_budget"]}
    sens = next(r for r in profile.measured if r["kind"] == "layer_sensitivity")
    assert len(sens["kl_last256"]) == 4 and sens["length"] == 448
    prov = profile.provenance
    assert prov["command"].startswith("python -m router calibrate --model builtin:tiny")
    assert prov["versions"]["torch"] == torch.__version__ and prov["device"].startswith("cpu")
    assert profile.dense_below is None


def test_table_renders_the_profile(calibrated, capsys):
    _, out = calibrated
    profile = SparseProfile.load(out)
    capsys.readouterr()
    assert main(["calibrate", "--table", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == table.markdown(profile)
    lines = [ln for ln in text.splitlines() if ln.startswith("| 384 ") or ln.startswith("| 448 ")]
    assert len(lines) == 2 * (1 + len(GRIDS["quick"].points()))  # dense + every setting, per length
    chosen = [ln for ln in lines if "(chosen)" in ln]
    assert len(chosen) == 2 and all(f"**{profile.budget['chosen']}**" in ln for ln in chosen)
    densities = [float(ln.split("|")[3]) for ln in lines if ln.startswith("| 384 ") and "| dense |" not in ln]
    assert densities == sorted(densities)
    assert main(["calibrate", "--table", str(out), "--pareto-only"]) == 0
    short = capsys.readouterr().out
    assert "(chosen)" in short and short.count("\n") <= text.count("\n")


def test_an_impossible_budget_writes_the_best_and_exits_1(tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["calibrate", *TINY, "--lengths", "384", "--schedules", "uniform", "--last-dense-tiles", "2",
                 "--needles", "0", "--lastword-items", "0", "--budget-kl", "0", "--budget-kl-last", "0",
                 "--out", str(out)])
    assert code == 1
    assert "NOT met" in capsys.readouterr().err
    profile = SparseProfile.load(out)
    assert not profile.budget["met"] and any("KL last 256" in f for f in profile.budget["failures"])
    rows = [r for r in profile.measured if r["kind"] == "grid"]
    assert len(rows) == 2 and not any(r["meets_budget"] for r in rows)
    # the best: fewest failed checks (both fail KL last 256 and last 8), then the lowest KL
    best = min(rows, key=lambda r: r["kl_last256"])
    assert profile.budget["chosen"] == best["setting"]


def test_the_time_guard_stops_and_does_not_meet(tmp_path):
    out = tmp_path / "p.json"
    code = main(["calibrate", *TINY, "--lengths", "384", "--schedules", "uniform", "--needles", "0",
                 "--lastword-items", "0", "--budget-kl", "1", "--max-seconds", "0.001", "--out", str(out)])
    assert code == 1
    profile = SparseProfile.load(out)
    assert not profile.budget["met"] and any(f.startswith("incomplete") for f in profile.budget["failures"])
    assert not [r for r in profile.measured if r["kind"] == "grid"]


@pytest.mark.parametrize("extra, flag", [
    (["--budget-kl", "-1"], "--budget-kl"),
    (["--budget-kl", "nan"], "--budget-kl"),
    (["--budget-kl-last", "-0.5"], "--budget-kl-last"),
    (["--needle-slack", "-1"], "--needle-slack"),
    (["--lengths", "100"], "--lengths"),
    (["--lengths", "384", "384"], "--lengths"),
    (["--alphas", "0"], "--alphas"),
    (["--energy-rules", "nearest"], "--energy-rules"),
    (["--dense-layers", "-2"], "--dense-layers"),
    (["--schedules", "random"], "--schedules"),
    (["--block-size", "100"], "--block-size"),
    (["--window", "-1"], "--window"),
    (["--prompts", "0"], "--prompts"),
    (["--sensitivity-length", "512"], "--sensitivity-length"),
    (["--dense-below", "100000"], "--dense-below"),
    (["--max-seconds", "0"], "--max-seconds"),
    (["--lengths", "2000000"], "--lengths"),  # longer than the text: found before any forward
])
def test_bad_arguments_name_the_option(extra, flag, tmp_path, capsys):
    args = ["calibrate", *TINY, "--lengths", "384", "--budget-kl", "0.1", "--out", str(tmp_path / "p.json")]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err, err
    assert not (tmp_path / "p.json").exists()


def test_missing_required_options_and_bad_table(tmp_path, capsys):
    assert main(["calibrate", *TINY, "--out", str(tmp_path / "p.json")]) == 2
    assert "--budget-kl: required" in capsys.readouterr().err
    assert main(["calibrate", *TINY, "--budget-kl", "0.1"]) == 2
    assert "--out: required" in capsys.readouterr().err
    assert main(["calibrate", "--table", str(tmp_path / "absent.json")]) == 2
    assert "--table:" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"format": "flashprefill-sparse-profile/1", "model": "m"}))
    assert main(["calibrate", "--table", str(tmp_path / "bad.json")]) == 2
    assert "missing keys" in capsys.readouterr().err


# -- forwards ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return load_model("builtin:tiny")


def test_density_counts_dense_layers_as_fully_selected(tiny):
    runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=12), SparseConfig(), dense_below=0)
    ids = torch.randint(0, 256, (640,), generator=torch.Generator().manual_seed(3)).tolist()
    base = SparseConfig(alpha=0.5, block_size=64, sink_tokens=64, window_tokens=64)
    got = {}
    for dense_layers in (0, 2):
        config = SparseConfig(**{**vars(base), "dense_layers": dense_layers})
        _, counts = forwards.tail_logits(runner, [ids], config, tiny.num_layers, 8)
        got[dense_layers] = (counts, runner.index_tile_counts()["calib-0"])
    (sel0, tot0), (raw_sel0, raw_tot0) = got[0]
    (sel2, tot2), (raw_sel2, raw_tot2) = got[2]
    per_layer = raw_tot0 // 4
    assert (sel0, tot0) == (raw_sel0, raw_tot0) and tot2 == tot0
    # the runner counts the dense layers as fully selected itself (ForwardState.count_dense), as
    # the kernels' backends do by listing every tile
    assert raw_tot2 == 4 * per_layer and (sel2, tot2) == (raw_sel2, raw_tot2)
    assert runner.pool.free_pages == 12


def test_greedy_answers_match_the_offline_generator(tiny):
    from model_executor.sampling import SamplingParams
    from router.offline import generate

    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (200, 333)]
    runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=16), SparseConfig(), dense_below=0)
    sparse = SparseConfig(alpha=0.5, block_size=64, sink_tokens=64, window_tokens=64)
    got = needle.greedy_answers(runner, prompts, sparse, max_new_tokens=5)
    assert runner.pool.free_pages == 16
    ref = generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=5), model=tiny, sparse_config=sparse,
                   dense_below=0)
    assert got == [list(r.output_token_ids) for r in ref]
    with pytest.raises(ValueError, match="max_new_tokens"):
        needle.greedy_answers(runner, prompts, sparse, max_new_tokens=0)


def test_a_profile_changes_the_prefill_selection(calibrated, tiny):
    _, out = calibrated
    profile = SparseProfile.load(out)
    ids = torch.randint(0, 256, (1024,), generator=torch.Generator().manual_seed(5)).tolist()
    counts = {}
    for name, config in (("default", SparseConfig()), ("profile", profile.sparse_config())):
        runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=17), config, dense_below=0)
        runner.pool.reserve("r", len(ids))
        runner.prefill([PrefillItem("r", ids)])
        counts[name] = runner.index_tile_counts()["r"]
    assert counts["default"] != counts["profile"]
    assert counts["profile"][0] < counts["default"][0]  # the calibrated settings keep fewer tiles here
