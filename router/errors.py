"""The errors the ingress answers with: a bad field as a 400 naming it (OpenAI's
``invalid_request_error`` shape), pydantic's validation errors in that shape, the missing bearer
token, and any other exception as the status a client can act on (429 / 503 / 500). HTTP and gRPC
render the same :class:`~serving.errors.RequestError`.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from serving.errors import RequestError

logger = logging.getLogger("ray.serve")

# errors inside these fields name the field, not the entry (a stop string, a token id, a bias)
_NAMED_WHOLE = frozenset({"stop", "logit_bias", "stop_token_ids", "sparse_attention"})
# the models' own error types: their message says what was expected, and shows no input
_OWN_ERRORS = frozenset({"invalid_type", "neutral", "invalid_unicode", "not_printable"})


def bad(param: str, message: str) -> RequestError:
    """A 400 naming ``param``: ``<param>: <message>``."""
    return RequestError(f"{param}: {message}", param=param, status=400, code="invalid_value")


def escaped(text: str) -> str:
    """``text`` with any lone surrogate escaped: an error naming client data must render as JSON."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _param(loc: tuple, body: Any) -> str:
    """The name a bad field is answered with: ``messages[0].content[1].text`` for pydantic's
    ``("messages", 0, "content", "~list", 1, "text")`` (union tags left out; a token-id list,
    a one-prompt list and the fields of ``_NAMED_WHOLE`` named as a whole)."""
    parts: list = []
    for p in loc:
        if isinstance(p, str) and p.startswith("~"):
            if p == "~ids":
                break
            continue
        parts.append(p)
    if parts and parts[0] in _NAMED_WHOLE:
        parts = parts[:1]
    if parts[:1] == ["prompt"] and isinstance(body, dict) and isinstance(body.get("prompt"), list) \
            and len(body["prompt"]) == 1:
        parts = parts[:1]
    if not parts:
        return "body"
    # a key is client data of any length: the name is cut to keep the error short
    return escaped(str(parts[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[1:]))[:200]


def request_error(exc: ValidationError, body: Any, prefix: tuple = ()) -> RequestError:
    """pydantic's first error as a 400 naming the field: ``<param>: <what>, got <value>``."""
    err = exc.errors(include_url=False)[0]
    at = (err.get("ctx") or {}).get("field")  # a rule between a message's fields names the one at fault
    param = _param((*prefix, *err["loc"], *((at,) if at else ())), body)
    if err["type"] == "string_unicode" and isinstance(err["input"], str):  # pydantic's own lone-surrogate check
        try:
            check_text(param, err["input"])
        except RequestError as named:  # the same message as the models' own check
            return named
    if at or err["type"] in _OWN_ERRORS:
        message = err["msg"]
        if err["type"] == "invalid_type":
            message += f", got {type(err['input']).__name__}"
    elif err["type"] == "extra_forbidden":
        message = "unrecognized field"
    elif err["type"] == "missing":
        message = "required"
    else:
        message = f"{err['msg']}, got {escaped(repr(err['input']))[:100]}"
    return bad(param, message[:300])


def check_text(name: str, value: str) -> str:
    """A string field must be valid Unicode that UTF-8 can encode (JSON lets a client send a
    lone surrogate such as ``"\\ud800"``, which no tokenizer can encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(name, f"invalid Unicode: a lone surrogate (U+{ord(value[exc.start]):04X}) at character "
                        f"{exc.start}") from None
    return value


UNAUTHORIZED = RequestError("missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                            status=401, code="invalid_api_key")


def as_request_error(exc: BaseException) -> RequestError:
    """An exception as the error the client sees (HTTP status / gRPC code): overload, a
    missing deployment and running out of GPU memory keep their meaning (429 / 503); anything
    else is logged and is a 500."""
    if isinstance(exc, RequestError):
        return exc
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, BackPressureError):
        return RequestError("service overloaded; retry later", status=429, code="overloaded", retry_after_s=1)
    if isinstance(exc, DeploymentUnavailableError):
        return RequestError("a worker deployment is unavailable", status=503, code="unavailable", retry_after_s=1)
    import torch

    # a prefill forward's OOM arrives as PrefillOutOfMemory; one elsewhere (an export's or a
    # decode step's buffers) is still a capacity failure, not a bug (Ray's wrapper is an instance)
    if isinstance(exc, torch.OutOfMemoryError):
        logger.error("a worker ran out of GPU memory: %s", exc)
        return RequestError("a worker ran out of GPU memory; retry later", status=503, code="out_of_memory",
                            retry_after_s=1)
    logger.exception("request failed")
    return RequestError(f"internal error: {type(exc).__name__}", status=500, code="internal_error")
