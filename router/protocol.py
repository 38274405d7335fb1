"""The OpenAI-compatible wire protocol: request validation, response and error objects.

A request body is validated through its pydantic model (``router/openai_models.py``: every
field's type, range and allowed values); what depends on the served model (vocabulary, context
length, chat template, grammars) and the rules between fields are checked here. Every bad field
gets a 400 naming it (OpenAI's ``invalid_request_error`` shape), not a generic 422. The gRPC
service reuses the same validation (``router/app.py`` turns its message into the same dict).
What comes out is a :class:`GenerationRequest`: token ids and sampling options, everything the
workers need, nothing they do not.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from model_executor.sampling import SamplingParams
from serving.errors import RequestError

from .openai_models import (CHUNKS, MAX_SEED, REQUESTS, RESPONSES, ChatMessage, ErrorResponse, StreamOptions,
                            ignored_fields, json_schema)

logger = logging.getLogger("ray.serve")

SYSTEM_FINGERPRINT = "fp_flashprefill"  # ``system_fingerprint`` of every response
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat takes them (neutral in completions)
STREAM_OPTIONS = tuple(StreamOptions.model_fields)
# roles the chat templates do not know, and the role they are rendered as
_ROLE_AS = {"developer": "system"}
_IGNORED = {kind: ignored_fields(kind) for kind in REQUESTS}
_MESSAGES = TypeAdapter(Annotated[list[ChatMessage], Field(min_length=1)])
# errors inside these fields name the field, not the entry (a stop string, a token id, a bias)
_NAMED_WHOLE = frozenset({"stop", "logit_bias", "stop_token_ids", "sparse_attention"})
# the models' own error types: their message says what was expected, and shows no input
_OWN_ERRORS = frozenset({"invalid_type", "neutral", "invalid_unicode", "not_printable"})
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


def bad(param: str, message: str) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, status=400, code="invalid_value")


def _escaped(text: str) -> str:
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
    return _escaped(str(parts[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts[1:]))[:200]


def _request_error(exc: ValidationError, body: Any, prefix: tuple = ()) -> RequestError:
    """pydantic's first error as a 400 naming the field: ``<param>: <what>, got <value>``."""
    err = exc.errors(include_url=False)[0]
    at = (err.get("ctx") or {}).get("field")  # a rule between a message's fields names the one at fault
    param = _param((*prefix, *err["loc"], *((at,) if at else ())), body)
    if err["type"] == "string_unicode" and isinstance(err["input"], str):  # pydantic's own lone-surrogate check
        try:
            _check_text(param, err["input"])
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
        message = f"{err['msg']}, got {_escaped(repr(err['input']))[:100]}"
    return bad(param, message[:300])


