"""A TP=2 group driven in lockstep (model_executor/parallel.py LockstepRunner): the prefill and
decode engines (one scheduler, one set of decisions per step) on the leader rank, a follower rank
replaying every step over a pipe, both in a gloo group; outputs equal the TP=1 engines'; both
pools end empty; a follower killed mid-prefill fails the leader with RankFailed (no hang)."""

from __future__ import annotations

import datetime
import multiprocessing
import os

import pytest
import torch

from decode_worker.engine import DecodeEngine
from kernels.config import SparseConfig
from model_executor import ModelRunner, SamplingParams, parallel
from model_executor.loading import build_tiny_model, make_pool
from prefill_worker.engine import PrefillEngine, PrefillRequest

SPARSE = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64)
PAGE = 16


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    base = torch.randint(0, 256, (150,), generator=g).tolist()
    # the second prompt shares the first one's first 128 tokens (whole pages and query tiles): a prefix-cache hit
    return [base, base[:128] + torch.randint(0, 256, (30,), generator=g).tolist(),
            torch.randint(0, 256, (21,), generator=g).tolist()]


def serve(runner) -> dict:
    """Prefill (chunked, prefix cache) and greedy decode of ``prompts()`` through the engines."""
    prefill = PrefillEngine(runner, chunk_size=64, prefix_cache=True)
    decode = DecodeEngine(runner, max_running=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    out = {"first": [], "cached": [], "tokens": []}
    reqs = []
    for i, p in enumerate(prompts()):  # one at a time: the second finds the first's pages cached
        (res,) = prefill.prefill([PrefillRequest(f"r{i}", p, params)])
        out["first"].append(res.first_token)
        out["cached"].append(res.cached_tokens)
        reqs.append((res, decode))
    states = [decode.add_request(r.request_id, r.kv_len, r.first_token, params) for r, _ in reqs]
    # prompt logprobs at a request's own alpha (the runner's prefill_keeping), then n = 2 seeded
    # choices forked over one copy of the pages (KVPool.fork on every rank)
    seeded = (SamplingParams(temperature=1.0, seed=3, max_new_tokens=6),
              SamplingParams(temperature=1.0, seed=4, max_new_tokens=6))
    (res,) = prefill.prefill([PrefillRequest("g", prompts()[0][:70], SamplingParams(temperature=0.0, prompt_logprobs=0),
                                             sparse_alpha=0.5, choices=seeded)])
    out["prompt_logprobs"] = [round(e.logprob, 4) for e in res.prompt_logprobs[1:]]
    states += decode.add_group("g", res.kv_len, [(f"g#{k}", tok, p) for k, (tok, p) in
                                                 enumerate(zip(res.first_tokens, seeded))])
    decode.run_until_done()
    out["tokens"] = [list(s.output_ids) for s in states]
    runner.pool.clear_prefix_cache()
    out["used_pages"] = runner.pool.used_pages
    return out


def make_runner(tp):
    loaded = build_tiny_model(num_layers=2, seed=5)
    if tp is not None:
        parallel.shard_model(loaded.model, tp)
    return ModelRunner(loaded.model, make_pool(loaded, num_pages=48, page_size=PAGE), SPARSE, dense_below=100)


class PipeLink(parallel.RankLink):
    def __init__(self, conn) -> None:
        self.conn = conn

    def submit(self, command):
        try:
            self.conn.send(command)
        except (BrokenPipeError, OSError) as exc:
            raise parallel.RankFailed(f"rank 1 is gone: {exc}") from None

    def wait(self, handle) -> None:
        try:
            status = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise parallel.RankFailed(f"rank 1 is gone: {exc!r}") from None
        if status != "ok":
            raise parallel.RankFailed(f"rank 1: {status}")


def _rank(rank: int, init_file: str, conn, out: str, die: bool) -> None:
    from torch.distributed import FileStore, ProcessGroupGloo

    torch.set_num_threads(1)
    # a group built on a store, no default group (as a replica next to its channels' groups)
    opts = ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=30)
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    tp = parallel.TensorParallel.from_group(ProcessGroupGloo(FileStore(init_file, 2), rank, 2, opts))
    runner = make_runner(tp)
    if rank == 1:  # the follower: replays the leader's commands until told to stop
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if die and cmd[1] == "prefill" and any(it.request_id == "last" for it in cmd[2][0]):
                os._exit(3)  # killed mid-prefill: the leader is inside the same forward
            try:
                parallel.run_command(runner, cmd)
                conn.send("ok")
            except Exception as exc:  # noqa: BLE001 - reported to the leader
                conn.send(f"{type(exc).__name__}: {exc}")
        conn.send(runner.pool.used_pages)
        return
    lock = parallel.LockstepRunner(runner, [PipeLink(conn)])
    result = serve(lock)
    bad = lock.pool.reserve  # a leader-side refusal is not replayed: the follower stays in step
    with pytest.raises(ValueError):
        bad("x", -1)
    with pytest.raises(ValueError):  # validation fails on both ranks alike, no forward runs
        lock.prefill([parallel_item("nope", [1, 2])])
    result["again"] = serve(lock)  # still in step after the refusals
    died = None
    try:
        lock.ensure_capacity("last", 40)
        lock.prefill([parallel_item("last", list(range(40)))])
    except parallel.RankFailed as exc:
        died = str(exc)
    result["died"] = died
    if died is None:
        conn.send("stop")
        result["follower_pages"] = conn.recv()
    torch.save(result, os.path.join(out, "leader.pt"))
    os._exit(0)  # the group's peer may be dead: no orderly teardown


