"""Bounded load test of the service on loopback: every response checked against the oracle.

    python benchmarks/load_test.py --start                  # local Ray + Serve, CPU, tiny model
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --grpc-target 127.0.0.1:9000

Sends ``requests`` greedy requests (mixed prompt lengths and ``max_tokens``; HTTP and gRPC,
streaming and not) with at most ``concurrency`` in flight, and checks each one against the
single-process oracle (``router.offline.generate``, one prompt at a time):
- lost: no complete response (transport error, non-200, missing finish_reason / ``[DONE]``);
- duplicated: a response id seen twice, or more tokens than the oracle (repeats after a resume);
- garbled: token ids differ from the oracle, or the text differs from their detokenization.
Prints a table, writes JSON (``--out``). Bounded: fixed count, per-request timeout, and a
wall-clock limit for the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("http", "http_stream", "grpc", "grpc_stream")


@dataclass(frozen=True)
class LoadSpec:
    requests: int = 200
    concurrency: int = 32
    prompt_lengths: tuple[int, ...] = (5, 17, 48, 130, 300, 700)
    max_tokens: tuple[int, ...] = (1, 4, 12, 24)
    modes: tuple[str, ...] = MODES
    seed: int = 0
    request_timeout_s: float = 120.0
    wall_limit_s: float = 300.0
    model: str = "builtin:tiny"
    app: str | None = None  # Serve application (route prefix and gRPC metadata)
    auth_token: str | None = None

    def workload(self) -> list[tuple[int, tuple[int, ...], int, str]]:
        """(index, prompt ids, max_tokens, mode) per request; prompts repeat (the oracle runs
        once per distinct prompt)."""
        rng = random.Random(self.seed)
        out = []
        for i in range(self.requests):
            n = rng.choice(self.prompt_lengths)
            variant = rng.randrange(3)
            out.append((i, prompt_ids(n, variant), rng.choice(self.max_tokens), self.modes[i % len(self.modes)]))
        return out


@dataclass
class Outcome:
    index: int
    mode: str
    prompt_len: int
    max_tokens: int
    ok: bool
    problem: str = ""
    latency_s: float = 0.0
    ttft_s: float | None = None
    response_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: str = ""
    token_times: list[float] = field(default_factory=list)  # streams: seconds after t0, one per token
    timing: dict | None = None  # the service's timing object (last chunk / response)


@dataclass
class LoadReport:
    spec: dict
    sent: int
    ok: int
    lost: int
    duplicated: int
    garbled: int
    rejected_429: int
    wall_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    throughput_rps: float
    tokens_out: int
    by_mode: dict
    problems: list[str]


def prompt_ids(n: int, variant: int) -> tuple[int, ...]:
    """A deterministic byte-token prompt of ``n`` tokens (BOS first) for the tiny model."""
    return (256, *[(variant * 37 + i * 11 + (i * i) % 7) % 256 for i in range(n - 1)])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


# ----------------------------------------------------------------------------- oracle
class Oracle:
    """Greedy tokens and text from the single-process engines (cached per prompt)."""

    def __init__(self, config: Any = None) -> None:
        from model_executor.loading import load_model
        from model_executor.tokenizer import ByteTokenizer
        from serving.config import ServiceConfig

        self.config = config or ServiceConfig(sparse={"alpha": 0.0})
        self.model = load_model(None)
        self.tokenizer = ByteTokenizer()
        self._cache: dict[tuple, list[int]] = {}

    def tokens(self, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in self._cache:
            from router.offline import generate
            from model_executor.sampling import SamplingParams

            params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                                    stop_token_ids=self.tokenizer.stop_token_ids)
            res = generate([list(prompt)], params, model=self.model, sparse_config=self.config.sparse_config,
                           dense_below=self.config.sparse.dense_below, page_size=self.config.kv.page_size)
            self._cache[key] = list(res[0].output_token_ids)
        return self._cache[key]

    def text(self, token_ids: list[int]) -> str:
        return detokenize(self.tokenizer, token_ids)


def detokenize(tokenizer: Any, token_ids: list[int]) -> str:
    """The text the service should send for ``token_ids`` (its own incremental detokenizer)."""
    from router.detokenize import TextStream

    stream = TextStream(tokenizer)
    return stream.push(token_ids) + stream.finish()


# ----------------------------------------------------------------------------- clients
def completion_body(model: str, prompt: tuple[int, ...] | list[int], max_tokens: int, stream: bool) -> dict:
    """A greedy ``/v1/completions`` body with token ids in and out."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "stream": stream}


