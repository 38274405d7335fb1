"""Constrained decoding: a grammar (JSON schema, any JSON object, regex, a choice of strings)
turned into a per-step token mask, through llguidance (docs/STRUCTURED_OUTPUT.md says why
that library).

Specs (``guided``, plain dicts, as they come from a request):
``{"type": "json_object"}``; ``{"type": "json_schema", "schema": {...}, "strict": bool}`` (the
content of OpenAI's ``response_format.json_schema``); ``{"type": "regex", "pattern": str}`` (Rust
``regex`` syntax, matched in full, with ``\\d``, ``\\w``, ``\\s`` the ASCII classes, as under
Python's ``re.ASCII``); ``{"type": "choice", "choices": [str, ...]}``; and ``{"type": "lark", "grammar": str}`` (an
llguidance Lark grammar; ``model_executor.tools`` builds these for forced tool calls).

Public API (``fill_masks``: the batch form of ``fill_mask``): ``validate_guided`` (everything that needs no tokenizer: field types, the regex, the
schema's compilation; where requests enter), ``compile_guide`` (a ``Guide`` per request, its
grammar compiled once per spec and tokenizer and cached), ``Guide.fill_mask`` / ``accept`` /
``is_terminated`` (the decode sampler's per-token calls), ``response_format_to_guided`` (an OpenAI
``response_format`` body to a spec).

JSON is generated compact (``", "`` and ``": "`` separators, no other whitespace) unless the
schema's ``x-guidance`` says otherwise: flexible whitespace lets a model wander into endless
newlines, and no JSON parser cares. ``strict: false`` makes schema keywords llguidance does not
implement ignored; ``strict: true`` makes them an error.

The mask is computed on the host (llguidance, one bit per token) and expanded on the logits'
device; a request without a spec never reaches this module.
"""

from __future__ import annotations

import json
import logging
import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    import torch  # the masks' (decode replicas); the ingress compiles guides without torch

from .tokenizer import ByteTokenizer, HFTokenizer, IdTokenizer

logger = logging.getLogger(__name__)

GUIDED_TYPES = ("json_object", "json_schema", "regex", "choice", "lark")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice")
MAX_SPEC_CHARS = 256 * 1024  # a serialized spec (schema, pattern, choices) larger than this is refused
MAX_CHOICES = 4096
_MAX_MESSAGE = 600  # llguidance's error text, cut (verbose errors quote the grammar)
CACHE_SIZE = 128  # compiled grammars kept per tokenizer (least recently used dropped)

_FIELDS = {
    "json_object": {"type"},
    "json_schema": {"type", "schema", "strict"},
    "regex": {"type", "pattern"},
    "choice": {"type", "choices"},
    "lark": {"type", "grammar"},
}
# how JSON is laid out (llguidance JSON options; a schema's "x-guidance" overrides them)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# response_format.json_schema.name: OpenAI's rule (letters, digits, _ and -, at most 64)
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


# -- validation -----------------------------------------------------------------------------------
def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut for an error message (a request can send megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_name(key: object) -> str:
    """A request's key as it can appear in an error's field path: itself when it is a short
    identifier, else its cut repr (no lone surrogate reaches a message)."""
    return key if isinstance(key, str) and key.isidentifier() and key.isascii() and len(key) <= 64 else short_repr(key)


def _check_text(name: str, value: object, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name}: expected a non-empty string, got ''")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode (a lone surrogate at index {e.start})") from None
    return value


def _dump_json(name: str, value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode (a lone surrogate in a string)") from e
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{name}: expected plain JSON (objects, arrays, strings, finite numbers), {e}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{name}: {len(text)} characters serialized, the limit is {MAX_SPEC_CHARS}")
    return text


def _grammar_of(guided: dict, prefix: str) -> str:
    """The llguidance grammar text of a spec whose fields were checked (not yet compiled)."""
    kind = guided["type"]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if kind == "json_schema":
        overrides = {"lenient": True} if not guided.get("strict", False) else None
        return llguidance.LLMatcher.grammar_from_json_schema(
            _dump_json(f"{prefix}schema", guided["schema"]), defaults=JSON_STYLE, overrides=overrides
        )
    if kind == "regex":  # \d, \w, \s: ASCII, as under Python's re.ASCII and in JSON Schema
        return llguidance.LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(guided["pattern"], "dws") + "/")
    if kind == "choice":
        return llguidance.grammar_from("choice", list(guided["choices"]))
    return llguidance.LLMatcher.grammar_from_lark(guided["grammar"])