def parallel_item(rid, ids):
    from model_executor import PrefillItem

    return PrefillItem(rid, ids)


def run_group(tmp_path, die: bool):
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), conn, str(tmp_path), die))
             for r, conn in ((0, a), (1, b))]
    for p in procs:
        p.start()
    a.close(), b.close()  # the children hold the ends: a dead rank is EOF for its peer
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes, torch.load(tmp_path / "leader.pt")


def test_lockstep_engines_equal_tp1_and_leave_no_page(tmp_path):
    codes, got = run_group(tmp_path, die=False)
    assert codes == [0, 0]
    want = serve(make_runner(None))
    for key in ("first", "cached", "tokens"):
        assert got[key] == want[key] == got["again"][key], key
    assert got["prompt_logprobs"] == pytest.approx(want["prompt_logprobs"], abs=2e-3)
    assert len(want["tokens"]) == 5 and want["tokens"][3] != want["tokens"][4]  # the two seeded choices
    assert want["cached"][1] == 128  # the prefix cache was used
    assert got["used_pages"] == 0 and got["died"] is None
    assert got["follower_pages"] == 40 // PAGE + 1  # only the last request ("last") still holds pages


def test_a_follower_killed_mid_prefill_fails_the_leader(tmp_path):
    codes, got = run_group(tmp_path, die=True)  # the follower dies on the prefill of "last"
    assert codes == [0, 3]
    assert got["died"] is not None and "rank 1" in got["died"]
    assert got["tokens"] == got["again"]["tokens"]


def test_the_lockstep_runner_public_api_for_transfers():
    """What the TP transports use instead of the runner's private parts: ``leader`` (rank 0's
    own runner), ``report_failure`` (a rank call outside a step fails the replica as a step
    would) and ``keep_alive``."""
    from types import SimpleNamespace

    class Link(parallel.RankLink):
        def submit(self, command):
            return None

        def wait(self, handle) -> None:
            raise parallel.RankFailed("rank 1: gone")

    runner = SimpleNamespace(pool=SimpleNamespace(num_pages=4), model="m", ensure_capacity=lambda rid, n: None)
    failures = []
    lock = parallel.LockstepRunner(runner, [Link()], on_failure=failures.append)
    assert lock.leader is runner and lock.model == "m"
    dead = parallel.RankFailed("TP rank 1: channel receive")
    lock.report_failure(dead)
    assert failures == [dead]
    with pytest.raises(parallel.RankFailed, match="gone"):  # a step's failure takes the same path
        lock.ensure_capacity("r", 3)
    assert len(failures) == 2 and str(failures[1]) == "rank 1: gone"
    quiet = parallel.LockstepRunner(runner, [])
    quiet.report_failure(dead)  # no on_failure: nothing to tell
    import gc
    import weakref

    class Store:
        pass

    store = Store()
    held = weakref.ref(store)
    quiet.keep_alive(store)
    del store
    gc.collect()
    assert held() is not None  # the rendezvous lives as long as the runner
    del quiet
    gc.collect()
    assert held() is None
