"""Per-role autoscaling (serving/autoscaling.py): the policies' arithmetic on fresh random
metrics, their error paths, the Serve autoscaling_config built from ServiceConfig, and the
policies run through Serve's own wrapper (bounds and delays) on a real AutoscalingContext."""

from __future__ import annotations

import math
import random

import pytest

from serving.autoscaling import DECODE_POLICY, PREFILL_POLICY, DecodePolicy, PrefillPolicy, autoscaling_config
from serving.config import ServiceConfig


def per_replica(rng: random.Random, n: int, hi: float) -> dict:
    return {f"r{i}": rng.uniform(0, hi) for i in range(n)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_policy_follows_queued_tokens_or_prompts(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    tokens, prompts = per_replica(rng, n, 40000), per_replica(rng, n, 30)
    policy = PrefillPolicy(target_queued_tokens=8192, target_queued_requests=8)
    want = max(math.ceil(sum(tokens.values()) / 8192), math.ceil(sum(prompts.values()) / 8))
    assert policy.desired({"queued_tokens": tokens, "queued_requests": prompts}, n) == want


def test_prefill_policy_idle_wants_none_and_unknown_holds():
    policy = PrefillPolicy()
    assert policy.desired({"queued_tokens": {"a": 0.0}, "queued_requests": {"a": 0.0}}, 3) == 0
    assert policy.desired({}, 3) == 3 and policy.desired(None, 2) == 2  # no report yet
    assert policy.desired({"queued_tokens": {"a": 9000.0}, "queued_requests": {"a": 1.0}}, 1) == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_policy_follows_streams_or_kv_pages(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    streams, busy = per_replica(rng, n, 100), per_replica(rng, n, 1000)
    pages = {k: 1000.0 for k in busy}
    policy = DecodePolicy(target_running=16, target_kv_fraction=0.5)
    want = max(math.ceil(sum(streams.values()) / 16), math.ceil(sum(busy.values()) / 500))
    assert policy.desired({"running_streams": streams, "kv_pages_busy": busy, "kv_pages": pages}, n) == want


def test_decode_policy_scales_on_pages_with_few_streams():
    policy = DecodePolicy(target_running=64, target_kv_fraction=0.5)
    metrics = {"running_streams": {"a": 2.0}, "kv_pages_busy": {"a": 900.0}, "kv_pages": {"a": 1000.0}}
    assert policy.desired(metrics, 1) == 2  # two long-context streams fill the pool
    assert policy.desired({"running_streams": {"a": 2.0}}, 4) == 4


@pytest.mark.parametrize("kwargs,name", [({"target_queued_tokens": 0}, "target_queued_tokens"),
                                         ({"target_queued_requests": -1}, "target_queued_requests"),
                                         ({"target_queued_tokens": "many"}, "target_queued_tokens")])
def test_prefill_policy_rejects_bad_targets(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PrefillPolicy(**kwargs)


@pytest.mark.parametrize("kwargs,name", [({"target_running": 0}, "target_running"),
                                         ({"target_kv_fraction": 0.0}, "target_kv_fraction"),
                                         ({"target_kv_fraction": 1.5}, "target_kv_fraction")])
def test_decode_policy_rejects_bad_targets(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DecodePolicy(**kwargs)


def test_autoscaling_config_from_service_config():
    fixed = ServiceConfig.from_dict({})
    assert autoscaling_config("prefill", fixed.prefill) is None and autoscaling_config("decode", fixed.decode) is None
    cfg = ServiceConfig.from_dict({"prefill": {"min_replicas": 2, "max_replicas": 5, "target_queued_tokens": 4096},
                                   "decode": {"max_replicas": 3, "max_running": 40, "target_kv_fraction": 0.6}})
    p = autoscaling_config("prefill", cfg.prefill)
    assert (p["min_replicas"], p["max_replicas"], p["policy"]["policy_function"]) == (2, 5, PREFILL_POLICY)
    assert p["policy"]["policy_kwargs"]["target_queued_tokens"] == 4096
    d = autoscaling_config("decode", cfg.decode)
    assert (d["min_replicas"], d["max_replicas"], d["policy"]["policy_function"]) == (1, 3, DECODE_POLICY)
    assert d["policy"]["policy_kwargs"] == {"target_running": 20, "target_kv_fraction": 0.6}
    with pytest.raises(ValueError, match="role"):
        autoscaling_config("ingress", cfg.decode)
    with pytest.raises(ValueError, match="prefill.max_replicas"):
        ServiceConfig.from_dict({"prefill": {"min_replicas": 4, "max_replicas": 2}})


def _context(config, current: int, metrics: dict):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingContext

    dep = DeploymentID(name="PrefillServer", app_name="a")
    replicas = [ReplicaID(unique_id=k, deployment_id=dep) for k in next(iter(metrics.values()))]
    by_id = {name: {rid: vals[rid.unique_id] for rid in replicas} for name, vals in metrics.items()}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name="a", current_num_replicas=current,
        target_num_replicas=current, running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=by_id, raw_metrics=None, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=None, config=config)


def test_serve_runs_the_policy_with_its_delays():
    """Serve imports the policy class, builds it with policy_kwargs and wraps it in its delay
    logic (min/max replicas are applied after, by the controller)."""
    pytest.importorskip("ray.serve")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    cfg = ServiceConfig.from_dict({"prefill": {"min_replicas": 1, "max_replicas": 3, "target_queued_tokens": 100}})
    busy = {"queued_tokens": {"r0": 500.0, "r1": 0.0}, "queued_requests": {"r0": 3.0, "r1": 0.0}}
    idle = {"queued_tokens": {"r0": 0.0, "r1": 0.0}, "queued_requests": {"r0": 0.0, "r1": 0.0}}
    now = AutoscalingConfig(**autoscaling_config("prefill", cfg.prefill, upscale_delay_s=0.0, downscale_delay_s=0.0))
    policy = _apply_autoscaling_config(_resolve_policy_callable(now.policy))
    assert policy(_context(now, 2, busy))[0] == 5
    assert policy(_context(now, 2, idle))[0] in (0, 1)  # down (Serve steps to 1 before 0)
    slow = AutoscalingConfig(**autoscaling_config("prefill", cfg.prefill, upscale_delay_s=60.0, downscale_delay_s=60.0))
    held = _apply_autoscaling_config(_resolve_policy_callable(slow.policy))
    assert held(_context(slow, 2, busy))[0] == 2 and held(_context(slow, 2, idle))[0] == 2  # within the delays


def test_deployments_autoscale_unless_given_a_replica_count():
    pytest.importorskip("ray.serve")
    from decode_worker.deployment import make_decode_deployment
    from prefill_worker.deployment import make_prefill_deployment

    cfg = ServiceConfig.from_dict({"prefill": {"max_replicas": 4}, "decode": {"max_replicas": 2}})
    p = make_prefill_deployment(cfg)
    assert p._deployment_config.autoscaling_config.max_replicas == 4
    assert p._deployment_config.autoscaling_config.policy.policy_function == PREFILL_POLICY
    d = make_decode_deployment(cfg)
    assert d._deployment_config.autoscaling_config.policy.policy_function == DECODE_POLICY
    fixed = make_prefill_deployment(cfg, num_replicas=2)
    assert fixed._deployment_config.autoscaling_config is None and fixed.num_replicas == 2
    assert make_prefill_deployment(ServiceConfig.from_dict({}))._deployment_config.autoscaling_config is None


@pytest.mark.slow
def test_short_scenario_scales_each_role_and_loses_nothing():
    """benchmarks/autoscale_scenario.py --short on the local fake multi-node cluster: prefill
    scales up under long prompts, decode under long outputs, both come back down when idle,
    and every request sent completes (through every scale-up and drain). Starts several
    raylets and runs minutes of load on 2 cores: slow-marked."""
    pytest.importorskip("ray.serve")
    pytest.importorskip("psutil")
    from benchmarks.autoscale_scenario import ROLES, SHORT, run

    result = run(SHORT, out=None)
    sent = sum(r["sent"] for r in result.requests.values())
    assert sent > 0 and all(r["lost"] == 0 and r["completed"] == r["sent"] for r in result.requests.values()), \
        result.requests
    seen = {ph: {role: {s["replicas"][role] for s in result.samples if s["phase"] == ph} for role in ROLES}
            for ph in ("prefill-heavy", "decode-heavy", "idle")}
    assert max(seen["prefill-heavy"]["prefill"]) > result.min_replicas["prefill"], seen
    assert max(seen["decode-heavy"]["decode"] | seen["idle"]["decode"]) > result.min_replicas["decode"], seen
    last = result.samples[-1]["replicas"]
    assert all(last[r] == result.min_replicas[r] for r in ROLES), result.samples[-5:]


def test_short_scenario_shortens_only_the_roles_timers():
    """--short deploys serve_config.local.yaml with its own look-back and scale-down delay in
    both roles (the same policies, bounds and upscale delay); the full run deploys the file as is."""
    import yaml

    from benchmarks.autoscale_scenario import FULL, ROLES, ROOT, SHORT, serve_config

    ports = {"http": random.Random(7).randint(20000, 30000), "grpc": 9001}
    file = {d["name"]: d for d in yaml.safe_load((ROOT / "serve_config.local.yaml").read_text())["applications"][0]["deployments"]}
    short = {d["name"]: d for d in serve_config(SHORT, ports)["applications"][0]["deployments"]}
    assert serve_config(FULL, ports)["applications"][0]["deployments"] == list(file.values())
    assert serve_config(SHORT, ports)["http_options"]["port"] == ports["http"]
    for name, dep in short.items():
        want = {**file[name]["autoscaling_config"]}
        if name in ROLES.values():
            want.update(look_back_period_s=4.0, downscale_delay_s=5.0)
            assert want["look_back_period_s"] < file[name]["autoscaling_config"]["look_back_period_s"]
        assert dep == {**file[name], "autoscaling_config": want}


def test_a_load_phase_ends_only_after_its_role_scaled_up():
    """``until_scaled``: the phase's stop is set once a sample of this phase (not an earlier
    one) shows the role above its minimum, and never while it stays there."""
    import asyncio

    from benchmarks.autoscale_scenario import SHORT, Phase, Result, ScenarioConfig, _until_scaled

    assert [p.until_scaled for p in SHORT.phases] == ["prefill", "decode", None]
    cfg = ScenarioConfig(phases=(), sample_s=0.01, scaled_hold_s=0.0)
    rng = random.Random(5)
    low = rng.randint(1, 3)
    res = Result(config={}, min_replicas={"prefill": low, "decode": 1})
    res.samples = [{"replicas": {"prefill": low + 2, "decode": 1}}]  # an earlier phase's scale-up
    phase = Phase("prefill-heavy", 60, 1, 10, 1, until_scaled="prefill")

    async def scenario():
        enough = asyncio.Event()
        task = asyncio.create_task(_until_scaled(phase, cfg, res, len(res.samples), enough))
        for _ in range(rng.randint(3, 8)):
            res.samples.append({"replicas": {"prefill": low, "decode": 1}})
            await asyncio.sleep(0.02)
        stopped_early = enough.is_set()
        res.samples.append({"replicas": {"prefill": low + 1, "decode": 1}})
        await asyncio.wait_for(task, 30)
        return stopped_early, enough.is_set()

    assert asyncio.run(scenario()) == (False, True)
    unbound = asyncio.Event()
    asyncio.run(_until_scaled(Phase("p", 1, 1, 1, 1), cfg, res, 0, unbound))  # no role: returns at once
    assert not unbound.is_set()


def test_scenario_summary_and_plot_from_recorded_samples(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.autoscale_scenario import NODE_TYPES, Result, plot, summary

    rng = random.Random(3)
    res = Result(config={}, min_replicas={"prefill": 1, "decode": 1}, max_replicas={"prefill": 4, "decode": 4})
    res.phases = [{"name": "prefill-heavy", "start": 0, "end": 10}, {"name": "idle", "start": 10, "end": 20}]
    peak = rng.randint(2, 4)
    for t in range(20):
        res.samples.append({"t": t, "phase": "prefill-heavy" if t < 10 else "idle",
                            "replicas": {"prefill": peak if 3 <= t < 10 else 1, "decode": 1},
                            "nodes": {NODE_TYPES[0]: 2 if 4 <= t < 12 else 1, NODE_TYPES[1]: 1}})
    res.requests = {"prefill-heavy": {"sent": 7, "completed": 7, "lost": 0, "lost_reasons": {}},
                    "idle": {"sent": 0, "completed": 0, "lost": 0, "lost_reasons": {}}}
    text = summary(res).splitlines()
    assert text[1].split()[:4] == ["prefill-heavy", "7", "7", "0"] and f"{peak}," in text[1]
    plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
