"""The Ray ``worker_process_setup_hook`` of the test session's cluster (``local_serve`` in
tests/service_helpers.py): the product's hook (router.security.bind_grpc_to_host) plus the
serving environment's set of installed packages.

scripts/test.sh installs the ``test`` and ``bench`` extras on top of the serving environment
(scripts/setup.sh), and lm-eval and nvidia-cutlass bring scikit-learn, SciPy, pandas and pyarrow
with them. transformers (its generation and loss modules) and Ray Serve import each of these at
start-up merely because it is installed, although no replica uses one: about 1.3 s of CPU per
replica process on the CI machine, and a test run starts hundreds of replicas on 2 cores. The
hook marks them absent in every worker (``None`` in ``sys.modules``: ``find_spec`` answers None
and ``import`` raises ImportError), so a replica imports what it would in a serving-only
environment. The pytest process itself (lm-eval, the evals) is untouched."""

from __future__ import annotations

import sys

# installed by the test/bench extras only (pip show: required by lm-eval's deps and nvidia-cutlass)
TEST_ONLY_PACKAGES = ("sklearn", "scipy", "pandas", "pyarrow")
HOOK = "tests.worker_setup.serving_environment"


def serving_environment() -> None:
    for name in TEST_ONLY_PACKAGES:
        sys.modules.setdefault(name, None)  # one already imported (never, in a fresh worker) stays
    from router.security import bind_grpc_to_host

    bind_grpc_to_host()
