"""Open-loop load generation against the service's HTTP API, on loopback.

One *cell* is one arrival rate: requests leave at Poisson arrival times (exponential gaps of
mean ``1 / rate``, drawn from ``seed``) whether or not earlier ones have finished, so a slow
service builds a queue instead of slowing the client down (closed-loop clients hide that).
Every request is a streaming ``/v1/completions`` call (token-id prompt, greedy), timed on the
client: TTFT at the first chunk, then the arrival of every token.

Bounded in count and time:
- at most ``requests`` requests; an arrival later than ``cell_seconds`` after the start is not
  sent (``not_sent``);
- each request gets ``request_timeout_s`` (then lost: ``timeout``); requests still running
  ``cell_seconds + drain_seconds`` after the start are cut (lost: ``cut``);
- a refused request (HTTP 4xx/5xx, an in-band error, a stream that ends early) is lost too,
  with its reason.

Per cell (:func:`summarize`): sent, completed, lost (by reason), P50/P99 TTFT (of completed
requests, and of every sent request with the ones that never saw a token as lower bounds) and
time per output token (TPOT: first to last token over the tokens in between), output tokens/s
and requests/s over the cell's busy time, and medians of the service's own TTFT breakdown
(``timing``: queue, prefill, export, transfer, first decode step).

Loopback only: :func:`check_loopback` refuses other hosts unless ``allow_remote`` is set.
The HTTP client itself is ``benchmarks.load_test.http_completion`` (shared with the load test).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.load_test import Outcome, http_completion, percentile  # noqa: E402

# the service's timing fields that make up the breakdown (see ChoiceReporter.timing in router/reporting.py)
BREAKDOWN = ("ttft_s", "queue_s", "prefill_s", "export_s", "transfer_s", "first_decode_s")
LOST_REASONS = ("timeout", "cut", "rejected", "http_error", "error", "incomplete")


@dataclass(frozen=True)
class CellSpec:
    """One open-loop cell (see the module docstring)."""

    rate: float
    requests: int = 100
    cell_seconds: float = 120.0
    drain_seconds: float = 60.0
    request_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate", "cell_seconds", "request_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        if isinstance(self.drain_seconds, bool) or not isinstance(self.drain_seconds, (int, float)) or \
                not (0 <= self.drain_seconds < math.inf):
            raise ValueError(f"drain_seconds: expected a number >= 0, got {self.drain_seconds!r}")
        if isinstance(self.requests, bool) or not isinstance(self.requests, int) or self.requests < 1:
            raise ValueError(f"requests: expected an int >= 1, got {self.requests!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an int, got {self.seed!r}")


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times (seconds from 0) of a Poisson process of ``rate`` per second."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate < math.inf):
        raise ValueError(f"rate: expected a positive number of requests per second, got {rate!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count: expected an int >= 0, got {count!r}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def check_loopback(url: str, allow_remote: bool = False) -> None:
    """Refuse a URL whose host is not a loopback address (or ``localhost``) unless
    ``allow_remote``: load generation is for the service on this machine."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url: expected http://HOST:PORT, got {url!r}")
    if allow_remote:
        return
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ValueError(f"url: {host!r} is not a loopback address; load tests target this machine "
                         "(127.0.0.1, ::1, localhost) unless allow_remote is set (--allow-remote)")


@dataclass
class RequestRecord:
    """One request of a cell, as the client saw it (times in seconds from the cell's start
    for ``scheduled_s``/``sent_s``/``finished_s``, from its own send for the rest)."""

    index: int
    prompt_len: int
    scheduled_s: float
    status: str = "not_sent"  # not_sent | ok | lost
    lost_reason: str | None = None
    problem: str = ""
    sent_s: float | None = None
    finished_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    http_status: str = ""
    timing: dict | None = None


def _classify(out: Outcome, max_tokens: int) -> tuple[str, str | None]:
    if out.problem:
        if out.status == "429":
            return "lost", "rejected"
        if out.status and out.status != "200":
            return "lost", "http_error"
        if out.problem.startswith("in-band error"):
            return "lost", "error"
        return "lost", "incomplete" if out.status == "200" else "error"
    if len(out.token_ids) != max_tokens:
        return "lost", "incomplete"
    return "ok", None


def _record(rec: RequestRecord, out: Outcome, max_tokens: int) -> None:
    rec.status, rec.lost_reason = _classify(out, max_tokens)
    rec.problem, rec.http_status, rec.timing = out.problem, out.status, out.timing
    rec.output_tokens = len(out.token_ids)
    rec.ttft_s = out.ttft_s
    if len(out.token_times) > 1:
        rec.tpot_s = (out.token_times[-1] - out.token_times[0]) / (len(out.token_times) - 1)