_SPEC_FIELD = {"json_object": "type", "json_schema": "schema", "regex": "pattern", "choice": "choices", "lark": "grammar"}


def _check_guided(guided: object, prefix: str) -> str:
    """Checks ``guided`` (fields named ``prefix + field``); returns its grammar, validated."""
    if not isinstance(guided, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'guided'}: expected an object, got {type(guided).__name__}")
    kind = guided.get("type")
    if kind not in GUIDED_TYPES:
        raise ValueError(f"{prefix}type: expected one of {GUIDED_TYPES}, got {short_repr(kind)}")
    for key in guided:
        if key not in _FIELDS[kind]:
            raise ValueError(f"{prefix}{field_name(key)}: not a field of a {kind!r} spec (fields: {sorted(_FIELDS[kind])})")
    if kind == "json_schema":
        if "schema" not in guided:
            raise ValueError(f"{prefix}schema: required for type 'json_schema'")
        if not isinstance(guided["schema"], dict):
            raise ValueError(f"{prefix}schema: expected a JSON Schema object, got {type(guided['schema']).__name__}")
        _dump_json(f"{prefix}schema", guided["schema"])
        if not isinstance(guided.get("strict", False), bool):
            raise ValueError(f"{prefix}strict: expected a bool, got {short_repr(guided['strict'])}")
    elif kind == "regex":
        if "pattern" not in guided:
            raise ValueError(f"{prefix}pattern: required for type 'regex'")
        _check_text(f"{prefix}pattern", guided["pattern"])
        if len(guided["pattern"]) > MAX_SPEC_CHARS:
            raise ValueError(f"{prefix}pattern: {len(guided['pattern'])} characters, the limit is {MAX_SPEC_CHARS}")
    elif kind == "choice":
        choices = guided.get("choices")
        if not isinstance(choices, (list, tuple)) or not choices:
            raise ValueError(f"{prefix}choices: expected a non-empty list of strings, got {short_repr(choices)}")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"{prefix}choices: {len(choices)} choices, the limit is {MAX_CHOICES}")
        for i, c in enumerate(choices):
            _check_text(f"{prefix}choices[{i}]", c, allow_empty=False)
        _dump_json(f"{prefix}choices", list(choices))
    elif kind == "lark":
        if "grammar" not in guided:
            raise ValueError(f"{prefix}grammar: required for type 'lark'")
        _check_text(f"{prefix}grammar", guided["grammar"], allow_empty=False)
    if kind == "regex":  # checked as written first: its errors then point into the pattern itself
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_regex(guided["pattern"]))
        if is_error:
            raise ValueError(f"{prefix}pattern: {messages[0].strip()[:_MAX_MESSAGE]}")
    try:
        grammar = _grammar_of(guided, prefix)
    except ValueError as e:  # llguidance's own parse of the schema (e.g. its nesting limit)
        raise ValueError(f"{prefix}{_SPEC_FIELD[kind]}: {str(e)[:_MAX_MESSAGE]}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{prefix}{_SPEC_FIELD[kind]}: {messages[0].strip()[:_MAX_MESSAGE]}")
    return grammar


def validate_guided(guided: dict) -> None:
    """Raises ``ValueError`` naming the offending field (``type``, ``schema``, ``strict``,
    ``pattern``, ``choices[i]``, ...) for a bad spec: a wrong type, an unknown field, a lone
    surrogate, a regex or schema llguidance cannot compile. Needs no tokenizer."""
    _check_guided(guided, "")


