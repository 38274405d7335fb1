"""Tool calling for chat: OpenAI ``tools`` / ``tool_choice`` checked, rendered through the
model's own chat template, forced by a grammar when the client requires a call, and parsed back
out of the generated text in the format of the model's architecture.

Formats (by ``config.model_type``: each family's ``tool_call_format`` in ``model_executor.models``):
- ``qwen2``, ``qwen3`` (Hermes style, what their templates teach): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several in a row for parallel
  calls, text outside them is content.
- ``llama`` (Llama 3.x JSON tool calling): the whole reply is ``{"name": ..., "parameters":
  {...}}``, optionally after ``<|python_tag|>``; several separated by ``;``. (The pythonic
  ``[f(a=1)]`` form of Llama 3.2's examples is not parsed: it is returned as content.)

A model takes tools only when its chat template reads a ``tools`` variable (a Hugging Face
tokenizer), or its tokenizer declares a ``tool_call_format`` (the built-in tiny model's byte
tokenizer: Hermes, see ``ByteTokenizer``); otherwise ``require_tool_support`` raises a
``ValueError`` naming ``tools``. The declared format wins over the architecture's (the tiny
model is Llama-shaped but its template teaches Hermes calls). Wherever a ``model_type`` is
taken, a format name (``hermes``, ``llama3_json``) is accepted too.

A stream is parsed as it goes (``ToolCallStream``): content out as soon as it cannot begin a call
marker, each call whole when it closes, the same content and calls as ``extract_tool_calls`` of
the whole reply.

``tool_choice``: ``"none"`` and ``"auto"`` (the default) leave decoding free and the reply is
parsed afterwards; ``"required"`` and a named function constrain decoding to the model's call
format (``tools_to_guided``, a spec for ``model_executor.grammar.compile_guide``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from . import models
from .grammar import JSON_STYLE, field_name, short_repr, validate_guided
from .tokenizer import HFTokenizer

FORMATS = models.TOOL_CALL_FORMATS
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TEMPLATE_TOOLS = re.compile(r"\btools\b")
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _format_of(model_type: object) -> str:
    if model_type in FORMATS:
        return model_type  # type: ignore[return-value]
    formats = models.tool_call_formats()
    if model_type not in formats:
        raise ValueError(f"model_type: no tool-call format for {short_repr(model_type)}; expected one of {sorted(formats)}")
    return formats[model_type]


# -- checking the request -------------------------------------------------------------------------
def validate_tools(tools: object, tool_choice: object = None, parallel_tool_calls: object = None) -> None:
    """``ValueError`` naming the field (``tools[2].function.name``, ``tool_choice``,
    ``parallel_tool_calls``, ...) for a malformed OpenAI ``tools`` list, ``tool_choice`` or
    ``parallel_tool_calls``. Each function's ``parameters`` must compile as a JSON schema
    (under its ``strict``)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools: expected a non-empty list of tools, got {short_repr(tools)}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: {len(tools)} tools, the limit is {MAX_TOOLS}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{at}: expected an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{at}.type: expected 'function', got {short_repr(tool.get('type'))}")
        for key in tool:
            if key not in ("type", "function"):
                raise ValueError(f"{at}.{field_name(key)}: not a field of a tool (fields: function, type)")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{at}.function: expected an object with a name, got {short_repr(fn)}")
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise ValueError(f"{at}.function.{field_name(key)}: not a field (fields: description, name, parameters, strict)")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{at}.function.name: expected 1 to 64 of a-z, A-Z, 0-9, _ and -, got {short_repr(name)}")
        if name in names:
            raise ValueError(f"{at}.function.name: {short_repr(name)} names two tools")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ValueError(f"{at}.function.description: expected a string, got {type(fn['description']).__name__}")
        if "description" in fn:
            try:
                fn["description"].encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{at}.function.description: not valid Unicode (a lone surrogate)") from None
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{at}.function.strict: expected a bool or null, got {short_repr(strict)}")
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"{at}.function.parameters: expected a JSON Schema object, got {type(params).__name__}")
        try:
            validate_guided({"type": "json_schema", "schema": params, "strict": bool(strict)})
        except ValueError as e:  # "schema: why" -> this field
            raise ValueError(f"{at}.function.parameters: {str(e).partition(': ')[2]}") from None
    _chosen(tools, tool_choice)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls: expected a bool, got {short_repr(parallel_tool_calls)}")


