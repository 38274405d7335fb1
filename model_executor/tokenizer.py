"""Tokenizers behind one small interface: our byte-level tokenizer (for the built-in tiny
model, no files needed), the id tokenizer of the built-in structured models (token ids are
their only language), and an adapter over a Hugging Face tokenizer loaded from a directory.

Interface (what the engines and the service use):
``encode(text, add_bos=True) -> list[int]``, ``decode(ids, skip_special_tokens=True) -> str``,
``apply_chat_template(messages, add_generation_prompt=True) -> list[int]``,
``bos_token_id``, ``eos_token_id``, ``vocab_size``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_ROLES = ("system", "user", "assistant", "tool")
# The tool preamble of the byte tokenizer's chat template (Hermes / Qwen2.5-style tool calling;
# the wording is ours). ``{tools}``: one JSON object per tool, one per line.
TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call the functions described below. Their signatures, one JSON object per line, "
    "are inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with one block per call, each a JSON object holding the "
    "function's name and its arguments:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def render_tool_call(name: str, arguments: Any) -> str:
    """One call in the Hermes format the byte template writes and ``model_executor.tools``
    parses: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (JSON with
    ``", "`` / ``": "`` separators, as the tool grammar generates it)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _call_of(i: int, j: int, call: Any) -> tuple[str, Any]:
    """``(name, arguments)`` of ``messages[i].tool_calls[j]`` (OpenAI's ``{"function": {name,
    arguments}}`` or a bare ``{name, arguments}``); arguments given as a JSON string are parsed."""
    at = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{at}.function.name: expected a non-empty string")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"{at}.function.arguments: expected a JSON object (as a string), got invalid JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"{at}.function.arguments: expected a JSON object, got {type(args).__name__}")
    return fn["name"], args


