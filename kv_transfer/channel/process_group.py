"""One end of a channel: the 2-rank process group a sender (rank 0) and a receiver (rank 1)
build for themselves on the receiver's store (see ``kv_transfer.channel``), its posted sends and
receives, their deadlines, and its abort. ``torch.distributed``'s default group is never used.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from .pages import _device_guard

logger = logging.getLogger(__name__)

CHANNEL_BACKENDS = {"cuda": "nccl", "cpu": "gloo"}  # pool device type -> process-group backend
SENDER, RECEIVER = 0, 1
# NCCL's own watchdog: far beyond our deadlines (we abort first), only a last resort.
_NCCL_WATCHDOG_S = 600.0


class ChannelBroken(RuntimeError):
    """The channel was closed (by us, after a failure elsewhere) while an operation used it."""


def _nccl_error_handling_default() -> None:
    # Training jobs want a hung collective to take the process down (the default, 3); a
    # server whose peers come and go wants the communicator aborted and the replica alive.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class Channel:
    """One end of a pair's process group. Rank 0 sends, rank 1 (whose replica hosts the store
    at ``store_addr``) receives. ``run`` and ``abort`` block: call them from a worker thread.

    Each end opens its own client connection to the store: a rendezvous blocked on one
    channel (a peer that never comes) must not hold up the other channels of that store."""

    def __init__(self, backend: str, *, rank: int, prefix: str, generation: int, host: str,
                 device: torch.device, connect_timeout_s: float, store_addr: tuple[str, int]) -> None:
        if backend not in CHANNEL_BACKENDS.values():
            raise ValueError(f"backend: expected one of {sorted(CHANNEL_BACKENDS.values())}, got {backend!r}")
        if rank not in (SENDER, RECEIVER):
            raise ValueError(f"rank: expected {SENDER} (sender) or {RECEIVER} (receiver), got {rank!r}")
        if (not isinstance(store_addr, tuple) or len(store_addr) != 2 or not isinstance(store_addr[0], str)
                or not isinstance(store_addr[1], int)):
            raise ValueError(f"store_addr: expected (host, port) of the receiver's store, got {store_addr!r}")
        self.backend = backend
        self.rank = rank
        self.prefix = prefix
        self.generation = generation
        self.host = host
        self.device = device
        self.connect_timeout_s = connect_timeout_s
        self._store: Any = None  # our client connection to the store
        self._store_addr = store_addr
        self.pg: Any = None
        self.broken = False
        self._abort_lock = threading.Lock()
        self._aborted_pg: Any = None
        self.lock = threading.Lock()  # one transfer at a time over this channel
        self.last_used = time.monotonic()
        self.transfers = 0

    def __repr__(self) -> str:
        state = "broken" if self.broken else ("open" if self.pg is not None else "new")
        return f"Channel({self.backend}, rank={self.rank}, {self.prefix!r}, {state})"

    def _open(self) -> None:
        from torch.distributed import PrefixStore, TCPStore

        timeout = datetime.timedelta(seconds=self.connect_timeout_s)
        if self._store is None:
            host, port = self._store_addr
            self._store = TCPStore(host, port, None, False, timeout)  # connects, bounded by timeout
        store = PrefixStore(self.prefix, self._store)
        if self.backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
            pg = ProcessGroupGloo(store, self.rank, 2, opts)  # the rendezvous: waits for the peer
        else:
            if not torch.distributed.is_nccl_available():
                raise ChannelBroken("this torch build has no NCCL")
            _nccl_error_handling_default()
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=max(_NCCL_WATCHDOG_S, 4 * self.connect_timeout_s))
            opts.is_high_priority_stream = False
            if hasattr(opts, "group_name"):  # for NCCL's logs; unique per end (a test may hold both)
                opts.group_name = f"{self.prefix}rank{self.rank}"
            pg = ProcessGroupNCCL(store, self.rank, 2, opts)  # lazy: the communicator comes with the first op
        if self.broken:  # closed while we were connecting
            _abort_pg(pg)
            raise ChannelBroken(f"{self.prefix} was closed while it opened")
        self.pg = pg

    def open(self) -> None:
        """Blocking: build this end's process group if not yet done (the rendezvous with the peer)."""
        if self.broken:
            raise ChannelBroken(f"{self.prefix} is closed")
        if self.pg is None:
            with _device_guard(self.device):
                self._open()

    def post(self, tensor: torch.Tensor, tag: int = 0) -> "_Op":
        """Start sending (rank 0) or receiving (rank 1) ``tensor``. NCCL runs it after the work
        queued so far on the caller's current stream; the tensor must not be touched until
        :meth:`after` or :meth:`finish` says the operation has completed."""
        if self.broken:
            raise ChannelBroken(f"{self.prefix} is closed")
        peer = 1 - self.rank
        work = self.pg.send([tensor], peer, tag) if self.rank == SENDER else self.pg.recv([tensor], peer, tag)
        return _Op(work)

    def after(self, op: "_Op", deadline: float) -> None:
        """Order what the caller does next after ``op``. NCCL: the caller's current stream waits
        for it on the device and the host goes on; gloo: this thread waits (until ``deadline``)."""
        if self.backend == "gloo":
            self._wait_gloo(op, deadline)
        else:
            op.work.wait()

    def finish(self, ops: list["_Op"], deadline: float, tail: Any = None) -> None:
        """Blocking: until every operation of ``ops`` (and the CUDA event ``tail``) has completed;
        raises on failure, when the channel is closed meanwhile, or after ``deadline``."""
        if self.backend == "gloo":
            for op in ops:
                self._wait_gloo(op, deadline)
        else:
            # poll the works' end events so that a closed channel or the deadline ends the wait
            # (a blocking wait could not be interrupted); short sleeps keep the added latency
            # under half a millisecond for a transfer that itself takes a few
            pause, first = 2e-5, 0
            while True:
                while first < len(ops) and ops[first].work.is_completed():
                    first += 1
                if first == len(ops) and (tail is None or tail.query()):
                    break
                if self.broken:
                    raise ChannelBroken(f"{self.prefix} was closed during the transfer")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.prefix}: transfer not complete before the deadline")
                time.sleep(pause)
                pause = min(pause * 2, 5e-4)
            for op in ops:
                op.work.wait()  # raises the work's error, if any
        self.transfers += 1
        self.last_used = time.monotonic()

    def run(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Send (rank 0) or receive (rank 1) ``tensor`` whole, opening the channel first if
        needed; raises on failure or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self.open()
        with _device_guard(self.device):
            self.finish([self.post(tensor)], deadline)

    def _wait_gloo(self, op: "_Op", deadline: float) -> None:
        if op.waited:  # a second wait on a completed gloo work would time out
            return
        # gloo reports completion only through wait(); its timeout closes the channel's pairs
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self.prefix}: no time left to wait")
        op.work.wait(datetime.timedelta(seconds=remaining))
        op.waited = True

    def mark_broken(self) -> None:
        """Instant (any thread): no new operation starts on this channel."""
        self.broken = True

    def abort(self) -> None:
        """Blocking: close the process group (aborting what is in flight where the backend can).
        Several threads may call it: the group is aborted once, and a second caller returns
        only after that."""
        self.broken = True
        with self._abort_lock:
            pg = self.pg
            if pg is not None and pg is not self._aborted_pg:
                self._aborted_pg = pg
                _abort_pg(pg)
        self._store = None  # our client connection (the receiver's hosted store lives on)


@dataclass
class _Op:
    """One posted send or receive."""

    work: Any
    waited: bool = False


def _abort_pg(pg: Any) -> None:
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as exc:  # best effort: the channel is being dropped anyway
            logger.debug("process group %s() failed: %r", name, exc)