def _chosen(tools: list, tool_choice: object) -> list[dict] | None:
    """The functions decoding must call (``None``: free decoding)."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        return [t["function"] for t in tools]
    if isinstance(tool_choice, str):
        raise ValueError(f"tool_choice: expected one of {TOOL_CHOICES} or a function, got {short_repr(tool_choice)}")
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice: expected one of {TOOL_CHOICES} or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {short_repr(tool_choice)}")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    for tool in tools:
        if tool["function"]["name"] == name:
            return [tool["function"]]
    raise ValueError(f"tool_choice.function.name: expected the name of one of the tools, got {short_repr(name)}")


def chat_template_supports_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template reads a ``tools`` variable (Hugging Face
    ``chat_template``: a string, or named templates), or the tokenizer declares a
    ``tool_call_format`` (our byte tokenizer: yes; the id tokenizer: no)."""
    if not isinstance(tokenizer, HFTokenizer):
        return getattr(tokenizer, "tool_call_format", None) in FORMATS
    template = getattr(tokenizer.hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    if isinstance(template, list):  # the older list-of-{name, template} form
        template = " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return isinstance(template, str) and bool(_TEMPLATE_TOOLS.search(template))


def require_tool_support(tokenizer: Any, model_type: object) -> str:
    """The tool-call format (``hermes`` or ``llama3_json``) of the model: the tokenizer's
    declared ``tool_call_format``, else its architecture's. ``ValueError`` naming ``tools``
    unless the model's chat template takes tools and there is a format for it."""
    if not chat_template_supports_tools(tokenizer):
        raise ValueError(
            "tools: this model's chat template does not take tools (no 'tools' in its chat_template); "
            "send the request without tools, or serve a model whose template supports them"
        )
    declared = getattr(tokenizer, "tool_call_format", None)
    if declared in FORMATS:
        return declared
    formats = models.tool_call_formats()
    if model_type not in formats:
        raise ValueError(f"tools: no tool-call parser for model_type {short_repr(model_type)} (have: {sorted(formats)})")
    return formats[model_type]


def apply_chat_template_with_tools(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool = True
) -> list[int]:
    """The prompt ids of ``messages`` with ``tools`` rendered by the model's own template
    (``tools`` checked by ``validate_tools`` and ``require_tool_support`` first; ``None`` or
    empty: no tools in the prompt, e.g. for ``tool_choice: "none"``, while ``tool`` messages and
    assistant ``tool_calls`` in the history are still rendered). Assistant ``tool_calls`` should
    carry ``arguments`` as an object (what Hugging Face templates expect). A template that
    rejects the messages (e.g. raises on a role order it does not allow) is a ``ValueError``
    naming ``messages``."""
    if not chat_template_supports_tools(tokenizer):
        raise ValueError("tools: this model's chat template does not take tools")
    if not isinstance(tokenizer, HFTokenizer):  # our byte template (its errors name the field)
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt, tools=list(tools or ()) or None)
    from jinja2 import TemplateError

    try:
        ids = tokenizer.hf_tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )
    except (TemplateError, TypeError, KeyError, ValueError) as e:  # a template's raise_exception is a TemplateError
        raise ValueError(f"messages: the chat template rejected them: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


# -- forcing a call -------------------------------------------------------------------------------
def _call_schema(fn: dict, args_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: fn.get("parameters", _NO_PARAMETERS)},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def hermes_tag_tokens(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has ``<tool_call>`` and ``</tool_call>`` as single tokens (Qwen2.5's
    added tokens). llguidance counts every added token as special, so a grammar's text literal
    cannot produce them: the forcing grammar must name them as tokens instead
    (``tools_to_guided(..., tag_tokens=True)``)."""
    if not isinstance(tokenizer, HFTokenizer):
        return False
    tok = tokenizer.hf_tokenizer
    added = getattr(tok, "get_added_vocab", dict)()
    return "<tool_call>" in added and "</tool_call>" in added


def tools_to_guided(
    tools: list, tool_choice: object = None, *, model_type: str = "qwen2", parallel_tool_calls: bool = True,
    tag_tokens: bool = False,
) -> dict | None:
    """The grammar spec (``model_executor.grammar``) that forces the call ``tool_choice`` asks
    for, in ``model_type``'s format: ``None`` for ``"none"``/``"auto"``/absent (free decoding);
    for ``"required"`` a call of any of the tools (Hermes: one or more when
    ``parallel_tool_calls``), for a named function a single call of it. Arguments are
    constrained by each function's ``parameters`` schema (lenient unless every forced function
    is ``strict``). ``tag_tokens`` (Hermes): the call tags are the tokenizer's single
    ``<tool_call>`` / ``</tool_call>`` tokens (see ``hermes_tag_tokens``), not their characters.
    ``ValueError`` naming the field for a bad request."""
    validate_tools(tools, tool_choice, parallel_tool_calls)
    fmt = _format_of(model_type)
    forced = _chosen(tools, tool_choice)
    if forced is None:
        return None
    strict = all(bool(fn.get("strict")) for fn in forced)
    if fmt == "llama3_json":
        schemas = [_call_schema(fn, "parameters") for fn in forced]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return {"type": "json_schema", "schema": schema, "strict": strict}
    schemas = [_call_schema(fn, "arguments") for fn in forced]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {**JSON_STYLE, "lenient": not strict}}
    repeat = ' ("\\n" call)*' if parallel_tool_calls and tool_choice == "required" else ""
    call = ('call: <tool_call> "\\n" body "\\n" </tool_call>\n' if tag_tokens
            else 'call: "<tool_call>\\n" body "\\n</tool_call>"\n')
    lark = f"start: call{repeat}\n{call}body: %json {json.dumps(schema, ensure_ascii=False)}\n"
    guided = {"type": "lark", "grammar": lark}
    validate_guided(guided)
    return guided


# -- parsing calls out of the reply ----------------------------------------------------------------
def _call(name: object, arguments: object) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _hermes_call(body_text: str) -> dict | None:
    """The call a ``<tool_call>`` block's body holds, ``None`` if it is malformed."""
    try:
        body = json.loads(body_text)
    except ValueError:
        return None
    return _call(body.get("name"), body.get("arguments", {})) if isinstance(body, dict) else None


def _hermes(text: str) -> tuple[str | None, list[dict] | None]:
    calls, kept, last = [], [], 0
    for m in _HERMES_CALL.finditer(text):
        call = _hermes_call(m.group(1))
        if call is None:
            continue  # not a call: stays in the content
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return (text or None), None
    kept.append(text[last:])
    # the whitespace the calls leave at the ends goes: all trailing whitespace, and the leading
    # whitespace when a call comes before any other text (a reply that starts with text keeps
    # its leading whitespace, so the content can stream before the calls are known)
    content = "".join(kept).rstrip()
    if not kept[0].strip():
        content = content.lstrip()
    return (content or None), calls


def _llama(text: str) -> tuple[str | None, list[dict] | None]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return (text or None), None
        if not isinstance(obj, dict):
            return (text or None), None
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
        if call is None:
            return (text or None), None
        calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    if not calls:
        return (text or None), None
    return None, calls


def extract_tool_calls(text: str, model_type: str) -> tuple[str | None, list[dict] | None]:
    """``(content, tool_calls)`` of a reply: ``tool_calls`` in OpenAI's form (``id``,
    ``type: "function"``, ``function: {name, arguments}`` with ``arguments`` a JSON string) or
    ``None`` when the reply holds no well-formed call; ``content`` is the text outside the calls
    (``None`` if empty). A malformed call is left in the content, never an error. ``text``
    should be decoded with special tokens kept where the format uses one (Llama's
    ``<|python_tag|>``)."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str, got {type(text).__name__}")
    fmt = _format_of(model_type)
    return _llama(text) if fmt == "llama3_json" else _hermes(text)


def parse_tool_calls(text: str, model_type: str) -> list[dict] | None:
    """The tool calls in a reply (see ``extract_tool_calls``), ``None`` if it holds none."""
    return extract_tool_calls(text, model_type)[1]


# -- parsing calls out of a streamed reply ---------------------------------------------------------
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStream:
    """Tool calls parsed out of a reply as it streams, for one choice: :meth:`push` each text
    delta, :meth:`finish` at the end; both return events in order, ``("content", text)`` and
    ``("call", call)`` (a call as ``extract_tool_calls`` gives it). Whatever the split into
    deltas, the concatenated content and the calls equal ``extract_tool_calls`` of the whole
    text (content ``None`` there is ``""`` here).

    Hermes: content goes out as soon as it cannot be the beginning of ``<tool_call>``; a
    whitespace run is held until text follows it (whitespace the calls leave at the ends of
    the content is dropped, see ``_hermes``); a call goes out whole when its ``</tool_call>``
    arrives (a malformed one, and an unclosed one at the end that does not parse, is content).
    Llama 3 JSON (the whole reply is calls, or it is content): a reply whose first non-space
    character is neither ``{`` nor the start of ``<|python_tag|>`` streams as content; any
    other is held to the end and parsed whole."""

    def __init__(self, model_type: str) -> None:
        self.format = _format_of(model_type)
        self._buf = ""  # text not yet classified
        self._in_call = False  # hermes: inside a <tool_call> block (self._buf is its body)
        self._scanned = 0  # hermes: characters of the body already searched for </tool_call>
        self._ws = ""  # hermes: whitespace held until text follows it
        self._leading = True  # hermes: no text other than whitespace has gone out
        self._calls = 0
        self._plain = False  # llama: the reply cannot be calls
        self._done = False

    def push(self, text: str) -> list[tuple[str, Any]]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        if self._done:
            raise ValueError("text: the stream has finished")
        if self.format == "llama3_json":
            return self._llama_push(text)
        out: list[tuple[str, Any]] = []
        self._buf += text
        while True:
            if self._in_call:
                at = self._buf.find(_CLOSE, max(self._scanned - len(_CLOSE) + 1, 0))
                if at < 0:
                    self._scanned = len(self._buf)
                    return out
                body, self._buf = self._buf[:at], self._buf[at + len(_CLOSE):]
                self._in_call, self._scanned = False, 0
                self._block(body, _CLOSE, out)
            else:
                at = self._buf.find(_OPEN)
                if at < 0:
                    keep = _marker_prefix(self._buf, _OPEN)
                    self._content(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(self._buf[:at], out)
                self._buf, self._in_call = self._buf[at + len(_OPEN):], True

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the reply: what was held back (the calls' trailing whitespace goes)."""
        if self._done:
            return []
        self._done = True
        out: list[tuple[str, Any]] = []
        if self.format == "llama3_json":
            if self._buf:
                content, calls = _llama(self._buf)
                out += [("call", c) for c in calls] if calls else [("content", self._buf)]
            return out
        if self._in_call:  # an unclosed last call (cut by a stop or max_tokens)
            self._block(self._buf, "", out)
        else:
            self._content(self._buf, out)
        self._buf = ""
        if self._ws and not self._calls:
            out.append(("content", self._ws))
        self._ws = ""
        return out

    def _block(self, body: str, close: str, out: list) -> None:
        call = _hermes_call(body)
        if call is None:
            self._content(_OPEN + body + close, out)
            return
        self._calls += 1
        out.append(("call", call))

    def _content(self, text: str, out: list) -> None:
        start = len(text) - len(text.lstrip())
        if start == len(text):
            self._ws += text
            return
        end = len(text.rstrip())
        held = "" if self._leading and self._calls else self._ws + text[:start]
        out.append(("content", held + text[start:end]))
        self._ws, self._leading = text[end:], False

    def _llama_push(self, text: str) -> list[tuple[str, Any]]:
        if self._plain:
            return [("content", text)] if text else []
        self._buf += text
        head = self._buf.lstrip()
        if not head or head.startswith("{") or head.startswith(_PYTHON_TAG) or _PYTHON_TAG.startswith(head):
            return []  # may be calls: held to the end
        self._plain, text, self._buf = True, self._buf, ""
        return [("content", text)]
