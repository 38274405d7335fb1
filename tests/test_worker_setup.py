"""tests/worker_setup.py, the session cluster's worker setup hook: in a fresh interpreter it
hides the test-only packages from imports and from transformers' availability probes and still
applies the product's hook; the session cluster's workers run it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.worker_setup import HOOK, TEST_ONLY_PACKAGES

_PROBE = """
import importlib, importlib.util, json, sys
names = {names!r}
before = [n for n in names if importlib.util.find_spec(n) is not None]
from tests.worker_setup import serving_environment
serving_environment()
after = [n for n in names if importlib.util.find_spec(n) is not None]
refused = []
for n in names:
    try:
        importlib.import_module(n)
    except ImportError:
        refused.append(n)
from transformers.utils import is_scipy_available, is_sklearn_available
import ray.serve._private.default_impl as impl
print(json.dumps({{"before": before, "after": after, "refused": refused,
                  "transformers_sees": [is_sklearn_available(), is_scipy_available()],
                  "grpc_hook": getattr(impl.add_grpc_address, "_flashprefill", False)}}))
"""


def test_the_hook_hides_the_test_only_packages_in_a_fresh_interpreter():
    installed = [n for n in TEST_ONLY_PACKAGES if importlib.util.find_spec(n) is not None]
    if not installed:
        pytest.skip("none of the test-only packages is installed: nothing to hide")
    out = subprocess.run([sys.executable, "-c", _PROBE.format(names=TEST_ONLY_PACKAGES)], check=True,
                         capture_output=True, text=True, timeout=300).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["before"] == installed
    assert seen["after"] == [] and seen["refused"] == list(TEST_ONLY_PACKAGES)
    assert seen["transformers_sees"] == [False, False]
    assert seen["grpc_hook"] is True  # the product's hook still runs


def test_the_session_cluster_workers_run_the_hook(serve_cluster):
    import ray

    @ray.remote(num_cpus=0)
    def hidden() -> list[str]:
        return [n for n in TEST_ONLY_PACKAGES if n in sys.modules and sys.modules[n] is None]

    assert ray.get_runtime_context().runtime_env.get("worker_process_setup_hook") == HOOK
    assert ray.get(hidden.remote(), timeout=300) == list(TEST_ONLY_PACKAGES)
