"""The OpenAI request and response bodies of ``/v1/completions`` and ``/v1/chat/completions``
as pydantic models: the single statement of each field's type, range and allowed values.

``router.parsing.RequestParser`` validates bodies through the request models and adds what
depends on the served model (vocabulary, context length, chat template, grammars) and the rules
between fields; the OpenAPI description (``/openapi.json``) is generated from the same models.

Tags of the unions below start with ``~``: they are not field names, and the parser leaves them
out of the dotted path it names a bad field by. The three kinds of field docs/API.md lists
("Request fields") are typed here: acted on (constrained), neutral only (:func:`neutral`: the
"off" values alone), ignored (:data:`Ignored`: any JSON value).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from annotated_types import Len
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, SkipValidation,
                      Tag, model_validator)
from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 256
MAX_SEED = (1 << 63) - 1
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_STOP_TOKEN_IDS = 64
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limits: completions' logprobs, chat's top_logprobs
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 32  # prompts in one completions request
MAX_N = 16  # n and best_of
MAX_TOOLS = 128
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = "accepted, not acted on (docs/API.md, Request fields)"


def _utf8(value: str) -> str:
    """JSON lets a client send a lone surrogate such as ``"\\ud800"``, which no tokenizer can
    encode: such a string is refused where it enters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError("invalid_unicode", "invalid Unicode: a lone surrogate (U+{cp}) at character {at}",
                                  {"cp": f"{ord(value[exc.start]):04X}", "at": exc.start}) from None
    return value


def _printable(value: str) -> str:
    if not value.isprintable():
        raise PydanticCustomError("not_printable", "expected a printable string of at most 128 characters")
    return value


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]
# a token-id list is named as a whole (``prompt``, ``stop_token_ids``), as the vocabulary check names it
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Ignored = Annotated[Any, Field(description=IGNORED)]


def _kind(value: Any) -> str | None:
    """The JSON type of ``value``: the tag a ``_by_type`` union chooses its member by."""
    if isinstance(value, bool):
        return "~bool"
    if isinstance(value, str):
        return "~text"
    if isinstance(value, dict):
        return "~object"
    if isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "~ids"
        return "~list"
    return None


def _by_type(expected: str, *, kind: Any = _kind, **members: Any) -> Any:
    """A union whose member is chosen by the input's JSON type (``kind``), so an error is the
    chosen member's alone, not one per member; an input of no member's type is ``expected``."""
    tagged = tuple(Annotated[t, Tag(f"~{k}")] for k, t in members.items())
    if "list" in members and "ids" not in members:  # a list of ints is a list too
        tagged += (Annotated[members["list"], Tag("~ids")],)
    return Annotated[Union[tagged], Discriminator(kind, custom_error_type="invalid_type",
                                                  custom_error_message=expected)]


def neutral(*values: Any, message: str | None = None) -> Any:
    """A field we do not implement, accepted at its "off" ``values`` (and null) only: equal and
    of the same JSON type (``1`` is not ``true``)."""
    def check(value: Any) -> Any:
        if value is None or any(value == v and type(value) is type(v) for v in values):
            return value
        shown = " or ".join(repr(v) for v in values[:1] + tuple(v for v in values[1:] if not isinstance(v, int)))
        raise PydanticCustomError("neutral", message or ("not supported here" + (
            f": send {shown}, null, or leave it out" if values else ": send null or leave it out")))

    scalars = tuple(v for v in values if not isinstance(v, list))
    members = ([Literal[scalars]] if scalars else []) + ([Annotated[list[Any], Len(0, 0)]] if [] in values else [])
    return Annotated[Union[tuple(members + [None])] if members else None, BeforeValidator(check)]


class _Model(BaseModel):
    # strict: JSON's types as they are (true is not 1, 1.5 is not an integer); nested models from objects
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown keys: logged, or refused with strict_fields

    include_usage: bool | None = Field(None, description="a last chunk with usage")
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: with include_usage, usage in every "
                                                "chunk (the tokens so far)")
    include_obfuscation: bool | None = Field(None, description="accepted, not acted on")