def encode_body(body: dict) -> bytes:
    """JSON bytes of a request body (compact: 128K-token prompts stay under a megabyte)."""
    return json.dumps(body, separators=(",", ":")).encode()


async def _http_call(client: Any, spec: LoadSpec, prompt: tuple[int, ...], max_tokens: int, stream: bool,
                     out: Outcome, t0: float) -> None:
    prefix = f"/{spec.app}" if spec.app else ""
    headers = {"Authorization": f"Bearer {spec.auth_token}"} if spec.auth_token else {}
    body = completion_body(spec.model, prompt, max_tokens, stream)
    await http_completion(client, f"{prefix}/v1/completions", encode_body(body), headers, stream, out, t0)


async def http_completion(client: Any, path: str, body: bytes, headers: dict, stream: bool, out: Outcome,
                          t0: float) -> None:
    """One completion over HTTP (``body``: JSON bytes, see :func:`encode_body`); fills ``out``:
    status, response id, token ids, text, the service's ``timing``, and ``problem`` for anything
    short of a complete answer. Streams also record ``ttft_s`` and each token's arrival
    (``token_times``, seconds after ``t0``)."""
    headers = {**headers, "content-type": "application/json"}
    if not stream:
        r = await client.post(path, content=body, headers=headers)
        out.status = str(r.status_code)
        if r.status_code != 200:
            out.problem = f"HTTP {r.status_code}: {r.text[:200]}"
            return
        obj = r.json()
        choice = obj["choices"][0]
        out.response_id, out.token_ids, out.text = obj["id"], choice["token_ids"], choice["text"]
        out.timing = obj.get("timing")
        if choice.get("finish_reason") not in ("stop", "length"):
            out.problem = f"finish_reason {choice.get('finish_reason')!r}"
        return
    finishes, done = 0, 0
    async with client.stream("POST", path, content=body, headers=headers) as r:
        out.status = str(r.status_code)
        if r.status_code != 200:
            out.problem = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done += 1
                continue
            if done:
                out.problem = "data after [DONE]"
            chunk = json.loads(data)
            if "error" in chunk:
                out.problem = f"in-band error: {chunk['error']}"
                continue
            now = time.monotonic() - t0
            if out.ttft_s is None:
                out.ttft_s = now
            if out.response_id and chunk["id"] != out.response_id:
                out.problem = "chunk ids differ within one stream"
            out.response_id = chunk["id"]
            if "timing" in chunk:
                out.timing = chunk["timing"]
            for choice in chunk["choices"]:
                ids = choice.get("token_ids", [])
                out.token_ids.extend(ids)
                out.token_times.extend([now] * len(ids))
                out.text += choice.get("text", "")
                finishes += choice.get("finish_reason") is not None
    if done != 1 or finishes != 1:
        out.problem = out.problem or f"stream ended with {done} [DONE] and {finishes} finish_reason"


async def _grpc_call(stub: Any, spec: LoadSpec, prompt: tuple[int, ...], max_tokens: int, stream: bool,
                     out: Outcome, t0: float) -> None:
    from router.proto import flashprefill_pb2 as pb

    meta = []
    if spec.app:
        meta.append(("application", spec.app))
    if spec.auth_token:
        meta.append(("authorization", f"Bearer {spec.auth_token}"))
    req = pb.GenerateRequest(model=spec.model, prompt_token_ids=list(prompt), max_tokens=max_tokens,
                             temperature=0.0, request_id=f"load-{out.index}-{out.mode}")
    if not stream:
        resp = await stub.Generate(req, metadata=meta, timeout=spec.request_timeout_s)
        out.status = "OK"
        out.response_id, out.token_ids, out.text = resp.request_id, list(resp.token_ids), resp.text
        if resp.finish_reason not in ("stop", "length"):
            out.problem = f"finish_reason {resp.finish_reason!r}"
        return
    finishes = 0
    async for msg in stub.GenerateStream(req, metadata=meta, timeout=spec.request_timeout_s):
        if out.ttft_s is None:
            out.ttft_s = time.monotonic() - t0
        out.response_id = msg.request_id
        out.token_ids.extend(msg.token_ids)
        out.text += msg.text
        finishes += bool(msg.finish_reason)
    out.status = "OK"
    if finishes != 1:
        out.problem = f"stream carried {finishes} finish_reason"


