"""The OpenAI-compatible wire protocol: request validation, response and error objects.

Requests are parsed from plain JSON objects by hand, field by field, so that every bad field
gets a 400 naming it (OpenAI's ``invalid_request_error`` shape), not a generic 422. The gRPC
service reuses the same validation (``router/grpc_service.py`` turns its message into the
same dict). What comes out is a :class:`GenerationRequest`: token ids and sampling options,
everything the workers need, nothing they do not.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from model_executor.sampling import SamplingParams
from serving.errors import RequestError

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 256
MAX_SEED = (1 << 63) - 1
MAX_TEMPERATURE = 2.0

# Parameters we accept only at their "off" value (OpenAI clients send some of them by default).
_NEUTRAL = {
    "n": (1,),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "user": None,  # any string: recorded nowhere
    "parallel_tool_calls": (None, False),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream",
           "stream_options", "seed", "return_token_ids", "request_id"}
COMPLETION_FIELDS = _COMMON | {"prompt"} | set(_NEUTRAL)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL)
CHAT_ROLES = ("system", "user", "assistant")


def bad(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, status=400, code="invalid_value")


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation request, protocol-independent."""

    request_id: str
    kind: str  # "completion" or "chat"
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            max_new_tokens=self.max_tokens, stop_token_ids=self.stop_token_ids, seed=self.seed,
        )


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"expected a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise bad(name, f"expected a number in {bracket}{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise bad(name, f"expected an integer in [{lo}, {hi}], got {value}")
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"expected true or false, got {value!r}")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise bad("stop", f"expected a string or a list of at most {MAX_STOP_STRINGS} strings, got {value!r}")
    for s in value:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN:
            raise bad("stop", f"expected non-empty strings of at most {MAX_STOP_LEN} characters, got {s!r}")
        _check_text("stop", s)
    return tuple(value)