def response_format_to_guided(response_format: dict) -> dict | None:
    """An OpenAI ``response_format`` body to a spec: ``{"type": "text"}`` -> ``None`` (no
    constraint); ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name",
    "description"?, "schema"?, "strict"?}}`` (no ``schema``: any JSON object); and our extension
    ``{"type": "regex", "pattern"}`` / ``{"type": "choice", "choices"}``. The spec is validated;
    a ``ValueError`` names ``response_format.<field>``."""
    name = "response_format"
    if not isinstance(response_format, dict):
        raise ValueError(f"{name}: expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"{name}.type: expected one of {RESPONSE_FORMAT_TYPES}, got {short_repr(kind)}")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(
        kind, _FIELDS.get(kind, set())
    )
    for key in response_format:
        if key not in allowed:
            raise ValueError(f"{name}.{field_name(key)}: not a field of response_format type {kind!r} (fields: {sorted(allowed)})")
    if kind == "text":
        return None
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict):
            raise ValueError(f"{name}.json_schema: expected an object with name and schema, got {short_repr(body)}")
        for key in body:
            if key not in ("name", "description", "schema", "strict"):
                raise ValueError(f"{name}.json_schema.{field_name(key)}: not a field (fields: description, name, schema, strict)")
        schema_name = body.get("name")
        _check_text(f"{name}.json_schema.name", schema_name, allow_empty=False)
        if len(schema_name) > 64 or not set(schema_name) <= _NAME_CHARS:
            raise ValueError(f"{name}.json_schema.name: expected at most 64 of a-z, A-Z, 0-9, _ and -, got {short_repr(schema_name)}")
        if "description" in body:
            _check_text(f"{name}.json_schema.description", body["description"])
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{name}.json_schema.strict: expected a bool or null, got {short_repr(strict)}")
        guided = {"type": "json_schema", "schema": body.get("schema", {"type": "object"}), "strict": bool(strict)}
        _check_guided(guided, f"{name}.json_schema.")
        return guided
    guided = dict(response_format)
    _check_guided(guided, f"{name}.")
    return guided


# -- tokenizers and the compiled-grammar cache ------------------------------------------------
def _byte_ll_tokenizer(tok: ByteTokenizer) -> llguidance.LLTokenizer:
    class _Bytes:  # what llguidance.TokenizerWrapper reads: token bytes, specials, eos, encode
        eos_token_id = tok.eos_token_id
        bos_token_id = tok.bos_token_id
        # llguidance marks special tokens with a leading 0xFF byte (never in UTF-8 text)
        tokens = [bytes([i]) for i in range(tok.NUM_BYTES)] + [
            b"\xff" + (tok.SPECIALS[i - tok.NUM_BYTES] if i - tok.NUM_BYTES < len(tok.SPECIALS) else f"<|{i}|>").encode()
            for i in range(tok.NUM_BYTES, tok.vocab_size)
        ]
        special_token_ids = list(range(tok.NUM_BYTES, tok.vocab_size))

        def __call__(self, text):
            return list(text.encode("utf-8") if isinstance(text, str) else text)

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Bytes()), n_vocab=tok.vocab_size, eos_token=list(tok.stop_token_ids)
    )


