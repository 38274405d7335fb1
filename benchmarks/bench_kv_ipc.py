"""KV transfer between two processes on one GPU over CUDA IPC, against the GPU's own copy rate.

A prefill and a decode replica that share a GPU (the default placement on a one-GPU machine)
move a request's KV pages over CUDA IPC (``CudaIpcSender`` -> ``CudaIpcReceiver``): the decode
side maps the prefill pool and copies the pages device to device (``kv_transfer/cuda_ipc/``). This
measures, for one request of a Llama-3.1-8B-shaped model (32 layers, 8 KV heads, head_dim 128,
bf16, 64-token pages: 128 KiB a token) at each length:

(a) ``memcpy``: one contiguous device-to-device copy of the same byte count in this process,
    the ceiling for any copy on this GPU (each byte read once and written once);
(b) ``copy_pages``: the IPC path's copy routine between two pools in this process (the same
    integer word, ``pool_page_words``), fragmented page lists, no IPC: gather into a temporary,
    scatter out (each byte read twice, written twice), ``copy_chunk_bytes`` at a time;
(c) ``ipc``: ``CudaIpcReceiver.receive`` end to end in this process of a ticket exported by a
    sender process (spawned): ticket checks, page reservation, the mapping (opened once per
    sender storage, then cached, as in a replica), the copy on a side stream, the sync.

GB/s are decimal (1e9 bytes/s) over the payload bytes (whole pages, K and V); (b) and (c) are
also given as a fraction of (a). Medians of ``--repeats`` runs after one warm-up run. Every
length is checked once: per-layer sums of the received pages' words against the sender's.

Usage, from the repository root on a GPU machine (no Ray needed)::

    PYTHONPATH=$PWD python3 benchmarks/bench_kv_ipc.py            # 4K, 32K, 128K; ~1 min
    PYTHONPATH=$PWD python3 benchmarks/bench_kv_ipc.py --quick    # 4K and 32K

writes ``benchmarks/results/kv_ipc_h200.json`` (``--out`` to change it). ``--cpu-smoke`` (CI):
(a) and (b) between two CPU pools of a small geometry, checked the same way; (c) needs CUDA and
is recorded as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

import torch  # noqa: E402

from kv_cache import KVPool, KVPoolConfig  # noqa: E402
from kv_cache.tensors import pool_page_words  # noqa: E402
from kv_transfer.cuda_ipc.common import copy_pages  # noqa: E402
from kv_transfer.cuda_ipc.recv import CudaIpcReceiver  # noqa: E402
from kv_transfer.cuda_ipc.send import CudaIpcSender  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 64}
SMOKE_GEOMETRY = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "page_size": 16}
DEFAULT_LENGTHS = (4096, 32768, 131072)
QUICK_LENGTHS = (4096, 32768)


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"4096,32768"`` -> (4096, 32768): positive token counts, distinct."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"lengths: expected comma-separated token counts, got {text!r}") from None
    if not out or any(n < 1 for n in out) or len(set(out)) != len(out):
        raise ValueError(f"lengths: expected distinct token counts >= 1, got {text!r}")
    return out


def make_pool(num_tokens: int, device: str, geometry: dict = GEOMETRY) -> KVPool:
    """A bf16 pool with room for ``num_tokens`` plus 64 spare pages (the fragmentation below)."""
    pages = -(-num_tokens // geometry["page_size"]) + 64
    return KVPool(KVPoolConfig(**geometry, dtype=torch.bfloat16, num_pages=pages, device=device))


def fragmented_request(pool: KVPool, rid: str, num_tokens: int) -> list[int]:
    """Reserve ``num_tokens`` for ``rid`` over a free list with holes: 64 one-page requests,
    every other one released first, so the request's pages are not one run."""
    ps = pool.page_size
    fillers = [f"_f{i}" for i in range(64)]
    for f in fillers:
        pool.reserve(f, ps)
    for f in fillers[::2]:
        pool.release(f)
    pool.reserve(rid, num_tokens)
    pool.set_seq_len(rid, num_tokens)
    for f in fillers[1::2]:
        pool.release(f)
    return pool.pages(rid)


