"""tests/conftest.py's ordering: the modules that use the session's Ray + Serve run as one block
at the place of the first of them, every other item keeps its order (random module layouts)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from conftest import CLUSTER_FIXTURE, _group_cluster_modules


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple


def _layout(rng: random.Random) -> list[Item]:
    items = []
    for m in range(rng.randint(1, 8)):
        uses = rng.random() < 0.4
        for t in range(rng.randint(1, 4)):
            # in a module that uses the cluster, some tests (units) may not ask for it
            names = ("tmp_path", CLUSTER_FIXTURE) if uses and rng.random() < 0.6 else ("tmp_path",)
            items.append(Item(f"tests/test_m{m}.py::test_{t}", names))
    return items


@pytest.mark.parametrize("seed", range(6))
def test_cluster_modules_run_as_one_block_where_the_first_was(seed):
    rng = random.Random(seed)
    items = _layout(rng)
    before = list(items)
    users = {it.nodeid.split("::")[0] for it in items if CLUSTER_FIXTURE in it.fixturenames}
    block = _group_cluster_modules(items)
    assert sorted(map(id, items)) == sorted(map(id, before))  # nothing dropped or added
    inside = [it for it in before if it.nodeid.split("::")[0] in users]
    assert block == inside  # every item of those modules, in their own order
    if not users:
        assert items == before
        return
    start = items.index(block[0])
    assert start == before.index(block[0]) and items[start:start + len(block)] == block
    assert [it for it in items if it not in block] == [it for it in before if it not in block]
