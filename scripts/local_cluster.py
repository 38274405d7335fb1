"""Start and stop the local multi-node cluster of cluster.local.yaml (Ray's fake multi-node
provider: the real autoscaler adds and removes prefill / decode "nodes", each a raylet on
this machine), everything on 127.0.0.1.

    python scripts/local_cluster.py up      # the head; worker nodes come and go with the load
    serve deploy serve_config.local.yaml    # -a http://127.0.0.1:8265 (the default)
    python scripts/local_cluster.py down    # stops this cluster's processes, and only these

``down`` stops what runs under this cluster's own Ray temp dir (``--temp-dir``), not every Ray
process of the user as ``ray stop`` would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEMP_DIR = "/tmp/fp_local_ray"  # short: Ray's socket paths live under it
STATE = "flashprefill_local_cluster.json"


def cluster_env(extra: dict | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RAY_FAKE_CLUSTER": "1",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        # keep the node IP on loopback (Ray resolves an explicit 127.0.0.1 to the machine's address)
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # custom autoscaling metrics every second, not every 10 s: the local delays are seconds
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": env.get("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1"),
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": env.get("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1"),
        "RAY_SERVE_LOG_TO_STDERR": env.get("RAY_SERVE_LOG_TO_STDERR", "0"),
    })
    env.pop("RAY_ADDRESS", None)
    env.update(extra or {})
    return env


def ray_bin(name: str = "ray") -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def cluster_config(gcs_port: int) -> Path:
    """cluster.local.yaml, or a copy pointing the provider at another GCS port."""
    import yaml

    path = ROOT / "cluster.local.yaml"
    config = yaml.safe_load(path.read_text())
    want = f"127.0.0.1:{gcs_port}"
    if config["provider"].get("gcs_address") == want:
        return path
    config["provider"]["gcs_address"] = want
    out = Path(tempfile.mkdtemp(prefix="fp_local_cluster_")) / "cluster.local.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def up(temp_dir: str = DEFAULT_TEMP_DIR, gcs_port: int = 6379, dashboard_port: int = 8265,
       metrics_port: int = 8080, env: dict | None = None) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_local_cluster

    if gen_local_cluster.main(["--check"]) != 0:
        raise SystemExit("cluster.local.yaml is stale: run python scripts/gen_local_cluster.py")
    config = cluster_config(gcs_port)
    cmd = [ray_bin(), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--num-cpus=4",
           "--num-gpus=0", f"--autoscaling-config={config}", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard_port}", f"--metrics-export-port={metrics_port}", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    subprocess.run(cmd, check=True, env=cluster_env(env), cwd=ROOT, stdout=subprocess.DEVNULL)
    info = {"temp_dir": temp_dir, "gcs": f"127.0.0.1:{gcs_port}", "dashboard": f"http://127.0.0.1:{dashboard_port}",
            "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    Path(temp_dir, STATE).write_text(json.dumps(info))
    return info


def cluster_processes(temp_dir: str) -> list:
    """Every process of this cluster: those whose command line or open files name its temp
    dir, and their descendants."""
    import psutil

    found = {}
    for proc in psutil.process_iter():
        try:
            if temp_dir in " ".join(proc.cmdline()) or any(temp_dir in os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                                                           for fd in os.listdir(f"/proc/{proc.pid}/fd")):
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            pass
    found.pop(os.getpid(), None)
    return list(found.values())


def _running(procs: list) -> list:
    """Those of ``procs`` still running: a zombie has exited (its parent, also stopping, may
    never reap it), so it is not waited for."""
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            pass
    return alive


def down(temp_dir: str = DEFAULT_TEMP_DIR, grace_s: float = 5.0) -> int:
    """SIGTERM to every process of the cluster, SIGKILL to those still running ``grace_s``
    later (as ``ray stop`` does after its grace period). Ray's GCS server and the autoscaler's
    monitor outlive a SIGTERM by minutes, which a longer grace would only wait out."""
    import psutil

    procs = cluster_processes(temp_dir)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace_s
    alive = _running(procs)
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = _running(alive)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    Path(temp_dir, "ray_current_cluster").unlink(missing_ok=True)  # as `ray stop` does
    return len(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--temp-dir", default=DEFAULT_TEMP_DIR)
    parser.add_argument("--port", type=int, default=6379, help="GCS port")
    parser.add_argument("--dashboard-port", type=int, default=8265)
    parser.add_argument("--metrics-port", type=int, default=8080)
    args = parser.parse_args(argv)
    if args.action == "up":
        info = up(args.temp_dir, args.port, args.dashboard_port, args.metrics_port)
        print(f"local cluster up: GCS {info['gcs']}  dashboard {info['dashboard']}  metrics {info['metrics']}")
        print("next: serve deploy serve_config.local.yaml   (then: serve status; ray status --address "
              f"{info['gcs']}, with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)")
    else:
        print(f"stopped {down(args.temp_dir)} processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
