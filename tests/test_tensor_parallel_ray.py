"""A TP=2 group on a local Ray (serving/tp_group.py): the leader here, the follower a RankActor;
the engines over the lockstep runner equal TP=1, both pools end clean; the placement options;
a killed follower fails the leader's next step with RankFailed."""

from __future__ import annotations

import time

import pytest
import ray

from model_executor import PrefillItem, parallel
from serving.config import ServiceConfig
from serving.tp_group import build_rank_runner, placement_options, start_group
from test_tensor_parallel_lockstep import serve

CONFIG = dict(model={"model": "builtin:tiny", "device": "cpu", "seed": 2}, kv={"page_size": 16},
              sparse={"alpha": 0.9, "block_size": 64, "sink_tokens": 64, "window_tokens": 64, "dense_below": 100},
              prefill={"tensor_parallel_size": 2}, runtime={"fused_ops": False, "torch_threads": 1})


def test_placement_options_one_bundle_per_rank():
    cfg = ServiceConfig(**CONFIG)
    opts = placement_options(cfg, "prefill", {"num_cpus": 4, "num_gpus": 1, "resources": {"prefill_gpu": 1}})
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0, "prefill_gpu": 1.0},
                                               {"CPU": 1.0, "GPU": 1.0, "prefill_gpu": 1.0}]
    assert placement_options(cfg, "decode") == {}


def test_a_ray_tp_group_equals_tp1_and_a_dead_rank_fails_the_leader(serve_cluster):
    # the session's Ray (tests/conftest.py): the group is placed like a replica's ranks
    cfg = ServiceConfig(**CONFIG)
    lock, actors = start_group(cfg, "prefill", num_pages=48)
    assert lock.pool.num_kv_heads == 1  # 2 KV heads over 2 ranks
    got = serve(lock)
    want = serve(build_rank_runner(cfg, "prefill", None, 48))
    for key in ("first", "cached", "tokens"):
        assert got[key] == want[key], key
    assert want["cached"][1] == 128
    assert got["used_pages"] == 0 and ray.get(actors[0].used_pages.remote()) == 0
    ray.kill(actors[0])
    # ray.kill is asynchronous: wait until the actor is gone, so the step below meets a dead rank
    for _ in range(600):
        try:
            ray.get(actors[0].used_pages.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - RayActorError once it is dead
            break
        time.sleep(0.05)
    with pytest.raises(parallel.RankFailed, match="TP rank 1"):
        lock.ensure_capacity("late", 20)  # the follower is gone: the group is out of step