def _hf_ll_tokenizer(tok: HFTokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer, built from our own per-token bytes
    (``HFTokenizer.token_bytes``) rather than from tokenizer.json: llguidance's own reader
    (``llguidance.hf.from_tokenizer``) recognises byte-level BPE only by a bare ``ByteLevel``
    decoder, and a tokenizer converted from GGUF (SmolLM2's) has a decoder *sequence* ending in
    ByteLevel; read that way, every token spelled with GPT-2's byte characters ("Ġ" for a space)
    became those characters' UTF-8 bytes, and the grammar masks went wrong (tests/test_real_model.py)."""
    from transformers import PreTrainedTokenizerFast

    hf = tok.hf_tokenizer
    if not isinstance(hf, PreTrainedTokenizerFast):
        raise ValueError(
            f"tokenizer: guided decoding needs a fast Hugging Face tokenizer (tokenizer.json), "
            f"got {type(hf).__name__}"
        )
    n_known = len(hf)
    special = {int(i) for i in hf.all_special_ids}
    # every added token is matched whole, by name (``<tool_call>`` in a grammar), as llguidance's own reader does
    special |= {int(i) for i in hf.added_tokens_decoder}
    special |= set(range(n_known, tok.vocab_size))  # the model's padding rows: never text

    def piece(i: int) -> bytes:
        if i in special:  # llguidance marks special tokens with a leading 0xFF (never in UTF-8)
            name = hf.convert_ids_to_tokens(i) if i < n_known else None
            return b"\xff" + (name or f"<|{i}|>").encode("utf-8")
        return tok.token_bytes(i)

    class _Vocab:  # what llguidance.TokenizerWrapper reads
        eos_token_id = tok.stop_token_ids[0]
        bos_token_id = getattr(hf, "bos_token_id", None)
        tokens = [piece(i) for i in range(tok.vocab_size)]
        special_token_ids = sorted(special)

        def __call__(self, text: str) -> list[int]:
            return hf.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocab()), n_vocab=tok.vocab_size, eos_token=list(tok.stop_token_ids)
    )


def _check_tokenizer(tokenizer: Any) -> None:
    if not getattr(tokenizer, "stop_token_ids", ()) and isinstance(tokenizer, (ByteTokenizer, HFTokenizer, IdTokenizer)):
        raise ValueError(
            f"tokenizer: guided decoding needs a tokenizer with an end-of-sequence token to end on; "
            f"{type(tokenizer).__name__} has none (a model without a text vocabulary)"
        )
    if not isinstance(tokenizer, (ByteTokenizer, HFTokenizer)):
        raise ValueError(f"tokenizer: expected a ByteTokenizer or HFTokenizer, got {type(tokenizer).__name__}")


def _ll_tokenizer(tokenizer: ByteTokenizer | HFTokenizer) -> llguidance.LLTokenizer:
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_ll_tokenizer(tokenizer)
    return _hf_ll_tokenizer(tokenizer)


