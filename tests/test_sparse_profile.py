"""Sparse profiles (model_executor/sparse_profile.py) and how the service loads them
(``sparse.profile`` in serving/config.py): a profile fills the sparse options a config does not
give, options given win, errors name the key."""

from __future__ import annotations

import json

import pytest

from kernels.config import SparseConfig
from model_executor.sparse_profile import PROFILE_FORMAT, SparseProfile, resolve_profile, shipped_profile_path
from serving.config import ConfigError, ServiceConfig


def _profile(**over) -> dict:
    raw = {"format": PROFILE_FORMAT, "model": "builtin:tiny", "num_layers": 4,
           "sparse": {"alpha": 0.3, "last_dense_tiles": 4, "energy_rule": "visible", "dense_layers": 1,
                      "layer_alpha": [0.0, 0.2, 0.25, 0.3]},
           "dense_below": 2048, "expected_density": 0.45}
    raw.update(over)
    return raw


def _write(tmp_path, raw, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def test_profile_round_trip_and_config(tmp_path):
    profile = SparseProfile.load(_write(tmp_path, _profile()))
    assert profile.sparse_config() == SparseConfig(alpha=0.3, last_dense_tiles=4, energy_rule="visible",
                                                   dense_layers=1, layer_alpha=(0.0, 0.2, 0.25, 0.3))
    again = SparseProfile.load(profile.save(tmp_path / "again.json"))
    assert again == profile
    assert json.loads((tmp_path / "again.json").read_text())["format"] == PROFILE_FORMAT


@pytest.mark.parametrize("change,match", [
    ({"format": "other/1"}, "format"),
    ({"extra": 1}, r"unknown keys \['extra'\]"),
    ({"num_layers": 0}, "num_layers"),
    ({"sparse": {"alpha": 2.0}}, "alpha"),
    ({"sparse": {"beta": 0.1}}, r"sparse: unknown options \['beta'\]"),
    ({"sparse": {"layer_alpha": [0.1] * 5}}, "sparse.layer_alpha"),
    ({"dense_below": -1}, "dense_below"),
    ({"expected_density": 1.5}, "expected_density"),
])
def test_bad_profiles_name_the_key(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        SparseProfile.load(_write(tmp_path, _profile(**change)))


def test_missing_and_broken_files(tmp_path):
    raw = _profile()
    del raw["sparse"]
    with pytest.raises(ValueError, match=r"missing keys \['sparse'\]"):
        SparseProfile.load(_write(tmp_path, raw))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="sparse.profile: .* is not JSON"):
        SparseProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="sparse.profile: no such file"):
        resolve_profile(str(tmp_path / "none.json"), "builtin:tiny")
    assert resolve_profile("none", "builtin:tiny") is None and resolve_profile(None, "x") is None
    assert resolve_profile("auto", "builtin:tiny") is None  # no shipped profile for it
    assert shipped_profile_path("builtin:tiny") is None


def test_the_service_takes_what_the_profile_sets_and_keeps_what_is_given(tmp_path):
    path = _write(tmp_path, _profile())
    config = ServiceConfig.from_dict({"model.model": "builtin:tiny", "sparse.profile": path,
                                      "sparse.energy_rule": "first_key"})
    s = config.sparse
    assert (s.alpha, s.last_dense_tiles, s.dense_layers, s.layer_alpha) == (0.3, 4, 1, [0.0, 0.2, 0.25, 0.3])
    assert s.energy_rule == "first_key"  # given: the profile's "visible" does not win
    assert (s.dense_below, s.expected_density) == (2048, 0.45)
    assert config.sparse_config.layer_alpha == (0.0, 0.2, 0.25, 0.3)
    # the dict that travels to the replicas gives every option: loading it again changes nothing
    assert ServiceConfig.from_dict(config.to_dict()) == config
    plain = ServiceConfig.from_dict({"model.model": "builtin:tiny", "sparse.profile": "none"})
    assert (plain.sparse.alpha, plain.sparse.last_dense_tiles, plain.sparse.energy_rule) == (0.1, 2, "first_key")


def test_bad_profile_option_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="sparse.profile: no such file"):
        ServiceConfig.from_dict({"model.model": "builtin:tiny", "sparse.profile": str(tmp_path / "x.json")})
    with pytest.raises(ConfigError, match="sparse.profile"):
        ServiceConfig.from_dict({"model.model": "builtin:tiny",
                                 "sparse.profile": _write(tmp_path, _profile(sparse={"alpha": -1}))})


def test_the_profile_reaches_the_replicas_runner(tmp_path):
    """What a prefill replica builds from the config runs the profile's selection."""
    from serving.runtime import WorkerRuntime

    path = _write(tmp_path, _profile())
    config = ServiceConfig.from_dict({"model.model": "builtin:tiny", "model.device": "cpu", "sparse.profile": path})
    runtime = WorkerRuntime.build(config, num_pages=8)
    assert runtime.runner.sparse_config == SparseProfile.load(path).sparse_config()
    assert runtime.runner.dense_below == 2048
    too_long = _write(tmp_path, _profile(num_layers=30, sparse={"layer_alpha": [0.1] * 30}), "long.json")
    with pytest.raises(ValueError, match="layer_alpha"):
        WorkerRuntime.build(ServiceConfig.from_dict({"model.model": "builtin:tiny", "model.device": "cpu",
                                                     "sparse.profile": too_long}), num_pages=8)


def test_banner_says_how_prompts_are_prefilled(tmp_path):
    from router.launcher import sparse_summary

    tiny = {"model.model": "builtin:tiny", "sparse.profile": "none"}
    line = sparse_summary(ServiceConfig.from_dict({**tiny, "sparse.dense_below": 4096}))
    assert line.startswith("FlashPrefill V2 sparse from 4096 tokens") and "last 2 query tiles dense" in line
    # SmolLM2's context is 8192: a dense_below past it means dense everywhere, said plainly
    line = sparse_summary(ServiceConfig.from_dict({"sparse.profile": "none", "sparse.dense_below": 8193}))
    assert line.startswith("dense up to the model's context (8192 tokens)")
    assert sparse_summary(ServiceConfig.from_dict({**tiny, "sparse.alpha": 0.0})).startswith("dense (")
    path = _write(tmp_path, _profile())
    line = sparse_summary(ServiceConfig.from_dict({"model.model": "builtin:tiny", "sparse.profile": path}))
    assert line.startswith("FlashPrefill V2 sparse from 2048 tokens (alpha 0.3, layer_alpha x4") and path in line


def test_the_shipped_smollm2_profile_is_its_own_measurements():
    """The profile shipped for the built-in model agrees with what it records: its options are
    the calibration's chosen row, its ``dense_below`` is the 1.1x rule over the recorded
    speed-ups, and the service built on the model takes both (dense up to its 8K context)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_dense_below import implied_dense_below

    profile = resolve_profile("auto", "builtin:smollm2-135m")
    assert profile is not None and profile.num_layers == 30
    chosen = [r for r in profile.measured if r.get("kind") == "grid" and r.get("chosen")]
    assert chosen and all(r["sparse"] == dict(profile.sparse) for r in chosen)
    speedups = profile.provenance["dense_below"]
    rows = [{"length": int(n), "speedup": x} for n, x in speedups["speedups"].items()]
    assert profile.dense_below == implied_dense_below(rows, speedups["min_speedup"])
    assert "cuda" in profile.provenance["device"]
    config = ServiceConfig.from_dict({"model.model": "builtin:smollm2-135m"})
    assert config.sparse.dense_below == profile.dense_below
    assert config.sparse.last_dense_tiles == profile.sparse["last_dense_tiles"]
