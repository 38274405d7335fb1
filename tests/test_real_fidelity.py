"""evals/real_fidelity.py: the metrics against hand-computed formulas, the harness on the
built-in tiny model and on a saved directory beyond its trained context (RoPE scaling), and the
CLI in a fresh process (its JSON, and that it imports neither Ray nor the service)."""

import hashlib
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evals import real_fidelity as rf
from kernels.config import SparseConfig
from model_executor.loading import build_tiny_model, load_model, load_model_dir, rope_scaling_overrides

ROOT = Path(__file__).resolve().parent.parent
# Small selection settings so that a few hundred tokens have blocks to prune; alpha 1 keeps only
# the strongest block per tile besides the forced ones (the random tiny model's attention is flat).
SMALL = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64)


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))
                    for _ in range(n))


# -- metrics -------------------------------------------------------------------------------------
def _hand_kl(a: list[float], b: list[float]) -> float:
    za = sum(math.exp(x) for x in a)
    zb = sum(math.exp(x) for x in b)
    return sum(math.exp(x) / za * (math.log(math.exp(x) / za) - math.log(math.exp(y) / zb)) for x, y in zip(a, b))


def _hand_nll(a: list[float], t: int) -> float:
    return -math.log(math.exp(a[t]) / sum(math.exp(x) for x in a))


def test_compare_logits_matches_the_float64_formulas():
    gen = torch.Generator().manual_seed(11)
    ref = torch.randn(9, 7, generator=gen) * 3
    other = ref + torch.randn(9, 7, generator=gen)
    targets = torch.randint(0, 7, (9,), generator=gen)
    c = rf.compare_logits(ref, other, targets, chunk=4)  # chunks of 4, 4, 1
    for i in range(9):
        a, b, t = ref[i].tolist(), other[i].tolist(), int(targets[i])
        assert c.kl[i].item() == pytest.approx(_hand_kl(a, b), rel=1e-9, abs=1e-12)
        assert c.nll_ref[i].item() == pytest.approx(_hand_nll(a, t), rel=1e-9)
        assert c.nll[i].item() == pytest.approx(_hand_nll(b, t), rel=1e-9)
        assert bool(c.agree[i]) == (max(range(7), key=a.__getitem__) == max(range(7), key=b.__getitem__))
    s = rf.summarize([c])
    assert s["scored_positions"] == 9
    assert s["kl_mean"] == pytest.approx(sum(_hand_kl(ref[i].tolist(), other[i].tolist()) for i in range(9)) / 9)
    assert s["kl_max"] == pytest.approx(max(_hand_kl(ref[i].tolist(), other[i].tolist()) for i in range(9)))
    assert s["top1_agreement"] == pytest.approx(c.agree.double().mean().item())
    nll = [_hand_nll(other[i].tolist(), int(targets[i])) for i in range(9)]
    assert s["ppl"] == pytest.approx(math.exp(sum(nll) / 9), rel=1e-9)
    assert 0 < s["top1_agreement"] < 1  # the perturbation flips some argmaxes: both branches checked


def test_kl_of_identical_logits_is_zero():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 300, generator=gen) * 4
    c = rf.compare_logits(x, x, torch.randint(0, 300, (5,), generator=gen))
    assert torch.equal(c.kl, torch.zeros(5, dtype=torch.float64))
    assert bool(c.agree.all()) and torch.equal(c.nll, c.nll_ref)


def test_metric_errors_name_the_argument():
    x = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="other"):
        rf.compare_logits(x, torch.zeros(3, 6), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="targets"):
        rf.compare_logits(x, x, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="parts"):
        rf.summarize([rf.compare_logits(x[:0], x[:0], torch.zeros(0, dtype=torch.int64))])


def test_windows_modes_text_and_rope_errors(tmp_path):
    assert rf.token_windows(list(range(10)), 3, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="length"):
        rf.token_windows(list(range(10)), 4, 3)
    with pytest.raises(ValueError, match="length"):
        rf.token_windows(list(range(10)), 1, 1)
    with pytest.raises(ValueError, match="samples"):
        rf.token_windows(list(range(10)), 2, 0)
    names = [m.name for m in rf.make_modes(SMALL, [0.1, 0.3])]
    assert names == ["dense", "floor", "a0.1", "a0.1_nocorr", "a0.3", "a0.3_nocorr"]
    assert [m.name for m in rf.make_modes(SMALL, [0.1], "off", floor=False)] == ["dense", "a0.1_nocorr"]
    with pytest.raises(ValueError, match="correction"):
        rf.make_modes(SMALL, [0.1], "maybe")
    with pytest.raises(ValueError, match="alphas"):
        rf.make_modes(SMALL, [0.0])
    with pytest.raises(ValueError, match="text"):
        rf.load_text(str(tmp_path / "absent.txt"))
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="text"):
        rf.load_text(str(tmp_path / "bad.txt"))
    assert rf.rope_for(8192, 8192, "yarn") is None
    assert rf.rope_for(32768, 8192, "linear") == {"rope_type": "linear", "factor": 4.0}
    assert rf.rope_for(16384, 8192, "none") is None
    with pytest.raises(ValueError, match="rope_scaling"):
        rf.rope_for(16384, 8192, "ntk")


