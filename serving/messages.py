"""The messages that cross Ray calls between the ingress and the worker replicas.

Frozen dataclasses: Ray pickles them as they are, and their fields are checked where the data
came from outside (the ingress's HTTP / gRPC parsing, ``router/parsing.py``; frames off the
network, ``kv_transfer``), not again on every internal hop. ``ticket`` is the KV transport's
own (``kv_transfer.transfer``): opaque here.

A request's trip (``docs/ARCHITECTURE.md``): the ingress calls ``PrefillServer.prefill`` with a
:class:`PrefillCall`; that stream yields one :class:`Prefilled` (first token + ticket). The
ingress calls ``DecodeServer.generate`` with a :class:`DecodeCall`; that stream yields
:class:`Adopted` (the pages are in the decode pool) or :class:`TransferFailed`, then
:class:`Tokens` until one says ``finished``.

A group (the ``n`` / ``best_of`` choices of one prompt) makes the same trip once: its
:class:`PrefillCall` lists every choice's sampling params and its :class:`Prefilled` one first
token per choice; its :class:`DecodeCall` lists (first token, params) per choice, the decode
replica adopts the pages once and forks them per choice, and each :class:`Tokens` names its
choice; the stream ends when every choice has had its ``finished`` event.

The side calls, each pinned to one replica: ``PrefillServer.release_pages``
(:class:`ReleasePages` -> :class:`PagesReleased`), ``send_pages`` and ``stage_pages``
(:class:`SendPages` -> :class:`SendReply`, :class:`StagePages` -> :class:`StageReply`: the
transports build and answer those, so they live in ``kv_transfer.wire``, below this layer,
and are re-exported here), and ``DecodeServer.cancel_choice`` (:class:`CancelChoice` ->
:class:`ChoiceCancelled`). Their requests come from another replica: the callee checks them
(``check()``: ``ValueError`` naming the field) and answers a bad one with a refusal, never an
exception. ``serving.prefill_client.PrefillClient`` makes the prefill calls.
"""

from __future__ import annotations

from collections.abc import Sequence
import enum
from dataclasses import dataclass
from typing import Any