def _check_text(name: str, value: str) -> str:
    """A string field must be valid Unicode that UTF-8 can encode (JSON lets a client send a
    lone surrogate such as ``"\\ud800"``, which no tokenizer can encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(name, f"invalid Unicode: a lone surrogate (U+{ord(value[exc.start]):04X}) at character "
                        f"{exc.start}") from None
    return value


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
            raise bad(_escaped(name), "unrecognized request argument (ingress.strict_fields is on)")
        _log_ignored(name, "not a field OpenAI or vLLM define for this endpoint")
    for name in sorted(set(body) & _IGNORED[kind]):
        _log_ignored(name, "accepted, not acted on (docs/API.md, Request fields)")
    # an ignored unknown field is not the model's to check: a name pydantic cannot take as a
    # string (a lone surrogate) must not turn a valid request into a 400
    return {k: v for k, v in body.items() if k not in unknown} if unknown else body


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


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
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk (vLLM's)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    n: int = 1  # choices per prompt
    best_of: int | None = None  # generate this many per prompt, return the n of highest logprob
    batch: tuple[tuple[int, ...], ...] = ()  # every prompt of a list of prompts (() : just this one)
    echo: bool = False  # completions: the prompt (and with logprobs its logprobs) before the output
    # leading prompt tokens the tokenizer added (a BOS the client did not send): not echoed; of
    # this prompt (echo_skip) or of each prompt of ``batch`` (batch_skip)
    echo_skip: int = 0
    batch_skip: tuple[int, ...] = ()
    sparse_alpha: float | None = None  # per-request sparsity: the prefill's alpha (0: dense); None: the service's
    # the request's other sparse options: (name, value) pairs (last_dense_tiles, energy_rule, dense_layers)
    sparse_options: tuple[tuple[str, object], ...] = ()
    guided: dict | None = None  # structured output (response_format or forced tool calls): model_executor.grammar's spec
    tool_format: str | None = None  # chat with tools: the reply is parsed for calls in this format (tools.FORMATS)
    parallel_tool_calls: bool = True  # False: at most one call is returned
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_len(self) -> int:
        """Prompt tokens of the request (of all its prompts, each counted once, as OpenAI)."""
        return sum(len(p) for p in self.batch) if self.batch else len(self.prompt_token_ids)

    @property
    def response_id(self) -> str:
        """The ``id`` of the response objects: OpenAI's ``cmpl-`` / ``chatcmpl-`` prefix on the
        request id (which may come from ``x-request-id`` or the ``request_id`` field)."""
        prefix = "cmpl-" if self.kind == "completion" else "chatcmpl-"
        return self.request_id if self.request_id.startswith(prefix) else prefix + self.request_id

    @property
    def single(self) -> bool:
        return not self.batch and self.n == 1 and self.best_of is None

    def choices(self) -> list[list["GenerationRequest"]]:
        """Per prompt, the single requests its choices come from (``best_of`` or ``n`` of them):
        each its own request id, and with a seed, seeds ``seed, seed + 1, ...`` (choice 0 is the
        n=1 answer). With ``best_of`` they keep logprobs, the ranking's score."""
        per_prompt = self.best_of or self.n
        logprobs = self.logprobs if self.best_of is None else (self.logprobs or 0)
        out = []
        for i, ids in enumerate(self.batch or (self.prompt_token_ids,)):
            row = []
            for j in range(per_prompt):
                k = i * per_prompt + j
                row.append(replace(self, request_id=f"{self.request_id}-{k}", prompt_token_ids=tuple(ids), batch=(),
                                   echo_skip=self.batch_skip[i] if self.batch_skip else self.echo_skip,
                                   batch_skip=(), n=1, best_of=None, logprobs=logprobs,
                                   seed=None if self.seed is None else (self.seed + j) % (MAX_SEED + 1)))
            out.append(row)
        return out

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            max_new_tokens=max(self.max_tokens, 1), stop_token_ids=self.stop_token_ids, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            guided=self.guided,
        )


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
            raise _request_error(exc, body, ("messages",)) from None
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
            _check_text(f"{here}.id", call["id"])
            if call.get("type", "function") != "function":
                raise bad(f"{here}.type", f"expected 'function', got {call.get('type')!r}"[:200])
            fn = call.get("function")
            if not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
                raise bad(f"{here}.function", "expected {name, arguments}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad(f"{here}.function.name", f"expected a non-empty string, got {fn.get('name')!r}"[:200])
            _check_text(f"{here}.function.name", fn["name"])
            args = fn.get("arguments")
            if not isinstance(args, str):
                raise bad(f"{here}.function.arguments", f"expected a JSON object as a string, got {type(args).__name__}")
            try:
                parsed = json.loads(_check_text(f"{here}.function.arguments", args))
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
        _check_text("model", model)
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
            raise _request_error(exc, body) from None
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
            temperature=_or(req.temperature, 1.0),
            top_p=_or(req.top_p, 1.0),
            top_k=max(top_k, 0),
            min_p=_or(req.min_p, 0.0),
            seed=req.seed,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            stop_token_ids=self._stop_token_ids(req.stop_token_ids, bool(req.ignore_eos)),
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            return_token_ids=bool(req.return_token_ids),
            return_tokens_as_token_ids=bool(req.return_tokens_as_token_ids),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            logit_bias=self._logit_bias(req.logit_bias),
            min_tokens=min_tokens,
            logprobs=self._logprobs(req, kind),
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
                raise bad(_escaped(name), "unrecognized stream option (ingress.strict_fields is on)")
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
                raise bad("logit_bias", f"expected token ids in [0, {self.vocab_size}) as keys, got {_check_text('logit_bias', key)[:32]!r}")
            out.append((tok, float(value)))
        return tuple(out)

    @staticmethod
    def _logprobs(req: BaseModel, kind: str) -> int | None:
        if kind == "completion":
            return req.logprobs
        if req.top_logprobs is not None and not req.logprobs:
            raise bad("top_logprobs", "requires logprobs: true")
        return _or(req.top_logprobs, 0) if req.logprobs else None


# ----------------------------------------------------------------------------- responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
          sparse_attention: dict | None = None) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens reused from the prefix cache;
    ``sparse_attention`` (extension): how the prefill ran (``{"alpha", "dense", "density"}``:
    ``density`` is the measured fraction of causal (query tile, 64-key tile) pairs attended,
    1.0 when dense)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if sparse_attention is not None:
        out["sparse_attention"] = sparse_attention
    if cached_tokens is not None:  # after a resume the re-prefilled context is longer than the prompt
        out["prompt_tokens_details"] = {"cached_tokens": min(int(cached_tokens), prompt_tokens)}
    return out


