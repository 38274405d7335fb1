"""Pairwise channels: a request's KV pages from a prefill replica's device straight into a
decode replica's device, over a 2-rank process group that the pair builds for itself.

Serve replicas come and go, so there is no group over all of them: a *channel* joins one
sender (a prefill replica, rank 0) and one receiver (a decode replica, rank 1), is opened the
first time that pair transfers and is rebuilt after any failure. It is a standalone
``torch.distributed`` backend (``init_process_group`` and the default group are never used):
the receiver hosts one ``TCPStore`` on a free port of its node's address, each channel gets a
``PrefixStore`` namespace ``fpkv/<sender>/<receiver>/<generation>/`` in it, and both ends
build ``ProcessGroupNCCL`` (CUDA pools) or ``ProcessGroupGloo`` (CPU pools) on that prefix.
The backend follows the pools' device, so the CPU tests run exactly the code that moves
GPU pages with NCCL.

The transport is a pair: ``send.ChannelSender`` (``export``, ``serve_send``: the prefill
side) and ``recv.ChannelReceiver`` (``receive``, ``receive_heads``: the decode side); ``end``
holds what both ends share (``ChannelEnd``: checked settings, worker threads, side streams,
counters, closing). Its parts: ``pages`` (a chunk's bytes: gather, scatter, checksum, side
streams), ``process_group`` (one end of a channel: ``Channel``), ``kv_transfer.wire`` (the send
request and its reply), ``config`` (``ChannelConfig``); ``group``: channels between TP groups;
``spec``: what the registry knows of it (``nccl`` on CUDA pools, ``gloo`` on CPU pools).

One transfer (the header travels through Ray, the pages over the channel):
1. ``export`` (sender, after prefill) copies nothing. The pages stay in the prefill pool under
   the lease the prefill replica holds until the decode side has adopted them; the export
   records them, the msgpack :class:`~kv_transfer.header.KVFrameHeader`
   (``checksum_kind="wsum64"``, ``checksum`` 0: the checksums come with the send, step 4) and,
   for CUDA pools, an event on the stream the pages were written on, which the send waits for
   on the device. The ticket carries the header and the sender's address.
2. ``receive`` (receiver): checks the ticket and the geometry, reserves the pages in its own
   pool (all or nothing: ``TransferFailure.POOL_EXHAUSTED`` otherwise, and the sender is not
   even called), picks the chunking, then - one transfer at a time per pair - asks the sender,
   through ``call_sender`` (a Ray call pinned to that replica), to send over channel
   ``generation``. Both ends run the blocking collective work in worker threads, never on
   the replica's event loop.
3. The pages move in *chunks*: K then V of a group of consecutive layers, as many whole layers
   as fit in ``ChannelConfig.chunk_bytes`` (at least one; the receiver decides and tells the
   sender), through a ring of ``ring_depth`` chunk buffers at each end. The sender gathers and
   checksums chunk i+1 on a side stream while chunk i is on the wire; a send waits for its
   gather, a ring slot is refilled only once its send has completed. The receiver receives
   chunk i+1 while it checksums chunk i and scatters it into the reserved pages on a side
   stream; a slot takes a new chunk only once its scatter has run. The ordering is CUDA
   events and stream waits on the NCCL work, with no host sync per chunk, and memory is
   bounded by the rings, not by the request. Between CPU pools (gloo) the same code runs: the
   streams are no-ops and the waits block the worker thread.
4. Each end checksums every chunk where it lives (:func:`kv_transfer.channel.pages.payload_checksum`'s formula) into a
   device tensor read once at the end. The sender returns its list in the ``serve_send``
   reply; the receiver compares it with its own after the last chunk.

The checksum is a position-weighted sum computed on the device; CRC-32 on the GPU would cost
more than the transfer. It guards against our own bugs (a gather/scatter or ordering mistake,
two transfers crossing on one channel, a wrong buffer), not against the wire: NCCL and TCP
guarantee delivery integrity.

Failures never hang a request: channel set-up is bounded by ``connect_timeout_s`` (store
connection, gloo rendezvous, NCCL unique-id exchange), a transfer by
``transfer_timeout_s + bytes / min_bytes_per_s``. A timeout, a dead or unreachable peer,
a sender that no longer holds the pages or a checksum mismatch raise ``TransferError``
(``LOST``, ``UNAVAILABLE`` or ``CHECKSUM``: all retryable, and the service retries such a
request over the object store) and mark the channel broken on this side; the next transfer
between the pair opens a new generation, and the other end drops its older generation when
it sees the newer one. A gloo wait cannot be interrupted: its worker thread stays blocked
until its own timeout, while the request has already failed.

Half-written pages. The receiver scatters chunks before it can compare checksums, so a failed
transfer may have written into its reserved pages, and on CUDA such writes may still be queued
when the transfer is given up (a scatter waits for a receive that never completes). Pages go
back to the pool only once nothing can write into them any more, zeroed (free pages keep
finite values: padding slots are read under a mask); while writes may be pending they move to
a private id, and the receiving worker frees them after aborting the channel and draining its
stream (if that never drains, they stay out of the pool: a leak, logged, rather than a page
that a late write corrupts). On the sender, a send whose export was discarded while it ran
(the lease ended: the pages may belong to another request by now) is answered as failed.

NCCL: a hung transfer's communicator is aborted by us. So that a timeout aborts the channel
and not the replica process, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 2 (clean up
only) in processes that open NCCL channels, unless the environment already sets it.

Ownership is unchanged (docs/ARCHITECTURE.md): the sender's pages stay allocated until the
decode side has adopted them and the lease stream is closed.

TP groups (``kv_transfer.channel.group.TPChannelTransport``, docs/ARCHITECTURE.md "Tensor
parallelism"): a TP prefill replica's ticket adds ``tp`` (its head layout and every rank's
header); each rank has its own channel (sender id ``<replica>:tp<rank>``). The receiver
(``receive_heads``; ``receive`` for a TP=1 replica) reserves its pages once and pulls from each
rank holding some of its heads, the send request naming ``rank``, that rank's local ``heads``
and ``pulls`` (how many sends the receiving replica makes in all, so that the sender's lease
outlives every one of them); chunks then hold only those heads
(:func:`kv_transfer.channel.pages.gather_heads` / :func:`~kv_transfer.channel.pages.scatter_heads`). A TP decode
group runs ``receive_heads`` on every rank at once, each rank a receiver of its own
(``<replica>:tp<rank>``, its own store): one channel per (prefill rank, decode rank) pair
(``kv_transfer.channel.group``).
"""
