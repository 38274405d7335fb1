"""lm-eval scores of the service, sparse prefill against dense, on the shipped last-word task.

For each mode a CPU service is started (``python -m router serve``, the built-in SmolLM2-135M;
``sparse``: the default ``sparse.alpha``, ``dense``: ``--alpha 0``), lm-eval runs the task
unmodified (``--model local-completions`` with the tokenizer ``python -m router tokenizer``
writes; string mode), and the service is stopped. The task's contexts (about 1.1K-2K tokens) are
prefilled block-sparse in the sparse mode, which forces ``sparse.dense_below = 0`` (the model's
profile otherwise decides where sparse prefill starts). Per
mode: lm-eval's metrics; across modes: per item, the continuation's loglikelihood difference and
whether the greedy verdict agrees.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lmeval_scores.py --limit 30   # 2 shared CPU cores: ~17 min a mode

Writes ``benchmarks/results/lmeval_lastword_cpu.json`` and prints a table last; the service
logs and lm-eval's own outputs stay in the temporary folder it prints first. Wall times
depend on the machine's load; the scores do not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODES = {"sparse": None, "dense": 0.0}  # mode -> --alpha (None: the service default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited ({proc.returncode}) before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # the same deadline, asked more often: a ready service is used sooner
    raise RuntimeError(f"the service was not ready after {timeout_s} s")


def run_mode(mode: str, args: argparse.Namespace, tokenizer_dir: Path, out: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "--model", args.model, "--device", "cpu",
           "--http-port", str(port), "--grpc-port", str(free_port()),
           "--prefill-kv-pages", str(args.kv_pages), "--decode-kv-pages", str(args.kv_pages)]
    if MODES[mode] is not None:
        cmd += ["--alpha", str(MODES[mode])]
    else:  # the model's sparse setting (its profile) forced on at every length: what the targets measure
        cmd += ["--option", "sparse.dense_below=0"]
    log = open(out / f"serve_{mode}.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, server, args.ready_timeout)
        model_args = (f"model={args.model},base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                      f"tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent={args.concurrency},"
                      "max_length=8192,max_retries=1,timeout=1200")  # lm-eval's default 2048 would cut contexts
        lm_cmd = [str(BIN / "lm_eval"), "--model", "local-completions", "--model_args", model_args,
                  "--include_path", "evals/tasks", "--tasks", args.task, "--output_path", str(out / mode),
                  "--log_samples", "--seed", "0"]
        if args.limit is not None:
            lm_cmd += ["--limit", str(args.limit)]
        start = time.monotonic()
        subprocess.run(lm_cmd, cwd=ROOT, check=True)
        wall = time.monotonic() - start
    finally:
        os.killpg(server.pid, signal.SIGINT)  # the launcher shuts Serve and its Ray down on SIGINT
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    return collect(out / mode, args.task) | {"command": " ".join(cmd), "lm_eval": " ".join(lm_cmd),
                                              "wall_s": round(wall, 1)}


def collect(out: Path, task: str) -> dict:
    """lm-eval's metrics and per-item samples of ``task`` from its ``--output_path`` folder."""
    (results,) = list(out.rglob("results_*.json"))
    (samples,) = list(out.rglob(f"samples_{task}_*.jsonl"))
    raw = json.loads(results.read_text())
    wall = raw.get("total_evaluation_time_seconds")  # lm-eval's own clock (a string in its JSON)
    return {"results": raw["results"][task], "model_args": raw.get("config", {}).get("model_args"),
            "output_dir": str(out), "wall_s": None if wall is None else round(float(wall), 1),
            "samples": [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]}


def compare(a: list[dict], b: list[dict]) -> dict:
    """Per item (by doc_id): |loglikelihood difference| and greedy-verdict agreement of two runs."""
    rb = {s["doc_id"]: s["filtered_resps"][0] for s in b}
    diffs, agree = [], 0
    for s in a:
        (la, ga), (lb, gb) = s["filtered_resps"][0], rb[s["doc_id"]]
        diffs.append(abs(float(la) - float(lb)))
        agree += str(ga) == str(gb)
    return {"items": len(diffs), "mean_abs_loglik_diff": sum(diffs) / len(diffs), "max_abs_loglik_diff": max(diffs),
            "greedy_agreement": agree / len(diffs)}


def table(modes: dict) -> str:
    lines = ["| mode | items | acc | acc stderr | perplexity | lm-eval wall (s) |", "|---|---|---|---|---|---|"]
    for mode, r in modes.items():
        res = r["results"]
        lines.append(f"| {mode} | {len(r['samples'])} | {res['acc,none']:.4f} | {res['acc_stderr,none']:.4f} | "
                     f"{res['perplexity,none']:.3f} | {r.get('wall_s', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="fp_lastword", help="a loglikelihood task of evals/tasks")
    p.add_argument("--limit", type=int, default=None, help="the first N items (the task's order is a random sample)")
    p.add_argument("--model", default="builtin:smollm2-135m")
    p.add_argument("--modes", default="sparse,dense", help=f"comma-separated, of {tuple(MODES)}")
    p.add_argument("--concurrency", type=int, default=1, help="lm-eval's num_concurrent")
    p.add_argument("--kv-pages", type=int, default=96,
                   help="KV pages per replica (64 tokens each; the default 1024 holds GBs the task never uses)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", default="lmeval_lastword_cpu.json", help="file name under benchmarks/results/")
    p.add_argument("--combine", nargs="+", default=None, metavar="MODE=DIR",
                   help="run nothing: build the report from lm-eval output folders of earlier runs of this script "
                        "(each mode's run prints where they are; runs of the modes may go in parallel)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes: expected a comma-separated list of {tuple(MODES)}, got {args.modes!r}")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit: expected an int >= 1, got {args.limit}")

    sys.path.insert(0, str(ROOT))
    from evals.report import environment, write_json
    from model_executor.loading import export_tokenizer

    if args.combine:
        pairs = [c.partition("=") for c in args.combine]
        if any(not sep or m not in MODES or not Path(d).is_dir() for m, sep, d in pairs):
            p.error(f"--combine: expected MODE=DIR with MODE one of {tuple(MODES)} and DIR a folder, got {args.combine}")
        runs = {m: collect(Path(d), args.task) for m, _, d in pairs}
    else:
        tmp = Path(tempfile.mkdtemp(prefix="lmeval_scores_"))  # kept: the service logs, lm-eval's outputs
        print(f"service logs and lm-eval outputs under {tmp}", flush=True)
        tokenizer_dir = export_tokenizer(args.model, tmp / "tokenizer")
        runs = {m: run_mode(m, args, tokenizer_dir, tmp) for m in modes}
    payload = {"task": args.task, "limit": args.limit, "model": args.model, "environment": environment(),
               "modes": {m: {k: v for k, v in r.items() if k != "samples"} | {"items": len(r["samples"])}
                         for m, r in runs.items()}}
    if {"sparse", "dense"} <= set(runs):
        payload["sparse_vs_dense"] = compare(runs["sparse"]["samples"], runs["dense"]["samples"])
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    if "sparse_vs_dense" in payload:
        c = payload["sparse_vs_dense"]
        print(f"sparse vs dense, per item: mean |d loglik| {c['mean_abs_loglik_diff']:.4f}, max "
              f"{c['max_abs_loglik_diff']:.4f}, greedy verdict agreement {c['greedy_agreement']:.3f}")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