class ByteTokenizer:
    """Bytes are ids 0..255; the specials follow.

    Specials: ``<|bos|>`` 256, ``<|eos|>`` 257, ``<|pad|>`` 258, ``<|system|>`` 259,
    ``<|user|>`` 260, ``<|assistant|>`` 261, ``<|end|>`` 262 (end of a chat turn); the
    vocabulary is padded to 264.

    Chat template: ``<|bos|>`` then, per message, ``<|role|>`` + UTF-8 content + ``<|end|>``;
    with ``add_generation_prompt`` a final ``<|assistant|>``.

    Tools (Hermes / Qwen2.5 style, ``tool_call_format = "hermes"``): with ``tools``, a first
    ``<|system|>`` turn holds the system message (if the first message is one), a blank line and
    ``TOOLS_PREAMBLE`` listing each tool as a JSON line. An assistant message's ``tool_calls``
    follow its content, each as ``render_tool_call`` writes it (joined by newlines). Messages of
    role ``tool`` are tool results: consecutive ones form one ``<|user|>`` turn of
    ``<tool_response>\\n{content}\\n</tool_response>`` blocks joined by newlines. Without tools
    and tool messages the prompt is exactly the plain template's.
    """

    tool_call_format = "hermes"

    NUM_BYTES = 256
    SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    VOCAB_SIZE = 264

    def __init__(self) -> None:
        self._special_ids = {name: self.NUM_BYTES + i for i, name in enumerate(self.SPECIALS)}

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def bos_token_id(self) -> int:
        return self._special_ids["<|bos|>"]

    @property
    def eos_token_id(self) -> int:
        return self._special_ids["<|eos|>"]

    @property
    def pad_token_id(self) -> int:
        return self._special_ids["<|pad|>"]

    @property
    def end_of_turn_id(self) -> int:
        return self._special_ids["<|end|>"]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation: end of text and end of a chat turn."""
        return (self.eos_token_id, self.end_of_turn_id)

    def special_id(self, name: str) -> int:
        if name not in self._special_ids:
            raise ValueError(f"name: expected one of {self.SPECIALS}, got {name!r}")
        return self._special_ids[name]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        names = {v: k for k, v in self._special_ids.items()}
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                out.extend((i,))
            elif not skip_special_tokens:
                out.extend(names.get(i, f"<|{i}|>").encode())
            elif i >= self.VOCAB_SIZE or i < 0:
                raise ValueError(f"ids: token id {i} is outside the vocabulary [0, {self.VOCAB_SIZE})")
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *, tools: Sequence[dict] | None = None
    ) -> list[int]:
        """The prompt ids (see the class docstring); ``ValueError`` naming ``messages[i].<field>``
        or ``tools``."""
        turns: list[tuple[str, str]] = []  # (role, text)
        messages = list(messages)
        if tools:
            if not isinstance(tools, (list, tuple)):
                raise ValueError(f"tools: expected a list, got {type(tools).__name__}")
            lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            system = TOOLS_PREAMBLE.format(tools=lines)
            first = messages[0] if messages else None
            if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
                system = first["content"] + "\n\n" + system
                messages = messages[1:]
                offset = 1
            else:
                offset = 0
            turns.append(("system", system))
        else:
            offset = 0
        responses: list[str] = []
        for k, message in enumerate(messages):
            i = k + offset
            role = message.get("role") if isinstance(message, dict) else None
            if role not in _ROLES:
                raise ValueError(f"messages[{i}].role: expected one of {_ROLES}, got {role!r}")
            content = message.get("content", "")
            calls = message.get("tool_calls") if role == "assistant" else None
            if content is None and (calls or role == "assistant"):
                content = ""
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: expected a str, got {type(content).__name__}")
            if role == "tool":
                responses.append(f"<tool_response>\n{content}\n</tool_response>")
                continue
            if responses:
                turns.append(("user", "\n".join(responses)))
                responses = []
            if calls is not None:
                if not isinstance(calls, (list, tuple)):
                    raise ValueError(f"messages[{i}].tool_calls: expected a list, got {type(calls).__name__}")
                rendered = [render_tool_call(*_call_of(i, j, c)) for j, c in enumerate(calls)]
                content = "\n".join(([content] if content else []) + rendered)
            turns.append((role, content))
        if responses:
            turns.append(("user", "\n".join(responses)))
        ids = [self.bos_token_id]
        for role, text in turns:
            ids.append(self._special_ids[f"<|{role}|>"])
            ids.extend(text.encode("utf-8"))
            ids.append(self.end_of_turn_id)
        if add_generation_prompt:
            ids.append(self._special_ids["<|assistant|>"])
        return ids


class IdTokenizer:
    """For models without a text vocabulary (the built-in structured benchmark models): clients
    send token ids. Text still works for smoke tests: each UTF-8 byte ``b`` becomes id
    ``BYTE_OFFSET + b``. ``decode`` writes each id as ``<id>``. No stop tokens: a generation
    always runs to ``max_tokens``. No chat template (chat requests answer 400)."""

    BYTE_OFFSET = 2

    def __init__(self, vocab_size: int, *, bos_token_id: int | None = None) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < self.BYTE_OFFSET + 256:
            raise ValueError(f"vocab_size: expected an int >= {self.BYTE_OFFSET + 256}, got {vocab_size!r}")
        if bos_token_id is not None and not (0 <= bos_token_id < vocab_size):
            raise ValueError(f"bos_token_id: expected None or an id in [0, {vocab_size}), got {bos_token_id!r}")
        self._vocab_size = vocab_size
        self._bos = bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> None:
        return None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return ()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        ids = [self.BYTE_OFFSET + b for b in text.encode("utf-8")]
        return [self._bos, *ids] if add_bos and self._bos is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"ids: token id {i} is outside the vocabulary [0, {self._vocab_size})")
            if not (skip_special_tokens and i == self._bos):
                out.append(f"<{i}>")
        return "".join(out)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        raise ValueError("tokenizer: this model has no text vocabulary and no chat template; "
                         "send a completion with token ids as the prompt")


class HFTokenizer:
    """The same interface over a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @property
    def hf_tokenizer(self) -> Any:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return () if self._tok.eos_token_id is None else (int(self._tok.eos_token_id),)

    @property
    def tool_call_format(self) -> str | None:
        """``"hermes"`` when the chat template writes ``<tool_call>`` blocks (Qwen2.5's, the built-in
        SmolLM2's), else None: the architecture decides (``model_executor.tools``). A Llama-arch
        model with a Hermes template must not be parsed as Llama 3's bare JSON."""
        template = getattr(self._tok, "chat_template", None)
        return "hermes" if isinstance(template, str) and "<tool_call>" in template else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(
                "tokenizer: this tokenizer has no chat_template (tokenizer_config.json); "
                "send a plain prompt instead"
            )
        ids = self._tok.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
