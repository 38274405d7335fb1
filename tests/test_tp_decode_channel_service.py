"""The service with TP=2 decode replicas receiving over gloo channels, each decode rank pulling
its own KV heads (``kv_transfer.channel.group.TPChannelReceiver``): from a TP=2 prefill
(app "c22", each decode rank pulls from the prefill rank holding its head) and from a TP=1
prefill (app "c12", both decode ranks pull from the one prefill replica), both apps in one Serve
start. Greedy answers equal the single-process oracle; the transfers are channel transfers
(``gloo``), not object-store frames; the first transfer of "c22" carries a flipped chunk on
prefill rank 1's pair: every decode rank releases, the ingress retries over the object store
(the merged frame, split by head); afterwards every lease has ended (by its sends) and no rank,
prefill or decode, leader or follower, holds a page."""

from __future__ import annotations

import time

import pytest

from serving.config import ServiceConfig

httpx = pytest.importorskip("httpx")

from tests.service_helpers import oracle_tokens, prompt_of, replica_stats, wait_pools_idle  # noqa: E402

MODEL = "builtin:tiny"
COMMON = {"model": "builtin:tiny", "device": "cpu", "torch_threads": 1, "prefill_kv_pages": 64, "decode_kv_pages": 64, "page_size": 16,
          "batch_wait_ms": 1.0, "alpha": 0.9, "block_size": 64, "sink_tokens": 64, "window_tokens": 64,
          "dense_below": 100, "transport": "gloo", "fused_ops": False, "decode": {"tensor_parallel_size": 2},
          # roomy: torch's store reverse-resolves peer addresses, slow on some sandboxes' resolvers
          "transfer": {"channel": {"connect_timeout_s": 20.0, "transfer_timeout_s": 20.0}}}
CONFIGS = {
    "c22": ServiceConfig.from_dict({**COMMON, "prefill": {"tensor_parallel_size": 2},
                                    "fault_injection": {"corrupt_transfers": 1, "mode": "flip"}}),
    "c12": ServiceConfig.from_dict(COMMON),
}
ONE = {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 1}
CASES = [(150, 4, 6), (40, 1, 8), (230, 2, 5), (17, 3, 7)]  # sparse and dense, one to several pages


SERVE_APPS = {app: {"config": cfg, "prefill": ONE, "decode": ONE, "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}
              for app, cfg in CONFIGS.items()}


def complete(service, app: str, ids: list[int], max_tokens: int) -> list[int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = service["http"].post(f"/{app}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def followers(prefix: str) -> list:
    """The follower rank actors whose names start with ``prefix``."""
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def follower_pages(prefix: str) -> list[int]:
    """Pages held by the follower rank actors whose names start with ``prefix``."""
    import ray

    return ray.get([a.used_pages.remote() for a in followers(prefix)], timeout=30)


def settled_prefill(app: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        (pre,) = replica_stats(app, "PrefillServer")
        if pre["leased"] == 0 or time.monotonic() > deadline:
            return pre
        time.sleep(0.2)


@pytest.mark.parametrize("app", list(CONFIGS))
def test_tp2_decode_pulls_over_channels_equal_to_the_oracle_fault_retried_every_rank_clean(service, app):
    for n, seed, max_tokens in CASES:
        ids = prompt_of(n, seed)
        assert complete(service, app, ids, max_tokens) == oracle_tokens(CONFIGS[app], ids, max_tokens), (app, n, seed)
    wait_pools_idle(app, timeout_s=60)
    pre = settled_prefill(app)
    (dec,) = replica_stats(app, "DecodeServer")
    assert dec["tp_ranks"] == 2 and dec["kv_heads"] == 1  # really TP: half the heads per decode rank
    faults = 1 if app == "c22" else 0
    # channel transfers for the normal requests; the damaged one retried over the object store
    assert dec["transfers"] == ({"gloo": len(CASES) - 1, "object_store": 1} if faults else {"gloo": len(CASES)}), \
        dec["transfers"]
    assert dec["transfer_failures"] == faults
    # every channel export (one per request) had a lease; each ended with its announced sends
    # (the flipped chunk's send succeeded too: the decode rank's checksum caught it); the retry's
    # object-store frame had one too (its reference), released after the fetch; none waited for
    # its deadline
    assert pre["leased"] == 0 and pre["leases_ended"]["expired"] == 0, pre["leases_ended"]
    assert pre["leases_ended"]["sent"] == len(CASES), pre["leases_ended"]
    assert pre["leases_ended"]["released"] == faults, pre["leases_ended"]
    assert pre["channel_staged"] == 0
    # rank 0 of the prefill replica sent once per decode rank holding its heads: TP 2 -> 2 pairs
    # rank 0 with decode rank 0 only; TP 1 -> 2 sends to both decode ranks
    assert pre["channel_sends"] == len(CASES) * (1 if app == "c22" else 2)
    # decode rank 0 pulled its head cleanly in every channel transfer (the flip hit rank 1's pair)
    assert dec["channel_receives"] == len(CASES) and dec["channel_failures"] == 0
    assert follower_pages(f"fptp_decode_rank:{dec['replica_id']}:") == [0]
    # decode rank 1 pulled its own head over its own channel (the flipped chunk: its checksum failed)
    import ray

    (rank1,) = followers(f"fptp_decode_rank:{dec['replica_id']}:")
    got = ray.get(rank1.end_counters.remote(), timeout=30)
    assert (got["channel_receives"], got["channel_failures"]) == (len(CASES) - faults, faults), got
    if app == "c22":
        assert pre["tp_ranks"] == 2 and follower_pages(f"fptp_rank:{pre['replica_id']}:") == [0]
