"""``/health/ready`` while ``python -m router serve`` starts: what it answers, and how fast.

Starts the launcher (tiny built-in model on CPU, one prefill and one decode replica) in a fresh
process and asks ``/health/ready`` every ``--every-s`` seconds, each request with a ``--timeout-s``
client timeout, from the launch until the first 200; then stops the launcher with SIGINT. Each
answer falls in one phase:

- ``refused``: the HTTP proxy does not listen yet;
- ``no route``: the proxy's own 404 (no application has a route for the path yet);
- ``held``: no answer within the timeout (the proxy holds the request: a route, no replica);
- ``starting``: the start-up health application's 503 (router/health_app.py);
- ``unavailable`` / ``ready``: the ingress's own 503 / 200.

Prints a table (per phase: answers, first and last seen after the launch, median and largest
latency, the phase's first answer's latency and the largest one after it) and writes ``benchmarks/results/startup_health_cpu.json``. Wall-clock figures: they
depend on the machine and its load.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/startup_health.py
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("refused", "no route", "held", "starting", "unavailable", "ready", "other")


def phase_of(status: int | None, body: object) -> str:
    """The phase of one answer (``status`` None: no answer, ``body`` then "refused" or "held")."""
    if status is None:
        return "held" if body == "held" else "refused"
    if status == 404 and body is None:  # the proxy's plain-text 404, not an application's JSON one
        return "no route"
    kind = body.get("status") if isinstance(body, dict) else None
    if status == 503 and kind in ("starting", "unavailable"):
        return kind
    if status == 200 and kind == "ready":
        return "ready"
    return "other"


def summarize(samples: list[tuple[float, str, float]]) -> list[dict]:
    """``samples``: (seconds after the launch, phase, latency s); one row per phase seen, in
    PHASES order."""
    rows = []
    for phase in PHASES:
        mine = [s for s in samples if s[1] == phase]
        if not mine:
            continue
        lat = [s[2] for s in mine]
        # the first answer of a phase may have waited for it to begin (a request the proxy held
        # while the start-up health application's replica started): the later ones, apart
        rows.append({"phase": phase, "answers": len(mine), "first_s": round(min(s[0] for s in mine), 2),
                     "last_s": round(max(s[0] for s in mine), 2), "p50_latency_s": round(statistics.median(lat), 3),
                     "max_latency_s": round(max(lat), 3), "first_latency_s": round(lat[0], 3),
                     "max_latency_after_first_s": round(max(lat[1:]), 3) if len(lat) > 1 else None})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'phase':<12} {'answers':>7} {'first s':>8} {'last s':>8} {'p50 lat s':>10} {'max lat s':>10} "
            f"{'1st lat s':>10} {'max later s':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        later = "-" if r["max_latency_after_first_s"] is None else f"{r['max_latency_after_first_s']:.3f}"
        lines.append(f"{r['phase']:<12} {r['answers']:>7} {r['first_s']:>8.2f} {r['last_s']:>8.2f} "
                     f"{r['p50_latency_s']:>10.3f} {r['max_latency_s']:>10.3f} {r['first_latency_s']:>10.3f} {later:>12}")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args) -> list[tuple[float, str, float]]:
    import httpx

    http_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(ROOT), RAY_SERVE_LOG_TO_STDERR="0", RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "router", "serve", "--model", "builtin:tiny", "--device", "cpu", "--num-cpus", "4",
           "--http-port", str(http_port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
           "--prefill-kv-pages", "64", "--decode-kv-pages", "64"]
    samples: list[tuple[float, str, float]] = []
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while time.monotonic() - t0 < args.max_s:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the launcher exited {proc.returncode}:\n{log.read()[-4000:]}")
                sent = time.monotonic()
                try:
                    r = httpx.get(f"http://127.0.0.1:{http_port}/health/ready", timeout=args.timeout_s)
                    try:
                        body = r.json()
                    except ValueError:
                        body = None
                    phase = phase_of(r.status_code, body)
                except httpx.TimeoutException:
                    phase = phase_of(None, "held")
                except httpx.TransportError:
                    phase = phase_of(None, "refused")
                samples.append((sent - t0, phase, time.monotonic() - sent))
                if phase == "ready":
                    break
                time.sleep(args.every_s)
            else:
                raise RuntimeError(f"no 200 within {args.max_s} s")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every-s", type=float, default=0.1)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--max-s", type=float, default=600.0)
    p.add_argument("--out", default="startup_health_cpu.json")
    args = p.parse_args(argv)
    from evals.report import environment, write_json

    rows = summarize(measure(args))
    path = write_json(args.out, {"environment": environment(), "args": vars(args), "phases": rows})
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
