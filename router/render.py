"""The response objects of the OpenAI-compatible API: unary answers, stream chunks and the
usage chunk, logprobs in completions' and chat's shapes, tool calls (parsed out of a finished
reply, or streamed as they complete), ``/v1/models``, and the OpenAPI description of the routes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .generation import GenerationRequest
from .openai_models import (CHUNKS, REQUESTS, RESPONSES, AssistantMessage, ChatChoice, ChatChunkChoice, ChatLogprobs,
                            CompletionChoice, CompletionLogprobs, Delta, ErrorResponse, FunctionCall,
                            PromptTokensDetails, ResponseToolCall, StreamToolCall, TokenLogprob, TopLogprob, Usage,
                            json_schema)
from .usage import choices_usage

SYSTEM_FINGERPRINT = "fp_flashprefill"  # ``system_fingerprint`` of every response
_OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
_CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
_SHAPES: dict[type[BaseModel], tuple[tuple[str, ...], frozenset[str]]] = {}  # field names in order, required ones


def _object(model: type[BaseModel], /, **fields: Any) -> dict:
    """The JSON object of ``model`` (``router/openai_models.py``, the one definition of every
    response's fields and their order) with ``fields``: those given are written, in the
    model's order (``None`` given is ``null``; a field not given is left out), a field the
    model lacks or a required one missing is a ``ValueError``. The values are not validated:
    they are the service's own (the parser's and the workers'), each stream renders one
    object per token, and a model's odd output must never turn a 200 into a 500; the tests
    check the objects against the models' JSON Schema. (``model_construct`` + ``model_dump``
    gives the same objects at about 4x the CPU per chunk.)"""
    shape = _SHAPES.get(model)
    if shape is None:
        names = model.model_fields
        shape = _SHAPES[model] = (tuple(names), frozenset(k for k, f in names.items() if f.is_required()))
    order, required = shape
    out = {name: fields[name] for name in order if name in fields}
    if len(out) < len(fields) or not required <= out.keys():
        raise ValueError(f"{model.__name__}: expected its fields {list(order)} with {sorted(required)}, "
                         f"got {sorted(fields)}")
    return out


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "surrogatepass"))


def _named(req: GenerationRequest, token_id: int, token: str) -> str:
    """A token as logprobs name it: its text, or vLLM's ``token_id:<id>`` with
    ``return_tokens_as_token_ids`` (distinct where texts are not: partial UTF-8 bytes all
    decode to U+FFFD)."""
    return f"token_id:{token_id}" if req.return_tokens_as_token_ids else token


def _top_dict(req: GenerationRequest, top: tuple) -> dict[str, float]:
    """Completions' legacy ``top_logprobs`` entry, ``{token: logprob}``, keyed by text as vLLM:
    where several alternatives share a text only the most likely keeps it (vLLM keeps the last
    written, the least likely, so ``max`` of the entry would not be the best logprob); with
    ``return_tokens_as_token_ids`` the keys are the ids and every alternative is there."""
    out: dict[str, float] = {}
    for token_id, token, lp in top:  # most likely first
        out.setdefault(_named(req, token_id, token), lp)
    return out


def logprobs_object(req: GenerationRequest, entries: list | None, text_offset: int = 0) -> dict | None:
    """OpenAI's ``logprobs`` of a choice (or of a chunk's tokens): completions' parallel
    lists, or chat's ``content`` list (an entry per token id, with its ``bytes``).
    ``entries``: ``router.accounting.Logprob`` values."""
    if req.logprobs is None or entries is None:
        return None
    if req.kind == "completion":
        offsets, at = [], text_offset
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        # echo: the prompt's first token has no logprob (nothing before it predicts it)
        return _object(CompletionLogprobs, tokens=[_named(req, e.token_id, e.token) for e in entries],
                       token_logprobs=[e.logprob for e in entries],
                       top_logprobs=[None if e.logprob is None else _top_dict(req, e.top) for e in entries],
                       text_offset=offsets)

    def raw(token: str, of: bytes | None) -> list[int]:
        return list(of) if of is not None else _token_bytes(token)

    content = []
    for e in entries:
        top_bytes = e.top_bytes or (None,) * len(e.top)
        content.append(_object(TokenLogprob, token=_named(req, e.token_id, e.token), logprob=e.logprob,
                               bytes=raw(e.token, e.token_bytes),
                               top_logprobs=[_object(TopLogprob, token=_named(req, i, t), logprob=lp, bytes=raw(t, b))
                                             for (i, t, lp), b in zip(e.top, top_bytes)]))
    return _object(ChatLogprobs, content=content, refusal=None)


def split_tool_calls(req: GenerationRequest, text: str, finish_reason: str | None
                     ) -> tuple[str | None, list[dict] | None, str | None]:
    """``(content, tool_calls, finish_reason)`` of a chat reply: for a request with tools
    (``req.tool_format``), the calls parsed out of ``text`` in OpenAI's shape (``id``
    ``call_...``, ``type: "function"``, ``function.arguments`` a JSON string), ``content`` the
    text outside them (``None`` when there is none) and ``finish_reason`` ``"tool_calls"``
    (``"length"`` stays: the calls that were complete are returned). Without calls, or without
    tools: ``(text, None, finish_reason)``. A malformed call is content, never an error. With
    ``parallel_tool_calls: false`` only the first call is returned. (gRPC can render a
    ``Completion`` the same way.)"""
    if req.tool_format is None:
        return text, None, finish_reason
    from model_executor.tools import extract_tool_calls

    content, calls = extract_tool_calls(text, req.tool_format)
    if not calls:
        return text, None, finish_reason
    if not req.parallel_tool_calls:
        calls = calls[:1]
    return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolChoiceStream:
    """One streamed chat choice of a request with tools (``req.tool_format``): its text deltas
    through ``model_executor.tools.ToolCallStream``. :meth:`push` returns the events now final,
    ``("content", text)`` and ``("call", {"index", "id", "type", "function"})`` (``index``: the
    call's position in the choice; with ``parallel_tool_calls: false`` calls after the first
    are dropped), and the finish reason (``"tool_calls"`` for a ``"stop"`` once a call came)."""

    def __init__(self, req: GenerationRequest) -> None:
        from model_executor.tools import ToolCallStream

        self._req = req
        self._parser = ToolCallStream(req.tool_format)
        self.calls = 0

    def push(self, text: str, finish_reason: str | None = None) -> tuple[list[tuple[str, Any]], str | None]:
        events = self._parser.push(text)
        if finish_reason is not None:
            events += self._parser.finish()
        out: list[tuple[str, Any]] = []
        for kind, value in events:
            if kind == "call":
                if self.calls and not self._req.parallel_tool_calls:
                    continue
                out.append(("call", {"index": self.calls, **value}))
                self.calls += 1
            elif value and out and out[-1][0] == "content":
                out[-1] = ("content", out[-1][1] + value)
            elif value:
                out.append(("content", value))
        return out, ("tool_calls" if finish_reason == "stop" and self.calls else finish_reason)


def tool_stream_chunks(req: GenerationRequest, stream: ToolChoiceStream, text: str, token_ids: list[int],
                       finish_reason: str | None, *, first: bool = False, logprobs: list | None = None,
                       index: int = 0) -> list[dict]:
    """The chunks of one delta of a streamed chat choice with tools: the content now final (a
    possible beginning of ``<tool_call>``, a call's body and whitespace before unknown text are
    held back), one chunk per call completed in it (``delta.tool_calls: [{index, id, type,
    function: {name, arguments}}]``, a whole call), at least one chunk. The delta's
    ``token_ids`` and ``logprobs`` (the tokens it generated) ride on its first chunk, with
    ``delta.role`` for the choice's first; ``finish_reason`` on the last (after a call: a chunk
    ``delta: {}`` of its own)."""
    events, finish = stream.push(text, finish_reason)
    return tool_chunks(req, events, finish, token_ids, first=first, logprobs=logprobs, index=index)


def tool_chunks(req: GenerationRequest, events: list, finish: str | None, token_ids: list[int], *,
                first: bool = False, logprobs: list | None = None, index: int = 0) -> list[dict]:
    """:func:`tool_stream_chunks` of the events a ``ToolChoiceStream`` returned."""
    events = list(events)
    if not events or (finish is not None and events[-1][0] == "call"):
        events.append(("content", None))
    return [_chunk(req, value if kind == "content" else None, token_ids if i == 0 else [],
                   finish if i == len(events) - 1 else None, first=first and i == 0,
                   logprobs=logprobs if i == 0 else None, index=index,
                   tool_calls=[_tool_call(StreamToolCall, value)] if kind == "call" else None)
            for i, (kind, value) in enumerate(events)]


def _tool_call(model: type[ResponseToolCall] | type[StreamToolCall], call: dict) -> dict:
    """A parsed call (``model_executor.tools``: ``{id, type, function: {name, arguments}}``; a
    streamed one with its ``index``) as ``model`` writes it."""
    return _object(model, **{**call, "function": _object(FunctionCall, **call["function"])})


def _usage(usage_object: dict) -> dict:
    """``usage_object`` (from :class:`~router.usage.UsageAccount`) as the model writes it."""
    details = usage_object.get("prompt_tokens_details")
    if details is not None:
        usage_object = {**usage_object, "prompt_tokens_details": _object(PromptTokensDetails, **details)}
    return _object(Usage, **usage_object)


def completion_response(req: GenerationRequest, result: Any, *, choices: list | None = None,
                        completion_tokens: int | None = None) -> dict:
    """``result``: a ``router.accounting.Completion`` (with ``n``, a list of prompts or
    ``best_of``: ``choices``, ``(index, prompt_token_ids, Completion)`` per returned choice,
    ``result`` the first; ``completion_tokens``: every token generated, best_of's discarded
    ones included)."""
    choices = choices if choices is not None else [(0, req.prompt_token_ids, result)]
    out_choices = []
    for index, prompt_ids, res in choices:
        lp = logprobs_object(req, (res.prompt_logprobs or []) + (res.logprobs or []) if req.echo else res.logprobs)
        ids = {"token_ids": list(res.token_ids), "prompt_token_ids": list(prompt_ids)} if req.return_token_ids else {}
        if req.kind == "completion":
            text = (res.prompt_text or "") + res.text if req.echo else res.text
            out_choices.append(_object(CompletionChoice, index=index, text=text, finish_reason=res.finish_reason,
                                       logprobs=lp, **ids))
        else:
            content, calls, finish = split_tool_calls(req, res.text, res.finish_reason)
            tool_calls = {} if calls is None else {"tool_calls": [_tool_call(ResponseToolCall, c) for c in calls]}
            message = _object(AssistantMessage, role="assistant", content=content, **tool_calls)
            out_choices.append(_object(ChatChoice, index=index, message=message, finish_reason=finish, logprobs=lp,
                                       **ids))
    routing = {} if result.routing is None else {"routing": result.routing}
    return _object(RESPONSES[req.kind], id=req.response_id, object=_OBJECT[req.kind], created=req.created,
                   model=req.model, system_fingerprint=SYSTEM_FINGERPRINT, choices=out_choices,
                   usage=_usage(choices_usage(req, choices, completion_tokens)), timing=result.timing, **routing)


def _chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None, *,
           first: bool = False, logprobs: list | None = None, text_offset: int = 0, index: int = 0,
           tool_calls: list | None = None) -> dict:
    lp = logprobs_object(req, logprobs, text_offset)
    ids = {"token_ids": list(token_ids)} if req.return_token_ids else {}
    if req.kind == "completion":
        choice = _object(CompletionChoice, index=index, text=text or "", finish_reason=finish_reason, logprobs=lp,
                         **ids)
    else:
        delta = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice = _object(ChatChunkChoice, index=index, delta=_object(Delta, **delta), finish_reason=finish_reason,
                         logprobs=lp, **ids)
    return _object(CHUNKS[req.kind], id=req.response_id, object=_CHUNK_OBJECT[req.kind], created=req.created,
                   model=req.model, system_fingerprint=SYSTEM_FINGERPRINT, choices=[choice])


def stream_chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None,
                 *, first: bool = False, logprobs: list | None = None, text_offset: int = 0, index: int = 0) -> dict:
    """One streamed event of one choice: ``text`` (chat: the delta's ``content``, with ``role``
    on the choice's ``first``), the tokens it generated (``return_token_ids``) and their logprobs."""
    return _chunk(req, text, token_ids, finish_reason, first=first, logprobs=logprobs, text_offset=text_offset,
                  index=index)


def usage_chunk(req: GenerationRequest, usage_object: dict) -> dict:
    """A stream's usage chunk (``include_usage``): ``usage_object`` from
    :class:`~router.usage.UsageAccount`."""
    return _object(CHUNKS[req.kind], id=req.response_id, object=_CHUNK_OBJECT[req.kind], created=req.created,
                   model=req.model, system_fingerprint=SYSTEM_FINGERPRINT, choices=[], usage=_usage(usage_object))


def models_response(model_id: str, created: int, max_model_len: int) -> dict:
    """``/v1/models``: the served model, with its context (``max_model_len``, as vLLM's model card)."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "flashprefill-serve", "max_model_len": max_model_len}]}


# ----------------------------------------------------------------------------- OpenAPI
def openapi_extra(kind: str) -> dict:
    """``openapi_extra`` for a FastAPI route taking a raw ``Request``: the body, response and
    error schemas, generated from ``router.openai_models``. The parser stays the authority on
    what depends on the served model (vocabulary, ``max_model_len``, the chat template); other
    fields OpenAI and vLLM define are there (docs/API.md, Request fields), and unknown ones are
    ignored, or refused where ``ingress.strict_fields`` is on."""
    error = {"content": {"application/json": {"schema": json_schema(ErrorResponse)}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": json_schema(REQUESTS[kind])}}},
        "responses": {
            "200": {"description": "the response; with stream: true, server-sent events of chunks, then "
                                   "'data: [DONE]'",
                    "content": {"application/json": {"schema": json_schema(RESPONSES[kind])},
                                "text/event-stream": {"schema": json_schema(CHUNKS[kind])}}},
            "400": {"description": "invalid request (the error's param names the field)", **error},
            "401": {"description": "missing or wrong bearer token", **error},
            "404": {"description": "unknown model", **error},
            "413": {"description": "body larger than ingress.max_request_bytes", **error},
            "429": {"description": "overloaded; see Retry-After", **error},
            "502": {"description": "a worker failed and retries were exhausted", **error},
            "503": {"description": "no worker replica available", **error},
        },
    }