def _check_text(name: str, value: str) -> str:
    """A string field must be valid Unicode that UTF-8 can encode (JSON lets a client send a
    lone surrogate such as ``"\\ud800"``, which no tokenizer can encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(name, f"invalid Unicode: a lone surrogate (U+{ord(value[exc.start]):04X}) at character "
                        f"{exc.start}") from None
    return value


def _check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object", param=None, status=400, code="invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], "unrecognized request argument")
    for name, neutral in _NEUTRAL.items():
        if name not in body:
            continue
        value = body[name]
        if neutral is None:
            if value is not None and not isinstance(value, str):
                raise bad(name, f"expected a string, got {value!r}")
        elif not any(value == n and type(value) is type(n) for n in neutral) and not (
            name in ("presence_penalty", "frequency_penalty") and value == 0 and not isinstance(value, bool)
        ):
            what = "n must be 1" if name == "n" else f"only {neutral[-1]!r} is supported"
            raise bad(name, f"{what}, got {value!r}")
    return body


class RequestParser:
    """Turns OpenAI request bodies into GenerationRequests for one served model."""

    def __init__(self, tokenizer: Any, *, model_id: str, max_model_len: int, default_max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.vocab_size = int(tokenizer.vocab_size)
        self.stop_token_ids = tuple(getattr(tokenizer, "stop_token_ids", ()) or ())

    # -- prompts ---------------------------------------------------------------------
    def _token_ids(self, name: str, ids: list) -> list[int]:
        if not ids:
            raise bad(name, "expected a non-empty prompt")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise bad(name, f"expected token ids in [0, {self.vocab_size}), got {t!r}")
        return list(ids)

    def _prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise bad("prompt", "expected a non-empty string")
            return self.tokenizer.encode(_check_text("prompt", prompt))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self._token_ids("prompt", prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise bad("prompt", "batched prompts are not supported: send one prompt per request")
        raise bad("prompt", f"expected a string or a list of token ids, got {type(prompt).__name__}")

    def _messages(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "expected a non-empty list of {role, content} objects")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}]", "expected an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES:
                raise bad(f"messages[{i}].role", f"expected one of {CHAT_ROLES}, got {role!r}")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad(f"messages[{i}].content[{j}]", "only {'type': 'text', 'text': str} parts are supported")
                    parts.append(_check_text(f"messages[{i}].content[{j}].text", part["text"]))
                content = "".join(parts)
            if not isinstance(content, str):
                raise bad(f"messages[{i}].content", f"expected a string, got {type(content).__name__}")
            _check_text(f"messages[{i}].content", content)
            if isinstance(m.get("name"), str):
                _check_text(f"messages[{i}].name", m["name"])
            extra = sorted(set(m) - {"role", "content", "name"})
            if extra:
                raise bad(f"messages[{i}].{extra[0]}", "unrecognized message field")
            clean.append({"role": role, "content": content})
        try:
            return self.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
        except ValueError as exc:
            raise bad("messages", str(exc)) from None

    # -- whole requests ---------------------------------------------------------------
    def _model(self, body: dict) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", "expected the model id (see /v1/models)")
        _check_text("model", model)
        if model != self.model_id:
            raise RequestError(
                f"model: {model!r} does not exist; this service serves {self.model_id!r}",
                param="model", status=404, code="model_not_found",
            )
        return model

    def parse(self, body: Any, kind: str, *, request_id: str | None = None) -> GenerationRequest:
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind: expected 'completion' or 'chat', got {kind!r}")
        body = _check_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
        model = self._model(body)
        ids = self._prompt(body) if kind == "completion" else self._messages(body)
        if kind == "chat" and body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None:
                raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        room = self.max_model_len - len(ids)
        if room < 1:
            raise bad("prompt" if kind == "completion" else "messages",
                      f"the prompt has {len(ids)} tokens; this model takes at most {self.max_model_len - 1} "
                      "(max_model_len, one token of room to generate)")
        max_tokens = _integer(body, "max_tokens", None, 1, self.max_model_len)
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise bad("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {self.max_model_len}")
        temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _integer(body, "top_k", 0, -1, self.vocab_size)
        seed = _integer(body, "seed", None, 0, MAX_SEED)
        stream = _bool(body, "stream", False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise bad("stream_options", "only allowed with stream: true")
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise bad("stream_options", "expected {\"include_usage\": bool}")
            include_usage = _bool(options, "include_usage", False)
        rid = body.get("request_id")
        if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= 128 or not rid.isprintable()):
            raise bad("request_id", "expected a printable string of at most 128 characters")
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return GenerationRequest(
            request_id=rid or request_id or f"{prefix}-{uuid.uuid4().hex}",
            kind=kind,
            model=model,
            prompt_token_ids=tuple(ids),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            seed=seed,
            stop=_stop(body),
            stop_token_ids=self.stop_token_ids,
            stream=stream,
            include_usage=include_usage,
            return_token_ids=_bool(body, "return_token_ids", False),
        )


# ----------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens reused from the prefix cache."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # after a resume the re-prefilled context is longer than the prompt
        out["prompt_tokens_details"] = {"cached_tokens": min(int(cached_tokens), prompt_tokens)}
    return out


def completion_response(req: GenerationRequest, result: Any) -> dict:
    """``result``: a ``router.pipeline.Completion``."""
    if req.kind == "completion":
        choice = {"index": 0, "text": result.text, "finish_reason": result.finish_reason, "logprobs": None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "finish_reason": result.finish_reason, "logprobs": None}
        obj = "chat.completion"
    if req.return_token_ids:
        choice["token_ids"] = list(result.token_ids)
        choice["prompt_token_ids"] = list(req.prompt_token_ids)
    out = {
        "id": req.request_id, "object": obj, "created": req.created, "model": req.model,
        "choices": [choice],
        "usage": usage(req.prompt_len, len(result.token_ids), (result.timing or {}).get("cached_tokens")),
        "timing": result.timing,
    }
    if result.routing is not None:
        out["routing"] = result.routing
    return out


def stream_chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None,
                 *, first: bool = False) -> dict:
    if req.kind == "completion":
        choice: dict = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    else:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenerationRequest, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "choices": [], "usage": usage(req.prompt_len, completion_tokens, cached_tokens)}


def models_response(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "flashprefill-serve"}]}


# ----------------------------------------------------------------------------- OpenAPI
def _request_schema(kind: str) -> dict:
    """JSON schema of a request body, for the OpenAPI description (``/openapi.json``). The
    parser above stays the authority: model-dependent bounds (vocabulary, ``max_model_len``)
    are checked there and answered with 400s naming the field."""
    stop = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN},
                      {"type": "array", "maxItems": MAX_STOP_STRINGS,
                       "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LEN}},
                      {"type": "null"}]}
    props: dict[str, Any] = {
        "model": {"type": "string", "minLength": 1, "description": "the served model id (GET /v1/models)"},
        "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        "temperature": {"anyOf": [{"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}, {"type": "null"}]},
        "top_p": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {"type": "null"}]},
        "top_k": {"anyOf": [{"type": "integer", "minimum": -1}, {"type": "null"}]},
        "seed": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_SEED}, {"type": "null"}]},
        "stop": stop,
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                           "additionalProperties": False},
        "return_token_ids": {"type": "boolean"},
        "request_id": {"type": "string", "minLength": 1, "maxLength": 128},
        "n": {"type": "integer", "enum": [1]},
        "user": {"type": "string"},
    }
    if kind == "completion":
        props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}
        required = ["model", "prompt"]
    else:
        props["messages"] = {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)}, "content": {"type": "string"},
                           "name": {"type": "string"}}}}
        props["max_completion_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
        required = ["model", "messages"]
    return {"type": "object", "required": required, "properties": props, "additionalProperties": False}


ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def openapi_extra(kind: str) -> dict:
    """``openapi_extra`` for a FastAPI route taking a raw ``Request``: body schema and errors."""
    error = {"content": {"application/json": {"schema": ERROR_SCHEMA}}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _request_schema(kind)}}},
        "responses": {
            "400": {"description": "invalid request (the error's param names the field)", **error},
            "401": {"description": "missing or wrong bearer token", **error},
            "404": {"description": "unknown model", **error},
            "413": {"description": "body larger than ingress.max_request_bytes", **error},
            "429": {"description": "overloaded; see Retry-After", **error},
            "502": {"description": "a worker failed and retries were exhausted", **error},
            "503": {"description": "no worker replica available", **error},
        },
    }
