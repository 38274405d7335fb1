"""Same-GPU KV transfers over CUDA IPC: the decode replica maps the prefill replica's KV pool
and copies the request's pages device to device.

Why: a prefill and a decode replica sharing one GPU (``num_gpus: 0.5`` each, the default
deployment on a one-GPU machine) cannot open an NCCL channel (NCCL refuses two ranks on one
device), and the object store moves about 0.5 GB/s through host memory (30 s for the 17 GB of
a 128K-token request). Here the bytes never leave the GPU.

One transfer:
1. ``export`` (prefill replica, after prefill): waits until the prefill's writes are
   done (an event on the current stream), describes the pages (``describe_pages``,
   ``checksum_kind="none"``) and returns a ticket holding the msgpack header, the sender's
   identity and process id, the physical GPU's UUID, the sender's page ids and pool size, and
   CUDA IPC handles of the pool's K and V storages (``UntypedStorage._share_cuda_``, taken
   once per pool and cached: each share wraps the storage for torch's cross-process refcount).
   Nothing is copied: the pages stay valid under the prefill lease, which lasts until the
   decode replica acknowledges.
2. ``receive`` (decode replica): checks the ticket strictly (``MALFORMED``), the geometry
   (``SHAPE``) and that its own pool is on the same physical GPU (by UUID: device indices
   differ between processes under ``CUDA_VISIBLE_DEVICES``), else ``UNAVAILABLE`` or the
   fallback below. It reserves pages (``adopt_pages``), opens the sender's storages
   (``UntypedStorage._new_shared_cuda``, once per (sender replica, storage handle), cached),
   copies remote pages into its own with ``index_select``/``index_copy_`` on integer word
   views (exact bytes, bf16 and fp8 alike) on a side stream, at most ``copy_chunk_bytes`` of
   temporaries at a time, and synchronizes before it returns, so the acknowledgement that
   lets the prefill replica free its pages implies the copy is complete. Any failure
   releases the reserved pages and raises ``TransferError``.

No checksum: nothing sits between the bytes read and the bytes written (no wire, no staging
buffer, no reordering), so a CRC or the channel's on-device sum would re-read the whole
payload to check one copy kernel. The header says so (``checksum_kind="none"``).

Fallback (``auto`` on CUDA): with ``fallback`` (the NCCL channel's sender on a prefill
replica, its receiver on a decode replica) pages also move between pools on different GPUs,
so one deployment works whether Ray puts the pair on one GPU or two. It is lazy: the ticket
carries the IPC part only, and a receiver on another GPU asks the sender (``call_sender``:
the prefill replica's ``stage_pages``, which runs ``serve_stage``) to export the pages over
the fallback, then receives that ticket. Exporting both up front would stage a full copy of
every request's pages (the channel's staging buffer) even when the pair shares a GPU, the
very case this transport is for.

The lease and the clock: the sender's pages are read in place, so they must still be the
request's when the copy ends. The prefill replica frees them when the ingress closes the lease
(after ``adopted``: the copy is done) or after ``lease_timeout_s``; the ticket carries that
deadline (``expires_at``, wall clock, both ends being on one host) and the receiver neither
starts nor acknowledges a copy past it (``LOST``).

A sender that goes away: CUDA calls freeing an exported allocation before every importer has
closed it undefined behaviour, and does not say what an open mapping of an exited process
does (keeps its memory allocated, or dangles). Either way a mapping whose sender is gone must
be closed and never read again: ``sweep`` (at every receive, and from the decode replica's
health check) closes mappings idle for ``idle_close_s`` or whose sender process no longer
exists; a copy checks that its sender is still alive before it acknowledges. See
RELIABILITY.md for what a sender dying during a copy can do.

The transport is a pair: ``send.CudaIpcSender`` (``export``, ``serve_stage``: the prefill
side) and ``recv.CudaIpcReceiver`` (``receive``, ``sweep``: the decode side); ``common`` holds
what both read: the ticket and its checks, the copy, and ``CudaIpcEnd`` (identity, fallback,
counters, closing); ``config``: ``IpcConfig``; ``spec``: what the registry knows of it (CUDA
pools only, never between TP groups).
"""
