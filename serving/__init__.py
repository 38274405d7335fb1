"""What the prefill and decode workers share, below them and above the KV transports.

- ``config``: ``ServiceConfig``, every option of the service (validated where it is built).
- ``costs``: the prefill cost model and the routing hint every routed call carries.
- ``errors``: ``RequestError``, a request the service refuses (rendered by the ingress).
- ``metrics``: the service's Prometheus metrics through Ray's metrics export.
- ``runtime``: what a worker replica builds at start (model, KV pool, runner) and its identity.

Layers (pyproject's import contracts): ``router`` > ``prefill_worker`` | ``decode_worker`` >
``serving`` > ``kv_transfer`` > ``model_executor`` > ``kv_cache`` > ``kernels``.
"""
