"""DecodeScheduler (decode_worker/scheduler.py) on its own: no model, no Ray. A ``PageManager``
(kv_cache/manager.py) stands for the pool; tokens are "generated" by advancing ``seq_len``."""

from __future__ import annotations

import random

import pytest

from decode_worker.scheduler import DecodeScheduler, default_watermark
from kv_cache.manager import PageManager

PS = 4  # tokens per page


def pool(num_pages: int = 16) -> PageManager:
    return PageManager(num_pages, PS)


def adopt(p: PageManager, rid: str, tokens: int) -> None:
    p.adopt(rid, tokens)  # what a transfer's adoption does: pages for the tokens, seq_len set
    assert p.seq_len(rid) == tokens


def decode_step(s: DecodeScheduler) -> tuple[list[str], list[str]]:
    """One step: schedule, then every sequence in the batch writes its next token."""
    batch, preempted = s.schedule()
    for rid in batch:
        s.pool.set_seq_len(rid, s.pool.seq_len(rid) + 1)
    return batch, preempted


def test_admission_in_arrival_order_up_to_max_running():
    p = pool(32)
    s = DecodeScheduler(p, max_running=2, watermark_pages=1)
    for rid in "abc":
        adopt(p, rid, 3)
        s.add(rid)
    assert s.waiting == ["a", "b", "c"] and s.running == []
    assert decode_step(s) == (["a", "b"], [])
    assert s.waiting == ["c"]
    assert s.finish("a") is True and not p.has("a")
    assert decode_step(s) == (["b", "c"], [])
    assert "a" not in s and "c" in s