class SparseAlpha(_Model):
    """A request's own prefill sparsity (``kernels.config.REQUEST_OPTIONS``): any of them."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"minProperties": 1})

    alpha: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    last_dense_tiles: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    energy_rule: Literal["first_key", "visible"] | None = None
    dense_layers: Annotated[int, Field(ge=0, le=4096)] | None = None

    @model_validator(mode="after")
    def _some_option(self) -> "SparseAlpha":
        if not self.model_fields_set:
            raise ValueError("expected at least one of alpha, last_dense_tiles, energy_rule, dense_layers")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: Text


def _text_part(value: Any) -> str | None:
    return "~text" if isinstance(value, dict) and value.get("type") == "text" else None


ContentPart = Annotated[Union[Annotated[TextPart, Tag("~text")]],
                        Discriminator(_text_part, custom_error_type="invalid_type",
                                      custom_error_message="only {'type': 'text', 'text': str} parts are supported")]


class FunctionCall(_Model):
    name: NonEmptyText
    arguments: str = Field(description="a JSON object")


class ToolCall(_Model):
    id: NonEmptyText
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema (absent: no arguments)")
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "regex", "choice"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")
    pattern: str | None = Field(None, description="with type regex (extension)")
    choices: list[str] | None = Field(None, description="with type choice (extension)")


class ChatMessage(_Model):
    role: Literal[CHAT_ROLES]
    content: _by_type("expected a string or a list of text parts", text=Text,
                      list=list[ContentPart]) | None = Field(
        None, description="null only in an assistant message with tool_calls")
    name: Text | None = None
    # checked by model_executor.tools with the template's rendering (gRPC's path too)
    tool_calls: SkipValidation[Annotated[list[ToolCall], Field(min_length=1)]] | None = Field(
        None, description="assistant messages only")
    tool_call_id: NonEmptyText | None = Field(None, description="tool messages only (required there)")
    # what the openai client echoes back from a response message: accepted when null
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[Any], Len(0, 0)] | None = None

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if "tool_calls" in self.model_fields_set and self.role != "assistant":
            raise PydanticCustomError("extra_forbidden", "unrecognized message field (only in assistant messages)",
                                      {"field": "tool_calls"})
        if "tool_call_id" in self.model_fields_set and self.role != "tool":
            raise PydanticCustomError("extra_forbidden", "unrecognized message field (only in tool messages)",
                                      {"field": "tool_call_id"})
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("missing", "expected the id of the call this answers", {"field": "tool_call_id"})
        if self.content is None and not (self.role == "assistant" and self.tool_calls is not None):
            raise PydanticCustomError("string_type", "expected a string, got NoneType", {"field": "content"})
        return self


Number = Annotated[float, Field(allow_inf_nan=False)]
Penalty = Annotated[Number, Field(ge=-2, le=2)] | None
Flag = bool | None


class _Request(BaseModel):
    """The fields of both endpoints."""

    # unknown fields reach the parser (model_extra): logged, or refused with ingress.strict_fields
    model_config = ConfigDict(strict=True, extra="allow")

    model: NonEmptyText = Field(description="the served model id (GET /v1/models)")
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description="0 only with echo (completions)")
    temperature: Annotated[Number, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="extension (vLLM's); -1 or 0: off")
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = Field(
        None, description="extension (vLLM's): only tokens at least min_p times as likely as the top one")
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: _by_type(f"expected a string or a list of at most {MAX_STOP_STRINGS} strings",
                   text=Annotated[NonEmptyText, Field(max_length=MAX_STOP_LEN)],
                   list=Annotated[list[Annotated[NonEmptyText, Field(max_length=MAX_STOP_LEN)]],
                                  Field(max_length=MAX_STOP_STRINGS)]) | None = None
    stream: Flag = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: Annotated[Number, Field(gt=0, le=10)] | None = Field(
        None, description="extension: over the generated tokens")
    logit_bias: Annotated[dict[str, Annotated[Number, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (a decimal string) -> bias")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description="extension (vLLM's)")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="extension (vLLM's)")
    ignore_eos: Flag = Field(None, description="extension (vLLM's)")
    add_special_tokens: Flag = Field(None, description="extension (vLLM's): the tokenizer's special tokens around "
                                     "a text prompt (default: true for completions, false for chat)")
    return_tokens_as_token_ids: Flag = Field(None, description="extension (vLLM's): logprobs name tokens "
                                             "'token_id:<id>'")
    return_token_ids: Flag = Field(None, description="extension: the choices' token ids and the prompt's")
    request_id: Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_printable)] | None = None
    sparse_attention: _by_type('expected false, true or {"alpha": float in [0, 1], "last_dense_tiles": int, '
                               '"energy_rule": "first_key" | "visible", "dense_layers": int}', bool=bool,
                               object=SparseAlpha) | None = Field(
        None, description="extension: this request's prefill sparsity (false: dense; alpha: FlashPrefill V2's "
                          "threshold; last_dense_tiles, energy_rule, dense_layers: the safeguards, "
                          "docs/SEMANTICS.md)")
    # checked by model_executor.grammar, which compiles it (shared with gRPC)
    response_format: SkipValidation[ResponseFormat] | None = None
    user: str | None = Field(None, description="recorded nowhere")

    # neutral only: vLLM's sampling and output extensions we do not implement
    use_beam_search: neutral(False) = None
    include_stop_str_in_output: neutral(False) = None
    length_penalty: neutral(1.0, 1) = None
    allowed_token_ids: neutral() = None
    bad_words: neutral([]) = None
    truncate_prompt_tokens: neutral() = None
    prompt_logprobs: neutral() = None
    logits_processors: neutral() = None
    guided_json: neutral() = None
    guided_regex: neutral() = None
    guided_choice: neutral() = None
    guided_grammar: neutral() = None
    structured_outputs: neutral() = None

    # ignored: hints, bookkeeping and engine knobs that would change nothing here (OpenAI's, then vLLM's)
    metadata: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    prompt_cache_key: Ignored = None
    safety_identifier: Ignored = None
    priority: Ignored = None
    cache_salt: Ignored = None
    kv_transfer_params: Ignored = None
    vllm_xargs: Ignored = None
    skip_special_tokens: Ignored = None
    spaces_between_special_tokens: Ignored = None
    guided_decoding_backend: Ignored = None
    guided_whitespace_pattern: Ignored = None


Prompt = _by_type("expected a string or a list of token ids", text=NonEmptyText, ids=TokenIds)


def _prompt_kind(value: Any) -> str | None:
    """A list is a list of prompts only when every item is a prompt's type (a string or a list):
    ``["a", 3]`` is a malformed prompt, not a second prompt that is wrong."""
    kind = _kind(value)
    if kind == "~list" and not all(isinstance(p, (str, list)) for p in value):
        return None
    return kind


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: _by_type(f"expected a string, a list of token ids, or a list of at most {MAX_PROMPTS} of them",
                     kind=_prompt_kind, text=NonEmptyText, ids=TokenIds,
                     list=Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)])
    echo: Flag = Field(None, description="the prompt before the output; with logprobs, the prompt's logprobs, "
                                         "from the prefill (sparse attention where it is on)")
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

    suffix: neutral("") = None
    tools: neutral([]) = None
    tool_choice: neutral("none") = None
    parallel_tool_calls: neutral(False) = None
    prompt_embeds: neutral() = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Flag = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
        None, description="requires logprobs: true")
    # checked by model_executor.tools against the chat template (shared with gRPC)
    tools: SkipValidation[Annotated[list[Tool], Field(max_length=MAX_TOOLS)]] | None = Field(
        None, description="functions the model may call (400 naming tools for a model whose chat template takes none)")
    tool_choice: SkipValidation[Literal["none", "auto", "required"] | NamedToolChoice] | None = Field(
        None, description="with tools: auto (default), none, required, or a named function")
    parallel_tool_calls: Flag = None

    best_of: neutral(1) = Field(None, description="completions only")
    echo: neutral(False, message="not supported in chat (only false)") = None
    add_generation_prompt: neutral(True) = None
    continue_final_message: neutral(False) = None
    chat_template: neutral() = None
    audio: neutral() = None
    web_search_options: neutral() = None
    documents: neutral() = None

    reasoning_effort: Ignored = None  # no reasoning models
    verbosity: Ignored = None
    modalities: Ignored = None  # text only
    prediction: Ignored = None  # a latency hint
    functions: Ignored = None  # OpenAI's deprecated function calling: tools replace it
    function_call: Ignored = None
    chat_template_kwargs: Ignored = None
    mm_processor_kwargs: Ignored = None
    media_io_kwargs: Ignored = None


REQUESTS: dict[str, type[_Request]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}


def ignored_fields(kind: str) -> frozenset[str]:
    """The fields of ``kind``'s request accepted with any value and not acted on."""
    return frozenset(name for name, f in REQUESTS[kind].model_fields.items() if f.description == IGNORED)


