"""A pytest plugin that counts the ``ray.init`` and ``serve.start`` calls made in the pytest
process and prints them at the end of the run: each start of a local Ray and Serve costs tens of
seconds on a small machine, and unlike wall time the count does not vary with machine load.
Loaded by tests/conftest.py; on another checkout: ``pytest -p tests.ray_starts ...``. Clusters
that a test starts in a subprocess (``scripts/local_cluster.py``, ``router run``) are not seen.
Under pytest-xdist (``scripts/test.sh`` runs two workers) each worker is its own pytest process
with its own session cluster: the workers send their counts to the controller, which prints
them per worker."""

from __future__ import annotations

import functools
import sys

import pytest

STARTS = {"ray.init": 0, "serve.start": 0}


def _counted(fn, key: str):
    if getattr(fn, "_counted_as", None):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        STARTS[key] += 1
        return fn(*args, **kwargs)

    wrapper._counted_as = key
    return wrapper


def pytest_collection_finish(session):
    # only where a collected module imported Ray: a kernels-only run must not pay for the import
    if "ray" not in sys.modules:
        return
    import ray
    from ray import serve

    ray.init = _counted(ray.init, "ray.init")
    serve.start = _counted(serve.start, "serve.start")


WORKERS: dict[str, dict[str, int]] = {}  # the controller's copy of each xdist worker's counts


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker only
    if workeroutput is not None:
        workeroutput["ray_starts"] = dict(STARTS)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown (and never called) without xdist
def pytest_testnodedown(node, error):
    counts = getattr(node, "workeroutput", {}).get("ray_starts")
    if counts:
        WORKERS[node.gateway.id] = counts


def _line(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def pytest_terminal_summary(terminalreporter):
    if any(STARTS.values()):
        terminalreporter.write_line("Ray/Serve starts in this process: " + _line(STARTS))
    for worker, counts in sorted(WORKERS.items()):
        if any(counts.values()):
            terminalreporter.write_line(f"Ray/Serve starts in xdist worker {worker}: " + _line(counts))