class UsageAccount:
    """The ``usage`` of one request, fed each choice's generated tokens and timing (every delta
    of a stream, or each finished choice of a unary answer), in any order. One definition for
    every front end:

    - ``completion_tokens``: every token generated (best_of's discarded choices too: the caller
      sets the total);
    - ``cached_tokens``: OpenAI's ``prompt_tokens_details.cached_tokens`` is a part of
      ``prompt_tokens``, which counts each prompt once however many choices it has; so each
      prompt counts the cached tokens of ONE prefill: those reported by its lowest-index choice
      (the choices of a prompt share their prefill). None while no choice reported any;
    - ``sparse_attention``: how the prefill of the lowest-index reporting choice ran (only for
      a request that set its own)."""

    def __init__(self, req: GenerationRequest) -> None:
        self.req = req
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}  # choice index -> the cached tokens its prefill reported
        self._sparse: dict[int, dict] = {}

    def add(self, index: int, tokens: int, timing: dict | None = None) -> None:
        self.completion_tokens += tokens
        if not timing:
            return
        if timing.get("cached_tokens") is not None:
            self._cached[index] = int(timing["cached_tokens"])
        if timing.get("sparse_attention"):
            self._sparse[index] = timing["sparse_attention"]

    def cached_tokens(self) -> int | None:
        if not self._cached:
            return None
        per_prompt: dict[int, int] = {}
        for index in sorted(self._cached):  # the lowest index of a prompt names its count
            per_prompt.setdefault(index // self.req.n, self._cached[index])
        return sum(per_prompt.values())

    def sparse_attention(self) -> dict | None:
        return self._sparse[min(self._sparse)] if self._sparse else None

    def usage(self) -> dict:
        return usage(self.req.prompt_len, self.completion_tokens, self.cached_tokens(),
                     self.sparse_attention() if self.req.sparse_alpha is not None or self.req.sparse_options
                     else None)

    def running(self) -> dict:
        """The tokens so far, without prompt details (vLLM's ``continuous_usage_stats``)."""
        return usage(self.req.prompt_len, self.completion_tokens)


def choices_usage(req: GenerationRequest, choices: list, completion_tokens: int | None = None) -> dict:
    """The usage of a unary answer: ``choices`` as :func:`completion_response` takes them."""
    account = UsageAccount(req)
    for index, _, res in choices:
        account.add(index, len(res.token_ids), res.timing)
    if completion_tokens is not None:
        account.completion_tokens = completion_tokens
    return account.usage()


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
    ``entries``: ``router.pipeline.Logprob`` values."""
    if req.logprobs is None or entries is None:
        return None
    if req.kind == "completion":
        offsets, at = [], text_offset
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        # echo: the prompt's first token has no logprob (nothing before it predicts it)
        return {"tokens": [_named(req, e.token_id, e.token) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else _top_dict(req, e.top) for e in entries],
                "text_offset": offsets}

    def raw(token: str, of: bytes | None) -> list[int]:
        return list(of) if of is not None else _token_bytes(token)

    content = []
    for e in entries:
        top_bytes = e.top_bytes or (None,) * len(e.top)
        content.append({"token": _named(req, e.token_id, e.token), "logprob": e.logprob,
                        "bytes": raw(e.token, e.token_bytes),
                        "top_logprobs": [{"token": _named(req, i, t), "logprob": lp, "bytes": raw(t, b)}
                                         for (i, t, lp), b in zip(e.top, top_bytes)]})
    return {"content": content, "refusal": None}


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
    chunks = []
    for i, (kind, value) in enumerate(events):
        chunk = stream_chunk(req, value if kind == "content" else None, token_ids if i == 0 else [],
                             finish if i == len(events) - 1 else None, first=first and i == 0,
                             logprobs=logprobs if i == 0 else None, index=index)
        if kind == "call":
            chunk["choices"][0]["delta"]["tool_calls"] = [value]
        chunks.append(chunk)
    return chunks


def completion_response(req: GenerationRequest, result: Any, *, choices: list | None = None,
                        completion_tokens: int | None = None) -> dict:
    """``result``: a ``router.pipeline.Completion`` (with ``n``, a list of prompts or
    ``best_of``: ``choices``, ``(index, prompt_token_ids, Completion)`` per returned choice,
    ``result`` the first; ``completion_tokens``: every token generated, best_of's discarded
    ones included)."""
    choices = choices if choices is not None else [(0, req.prompt_token_ids, result)]
    out_choices = []
    for index, prompt_ids, res in choices:
        lp = logprobs_object(req, (res.prompt_logprobs or []) + (res.logprobs or []) if req.echo else res.logprobs)
        if req.kind == "completion":
            choice = {"index": index, "text": (res.prompt_text or "") + res.text if req.echo else res.text, "finish_reason": res.finish_reason, "logprobs": lp}
        else:
            content, calls, finish = split_tool_calls(req, res.text, res.finish_reason)
            message = {"role": "assistant", "content": content}
            if calls is not None:
                message["tool_calls"] = calls
            choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}
        if req.return_token_ids:
            choice["token_ids"] = list(res.token_ids)
            choice["prompt_token_ids"] = list(prompt_ids)
        out_choices.append(choice)
    out = {
        "id": req.response_id, "object": "text_completion" if req.kind == "completion" else "chat.completion",
        "created": req.created, "model": req.model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": out_choices,
        "usage": choices_usage(req, choices, completion_tokens),
        "timing": result.timing,
    }
    if result.routing is not None:
        out["routing"] = result.routing
    return out


def stream_chunk(req: GenerationRequest, text: str | None, token_ids: list[int], finish_reason: str | None,
                 *, first: bool = False, logprobs: list | None = None, text_offset: int = 0, index: int = 0) -> dict:
    lp = logprobs_object(req, logprobs, text_offset)
    if req.kind == "completion":
        choice: dict = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": lp}
        obj = "text_completion"
    else:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": lp}
        obj = "chat.completion.chunk"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice]}


def usage_chunk(req: GenerationRequest, usage_object: dict) -> dict:
    """A stream's usage chunk (``include_usage``): ``usage_object`` from :class:`UsageAccount`."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.response_id, "object": obj, "created": req.created, "model": req.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage_object}


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
