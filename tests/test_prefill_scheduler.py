"""PrefillScheduler on its own (no model, no pool): the token budget, chunking, the two
policies (fcfs; shortest_first with its aging bound), admission against a fake page count,
aborts and failed forwards. Expected step compositions are written out by hand."""

from __future__ import annotations

import random

import pytest

from prefill_worker.scheduler import PREFILL_POLICIES, PrefillScheduler


class Pages:
    """A fake pool: ``free`` pages of ``size`` tokens; admission reserves a whole prompt."""

    def __init__(self, free: int, size: int = 16) -> None:
        self.free, self.size, self.held = free, size, {}

    def admit(self, seq) -> bool:
        need = -(-seq.prompt_len // self.size)
        if need > self.free:
            return False
        self.free -= need
        self.held[seq.request_id] = need
        return True

    def release(self, rid: str) -> None:
        self.free += self.held.pop(rid)


def comp(chunks):
    return [(c.request_id, c.start, c.num_tokens) for c in chunks]


def run_step(s: PrefillScheduler, now: float, pages: Pages | None = None):
    chunks = s.schedule(now)
    finished, aborted = s.commit(chunks)
    if pages is not None:
        for seq in finished + aborted:
            pages.release(seq.request_id)
    return comp(chunks), [q.request_id for q in finished]


def test_fcfs_gives_spare_budget_to_the_next_prompts_in_the_same_step():
    s = PrefillScheduler(max_batch_tokens=48, chunk_size=32, policy="fcfs")
    s.add("long", 100, now=0.0)
    assert run_step(s, 0.1) == ([("long", 0, 32)], [])
    s.add("short", 20, now=0.2)
    # the long prompt's chunk first, then what is left of the budget to the arrival
    assert run_step(s, 0.3) == ([("long", 32, 32), ("short", 0, 16)], [])
    assert run_step(s, 0.4) == ([("long", 64, 32), ("short", 16, 4)], ["short"])
    assert run_step(s, 0.5) == ([("long", 96, 4)], ["long"])
    assert len(s) == 0 and s.schedule(0.6) == []


def test_shortest_first_preempts_a_long_prompt_at_a_chunk_boundary():
    s = PrefillScheduler(max_batch_tokens=32, chunk_size=32, policy="shortest_first", max_wait_s=60.0)
    s.add("long", 160, now=0.0)
    assert run_step(s, 0.1) == ([("long", 0, 32)], [])
    s.add("short", 20, now=0.2)
    # the arrival runs at the next boundary; the long prompt resumes with what budget is left
    assert run_step(s, 0.3) == ([("short", 0, 20), ("long", 32, 12)], ["short"])
    assert run_step(s, 0.4) == ([("long", 44, 32)], [])
    # under fcfs the same arrival waits behind the running prompt's full chunk
    f = PrefillScheduler(max_batch_tokens=32, chunk_size=32, policy="fcfs")
    f.add("long", 160, now=0.0)
    run_step(f, 0.1)
    f.add("short", 20, now=0.2)
    assert run_step(f, 0.3) == ([("long", 32, 32)], [])


def test_shortest_first_orders_by_remaining_work_not_prompt_length():
    s = PrefillScheduler(max_batch_tokens=64, chunk_size=64, policy="shortest_first", max_wait_s=60.0)
    s.add("b", 200, now=0.0)
    for t in range(3):
        s.commit(s.schedule(0.1 + t))  # b: 192 of 200 tokens done
    s.add("c", 60, now=5.0)
    # remaining causal pairs: b 8 * (200 + 192 + 1) / 2 = 1572, c 60 * 61 / 2 = 1830: the
    # longer prompt goes first, it has less left to do
    assert comp(s.schedule(5.1)) == [("b", 192, 8), ("c", 0, 56)]


def test_aging_bound_serves_overdue_prompts_first_in_arrival_order():
    s = PrefillScheduler(max_batch_tokens=1000, policy="shortest_first", max_wait_s=5.0)
    s.add("older-big", 700, now=0.0)
    s.add("old-mid", 320, now=1.0)
    s.add("young-big", 640, now=8.0)
    s.add("young-small", 64, now=9.0)
    order = [q.request_id for q in s.ordered(10.0)]
    assert order == ["older-big", "old-mid", "young-small", "young-big"]
    # whole prompts: older-big alone would leave 300; old-mid (320) does not fit and waits,
    # young-small does (shortest_first looks past a prompt that does not fit)
    assert comp(s.schedule(10.0)) == [("older-big", 0, 700), ("young-small", 0, 64)]
    # max_wait_s = 0: everything is overdue, arrival order again
    z = PrefillScheduler(max_batch_tokens=1000, policy="shortest_first", max_wait_s=0.0)
    for rid, n in (("x", 600), ("y", 900), ("z", 50)):
        z.add(rid, n, now=0.0)
    assert [q.request_id for q in z.ordered(0.0)] == ["x", "y", "z"]


def test_page_shortage_fcfs_holds_back_and_an_overdue_prompt_keeps_its_turn():
    pages = Pages(free=12)  # 192 tokens
    f = PrefillScheduler(max_batch_tokens=1000, policy="fcfs", admit=pages.admit)
    f.add("big", 300, now=0.0)  # 19 pages: never now
    f.add("small", 30, now=1.0)
    assert f.schedule(2.0) == []  # fcfs: nothing overtakes the head of the line
    pages = Pages(free=12)
    s = PrefillScheduler(max_batch_tokens=1000, policy="shortest_first", max_wait_s=5.0, admit=pages.admit)
    s.add("big", 300, now=0.0)
    s.add("small", 30, now=1.0)
    assert comp(s.schedule(2.0)) == [("small", 0, 30)]  # big is young: small goes past it
    s.commit(s.schedule(2.0))
    pages = Pages(free=12)
    s = PrefillScheduler(max_batch_tokens=1000, policy="shortest_first", max_wait_s=5.0, admit=pages.admit)
    s.add("big", 300, now=0.0)
    s.add("small", 30, now=9.0)
    assert s.schedule(10.0) == []  # big is overdue and waits for pages: nothing younger is admitted


def test_whole_prompts_split_only_at_the_budget():
    s = PrefillScheduler(max_batch_tokens=100, policy="fcfs")
    s.add("a", 60, now=0.0)
    s.add("b", 70, now=0.1)
    s.add("c", 250, now=0.2)
    assert run_step(s, 1.0) == ([("a", 0, 60)], ["a"])  # b does not fit beside a: next forward
    assert run_step(s, 1.1) == ([("b", 0, 70)], ["b"])
    assert run_step(s, 1.2) == ([("c", 0, 100)], [])  # alone and longer than the budget
    assert run_step(s, 1.3) == ([("c", 100, 100)], [])
    assert run_step(s, 1.4) == ([("c", 200, 50)], ["c"])


@pytest.mark.parametrize("policy", PREFILL_POLICIES)
@pytest.mark.parametrize("chunk_size", [None, 7, 64])
def test_no_forward_exceeds_the_budget_and_every_prompt_finishes_once(policy, chunk_size):
    rng = random.Random(hash((policy, chunk_size)) & 0xFFFF)
    pages = Pages(free=40, size=16)
    s = PrefillScheduler(max_batch_tokens=96, chunk_size=chunk_size, policy=policy, max_wait_s=3.0,
                         admit=pages.admit)
    lengths = {f"r{i}": rng.randint(1, 400) for i in range(40)}
    done_tokens = {rid: 0 for rid in lengths}
    arrivals = sorted(lengths, key=lambda r: int(r[1:]))
    finished, now = [], 0.0
    while len(finished) < len(lengths):
        now += 0.25
        while arrivals and rng.random() < 0.5:
            rid = arrivals.pop(0)
            s.add(rid, lengths[rid], now=now)
        chunks = s.schedule(now)
        assert sum(c.num_tokens for c in chunks) <= 96
        assert len({c.request_id for c in chunks}) == len(chunks)  # one chunk per prompt
        for c in chunks:
            assert c.start == done_tokens[c.request_id]  # contiguous progress, nothing recomputed
            if chunk_size is not None:
                assert c.num_tokens <= chunk_size
            done_tokens[c.request_id] += c.num_tokens
        fin, _ = s.commit(chunks)
        for seq in fin:
            pages.release(seq.request_id)
        finished += [q.request_id for q in fin]
        assert chunks or not len(s) or arrivals  # progress whenever something is admitted
    assert sorted(finished) == sorted(lengths) and done_tokens == lengths and pages.free == 40


def test_aborted_in_flight_prompt_comes_out_of_commit_and_a_failed_forward_takes_its_prompts_out():
    s = PrefillScheduler(max_batch_tokens=64, chunk_size=32, policy="fcfs")
    s.add("a", 40, now=0.0)
    s.add("b", 100, now=0.0)
    chunks = s.schedule(0.1)
    assert comp(chunks) == [("a", 0, 32), ("b", 0, 32)]
    s.get("a").aborted = True  # what the engine does for a prompt whose forward is running
    finished, aborted = s.commit(chunks)
    assert finished == [] and [q.request_id for q in aborted] == ["a"] and s.get("a") is None
    chunks = s.schedule(0.2)
    assert comp(chunks) == [("b", 32, 32)]
    assert [q.request_id for q in s.fail(chunks)] == ["b"] and len(s) == 0


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        PrefillScheduler(max_batch_tokens=0)
    with pytest.raises(ValueError, match="chunk_size"):
        PrefillScheduler(max_batch_tokens=8, chunk_size=True)
    with pytest.raises(ValueError, match="policy"):
        PrefillScheduler(max_batch_tokens=8, policy="lifo")
    with pytest.raises(ValueError, match="max_wait_s"):
        PrefillScheduler(max_batch_tokens=8, max_wait_s=-1)
    s = PrefillScheduler(max_batch_tokens=8)
    s.add("x", 4, now=0.0)
    with pytest.raises(ValueError, match="request_id"):
        s.add("x", 4, now=0.0)
    with pytest.raises(ValueError, match="prompt_len"):
        s.add("y", 0, now=0.0)
    with pytest.raises(ValueError, match="done_tokens"):
        s.add("z", 4, now=0.0, done_tokens=4)


def test_batch_level_discipline_runs_a_batch_to_completion_before_admitting():
    """interleave=False: the engine's earlier discipline, kept for bench_scheduler."""
    s = PrefillScheduler(max_batch_tokens=64, chunk_size=64, policy="shortest_first", max_wait_s=60.0,
                         interleave=False)
    s.add("long", 150, now=0.0)
    assert run_step(s, 0.1) == ([("long", 0, 64)], [])
    s.add("short", 10, now=0.2)
    assert run_step(s, 0.3) == ([("long", 64, 64)], [])  # the arrival waits for the batch
    assert run_step(s, 0.4) == ([("long", 128, 22)], ["long"])
    assert run_step(s, 0.5) == ([("short", 0, 10)], ["short"])
    # a batch is formed of whole prompts that fit the budget together
    for rid, n in (("a", 30), ("b", 30), ("c", 30)):
        s.add(rid, n, now=1.0)
    assert run_step(s, 1.1) == ([("a", 0, 30), ("b", 0, 30)], ["a", "b"])
    with pytest.raises(ValueError, match="interleave"):
        PrefillScheduler(max_batch_tokens=8, interleave=1)
