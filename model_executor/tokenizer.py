"""Tokenizers behind one small interface: our byte-level tokenizer (for the built-in tiny
model, no files needed), the id tokenizer of the built-in structured models (token ids are
their only language), and an adapter over a Hugging Face tokenizer loaded from a directory.

Interface (what the engines and the service use):
``encode(text, add_bos=True) -> list[int]``, ``decode(ids, skip_special_tokens=True) -> str``,
``apply_chat_template(messages, add_generation_prompt=True) -> list[int]``,
``token_bytes(token_id) -> bytes`` (what one token stands for: a token holding part of a
multi-byte character gives those raw bytes, where ``decode`` would give U+FFFD),
``bos_token_id``, ``eos_token_id``, ``vocab_size``.
"""

from __future__ import annotations

import functools
import json
import re
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

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        if 0 <= token_id < self.NUM_BYTES:
            return bytes((token_id,))
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

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

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        raise ValueError("tokenizer: this model has no text vocabulary and no chat template; "
                         "send a completion with token ids as the prompt")


class HFTokenizer:
    """The same interface over a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        # transformers ignores clean_up_tokenization_spaces for BPE (and warns on the first decode):
        # false decodes the same, without the warning (loading.export_tokenizer writes it so too)
        model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
        if type(model).__name__ == "BPE" and getattr(tokenizer, "clean_up_tokenization_spaces", False) is True and \
                not getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
            tokenizer.clean_up_tokenization_spaces = False

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

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Byte-level BPE (GPT-2, Llama 3, SmolLM2): vocabulary strings spell bytes as characters."""
        return "ByteLevel" in str(getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", ""))

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str):
            fallback = _BYTE_PIECE.fullmatch(piece)  # SentencePiece's byte fallback: <0xE2>
            if fallback:
                return bytes((int(fallback.group(1), 16),))
            if self._byte_level:
                table = _byte_decoder()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

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


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's character -> byte table (the inverse of GPT-2's byte -> printable
    character map, from transformers)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def byte_chat_template() -> str:
    """``ByteTokenizer.apply_chat_template`` as a Hugging Face Jinja chat template (tools and
    tool messages included; assistant ``tool_calls`` carry ``arguments`` as objects, as Hugging
    Face templates expect). Rendered text is then tokenized with the specials parsed."""
    head, tail = TOOLS_PREAMBLE.replace("{{", "{").replace("}}", "}").split("{tools}")
    return (
        "{{- '<|bos|>' -}}"
        "{%- set rest = messages -%}"
        "{%- if tools -%}"
        "{%- set lines = namespace(s='') -%}"
        "{%- for tool in tools -%}"
        "{%- if not loop.first -%}{%- set lines.s = lines.s + '\\n' -%}{%- endif -%}"
        "{%- set lines.s = lines.s + (tool | tojson) -%}"
        "{%- endfor -%}"
        f"{{%- set system = {json.dumps(head)} + lines.s + {json.dumps(tail)} -%}}"
        "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string -%}"
        "{%- set system = messages[0]['content'] + '\\n\\n' + system -%}{%- set rest = messages[1:] -%}"
        "{%- endif -%}"
        "{{- '<|system|>' + system + '<|end|>' -}}"
        "{%- endif -%}"
        "{%- set ns = namespace(responses='', pending=false) -%}"
        "{%- for m in rest -%}"
        "{%- if m['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
        "{{- raise_exception('messages: role must be one of system, user, assistant, tool') -}}"
        "{%- endif -%}"
        "{%- if m['role'] == 'tool' -%}"
        "{%- if ns.pending -%}{%- set ns.responses = ns.responses + '\\n' -%}{%- endif -%}"
        "{%- set ns.responses = ns.responses + '<tool_response>\\n' + m['content'] + '\\n</tool_response>' -%}"
        "{%- set ns.pending = true -%}"
        "{%- else -%}"
        "{%- if ns.pending -%}"
        "{{- '<|user|>' + ns.responses + '<|end|>' -}}{%- set ns.responses = '' -%}{%- set ns.pending = false -%}"
        "{%- endif -%}"
        "{%- set text = namespace(s=m['content'] or '') -%}"
        "{%- if m['role'] == 'assistant' and m.get('tool_calls') is not none -%}"
        "{%- for call in m['tool_calls'] -%}"
        "{%- set fn = call['function'] if 'function' in call else call -%}"
        "{%- if text.s -%}{%- set text.s = text.s + '\\n' -%}{%- endif -%}"
        "{%- set text.s = text.s + '<tool_call>\\n' + ({'name': fn['name'], 'arguments': fn.get('arguments', {})} | tojson)"
        " + '\\n</tool_call>' -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|' + m['role'] + '|>' + text.s + '<|end|>' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if ns.pending -%}{{- '<|user|>' + ns.responses + '<|end|>' -}}{%- endif -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
    )


def byte_tokenizer_hf() -> Any:
    """A Hugging Face fast tokenizer that tokenizes as ``ByteTokenizer`` does, for clients that
    load a tokenizer (lm-eval, guidellm): each UTF-8 byte is its own id (a byte-level BPE without
    merges), the specials keep their ids, ``<|bos|>`` is prepended by default, and the chat
    template is ``byte_chat_template``. One difference, as with every Hugging Face tokenizer: the
    text of a special (``"<|bos|>"``) in a prompt becomes that special here, bytes in the service."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = ByteTokenizer()
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split, no prefix space: the whole text becomes its bytes, nothing else
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # ids 256.. in order; the padding id 263 (no name in ByteTokenizer) decodes as it does there
    specials = [*ByteTokenizer.SPECIALS, *(f"<|{i}|>" for i in range(tok.NUM_BYTES + len(tok.SPECIALS), tok.VOCAB_SIZE))]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", tok.bos_token_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        chat_template=byte_chat_template(), clean_up_tokenization_spaces=False, model_max_length=32768)
