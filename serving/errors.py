"""RequestError: a request the service refuses, raised in any layer and rendered by the ingress
as an OpenAI error object (HTTP) or a gRPC status."""

from __future__ import annotations

MAX_ERROR_MESSAGE = 512


def _utf8_safe(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates, e.g. from a JSON ``"\\ud800"``)
    written as a backslash escape, so an error that quotes bad input can always be rendered."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestError(Exception):
    """A request the service refuses; rendered as an OpenAI error object.

    status: HTTP status (400 bad input, 404 unknown model, 429 overloaded, 500/502/503).
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        error_type: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        message = _utf8_safe(str(message))
        param = None if param is None else _utf8_safe(str(param))
        if len(message) > MAX_ERROR_MESSAGE:  # messages quote bad values: keep them short
            message = message[: MAX_ERROR_MESSAGE - 3] + "..."
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.retry_after_s = retry_after_s
        self.error_type = error_type or _type_for(status)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def __reduce__(self):
        return (_rebuild_request_error, (self.message, self.param, self.status, self.code, self.error_type, self.retry_after_s))


def _rebuild_request_error(message, param, status, code, error_type, retry_after_s):
    return RequestError(message, param=param, status=status, code=code, error_type=error_type, retry_after_s=retry_after_s)


def _type_for(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class PrefillOutOfMemory(RequestError):
    """A prefill forward ran out of accelerator memory: a capacity failure, not a server bug, so
    503 with Retry-After (gRPC UNAVAILABLE). The failed batch's pages are already back in the
    pool and the replica serves on; the message says what to change so it stops happening."""

    CODE = "prefill_out_of_memory"

    def __init__(self, prompt_tokens: int, batch_tokens: int, *, retry_after_s: int = 1) -> None:
        self.prompt_tokens = int(prompt_tokens)
        self.batch_tokens = int(batch_tokens)
        super().__init__(
            f"prefill ran out of GPU memory on a {self.prompt_tokens}-token prompt (its forward held "
            f"{self.batch_tokens} prompt tokens); retry later, or lower prefill.max_batch_tokens or "
            "kv.prefill_pages / kv.decode_pages, use model.weight_dtype fp8_*, or give prefill its own GPU",
            status=503, code=self.CODE, retry_after_s=retry_after_s)

    def __reduce__(self):
        return (_rebuild_out_of_memory, (self.prompt_tokens, self.batch_tokens, self.retry_after_s))


def _rebuild_out_of_memory(prompt_tokens, batch_tokens, retry_after_s):
    return PrefillOutOfMemory(prompt_tokens, batch_tokens, retry_after_s=retry_after_s)
