"""kv_transfer: KV pages shipped between a prefill and a decode replica (see docs/ARCHITECTURE.md).

Above ``model_executor``; the pool it moves pages in and out of is ``kv_cache.KVPool``.
- ``errors``, ``header``, ``frame``, ``faults``: why a transfer failed; the msgpack header of a
  request's pages and its checks; the object store's frame codec; frame fault injection.
- ``interfaces``: the transport interface (``TransferTicket``, ``KVSender``, ``KVReceiver``,
  ``KVTransport``).
- One folder per transport, each its ends, config and ``spec`` (what it declares):
  ``object_store/`` (frames through Ray's object store, imports Ray when used), ``channel/``
  (pairwise NCCL / gloo channels), ``cuda_ipc/`` (same-GPU copies); ``local`` (in-process
  frames: tests and tools).
- ``registry``, ``spec``: the transports by name (standard library only, so that the service's
  options read the names without importing a transport) and what each declares.
- ``choice``: which transports a replica uses (``select_transport``, ``choose_transports``);
  ``factory``: builds them by asking the registry.
- ``group``: a TP replica's ranks as the transports see them; ``routes`` and ``tp_transfer``:
  frames between tensor-parallel groups; ``wire``: the typed side-call messages.
- ``transfer``: the public names of all of the above in one import.

Adding a transport: its folder and one line in ``registry._BUILTIN`` (tests/toy_transport.py
shows one added from a test with one ``register_transport`` call).

Import the module that holds a name: the package imports none of them.
"""
