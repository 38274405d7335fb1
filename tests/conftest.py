"""Fixtures shared by the test modules, and the one local Ray + Serve of a test session.

Starting Ray and Serve costs 30-40 s on a 2-core machine, so the session starts them once
(``serve_cluster``: on 127.0.0.1, HTTP and gRPC proxies, 8 CPUs), and only when a collected
test needs them: ``pytest tests/test_kernels_only.py`` starts no Ray. A service test module
declares its applications and asks for ``service``::

    SERVE_APPS = {"mine": {"config": CONFIG, "prefill": {"num_replicas": 1, ...}, "decode": {...},
                           "ingress": {"ray_actor_options": {"num_cpus": 0.25}}}}

    def test_something(service):
        r = service["http"].post("/mine/v1/completions", json={...})   # route prefix /<app name>
        stub.Generate(req, metadata=(("application", "mine"),))        # over service["channel"]

``SERVE_APPS`` maps an application name, unique in the suite, to the keyword arguments of
``router.app.build_application``. ``service`` deploys them for the module and deletes them
after its last test, so the next module finds Serve empty; it yields ``http`` (an
``httpx.Client`` on the HTTP proxy), ``channel`` (a gRPC channel to the gRPC proxy), ``base``
(the HTTP proxy's URL), ``target`` (the gRPC proxy's address), ``http_port`` and ``grpc_port``.
A module may override ``service`` with a fixture of the same name that takes the shared one
and adds its own clients (tests/test_openai_api.py). A test that needs Ray without Serve asks
for ``serve_cluster``. What a module changes in the cluster beyond its applications (named
actors, placement groups, environment variables) it undoes itself.

Modules run longest first, by their recorded seconds (tests/module_order.py). Modules that use
the cluster run as one block, at the place of the first of them (their own order kept), and the
cluster stops after the block: the tests outside it, some of which start clusters of their own
in subprocesses (tests/test_ports.py, the fake multi-node cluster of tests/test_cluster_yaml.py
and tests/test_autoscaling.py), never run next to it. Under pytest-xdist each worker runs some of
the block's modules on a cluster of its own, and stops it when its next module is one after the
block (xdist hands modules out in the collection's order: none of the block comes to it after that).
"""

import pytest
import torch

from kernels.triton_interpreter import apply_if_interpreting
from module_order import (  # noqa: F401 - hooks
    load_table,
    longest_modules_first,
    pytest_addoption,
    pytest_runtest_logreport,
    pytest_unconfigure,
)
from ray_starts import (  # noqa: F401 - hooks
    pytest_collection_finish,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
)

# The interpreter's fixes live in the library (kernels/triton_interpreter.py) and are applied
# when a kernels.triton_* module is imported under TRITON_INTERPRET=1; applying them here too
# covers tests that launch their own Triton kernels before importing one.
apply_if_interpreting()

CLUSTER_FIXTURE = "serve_cluster"
_LAST_CLUSTER_ITEM = pytest.StashKey[str | None]()
_AFTER_BLOCK = pytest.StashKey[frozenset]()  # the modules after the block, in the collection's order
_CLUSTER = pytest.StashKey[object]()


def _module_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _group_cluster_modules(items: list) -> list:
    """Moves the modules with a test that uses the cluster next to each other (stable), so the
    cluster lives through one block of the run; the block's items."""
    users = {_module_of(it) for it in items if CLUSTER_FIXTURE in getattr(it, "fixturenames", ())}
    if not users:
        return []
    first = next(i for i, it in enumerate(items) if _module_of(it) in users)
    block = [it for it in items if _module_of(it) in users]
    rest = [it for it in items if _module_of(it) not in users]
    items[:] = rest[:first] + block + rest[first:]
    return block


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the block's last item is one that runs
def pytest_collection_modifyitems(config, items):
    longest_modules_first(items, load_table())  # tests/module_order.py: xdist hands modules out in this order
    block = _group_cluster_modules(items)
    config.stash[_LAST_CLUSTER_ITEM] = block[-1].nodeid if block else None
    config.stash[_AFTER_BLOCK] = frozenset(_module_of(it) for it in items[items.index(block[-1]) + 1:]) if block else frozenset()
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _Cluster:
    """The session's local Ray + Serve: ports, and a stop that may run early (after the last
    test that uses it) and again at the session's end."""

    def __init__(self):
        import contextlib

        from router.app import GRPC_SERVICER
        from tests.service_helpers import local_serve

        self._stack = contextlib.ExitStack()
        self.http_port, self.grpc_port = self._stack.enter_context(local_serve(GRPC_SERVICER))

    def stop(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def serve_cluster(request):
    """The session's local Ray and Serve (started on first use); ``.http_port``, ``.grpc_port``."""
    pytest.importorskip("ray.serve")
    cluster = _Cluster()
    request.config.stash[_CLUSTER] = cluster
    yield cluster
    cluster.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # after the last module's own teardown (its applications deleted): stop the cluster now,
    # not at the session's end, so the modules after the block run without it; under xdist, a
    # worker whose next module comes after the block runs none of the block's from now on
    result = yield
    stash = item.config.stash
    if _CLUSTER in stash and (item.nodeid == stash.get(_LAST_CLUSTER_ITEM, None) or (
            nextitem is not None and _module_of(nextitem) in stash.get(_AFTER_BLOCK, frozenset()))):
        cluster = stash[_CLUSTER]
        del stash[_CLUSTER]  # stopped once here (and again, a no-op, by the fixture at the session's end)
        cluster.stop()
    return result


@pytest.fixture(scope="module")
def service(request, serve_cluster):
    """The module's ``SERVE_APPS`` deployed into the session's Serve (see the module doc)."""
    grpc = pytest.importorskip("grpc")
    httpx = pytest.importorskip("httpx")
    from tests.service_helpers import deployed

    apps = getattr(request.module, "SERVE_APPS", None)
    if not apps:
        raise ValueError(f"SERVE_APPS: {request.module.__name__} uses the service fixture but declares no applications")
    base, target = f"http://127.0.0.1:{serve_cluster.http_port}", f"127.0.0.1:{serve_cluster.grpc_port}"
    with deployed(apps), httpx.Client(base_url=base, timeout=240.0) as http, grpc.insecure_channel(target) as channel:
        yield {"http": http, "channel": channel, "base": base, "target": target,
               "http_port": serve_cluster.http_port, "grpc_port": serve_cluster.grpc_port}


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny model (random weights, seed 0), one per module: each ModelRunner
    rewires the model's forwards (attention, fused kernels, FP8 layers) and some tests install
    kernels by hand, so modules do not share one (a build takes milliseconds)."""
    from model_executor.loading import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def tiny_runner(tiny):
    """``(tiny, its ModelRunner)``: a 12-page pool of 64-token pages, dense attention."""
    from model_executor import ModelRunner
    from model_executor.loading import make_pool

    return tiny, ModelRunner(tiny.model, make_pool(tiny, num_pages=12, page_size=64), dense_below=1 << 30)


@pytest.fixture
def one_thread():
    """torch on one thread for the test: the reference paths run many small ops, faster on one
    thread and immune to CPU contention."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