def test_pages_grow_with_the_tokens_not_up_front():
    p = pool(16)
    s = DecodeScheduler(p, max_running=4, watermark_pages=1)
    adopt(p, "a", 3)  # one page, one free slot
    s.add("a")
    held = []
    for _ in range(9):  # tokens 4..12
        decode_step(s)
        held.append(len(p.pages("a")))
    # a page is taken only when the next token needs it: tokens 4 | 5-8 | 9-12
    assert held == [1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert p.seq_len("a") == 12


def test_a_waiting_request_stays_back_below_the_watermark_but_runs_alone():
    p = pool(4)
    s = DecodeScheduler(p, max_running=8, watermark_pages=2)
    adopt(p, "a", 8)  # 2 pages
    adopt(p, "b", 4)  # 1 page, full: its next token needs a page
    s.add("a")
    s.add("b")
    # a runs (nothing else does); b's page for its next token would leave 0 < 2 free
    batch, preempted = s.schedule()
    assert (batch, preempted) == (["a"], [])
    assert len(p.pages("a")) == 3 and p.free_pages == 0  # a grew into the last free page
    assert s.waiting == ["b"]
    s.finish("a")
    assert s.schedule() == (["b"], [])  # alone: admitted whatever the watermark


def test_no_overtaking_in_the_waiting_queue():
    p = pool(6)
    s = DecodeScheduler(p, max_running=8, watermark_pages=2)
    adopt(p, "a", 7)  # 2 pages, room for its next token
    adopt(p, "big", 4)  # full page: needs one more to run
    adopt(p, "small", 1)  # room for its next token, but behind big
    for rid in ("a", "big", "small"):
        s.add(rid)
    assert s.schedule() == (["a"], [])  # free 2, big would leave 1 < 2: big waits, small waits behind it
    assert s.waiting == ["big", "small"]


def test_preemption_takes_the_newest_waiting_then_running_and_returns_its_pages():
    p = pool(3)
    s = DecodeScheduler(p, max_running=8, watermark_pages=0)
    for rid in ("a", "b", "c"):
        adopt(p, rid, 4)  # each fills its only page: every next token needs a page
        s.add(rid)
    assert p.free_pages == 0
    batch, preempted = s.schedule()
    # a runs alone (b and c would need pages there are none of) and needs a page: c, the
    # newest, gives its page up; b keeps waiting with its own
    assert (batch, preempted) == (["a"], ["c"])
    assert not p.has("c") and len(p.pages("a")) == 2 and len(p.pages("b")) == 1
    assert s.preempted == 1 and "c" not in s and s.waiting == ["b"]
    s.finish("a")
    assert s.schedule() == (["b"], [])
    s.finish("b")
    assert p.used_pages == 0


def test_preemption_prefers_a_waiting_sequence_over_a_running_one():
    p = pool(3)
    s = DecodeScheduler(p, max_running=1, watermark_pages=0)
    adopt(p, "old", 4)
    adopt(p, "new", 8)  # waits: max_running is 1
    s.add("old")
    s.add("new")
    batch, preempted = s.schedule()
    assert (batch, preempted) == (["old"], ["new"])
    assert len(p.pages("old")) == 2 and p.free_pages == 1


def test_the_sequence_that_asks_may_be_the_one_preempted():
    p = pool(2)
    s = DecodeScheduler(p, max_running=4, watermark_pages=0)
    adopt(p, "a", 8)  # the whole pool, full: its next token has no page
    s.add("a")
    assert s.schedule() == ([], ["a"])
    assert p.free_pages == 2 and not s.has_unfinished()


def test_no_page_leaks_over_random_lives():
    rng = random.Random(1234)
    for trial in range(5):
        p = pool(rng.randint(4, 24))
        s = DecodeScheduler(p, max_running=rng.randint(1, 6), watermark_pages=rng.randint(0, 2))
        live: set[str] = set()
        for step in range(60):
            if rng.random() < 0.4:
                rid = f"r{trial}-{step}"
                n = rng.randint(1, 3 * PS)
                if s.claim(rid, s.adoption_pages(n)):
                    adopt(p, rid, n)
                    s.settle(rid)
                    s.add(rid)
                    live.add(rid)
            _, preempted = decode_step(s)
            live -= set(preempted)
            for rid in sorted(live):
                if rng.random() < 0.1:  # finished or cancelled
                    s.finish(rid)
                    live.discard(rid)
            held = sum(len(p.pages(r)) for r in live)
            assert p.used_pages == held and not s.claimed_pages
            assert set(s.waiting) | set(s.running) == live
        for rid in live:
            s.finish(rid)
        assert p.used_pages == 0 and not s.has_unfinished()


def test_claims_fit_next_to_each_other_and_the_watermark():
    p = pool(10)
    s = DecodeScheduler(p, max_running=4, watermark_pages=2)
    assert s.room_pages == 8
    assert s.claim("a", 5) is True and s.claimed_pages == 5 and s.room_pages == 3
    assert s.claim("b", 4) is False and s.claimed_pages == 5  # 5 + 4 > 10 - 2: nothing claimed
    assert s.claim("b", 3) is True and s.room_pages == 0
    with pytest.raises(ValueError, match="request_id"):
        s.claim("a", 1)
    adopt(p, "a", 5 * PS)
    s.settle("a")  # adopted: the pool counts its 5 pages now
    assert s.claimed_pages == 3 and s.room_pages == 0
    s.settle("b")  # gave up
    s.settle("b")  # a claim settles once
    assert s.claimed_pages == 0 and s.room_pages == 3


def test_a_request_alone_is_admitted_past_the_watermark():
    p = pool(8)
    s = DecodeScheduler(p, max_running=4, watermark_pages=2)
    assert s.fits_ever(8) and not s.fits_ever(9)
    assert s.claim("whole", 8) is True  # nobody else: the pool holds it
    assert s.claim("more", 1) is False


def test_adoption_pages_counts_a_groups_partial_page_copies():
    s = DecodeScheduler(pool(), max_running=4)
    assert s.adoption_pages(8) == 2  # full pages only
    assert s.adoption_pages(9) == 3
    assert s.adoption_pages(9, num_choices=3) == 5  # + a copy of the partial page per extra choice
    assert s.adoption_pages(8, num_choices=3) == 2  # full pages are shared


def test_a_default_max_tokens_chat_no_longer_reserves_its_whole_context():
    """Chat without max_tokens runs to the end of the context; the replica admits it by its
    prompt's pages and grows it page by page, so two such chats fit where a whole-context
    reservation (its ``DecodeCall.footprint``) fitted only one."""
    pytest.importorskip("pydantic")  # the ingress's request models (the GPU machine has no Ray, no pydantic)
    from model_executor.tokenizer import ByteTokenizer
    from router.parsing import RequestParser
    from serving.messages import DecodeCall

    ctx_pages = 32
    parser = RequestParser(ByteTokenizer(), model_id="m", max_model_len=ctx_pages * PS, default_max_tokens=8,
                           max_sequence_tokens=ctx_pages * PS, page_size=PS)
    rng = random.Random(7)
    text = "".join(rng.choice("abcdefgh") for _ in range(10))
    req = parser.parse({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat")
    prompt = len(req.prompt_token_ids)
    assert req.max_tokens == ctx_pages * PS - prompt  # until the context ends
    call = DecodeCall(request_id="c1", ticket=None, kv_len=prompt, first_token=1, params=req.sampling_params())
    assert call.footprint(PS) == ctx_pages  # what the old ledger reserved: the whole context

    p = pool(ctx_pages + ctx_pages // 2)
    s = DecodeScheduler(p, max_running=8, watermark_pages=1)
    for rid in ("c1", "c2"):
        pages = s.adoption_pages(call.kv_len)
        assert s.claim(rid, pages) is True
        adopt(p, rid, call.kv_len)
        s.settle(rid)
        s.add(rid)
    s.schedule()
    for rid in ("c1", "c2"):  # after admission: the prompt's pages and its next token's
        assert len(p.pages(rid)) == -(-(prompt + 1) // PS) < call.footprint(PS)


def test_bad_arguments_name_themselves():
    p = pool(4)
    for kwargs, name in [({"max_running": 0}, "max_running"), ({"max_running": True}, "max_running"),
                         ({"watermark_pages": -1}, "watermark_pages"), ({"watermark_pages": 4}, "watermark_pages"),
                         ({"watermark_pages": 1.5}, "watermark_pages"), ({"ensure_capacity": 3}, "ensure_capacity")]:
        with pytest.raises(ValueError, match=name):
            DecodeScheduler(p, **kwargs)
    s = DecodeScheduler(p)
    with pytest.raises(ValueError, match="kv_len"):
        s.adoption_pages(0)
    with pytest.raises(ValueError, match="num_choices"):
        s.adoption_pages(4, num_choices=0)
    with pytest.raises(ValueError, match="pages"):
        s.claim("a", -1)
    with pytest.raises(ValueError, match="request_id"):
        s.claim(7, 1)
    with pytest.raises(ValueError, match="request_id"):
        s.add("ghost")  # holds no pages
    adopt(p, "a", 2)
    s.add("a")
    with pytest.raises(ValueError, match="request_id"):
        s.add("a")
    assert s.finish("ghost") is False


def test_default_watermark_is_a_small_share_of_the_pool():
    assert default_watermark(1) == 0
    assert default_watermark(2) == 1
    assert default_watermark(1000) == 10
    assert DecodeScheduler(pool(1000)).watermark_pages == 10
