"""tests/module_order.py: modules ordered longest first by the recorded table (unknown ones as
its median, ties and each module's own items in order), the table merged on recording, and the
cluster block of tests/conftest.py kept whole after the ordering."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass

import pytest

from conftest import CLUSTER_FIXTURE, _group_cluster_modules
from module_order import load_table, longest_modules_first, merged_table, module_of


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple = ()


def _items(rng: random.Random, modules: int) -> list[Item]:
    return [Item(f"tests/test_m{m}.py::test_{t}", (CLUSTER_FIXTURE,) if m % 3 == 0 else ())
            for m in range(modules) for t in range(rng.randint(1, 4))]


@pytest.mark.parametrize("seed", range(5))
def test_longest_modules_first_stable(seed):
    rng = random.Random(seed)
    items = _items(rng, rng.randint(2, 9))
    mods = list(dict.fromkeys(module_of(it.nodeid) for it in items))
    seconds = {m: float(rng.choice([5, 40, 300])) for m in mods if rng.random() < 0.7}
    before = list(items)
    longest_modules_first(items, seconds)
    assert sorted(map(id, items)) == sorted(map(id, before))
    guess = statistics.median(seconds.values()) if seconds else 0.0
    got = list(dict.fromkeys(module_of(it.nodeid) for it in items))
    # expected by hand: each module's seconds (median when unknown), longest first, ties in collection order
    want = [m for _, _, m in sorted((-seconds.get(m, guess), i, m) for i, m in enumerate(mods))]
    assert got == want
    for m in mods:  # a module's items stay together and in order
        mine = [it for it in items if module_of(it.nodeid) == m]
        start = items.index(mine[0])
        assert items[start:start + len(mine)] == [it for it in before if module_of(it.nodeid) == m]
    block = _group_cluster_modules(items)  # conftest's block after the ordering: still whole
    if block:
        start = items.index(block[0])
        assert items[start:start + len(block)] == block


def test_unknown_and_empty_tables():
    items = [Item("tests/test_a.py::t"), Item("tests/test_b.py::t"), Item("tests/test_c.py::t")]
    longest_modules_first(items, {})
    assert [it.nodeid for it in items] == ["tests/test_a.py::t", "tests/test_b.py::t", "tests/test_c.py::t"]
    longest_modules_first(items, {"tests/test_a.py": 10.0, "tests/test_c.py": 30.0, "tests/test_x.py": 50.0})
    # test_b unknown: the median, 30 s, ties with test_c and was collected before it
    assert [it.nodeid for it in items] == ["tests/test_b.py::t", "tests/test_c.py::t", "tests/test_a.py::t"]


def test_merged_table_and_load(tmp_path):
    old = {"tests/test_b.py": 12.0, "tests/test_a.py": 3.0}
    table = merged_table(old, {"tests/test_a.py": 7.6, "tests/test_c.py": 0.4})
    assert table == {"tests/test_a.py": 8, "tests/test_b.py": 12, "tests/test_c.py": 0}
    assert list(table) == sorted(table)
    path = tmp_path / "seconds.json"
    assert load_table(path) == {}
    path.write_text(json.dumps(table))
    assert load_table(path) == {"tests/test_a.py": 8.0, "tests/test_b.py": 12.0, "tests/test_c.py": 0.0}


def test_the_committed_table_names_only_existing_modules():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    table = load_table()
    assert table, "tests/module_seconds.json: record it with pytest --record-module-seconds"
    assert all((root / m).is_file() and v >= 0 for m, v in table.items()), sorted(m for m in table if not (root / m).is_file())