async def run_load_async(spec: LoadSpec, http_base: str, grpc_target: str,
                         expected: Callable[[tuple[int, ...], int], list[int]],
                         expected_text: Callable[[list[int]], str]) -> LoadReport:
    import grpc
    import httpx

    from router.proto import flashprefill_pb2_grpc

    work = spec.workload()
    outcomes: list[Outcome] = []
    sem = asyncio.Semaphore(spec.concurrency)
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(base_url=http_base, timeout=spec.request_timeout_s, limits=limits) as client, \
            grpc.aio.insecure_channel(grpc_target) as channel:
        stub = flashprefill_pb2_grpc.FlashPrefillStub(channel)

        async def one(index: int, prompt: tuple[int, ...], max_tokens: int, mode: str) -> None:
            async with sem:
                out = Outcome(index, mode, len(prompt), max_tokens, ok=False)
                t0 = time.monotonic()
                try:
                    if mode.startswith("http"):
                        await _http_call(client, spec, prompt, max_tokens, mode.endswith("stream"), out, t0)
                    else:
                        await _grpc_call(stub, spec, prompt, max_tokens, mode.endswith("stream"), out, t0)
                except grpc.aio.AioRpcError as exc:
                    out.status, out.problem = exc.code().name, f"gRPC {exc.code().name}: {exc.details()}"
                except Exception as exc:  # noqa: BLE001 - counted as lost
                    out.problem = f"{type(exc).__name__}: {exc}"
                out.latency_s = time.monotonic() - t0
                outcomes.append(out)

        start = time.monotonic()
        tasks = [asyncio.create_task(one(*w)) for w in work]
        done, pending = await asyncio.wait(tasks, timeout=spec.wall_limit_s)
        for t in pending:
            t.cancel()
        wall = time.monotonic() - start

    lost = duplicated = garbled = rejected = 0
    problems: list[str] = []
    seen_ids: set[str] = set()
    for out in outcomes:
        want = expected(tuple(prompt_ids_of(work, out.index)), out.max_tokens)
        if out.problem:
            lost += 1
            rejected += out.status in ("429", "RESOURCE_EXHAUSTED")
            problems.append(f"#{out.index} {out.mode}: {out.problem}")
            continue
        if out.response_id in seen_ids:
            duplicated += 1
            problems.append(f"#{out.index} {out.mode}: duplicate response id {out.response_id}")
            continue
        seen_ids.add(out.response_id)
        if out.token_ids != want:
            if len(out.token_ids) > len(want) and out.token_ids[: len(want)] == want:
                duplicated += 1
            else:
                garbled += 1
            problems.append(f"#{out.index} {out.mode} (prompt {out.prompt_len}, max_tokens {out.max_tokens}): "
                            f"tokens {out.token_ids} != oracle {want}")
            continue
        if out.text != expected_text(want):
            garbled += 1
            problems.append(f"#{out.index} {out.mode}: text {out.text!r} != {expected_text(want)!r}")
            continue
        out.ok = True
    lost += len(work) - len(outcomes)  # still pending at the wall-clock limit
    ok = [o for o in outcomes if o.ok]
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    by_mode = {}
    for mode in spec.modes:
        ls = [o.latency_s for o in ok if o.mode == mode]
        by_mode[mode] = {"ok": len(ls), "p50_s": percentile(ls, 50), "p99_s": percentile(ls, 99)}
    return LoadReport(
        spec=asdict(spec) | {"auth_token": None}, sent=len(work), ok=len(ok), lost=lost, duplicated=duplicated,
        garbled=garbled, rejected_429=rejected, wall_s=wall, latency_p50_s=percentile(lat, 50),
        latency_p99_s=percentile(lat, 99), ttft_p50_s=percentile(ttft, 50) if ttft else None,
        ttft_p99_s=percentile(ttft, 99) if ttft else None, throughput_rps=len(ok) / wall if wall else 0.0,
        tokens_out=sum(len(o.token_ids) for o in ok), by_mode=by_mode, problems=problems[:20],
    )


