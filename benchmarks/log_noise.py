"""A short mixed run against a local ``python -m router serve`` (CPU, builtin:tiny), and what
its log says: lines by level, tracebacks, Serve's "Failed to route request" warnings, and how
long ``/health/ready`` kept answering 200 after a prefill replica was killed (issue 47).

The run, over ``--duration-s``: a few clients sending ordinary requests one after another
(HTTP, SSE, gRPC), a burst of ``--burst`` concurrent requests, bad requests (HTTP 400s and gRPC
INVALID_ARGUMENT), and, half-way, SIGKILL of the prefill replica's process (a crash), polling
``/health/ready`` every 20 ms until it answers 503. The log is the launcher's own output (what
a user of ``router serve`` sees: Ray forwards the replicas' lines to it).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/log_noise.py --out /tmp/log_noise.json
    # the code of another commit (before/after), exported without touching any checkout:
    mkdir /tmp/before && git archive f7fc143 | tar -x -C /tmp/before
    PYTHONPATH=$PWD .venv/bin/python benchmarks/log_noise.py --repo /tmp/before --out /tmp/before.json

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the client's proto stubs (router/proto)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    repo: str
    duration_s: float = 180.0
    burst: int = 200
    clients: int = 3
    log: str = "/tmp/log_noise_serve.log"


@dataclasses.dataclass
class RunResult:
    repo: str
    commit: str
    duration_s: float
    requests: dict
    log_lines: int
    warning: int
    error: int
    tracebacks: int
    failed_to_route: int
    ready_200_after_kill_s: float | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(i: int) -> list[int]:
    return [256] + [(i * 31 + k * 17) % 256 for k in range(8 + i % 40)]


class Traffic:
    def __init__(self, base: str, grpc_target: str) -> None:
        import httpx

        self.base, self.target = base, grpc_target
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._httpx = httpx

    def count(self, key: str) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def http(self, i: int, stream: bool = False, body: dict | None = None) -> None:
        body = body or {"model": "builtin:tiny", "prompt": _prompt(i), "max_tokens": 4, "temperature": 0}
        if stream:
            body = {**body, "stream": True}
        try:
            with self._httpx.Client(base_url=self.base, timeout=300.0) as c:
                self.count(f"http {c.post('/v1/completions', json=body).status_code}")
        except Exception as exc:  # noqa: BLE001 - counted, not raised: the run goes on
            self.count(f"http {type(exc).__name__}")

    def grpc(self, i: int, bad: bool = False) -> None:
        import grpc

        from router.proto import flashprefill_pb2 as pb
        from router.proto import flashprefill_pb2_grpc as pb_grpc

        req = pb.GenerateRequest(model="builtin:tiny", prompt_token_ids=_prompt(i), max_tokens=4, temperature=0.0)
        if bad:
            req.temperature = -1.0  # a field the stubs take and the service refuses (INVALID_ARGUMENT)
        with grpc.insecure_channel(self.target) as channel:
            try:
                pb_grpc.FlashPrefillStub(channel).Generate(req, timeout=300)
                self.count("grpc OK")
            except grpc.RpcError as err:
                self.count(f"grpc {err.code().name}")


def _prefill_pids() -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "ServeReplica" in line and "PrefillServer" in line]


def run(cfg: RunConfig) -> RunResult:
    http_port, grpc_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": cfg.repo}
    cmd = [sys.executable, "-m", "router", "serve", "--model", "builtin:tiny", "--http-port", str(http_port),
           "--grpc-port", str(grpc_port), "--metrics-port", "0", "--no-ray-auth", "--num-cpus", "8"]
    log = open(cfg.log, "wb")
    proc = subprocess.Popen(cmd, cwd=cfg.repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{http_port}"
    traffic = Traffic(base, f"127.0.0.1:{grpc_port}")
    ready_after_kill = None
    try:
        import httpx

        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router serve exited {proc.returncode}; see {cfg.log}")
            try:
                if httpx.get(f"{base}/health/ready", timeout=5).status_code == 200 and \
                        httpx.get(f"{base}/v1/models", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the service did not become ready in 900 s")
            time.sleep(1.0)
        start = time.monotonic()
        stop = threading.Event()

        def client(k: int) -> None:
            i = k * 100_000
            while not stop.is_set():
                i += 1
                (traffic.grpc(i) if i % 3 == 0 else traffic.http(i, stream=i % 3 == 1))

        pool = concurrent.futures.ThreadPoolExecutor(cfg.burst + cfg.clients + 8)
        clients = [pool.submit(client, k) for k in range(cfg.clients)]
        time.sleep(min(20.0, cfg.duration_s / 6))
        burst = [pool.submit(traffic.http, 10_000 + i, i % 2 == 0) if i % 4 else pool.submit(traffic.grpc, 10_000 + i)
                 for i in range(cfg.burst)]
        concurrent.futures.wait(burst)
        for i in range(20):  # bad input: HTTP 400s, gRPC INVALID_ARGUMENT
            traffic.http(i, body={"model": "builtin:tiny", "prompt": _prompt(i), "max_tokens": "many"})
            if i % 2:
                traffic.grpc(i, bad=True)
        time.sleep(max(cfg.duration_s / 2 - (time.monotonic() - start), 0))
        pids = _prefill_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() - killed < 60:
                if httpx.get(f"{base}/health/ready", timeout=5).status_code == 503:
                    ready_after_kill = time.monotonic() - killed
                    break
                time.sleep(0.02)
        time.sleep(max(cfg.duration_s - (time.monotonic() - start), 0))
        stop.set()
        concurrent.futures.wait(clients)
        pool.shutdown()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    text = Path(cfg.log).read_text(errors="replace").splitlines()
    level = lambda name: sum(1 for line in text if re.search(rf"(^|[\s\]]){name}[\s:]", line[:160]))  # noqa: E731
    commit = subprocess.run(["git", "-C", cfg.repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return RunResult(repo=cfg.repo, commit=commit, duration_s=cfg.duration_s, requests=dict(sorted(traffic.counts.items())),
                     log_lines=len(text), warning=level("WARNING"), error=level("ERROR"),
                     tracebacks=sum("Traceback (most recent call last)" in line for line in text),
                     failed_to_route=sum("Failed to route request" in line for line in text),
                     ready_200_after_kill_s=ready_after_kill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.getcwd(), help="the checkout whose code runs (cwd and PYTHONPATH)")
    ap.add_argument("--duration-s", type=float, default=180.0)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--log", default="/tmp/log_noise_serve.log")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = run(RunConfig(repo=os.path.abspath(args.repo), duration_s=args.duration_s, burst=args.burst, log=args.log))
    print(f"| commit | lines | WARNING | ERROR | tracebacks | 'Failed to route' | /health/ready 200 after kill (s) |")
    print("|---|---|---|---|---|---|---|")
    kill = "n/a" if res.ready_200_after_kill_s is None else f"{res.ready_200_after_kill_s:.2f}"
    print(f"| {res.commit} | {res.log_lines} | {res.warning} | {res.error} | {res.tracebacks} | "
          f"{res.failed_to_route} | {kill} |")
    print("requests:", res.requests)
    if args.out:
        Path(args.out).write_text(json.dumps(dataclasses.asdict(res), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
