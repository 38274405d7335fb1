"""The OpenAI-compatible requests: a body (or a gRPC message's dict) validated into a request.

A request body is validated through its pydantic model (``router/openai_models.py``: every
field's type, range and allowed values); what depends on the served model (vocabulary, context
length, chat template, grammars) and the rules between fields are checked here. Every bad field
gets a 400 naming it (OpenAI's ``invalid_request_error`` shape), not a generic 422. The gRPC
service reuses the same validation (``router/app.py`` turns its message into the same dict).
What comes out is a :class:`GenerationRequest`: token ids and sampling options, everything the
workers need, nothing they do not.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from model_executor.sampling_params import SamplingParams
from serving.errors import RequestError

from .errors import bad, check_text, escaped, request_error
from .generation import GenerationRequest, shared_fields
from .openai_models import REQUESTS, ChatMessage, CompletionRequest, StreamOptions, ignored_fields

logger = logging.getLogger("ray.serve")

_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat takes them (neutral in completions)
# roles the chat templates do not know, and the role they are rendered as
_ROLE_AS = {"developer": "system"}
_IGNORED = {kind: ignored_fields(kind) for kind in REQUESTS}
_MESSAGES = TypeAdapter(Annotated[list[ChatMessage], Field(min_length=1)])
_logged_fields: set[str] = set()  # field names already logged as ignored, in this process
MAX_LOGGED_FIELDS = 256  # names are client data: a bound on the memory and the log lines they take


def _log_ignored(name: str, why: str) -> None:
    """One log line per field name per process (a client sends the same fields every request),
    for at most MAX_LOGGED_FIELDS names (the last line says so), each shown to 64 characters."""
    if name in _logged_fields or len(_logged_fields) > MAX_LOGGED_FIELDS:
        return
    _logged_fields.add(name)
    if len(_logged_fields) > MAX_LOGGED_FIELDS:
        logger.warning("request fields: %d names logged as ignored; further ones are not logged", MAX_LOGGED_FIELDS)
        return
    shown = name[:64].encode("utf-8", "backslashreplace").decode("utf-8")
    logger.warning("request field %r: %s; ignored (logged once per process)", shown, why)


def _check_fields(body: Any, kind: str, *, strict: bool = False) -> dict:
    """The body's field names against the request model: unknown ones logged (or a 400 when
    ``strict``), ignored ones logged. (Their values are the model's to check.)"""
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object", param=None, status=400, code="invalid_json")
    wrong = "messages" if kind == "completion" else "prompt"  # the other endpoint's input: a mistake, not noise
    if wrong in body:
        raise bad(wrong, "not a field of this endpoint (send it to "
                         f"{'/v1/chat/completions' if kind == 'completion' else '/v1/completions'})")
    unknown = sorted(set(body) - set(REQUESTS[kind].model_fields))
    for name in unknown:
        if strict:  # a name with a lone surrogate is escaped: the error must render as JSON
            raise bad(escaped(name), "unrecognized request argument (ingress.strict_fields is on)")
        _log_ignored(name, "not a field OpenAI or vLLM define for this endpoint")
    for name in sorted(set(body) & _IGNORED[kind]):
        _log_ignored(name, "accepted, not acted on (docs/API.md, Request fields)")
    # an ignored unknown field is not the model's to check: a name pydantic cannot take as a
    # string (a lone surrogate) must not turn a valid request into a 400
    return {k: v for k, v in body.items() if k not in unknown} if unknown else body


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# Rules of their own in ``RequestParser.parse`` (bounds against max_tokens or the vocabulary,
# ignore_eos, token id keys, chat's logprobs/top_logprobs); every other sampling parameter the
# request model, GenerationRequest and SamplingParams name alike passes as given (unset: the
# GenerationRequest default), its range checked by the request model.
OWN_RULES = frozenset({"top_k", "stop_token_ids", "logit_bias", "min_tokens", "logprobs", "guided"})


def plain_sampling(request_model: type = CompletionRequest, generation: type = GenerationRequest,
                   sampling: type = SamplingParams) -> tuple[str, ...]:
    """The sampling parameters that pass through the parser unchanged."""
    return tuple(n for n in shared_fields(generation, sampling, request_model) if n not in OWN_RULES)


PLAIN_SAMPLING = plain_sampling()
_GENERATION_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationRequest)}

