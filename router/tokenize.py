"""vLLM's ``/tokenize`` and ``/detokenize`` (the same request and response shapes), so clients
that count tokens through the server (guidellm, vLLM's own tools) work unchanged.

``/tokenize``: ``{"model"?, "prompt": str, "add_special_tokens"?: true}`` or ``{"model"?,
"messages": [...], "add_generation_prompt"?: true, "add_special_tokens"?: false, "tools"?}``
(chat messages as ``/v1/chat/completions`` takes them, rendered by the same template), plus
``return_token_strs``; answers ``{"count", "max_model_len", "tokens"}`` (and ``token_strs``).
``/detokenize``: ``{"model"?, "tokens": [int]}`` answers ``{"prompt"}``, special tokens written
out (as vLLM). ``model``, when given, must be the served model (else 404, as for completions).
Bad input: a 400 naming the field. A prompt longer than ``max_model_len`` is tokenized anyway:
telling the client its length is the point.
"""

from __future__ import annotations

from typing import Any

from serving.errors import RequestError

from .errors import bad, check_text
from .parsing import RequestParser

_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "return_token_strs", "tools"}
_DETOKENIZE_FIELDS = {"model", "tokens"}


class _WithoutGenerationPrompt:
    """The tokenizer, rendering chat templates without the assistant prompt (``RequestParser``
    always asks for it, as a chat completion needs it)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self._tok.apply_chat_template(messages, False, **kwargs)


def _body(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object", param="body", status=400, code="invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0].encode("utf-8", "backslashreplace").decode("utf-8"), "unrecognized request argument")
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad(name, f"expected true or false, got {value!r}"[:200])
    return value


def _check_model(parser: RequestParser, body: dict) -> None:
    if body.get("model") is not None:
        parser._model(body)  # a 404 naming model, as completions answer


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:  # the vocabulary's own strings, as vLLM returns them
        return [str(t) for t in hf.convert_ids_to_tokens(ids)]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def tokenize(parser: RequestParser, body: Any) -> dict:
    """``/tokenize``'s response for ``body`` (``RequestError`` on bad input)."""
    chat = isinstance(body, dict) and "messages" in body
    body = _body(body, _CHAT_FIELDS if chat else _PROMPT_FIELDS)
    _check_model(parser, body)
    tokenizer = parser.tokenizer
    if chat:
        add_special = _flag(body, "add_special_tokens", False)
        if _flag(body, "continue_final_message", False):
            raise bad("continue_final_message", "only false is supported")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and tools):
            raise bad("tools", "expected a non-empty list of tools")
        if not _flag(body, "add_generation_prompt", True):
            parser = RequestParser(_WithoutGenerationPrompt(tokenizer), model_id=parser.model_id,
                                   max_model_len=parser.max_model_len, default_max_tokens=parser.default_max_tokens,
                                   model_type=parser.model_type)
        ids = parser._messages(body, tools)  # the very prompt a chat completion would run
        if add_special:  # what the tokenizer adds to any text (its BOS, if it adds one), as vLLM does
            ids = [*tokenizer.encode("", add_bos=True), *ids]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", f"expected a string, got {type(prompt).__name__}")
        ids = tokenizer.encode(check_text("prompt", prompt), add_bos=_flag(body, "add_special_tokens", True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": parser.max_model_len, "tokens": [int(i) for i in ids]}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = _token_strs(tokenizer, out["tokens"])
    return out


def detokenize(parser: RequestParser, body: Any) -> dict:
    """``/detokenize``'s response for ``body`` (``RequestError`` on bad input)."""
    body = _body(body, _DETOKENIZE_FIELDS)
    _check_model(parser, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens", f"expected a list of token ids, got {type(tokens).__name__}")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < parser.vocab_size:
            raise bad("tokens", f"expected token ids in [0, {parser.vocab_size}), got {t!r}"[:200])
    return {"prompt": parser.tokenizer.decode(tokens, skip_special_tokens=False)}