def prompt_ids_of(work: list, index: int) -> tuple[int, ...]:
    return work[index][1]


def run_load(spec: LoadSpec, http_base: str, grpc_target: str, oracle: Oracle | None = None) -> LoadReport:
    oracle = oracle or Oracle()
    for _, prompt, max_tokens, _ in spec.workload():  # oracle first: it is not part of the timing
        oracle.tokens(prompt, max_tokens)
    return asyncio.run(run_load_async(spec, http_base, grpc_target, oracle.tokens, oracle.text))


def format_report(rep: LoadReport) -> str:
    rows = [
        ("requests sent", rep.sent), ("ok (match the oracle)", rep.ok), ("lost", rep.lost),
        ("duplicated", rep.duplicated), ("garbled", rep.garbled), ("of lost: 429 rejections", rep.rejected_429),
        ("wall s", f"{rep.wall_s:.1f}"), ("throughput req/s", f"{rep.throughput_rps:.2f}"),
        ("latency P50 s", f"{rep.latency_p50_s:.3f}"), ("latency P99 s", f"{rep.latency_p99_s:.3f}"),
        ("TTFT P50 s (streams)", f"{rep.ttft_p50_s:.3f}" if rep.ttft_p50_s is not None else "-"),
        ("TTFT P99 s (streams)", f"{rep.ttft_p99_s:.3f}" if rep.ttft_p99_s is not None else "-"),
        ("tokens out", rep.tokens_out),
    ]
    lines = [f"{k:<24} {v}" for k, v in rows]
    lines.append(f"{'mode':<14} {'ok':>4} {'P50 s':>8} {'P99 s':>8}")
    for mode, m in rep.by_mode.items():
        lines.append(f"{mode:<14} {m['ok']:>4} {m['p50_s']:>8.3f} {m['p99_s']:>8.3f}")
    lines.extend(rep.problems)
    return "\n".join(lines)


def local_config():
    """The ``--start`` service: the oracle's model (``LoadSpec.model``, the tiny byte model; the
    service's default model is another), dense (alpha 0) as the oracle, CPU-sized pools."""
    from serving.config import ServiceConfig

    return ServiceConfig(model={"model": LoadSpec.model, "max_model_len": 2048}, sparse={"alpha": 0.0}, runtime={"torch_threads": 1},
                         kv={"prefill_pages": 256, "decode_pages": 512})


def _start_local(args: argparse.Namespace) -> tuple[str, str]:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from router.app import GRPC_SERVICER, build_application
    from router.launcher import prepare_environment, ray_init_kwargs

    prepare_environment()
    ray.init(num_cpus=8, logging_level="WARNING", log_to_driver=False, **ray_init_kwargs())
    serve.start(http_options={"host": "127.0.0.1", "port": args.http_port},
                grpc_options=gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[GRPC_SERVICER]))
    config = local_config()
    small = {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}
    serve.run(build_application(config, prefill={**small, "num_replicas": args.prefill_replicas},
                                decode={**small, "num_replicas": args.decode_replicas}),
              name="load", route_prefix="/load")
    return f"http://127.0.0.1:{args.http_port}", f"127.0.0.1:{args.grpc_port}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", action="store_true", help="start a local Ray + Serve (CPU, tiny model) first")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--grpc-target", default="127.0.0.1:9000")
    p.add_argument("--app", default=None, help="Serve application name (route prefix, gRPC metadata)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_cpu.json"))
    args = p.parse_args(argv)
    app = args.app
    if args.start:
        url, target = _start_local(args)
        app = "load"
    else:
        url, target = args.url, args.grpc_target
    import os

    spec = LoadSpec(requests=args.requests, concurrency=args.concurrency, app=app,
                    auth_token=os.environ.get("FLASHPREFILL_API_TOKEN"))
    rep = run_load(spec, url, target)
    print(format_report(rep))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(asdict(rep), indent=2))
    print(f"wrote {args.out}")
    if args.start:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    return 0 if rep.lost == rep.duplicated == rep.garbled == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