def page_sums(pool: KVPool, pages: list[int]) -> list[int]:
    """Per layer, K then V: the sum of the pages' 16-bit words (one layer at a time)."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.device)
    out = []
    for t in (pool.k, pool.v):
        for layer in range(t.shape[0]):
            out.append(int(t[layer].index_select(0, idx).view(torch.int16).sum(dtype=torch.int64)))
    return out


def payload_bytes(pool: KVPool, num_pages: int) -> int:
    return 2 * pool.num_layers * num_pages * pool.page_size * pool.num_kv_heads * pool.head_dim * pool.k.element_size()


def _median_s(fn, repeats: int, sync) -> tuple[float, list[float]]:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _sender(conn, lengths: tuple[int, ...], device: str) -> None:
    """Child process: one pool per length, random bf16 K/V, a fragmented request, its ticket and
    page sums; stays alive (the pools must) until told."""
    try:
        transport = CudaIpcSender(identity={"replica_id": "bench-prefill"}, lease_timeout_s=3600.0)
        pools, out = [], []
        for n in lengths:
            pool = make_pool(n, device)
            pool.k.normal_()
            pool.v.normal_()
            pages = fragmented_request(pool, f"r{n}", n)
            torch.cuda.synchronize()
            out.append((n, transport.export(pool, f"r{n}"), page_sums(pool, pages)))
            pools.append(pool)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which fails the run)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("tickets", out))
    conn.recv()
    transport.close()


def run(lengths: tuple[int, ...], repeats: int, device: str = "cuda:0") -> dict:
    sync = torch.cuda.synchronize
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, lengths, device), daemon=True)
    proc.start()
    child.close()
    receiver = CudaIpcReceiver(identity={"replica_id": "bench-decode"})
    loop = asyncio.new_event_loop()  # one loop, as a replica has
    rows = []
    try:
        if not parent.poll(600):
            raise RuntimeError("the sender process sent no tickets within 600 s")
        kind, payload = parent.recv()
        if kind != "tickets":
            raise RuntimeError(f"the sender process failed: {payload}")
        for n, ticket, want in payload:
            dst = make_pool(n, device)
            dst.reserve("_other", 7 * dst.page_size)  # the receiver's page ids differ from the sender's
            nbytes = payload_bytes(dst, ticket.num_pages)

            # (c) IPC receive, end to end; checked once
            pages = loop.run_until_complete(receiver.receive(ticket, dst))
            ok = page_sums(dst, pages) == want
            dst.release(ticket.request_id)

            def receive():
                loop.run_until_complete(receiver.receive(ticket, dst))
                dst.release(ticket.request_id)

            ipc_s, ipc_runs = _median_s(receive, repeats, sync)

            # (b) the same copy routine between two pools of this process
            src = make_pool(n, device)
            src_pages = torch.tensor(fragmented_request(src, "r", n), dtype=torch.long, device=device)
            dst.reserve("r", n)
            dst_pages = torch.tensor(dst.pages("r"), dtype=torch.long, device=device)
            src_words, dst_words = pool_page_words(src), pool_page_words(dst)  # the word the receive picks

            def local_copy():
                for a, b in zip(src_words, dst_words):
                    copy_pages(a, b, src_pages, dst_pages, receiver.copy_chunk_bytes)

            copy_s, copy_runs = _median_s(local_copy, repeats, sync)
            del src, src_words, dst_words
            dst.release("r")

            # (a) one contiguous copy of the same bytes
            a = torch.empty(nbytes, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            memcpy_s, memcpy_runs = _median_s(lambda: b.copy_(a), repeats, sync)
            del a, b, dst
            torch.cuda.empty_cache()

            rows.append({
                "tokens": n, "pages": ticket.num_pages, "bytes": nbytes, "check": "ok" if ok else "MISMATCH",
                "memcpy_ms": memcpy_s * 1e3, "memcpy_gbps": nbytes / memcpy_s / 1e9,
                "copy_pages_ms": copy_s * 1e3, "copy_pages_gbps": nbytes / copy_s / 1e9,
                "ipc_ms": ipc_s * 1e3, "ipc_gbps": nbytes / ipc_s / 1e9,
                "copy_pages_of_memcpy": memcpy_s / copy_s, "ipc_of_memcpy": memcpy_s / ipc_s,
                "runs_ms": {"memcpy": [t * 1e3 for t in memcpy_runs], "copy_pages": [t * 1e3 for t in copy_runs],
                            "ipc": [t * 1e3 for t in ipc_runs]},
            })
            print(format_row(rows[-1]), flush=True)
        counters = receiver.counters()
    finally:
        receiver.close()
        loop.close()
        try:
            parent.send("done")
        except (BrokenPipeError, OSError):
            pass
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return {"rows": rows, "receiver_counters": counters}


def run_local(lengths: tuple[int, ...], repeats: int, device: str = "cpu",
              geometry: dict = SMOKE_GEOMETRY) -> dict:
    """(a) and (b) only, both pools in this process (no IPC: a CPU run); (b) checked by the
    page sums of what it copied. Chunks of two pages of one layer, so the copy walks many."""
    rows = []
    page_layer_bytes = geometry["page_size"] * geometry["num_kv_heads"] * geometry["head_dim"] * 2
    chunk_bytes = 2 * page_layer_bytes
    for n in lengths:
        src = make_pool(n, device, geometry)
        src.k.normal_()
        src.v.normal_()
        src_ids = fragmented_request(src, "r", n)
        dst = make_pool(n, device, geometry)
        dst.reserve("_other", 7 * dst.page_size)  # the receiver's page ids differ from the sender's
        dst.reserve("r", n)
        dst_ids = dst.pages("r")
        nbytes = payload_bytes(dst, len(dst_ids))
        src_pages = torch.tensor(src_ids, dtype=torch.long, device=device)
        dst_pages = torch.tensor(dst_ids, dtype=torch.long, device=device)
        src_words, dst_words = pool_page_words(src), pool_page_words(dst)

        def local_copy():
            for a, b in zip(src_words, dst_words):
                copy_pages(a, b, src_pages, dst_pages, chunk_bytes)

        copy_s, copy_runs = _median_s(local_copy, repeats, lambda: None)
        ok = page_sums(dst, dst_ids) == page_sums(src, src_ids)
        a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        memcpy_s, memcpy_runs = _median_s(lambda: b.copy_(a), repeats, lambda: None)
        rows.append({
            "tokens": n, "pages": len(dst_ids), "bytes": nbytes, "check": "ok" if ok else "MISMATCH",
            "memcpy_ms": memcpy_s * 1e3, "memcpy_gbps": nbytes / memcpy_s / 1e9,
            "copy_pages_ms": copy_s * 1e3, "copy_pages_gbps": nbytes / copy_s / 1e9,
            "ipc_ms": None, "ipc_gbps": None, "copy_pages_of_memcpy": memcpy_s / copy_s, "ipc_of_memcpy": None,
            "ipc": "skipped: needs CUDA",
            "runs_ms": {"memcpy": [t * 1e3 for t in memcpy_runs], "copy_pages": [t * 1e3 for t in copy_runs]},
        })
        print(format_row(rows[-1]), flush=True)
    return {"rows": rows, "receiver_counters": None}


HEADER = (f"{'tokens':>7} {'GB':>6} | {'memcpy ms':>9} {'GB/s':>6} | {'copy_pages ms':>13} {'GB/s':>6} {'x mc':>5} | "
          f"{'ipc ms':>7} {'GB/s':>6} {'x mc':>5} | check")


def format_row(r: dict) -> str:
    ipc = (f"{r['ipc_ms']:>7.2f} {r['ipc_gbps']:>6.0f} {r['ipc_of_memcpy']:>5.2f}" if r["ipc_ms"] is not None
           else f"{'-':>7} {'-':>6} {'-':>5}")
    return (f"{r['tokens']:>7} {r['bytes'] / 1e9:>6.2f} | {r['memcpy_ms']:>9.2f} {r['memcpy_gbps']:>6.0f} | "
            f"{r['copy_pages_ms']:>13.2f} {r['copy_pages_gbps']:>6.0f} {r['copy_pages_of_memcpy']:>5.2f} | "
            f"{ipc} | {r['check']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4K and 32K tokens")
    ap.add_argument("--lengths", default=None, help="comma-separated token counts (default 4096,32768,131072)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement, after one warm-up")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU: the in-process copy and memcpy at a small geometry, no IPC (default --lengths 100,300)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_ipc_h200.json")
    args = ap.parse_args(argv)
    if args.cpu_smoke and not args.lengths:
        args.lengths = "100,300"
    try:
        lengths = parse_lengths(args.lengths) if args.lengths else (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1:
        ap.error(f"--repeats: expected an int >= 1, got {args.repeats}")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_kv_ipc needs a CUDA GPU (CUDA IPC; --cpu-smoke for the CPU smoke run)", file=sys.stderr)
        return 2
    env = {
        "gpu": "cpu" if args.cpu_smoke else torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": "PYTHONPATH=$PWD python3 benchmarks/bench_kv_ipc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(env)
    print(HEADER)
    t0 = time.time()
    result = run_local(lengths, args.repeats) if args.cpu_smoke else run(lengths, args.repeats)
    geometry = SMOKE_GEOMETRY if args.cpu_smoke else GEOMETRY
    out = {"benchmark": "KV transfer over CUDA IPC between two processes on one GPU (kv_transfer/cuda_ipc/)",
           "env": env, "geometry": {**geometry, "dtype": "bfloat16"}, "repeats": args.repeats,
           "timing": f"median of {args.repeats} runs after one warm-up run", **result, "wall_s": time.time() - t0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    bad = [r["tokens"] for r in result["rows"] if r["check"] != "ok"]
    if bad:
        print(f"received pages differ from the sender's at {bad} tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
