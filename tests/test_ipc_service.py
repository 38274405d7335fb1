"""The service on one GPU with ``transport: auto``: prefill and decode replicas share the GPU and
their KV pages move over CUDA IPC (the session's local Ray + Serve on 127.0.0.1,
tests/conftest.py; needs CUDA).

- ``ipc``: 1 prefill + 1 decode, a quarter GPU each; every transfer goes over CUDA IPC;
- ``ipc_break``: the same, whose first ticket names a GPU nobody has: that request is retried
  over the object store, and its tokens equal those of ``ipc`` (pages that came over IPC
  decode like pages that came through the object store); the next request uses IPC again.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from serving.config import ServiceConfig  # noqa: E402
from tests.service_helpers import prompt_of, replica_stats, wait_pools_idle  # noqa: E402

pytestmark = pytest.mark.gpu

MODEL = "builtin:tiny"
COMMON = {"model": "builtin:tiny", "device": "cuda", "torch_threads": 1, "prefill_kv_pages": 128, "decode_kv_pages": 128,
          "debug_routing": True, "batch_wait_ms": 1.0, "alpha": 0.0, "transport": "auto"}
CONFIGS = {
    "ipc": ServiceConfig.from_dict(COMMON),
    "ipc_break": ServiceConfig.from_dict({**COMMON, "fault_injection": {"corrupt_transfers": 1, "mode": "break"}}),
}
QUARTER = {"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.25}, "num_replicas": 1}


SERVE_APPS = {name: {"config": CONFIGS[name], "prefill": QUARTER, "decode": QUARTER,
                     "ingress": {"ray_actor_options": {"num_cpus": 0.25}}} for name in CONFIGS}


def complete(service, app: str, ids: list[int], max_tokens: int) -> tuple[list[int], dict]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = service["http"].post(f"/{app}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj["choices"][0]["token_ids"], obj


def _sum(stats: list[dict], key: str) -> int:
    return sum(s.get(key, 0) for s in stats)


def test_shared_gpu_moves_pages_over_cuda_ipc_and_falls_back_to_the_object_store(service):
    ids = prompt_of(300, seed=8)
    fallback_tokens, obj = complete(service, "ipc_break", ids, 6)  # its ticket is broken: object store
    assert obj["timing"]["prefill_attempts"] == 2
    dec = replica_stats("ipc_break", "DecodeServer")
    assert [s["transfers"] for s in dec] == [{"object_store": 1}] and _sum(dec, "transfer_failures") == 1
    got, obj = complete(service, "ipc_break", ids, 6)  # the next ticket is intact
    assert got == fallback_tokens and obj["timing"]["prefill_attempts"] == 1
    cases = [(7, 9), (150, 6), (300, 6), (1000, 4)]
    for n, max_tokens in cases:
        got, obj = complete(service, "ipc", prompt_of(n, seed=8 if n == 300 else n), max_tokens)
        assert obj["timing"]["prefill_attempts"] == 1
        if n == 300:
            assert got == fallback_tokens  # IPC pages decode as the object store's did
    for app in CONFIGS:
        wait_pools_idle(app)
    pre, dec = replica_stats("ipc", "PrefillServer"), replica_stats("ipc", "DecodeServer")
    assert [s["transfers"] for s in dec] == [{"cuda_ipc": len(cases)}]
    assert _sum(dec, "ipc_receives") == len(cases) == _sum(pre, "ipc_exports")
    assert _sum(dec, "ipc_fallbacks") == 0 and _sum(pre, "ipc_stages") == 0  # one GPU: never the channel
    assert _sum(dec, "ipc_failures") == 0 and _sum(dec, "transfer_failures") == 0
    assert _sum(pre, "ipc_exported") == 0  # every lease ended
    assert _sum(dec, "ipc_mappings_open") == 2  # the prefill pool's K and V, opened once
    dec = replica_stats("ipc_break", "DecodeServer")
    assert [s["transfers"] for s in dec] == [{"object_store": 1, "cuda_ipc": 1}]
