"""prefill.tensor_parallel_size / decode.tensor_parallel_size: checked against the model's heads
and runtime.devices_per_node when the config is built, before Ray starts."""

from __future__ import annotations

import json

import pytest

from serving.config import ConfigError, ServiceConfig

TINY = {"model": "builtin:tiny"}  # 8 query / 4 KV heads (the default model, SmolLM2-135M, has 9 / 3)


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("size, why", [(3, "8 query heads"), (16, "8 query heads"), (0, "greater than or equal to 1")])
def test_sizes_that_do_not_split_the_tiny_model_name_the_option(side, size, why):
    with pytest.raises(ConfigError, match=f"^{side}.tensor_parallel_size: .*{why}"):
        ServiceConfig(model=TINY, **{side: {"tensor_parallel_size": size}})


def test_more_ranks_than_a_node_holds_is_refused():
    with pytest.raises(ConfigError, match=r"^decode.tensor_parallel_size: 4 ranks do not fit runtime.devices_per_node \(2\)"):
        ServiceConfig(model=TINY, decode={"tensor_parallel_size": 4}, runtime={"devices_per_node": 2})
    ok = ServiceConfig(model=TINY, prefill={"tensor_parallel_size": 2}, runtime={"devices_per_node": 2})
    assert ok.prefill.tensor_parallel_size == 2 and ok.decode.tensor_parallel_size == 1


def test_different_sizes_per_side_and_replicated_kv_heads_are_accepted():
    c = ServiceConfig(model={"model": "builtin:structured-8b"}, prefill={"tensor_parallel_size": 8},
                      decode={"tensor_parallel_size": 2})
    assert (c.prefill.tensor_parallel_size, c.decode.tensor_parallel_size) == (8, 2)
    c = ServiceConfig(model=TINY, prefill_tensor_parallel_size=4, decode_tensor_parallel_size=8)  # flat names; 8 > 2 KV heads
    assert (c.prefill.tensor_parallel_size, c.decode.tensor_parallel_size) == (4, 8)


def test_a_directory_model_is_checked_from_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 768,
        "intermediate_size": 3072}))
    with pytest.raises(ConfigError, match="prefill.tensor_parallel_size: 4 ranks must divide the model's 6 KV heads"):
        ServiceConfig(model={"model": str(tmp_path)}, prefill={"tensor_parallel_size": 4})
    assert ServiceConfig(model={"model": str(tmp_path)}, prefill={"tensor_parallel_size": 3}).prefill.tensor_parallel_size == 3
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 768,
        "intermediate_size": 3071}))
    with pytest.raises(ConfigError, match="decode.tensor_parallel_size: 2 ranks must divide the model's MLP width 3071"):
        ServiceConfig(model={"model": str(tmp_path)}, decode={"tensor_parallel_size": 2})


def test_bad_settings_fail_in_the_builder_before_ray_starts(monkeypatch):
    import ray

    from router.app import build_application

    def no_start(*args, **kwargs):  # the builder must refuse before it starts or joins a Ray
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", no_start)
    with pytest.raises(ConfigError, match="prefill.tensor_parallel_size"):
        build_application({"model": TINY, "prefill": {"tensor_parallel_size": 3}})


def test_the_cost_model_splits_a_tp_replica_s_work_over_its_ranks():
    from serving.costs import PrefillCostModel

    one = PrefillCostModel(dense_below=0, expected_density=0.5)
    two = PrefillCostModel(dense_below=0, expected_density=0.5, tensor_parallel_size=2, allreduce_weight=10.0)
    # 100 new tokens after 20 cached: 256 x 100 + 100 x (20 + 120 + 1) / 2 x 0.5 = 29125 at TP=1
    assert one.cost(120, 20) == 29125.0
    assert two.cost(120, 20) == 29125.0 / 2 + 10.0 * 100 / 2
    assert PrefillCostModel.for_config(ServiceConfig(model=TINY, prefill={"tensor_parallel_size": 4})).tensor_parallel_size == 4
    for bad in (dict(tensor_parallel_size=0), dict(tensor_parallel_size=True), dict(allreduce_weight=-1.0)):
        with pytest.raises(ValueError, match="tensor_parallel_size, allreduce_weight"):
            PrefillCostModel(**bad)


def test_the_tp_example_config_is_valid_and_its_bundles_match_the_sizes():
    from pathlib import Path

    import yaml

    raw = yaml.safe_load((Path(__file__).parents[1] / "examples" / "serve_config_tp.yaml").read_text())
    (app,) = raw["applications"]
    config = ServiceConfig.from_dict(app["args"])
    deps = {d["name"]: d for d in app["deployments"]}
    for name, side in (("PrefillServer", config.prefill), ("DecodeServer", config.decode)):
        assert len(deps[name]["placement_group_bundles"]) == side.tensor_parallel_size
        assert deps[name]["placement_group_strategy"] == "STRICT_PACK"
        assert side.tensor_parallel_size <= config.runtime.devices_per_node


def test_the_tp_example_bundles_are_each_rank_s_gpu_with_bundle_0_the_replica_itself():
    from pathlib import Path

    import yaml

    raw = yaml.safe_load((Path(__file__).parents[1] / "examples" / "serve_config_tp.yaml").read_text())
    (app,) = raw["applications"]
    for dep in app["deployments"]:
        opts, bundles = dep["ray_actor_options"], dep["placement_group_bundles"]
        first = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **opts["resources"]}
        assert bundles[0] == first, dep["name"]  # rank 0 is the replica: its own resources
        assert all(b["GPU"] == 1 and set(b) == set(first) for b in bundles), dep["name"]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_tp_deployments_get_one_strict_pack_bundle_per_rank_unless_given(side):
    from decode_worker.deployment import make_decode_deployment
    from prefill_worker.deployment import make_prefill_deployment

    make = make_prefill_deployment if side == "prefill" else make_decode_deployment
    cfg = ServiceConfig(model=TINY, **{side: {"tensor_parallel_size": 2}})
    dep = make(cfg, ray_actor_options={"num_cpus": 2})
    replica = dep._replica_config  # Serve keeps the placement group options there
    assert replica.placement_group_strategy == "STRICT_PACK"
    assert replica.placement_group_bundles == [{"CPU": 2.0}, {"CPU": 1.0}]
    given = make(cfg, placement_group_bundles=[{"CPU": 3}, {"CPU": 3}], placement_group_strategy="STRICT_PACK")
    assert given._replica_config.placement_group_bundles == [{"CPU": 3}, {"CPU": 3}]
    assert make(ServiceConfig(model=TINY))._replica_config.placement_group_bundles is None  # TP=1: no placement group