def test_pydoc_text_is_deterministic_prose():
    a, b = rf.load_text(), rf.load_text()
    assert a.text == b.text and a.sha256 == b.sha256 and len(a.text) > 200_000
    assert "assert" in a.text[:200] and f"Python {sys.version_info.major}.{sys.version_info.minor}" in a.name


# -- RoPE scaling in the loader -------------------------------------------------------------------
RAW = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 256}


def test_rope_scaling_overrides_and_errors():
    o = rope_scaling_overrides(RAW, {"rope_type": "yarn", "factor": 2})
    assert o == {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 256}, "max_position_embeddings": 512}
    legacy = {"rope_theta": 500.0, "max_position_embeddings": 100}
    assert rope_scaling_overrides(legacy, {"rope_type": "linear", "factor": 1.5})["rope_parameters"]["rope_theta"] == 500.0
    for bad in ({"rope_type": "yarn"}, {"rope_type": "ntk", "factor": 2}, {"rope_type": "yarn", "factor": 1.0},
                {"rope_type": "linear", "factor": True}, "yarn"):
        with pytest.raises(ValueError, match="rope_scaling"):
            rope_scaling_overrides(RAW, bad)
    scaled = {**RAW, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_scaling_overrides(scaled, {"rope_type": "yarn", "factor": 2})
    with pytest.raises(ValueError, match="rope_scaling"):
        load_model("builtin:tiny", rope_scaling={"rope_type": "yarn", "factor": 2})


def _save_dir(path: Path, max_positions: int):
    """The tiny model (2 layers) with a shorter trained context and a character tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    loaded = build_tiny_model(seed=4, num_layers=2)
    loaded.model.config.max_position_embeddings = max_positions
    loaded.model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return loaded


def test_loader_applies_linear_and_yarn_rope(tmp_path):
    plain = _save_dir(tmp_path, 256)
    d = 64
    base = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    lin = load_model_dir(tmp_path, load_tokenizer=False, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert lin.config.max_position_embeddings == 512
    torch.testing.assert_close(lin.model.model.rotary_emb.inv_freq.double(), base / 2, rtol=1e-6, atol=0)
    yarn = load_model_dir(tmp_path, load_tokenizer=False, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert yarn.config.rope_parameters["original_max_position_embeddings"] == 256
    # YaRN's attention temperature: 0.1 ln(s) + 1
    assert yarn.model.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    torch.testing.assert_close(plain.model.model.rotary_emb.inv_freq.double(), base, rtol=1e-6, atol=0)


# -- the harness ---------------------------------------------------------------------------------
def test_harness_on_tiny_model():
    modes = rf.make_modes(SMALL, [1.0])
    text = rf.Text("random words", _words(5, 200))
    payload = rf.run_fidelity("builtin:tiny", lengths=[448], modes=modes, base=SMALL, text=text,
                              samples=2, score_from=192)
    rows = {r["mode"]: r for r in payload["rows"]}
    assert list(rows) == ["dense", "floor", "a1", "a1_nocorr"]
    n = 2 * (448 - 1 - 192)
    assert all(r["scored_positions"] == n and r["windows"] == 2 for r in rows.values())
    dense = rows["dense"]
    assert (dense["kl_mean"], dense["kl_max"], dense["top1_agreement"], dense["density"]) == (0.0, 0.0, 1.0, 1.0)
    # the sparse kernels at alpha 0 keep every causal tile and match dense to rounding
    assert rows["floor"]["density"] == 1.0 and rows["floor"]["kl_max"] < 1e-9
    for name in ("a1", "a1_nocorr"):
        assert 0 < rows[name]["density"] < 1 and rows[name]["kl_mean"] > 0
        assert rows[name]["kl_max"] >= rows[name]["kl_mean"]
        assert rows[name]["selected_tiles"] < rows[name]["causal_tiles"]
    assert rows["a1"]["kl_mean"] != rows["a1_nocorr"]["kl_mean"]
    assert len({r["ppl_dense"] for r in rows.values()}) == 1
    assert payload["text"]["tokens"] == len(text.text.encode())  # byte tokenizer, no BOS
    assert not any(r["beyond_trained_context"] for r in rows.values())

    # dense perplexity from transformers' own forward of the same weights, windows and positions
    ref = build_tiny_model(seed=0).model
    from model_executor.tokenizer import ByteTokenizer

    ids = ByteTokenizer().encode(text.text, add_bos=False)
    nll = []
    with torch.no_grad():
        for w in range(2):
            x = torch.tensor(ids[w * 448:(w + 1) * 448])
            logp = torch.log_softmax(ref(x[None]).logits[0].double(), -1)
            nll.append(-logp[192:447].gather(-1, x[193:, None])[:, 0])
    assert dense["ppl_dense"] == pytest.approx(math.exp(float(torch.cat(nll).mean())), rel=1e-4)


def test_per_forward_alpha_zero_is_the_dense_path_bit_for_bit():
    from model_executor.loading import make_pool
    from model_executor.runner import ModelRunner

    loaded = load_model("builtin:tiny")
    runner = ModelRunner(loaded.model, make_pool(loaded, num_pages=8), SMALL, dense_below=0)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(6)).tolist()
    dense, counts = rf.prefill_logits(runner, ids, rf.Mode("dense", SparseConfig(alpha=0.0, block_size=64)))
    again, _ = rf.prefill_logits(runner, ids, rf.Mode("sparse_a0", SparseConfig(alpha=0.0)))
    assert counts is None and torch.equal(dense, again)
    assert runner.pool.free_pages == 8  # every forward released its pages
    sparse, counts = rf.prefill_logits(runner, ids, rf.Mode("a1", SparseConfig(alpha=1.0, block_size=64,
                                                                              sink_tokens=64, window_tokens=64)))
    assert counts[0] < counts[1] and not torch.equal(dense, sparse)
    with pytest.raises(ValueError, match="score_from"):
        rf.run_length(loaded, [ids], rf.make_modes(SMALL, [1.0]), score_from=299, base=SMALL)
    with pytest.raises(ValueError, match="modes"):
        rf.run_length(loaded, [ids], rf.make_modes(SMALL, [1.0])[1:], score_from=10, base=SMALL)


def test_beyond_the_trained_context_reloads_with_rope(tmp_path):
    _save_dir(tmp_path, 256)
    text = rf.Text("letters", _words(7, 150))
    payload = rf.run_fidelity(str(tmp_path), lengths=[256, 512], modes=rf.make_modes(SMALL, [1.0], "on"),
                              base=SMALL, text=text, score_from=128, rope_scaling="yarn")
    rows = payload["rows"]
    assert [(r["length"], r["mode"]) for r in rows] == [(256, m) for m in ("dense", "floor", "a1")] + [
        (512, m) for m in ("dense", "floor", "a1")]
    assert all(r["rope_scaling"] is None and not r["beyond_trained_context"] for r in rows[:3])
    assert all(r["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0} and r["beyond_trained_context"]
               for r in rows[3:])
    assert payload["model"]["trained_context"] == 256
    assert rows[4]["kl_max"] < 1e-9 and 0 < rows[5]["density"] < 1
    table = rf.markdown_table(payload)
    assert table.count("beyond the trained context") == 3 and "yarn x2" in table


def test_cli_writes_json_without_ray_or_the_service(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(_words(9, 120), encoding="utf-8")
    out, saved = tmp_path / "out.json", tmp_path / "saved.txt"
    argv = ["real_fidelity", "--model", "builtin:tiny", "--device", "cpu", "--threads", "1", "--text", str(text),
            "--save-text", str(saved), "--lengths", "320", "--alphas", "1", "--correction", "off", "--no-floor",
            "--block-size", "64", "--sink", "64", "--window", "64", "--score-from", "128", "--out", str(out)]
    code = ("import runpy, sys; sys.argv = %r; runpy.run_module('evals.real_fidelity', run_name='__main__'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'router', 'serving', 'gguf', "
            "'prefill_worker', 'decode_worker')); print('IMPORTED', bad)" % argv)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "IMPORTED []" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-2].startswith("| 320 | trained | a1_nocorr | 1 | off |")
    payload = json.loads(out.read_text())
    assert saved.read_text(encoding="utf-8") == text.read_text(encoding="utf-8")
    assert payload["text"]["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    assert payload["text"]["name"] == "file text.txt"
    assert [r["mode"] for r in payload["rows"]] == ["dense", "a1_nocorr"]
    assert payload["settings"]["sparse"] == {**payload["settings"]["sparse"], "block_size": 64, "sink_tokens": 64,
                                             "window_tokens": 64}
    assert payload["environment"]["threads"] == 1 and payload["model"]["dtype"] == "float32"
    r = payload["rows"][1]
    assert r["scored_positions"] == 320 - 1 - 128 and not r["mean_correction"] and 0 < r["density"] < 1
