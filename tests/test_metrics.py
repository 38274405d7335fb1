"""serving/metrics.py: what each recording call creates and records (a fake of Ray's metric
classes stands in for ray.serve.metrics), the no-op without Ray, and that a broken metric never
fails the caller. The pipeline's records are checked in test_reliability_units.py."""

from __future__ import annotations

import pytest

from serving import metrics as metrics_mod
from serving.metrics import PREFIX, SPECS, Metrics
from tests.helpers import FakeMetricsBackend as FakeBackend


def test_request_ended_records_every_request_metric():
    backend = FakeBackend()
    m = Metrics(backend)
    m.request_ended(finish_reason="length", prompt_tokens=4096, output_tokens=64, ttft_s=1.5, latency_s=4.0,
                    tpot_s=0.04, prefill_retries=1, resumes=0)
    m.request_ended(finish_reason="failed", prompt_tokens=None, output_tokens=0, ttft_s=None, latency_s=0.2,
                    tpot_s=None, prefill_retries=0, resumes=0)
    assert backend.calls("requests_total") == [("inc", 1.0, {"finish_reason": "length"}),
                                               ("inc", 1.0, {"finish_reason": "failed"})]
    assert backend.calls("prompt_tokens_total") == [("inc", 4096, None)]
    assert backend.calls("generation_tokens_total") == [("inc", 64, None)]  # zero is not recorded
    assert backend.calls("time_to_first_token_seconds") == [("observe", 1.5, None)]
    assert backend.calls("time_per_output_token_seconds") == [("observe", 0.04, None)]
    assert backend.calls("e2e_request_latency_seconds") == [("observe", 4.0, None), ("observe", 0.2, None)]
    assert backend.calls("request_retries_total") == [("inc", 1, {"kind": "prefill"})]
    ttft = backend.made[PREFIX + "time_to_first_token_seconds"]
    assert ttft.boundaries == list(metrics_mod.TTFT_BUCKETS) and ttft.tag_keys is None
    assert backend.made[PREFIX + "requests_total"].tag_keys == ("finish_reason",)


def test_pool_gauges():
    class Pool:
        num_pages, free_pages = 100, 60

    backend = FakeBackend()
    Metrics(backend).pool("decode", Pool())
    assert backend.calls("kv_pages_used") == [("set", 40, {"role": "decode"})]
    assert backend.calls("kv_pages_total") == [("set", 100, {"role": "decode"})]


def test_every_spec_is_a_valid_prometheus_name_with_sorted_buckets():
    import re

    for name, (kind, description, tags, buckets) in SPECS.items():
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", PREFIX + name) and description
        assert kind in ("counter", "gauge", "histogram") and (buckets is not None) == (kind == "histogram")
        assert not kind == "counter" or name.endswith("_total")
        if buckets:
            assert list(buckets) == sorted(set(buckets)) and buckets[0] > 0


def test_without_ray_nothing_is_recorded(monkeypatch):
    ray = pytest.importorskip("ray")
    # no Ray in this process (the session's test cluster may run in it: scripts/test.sh runs
    # whole files per xdist worker, in any order)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    m = Metrics()
    assert not m.enabled
    m.request_ended(finish_reason="stop", prompt_tokens=1, output_tokens=1, ttft_s=0.1, latency_s=0.1,
                    tpot_s=None, prefill_retries=0, resumes=0)
    m.set("decode_running_requests", 3)


def test_a_metric_that_fails_is_skipped_after_one_warning(caplog):
    backend = FakeBackend()
    m = Metrics(backend)
    m.inc("prefill_tokens_total", 5)
    backend.made[PREFIX + "prefill_tokens_total"].inc = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("agent gone"))
    with caplog.at_level("WARNING"):
        m.inc("prefill_tokens_total", 5)
        m.inc("prefill_tokens_total", 5)
    assert sum("prefill_tokens_total" in r.getMessage() for r in caplog.records) == 1
    m.set("prefill_queued_requests", 2)  # the others still record
    assert backend.calls("prefill_queued_requests") == [("set", 2, None)]


