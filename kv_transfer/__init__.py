"""kv_transfer: KV pages shipped between a prefill and a decode replica (see docs/ARCHITECTURE.md).

Above ``model_executor``; the pool it moves pages in and out of is ``kv_cache.KVPool``.
- ``transfer``: the KV header and frame, their checks, the transport interface (``KVSender``,
  ``KVReceiver``, ``KVTransport``), ``LocalTransport``, ``ObjectStoreTransport`` (imports Ray
  when used), ``select_transport``.
- ``choice``: which sender / receivers a replica uses (``Placement``, ``choose_transports``).
- ``channel``, ``channel_send``, ``channel_recv``: pairwise NCCL (CUDA) / gloo (CPU) channels
  as a pair, ``ChannelSender`` and ``ChannelReceiver`` (on ``ChannelEnd``); their parts:
  ``pages`` (a chunk's bytes: gather, scatter, checksum), ``process_group`` (one end of a
  channel), ``wire`` (the typed send and stage requests and replies), ``config`` (``ChannelConfig``, standard
  library only: the service's options import it).
- ``ipc``, ``ipc_send``, ``ipc_recv``: same-GPU copies through CUDA IPC, as a pair,
  ``CudaIpcSender`` and ``CudaIpcReceiver`` (on ``CudaIpcEnd``).
- ``routes`` and ``tp_transfer``: transfers between tensor-parallel groups.

Import the module that holds a name: the package imports none of them, so that
``kv_transfer.config`` stays light.
"""