async def run_cell(base_url: str, spec: CellSpec, prompts: list[tuple[int, bytes]], *, max_tokens: int,
                   path: str = "/v1/completions", headers: dict | None = None,
                   allow_remote: bool = False, transport: Any = None) -> list[RequestRecord]:
    """Run one cell: request ``i`` sends ``prompts[i % len(prompts)]`` (``(prompt length,
    JSON body bytes)``, a streaming body asking for exactly ``max_tokens`` tokens) at its
    arrival time. Returns one record per request of ``spec.requests``, sent or not.
    ``transport``: an httpx transport instead of the network (tests)."""
    import httpx

    check_loopback(base_url, allow_remote)
    if not prompts:
        raise ValueError("prompts: expected at least one (prompt length, body) pair")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    arrivals = poisson_arrivals(spec.rate, spec.requests, spec.seed)
    records = [RequestRecord(i, prompts[i % len(prompts)][0], at) for i, at in enumerate(arrivals)]
    limits = httpx.Limits(max_connections=spec.requests, max_keepalive_connections=spec.requests)
    timeout = httpx.Timeout(spec.request_timeout_s, connect=min(30.0, spec.request_timeout_s))
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, transport=transport) as client:
        start = time.monotonic()

        async def one(rec: RequestRecord, body: bytes) -> None:
            out = Outcome(rec.index, "http_stream", rec.prompt_len, max_tokens, ok=False)
            t0 = time.monotonic()
            rec.sent_s = t0 - start
            try:
                await asyncio.wait_for(http_completion(client, path, body, headers or {}, True, out, t0),
                                       spec.request_timeout_s)
                _record(rec, out, max_tokens)
            except asyncio.TimeoutError:
                _record(rec, out, max_tokens)
                rec.status, rec.lost_reason = "lost", "timeout"
                rec.problem = f"no complete answer within request_timeout_s={spec.request_timeout_s}"
            except asyncio.CancelledError:
                _record(rec, out, max_tokens)
                rec.status, rec.lost_reason = "lost", "cut"
                rec.problem = f"still running {spec.cell_seconds + spec.drain_seconds:.0f} s after the cell started"
                raise
            except Exception as exc:  # noqa: BLE001 - transport errors are lost requests
                _record(rec, out, max_tokens)
                rec.status, rec.lost_reason = "lost", "error"
                rec.problem = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                rec.finished_s = time.monotonic() - start
                rec.latency_s = rec.finished_s - rec.sent_s

        for rec in records:
            if rec.scheduled_s > spec.cell_seconds:
                break  # this one and every later arrival: not sent
            delay = start + rec.scheduled_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(rec, prompts[rec.index % len(prompts)][1])))
        if tasks:
            left = start + spec.cell_seconds + spec.drain_seconds - time.monotonic()
            _, pending = await asyncio.wait(tasks, timeout=max(left, 0.0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return records


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _censored_percentile(values: list[tuple[float, bool]], q: float) -> tuple[float | None, bool]:
    """Percentile of (value, censored) pairs; a censored value is a lower bound (a request cut
    or timed out before its first token: its TTFT is more than the time it waited). Returns
    the value and whether it is such a lower bound."""
    if not values:
        return None, False
    xs = sorted(values)  # ties: the uncensored value first
    k = min(len(xs) - 1, max(0, int(round(q / 100.0 * (len(xs) - 1)))))
    return xs[k]


def summarize(records: list[RequestRecord], spec: CellSpec) -> dict:
    """The cell's metrics (see the module docstring). Throughput is over the busy time: from
    the start to the last completion (the cell's bound if nothing completed).

    ``ttft_p50_s``/``ttft_p99_s`` are over completed requests; an overloaded service completes
    its short, early requests first, so these flatter it. ``ttft_p50_sent_s``/``ttft_p99_sent_s``
    are over every sent request, those that never saw a first token counted at the time they
    waited: then the percentile is a lower bound (``ttft_sent_lower_bound``)."""
    sent = [r for r in records if r.sent_s is not None]
    ok = [r for r in sent if r.status == "ok"]
    lost = [r for r in sent if r.status == "lost"]
    busy = max((r.finished_s for r in ok), default=spec.cell_seconds + spec.drain_seconds) or 1e-9
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    tokens = sum(r.output_tokens for r in ok)
    cached = sum(int(r.timing.get("cached_tokens") or 0) for r in ok if isinstance(r.timing, dict))
    server: dict[str, Any] = {}
    for key in BREAKDOWN:
        vals = [float(r.timing[key]) for r in ok if r.timing and r.timing.get(key) is not None]
        server[key] = _median(vals)
    other = [float(r.timing["ttft_s"]) - sum(float(r.timing.get(k) or 0.0) for k in ("queue_s", "prefill_s", "export_s"))
             for r in ok if r.timing and r.timing.get("ttft_s") is not None]
    server["other_s"] = _median(other)  # ingress, routing, messaging: TTFT not in the three above
    by_length: dict[int, dict] = {}
    for n in sorted({r.prompt_len for r in ok}):
        xs = [r.ttft_s for r in ok if r.prompt_len == n and r.ttft_s is not None]
        by_length[n] = {"completed": len(xs), "ttft_p50_s": _median(xs)}
    waited = [(r.ttft_s, False) if r.ttft_s is not None else (r.latency_s or 0.0, True) for r in sent]
    p50_sent, p50_bound = _censored_percentile(waited, 50)
    p99_sent, p99_bound = _censored_percentile(waited, 99)
    last_send = max((r.sent_s for r in sent), default=0.0)
    return {
        "rate": spec.rate, "requests": spec.requests, "sent": len(sent), "not_sent": len(records) - len(sent),
        "completed": len(ok), "lost": len(lost),
        "lost_by_reason": {reason: sum(r.lost_reason == reason for r in lost) for reason in LOST_REASONS
                           if any(r.lost_reason == reason for r in lost)},
        "offered_rps": len(sent) / last_send if last_send > 0 else None,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "ttft_p50_sent_s": p50_sent, "ttft_p99_sent_s": p99_sent,
        "ttft_sent_lower_bound": {"p50": p50_bound, "p99": p99_bound},
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "output_tokens": tokens, "busy_s": busy, "cached_prompt_tokens": cached,
        "output_tokens_per_s": tokens / busy, "requests_per_s": len(ok) / busy,
        "server_median_s": server, "ttft_p50_by_prompt_len": by_length,
        "problems": sorted({r.problem for r in lost if r.problem})[:10],
    }


def records_to_json(records: list[RequestRecord]) -> list[dict]:
    return [asdict(r) for r in records]


__all__ = ["CellSpec", "RequestRecord", "BREAKDOWN", "LOST_REASONS", "poisson_arrivals", "check_loopback",
           "run_cell", "summarize", "records_to_json"]
