"""The object-store transport: one frame (``kv_transfer.frame``) per request through Ray's
object store; works across nodes for CPU or GPU pools, and is every replica's retry path.

- ``transport``: ``ObjectStoreTransport`` (both ends of a TP=1 replica);
- ``group``: a TP group's ends (every rank's heads merged into one ordinary frame on the
  prefill side; one frame split by head over the ranks on the decode side) and a follower
  rank's part of them;
- ``config``: ``ObjectStoreConfig``; ``spec``: what the registry knows of it.
"""
