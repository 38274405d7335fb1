"""The KV transfer benchmark's CPU smoke mode (gloo, tiny sizes) runs end to end, so the
2-GPU script cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_writes_a_complete_report(tmp_path):
    out = tmp_path / "kv.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GIT_COMMIT": "test-commit"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kv_transfer.py"), "--cpu-smoke",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["env"]["commit"] == "test-commit" and report["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert [r["tokens"] for r in report["results"]] == [64, 1000] and not report["notes"]
    for r in report["results"]:
        assert r["payload_bytes"] == -(-r["tokens"] // 16) * 16 * 2 * 2 * 2 * 16 * 4
        assert r["bit_exact"] == {"channel": True, "object_store": True}
        for key in ("peer_copy", "raw_p2p", "channel", "object_store"):
            assert r[key]["gbps"] > 0 and r[key]["skipped"] is None, key
        assert r["channel"]["detail"]["export_ms"] > 0 and r["channel_vs_copy"] > 0
        detail = r["channel"]["detail"]
        assert detail["chunks"] == 2 and detail["ring_depth"] == 2  # one layer per chunk (chunk_bytes=1)
        assert detail["chunk_mib"] * 2**20 == r["payload_bytes"] // 2
        assert detail["chunk_gather_ms"] > 0 and detail["chunk_scatter_ms"] > 0
    assert report["counters"]["decode"]["channel_receives"] == 2 * 3  # (warmup + iters) per size
    assert report["counters"]["prefill"]["channel_staged"] == 0


def test_kv_pack_cpu_smoke(tmp_path):
    """bench_kv_pack runs (gather / checksum / scatter timings) and its checks hold on CPU."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kv_pack.py"
    spec = importlib.util.spec_from_file_location("bench_kv_pack", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "pack.json"
    assert mod.main(["--cpu-smoke", "--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [40, 100]
    assert all(r[k] > 0 for r in rows for k in ("gather_ms", "gather_bytes_ms", "checksum_ms", "scatter_ms"))
