"""The service with a TP=2 prefill replica shipping KV over gloo channels from both ranks (each
rank its own heads, kv_transfer.tp_transfer.TPChannelTransport) to a TP=1 decode replica:
answers equal the single-process oracle; a channel failure injected on one rank (rank 1) fails
the whole transfer, which the ingress retries over the object store; every lease ends, and no
rank (leader or follower) or decode pool keeps a page."""

from __future__ import annotations

import time

import pytest

from serving.config import ServiceConfig

httpx = pytest.importorskip("httpx")

from tests.service_helpers import oracle_tokens, prompt_of, replica_stats, wait_pools_idle  # noqa: E402

MODEL = "builtin:tiny"
CONFIG = ServiceConfig.from_dict({
    "model": "builtin:tiny", "device": "cpu", "torch_threads": 1, "prefill_kv_pages": 64, "decode_kv_pages": 64, "page_size": 16,
    "batch_wait_ms": 1.0, "alpha": 0.9, "block_size": 64, "sink_tokens": 64, "window_tokens": 64, "dense_below": 100,
    "transport": "gloo", "prefill": {"tensor_parallel_size": 2}, "fused_ops": False,
    "transfer": {"channel": {"connect_timeout_s": 20.0, "transfer_timeout_s": 20.0}},
    "fault_injection": {"corrupt_transfers": 1, "mode": "break"}})  # the first transfer breaks on rank 1
ONE = {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 1}


SERVE_APPS = {"tpch": {"config": CONFIG, "prefill": ONE, "decode": ONE, "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}


def complete(service, ids: list[int], max_tokens: int) -> list[int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = service["http"].post("/tpch/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def follower_used_pages(replica_id: str) -> list[int]:
    """Pages held by the follower ranks of prefill replica ``replica_id``."""
    import ray

    ranks = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"fptp_rank:{replica_id}:")]
    return [ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).used_pages.remote()) for a in ranks]


def test_tp2_prefill_channels_from_every_rank_fault_retried_pools_clean(service):
    # the first request's transfer breaks on rank 1: retried over the object store, still answered
    for n, seed in ((150, 4), (40, 1), (230, 2), (17, 3)):  # sparse and dense, several pages
        ids = prompt_of(n, seed)
        assert complete(service, ids, 6) == oracle_tokens(CONFIG, ids, 6), (n, seed)
    wait_pools_idle("tpch")
    deadline = time.monotonic() + 30
    while True:
        (pre,) = replica_stats("tpch", "PrefillServer")
        if pre["leased"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (dec,) = replica_stats("tpch", "DecodeServer")
    assert pre["tp_ranks"] == 2 and pre["kv_heads"] == 1
    assert pre["leased"] == 0 and pre["leases_ended"]["expired"] == 0 and pre["leases_ended"]["stopped"] == 0
    # 5 leases: one per channel export (the broken one included), and the retry's object-store
    # frame's (its reference, no pages), which the decode replica released after its fetch
    assert pre["leases_ended"]["sent"] + pre["leases_ended"]["released"] == 5, pre["leases_ended"]
    assert pre["leases_ended"]["released"] >= 1, pre["leases_ended"]
    assert dec["transfers"] == {"object_store": 1, "gloo": 3}, dec["transfers"]
    assert dec["transfer_failures"] == 1
    # the leader's own rank sent in every channel transfer (rank 1 broke in the first, after it)
    assert pre["channel_sends"] == 4 and pre["channel_staged"] == 0
    assert follower_used_pages(pre["replica_id"]) == [0]
