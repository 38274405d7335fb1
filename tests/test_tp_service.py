"""The service with TP=2 prefill replicas (rank 0 the replica, rank 1 a RankActor in its
placement group, gloo on CPU) and TP=1 decode answers as the single-process oracle, and both
pools end clean."""

from __future__ import annotations

import pytest

from serving.config import ServiceConfig

httpx = pytest.importorskip("httpx")

from tests.service_helpers import oracle_tokens, prompt_of, replica_stats, wait_pools_idle  # noqa: E402

MODEL = "builtin:tiny"
CONFIG = ServiceConfig.from_dict({
    "model": "builtin:tiny", "device": "cpu", "torch_threads": 1, "prefill_kv_pages": 64, "decode_kv_pages": 64, "page_size": 16,
    "batch_wait_ms": 1.0, "alpha": 0.9, "block_size": 64, "sink_tokens": 64, "window_tokens": 64, "dense_below": 100,
    "transport": "object_store", "prefill": {"tensor_parallel_size": 2}, "fused_ops": False,
    "fault_injection": {"prefill_delay_ms": 2000.0}})  # a window to kill a rank while a call is in the replica
ONE = {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 1}


SERVE_APPS = {"tp": {"config": CONFIG, "prefill": ONE, "decode": ONE, "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}


def complete(service, ids: list[int], max_tokens: int) -> list[int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = service["http"].post("/tp/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_tp2_prefill_tp1_decode_equals_the_oracle(service):
    for n, seed in ((40, 1), (230, 2), (17, 3)):  # dense, sparse (chunks of whole blocks), short
        ids = prompt_of(n, seed)
        assert complete(service, ids, 8) == oracle_tokens(CONFIG, ids, 8), (n, seed)
    wait_pools_idle("tp")
    (pre,) = replica_stats("tp", "PrefillServer")
    assert pre["num_pages"] == 64 and pre["tp_ranks"] == 2 and pre["kv_heads"] == 1  # really TP: half the heads


def test_a_rank_killed_mid_prefill_fails_its_replica_and_the_request_is_still_answered(service):
    import threading
    import time

    import ray

    ids = prompt_of(150, 9)
    want = oracle_tokens(CONFIG, ids, 6)
    (before,) = replica_stats("tp", "PrefillServer")
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("tokens", complete(service, ids, 6)))
    worker.start()
    time.sleep(0.5)  # the call is in the replica, held by fault_injection.prefill_delay_ms
    ranks = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"fptp_rank:{before['replica_id']}:")]
    assert len(ranks) == 1
    ray.kill(ray.get_actor(ranks[0]["name"], namespace=ranks[0]["namespace"]))
    worker.join(240)
    assert out.get("tokens") == want
    wait_pools_idle("tp", timeout_s=120)
    (after,) = replica_stats("tp", "PrefillServer")
    assert after["replica_id"] != before["replica_id"] and after["tp_ranks"] == 2
