"""The KV channel's own work around the NCCL transfer, on one GPU: gather a request's pages into
a staging buffer, its checksum, scatter into a receiving pool (``kv_transfer.channel``). Whole
requests here; the channel now does the same a chunk of layers at a time, overlapped with the
transfer (bench_kv_transfer reports one chunk's times).

Why: on two H200s the channel moved 96.7 GB/s at 128K tokens while NCCL alone moved 370 GB/s
(BENCHMARKS.md); this isolates the rest. Rows per size (tokens of a Llama-3.1-8B-shaped request:
32 layers, 8 KV heads, d=128, bf16, 64-token pages, pages scattered over the pool):
``gather`` (``gather_pages``: integer-word views), ``gather_bytes`` (the same copy through
``uint8`` views, as before ca2e23c), ``checksum`` (``payload_checksum``), ``scatter``
(``scatter_pages``), each in ms and GB/s of payload.

    PYTHONPATH=$PWD python3 benchmarks/bench_kv_pack.py            # GPU, 8K..128K, ~1 min
    PYTHONPATH=$PWD python3 benchmarks/bench_kv_pack.py --cpu-smoke # CPU, tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

from kv_cache import KVPool, KVPoolConfig  # noqa: E402
from kv_transfer.channel.pages import gather_pages, payload_checksum, scatter_pages  # noqa: E402

GEOMETRY = dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64)


def gather_bytes(pool: KVPool, pages: list[int]) -> torch.Tensor:
    """The byte-view gather (the comparison): one index computation per byte."""
    k, v = pool.k.view(torch.uint8), pool.v.view(torch.uint8)
    out = torch.empty((2, k.shape[0], len(pages), *k.shape[2:]), dtype=torch.uint8, device=pool.device)
    index = torch.tensor(pages, dtype=torch.long, device=pool.device)
    for part, src in enumerate((k, v)):
        torch.index_select(src, 1, index, out=out[part])
    return out.view(-1)


def timed(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of ``fn`` (after one warm-up)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run(tokens_list: list[int], geometry: dict, device: torch.device, iters: int, dtype: torch.dtype) -> list[dict]:
    page_size = geometry["page_size"]
    most = max(tokens_list)
    pages_needed = -(-most // page_size)
    cfg = KVPoolConfig(**geometry, dtype=dtype, device=str(device), num_pages=2 * pages_needed)
    src, dst = KVPool(cfg), KVPool(cfg)
    torch.manual_seed(0)
    src.k.normal_()
    src.v.normal_()
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for tokens in tokens_list:
        n = -(-tokens // page_size)
        perm = torch.randperm(src.num_pages, generator=gen)
        pages, back = perm[:n].tolist(), perm[n : 2 * n].tolist()
        payload = gather_pages(src, pages)
        assert torch.equal(payload, gather_bytes(src, pages)), "word and byte gathers differ"
        scatter_pages(dst, back, payload)
        assert torch.equal(gather_pages(dst, back), payload), "scatter did not invert gather"
        nbytes = payload.numel()
        row = {"tokens": tokens, "mib": nbytes / 2**20}
        for name, fn in (("gather", lambda: gather_pages(src, pages)),
                         ("gather_bytes", lambda: gather_bytes(src, pages)),
                         ("checksum", lambda: payload_checksum(payload)),
                         ("scatter", lambda: scatter_pages(dst, back, payload))):
            ms = timed(fn, device, iters)
            row[f"{name}_ms"] = ms
            row[f"{name}_gbps"] = nbytes / ms / 1e6
        rows.append(row)
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        payload = None  # frees it before the next size (the timing lambdas close over the name)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny geometry on CPU")
    ap.add_argument("--tokens", type=str, default="8192,32768,131072")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        device, geometry, tokens = torch.device("cpu"), dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16), [40, 100]
        out = args.out or Path("/tmp/kv_pack_cpu.json")
    else:
        device, geometry = torch.device("cuda"), GEOMETRY
        tokens = [int(x) for x in args.tokens.split(",") if x]
        out = args.out or ROOT / "benchmarks/results/kv_pack_h200.json"
    rows = run(tokens, geometry, device, args.iters, torch.bfloat16)
    env = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "commit": git_commit(), "geometry": geometry,
           "command": "python3 benchmarks/bench_kv_pack.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    head = f"{'tokens':>7} {'MiB':>7} | {'gather':>7} {'bytes':>7} {'csum':>7} {'scatter':>7}   (ms; GB/s below)"
    print(head)
    for r in rows:
        print(f"{r['tokens']:>7} {r['mib']:>7.0f} | {r['gather_ms']:>7.2f} {r['gather_bytes_ms']:>7.2f} "
              f"{r['checksum_ms']:>7.2f} {r['scatter_ms']:>7.2f}")
        print(f"{'':>7} {'':>7} | {r['gather_gbps']:>7.0f} {r['gather_bytes_gbps']:>7.0f} "
              f"{r['checksum_gbps']:>7.0f} {r['scatter_gbps']:>7.0f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