from kv_transfer.wire import MAX_REQUEST_ID_LEN, SendPages, SendReply, StagePages, StageReply
from model_executor.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a decode ended (the decode engine's, reported to the ingress)."""

    STOP = "stop"  # emitted a stop token (it is the last output token), or its guide ended
    LENGTH = "length"  # reached max_new_tokens
    KV_EXHAUSTED = "kv_exhausted"  # preempted: no page for a next token, the newest request ends
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class PrefillCall:
    """Prefill a prompt and export its KV pages. ``skip_transfer``: the request ends with its
    first token (no decode, nothing to export). ``ends_at_stop``: the call's first tokens are
    the answer's first (a first attempt; a retry's or resume's are not used): where every
    choice's first token is one of its ``stop_token_ids`` the request ends there as well, so
    nothing is exported and no lease is left for a release message to end (the ingress's
    ``ChoiceReporter`` ends it by the same rule). ``transport``: ``"object_store"`` asks for a
    retry over the object store after a channel transfer failed; None: the replica's own."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    skip_transfer: bool = False
    transport: str | None = None
    sparse_alpha: float | None = None  # this prompt's FlashPrefill V2 alpha (0: dense); None: the replica's
    choices: tuple[SamplingParams, ...] = ()  # a group: one first token per entry (``params``: prompt logprobs)
    # this prompt's other own sparse options: (name, value) pairs of last_dense_tiles, energy_rule,
    # dense_layers (kernels.config.SparseConfig.with_request); empty: the replica's
    sparse_options: tuple[tuple[str, object], ...] = ()
    ends_at_stop: bool = False

    def ended_by(self, first_tokens: Sequence[int]) -> bool:
        """Whether the request ends with these first tokens (one per choice, or the one of a
        single request): ``skip_transfer``, or ``ends_at_stop`` and every first token one of
        its choice's stop tokens."""
        if self.skip_transfer:
            return True
        if not self.ends_at_stop:
            return False
        params = self.choices or (self.params,)
        return len(first_tokens) == len(params) and all(
            int(t) in p.stop_token_ids for t, p in zip(first_tokens, params))


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The prompt is prefilled: its first token, and the ticket of its exported pages (None
    with ``skip_transfer``). Seconds: queued, first forward to first token, export."""

    request_id: str
    first_token: int
    kv_len: int
    cached_tokens: int
    ticket: Any
    replica_id: str
    queue_s: float
    prefill_s: float
    export_s: float
    first_logprob: Any = None  # model_executor.sampling.TokenLogprob, with params.logprobs
    prompt_logprobs: Any = None  # with params.prompt_logprobs: one per prompt token (None first)
    block_density: float | None = None  # the prefill's measured block density (PrefillResult's); None: dense
    first_tokens: tuple[int, ...] = ()  # a group: one per choice (first_token is choice 0's)
    first_logprobs: tuple = ()  # a group: one TokenLogprob (or None) per choice


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """Adopt the pages of ``ticket`` (``kv_len`` tokens) and decode after ``first_token``.
    ``history``: the tokens a resumed request generated before ``first_token`` (the client has
    them; their K/V are in the pages): penalties, the guide, ``min_tokens``/``max_new_tokens``
    and seeded draws go on over them as if the request had never stopped. ``choices``: a group,
    ``(first token, params)`` per choice, each decoded on its own fork of the pages
    (``first_token`` / ``params`` then are choice 0's; a group has no history)."""

    request_id: str
    ticket: Any
    kv_len: int
    first_token: int
    params: SamplingParams
    history: tuple[int, ...] = ()
    choices: tuple[tuple[int, SamplingParams], ...] = ()

    def footprint(self, page_size: int) -> int:
        """Pages this call may grow to on a decode replica: the prompt's full pages once, plus each
        choice's own (its copy of the partial last page and its growth to ``max_new_tokens``)."""
        shared = self.kv_len // page_size
        if not self.choices:  # the history's K/V are in kv_len already and count against max_new_tokens
            return -(-(self.kv_len + self.params.max_new_tokens - len(self.history)) // page_size)
        return shared + sum(-(-(self.kv_len + p.max_new_tokens) // page_size) - shared for _, p in self.choices)


@dataclass(frozen=True, slots=True)
class Adopted:
    """The decode replica holds the request's pages (the prefill side may free its copy)."""

    replica_id: str
    transfer_s: float
    num_pages: int


@dataclass(frozen=True, slots=True)
class TransferFailed:
    """The pages did not arrive. ``reason``: a ``kv_transfer.transfer.TransferFailure`` value;
    ``fallback``: the transport a retry should ask for (``"object_store"`` after a failed
    channel), or None."""

    reason: str
    retryable: bool
    message: str
    replica_id: str
    transport: str | None = None
    fallback: str | None = None


@dataclass(frozen=True, slots=True)
class Tokens:
    """Tokens decoded since the last event. ``first_step_s`` (first event only): submitted to
    the decode loop -> the step that decoded its first token."""

    tokens: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    first_step_s: float | None = None
    logprobs: tuple | None = None  # one TokenLogprob per token, with params.logprobs
    choice: int = 0  # a group's choice these tokens are of


def _check_request_id(value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id: expected a non-empty str of at most {MAX_REQUEST_ID_LEN} characters, "
                         f"got {value!r:.80}")


@dataclass(frozen=True, slots=True)
class ReleasePages:
    """End the lease on ``request_id``'s pages (``PrefillServer.release_pages``): the decode
    replica is done with them, or the ingress abandoned the attempt."""

    request_id: str

    def check(self) -> "ReleasePages":
        _check_request_id(self.request_id)
        return self


@dataclass(frozen=True, slots=True)
class PagesReleased:
    """``ended``: a lease was held and has ended (False: none was, or the request was bad:
    ``message`` says why)."""

    ended: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class CancelChoice:
    """Stop choice ``choice`` of the group ``request_id`` (``DecodeServer.cancel_choice``)."""

    request_id: str
    choice: int

    def check(self) -> "CancelChoice":
        _check_request_id(self.request_id)
        if isinstance(self.choice, bool) or not isinstance(self.choice, int) or self.choice < 0:
            raise ValueError(f"choice: expected an int >= 0, got {self.choice!r:.80}")
        return self


@dataclass(frozen=True, slots=True)
class ChoiceCancelled:
    """``cancelled``: the choice was live and is being stopped (False: unknown or ended, or the
    request was bad: ``message`` says why)."""

    cancelled: bool
    message: str = ""


def checked(request: Any, kind: type) -> str | None:
    """Why ``request`` is not a valid ``kind`` message (its ``check()``'s error), or None."""
    if not isinstance(request, kind):
        return f"request: expected a {kind.__name__}, got {type(request).__name__}"
    try:
        request.check()
    except ValueError as exc:
        return str(exc)
    return None


__all__ = ["Adopted", "CancelChoice", "ChoiceCancelled", "DecodeCall", "PagesReleased", "PrefillCall", "Prefilled",
           "ReleasePages", "SendPages", "SendReply", "StagePages", "StageReply", "Tokens", "TransferFailed", "checked"]
