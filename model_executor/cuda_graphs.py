"""Decode steps replayed from CUDA graphs, one graph per batch size (as vLLM and SGLang do).

A decode step of the 8B model launches ~800 kernels (GEMMs, fused norms and RoPE, the pool
write and our paged decode kernel for each of 32 layers) for ~3.5 ms of GPU work; launched one
by one from Python it takes ~25 ms on the H200 (BENCHMARKS.md, "Model prefill and decode"): the
host is the bottleneck. A CUDA graph holds the whole step (embedding, every layer, the LM head)
and replays it with one launch.

Each graph is captured over static device buffers (token ids, positions, KV slots, KV lengths,
the page table); a step copies its metadata into them and replays the graph of the smallest
captured batch size that holds it. Rows past the real batch repeat row 0 (same token, position,
pages and slot): they write row 0's K/V to row 0's own slot again, with the same values, and
their logits are dropped, so no page is set aside for padding.

Fixed per graph: the batch size, the page table's width (``max_seqlen`` / page size columns) and
the decode kernel's split count (chosen for ``max_seqlen``; the kernel divides each sequence's
keys over the splits, so any length up to ``max_seqlen`` is attended exactly). A step that needs
more (a bigger batch, a longer sequence) runs eagerly; ``stats`` counts both.

Capture borrows pages of the pool and gives them back: one for its own dummy step, and a few
others on which each graph is then replayed with fresh probe inputs (distinct lengths over
several pages, random tokens and positions) and compared with the same step run eagerly (a page
table, length, slot or position the capture baked in instead of reading from the buffers would
show there).

``capture=False`` builds the same buffers and padding and runs the step eagerly through them, with
no graph: what the CPU tests check, and a way to tell a graph problem from a padding one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import ForwardBatch, ForwardMode

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
CAPTURE_ID = "__decode_graph_capture__"
PROBE_ID = "__decode_graph_probe__"
WARMUP_RUNS = 2  # eager runs before each capture: Triton compiles, cuBLAS picks its kernels
# a graph must reproduce the eager step; the only differences allowed are the rounding of
# kernels that may pick another reduction order between runs (relative to the logits' scale)
CHECK_RTOL = 2e-2


def check_batch_sizes(batch_sizes: object) -> tuple[int, ...]:
    """Distinct ints >= 1, returned sorted."""
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise ValueError(f"batch_sizes: expected a non-empty sequence of ints >= 1, got {batch_sizes!r}")
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"batch_sizes: expected ints >= 1, got {b!r} in {list(batch_sizes)}")
    if len(set(batch_sizes)) != len(batch_sizes):
        raise ValueError(f"batch_sizes: expected distinct sizes, got {list(batch_sizes)}")
    return tuple(sorted(batch_sizes))


class DecodeGraphs:
    """CUDA graphs of ``runner``'s decode step (see the module doc).

    max_seqlen: the longest sequence (KV tokens, the new one included) a graph step serves.
    batch_sizes: the batch sizes captured; a batch of ``B`` runs in the smallest ``>= B``.
    capture: ``True`` captures CUDA graphs (needs a CUDA runner); ``False`` runs the same
        buffers and padding eagerly (no graph).
    """

    def __init__(self, runner, *, max_seqlen: int, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 capture: bool = True) -> None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
            raise ValueError(f"max_seqlen: expected an int >= 1, got {max_seqlen!r}")
        self.batch_sizes = check_batch_sizes(batch_sizes)
        if not isinstance(capture, bool):
            raise ValueError(f"capture: expected a bool, got {capture!r}")
        if capture and runner.device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA runner, this one runs on {runner.device} "
                             "(capture=False runs the padded step without graphs)")
        self.runner = runner
        self.pool = runner.pool
        self.capture = capture
        self.page_size = runner.page_size
        self.max_pages = -(-max_seqlen // self.page_size)
        self.max_seqlen = self.max_pages * self.page_size  # what the decode splits are chosen for
        n, dev = self.batch_sizes[-1], runner.device
        self._i64 = torch.zeros(3, n, dtype=torch.int64, device=dev)  # token ids, positions, slots
        self._ids, self._pos, self._slots = self._i64[0], self._i64[1], self._i64[2]
        self._seqlens = torch.ones(n, dtype=torch.int32, device=dev)
        self._page_table = torch.zeros(n, self.max_pages, dtype=torch.int32, device=dev)
        self._cu = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one new token per sequence
        # CUDA: a step's metadata goes through pinned host buffers, copied without a host sync;
        # an event says when the last step's copies have read them
        self._staged = None
        self._copied: torch.cuda.Event | None = None
        if dev.type == "cuda":
            self._staged = (torch.zeros(3, n, dtype=torch.int64, pin_memory=True),
                            torch.ones(n, dtype=torch.int32, pin_memory=True),
                            torch.zeros(n, self.max_pages, dtype=torch.int32, pin_memory=True))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.stats = {"graph_steps": 0, "eager_steps": 0}
        if capture:
            self._capture_all()

    # -- a step ---------------------------------------------------------------------------
    def bucket(self, batch: int) -> int | None:
        """The captured batch size a batch of ``batch`` runs in (``None``: none holds it)."""
        for b in self.batch_sizes:
            if b >= batch:
                return b
        return None

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            pool=self.pool, page_table=self._page_table[:bs], cu_seqlens_q=self._cu[: bs + 1],
            seqlens_kv=self._seqlens[:bs], slots=self._slots[:bs], mode=ForwardMode.DECODE,
            sparse_config=self.runner.sparse_config, max_seqlen_kv=self.max_seqlen,
            backend=self.runner.backend,
        )

    def _step(self, bs: int) -> torch.Tensor:
        return self.runner.run_model(self._batch(bs), self._ids[:bs], self._pos[:bs], 0)

    def _fill(self, bs: int, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
              seqlens: torch.Tensor, table: torch.Tensor) -> None:
        """Host tensors of the real rows into the static buffers, rows past them repeating row 0."""
        pad = bs - ids.shape[0]

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x[:1].expand(pad, *x.shape[1:])]) if pad else x

        if self._staged is None:  # CPU: the static buffers are host memory
            self._i64[:, :bs].copy_(torch.stack([padded(ids), padded(pos), padded(slots)]))
            self._seqlens[:bs].copy_(padded(seqlens))
            self._page_table[:bs, : table.shape[1]].copy_(padded(table))
            return
        h64, hseq, htable = self._staged
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies are done with the staging buffers
        for row, x in enumerate((ids, pos, slots)):
            h64[row, :bs].copy_(padded(x))
        hseq[:bs].copy_(padded(seqlens))
        htable[:bs, : table.shape[1]].copy_(padded(table))
        # contiguous slices only (a strided host source would be staged through pageable memory);
        # the table's columns past this step's are stale and never read
        for row, dst in enumerate((self._ids, self._pos, self._slots)):
            dst[:bs].copy_(h64[row, :bs], non_blocking=True)
        self._seqlens[:bs].copy_(hseq[:bs], non_blocking=True)
        self._page_table[:bs].copy_(htable[:bs], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def run(self, request_ids: Sequence[str], token_ids: torch.Tensor, starts: Sequence[int]) -> torch.Tensor | None:
        """One decode step of ``request_ids`` (their newest tokens ``token_ids``, int64 host, at
        positions ``starts``, pages reserved for ``start + 1``): float32 logits ``[B, V]``, or
        ``None`` when no graph holds the batch (the caller runs it eagerly). Validation is the
        caller's (``ModelRunner.decode``); the caller advances ``seq_len``."""
        batch = len(request_ids)
        bs = self.bucket(batch)
        if bs is None or max(starts) + 1 > self.max_seqlen:
            self.stats["eager_steps"] += 1
            return None
        pos = torch.as_tensor(list(starts), dtype=torch.int64)
        need = -(-(int(pos.max()) + 1) // self.page_size)  # page-table columns any row reads
        table = self.pool.page_table(request_ids, device="cpu")[:, :need]
        slots = self.pool.slot_mapping(request_ids, starts, [1] * batch, device="cpu")
        self._fill(bs, token_ids.to("cpu", torch.int64), pos, slots, (pos + 1).to(torch.int32), table)
        if self.capture:
            self._graphs[bs].replay()
            out = self._outputs[bs]
        else:
            out = self._step(bs)
        self.stats["graph_steps"] += 1
        return out[:batch].clone()  # the graph's output is overwritten by the next replay

    # -- capture ----------------------------------------------------------------------------
    def probe_pages(self) -> int:
        """Pages ``verify`` needs: every probe row ends on a slot of its own, over at least two pages."""
        return max(2, -(-self.batch_sizes[-1] // self.page_size))

    def _capture_all(self) -> None:
        pool = self.pool
        need = 1 + self.probe_pages()
        if pool.free_pages < need:
            raise ValueError(f"pool: capturing and checking decode graphs needs {need} free pages (a dummy step's "
                             f"and the probes'), {pool.free_pages} are free")
        pool.reserve(CAPTURE_ID, self.page_size)
        pool.reserve(PROBE_ID, (need - 1) * self.page_size)
        try:
            page = pool.pages(CAPTURE_ID)[0]
            # the dummy step: every row the first slot of the capture's page (the probes use others)
            self._page_table.fill_(page)
            self._slots.fill_(page * self.page_size)
            self._seqlens.fill_(1)
            self._ids.fill_(0)
            self._pos.fill_(0)
            with torch.cuda.device(self.runner.device):
                mem = torch.cuda.graph_pool_handle()
                side = torch.cuda.Stream(self.runner.device)
                side.wait_stream(torch.cuda.current_stream(self.runner.device))
                for bs in reversed(self.batch_sizes):  # largest first: the smaller ones reuse its memory
                    with torch.cuda.stream(side):
                        for _ in range(WARMUP_RUNS):
                            self._step(bs)
                    torch.cuda.current_stream(self.runner.device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=mem, capture_error_mode="thread_local"):
                        self._outputs[bs] = self._step(bs)
                    self._graphs[bs] = graph
                torch.cuda.synchronize(self.runner.device)
                self.verify(pool.pages(PROBE_ID))
        finally:
            pool.release(CAPTURE_ID)
            pool.release(PROBE_ID)

    def verify(self, pages: Sequence[int], *, seed: int = 0) -> None:
        """Replay every graph on probe inputs unlike the capture's and compare with the same step
        run eagerly; ValueError naming the batch size on a mismatch. The probe: ``pages`` (other
        than the capture's; at least ``probe_pages()``) filled with random K/V and laid end to end
        as every row's sequence, each row a distinct length (so its new token has a slot of its
        own: the writes do not race) spread over all the pages, with random tokens and positions.
        A page table, length, slot or position the capture baked in would show."""
        if len(pages) < self.probe_pages():
            raise ValueError(f"pages: expected at least {self.probe_pages()} probe pages, got {len(pages)}")
        gen = torch.Generator().manual_seed(seed)
        pool, ps, dev = self.pool, self.page_size, self.runner.device
        table = torch.tensor(list(pages), dtype=torch.int32)
        flat = (table.to(torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)  # slots in sequence order
        dtype = next(self.runner.model.parameters()).dtype  # what the model hands the pool (FP8 quantizes)
        shape = (flat.numel(), pool.num_kv_heads, pool.head_dim)
        for layer in range(pool.num_layers):
            k = torch.randn(shape, generator=gen).to(dev, dtype)
            v = torch.randn(shape, generator=gen).to(dev, dtype)
            pool.write(layer, flat.to(dev), k, v)
        vocab = self.runner.vocab_size
        for bs in self.batch_sizes:
            lens = torch.randperm(flat.numel(), generator=gen)[:bs] + 1  # distinct: distinct last slots
            ids = torch.randint(0, vocab, (bs,), generator=gen)
            pos = torch.randint(0, self.max_seqlen, (bs,), generator=gen)
            self._fill(bs, ids, pos, flat[lens - 1], lens.to(torch.int32), table.expand(bs, -1))
            if self.capture:
                self._graphs[bs].replay()
                got = self._outputs[bs].clone()
            else:
                got = self._step(bs)
            want = self._step(bs)
            scale = float(want.abs().max()) + 1.0
            err = float((got - want).abs().max())
            if not err <= CHECK_RTOL * scale:
                raise ValueError(f"batch_sizes: the decode graph of batch size {bs} does not reproduce the eager "
                                 f"step (max |graph - eager| = {err:.3g}, logits up to {scale - 1:.3g})")


def graph_batch_sizes(max_running: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes of ``sizes`` a decode replica running at most ``max_running`` requests needs: those
    below it and the first one that holds it."""
    if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
        raise ValueError(f"max_running: expected an int >= 1, got {max_running!r}")
    sizes = check_batch_sizes(sizes)
    keep = [b for b in sizes if b < max_running]
    top = next((b for b in sizes if b >= max_running), None)
    return tuple(keep + [top]) if top is not None else tuple(keep)

