"""The service with TP=2 decode replicas (rank 0 the replica, rank 1 a RankActor in its placement
group, gloo on CPU), fed by a TP=1 prefill (app "d2") and by a TP=2 prefill (app "tp22"), both
apps in one Serve start: greedy answers equal the single-process oracle, streaming or not; a
split frame damaged on one decode rank releases the request on both and is retried; a decode
follower killed mid-stream ends its replica and the stream resumes on the replacement; every
rank's pool ends clean."""

from __future__ import annotations

import json
import time

import pytest

from serving.config import ServiceConfig

httpx = pytest.importorskip("httpx")

from tests.service_helpers import oracle_tokens, prompt_of, replica_stats, wait_pools_idle  # noqa: E402

MODEL = "builtin:tiny"
COMMON = {"model": "builtin:tiny", "device": "cpu", "torch_threads": 1, "prefill_kv_pages": 64, "decode_kv_pages": 64, "page_size": 16,
          "batch_wait_ms": 1.0, "alpha": 0.9, "block_size": 64, "sink_tokens": 64, "window_tokens": 64,
          "dense_below": 100, "transport": "object_store", "fused_ops": False, "decode": {"tensor_parallel_size": 2}}
CONFIGS = {
    # decode steps held 100 ms: a window to kill a decode rank mid-stream
    "d2": ServiceConfig.from_dict({**COMMON, "fault_injection": {"decode_step_delay_ms": 100.0}}),
    "tp22": ServiceConfig.from_dict({**COMMON, "prefill": {"tensor_parallel_size": 2},
                                     "fault_injection": {"corrupt_rank_frames": 1, "mode": "flip"}}),
}
ONE = {"ray_actor_options": {"num_cpus": 0.5}, "num_replicas": 1}


SERVE_APPS = {app: {"config": cfg, "prefill": ONE, "decode": ONE, "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}
              for app, cfg in CONFIGS.items()}


def complete(service, app: str, ids: list[int], max_tokens: int, *, stream: bool = False,
             on_tokens=None) -> tuple[list[int], dict]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if not stream:
        r = service["http"].post(f"/{app}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()
    tokens, last = [], {}
    with service["http"].stream("POST", f"/{app}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
                assert "error" not in last, last
                tokens += [t for ch in last["choices"] for t in ch.get("token_ids", [])]
                if on_tokens is not None:
                    on_tokens(tokens)
    return tokens, last


def decode_ranks(app: str) -> dict[int, object]:
    """The decode replica's follower actors (by rank), found by their names."""
    import ray

    (dec,) = replica_stats(app, "DecodeServer")
    prefix = f"fptp_decode_rank:{dec['replica_id']}:"
    return {int(a["name"][len(prefix):]): ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def assert_every_rank_clean(app: str) -> None:
    import ray

    wait_pools_idle(app, timeout_s=60)
    (dec,) = replica_stats(app, "DecodeServer")
    ranks = decode_ranks(app)
    assert dec["tp_ranks"] == 2 and dec["kv_heads"] == 1 and sorted(ranks) == [1]  # really TP: half the heads
    assert ray.get([a.used_pages.remote() for a in ranks.values()], timeout=30) == [0]


@pytest.mark.parametrize("app", list(CONFIGS))
def test_tp2_decode_equals_the_oracle_streaming_or_not(service, app):
    cases = [(40, 1, 8, False), (230, 2, 6, True), (17, 3, 7, False), (120, 4, 9, True)]  # dense and sparse
    for n, seed, max_tokens, stream in cases:
        ids = prompt_of(n, seed)
        got, _ = complete(service, app, ids, max_tokens, stream=stream)
        assert got == oracle_tokens(CONFIGS[app], ids, max_tokens), (app, n, seed, stream)
    assert_every_rank_clean(app)
    (dec,) = replica_stats(app, "DecodeServer")
    assert dec["decode_graphs"].startswith("off") and dec["transfers"] == {"object_store": len(cases)}
    # tp22: the first frame's part for rank 1 was damaged after the split: refused by every rank, prefilled again
    assert dec["transfer_failures"] == (1 if app == "tp22" else 0)


def test_a_decode_follower_killed_mid_stream_ends_its_replica_and_the_stream_resumes(service):
    import ray

    app = "d2"
    ids = prompt_of(45, 41)
    want = oracle_tokens(CONFIGS[app], ids, 30)
    assert len(want) == 30  # no early stop token: the stream outlives the kill
    (before,) = replica_stats(app, "DecodeServer")
    (rank1,) = decode_ranks(app).values()
    killed = []

    def kill_once(tokens):
        if not killed and len(tokens) >= 5:  # mid-stream: decode steps take >= 100 ms each
            ray.kill(rank1)
            killed.append(len(tokens))

    got, last = complete(service, app, ids, 30, stream=True, on_tokens=kill_once)
    assert killed and killed[0] < 30
    assert got == want  # no gap, no repeat: resumed on the replacement replica
    assert last["timing"]["decode_resumes"] >= 1
    deadline = time.monotonic() + 120
    while not (stats := replica_stats(app, "DecodeServer")) or stats[0]["replica_id"] == before["replica_id"]:
        assert time.monotonic() < deadline, "the decode replica was not replaced"
        time.sleep(0.5)
    assert_every_rank_clean(app)