# ----------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0, description="prompt tokens reused from the prefix cache")


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    sparse_attention: dict[str, Any] | None = Field(
        None, description="extension, when the request set sparse_attention: {alpha, dense, density}")
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


# The fields of every response object in the order the service writes them (router/render.py
# writes each object by its model): a choice has index, its output (text, message or delta),
# finish_reason, logprobs, then the extensions.
FinishReason = Literal["stop", "length", "tool_calls"] | None
_TOKEN_IDS = "with return_token_ids"


class _Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)


class CompletionChoice(_Choice):
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)
    prompt_token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)


class ResponseToolCall(_Model):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)
    prompt_token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)


class StreamToolCall(_Model):  # a streamed choice's call, whole, in the chunk where it completed
    index: int = Field(ge=0)  # the call's position in the choice (first: the order clients have seen)
    id: str
    type: Literal["function"]
    function: FunctionCall


class Delta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[StreamToolCall] | None = None


class ChatChunkChoice(_Choice):
    delta: Delta
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None
    token_ids: list[int] | None = Field(None, description=_TOKEN_IDS)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    object: str  # each response's own literal (declared here for its place: after id)
    created: int
    model: str
    system_fingerprint: str


class CompletionResponse(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage
    timing: dict[str, Any] | None = Field(None, description="extension: where the time went, per stage")
    routing: dict[str, Any] | None = Field(None, description="extension: the replicas that served it")


class ChatCompletionResponse(CompletionResponse):
    object: Literal["chat.completion"]  # type: ignore[assignment]
    choices: list[ChatChoice]  # type: ignore[assignment]


class CompletionChunk(_Response):
    """A streamed completions event (``text_completion`` objects, as OpenAI streams them)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: the last chunk's (choices "
                                "empty); with continuous_usage_stats every chunk's")


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: the last chunk's (choices "
                                "empty); with continuous_usage_stats every chunk's")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


RESPONSES: dict[str, type[BaseModel]] = {"completion": CompletionResponse, "chat": ChatCompletionResponse}
CHUNKS: dict[str, type[BaseModel]] = {"completion": CompletionChunk, "chat": ChatCompletionChunk}


# ----------------------------------------------------------------------------- JSON Schema
def _plain(node: Any, defs: dict) -> Any:
    """pydantic's JSON Schema with every ``$ref`` inlined (FastAPI's ``openapi_extra`` resolves
    none of them), tagged unions as ``anyOf`` and ``const`` as a one-value ``enum``."""
    if isinstance(node, list):
        return [_plain(v, defs) for v in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _plain(defs[node["$ref"].rsplit("/", 1)[1]], defs)
        return {**target, **{k: _plain(v, defs) for k, v in node.items() if k != "$ref"}}
    out = {}
    for key, value in node.items():
        if key in ("$defs", "discriminator", "title"):
            continue
        if key == "properties":  # field names, not schema keywords
            out[key] = {name: _plain(v, defs) for name, v in value.items()}
        elif key == "oneOf":
            out["anyOf"] = _plain(value, defs)
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = _plain(value, defs)
    return out


def json_schema(model: type[BaseModel]) -> dict:
    """``model``'s JSON Schema, self-contained (no ``$ref``)."""
    schema = model.model_json_schema()
    return _plain(schema, schema.get("$defs", {}))
