"""Prefill and decode autoscaling on the local multi-node cluster, in three phases.

Runs the README's local path: ``scripts/local_cluster.py up`` (cluster.local.yaml: Ray's fake
multi-node provider, so the real autoscaler adds and removes prefill / decode nodes, each a
raylet on this machine), ``serve deploy`` of serve_config.local.yaml (tiny model on CPU,
PrefillPolicy / DecodePolicy of serving/autoscaling.py), then closed-loop load:

1. prefill-heavy: long prompts, 1 output token (queued prompt tokens grow: prefill scales);
2. decode-heavy: short prompts, long outputs (running streams grow: decode scales);
3. idle: no requests, until both roles are back at their minimum (or the phase's deadline).

Bounded in time (each phase's seconds; in ``--short`` a load phase ends once its role scaled up,
idle once both are back at their minimum) and count (``--max-requests`` per phase). Every
second or two it records the running replicas per role (Serve's status through the dashboard)
and the alive nodes per node type; every request's outcome is recorded, and any that did not
complete with HTTP 200 and its full token count is *lost*. Writes JSON and a plot:

    python benchmarks/autoscale_scenario.py            # benchmarks/results/autoscale_scenario.{json,png}
    python benchmarks/autoscale_scenario.py --short    # the CI-sized run (tests/test_autoscaling.py, slow)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ROLES = {"prefill": "PrefillServer", "decode": "DecodeServer"}
NODE_TYPES = ("prefill_gpu_worker", "decode_gpu_worker")


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    # end the phase early, ``ScenarioConfig.scaled_hold_s`` after a sample shows this role above
    # its minimum: the scale-up it is there to cause has happened (None: run all ``seconds``)
    until_scaled: str | None = None


@dataclass(frozen=True)
class ScenarioConfig:
    phases: tuple[Phase, ...]
    max_requests: int = 2000  # per phase
    sample_s: float = 2.0
    idle_extra_s: float = 120.0  # the idle phase may run this much longer, until both roles are at min
    wait_for_nodes: bool = True  # ... and the worker node types at their min_workers
    scaled_hold_s: float = 6.0  # load kept on after an ``until_scaled`` scale-up: requests reach the new replicas
    seed: int = 0
    # set in both roles' autoscaling_config over serve_config.local.yaml's (e.g. shorter delays)
    autoscaling: dict = field(default_factory=dict)


FULL = ScenarioConfig(phases=(Phase("prefill-heavy", 100, 12, 1500, 1), Phase("decode-heavy", 100, 32, 24, 160),
                              Phase("idle", 45, 0, 0, 0)), idle_extra_s=150.0)
# CI-sized: each load phase ends once its role scaled up (how long a new node and replica take
# decides, not a fixed length; the cap only bounds a failing run), idle once both roles are back
# at their minimum. Shorter timers than the local config's, the same scale-ups and drains: metrics
# averaged over 4 s rather than 12 (replicas push them every second, scripts/local_cluster.py) and
# a scale-down after 5 s of less demand rather than 15 (the idle phase: 10 s rather than 24).
SHORT = ScenarioConfig(phases=(Phase("prefill-heavy", 90, 10, 1200, 1, until_scaled="prefill"),
                               Phase("decode-heavy", 90, 24, 16, 96, until_scaled="decode"),
                               Phase("idle", 0, 0, 0, 0)), max_requests=600, idle_extra_s=120.0,
                      wait_for_nodes=False, autoscaling={"look_back_period_s": 4.0, "downscale_delay_s": 5.0})


@dataclass
class Result:
    config: dict
    samples: list = field(default_factory=list)  # {t, phase, replicas: {role: n}, nodes: {type: n}}
    requests: dict = field(default_factory=dict)  # phase -> {sent, completed, lost, lost_reasons}
    phases: list = field(default_factory=list)  # {name, start, end}
    min_replicas: dict = field(default_factory=dict)
    max_replicas: dict = field(default_factory=dict)
    min_nodes: dict = field(default_factory=dict)
    cluster: str = "fake_multinode (cluster.local.yaml), one machine"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", ROOT / "scripts" / "local_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sample(dashboard: str) -> tuple[dict, dict]:
    """(running replicas per role, alive nodes per worker node type)."""
    from ray.util.state import list_nodes

    replicas = {role: 0 for role in ROLES}
    try:
        apps = httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).json()["applications"]
        deps = apps["flashprefill"]["deployments"]
        for role, name in ROLES.items():
            replicas[role] = sum(1 for r in deps.get(name, {}).get("replicas", []) if r["state"] == "RUNNING")
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    nodes = {t: 0 for t in NODE_TYPES}
    try:
        for node in list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False):
            res = node.resources_total or {}
            for t, key in zip(NODE_TYPES, ("prefill_gpu", "decode_gpu")):
                if res.get(key):
                    nodes[t] += 1
    except Exception:  # the state API is briefly unavailable while nodes come and go
        pass
    return replicas, nodes


async def _load(client: httpx.AsyncClient, phase: Phase, cfg: ScenarioConfig, stats: dict,
                enough: asyncio.Event) -> None:
    rng = random.Random(cfg.seed * 1000 + sum(map(ord, phase.name)))
    deadline = time.monotonic() + phase.seconds
    budget = [cfg.max_requests]

    async def worker() -> None:
        while time.monotonic() < deadline and budget[0] > 0 and not enough.is_set():
            budget[0] -= 1
            prompt = [rng.randrange(1, 255) for _ in range(phase.prompt_tokens)]
            stats["sent"] += 1
            try:
                r = await client.post("/v1/completions", json={"model": "builtin:tiny", "prompt": prompt,
                                                               "max_tokens": phase.max_tokens, "temperature": 0})
                # complete: 200 with max_tokens tokens, or fewer ending at a stop token
                body = r.json() if r.status_code == 200 else {}
                done = body.get("choices", [{}])[0].get("finish_reason")
                n = body.get("usage", {}).get("completion_tokens", 0)
                ok = r.status_code == 200 and ((done == "length" and n == phase.max_tokens) or (done == "stop" and n >= 1))
                reason = None if ok else f"http {r.status_code}" if r.status_code != 200 else f"finish {done} after {n}"
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                ok, reason = False, type(exc).__name__
            if ok:
                stats["completed"] += 1
            else:
                stats["lost"] += 1
                stats["lost_reasons"][reason] = stats["lost_reasons"].get(reason, 0) + 1

    await asyncio.gather(*(worker() for _ in range(phase.concurrency)))


async def _until_scaled(phase: Phase, cfg: ScenarioConfig, result: Result, first: int, enough: asyncio.Event) -> None:
    """Sets ``enough`` ``cfg.scaled_hold_s`` after a sample (from index ``first`` on) shows
    ``phase.until_scaled`` above its minimum replicas."""
    if phase.until_scaled is None:
        return
    role = phase.until_scaled
    while not any(s["replicas"][role] > result.min_replicas[role] for s in result.samples[first:]):
        await asyncio.sleep(cfg.sample_s / 4)
    await asyncio.sleep(cfg.scaled_hold_s)
    enough.set()


async def run_phases(base_url: str, dashboard: str, cfg: ScenarioConfig, result: Result) -> None:
    t0 = time.monotonic()
    current = {"phase": "startup"}
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            replicas, nodes = await asyncio.to_thread(sample, dashboard)
            result.samples.append({"t": round(time.monotonic() - t0, 2), "phase": current["phase"],
                                   "replicas": replicas, "nodes": nodes})
            try:
                await asyncio.wait_for(stop.wait(), cfg.sample_s)
            except asyncio.TimeoutError:
                pass

    task = asyncio.create_task(sampler())
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0,
                                 limits=httpx.Limits(max_connections=128)) as client:
        for phase in cfg.phases:
            current["phase"] = phase.name
            start = time.monotonic() - t0
            stats = {"sent": 0, "completed": 0, "lost": 0, "lost_reasons": {}}
            if phase.concurrency:
                enough = asyncio.Event()
                watch = asyncio.create_task(_until_scaled(phase, cfg, result, len(result.samples), enough))
                await _load(client, phase, cfg, stats, enough)
                watch.cancel()
            else:  # idle: until both roles and node types are back at their minimum (within idle_extra_s more)
                end = time.monotonic() + phase.seconds + cfg.idle_extra_s
                await asyncio.sleep(phase.seconds)
                while time.monotonic() < end:
                    last = result.samples[-1] if result.samples else None
                    if last and all(last["replicas"][r] <= result.min_replicas[r] for r in ROLES) and (
                            not cfg.wait_for_nodes or all(last["nodes"][t] <= result.min_nodes[t] for t in NODE_TYPES)):
                        break
                    await asyncio.sleep(cfg.sample_s)
            result.requests[phase.name] = stats
            result.phases.append({"name": phase.name, "start": round(start, 2), "end": round(time.monotonic() - t0, 2)})
    stop.set()
    await task


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in result.samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        ax1.step(t, [s["replicas"][role] for s in result.samples], where="post", label=f"{role} replicas", color=color)
    for kind, color in zip(NODE_TYPES, ("tab:blue", "tab:orange")):
        ax2.step(t, [s["nodes"][kind] for s in result.samples], where="post", label=kind, color=color)
    for ax in (ax1, ax2):
        for i, ph in enumerate(result.phases):
            ax.axvspan(ph["start"], ph["end"], alpha=0.08 * (i + 1), color="gray")
            if ax is ax1:
                ax.text(ph["start"], ax1.get_ylim()[1] if ax1.get_ylim()[1] else 1, ph["name"], va="top", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    lost = sum(r["lost"] for r in result.requests.values())
    sent = sum(r["sent"] for r in result.requests.values())
    ax1.set_ylabel("running replicas")
    ax2.set_ylabel("alive nodes")
    ax2.set_xlabel("seconds")
    ax1.set_title(f"Autoscaling per role on the local fake multi-node cluster: {sent} requests, {lost} lost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def serve_config(cfg: ScenarioConfig, ports: dict) -> dict:
    """serve_config.local.yaml on ``ports`` (http, grpc), ``cfg.autoscaling`` set in both roles."""
    serve_cfg = yaml.safe_load((ROOT / "serve_config.local.yaml").read_text())
    serve_cfg["http_options"]["port"], serve_cfg["grpc_options"]["port"] = ports["http"], ports["grpc"]
    for dep in serve_cfg["applications"][0]["deployments"]:
        if dep["name"] in ROLES.values():
            dep["autoscaling_config"].update(cfg.autoscaling)
    return serve_cfg


def run(cfg: ScenarioConfig, *, out: Path | None, temp_dir: str | None = None, ports: dict | None = None) -> Result:
    lc = _load_local_cluster()
    ports = ports or {k: free_port() for k in ("gcs", "dashboard", "metrics", "http", "grpc")}
    temp_dir = temp_dir or f"/tmp/fp_as{os.getpid()}"
    serve_cfg = serve_config(cfg, ports)
    deps = {d["name"]: d for d in serve_cfg["applications"][0]["deployments"]}
    result = Result(config={"phases": [asdict(p) for p in cfg.phases], "max_requests": cfg.max_requests,
                            "seed": cfg.seed, "autoscaling": {r: deps[n]["autoscaling_config"] for r, n in ROLES.items()}},
                    min_replicas={r: deps[n]["autoscaling_config"]["min_replicas"] for r, n in ROLES.items()},
                    max_replicas={r: deps[n]["autoscaling_config"]["max_replicas"] for r, n in ROLES.items()},
                    min_nodes={t: yaml.safe_load((ROOT / "cluster.local.yaml").read_text())["available_node_types"][t]
                               .get("min_workers", 0) for t in NODE_TYPES})
    serve_file = Path(temp_dir + "_serve.yaml")
    serve_file.write_text(yaml.safe_dump(serve_cfg, sort_keys=False))
    info = lc.up(temp_dir, ports["gcs"], ports["dashboard"], ports["metrics"])
    try:
        env = lc.cluster_env()
        subprocess.run([lc.ray_bin("serve"), "deploy", str(serve_file), "-a", info["dashboard"]], check=True,
                       env=env, cwd=ROOT, timeout=300, capture_output=True)
        base = f"http://127.0.0.1:{ports['http']}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("the service did not become ready")
        asyncio.run(run_phases(base, info["dashboard"], cfg, result))
    finally:
        lc.down(temp_dir)
        serve_file.unlink(missing_ok=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(asdict(result), indent=1))
        plot(result, out.with_suffix(".png"))
    return result


def summary(result: Result) -> str:
    lines = [f"{'phase':14} {'sent':>6} {'done':>6} {'lost':>5}  max replicas (prefill, decode)  max nodes (prefill, decode)"]
    for ph in result.phases:
        s = [x for x in result.samples if x["phase"] == ph["name"]] or [{"replicas": {"prefill": 0, "decode": 0},
                                                                        "nodes": dict.fromkeys(NODE_TYPES, 0)}]
        r = result.requests.get(ph["name"], {})
        lines.append(f"{ph['name']:14} {r.get('sent', 0):6} {r.get('completed', 0):6} {r.get('lost', 0):5}  "
                     f"{max(x['replicas']['prefill'] for x in s):>3}, {max(x['replicas']['decode'] for x in s):<3}"
                     f"                          {max(x['nodes'][NODE_TYPES[0]] for x in s):>3}, "
                     f"{max(x['nodes'][NODE_TYPES[1]] for x in s)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the CI-sized phases")
    parser.add_argument("--out", default=None, help="output path without suffix "
                        "(default benchmarks/results/autoscale_scenario[_short])")
    args = parser.parse_args(argv)
    cfg = SHORT if args.short else FULL
    out = Path(args.out) if args.out else RESULTS / ("autoscale_scenario_short" if args.short else "autoscale_scenario")
    result = run(cfg, out=out)
    print(summary(result))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0 if all(r["lost"] == 0 for r in result.requests.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
