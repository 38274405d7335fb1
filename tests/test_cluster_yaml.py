"""cluster.yaml validates against Ray's own cluster-launcher schema; serve_config.yaml against
Serve's config schema, and the two agree on the custom resources that pin the roles."""

from __future__ import annotations

import copy
import json
import os
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


# ----------------------------------------------------------------------------- the local cluster
def _gen():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_local_cluster", ROOT / "scripts" / "gen_local_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_local_files_are_generated_from_the_cluster_files():
    gen = _gen()
    for path, text in gen.outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run python scripts/gen_local_cluster.py"
    assert gen.main(["--check"]) == 0


def test_local_cluster_has_the_same_node_types_and_custom_resources():
    cloud, local = load("cluster.yaml"), load("cluster.local.yaml")
    assert local["provider"]["type"] == "fake_multinode"
    assert local["head_node_type"] == cloud["head_node_type"]
    assert set(local["available_node_types"]) == set(cloud["available_node_types"])
    for name, spec in cloud["available_node_types"].items():
        c, l_ = spec["resources"], local["available_node_types"][name]["resources"]
        assert set(c) - {"CPU"} == {k for k, v in l_.items() if v} - {"CPU"}, name  # same custom resources
        for key in set(c) - {"CPU", "GPU"}:  # one unit per GPU, as on the cloud nodes
            assert l_[key] / l_["GPU"] == c[key] / c["GPU"], (name, key)
        lw = local["available_node_types"][name]
        assert lw.get("min_workers", 0) <= lw["max_workers"] <= max(spec.get("max_workers", 0), lw["max_workers"])


def test_local_cluster_validates_against_ray_schema():
    import json

    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(load("cluster.local.yaml"), schema)
    bad = load("cluster.local.yaml")
    bad["available_node_types"]["decode_gpu_worker"]["gpus_please"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_local_serve_config_places_roles_like_the_cluster_one():
    from ray.serve.schema import ServeDeploySchema

    cloud, local = load("serve_config.yaml"), load("serve_config.local.yaml")
    ServeDeploySchema.model_validate(local)
    (capp,), (lapp,) = cloud["applications"], local["applications"]
    assert lapp["import_path"] == capp["import_path"]
    cdeps, ldeps = ({d["name"]: d for d in a["deployments"]} for a in (capp, lapp))
    assert set(cdeps) == set(ldeps)
    for name in ("PrefillServer", "DecodeServer"):
        assert ldeps[name]["ray_actor_options"]["resources"] == cdeps[name]["ray_actor_options"]["resources"]
        assert ldeps[name]["ray_actor_options"]["num_gpus"] == cdeps[name]["ray_actor_options"]["num_gpus"]
        lauto, cauto = ldeps[name]["autoscaling_config"], cdeps[name]["autoscaling_config"]
        assert lauto["policy"]["policy_function"] == cauto["policy"]["policy_function"]
        assert set(lauto["policy"]["policy_kwargs"]) == set(cauto["policy"]["policy_kwargs"])
        assert lauto["min_replicas"] <= lauto["max_replicas"] <= cauto["max_replicas"]
    from serving.config import ServiceConfig

    cfg = ServiceConfig.from_dict(lapp["args"])
    assert cfg.model.device == "cpu" and cfg.model.model == "builtin:tiny"


@pytest.mark.slow
def _local_cluster_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("local_cluster", ROOT / "scripts" / "local_cluster.py")
    lc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lc)
    return lc


def test_down_kills_what_outlives_sigterm_and_only_this_clusters_processes(tmp_path):
    """``local_cluster.py down``: a process of this cluster (its command line names the temp
    dir) that ignores SIGTERM, as Ray's GCS server does, is killed after the grace period, not
    waited for; one that obeys SIGTERM ends; a process of another temp dir is left running."""
    import random
    import subprocess
    import sys
    import time

    pytest.importorskip("psutil")
    lc = _local_cluster_module()
    tag = random.Random(os.getpid()).randrange(10**9)
    mine, other = f"/tmp/fp_down{tag}", f"/tmp/fp_keep{tag}"
    stubborn = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(120)")
    obeys = "import sys, time; print('ready', flush=True); time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", code, temp], stdout=subprocess.PIPE, text=True)
             for code, temp in ((stubborn, mine), (obeys, mine), (obeys, other))]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3  # the handler is set
        t0 = time.monotonic()
        assert lc.down(mine, grace_s=0.5) == 2
        waited = time.monotonic() - t0
        # down reaps what it killed (psutil waits on its own children): poll() then reads no signal
        assert [p.wait(timeout=10) is not None for p in procs[:2]] == [True, True]
        assert procs[2].poll() is None  # another cluster's process
        assert waited < 60  # not the stubborn process's 120 s
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_serve_deploy_on_the_local_cluster_answers_a_request(tmp_path):
    """The README path: the fake multi-node cluster up, ``serve deploy`` of the local serve
    config, a completion over HTTP, ``serve status`` showing each role on its own node type,
    the cluster down. Several raylets on this machine: minutes on 2 cores, hence slow."""
    import subprocess
    import sys
    import time

    import httpx

    from tests.service_helpers import free_port

    gen = _gen()  # noqa: F841 - the up() below checks the files are fresh
    lc = _local_cluster_module()
    temp_dir = f"/tmp/fp_t{os.getpid()}"
    gcs, dash, metrics, http_port, grpc_port = (free_port() for _ in range(5))
    cfg = load("serve_config.local.yaml")
    cfg["http_options"]["port"], cfg["grpc_options"]["port"] = http_port, grpc_port
    serve_file = tmp_path / "serve.yaml"
    serve_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    info = lc.up(temp_dir, gcs, dash, metrics)
    try:
        env = lc.cluster_env()
        subprocess.run([lc.ray_bin("serve"), "deploy", str(serve_file), "-a", info["dashboard"]], check=True, env=env,
                       cwd=ROOT, timeout=300, capture_output=True)
        deadline, codes = time.monotonic() + 600, []
        while time.monotonic() < deadline:
            try:
                code = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=10).status_code
            except httpx.HTTPError:
                code = None
            if not codes or codes[-1] != code:
                codes.append(code)
            if code == 200:
                break
            time.sleep(0.5)
        assert codes[-1] == 200, codes
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=120,
                       json={"model": "builtin:tiny", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        status = subprocess.run([lc.ray_bin("serve"), "status", "-a", info["dashboard"]], capture_output=True, text=True,
                                env=env, timeout=120)
        assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout + status.stderr
        # each role on a node of its own type (the custom resources pin them)
        probe = (
            "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
            "from ray.util.state import list_actors; "
            "nodes = {n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}; "
            "print(json.dumps({a.class_name + ':' + str(a.name): sorted(nodes.get(a.node_id, {})) "
            "for a in list_actors(filters=[('state', '=', 'ALIVE')]) if 'Server' in (a.name or '')}))"
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             env={**env, "RAY_ADDRESS": info["gcs"]})
        assert out.returncode == 0, out.stderr
        placed = json.loads(out.stdout.strip().splitlines()[-1])
        assert placed and all(("prefill_gpu" in res) == ("PrefillServer" in name) and
                              ("decode_gpu" in res) == ("DecodeServer" in name) for name, res in placed.items()), placed
    finally:
        lc.down(temp_dir)
