"""serving.prefill_client.PrefillClient: the one client of the prefill replicas' side calls
(the ingress and the decode replicas both use it). Fake Serve handles record the pinned calls."""

from __future__ import annotations

import asyncio
import random

import pytest

from serving.messages import PagesReleased, ReleasePages, SendPages, SendReply, StagePages, StageReply
from serving.prefill_client import RELEASE_TIMEOUT_S, PrefillClient


class _Method:
    def __init__(self, log: list, name: str, answer) -> None:
        self.log, self.name, self.answer = log, name, answer

    async def _reply(self, request):
        return await self.answer(request) if asyncio.iscoroutinefunction(self.answer) else self.answer(request)

    def remote(self, request, routing=None):
        self.log.append((self.name, request, routing))
        return self._reply(request)


class _Handle:
    def __init__(self, log: list, answers: dict) -> None:
        for name, answer in answers.items():
            setattr(self, name, _Method(log, name, answer))


def _client(answers: dict, **kwargs):
    log, made = [], []

    def get_handle(deployment, app):
        made.append((app, deployment))
        return _Handle(log, answers)

    return PrefillClient(get_handle=get_handle, **kwargs), log, made


def _sender(rng: random.Random) -> dict:
    return {"app": "llm", "deployment": "PrefillServer", "replica_id": f"rep-{rng.randrange(10**6)}", "host": "h"}


def test_each_call_is_pinned_to_the_sender_replica_and_shares_one_handle():
    rng = random.Random(0)
    sent = SendReply(True, checksums=(rng.randrange(1 << 63),))
    staged = StageReply(True, ticket="ticket")
    client, log, made = _client({"send_pages": lambda r: sent, "stage_pages": lambda r: staged,
                                 "release_pages": lambda r: PagesReleased(True)})
    sender = _sender(rng)
    send = SendPages(request_id="r", sender_id=sender["replica_id"], receiver_id="D", host="h", port=1,
                     prefix="fpkv/x/", generation=1, backend="gloo", timeout_s=1.0, layers_per_chunk=1)
    stage = StagePages(request_id="r", sender_id=sender["replica_id"], transport="gloo")

    async def go():
        return (await client.send_pages(sender, send), await client.stage_pages(sender, stage),
                await client.release_pages(sender, "r"))

    assert asyncio.run(go()) == (sent, staged, PagesReleased(True))
    assert made == [("llm", "PrefillServer")]  # one handle per deployment, asked for once
    assert [(name, req) for name, req, _ in log] == [("send_pages", send), ("stage_pages", stage),
                                                      ("release_pages", ReleasePages("r"))]
    assert all(routing["replica"] == sender["replica_id"] for _, _, routing in log)


def test_release_is_fire_and_forget_and_bounded_by_the_timeout():
    rng = random.Random(1)

    async def never(request):
        await asyncio.sleep(3600)

    client, log, made = _client({"release_pages": never}, timeout_s=0.05)
    sender = _sender(rng)

    async def go():
        task = client.release(sender, "r")  # returns at once
        assert not task.done()
        await task  # the timeout ends it; the failure is logged, not raised
        with pytest.raises(asyncio.TimeoutError):
            await client.release_pages(sender, "s")

    asyncio.run(go())
    assert [req for _, req, _ in log] == [ReleasePages("r"), ReleasePages("s")]
    # the failed release dropped its handle: the next call asked for a new one
    assert made == [("llm", "PrefillServer")] * 2
    assert PrefillClient().timeout_s == RELEASE_TIMEOUT_S


def test_release_runs_outside_the_callers_request_context():
    """Serve makes a handle call in a request's context that request's child, cancelled with
    it: a release (made as a request ends or is cancelled) must not see the caller's context,
    Serve's request context included."""
    import contextvars

    serve_context = pytest.importorskip("ray.serve.context")
    mine = contextvars.ContextVar("mine", default=None)
    seen = []

    def answer(request):
        seen.append((mine.get(), serve_context._serve_request_context.get()))
        return PagesReleased(True)

    client, log, _ = _client({"release_pages": answer})
    caller = serve_context._RequestContext(route="/x", request_id="parent-" + str(random.Random(2).random()))

    async def go():
        mine.set("caller")
        serve_context._serve_request_context.set(caller)
        await client.release(_sender(random.Random(3)), "r")
        return mine.get(), serve_context._serve_request_context.get()

    assert asyncio.run(go()) == ("caller", caller)  # the caller's own context is untouched
    (got_mine, got_serve), = seen
    assert got_mine is None and got_serve is None  # Serve's default: no parent request


def test_the_ingress_releaser_addresses_the_handle_deployment():
    rng = random.Random(2)
    client, log, made = _client({"release_pages": lambda r: PagesReleased(True)})
    lease = type("Lease", (), {"replica_id": f"rep-{rng.randrange(100)}", "request_id": "req-1"})()
    handle = type("H", (), {"app_name": "llm", "deployment_name": "PrefillServer"})()

    async def go():
        client.lease_releaser(handle)(lease)
        client.lease_releaser(object())(lease)  # no Serve names (a test's fake handle): nothing to call
        await asyncio.gather(*client._background)

    asyncio.run(go())
    assert made == [("llm", "PrefillServer")]
    assert [(n, r, h["replica"]) for n, r, h in log] == [("release_pages", ReleasePages("req-1"), lease.replica_id)]


@pytest.mark.parametrize("sender", [None, {}, {"replica_id": "r"}, {"app": "a", "deployment": 3, "replica_id": "r"},
                                    {"app": "a", "deployment": "d", "replica_id": ""}])
def test_a_sender_without_a_serve_address_is_refused(sender):
    client, log, made = _client({"release_pages": lambda r: PagesReleased(True)})
    with pytest.raises(ValueError, match="sender"):
        asyncio.run(client.release_pages(sender, "r"))
    asyncio.run(client._release(sender, "r"))  # fire and forget: logged, never raised
    assert log == [] and made == []


@pytest.mark.parametrize("kwargs,name", [({"timeout_s": 0}, "timeout_s"), ({"timeout_s": True}, "timeout_s"),
                                         ({"timeout_s": "30"}, "timeout_s"), ({"get_handle": 5}, "get_handle")])
def test_construction_errors(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PrefillClient(**kwargs)
