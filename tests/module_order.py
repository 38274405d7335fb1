"""A pytest plugin that hands out the longest test modules first, from a recorded table of each
module's seconds (tests/module_seconds.json). Loaded by tests/conftest.py.

scripts/test.sh runs two pytest-xdist workers with ``--dist loadfile``: a worker takes a whole
module at a time, in the order the modules were collected (``--no-loadscope-reorder``; xdist's
own default orders them by their number of tests, which put the five-minute autoscaling module
behind 36 others and left modules of one or two tests of a minute or more for last). The run
ends with its last module, so the long ones go first and the short ones fill in at the end
(longest processing time first). Modules the table does not name (new ones) count as its
median. The order decides nothing else: every collected test still runs.

``pytest --record-module-seconds`` (scripts/test.sh passes its arguments on) adds up each
module's setup, call and teardown seconds and writes them into the table, keeping the modules
that this run did not run."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("module_seconds.json")
MEASURED: dict[str, float] = defaultdict(float)  # this process's reports: module -> seconds


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_table(path: Path = TABLE) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_modules_first(items: list, seconds: dict[str, float]) -> None:
    """Orders ``items`` by their module's recorded seconds, longest first (stable: a module's
    items and modules of equal seconds keep their order)."""
    guess = statistics.median(seconds.values()) if seconds else 0.0
    rank = {}
    for it in items:
        mod = module_of(it.nodeid)
        rank.setdefault(mod, (-seconds.get(mod, guess), len(rank)))
    items.sort(key=lambda it: rank[module_of(it.nodeid)])


def merged_table(old: dict[str, float], measured: dict[str, float]) -> dict[str, int]:
    """``old`` with the modules of ``measured`` replaced, in whole seconds, sorted by name."""
    table = {**old, **measured}
    return {k: round(table[k]) for k in sorted(table)}


def pytest_addoption(parser):
    parser.addoption("--record-module-seconds", action="store_true",
                     help=f"write each module's seconds into {TABLE.name} (the xdist order, longest first)")


def pytest_runtest_logreport(report):
    # under xdist the controller is handed every worker's reports too
    MEASURED[module_of(report.nodeid)] += report.duration


def pytest_unconfigure(config):
    if not config.getoption("record_module_seconds") or hasattr(config, "workeroutput"):
        return  # not asked, or an xdist worker (its controller writes)
    if MEASURED:
        TABLE.write_text(json.dumps(merged_table(load_table(), dict(MEASURED)), indent=1) + "\n")
