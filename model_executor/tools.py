"""Tool calling for chat: OpenAI ``tools`` / ``tool_choice`` checked, rendered through the
model's own chat template, forced by a grammar when the client requires a call, and parsed back
out of the generated text in the format of the model's architecture.

Formats (by ``config.model_type``, the architectures ``model_executor.loading`` loads):
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

``tool_choice``: ``"none"`` and ``"auto"`` (the default) leave decoding free and the reply is
parsed afterwards; ``"required"`` and a named function constrain decoding to the model's call
format (``tools_to_guided``, a spec for ``model_executor.grammar.compile_guide``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .grammar import JSON_STYLE, field_name, short_repr, validate_guided
from .tokenizer import HFTokenizer

TOOL_FORMATS = {"llama": "llama3_json", "qwen2": "hermes", "qwen3": "hermes"}
FORMATS = ("hermes", "llama3_json")
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
    if model_type not in TOOL_FORMATS:
        raise ValueError(f"model_type: no tool-call format for {short_repr(model_type)}; expected one of {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[model_type]


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
    if model_type not in TOOL_FORMATS:
        raise ValueError(f"tools: no tool-call parser for model_type {short_repr(model_type)} (have: {sorted(TOOL_FORMATS)})")
    return TOOL_FORMATS[model_type]


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


def _hermes(text: str) -> tuple[str | None, list[dict] | None]:
    calls, kept, last = [], [], 0
    for m in _HERMES_CALL.finditer(text):
        try:
            body = json.loads(m.group(1))
        except ValueError:
            continue  # not a call: stays in the content
        call = _call(body.get("name"), body.get("arguments", {})) if isinstance(body, dict) else None
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return (text or None), None
    kept.append(text[last:])
    content = "".join(kept).strip()
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
