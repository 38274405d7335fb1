"""Shared test inputs: random varlen paged batches with fixed seeds; a fake of Ray's metric classes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged import paginate


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqlens_kv: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.page_table, self.cu_seqlens_q, self.seqlens_kv)


def make_batch(
    seqlens_q: list[int],
    prefixes: list[int],
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    needles: int = 0,
    needle_gain: float = 16.0,
    block_size: int = 64,
) -> PagedBatch:
    """Random q/k/v; ``needles`` random key blocks per sequence get keys aligned with the
    mean query direction so that thresholding keeps them and prunes the rest."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seqlens_q)
    q = torch.randn(total, num_qo_heads, head_dim, generator=g)
    direction = torch.randn(num_kv_heads, head_dim, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    if needles:
        q = q + 1.5 * direction.repeat_interleave(num_qo_heads // num_kv_heads, 0)[None]
    keys, values = [], []
    for lq, p in zip(seqlens_q, prefixes):
        n = lq + p
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        if needles and n > block_size:
            nblocks = -(-n // block_size)
            picks = torch.randperm(nblocks, generator=g)[:needles]
            for blk in picks.tolist():
                k[blk * block_size : (blk + 1) * block_size] += needle_gain * direction
        keys.append(k)
        values.append(torch.randn(n, num_kv_heads, head_dim, generator=g))
    perm_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    k_pages, table = paginate([x.to(dtype) for x in keys], page_size, generator=torch.Generator().manual_seed(perm_seed), spare_pages=2)
    v_pages, table_v = paginate([x.to(dtype) for x in values], page_size, generator=torch.Generator().manual_seed(perm_seed), spare_pages=2)
    assert torch.equal(table, table_v)
    cu = torch.zeros(len(seqlens_q) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seqlens_q, dtype=torch.int32).cumsum(0)
    skv = torch.tensor([a + b for a, b in zip(seqlens_q, prefixes)], dtype=torch.int32)
    return PagedBatch(
        q.to(dtype).to(device), k_pages.to(device), v_pages.to(device), table.to(device),
        cu.to(device), skv.to(device), keys, values,
    )


def spread_inputs(seqlens_q, prefixes, *, g, hkv, d, page_size, dtype, seed, spread, block_size):
    """A random varlen paged batch whose block energies spread over the threshold, on the CPU:
    ``(q, k_pages, v_pages, page_table, cu_seqlens_q, seqlens_kv)``.

    Queries lean along one direction per KV head; every key block gets that direction with a
    random gain, so block scores differ by up to ``spread`` nats and the energy ratios are
    spread over roughly ``[e^-spread, 1]``, on both sides of alpha = 0.1. Pages are shuffled and
    unused slots hold NaN (``paginate``)."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(hkv, d, generator=gen)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    q = torch.randn(sum(seqlens_q), g * hkv, d, generator=gen) + direction.repeat_interleave(g, 0)
    keys, values = [], []
    for lq, prefix in zip(seqlens_q, prefixes):
        n = lq + prefix
        gain = spread * d**0.5 * torch.rand(-(-n // block_size), hkv, 1, generator=gen)
        keys.append(torch.randn(n, hkv, d, generator=gen) + gain.repeat_interleave(block_size, 0)[:n] * direction)
        values.append(torch.randn(n, hkv, d, generator=gen))
    k_pages, table = paginate([x.to(dtype) for x in keys], page_size, spare_pages=2,
                              generator=torch.Generator().manual_seed(seed + 1))
    v_pages, _ = paginate([x.to(dtype) for x in values], page_size, spare_pages=2,
                          generator=torch.Generator().manual_seed(seed + 1))
    cu = torch.zeros(len(seqlens_q) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seqlens_q, dtype=torch.int32).cumsum(0)
    seqlens_kv = torch.tensor([a + b for a, b in zip(seqlens_q, prefixes)], dtype=torch.int32)
    return q.to(dtype), k_pages, v_pages, table, cu, seqlens_kv


def poison_empty(monkeypatch, module) -> None:
    """Make ``module._empty`` (the allocator a kernel wrapper uses for outputs and split
    partials) fill floating-point tensors with NaN, so any element a kernel leaves unwritten
    shows in the comparison."""
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, device=device, **kw)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(module, "_empty", empty)


# ----------------------------------------------------------------- metrics
class FakeMetric:
    def __init__(self, name, *, description, tag_keys=None, boundaries=None):
        self.name, self.description, self.tag_keys, self.boundaries = name, description, tag_keys, boundaries
        self.calls = []

    def inc(self, value, tags=None):
        self.calls.append(("inc", value, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def observe(self, value, tags=None):
        self.calls.append(("observe", value, tags))


class FakeMetricsBackend:
    """``ray.serve.metrics``' three classes; remembers every metric made."""

    def __init__(self):
        self.made = {}

        def factory(name, **kw):
            assert name not in self.made, f"{name} created twice"
            self.made[name] = FakeMetric(name, **kw)
            return self.made[name]

        self.Counter = self.Gauge = self.Histogram = factory

    def calls(self, name):
        from serving.metrics import PREFIX

        return self.made[PREFIX + name].calls


def _gloo_rank(rank: int, world: int, init_file: str, out_dir: str, work, args: tuple) -> None:
    """One spawned rank of :func:`run_tp_ranks`: a gloo group over ``init_file``, then
    ``work(rank, tp, *args)`` saved to ``out_dir/rank<rank>.pt``."""
    import os

    import torch.distributed as dist

    from model_executor import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tp = parallel.TensorParallel.from_group(dist.group.WORLD)
        torch.save(work(rank, tp, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_tp_ranks(work, world: int, tmp, *args, timeout_s: float = 600.0) -> list:
    """``world`` spawned processes in one gloo group (a tensor-parallel model's ranks on the
    CPU), each running ``work(rank, tp, *args)`` (a module-level function: spawn pickles it by
    name) with its ``model_executor.parallel.TensorParallel``; their results in rank order.
    Fails naming the exit codes when a rank dies or outlives ``timeout_s``."""
    import multiprocessing
    from pathlib import Path

    tmp = Path(tmp)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, str(tmp / "init"), str(tmp), work, args))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * world, f"rank exit codes {codes}"
    return [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
