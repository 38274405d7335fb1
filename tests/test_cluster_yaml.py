"""cluster.yaml validates against Ray's own cluster-launcher schema; serve_config.yaml against
Serve's config schema, and the two agree on the custom resources that pin the roles."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")
pytest.importorskip("ray.autoscaler")

ROOT = Path(__file__).resolve().parent.parent


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_cluster_yaml_validates_against_ray_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("cluster.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert types["prefill_gpu_worker"]["resources"]["prefill_gpu"] == types["prefill_gpu_worker"]["resources"]["GPU"]
    assert types["decode_gpu_worker"]["resources"]["decode_gpu"] == types["decode_gpu_worker"]["resources"]["GPU"]
    assert not {"GPU", "prefill_gpu", "decode_gpu"} & set(types[config["head_node_type"]]["resources"])
    # every node exports Prometheus metrics (serving/metrics.py) on one known port
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("--metrics-export-port=8080" in c for c in starts)


def test_cluster_yaml_schema_rejects_unknown_keys():
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("cluster.yaml")
    config["available_node_types"]["prefill_gpu_worker"]["gpus_please"] = 8
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        validate_config(prepare_config(config))


def test_serve_config_schema_and_pinning():
    from ray.serve.schema import ServeDeploySchema

    cfg = load("serve_config.yaml")
    schema = ServeDeploySchema.model_validate(cfg) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(cfg)
    assert schema.http_options.host == "127.0.0.1"
    assert "router.grpc_service.add_FlashPrefillServicer_to_server" in cfg["grpc_options"]["grpc_servicer_functions"]
    (app,) = cfg["applications"]
    deps = {d["name"]: d for d in app["deployments"]}
    assert deps["PrefillServer"]["ray_actor_options"]["resources"] == {"prefill_gpu": 1}
    assert deps["DecodeServer"]["ray_actor_options"]["resources"] == {"decode_gpu": 1}
    for name in ("PrefillServer", "DecodeServer"):  # independent autoscaling
        assert deps[name]["autoscaling_config"]["max_replicas"] >= deps[name]["autoscaling_config"]["min_replicas"]
    cluster = load("cluster.yaml")["available_node_types"]
    assert "prefill_gpu" in cluster["prefill_gpu_worker"]["resources"]
    assert "decode_gpu" in cluster["decode_gpu_worker"]["resources"]
    # the builder accepts the args (ServiceConfig options) of the file
    from serving.config import SECTIONS, ServiceConfig

    args = app.get("args", {})
    assert set(args) <= set(SECTIONS)  # the nested sections, not the flat names of before
    cfg = ServiceConfig.from_dict(args)
    assert (cfg.kv.decode_pages, cfg.decode.max_running, cfg.transfer.channel.ring_depth) == (32768, 256, 3)