class RequestParser:
    """Turns OpenAI request bodies into GenerationRequests for one served model."""

    def __init__(self, tokenizer: Any, *, model_id: str, max_model_len: int, default_max_tokens: int,
                 model_type: str | None = None, strict_fields: bool = False,
                 max_sequence_tokens: int | None = None, page_size: int = 1) -> None:
        """``default_max_tokens``: completions' ``max_tokens`` when none is sent (chat's runs to
        the end of the context); ``strict_fields``: unknown fields are 400s, not logged;
        ``max_sequence_tokens``: the tokens a decode replica's pool holds (``page_size``-token
        pages): chat's default leaves room there for the prompt and every choice."""
        self.tokenizer = tokenizer
        self.strict_fields = strict_fields
        self.max_sequence_tokens = max_sequence_tokens
        self.page_size = page_size
        self.model_type = model_type  # config.json's model_type: the tool-call format where the tokenizer declares none
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.vocab_size = int(tokenizer.vocab_size)
        self.stop_token_ids = tuple(getattr(tokenizer, "stop_token_ids", ()) or ())

    # -- prompts ---------------------------------------------------------------------
    def _in_vocab(self, name: str, ids: Any) -> None:
        for t in ids:
            if t >= self.vocab_size:
                raise bad(name, f"expected token ids in [0, {self.vocab_size}), got {t!r}")

    def _one_prompt(self, name: str, prompt: str | list[int], add_special: bool) -> tuple[list[int], int]:
        """``(token ids, leading tokens the tokenizer added)``: a string follows the tokenizer's
        ``add_special_tokens`` (``add_special``); token ids are taken as they are."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_bos=add_special)
            return ids, self._added_prefix(prompt, ids) if add_special else 0
        self._in_vocab(name, prompt)
        return list(prompt), 0

    def _added_prefix(self, text: str, ids: list[int]) -> int:
        """How many tokens before ``text``'s own the tokenizer put (a BOS), found by encoding it
        again without them (a literal "<s>" in the text is the client's, and stays)."""
        plain = self.tokenizer.encode(text, add_bos=False)
        for k in range(len(ids) - len(plain) + 1):
            if ids[k:k + len(plain)] == plain:
                return k
        return 0

    def _special_prefix(self) -> list[int]:
        """The tokens the tokenizer puts before any text (chat with ``add_special_tokens``)."""
        ids = self.tokenizer.encode("a", add_bos=True)
        return ids[:self._added_prefix("a", ids)]

    def _prompts(self, prompt: Any, add_special: bool) -> tuple[list[list[int]], list[int]]:
        """A string, a list of token ids, or a list of either (a list of prompts): each prompt's
        ids and its count of added leading tokens."""
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            out = [self._one_prompt("prompt" if len(prompt) == 1 else f"prompt[{i}]", p, add_special)
                   for i, p in enumerate(prompt)]
        else:
            out = [self._one_prompt("prompt", prompt, add_special)]
        return [ids for ids, _ in out], [skip for _, skip in out]

    def _messages(self, body: dict, tools: list | None = None) -> list[int]:
        """The chat prompt of ``body["messages"]``; ``tools``: rendered into it by the template
        (already checked)."""
        try:
            messages = _MESSAGES.validate_python(body.get("messages"), strict=True)
        except ValidationError as exc:
            raise request_error(exc, body, ("messages",)) from None
        clean, tool_turn = [], None  # tool_turn: the first field that needs a tool-capable template
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(part.text for part in content)
            out: dict[str, Any] = {"role": _ROLE_AS.get(m.role, m.role), "content": content or ""}
            if m.role == "tool":
                out["tool_call_id"] = m.tool_call_id
                tool_turn = tool_turn or f"messages[{i}].role"
            if m.tool_calls is not None:
                out["tool_calls"] = self._history_calls(f"messages[{i}].tool_calls", m.tool_calls)
                tool_turn = tool_turn or f"messages[{i}].tool_calls"
            clean.append(out)
        try:
            if tools is not None or tool_turn is not None:
                from model_executor.tools import apply_chat_template_with_tools, chat_template_supports_tools

                if not chat_template_supports_tools(self.tokenizer):
                    raise bad(tool_turn or "tools", "this model's chat template does not take tools, so it cannot "
                                                    "render tool calls and tool messages")
                return apply_chat_template_with_tools(self.tokenizer, clean, tools)
            return self.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
        except ValueError as exc:
            message = str(exc)
            param = message.split(":", 1)[0] if message.startswith("messages[") else "messages"
            raise bad(param, message[len(param) + 2:] if param != "messages" else message) from None

    @staticmethod
    def _history_calls(at: str, calls: Any) -> list[dict]:
        """An assistant message's ``tool_calls`` (OpenAI's shape, ``arguments`` a JSON string) for
        the template: ``arguments`` as an object, as Hugging Face templates expect."""
        import json

        if not isinstance(calls, list) or not calls:
            raise bad(at, "expected a non-empty list of {id, type: 'function', function: {name, arguments}}")
        out = []
        for j, call in enumerate(calls):
            here = f"{at}[{j}]"
            if not isinstance(call, dict):
                raise bad(here, f"expected an object, got {type(call).__name__}")
            extra = sorted(set(call) - {"id", "type", "function"})
            if extra:
                raise bad(f"{here}.{extra[0]}"[:200], "unrecognized field (fields: function, id, type)")
            if not isinstance(call.get("id"), str) or not call["id"]:
                raise bad(f"{here}.id", f"expected a non-empty string, got {call.get('id')!r}"[:200])
            check_text(f"{here}.id", call["id"])
            if call.get("type", "function") != "function":
                raise bad(f"{here}.type", f"expected 'function', got {call.get('type')!r}"[:200])
            fn = call.get("function")
            if not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
                raise bad(f"{here}.function", "expected {name, arguments}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad(f"{here}.function.name", f"expected a non-empty string, got {fn.get('name')!r}"[:200])
            check_text(f"{here}.function.name", fn["name"])
            args = fn.get("arguments")
            if not isinstance(args, str):
                raise bad(f"{here}.function.arguments", f"expected a JSON object as a string, got {type(args).__name__}")
            try:
                parsed = json.loads(check_text(f"{here}.function.arguments", args))
            except (ValueError, RecursionError):
                parsed = None
            if not isinstance(parsed, dict):
                raise bad(f"{here}.function.arguments", "expected a JSON object as a string")
            out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": parsed}})
        return out


    def _tools(self, req: BaseModel) -> tuple[list | None, dict | None, str | None, bool]:
        """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request: ``(tools for
        the prompt, grammar spec forcing the call, format to parse the reply in, parallel)``.
        ``tool_choice``: ``auto`` (default with tools: the tools in the prompt, free decoding, the
        reply parsed), ``required`` / a named function (also forced by a grammar), ``none``
        (no tools in the prompt, the reply is plain content)."""
        tools, choice, parallel = req.tools, req.tool_choice, req.parallel_tool_calls
        if tools is None or tools == []:
            if choice is not None and choice != "none":
                raise bad("tool_choice", "only allowed with tools (send a non-empty tools list)")
            return None, None, None, parallel is not False
        try:
            from model_executor.grammar import compile_guide
            from model_executor.tools import hermes_tag_tokens, require_tool_support, tools_to_guided, validate_tools
        except ImportError as exc:  # the grammar library is an optional dependency
            raise bad("tools", f"tool calling is not available on this server ({exc.name} is not installed)") from None
        try:
            fmt = require_tool_support(self.tokenizer, self.model_type)
            validate_tools(tools, choice, parallel)
            if choice == "none":
                return None, None, None, parallel is not False
            guided = tools_to_guided(tools, choice, model_type=fmt, parallel_tool_calls=parallel is not False,
                                     tag_tokens=fmt == "hermes" and hermes_tag_tokens(self.tokenizer))
            if guided is not None:
                compile_guide(guided, self.tokenizer)
        except ValueError as exc:
            message = str(exc)
            param = message.split(":", 1)[0]
            if not param.startswith(_TOOL_FIELDS):
                param, message = "tools", f"tools: {message}"
            raise bad(param, message[len(param) + 2:]) from None
        return tools, guided, fmt, parallel is not False

    # -- whole requests ---------------------------------------------------------------
    def _model(self, body: dict) -> str:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model", "expected the model id (see /v1/models)")
        check_text("model", model)
        if model != self.model_id:
            raise RequestError(
                f"model: {model!r} does not exist; this service serves {self.model_id!r}",
                param="model", status=404, code="model_not_found",
            )
        return model

    def parse(self, body: Any, kind: str, *, request_id: str | None = None) -> GenerationRequest:
        if kind not in REQUESTS:
            raise ValueError(f"kind: expected 'completion' or 'chat', got {kind!r}")
        body = _check_fields(body, kind, strict=self.strict_fields)
        try:
            req = REQUESTS[kind].model_validate(body, strict=True)
        except ValidationError as exc:
            raise request_error(exc, body) from None
        model = self._model({"model": req.model})
        tools, tool_guided, tool_format, parallel = self._tools(req) if kind == "chat" else (None, None, None, True)
        if tool_format is not None and req.response_format not in (None, {"type": "text"}):
            raise bad("response_format", "cannot be combined with tools (unless tool_choice is 'none'): "
                                         "a tool call's arguments are constrained by its parameters schema")
        echo = kind == "completion" and bool(req.echo)
        # vLLM's defaults: the tokenizer's specials for completions; none for chat (its template has them)
        add_special = _or(req.add_special_tokens, kind == "completion")
        if kind == "completion":
            prompts, skips = self._prompts(req.prompt, add_special)
        else:
            prompts, skips = [self._messages({"messages": req.messages}, tools)], [0]
            if add_special:
                prompts[0] = self._special_prefix() + list(prompts[0])
        ids = max(prompts, key=len)  # the room below is the longest prompt's
        max_tokens = req.max_tokens
        if kind == "chat" and req.max_completion_tokens is not None:
            if max_tokens is not None:
                raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
            max_tokens = req.max_completion_tokens
        room = self.max_model_len - len(ids)
        if room < 1:
            raise bad("prompt" if kind == "completion" else "messages",
                      f"the prompt has {len(ids)} tokens, but this model's context (max_model_len) is "
                      f"{self.max_model_len} tokens, prompt and output together: at most {self.max_model_len - 1} "
                      "prompt tokens leave room for one output token")
        n = _or(req.n, 1)
        # max_tokens 0: only the prompt (with echo: its logprobs, for loglikelihood evaluations)
        if max_tokens == 0 and not echo:
            raise bad("max_tokens", "expected at least 1 (0 only with echo), got 0")
        if max_tokens is None and kind == "chat":  # OpenAI's and vLLM's: until the context ends
            max_tokens = max(min(room, self._decode_room(len(ids), n)), 1)
        elif max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise bad("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {len(ids) + max_tokens} "
                                    f"exceeds this model's context (max_model_len) of {self.max_model_len} tokens: "
                                    f"lower max_tokens to at most {room}, or leave it out")
        top_k = _or(req.top_k, 0)
        if top_k > self.vocab_size:
            raise bad("top_k", f"expected an integer in [-1, {self.vocab_size}] (the vocabulary), got {top_k}")
        stream = bool(req.stream)
        include_usage, continuous_usage = self._stream_options(req.stream_options, stream)
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        min_tokens = _or(req.min_tokens, 0)
        if min_tokens > max_tokens:
            raise bad("min_tokens", f"expected an integer in [0, {max_tokens}] (max_tokens), got {min_tokens}")
        best_of = req.best_of
        if best_of is not None:
            if best_of < n:
                raise bad("best_of", f"expected best_of >= n ({n}), got {best_of}")
            if stream and best_of > n:
                raise bad("best_of", "best_of > n cannot be streamed (the best are known at the end)")
            if best_of == n:
                best_of = None  # nothing to choose
        sparse = req.sparse_attention
        return GenerationRequest(
            request_id=req.request_id or request_id or f"{prefix}-{uuid.uuid4().hex}",
            kind=kind,
            model=model,
            prompt_token_ids=tuple(prompts[0]),
            batch=tuple(tuple(p) for p in prompts) if len(prompts) > 1 else (),
            n=n,
            best_of=best_of,
            echo=echo,
            echo_skip=skips[0] if echo else 0,
            batch_skip=tuple(skips) if echo and len(prompts) > 1 else (),
            # false: dense; true / null: the service's setting; {"alpha": a}: FlashPrefill V2's threshold
            sparse_alpha=None if sparse is None or sparse is True else 0.0 if sparse is False else sparse.alpha,
            sparse_options=() if sparse is None or isinstance(sparse, bool) else tuple(
                (k, getattr(sparse, k)) for k in ("last_dense_tiles", "energy_rule", "dense_layers")
                if getattr(sparse, k) is not None),
            guided=tool_guided or self._guided(req.response_format),
            tool_format=tool_format,
            parallel_tool_calls=parallel,
            max_tokens=max_tokens,
            top_k=max(top_k, 0),
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=self._stop_token_ids(req.stop_token_ids, bool(req.ignore_eos)),
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            return_token_ids=bool(req.return_token_ids),
            return_tokens_as_token_ids=bool(req.return_tokens_as_token_ids),
            logit_bias=self._logit_bias(req.logit_bias),
            min_tokens=min_tokens,
            logprobs=self._logprobs(req, kind),
            **{name: _or(getattr(req, name), _GENERATION_DEFAULTS[name]) for name in PLAIN_SAMPLING},
        )

    def _decode_room(self, prompt_len: int, n: int) -> int:
        """Output tokens per choice that a decode replica can admit for a chat request without
        ``max_tokens`` (its choices share the prompt's pages and each grows its own, starting
        with a copy of the partial last page): so the default never exceeds the pool."""
        if self.max_sequence_tokens is None:
            return self.max_model_len
        if n == 1:
            return self.max_sequence_tokens - prompt_len
        return (self.max_sequence_tokens - prompt_len) // n - 2 * self.page_size

    def _stream_options(self, options: StreamOptions | None, stream: bool) -> tuple[bool, bool]:
        """``(include_usage, continuous_usage)`` of ``stream_options``: ``include_usage`` (a last
        chunk with usage), ``continuous_usage_stats`` (vLLM's: usage in every chunk too, with
        ``include_usage`` only, as vLLM), ``include_obfuscation`` (OpenAI's padding: accepted, not
        added)."""
        if options is None:
            return False, False
        if not stream:
            raise bad("stream_options", "only allowed with stream: true")
        for key in sorted(options.model_extra or ()):
            name = f"stream_options.{key}"
            if self.strict_fields:
                raise bad(escaped(name), "unrecognized stream option (ingress.strict_fields is on)")
            _log_ignored(name, "not a stream option OpenAI or vLLM define")
        if "include_obfuscation" in options.model_fields_set:
            _log_ignored("stream_options.include_obfuscation", "accepted, not acted on (no obfuscation padding)")
        include_usage = bool(options.include_usage)
        return include_usage, include_usage and bool(options.continuous_usage_stats)

    # -- sampling controls -------------------------------------------------------------
    def _guided(self, response_format: Any) -> dict | None:
        """``response_format`` (OpenAI's ``text``, ``json_object``, ``json_schema``; our ``regex``
        and ``choice``) as a grammar spec, compiled once here against this model's tokenizer so a
        spec it cannot take is a 400 now, not a failure on a worker (compiled grammars are
        cached, the workers reuse the compilation work per process)."""
        if response_format is None:
            return None
        if isinstance(response_format, dict) and response_format.get("type") == "text" and len(response_format) == 1:
            return None  # unconstrained: needs no grammar library
        try:
            from model_executor.grammar import compile_guide, response_format_to_guided
        except ImportError as exc:  # the grammar library is an optional dependency
            raise bad("response_format", f"structured output is not available on this server ({exc.name} "
                                         "is not installed)") from None
        try:
            guided = response_format_to_guided(response_format)
            if guided is not None:
                compile_guide(guided, self.tokenizer)
        except ValueError as exc:
            message = str(exc)
            param = message.split(":", 1)[0] if message.startswith("response_format") else "response_format"
            if not message.startswith("response_format"):
                message = f"response_format: {message}"
            raise RequestError(message, param=param, status=400, code="invalid_value") from None
        return guided

    def _stop_token_ids(self, ids: list[int] | None, ignore_eos: bool) -> tuple[int, ...]:
        """The tokenizer's end-of-text ids (unless ``ignore_eos``) and the request's own."""
        self._in_vocab("stop_token_ids", ids or ())
        base = () if ignore_eos else self.stop_token_ids
        return tuple(dict.fromkeys((*base, *(ids or ()))))

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        out = []
        for key, value in (bias or {}).items():
            tok = int(key) if key.isascii() and key.isdigit() else None
            if tok is None or not tok < self.vocab_size:
                raise bad("logit_bias", f"expected token ids in [0, {self.vocab_size}) as keys, got {check_text('logit_bias', key)[:32]!r}")
            out.append((tok, float(value)))
        return tuple(out)

    @staticmethod
    def _logprobs(req: BaseModel, kind: str) -> int | None:
        if kind == "completion":
            return req.logprobs
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("top_logprobs", "requires logprobs: true")
        return _or(req.top_logprobs, 0) if req.logprobs else None