class _TokenizerEntry:
    """llguidance's view of one tokenizer, and its compiled grammars (an LRU by spec)."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()


class GrammarCache:
    """Compiled grammars by (spec, tokenizer): a fresh ``LLMatcher`` per entry, deep-copied for
    each ``Guide`` (a copy skips the lexer and parser construction). Tokenizers are held weakly,
    so a replaced model's entries go with it. Thread-safe."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected an int >= 1, got {size!r}")
        self.size = size
        self._entries: weakref.WeakKeyDictionary[Any, _TokenizerEntry] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _entry(self, tokenizer: Any) -> _TokenizerEntry:
        _check_tokenizer(tokenizer)
        with self._lock:
            entry = self._entries.get(tokenizer)
        if entry is None:
            entry = _TokenizerEntry(_ll_tokenizer(tokenizer))  # outside the lock: ~1 s for a large HF vocab
            with self._lock:
                entry = self._entries.setdefault(tokenizer, entry)
        return entry

    def warm(self, tokenizer: Any) -> None:
        """Converts ``tokenizer`` for llguidance now (about a second for a 128k-token vocabulary),
        e.g. when a replica starts, so that its first guided request does not wait for it."""
        self._entry(tokenizer)

    def compile(self, guided: dict, tokenizer: Any) -> Guide:
        try:
            key = json.dumps(guided, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            _check_guided(guided, "")  # raises, naming the field
            raise
        entry = self._entry(tokenizer)
        with self._lock:
            template = entry.matchers.get(key)
            if template is not None:
                entry.matchers.move_to_end(key)
                self.hits += 1
        if template is None:
            grammar = _check_guided(guided, "")
            template = llguidance.LLMatcher(entry.ll_tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"{_SPEC_FIELD[guided['type']]}: {template.get_error().strip()[:_MAX_MESSAGE]}")
            with self._lock:
                self.misses += 1
                entry.matchers[key] = template
                while len(entry.matchers) > self.size:
                    entry.matchers.popitem(last=False)
        return Guide(template.deep_copy(), entry.ll_tokenizer)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


_DEFAULT_CACHE = GrammarCache()


def warm_tokenizer(tokenizer: Any) -> None:
    """``GrammarCache.warm`` on the default cache (``ValueError`` naming ``tokenizer`` for one
    guided decoding cannot use)."""
    _DEFAULT_CACHE.warm(tokenizer)


def compile_guide(guided: dict, tokenizer: Any, *, cache: GrammarCache | None = None) -> Guide:
    """A ``Guide`` for one request. ``guided`` is validated (``ValueError`` naming the field);
    ``tokenizer``: a ``ByteTokenizer`` or an ``HFTokenizer`` over a fast tokenizer (another is
    a ``ValueError`` naming ``tokenizer``). Compiled grammars are cached by spec and tokenizer
    (``cache``, default one per process)."""
    return (cache or _DEFAULT_CACHE).compile(guided, tokenizer)


# -- the per-request guide ----------------------------------------------------------------------
def _apply_words(words: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> None:
    """``words`` int32 ``[B, ceil(V / 32)]`` host bitmasks onto ``logits [B, >= V]`` in place."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.to(logits.device)[:, :, None] >> shifts) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()
    logits[:, :vocab_size].masked_fill_(~allowed, float("-inf"))
    logits[:, vocab_size:] = float("-inf")


class Guide:
    """One request's grammar state. Per sampled token: ``fill_mask(logits)``, sample,
    ``accept(token)``.

    The tokenizer's stop tokens (``stop_token_ids``: EOS, and the byte tokenizer's end of turn)
    are allowed exactly when the grammar may end. ``is_terminated()`` is true once a stop token
    was accepted, or when the grammar is complete and admits nothing but a stop token (the
    sampler may end the request there, finish reason ``stop``); after that ``fill_mask`` allows
    only stop tokens. If llguidance gives up on a step (a resource limit of a pathological
    grammar), ``error`` says why and the mask allows only stop tokens.
    """

    def __init__(self, matcher: llguidance.LLMatcher, ll_tokenizer: llguidance.LLTokenizer) -> None:
        self._matcher = matcher
        self.vocab_size = int(ll_tokenizer.vocab_size)
        self.stop_token_ids = tuple(int(t) for t in ll_tokenizer.eos_tokens)
        # the host masks, made on the first mask (the decode replica's): the ingress compiles a
        # guide only to check the request, without torch
        self._mask_words: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stopped = False  # a stop token was accepted
        self.error: str | None = None
        self.num_accepted = 0

    @property
    def _words(self) -> torch.Tensor:
        """The next token's mask buffer: int32 ``[ceil(V / 32)]``."""
        return self._masks()[0]

    @property
    def _stop_words(self) -> torch.Tensor:
        """The mask allowing only the stop tokens."""
        return self._masks()[1]

    def _masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._mask_words is None:
            import torch

            buffer = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
            stop_bits = torch.zeros(buffer.numel() * 32, dtype=torch.bool)
            stop_bits[list(self.stop_token_ids)] = True
            # the same bit layout as llguidance's: token i is bit i % 32 of word i // 32
            words = (stop_bits.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(1)
            self._mask_words = (buffer, torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
        return self._mask_words

    def _only_stop(self) -> bool:
        if self.error is None and self._matcher.is_error():
            self.error = self._matcher.get_error()
            logger.warning("guided decoding stopped: %s", self.error)
        return self._stopped or self.error is not None

    def allowed_words(self) -> torch.Tensor:
        """The host bitmask of the next token: int32 ``[ceil(V / 32)]``, bit ``i % 32`` of word
        ``i // 32`` set when token ``i`` is allowed."""
        if self._only_stop():
            self._words.copy_(self._stop_words)
        else:
            self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
            if self._matcher.is_error():  # llguidance leaves the mask empty then
                return self.allowed_words()
        return self._words

    def fill_mask(self, logits: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to ``-inf`` in place. ``logits``: 1-D float over
        the model's vocabulary, which may be larger than the tokenizer's (the extra ids are
        disallowed)."""
        import torch

        if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or not logits.is_floating_point():
            raise ValueError(f"logits: expected a 1-D float tensor, got {getattr(logits, 'shape', type(logits))}")
        if logits.numel() < self.vocab_size:
            raise ValueError(f"logits: expected at least the tokenizer's {self.vocab_size} entries, got {logits.numel()}")
        _apply_words(self.allowed_words()[None], logits[None], self.vocab_size)

    def is_allowed(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return False
        if self._only_stop():
            return token_id in self.stop_token_ids
        if token_id in self.stop_token_ids:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token_id]) == 1

    def accept(self, token_id: int) -> None:
        """Advances the grammar by ``token_id``; ``ValueError`` (naming ``token_id``, the state
        unchanged) if the grammar does not allow it here."""
        if isinstance(token_id, bool):
            raise ValueError(f"token_id: expected an int, got {token_id!r}")
        try:  # an int, numpy integer or 0-d integer tensor
            token_id = operator.index(token_id)
        except TypeError:
            raise ValueError(f"token_id: expected an int, got {short_repr(token_id)}") from None
        if not self.is_allowed(token_id):
            state = "after the end of the grammar" if self._only_stop() else "here"
            raise ValueError(f"token_id: {token_id} is not allowed by the grammar {state}")
        self.num_accepted += 1
        if token_id in self.stop_token_ids:
            self._stopped = True
            return
        if not self._matcher.consume_token(token_id):  # validated above: only a resource limit gets here
            self._only_stop()

    def is_terminated(self) -> bool:
        return self._stopped or self.error is not None or self._matcher.is_stopped()


_EXECUTOR: list[llguidance.LLExecutor] = []  # created on first use: it starts a thread pool
_EXECUTOR_LOCK = threading.Lock()


def fill_masks(guides: Sequence[Guide | None], logits: torch.Tensor) -> None:
    """``fill_mask`` for a batch: ``logits [B, V]`` in place, row ``i`` under ``guides[i]``
    (``None``: left alone). The host masks of the rows are computed in parallel by llguidance's
    ``LLExecutor`` threads, then expanded on the logits' device in one pass. The guides must
    share one tokenizer vocabulary size."""
    import torch

    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a 2-D float tensor [B, V], got {getattr(logits, 'shape', type(logits))}")
    if len(guides) != logits.shape[0]:
        raise ValueError(f"guides: expected one per row of logits ({logits.shape[0]}), got {len(guides)}")
    rows = [i for i, g in enumerate(guides) if g is not None]
    if not rows:
        return
    vocab_sizes = {guides[i].vocab_size for i in rows}
    if len(vocab_sizes) != 1:
        raise ValueError(f"guides: expected one tokenizer vocabulary size, got {sorted(vocab_sizes)}")
    vocab = vocab_sizes.pop()
    if logits.shape[1] < vocab:
        raise ValueError(f"logits: expected at least the tokenizer's {vocab} columns, got {logits.shape[1]}")
    words = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    live = []
    for k, i in enumerate(rows):
        if guides[i]._only_stop():
            words[k] = guides[i]._stop_words
        else:
            live.append((guides[i]._matcher, k))
    if live:
        with _EXECUTOR_LOCK:
            if not _EXECUTOR:
                _EXECUTOR.append(llguidance.LLExecutor())
        _EXECUTOR[0].unsafe_compute_mask_ptr(live, words.data_ptr(), words.shape[1] * 4, words.shape[0])
        for matcher, k in live:  # a matcher that failed this step: only stop tokens
            if matcher.is_error():
                guide = guides[rows[k]]
                guide._only_stop()
                words[k] = guide._stop_words
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    _apply_words(words, sub, vocab)
    logits.index_copy_(0, index, sub)