def test_every_name_the_service_records_is_specified():
    """A misspelt name would only log a warning at run time: read the call sites instead."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    used = set()
    for path in ("serving/metrics.py", "router/pipeline.py", "router/driver.py", "router/reporting.py",
                 "prefill_worker/deployment.py", "decode_worker/deployment.py"):
        used |= set(re.findall(r'\.(?:inc|set|observe)\(\s*"([a-z_]+)"', (root / path).read_text()))
    assert used and used <= set(SPECS), sorted(used - set(SPECS))
    assert {"decode_steps_total", "kv_transfers_total", "prefill_batch_seconds", "requests_total"} <= used


def test_decode_loop_counts_graph_and_eager_steps_and_sets_gauges():
    import torch

    from decode_worker.deployment import DecodeLoop
    from decode_worker.engine import DecodeEngine
    from kernels.config import SparseConfig
    from model_executor import ModelRunner, PrefillItem, SamplingParams, build_tiny_model
    from model_executor.loading import make_pool

    loaded = build_tiny_model(seed=0)
    runner = ModelRunner(loaded.model, make_pool(loaded, num_pages=16, page_size=16), SparseConfig(alpha=0.0),
                         dense_below=0)
    engine = DecodeEngine(runner, max_running=4)
    backend = FakeBackend()
    loop = DecodeLoop(engine, metrics=Metrics(backend))
    prompts = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0)).tolist()
    for i, prompt in enumerate(prompts):
        runner.ensure_capacity(f"r{i}", len(prompt) + 1)
        first = int(runner.prefill([PrefillItem(f"r{i}", prompt)]).argmax())
        engine.add_request(f"r{i}", len(prompt), first, SamplingParams(temperature=0.0, max_new_tokens=8))
    engine.step()
    loop._record()  # no graphs: an eager step
    runner.enable_decode_graphs(max_seqlen=64, batch_sizes=(2,), capture=False)
    engine.step()  # 3 requests > 2: eager through the graphs' fallback
    engine.cancel("r2")
    engine.step()  # 2 requests: the graph path
    engine.step()
    loop._record()
    assert backend.calls("decode_steps_total") == [("inc", 1.0, {"mode": "eager"}), ("inc", 2, {"mode": "graph"}),
                                                   ("inc", 1, {"mode": "eager"})]
    runner.enable_decode_graphs(max_seqlen=64, batch_sizes=(2,), capture=False)  # new graphs: counts restart
    engine.step()
    loop._record()
    assert backend.calls("decode_steps_total")[-1] == ("inc", 1, {"mode": "graph"})
    assert backend.calls("decode_running_requests")[-1] == ("set", 2, None)
    assert backend.calls("kv_pages_used")[-1] == ("set", runner.pool.num_pages - runner.pool.free_pages,
                                                  {"role": "decode"})


def test_prefill_loop_records_a_step():
    from types import SimpleNamespace

    from prefill_worker.deployment import PrefillLoop
    from prefill_worker.engine import PrefillResult, ScheduledChunk, StepOutput

    pool = SimpleNamespace(num_pages=50, free_pages=45)
    engine = SimpleNamespace(pool=pool, waiting_tokens=lambda: 300, num_waiting=lambda: 2)
    backend = FakeBackend()
    loop = PrefillLoop(engine, max_batch_tokens=4096, batch_wait_s=0.0,
                       max_queued_tokens=1 << 20, retry_after_s=1, metrics=Metrics(backend))
    # a step that computed a 100-token prompt's last 36 tokens (64 reused) and a 40-token chunk of another
    out = StepOutput([ScheduledChunk("a", 64, 36), ScheduledChunk("b", 0, 40)],
                     [PrefillResult("a", 1, (0, 1), 100, cached_tokens=64)])
    loop._record(out, 0.75)
    assert backend.calls("prefill_tokens_total") == [("inc", 76, None)]  # computed: 36 + 40
    assert backend.calls("prefix_cache_queries_total") == [("inc", 100, None)]  # the finished prompt
    assert backend.calls("prefix_cache_hits_total") == [("inc", 64, None)]
    assert backend.calls("prefill_batch_seconds") == [("observe", 0.75, None)]
    assert backend.calls("prefill_queued_requests") == [("set", 2, None)]
    assert backend.calls("prefill_queued_tokens") == [("set", 300, None)]
    assert backend.calls("kv_pages_used") == [("set", 5, {"role": "prefill"})]
