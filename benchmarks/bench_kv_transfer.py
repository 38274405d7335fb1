"""KV transfer between two GPUs: our channel transport and the object store against the link.

One request's KV pages of a Llama-3.1-8B-shaped model (32 layers, 8 KV heads, head_dim 128,
bf16, 64-token pages: 128 KiB per token) at 4K ... 128K tokens, moved between two Ray actors
pinned to one GPU each (``num_gpus=1``), as a prefill and a decode replica would:

(a) the link, two baselines: a ``cuda:0 -> cuda:1`` copy of the same byte count in this
    process (peer-to-peer over NVLink), and a raw NCCL send/recv of one contiguous buffer
    between the two actors (a 2-rank process group built as our channels build theirs, no
    gather, checksum or scatter);
(b) the channel (``ChannelSender`` -> ``ChannelReceiver``) end to end: the header through Ray, the decode side reserves pages
    and calls the sender back, then chunk by chunk (``--chunk-mib`` of whole layers through
    ``--ring-depth`` buffers per side, pipelined): gather on GPU 0, checksum, NCCL send/recv,
    checksum, scatter into the decode pool on GPU 1;
(c) ``ObjectStoreTransport`` end to end between the same actors (device -> host, CRC-32,
    ``ray.put``, ``ray.get``, CRC-32, host -> device).

GB/s are decimal (1e9 bytes/s) over the payload bytes (whole pages, K and V); (b) and (c)
are also given as a fraction of (a). Medians after warm-up. Every size is checked bit for
bit once (the decode pool's pages against the prefill pool's). The JSON's channel detail
adds the chunking and one chunk's gather + checksum and checksum + scatter times, measured
alone on the sender's GPU: the pipeline's fill and drain around the wire time.

Usage, from the repository root on the 2-GPU machine (``NCCL_NVLS_ENABLE=0`` stays set;
this script forces it to 0 for itself and the actors)::

    PYTHONPATH=$PWD python benchmarks/bench_kv_transfer.py            # ~2-3 min
    PYTHONPATH=$PWD python benchmarks/bench_kv_transfer.py --quick    # 4K and 32K, < 1 min

writes ``benchmarks/results/kv_transfer_h200x2.json`` (``..._quick.json`` with --quick).
``--cpu-smoke`` runs the same code over gloo with tiny sizes (a CPU test runs it). The whole
run is bounded by ``--budget-s``: what does not fit is skipped and said so in the JSON.
The commit comes from ``GIT_COMMIT`` when set (the GPU host may have no git).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from evals.report import git_commit  # noqa: E402

import torch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class BenchConfig:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    dtype: str = "bfloat16"
    tokens: tuple[int, ...] = (4096, 16384, 32768, 65536, 131072)
    warmup: int = 2
    iters: int = 5
    object_store_iters: int = 2  # 1 above 16K tokens: a 16 GiB frame takes tens of seconds
    budget_s: float = 170.0
    device: str = "cuda"
    chunk_bytes: int = 256 << 20  # ChannelConfig of both actors
    ring_depth: int = 3

    @property
    def token_bytes(self) -> int:
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def payload_bytes(self, tokens: int) -> int:
        pages = -(-tokens // self.page_size)
        return pages * self.page_size * self.token_bytes


QUICK = dict(tokens=(4096, 32768), warmup=1, iters=3, object_store_iters=1, budget_s=90.0)
CPU_SMOKE = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype="float32", tokens=(64, 1000),
                 warmup=1, iters=2, object_store_iters=1, budget_s=120.0, device="cpu",
                 chunk_bytes=1, ring_depth=2)  # one layer per chunk: the smoke run goes through the ring


@dataclass
class Measure:
    ms: float | None = None  # median
    gbps: float | None = None
    all_ms: list[float] = field(default_factory=list)
    detail: dict = field(default_factory=dict)  # per-side medians (export, receive, ...)
    skipped: str | None = None


@dataclass
class SizeResult:
    tokens: int
    payload_bytes: int
    peer_copy: Measure
    raw_p2p: Measure
    channel: Measure
    object_store: Measure
    bit_exact: dict = field(default_factory=dict)
    channel_vs_copy: float | None = None
    channel_vs_raw: float | None = None
    object_store_vs_copy: float | None = None


def _measure(times_s: list[float], nbytes: int, **detail) -> Measure:
    ms = [t * 1e3 for t in times_s]
    med = statistics.median(ms)
    return Measure(ms=med, gbps=nbytes / (med / 1e3) / 1e9 if med > 0 else None, all_ms=ms, detail=detail)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- the actors
def _endpoint_class():
    import ray

    @ray.remote
    class KVEndpoint:
        """A prefill-like (sender) or decode-like (receiver) replica: one pool, both transports."""

        def __init__(self, cfg: dict, num_pages: int, name: str, all_gpus_visible: bool) -> None:
            from kv_cache import KVPool, KVPoolConfig
            from kv_transfer.channel.recv import ChannelReceiver
            from kv_transfer.channel.send import ChannelSender
            from kv_transfer.channel.config import ChannelConfig
            from kv_transfer.transfer import ObjectStoreTransport

            self.cfg = BenchConfig(**cfg)
            if self.cfg.device == "cuda":
                index = int(ray.get_gpu_ids()[0]) if all_gpus_visible else 0
                device = torch.device("cuda", index)
                torch.cuda.set_device(device)
            else:
                device = torch.device("cpu")
            self.device = device
            self.pool = KVPool(KVPoolConfig(
                num_layers=self.cfg.num_layers, num_kv_heads=self.cfg.num_kv_heads, head_dim=self.cfg.head_dim,
                page_size=self.cfg.page_size, dtype=getattr(torch, self.cfg.dtype), device=device, num_pages=num_pages,
            ))
            g = torch.Generator(device=device).manual_seed(1234 if name == "prefill" else 99)
            for t in (self.pool.k, self.pool.v):  # random bytes everywhere: nothing arrives by luck
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                        device=device, generator=g))
            slow = ChannelConfig(connect_timeout_s=60.0, transfer_timeout_s=30.0, min_bytes_per_s=1e9,
                                 chunk_bytes=self.cfg.chunk_bytes, ring_depth=self.cfg.ring_depth)
            host = ray.util.get_node_ip_address()
            # this endpoint's end of the channel: it exports and sends as "prefill", receives as "decode"
            self.channels = (ChannelSender(device, host=host, identity={"replica_id": name}, config=slow)
                             if name == "prefill" else
                             ChannelReceiver(device, host=host, identity={"replica_id": name},
                                             call_sender=self._call_peer, config=slow))
            self.object_store = ObjectStoreTransport(fetch_timeout_s=300.0)
            self.peer = None
            self._raw: dict = {}
            _sync(device)

        def info(self) -> dict:
            out = {"device": str(self.device), "pid": os.getpid(),
                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
            if self.device.type == "cuda":
                out["gpu"] = torch.cuda.get_device_name(self.device)
            return out

        def set_peer(self, peer) -> None:
            self.peer = peer

        async def _call_peer(self, sender: dict, request):
            return await self.peer.serve_send.remote(request)

        async def serve_send(self, request):  # kv_transfer.wire.SendPages -> SendReply
            return await self.channels.serve_send(request)

        def hold(self, rid: str, tokens: int) -> None:
            self.pool.reserve(rid, tokens)
            self.pool.set_seq_len(rid, tokens)

        def release(self, rid: str) -> int:
            return self.pool.release(rid)

        def export(self, rid: str, transport: str):
            t0 = time.perf_counter()
            ticket = (self.channels if transport == "channel" else self.object_store).export(self.pool, rid)
            _sync(self.device)
            return ticket, time.perf_counter() - t0

        async def receive(self, ticket) -> float:
            t0 = time.perf_counter()
            receiver = self.channels if ticket.transport == self.channels.name else self.object_store
            await receiver.receive(ticket, self.pool)
            _sync(self.device)
            return time.perf_counter() - t0

        def chunk_phases(self, rid: str, iters: int) -> dict:
            """The chunking of ``rid``'s transfer and one (first, largest) chunk's gather + checksum
            and checksum + scatter, each alone on this device (median ms). The scatter writes the
            gathered bytes back into the same pages: the pool is unchanged."""
            from kv_transfer.channel.pages import chunk_layers, gather_pages, payload_checksum, scatter_pages

            pool, pages = self.pool, self.pool.pages(rid)
            layer_bytes = 2 * len(pages) * pool.page_size * pool.num_kv_heads * pool.head_dim * pool.k.element_size()
            per = self.channels.config.layers_per_chunk(pool.num_layers, layer_bytes)
            plan = chunk_layers(pool.num_layers, per)
            buf = torch.empty(per * layer_bytes, dtype=torch.uint8, device=self.device)
            index = torch.tensor(pages, dtype=torch.long, device=self.device)

            def timed(fn) -> float:
                times = []
                for _ in range(iters + 1):  # the first is a warm-up
                    _sync(self.device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(self.device)
                    times.append((time.perf_counter() - t0) * 1e3)
                return statistics.median(times[1:])

            gather = timed(lambda: payload_checksum(gather_pages(pool, index, plan[0], out=buf)))
            chunk = buf[: (plan[0][1] - plan[0][0]) * layer_bytes]
            scatter = timed(lambda: (payload_checksum(chunk), scatter_pages(pool, index, chunk, plan[0])))
            return {"chunks": len(plan), "chunk_mib": per * layer_bytes / 2**20,
                    "ring_depth": self.channels.config.ring_depth, "chunk_gather_ms": gather, "chunk_scatter_ms": scatter}

        def page_checksum(self, rid: str) -> int:
            from kv_transfer.channel.pages import gather_pages, payload_checksum

            return payload_checksum(gather_pages(self.pool, self.pool.pages(rid)))

        def counters(self) -> dict:
            return self.channels.counters()

        # -- raw send/recv of one contiguous buffer over a 2-rank group of our own
        def raw_store(self) -> tuple[str, int]:
            """Host the raw group's store here (as a decode replica hosts its channels')."""
            from torch.distributed import TCPStore

            host = ray.util.get_node_ip_address()
            self._raw["store"] = TCPStore(host, 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
            return host, int(self._raw["store"].port)

        def raw_run(self, rank: int, nbytes: int, warmup: int, iters: int, store_addr: tuple) -> list[float]:
            from kv_transfer.channel.process_group import Channel

            ch = self._raw.get("channel")
            if ch is None:
                ch = Channel(self.channels.backend, rank=rank, prefix="fpkv/raw/0/1/", generation=1,
                             host=ray.util.get_node_ip_address(), device=self.device, connect_timeout_s=60.0,
                             store_addr=(store_addr[0], int(store_addr[1])))
                ch.run(torch.zeros(8, dtype=torch.uint8, device=self.device), timeout_s=120.0)  # open + warm
                self._raw["channel"] = ch
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            times = []
            for i in range(warmup + iters):
                _sync(self.device)
                t0 = time.perf_counter()
                work = ch.pg.send([buf], 1, 0) if rank == 0 else ch.pg.recv([buf], 0, 0)
                work.wait()
                _sync(self.device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            del buf
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return times

        def close(self) -> None:
            self.channels.close()
            ch = self._raw.pop("channel", None)
            if ch is not None:
                ch.abort()

    return KVEndpoint


# ---------------------------------------------------------------------------- the run
class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def peer_copy(cfg: BenchConfig, nbytes_list: list[int], budget: Budget) -> dict[int, Measure]:
    """(a) in this process: cuda:0 -> cuda:1 (CPU smoke: a host memcpy)."""
    out: dict[int, Measure] = {}
    if cfg.device == "cuda":
        if torch.cuda.device_count() < 2:
            return {n: Measure(skipped="fewer than 2 GPUs visible to the driver") for n in nbytes_list}
        src_dev, dst_dev = torch.device("cuda", 0), torch.device("cuda", 1)
    else:
        src_dev = dst_dev = torch.device("cpu")
    biggest = max(nbytes_list)
    src = torch.empty(biggest, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(biggest, dtype=torch.uint8, device=dst_dev)
    for n in nbytes_list:
        if budget.left() < 20:
            out[n] = Measure(skipped="time budget")
            continue
        times = []
        for i in range(cfg.warmup + cfg.iters):
            _sync(src_dev), _sync(dst_dev)
            t0 = time.perf_counter()
            dst[:n].copy_(src[:n], non_blocking=True)
            _sync(dst_dev), _sync(src_dev)
            if i >= cfg.warmup:
                times.append(time.perf_counter() - t0)
        out[n] = _measure(times, n)
    del src, dst
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
    return out


def environment(cfg: BenchConfig, args: argparse.Namespace, endpoints: list[dict]) -> dict:
    import ray

    commit = git_commit()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "command": "PYTHONPATH=$PWD python " + " ".join(["benchmarks/bench_kv_transfer.py", *sys.argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "cuda": torch.version.cuda,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        "all_gpus_visible": bool(args.all_gpus_visible),
        "endpoints": endpoints,
    }
    if cfg.device == "cuda" and torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        if torch.cuda.device_count() >= 2:
            env["p2p_0_to_1"] = torch.cuda.can_device_access_peer(0, 1)
    return env


def run_sizes(cfg: BenchConfig, sender, receiver, copies: dict[int, Measure], budget: Budget,
              results: list[SizeResult], flush) -> None:
    import ray

    store_addr = ray.get(receiver.raw_store.remote())
    os_rate: float | None = None  # seconds per byte of the object store, from the last size
    for tokens in cfg.tokens:
        nbytes = cfg.payload_bytes(tokens)
        res = SizeResult(tokens, nbytes, copies[nbytes], Measure(), Measure(), Measure())
        results.append(res)
        rid = f"req-{tokens}"
        timeout = max(budget.left(), 30.0)
        # (a) raw send/recv
        if budget.left() < 15:
            res.raw_p2p.skipped = "time budget"
        else:
            recv_ref = receiver.raw_run.remote(1, nbytes, cfg.warmup, cfg.iters, store_addr)
            send_ref = sender.raw_run.remote(0, nbytes, cfg.warmup, cfg.iters, store_addr)
            recv_t, _ = ray.get([recv_ref, send_ref], timeout=timeout)
            res.raw_p2p = _measure(recv_t, nbytes)
        ray.get(sender.hold.remote(rid, tokens))
        # (b) the channel transport
        if budget.left() < 15:
            res.channel.skipped = "time budget"
        else:
            times, exports, receives = [], [], []
            for i in range(cfg.warmup + cfg.iters):
                t0 = time.perf_counter()
                ticket, export_s = ray.get(sender.export.remote(rid, "channel"), timeout=timeout)
                receive_s = ray.get(receiver.receive.remote(ticket), timeout=timeout)
                elapsed = time.perf_counter() - t0
                if i == 0:
                    res.bit_exact["channel"] = ray.get(sender.page_checksum.remote(rid)) == ray.get(
                        receiver.page_checksum.remote(rid))
                ray.get(receiver.release.remote(rid))
                if i >= cfg.warmup:
                    times.append(elapsed), exports.append(export_s * 1e3), receives.append(receive_s * 1e3)
            res.channel = _measure(times, nbytes, export_ms=statistics.median(exports),
                                   receive_ms=statistics.median(receives),
                                   **ray.get(sender.chunk_phases.remote(rid, cfg.iters), timeout=timeout))
        # (c) the object store: slow for big frames, so bounded by what is left
        iters = cfg.object_store_iters if tokens <= 16384 else 1
        warmup = 1 if tokens == cfg.tokens[0] else 0
        predicted = (os_rate or 0.0) * nbytes * (iters + warmup)
        if budget.left() - predicted < 10:
            res.object_store.skipped = f"time budget (predicted {predicted:.0f}s, {budget.left():.0f}s left)"
        else:
            times, exports, receives = [], [], []
            for i in range(warmup + iters):
                t0 = time.perf_counter()
                ticket, export_s = ray.get(sender.export.remote(rid, "object_store"), timeout=timeout)
                receive_s = ray.get(receiver.receive.remote(ticket), timeout=timeout)
                elapsed = time.perf_counter() - t0
                del ticket  # frees the frame
                if i == 0:
                    res.bit_exact["object_store"] = ray.get(sender.page_checksum.remote(rid)) == ray.get(
                        receiver.page_checksum.remote(rid))
                ray.get(receiver.release.remote(rid))
                if i >= warmup:
                    times.append(elapsed), exports.append(export_s * 1e3), receives.append(receive_s * 1e3)
            res.object_store = _measure(times, nbytes, export_ms=statistics.median(exports),
                                        receive_ms=statistics.median(receives))
            os_rate = statistics.median(times) / nbytes
        ray.get(sender.release.remote(rid))
        base_copy, base_raw = res.peer_copy.gbps, res.raw_p2p.gbps
        if res.channel.gbps and base_copy:
            res.channel_vs_copy = res.channel.gbps / base_copy
        if res.channel.gbps and base_raw:
            res.channel_vs_raw = res.channel.gbps / base_raw
        if res.object_store.gbps and base_copy:
            res.object_store_vs_copy = res.object_store.gbps / base_copy
        print_row(res, flush=True)
        flush()


def _fmt(m: Measure) -> str:
    return f"{m.gbps:8.1f}" if m.gbps is not None else f"{'skip' if m.skipped else '-':>8}"


def _ratio(x: float | None) -> str:
    return f"{x:6.2f}" if x is not None else f"{'-':>6}"


# GB/s: copy = peer copy in one process (a), sendrecv = raw send/recv between the actors (a),
# channel = ChannelSender -> ChannelReceiver end to end (b), objstore = ObjectStoreTransport end to end (c)
HEADER = (f"{'tokens':>7} {'MiB':>7} | {'copy':>8} {'sendrecv':>8} | {'channel':>8} {'/copy':>6} {'/s-r':>6} "
          f"{'exp ms':>7} {'rcv ms':>7} | {'objstore':>8} {'/copy':>6} | bit-exact")


def print_row(r: SizeResult, flush: bool = False) -> None:
    ch, os_ = r.channel, r.object_store
    print(f"{r.tokens:>7} {r.payload_bytes / 2**20:7.0f} | {_fmt(r.peer_copy)} {_fmt(r.raw_p2p)} | {_fmt(ch)} "
          f"{_ratio(r.channel_vs_copy)} {_ratio(r.channel_vs_raw)} {ch.detail.get('export_ms', float('nan')):7.1f} "
          f"{ch.detail.get('receive_ms', float('nan')):7.1f} | {_fmt(os_)} {_ratio(r.object_store_vs_copy)} | "
          f"{r.bit_exact}", flush=flush)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4K and 32K tokens, fewer iterations (< 1 min)")
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, tiny sizes: checks the script runs")
    ap.add_argument("--budget-s", type=float, default=None, help="bound on the whole run (default 170, quick 90)")
    ap.add_argument("--chunk-mib", type=float, default=None,
                    help="channel chunk target in MiB (default 256; at least one layer of the request)")
    ap.add_argument("--ring-depth", type=int, default=None, help="channel staging buffers per side (default 3)")
    ap.add_argument("--all-gpus-visible", action="store_true",
                    help="diagnostic: actors see both GPUs (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    overrides = dict(CPU_SMOKE) if args.cpu_smoke else (dict(QUICK) if args.quick else {})
    if args.budget_s is not None:
        overrides["budget_s"] = args.budget_s
    if args.chunk_mib is not None:
        overrides["chunk_bytes"] = max(1, int(args.chunk_mib * 2**20))
    if args.ring_depth is not None:
        overrides["ring_depth"] = args.ring_depth
    cfg = BenchConfig(**overrides)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_kv_transfer: no CUDA GPU here; use --cpu-smoke on CPU")
    out = args.out or RESULTS / ("kv_transfer_cpu_smoke.json" if args.cpu_smoke else
                                 "kv_transfer_h200x2_quick.json" if args.quick else "kv_transfer_h200x2.json")
    budget = Budget(cfg.budget_s)
    if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
        print(f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} -> 0 (NVLink multicast stays off)", flush=True)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if args.all_gpus_visible:
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    from router.launcher import prepare_environment  # PYTHONPATH for the actors, no Ray auth locally

    prepare_environment()

    # a hung run still leaves its partial JSON behind and ends
    def watchdog() -> None:
        time.sleep(cfg.budget_s + 90)
        print(f"bench_kv_transfer: still running {cfg.budget_s + 90:.0f}s after start; giving up", flush=True)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()

    sizes = [cfg.payload_bytes(t) for t in cfg.tokens]
    print(f"config: {asdict(cfg)}", flush=True)
    copies = peer_copy(cfg, sizes, budget)

    import ray

    gpus = 2 if cfg.device == "cuda" else 0
    ray.init(address="local", num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=True,
             logging_level="WARNING", _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0",
                                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]}})
    results: list[SizeResult] = []
    payload: dict = {"config": asdict(cfg), "results": results, "notes": []}

    def flush() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        payload["elapsed_s"] = round(time.monotonic() - started, 1)
        out.write_text(json.dumps(payload, indent=1, default=lambda o: asdict(o)) + "\n")

    endpoint = _endpoint_class()
    num_pages = -(-max(cfg.tokens) // cfg.page_size) + 1
    opts = {"num_gpus": 1, "num_cpus": 1} if cfg.device == "cuda" else {"num_cpus": 1}
    sender = endpoint.options(**opts).remote(asdict(cfg), num_pages, "prefill", args.all_gpus_visible)
    receiver = endpoint.options(**opts).remote(asdict(cfg), num_pages, "decode", args.all_gpus_visible)
    try:
        ray.get([sender.set_peer.remote(receiver), receiver.set_peer.remote(sender)], timeout=max(budget.left(), 60))
        infos = ray.get([sender.info.remote(), receiver.info.remote()])
        payload["env"] = environment(cfg, args, infos)
        print(f"env: {payload['env']}", flush=True)
        print(HEADER, flush=True)
        run_sizes(cfg, sender, receiver, copies, budget, results, flush)
        payload["counters"] = {"prefill": ray.get(sender.counters.remote()), "decode": ray.get(receiver.counters.remote())}
    except Exception as exc:  # keep what was measured
        payload["notes"].append(f"run ended early: {type(exc).__name__}: {exc}")
        print(f"run ended early: {exc!r}", flush=True)
    finally:
        for actor in (sender, receiver):
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(actor)
        flush()
        ray.shutdown()
    print("\n" + HEADER)
    for r in results:
        print_row(r)
    print(f"\nwrote {out} ({time.monotonic() - started:.0f}s)")
    ok = results and all(all(r.bit_exact.values()) for r in results) and not payload["notes"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
