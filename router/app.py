"""The Serve application: the OpenAI-compatible HTTP ingress (FastAPI), the gRPC methods of
``router/proto/flashprefill.proto`` on the same deployment, and the application builder.

    client --HTTP/gRPC--> OpenAIIngress --(PrefillRequestRouter)--> PrefillServer x N
                                  |                                     | KV frame (object store)
                                  +-------(DecodeRequestRouter)--> DecodeServer x M

``build_app(args)`` is the ``import_path`` target of ``serve_config.yaml`` (``args`` are
:class:`~serving.config.ServiceConfig` options); :func:`build_application` is the Python API
with per-deployment options (the launcher and the tests use it).

No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations at
import time (``request: Request`` must be the class, not a string).
"""

import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.config import ServiceConfig
from .pipeline import Delta, DisaggregatedPipeline
from .protocol import (
    SYSTEM_FINGERPRINT,
    GenerationRequest,
    RequestError,
    RequestParser,
    ToolChoiceStream,
    completion_response,
    models_response,
    openapi_extra,
    split_tool_calls,
    stream_chunk,
    tool_stream_chunks,
    usage,
    usage_chunk,
)
from serving.prefill_client import PrefillClient
from serving.runtime import load_tokenizer
from .health import ReadinessProbe
from .tokenize import detokenize, tokenize
from .security import BearerAuth, grpc_authorization

logger = logging.getLogger("ray.serve")

api = FastAPI(title="FlashPrefill Serve", description="OpenAI-compatible disaggregated-prefill LLM service")

# the hardened registration (bad bytes -> INVALID_ARGUMENT); the generated
# router.proto.flashprefill_pb2_grpc.add_FlashPrefillServicer_to_server works too
GRPC_SERVICER = "router.grpc_service.add_FlashPrefillServicer_to_server"

_GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED",
               413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
               502: "UNAVAILABLE", 503: "UNAVAILABLE"}

UNAUTHORIZED = RequestError("missing or invalid bearer token: send 'Authorization: Bearer <token>'",
                            status=401, code="invalid_api_key")


def error_response(err: RequestError) -> JSONResponse:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(err.to_dict(), status_code=err.status, headers=headers or None)


@api.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths and wrong methods answer OpenAI-style error objects too."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(RequestError(str(exc.detail), status=exc.status_code, code=code))


def _as_request_error(exc: BaseException) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, BackPressureError):
        return RequestError("service overloaded; retry later", status=429, code="overloaded", retry_after_s=1)
    if isinstance(exc, DeploymentUnavailableError):
        return RequestError("a worker deployment is unavailable", status=503, code="unavailable", retry_after_s=1)
    logger.exception("request failed")
    return RequestError(f"internal error: {type(exc).__name__}", status=500, code="internal_error")


def _model_type(config: ServiceConfig) -> str | None:
    """config.json's ``model_type`` of the served model (the tool-call format of a Hugging Face
    template), without loading weights; ``None`` where it cannot be read here."""
    from model_executor.loading import model_shape

    try:
        return getattr(model_shape(config.model.model), "model_type", None)
    except (OSError, ValueError):
        return None


def _scored(prompt_logprobs: list | None) -> list:
    """gRPC's prompt_logprobs: the echoed tokens that have a logprob (all but a first token
    the client sent, which nothing predicts)."""
    entries = list(prompt_logprobs or ())
    return entries[1:] if entries and entries[0].logprob is None else entries


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@serve.ingress(api)
class OpenAIIngress:
    """HTTP (OpenAI) and gRPC front end; one DisaggregatedPipeline per replica."""

    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, config: dict | None = None) -> None:
        self.config = ServiceConfig.from_dict(config)
        self.tokenizer = load_tokenizer(self.config)
        self.parser = RequestParser(
            self.tokenizer, model_id=self.config.model_id, max_model_len=self.config.ingress.max_model_len,
            default_max_tokens=self.config.ingress.default_max_tokens, model_type=_model_type(self.config),
            strict_fields=self.config.ingress.strict_fields,
            max_sequence_tokens=self.config.kv.decode_pages * self.config.kv.page_size,
            page_size=self.config.kv.page_size,
        )
        self.pipeline = DisaggregatedPipeline(prefill, decode, self.config, self.tokenizer,
                                              release_lease=PrefillClient().lease_releaser(prefill))
        self.auth = BearerAuth.from_config(self.config)
        self.created = int(time.time())
        self.readiness = ReadinessProbe(prefill.app_name, {"prefill": prefill.deployment_name, "decode": decode.deployment_name},
                                        refresh_s=self.config.ingress.health_refresh_s)

    def _check_capacity(self, req: GenerationRequest) -> None:
        """Requests no replica could ever hold are bad input (400), not overload (429)."""
        ps = self.config.kv.page_size
        prompt_len = max(len(p) for p in req.batch or (req.prompt_token_ids,))  # each prompt runs alone
        prompt_pages = -(-prompt_len // ps)
        if prompt_pages > self.config.kv.prefill_pages:
            raise RequestError(
                f"prompt: {prompt_len} tokens need {prompt_pages} KV pages; a prefill replica holds "
                f"{self.config.kv.prefill_pages}", param="prompt", status=400, code="prompt_too_long")
        final_pages = -(-(prompt_len + req.max_tokens) // ps)
        if final_pages > self.config.kv.decode_pages:
            raise RequestError(
                f"max_tokens: prompt ({prompt_len}) + max_tokens ({req.max_tokens}) need {final_pages} KV pages; "
                f"a decode replica holds {self.config.kv.decode_pages}: lower max_tokens",
                param="max_tokens", status=400, code="invalid_value")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.ingress.max_request_bytes
        declared = request.headers.get("content-length")
        too_large = RequestError(f"body: larger than {limit} bytes (ingress.max_request_bytes)", param="body",
                                 status=413, code="request_too_large")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError("body: bad Content-Length", param="body", status=400, code="invalid_request")
            if int(declared) > limit:
                raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():  # stop reading as soon as the limit is passed
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    # -- HTTP ----------------------------------------------------------------------------
    # liveness: this replica answers; readiness: every role has a running replica (router/health.py)
    @api.get("/health/live")
    async def health_live(self) -> dict:
        return {"status": "alive"}

    @api.get("/health/ready")
    async def health_ready(self):
        state = await self.readiness.check()
        return JSONResponse(state.to_dict(), status_code=200 if state.ready else 503,
                            headers=None if state.ready else {"Retry-After": str(self.config.ingress.retry_after_s or 1)})

    @api.get("/health")
    async def health(self):
        """Readiness under the name load balancers poll by default (503 while a role is down)."""
        state = await self.readiness.check()
        if state.ready:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable", "reason": state.reason}, status_code=503,
                            headers={"Retry-After": str(self.config.ingress.retry_after_s or 1)})

    @api.get("/v1/models")
    async def models(self, request: Request):
        if not self.auth.check(request.headers.get("authorization")):
            return error_response(UNAUTHORIZED)
        return models_response(self.config.model_id, self.created)

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        if not self.auth.check(request.headers.get("authorization")):
            return error_response(UNAUTHORIZED)
        if model_id != self.config.model_id:
            return error_response(RequestError(f"model: {model_id!r} does not exist; this service serves "
                                               f"{self.config.model_id!r}", param="model", status=404,
                                               code="model_not_found"))
        return models_response(self.config.model_id, self.created)["data"][0]

    @api.post("/v1/completions", openapi_extra=openapi_extra("completion"))
    async def completions(self, request: Request):
        return await self._http(request, "completion")

    @api.post("/v1/chat/completions", openapi_extra=openapi_extra("chat"))
    async def chat_completions(self, request: Request):
        return await self._http(request, "chat")

    @api.post("/tokenize")
    async def tokenize_route(self, request: Request):
        """vLLM's /tokenize (router/tokenize.py)."""
        return await self._json(request, lambda body: tokenize(self.parser, body))

    @api.post("/detokenize")
    async def detokenize_route(self, request: Request):
        return await self._json(request, lambda body: detokenize(self.parser, body))

    async def _json(self, request: Request, answer):
        """A JSON body in, ``answer(body)`` out; a RequestError as its status."""
        if not self.auth.check(request.headers.get("authorization")):
            return error_response(UNAUTHORIZED)
        try:
            raw = await self._read_body(request)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise RequestError(f"body: expected JSON ({type(exc).__name__})", param="body", status=400,
                                   code="invalid_json") from None
            return JSONResponse(answer(body))
        except RequestError as err:
            return error_response(err)

    async def _http(self, request: Request, kind: str):
        if not self.auth.check(request.headers.get("authorization")):
            return error_response(UNAUTHORIZED)
        try:
            raw = await self._read_body(request)
        except RequestError as err:
            return error_response(err)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            return error_response(RequestError(f"body: expected JSON ({type(exc).__name__})", param="body",
                                               status=400, code="invalid_json"))
        try:
            req = self.parser.parse(body, kind, request_id=request.headers.get("x-request-id"))
            self._check_capacity(req)
        except RequestError as err:
            return error_response(err)
        if not req.stream:
            try:
                if req.single:
                    return JSONResponse(completion_response(req, await self.pipeline.complete(req)))
                choices, generated = await self.pipeline.complete_choices(req)
            except Exception as exc:
                return error_response(_as_request_error(exc))
            return JSONResponse(completion_response(req, choices[0][2], choices=choices, completion_tokens=generated))
        deltas = self._single_choice(req) if req.single else self.pipeline.stream_choices(req)
        try:  # wait for the first token before committing to a 200: errors keep their status
            first = await deltas.__anext__()
        except Exception as exc:
            await deltas.aclose()
            return error_response(_as_request_error(exc))
        return StreamingResponse(self._sse_stream(req, first, deltas), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _single_choice(self, req: GenerationRequest):
        """The one stream of a single-choice request, as ``(0, Delta)`` (as ``stream_choices``)."""
        stream = self.pipeline.stream(req)
        try:
            async for delta in stream:
                yield 0, delta
        finally:
            await stream.aclose()

    async def _sse_stream(self, req: GenerationRequest, first: tuple[int, Delta], deltas):
        completion_tokens, cached_tokens, text_offset, sparse = 0, None, {}, None
        tool_streams: dict[int, ToolChoiceStream] = {}  # chat with tools: per choice, its call parser
        left = len(req.batch or (req.prompt_token_ids,)) * req.n  # choices still running
        try:
            index, delta = first
            while True:
                completion_tokens += len(delta.token_ids)
                if delta.timing is not None and delta.timing.get("cached_tokens") is not None:
                    cached_tokens = (cached_tokens or 0) + delta.timing["cached_tokens"]
                if delta.timing is not None:
                    sparse = delta.timing.get("sparse_attention") or sparse
                text, logprobs = delta.text, delta.logprobs
                if req.echo and delta.first:  # the prompt goes first
                    text = (delta.prompt_text or "") + text
                    if logprobs is not None:
                        logprobs = (delta.prompt_logprobs or []) + logprobs
                if req.tool_format is not None:  # content streams, each call goes out whole once complete
                    if index not in tool_streams:
                        tool_streams[index] = ToolChoiceStream(req)
                    stream = tool_streams[index]
                    chunks = tool_stream_chunks(req, stream, text, delta.token_ids, delta.finish_reason,
                                                first=delta.first, logprobs=logprobs, index=index)
                else:
                    chunks = [stream_chunk(req, text, delta.token_ids, delta.finish_reason, first=delta.first,
                                           logprobs=logprobs, text_offset=text_offset.get(index, 0), index=index)]
                    text_offset[index] = text_offset.get(index, 0) + sum(len(e.token) for e in logprobs or ())
                if req.continuous_usage:  # vLLM's continuous_usage_stats: the tokens so far, every choice's
                    for chunk in chunks:
                        chunk["usage"] = usage(req.prompt_len, completion_tokens)
                if delta.finish_reason is not None:
                    chunks[-1]["timing"] = delta.timing
                    if delta.routing is not None:
                        chunks[-1]["routing"] = delta.routing
                for chunk in chunks:
                    yield _sse(chunk)
                if delta.finish_reason is not None:
                    left -= 1
                    if not left:
                        break
                index, delta = await deltas.__anext__()
            if req.include_usage:
                yield _sse(usage_chunk(req, completion_tokens, cached_tokens, sparse))
        except StopAsyncIteration:
            pass
        except Exception as exc:  # after a 200 went out, the error travels in-band
            yield _sse(_as_request_error(exc).to_dict())
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    # -- gRPC (router/proto/flashprefill.proto) -------------------------------------------
    def _grpc_request(self, message: Any, grpc_context: Any = None, *, stream: bool = False) -> GenerationRequest:
        from router.grpc_service import MalformedMessage

        if not self.auth.check(grpc_authorization(grpc_context)):
            raise UNAUTHORIZED
        if isinstance(message, MalformedMessage):
            if message.field is not None:  # proto3 refuses a string that is not UTF-8 (a lone surrogate)
                raise RequestError(f"{message.field}: invalid UTF-8 (a lone surrogate or a broken byte sequence)",
                                   param=message.field, status=400, code="invalid_value")
            raise RequestError(f"request: {message.size} bytes are not a flashprefill.v1.GenerateRequest ({message.reason})",
                               param="request", status=400, code="invalid_message")
        size = message.ByteSize()
        if size > self.config.ingress.max_request_bytes:
            raise RequestError(f"request: {size} bytes, larger than ingress.max_request_bytes {self.config.ingress.max_request_bytes}",
                               param="request", status=413, code="request_too_large")
        req = self._grpc_parse(message, stream=stream)
        try:
            self._check_capacity(req)
        except RequestError as err:
            raise self._grpc_field_error(message, err) from None
        return req

    @staticmethod
    def _grpc_prompt_field(message: Any, i: int) -> str:
        return f"prompts[{i}].{'text' if message.prompts[i].text else 'token_ids'}"

    def _grpc_field_error(self, message: Any, err: RequestError) -> RequestError:
        """The parser names HTTP's fields; a few have other names in the proto."""
        param = err.param or ""
        rename = None
        if param == "prompt" and message.prompt_token_ids:
            rename = "prompt_token_ids"
        elif param.startswith("prompt") and len(message.prompts):  # prompt, prompt[i]
            if param == "prompt":
                rename = self._grpc_prompt_field(message, 0) if len(message.prompts) == 1 else "prompts"
            elif param.startswith("prompt[") and param.endswith("]") and param[7:-1].isdigit():
                rename = self._grpc_prompt_field(message, int(param[7:-1]))
        elif param == "top_logprobs":  # the proto has one field for both
            rename = "logprobs"
        elif param.startswith("response_format.json_schema.schema") and \
                message.response_format.json_schema.WhichOneof("schema_source") == "schema_json":
            rename = "response_format.json_schema.schema_json" + param[len("response_format.json_schema.schema"):]
        elif param == "tool_choice" and message.tool_choice.WhichOneof("choice") == "mode":
            rename = "tool_choice.mode"
        elif param.startswith("tools[") and ".function.parameters" in param:
            i = param[6:param.index("]")]
            head = f"tools[{i}].function.parameters"
            if i.isdigit() and int(i) < len(message.tools) and param.startswith(head) and \
                    message.tools[int(i)].function.WhichOneof("parameters_source") == "parameters_json":
                rename = head + "_json" + param[len(head):]
        if rename is None or not err.message.startswith(param):
            return err
        return RequestError(rename + err.message[len(param):], param=rename, status=err.status, code=err.code)

    @staticmethod
    def _grpc_schema(message: Any, source: str, at: str) -> Any:
        """A JSON Schema sent as JSON text (``<at>_json``, or ``schema_json`` under
        ``response_format``) or as a ``google.protobuf.Struct`` (``at``), as HTTP's object."""
        from google.protobuf import json_format

        def integral(value: Any) -> Any:  # Struct numbers are doubles: 3.0 -> 3 (maxLength, minItems, ...)
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
                return int(value)
            if isinstance(value, dict):
                return {k: integral(v) for k, v in value.items()}
            if isinstance(value, list):
                return [integral(v) for v in value]
            return value

        if source.endswith("_json"):
            try:
                return json.loads(getattr(message, source))
            except (ValueError, RecursionError) as exc:
                param = f"{at.rpartition('.')[0]}.{source}"
                raise RequestError(f"{param}: expected JSON text ({exc})"[:300], param=param, status=400,
                                   code="invalid_value") from None
        return integral(json_format.MessageToDict(getattr(message, source)))

    @classmethod
    def _grpc_response_format(cls, rf: Any) -> dict:
        """A ``ResponseFormat`` message as HTTP's ``response_format`` object (only the fields
        set: the parser then refuses a field the type does not take, as over HTTP)."""
        out: dict[str, Any] = {"type": rf.type}
        if rf.HasField("json_schema"):
            js = rf.json_schema
            body: dict[str, Any] = {"name": js.name}
            if js.HasField("description"):
                body["description"] = js.description
            source = js.WhichOneof("schema_source")
            if source is not None:
                body["schema"] = cls._grpc_schema(js, source, "response_format.json_schema.schema")
            if js.HasField("strict"):
                body["strict"] = js.strict
            out["json_schema"] = body
        if rf.HasField("pattern"):
            out["pattern"] = rf.pattern
        if rf.choices:
            out["choices"] = list(rf.choices)
        return out

    @staticmethod
    def _grpc_message(m: Any) -> dict:
        """A ``ChatMessage`` as HTTP's message object (the fields set only: the parser refuses
        ``tool_calls`` outside an assistant message, ``tool_call_id`` outside a tool message)."""
        out: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.HasField("name"):
            out["name"] = m.name
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type or "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        return out

    @classmethod
    def _grpc_tools(cls, message: Any, body: dict) -> None:
        """``tools``, ``tool_choice``, ``parallel_tool_calls`` into HTTP's body (the parser checks them)."""
        if message.tools:
            tools = []
            for i, tool in enumerate(message.tools):
                fn = tool.function
                function: dict[str, Any] = {"name": fn.name}
                if fn.HasField("description"):
                    function["description"] = fn.description
                source = fn.WhichOneof("parameters_source")
                if source is not None:
                    function["parameters"] = cls._grpc_schema(fn, source, f"tools[{i}].function.parameters")
                if fn.HasField("strict"):
                    function["strict"] = fn.strict
                tools.append({"type": tool.type or "function", "function": function})
            body["tools"] = tools
        if message.HasField("tool_choice"):
            which = message.tool_choice.WhichOneof("choice")
            if which is None:
                raise RequestError("tool_choice: expected mode or function", param="tool_choice", status=400,
                                   code="invalid_value")
            body["tool_choice"] = message.tool_choice.mode if which == "mode" else {
                "type": "function", "function": {"name": message.tool_choice.function.name}}
        if message.HasField("parallel_tool_calls"):
            body["parallel_tool_calls"] = message.parallel_tool_calls

    def _grpc_parse(self, message: Any, *, stream: bool = False) -> GenerationRequest:
        body: dict[str, Any] = {"model": message.model}
        given = [name for name in ("prompt", "prompt_token_ids", "prompts", "messages") if
                 (getattr(message, name) if name == "prompt" else len(getattr(message, name)))]
        if len(given) != 1:
            raise RequestError(f"prompt: expected exactly one of prompt, prompt_token_ids, prompts, messages; got {given or 'none'}",
                               param="prompt", status=400)
        kind = "chat" if given[0] == "messages" else "completion"
        if kind == "chat":
            body["messages"] = [self._grpc_message(m) for m in message.messages]
        elif given[0] == "prompts":
            prompts = []
            for i, p in enumerate(message.prompts):
                if bool(p.text) == bool(p.token_ids):
                    raise RequestError(f"prompts[{i}]: expected exactly one of text, token_ids", param=f"prompts[{i}]",
                                       status=400, code="invalid_value")
                prompts.append(p.text or list(p.token_ids))
            body["prompt"] = prompts
        else:
            body["prompt"] = message.prompt if given[0] == "prompt" else list(message.prompt_token_ids)
        if stream:  # the parser refuses what cannot be streamed (best_of > n)
            body["stream"] = True
        for name in ("n", "best_of"):
            if message.HasField(name):
                body[name] = getattr(message, name)
        if message.HasField("response_format"):
            body["response_format"] = self._grpc_response_format(message.response_format)
        self._grpc_tools(message, body)  # completions refuse them (as HTTP's parser refuses tools there)
        floats = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in ("max_tokens", "top_k", "seed", "min_tokens", *floats):
            if message.HasField(name):
                body[name] = getattr(message, name)
        for name in floats:  # float32 on the wire: 0.7 arrives as 0.699999988
            if name in body:
                body[name] = round(body[name], 6)
        if message.stop:
            body["stop"] = list(message.stop)
        if message.logit_bias:
            body["logit_bias"] = {str(k): round(v, 6) for k, v in message.logit_bias.items()}
        if message.stop_token_ids:
            body["stop_token_ids"] = list(message.stop_token_ids)
        if message.ignore_eos:
            body["ignore_eos"] = True
        if message.echo:
            body["echo"] = True
        if message.HasField("sparse_attention"):
            sa = message.sparse_attention
            if sa.dense and sa.HasField("alpha"):
                raise RequestError("sparse_attention: give dense or alpha, not both", param="sparse_attention",
                                   status=400, code="invalid_value")
            body["sparse_attention"] = False if sa.dense else (
                {"alpha": round(sa.alpha, 6)} if sa.HasField("alpha") else True)
        if message.HasField("min_p"):
            body["min_p"] = round(message.min_p, 6)
        if message.HasField("add_special_tokens"):
            body["add_special_tokens"] = message.add_special_tokens
        if message.HasField("logprobs"):  # completions' int k; chat's logprobs + top_logprobs
            if kind == "completion":
                body["logprobs"] = message.logprobs
            else:
                body["logprobs"], body["top_logprobs"] = True, message.logprobs
        if message.request_id:
            body["request_id"] = message.request_id
        try:
            return self.parser.parse(body, kind)
        except RequestError as err:
            raise self._grpc_field_error(message, err) from None

    @staticmethod
    def _grpc_fail(grpc_context: Any, err: RequestError) -> None:
        import grpc

        if grpc_context is not None:
            grpc_context.set_code(getattr(grpc.StatusCode, _GRPC_CODES.get(err.status, "INTERNAL")))
            grpc_context.set_details(err.message)
            if err.retry_after_s is not None:  # the retry hint, as HTTP's Retry-After
                grpc_context.set_trailing_metadata([("retry-after", str(err.retry_after_s))])

    @staticmethod
    def _grpc_usage(pb: Any, msg: Any, req: GenerationRequest, completion_tokens: int, cached_tokens: int | None,
                    sparse: dict | None) -> None:
        """``usage`` as HTTP reports it: every prompt once, every choice's tokens."""
        u = usage(req.prompt_len, completion_tokens, cached_tokens)
        cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                                    total_tokens=u["total_tokens"], cached_tokens=cached,
                                    prompt_tokens_details=pb.PromptTokensDetails(cached_tokens=cached)))
        if sparse and req.sparse_alpha is not None:
            msg.usage.sparse_attention.CopyFrom(pb.SparseAttentionUsage(alpha=sparse["alpha"], dense=sparse["dense"],
                                                                        density=sparse.get("density")))

    @staticmethod
    def _grpc_timing(pb: Any, msg: Any, timing: dict | None, routing: dict | None) -> None:
        fields = pb.Timing.DESCRIPTOR.fields_by_name
        msg.timing.CopyFrom(pb.Timing(**{k: float(v) for k, v in (timing or {}).items() if k in fields and v is not None}))
        if routing:
            msg.routing.CopyFrom(pb.Routing(**{k: v or "" for k, v in routing.items()}))

    def _grpc_choice(self, pb: Any, req: GenerationRequest, index: int, result: Any) -> Any:
        text = (result.prompt_text or "") + result.text if req.echo else result.text
        content, calls, finish = split_tool_calls(req, text, result.finish_reason)  # chat with tools only
        return pb.Choice(index=index, text=content or "", token_ids=result.token_ids, finish_reason=finish,
                         logprobs=self._grpc_logprobs(pb, result.logprobs),
                         prompt_logprobs=self._grpc_logprobs(pb, _scored(result.prompt_logprobs)),
                         tool_calls=self._grpc_tool_calls(pb, calls))

    @staticmethod
    def _grpc_tool_calls(pb: Any, calls: list[dict] | None) -> list:
        return [pb.ToolCall(id=c["id"], type=c["type"], function=pb.FunctionCall(
            name=c["function"]["name"], arguments=c["function"]["arguments"])) for c in calls or ()]

    @staticmethod
    def _grpc_logprobs(pb: Any, entries: list | None) -> list:
        return [pb.TokenLogprob(token_id=e.token_id, token=e.token, logprob=e.logprob,
                                top_logprobs=[pb.TopLogprob(token_id=i, token=t, logprob=lp) for i, t, lp in e.top])
                for e in entries or ()]

    async def Generate(self, request: Any, grpc_context: Any = None):
        from router.proto import flashprefill_pb2 as pb

        try:
            req = self._grpc_request(request, grpc_context)
            if req.single:
                result = await self.pipeline.complete(req)
                choices, generated = [(0, req.prompt_token_ids, result)], len(result.token_ids)
            else:  # n, best_of, a list of prompts: the pipeline runs the choices (as for HTTP)
                choices, generated = await self.pipeline.complete_choices(req)
        except Exception as exc:
            self._grpc_fail(grpc_context, _as_request_error(exc))
            return pb.GenerateResponse()
        out_choices = [self._grpc_choice(pb, req, index, res) for index, _, res in choices]
        first, result = out_choices[0], choices[0][2]
        out = pb.GenerateResponse(request_id=req.request_id, model=req.model, text=first.text, token_ids=first.token_ids,
                                  finish_reason=first.finish_reason, logprobs=first.logprobs,
                                  prompt_logprobs=first.prompt_logprobs, system_fingerprint=SYSTEM_FINGERPRINT,
                                  choices=out_choices, tool_calls=first.tool_calls)
        cached = [(res.timing or {}).get("cached_tokens") for _, _, res in choices]
        self._grpc_usage(pb, out, req, generated, None if None in cached else sum(cached),
                         (result.timing or {}).get("sparse_attention"))
        self._grpc_timing(pb, out, result.timing, result.routing)
        return out

    async def ListModels(self, request: Any, grpc_context: Any = None):
        from router.grpc_service import MalformedMessage
        from router.proto import flashprefill_pb2 as pb

        if not self.auth.check(grpc_authorization(grpc_context)):
            self._grpc_fail(grpc_context, UNAUTHORIZED)
            return pb.ListModelsResponse()
        if isinstance(request, MalformedMessage):
            self._grpc_fail(grpc_context, RequestError(
                f"request: {request.size} bytes are not a flashprefill.v1.ListModelsRequest ({request.reason})",
                param="request", status=400, code="invalid_message"))
            return pb.ListModelsResponse()
        model = models_response(self.config.model_id, self.created)["data"][0]
        return pb.ListModelsResponse(models=[pb.Model(id=model["id"], created=model["created"],
                                                      owned_by=model["owned_by"])])

    # -- gRPC health (grpc.health.v1.Health, registered by router/grpc_service.py) --------------
    async def _grpc_health(self, request: Any) -> Any:
        """The serving status for ``request.service``; None for a service we do not know."""
        from grpc_health.v1 import health_pb2

        from router.grpc_service import HEALTH_SERVICES

        if getattr(request, "service", None) not in HEALTH_SERVICES:
            return None
        state = await self.readiness.check()
        return health_pb2.HealthCheckResponse.SERVING if state.ready else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request: Any, grpc_context: Any = None):
        from grpc_health.v1 import health_pb2

        from router.grpc_service import MalformedMessage

        if isinstance(request, MalformedMessage):
            self._grpc_fail(grpc_context, RequestError(
                f"{request.field}: invalid UTF-8 (a lone surrogate or a broken byte sequence)" if request.field else
                f"request: {request.size} bytes are not a grpc.health.v1.HealthCheckRequest ({request.reason})",
                param=request.field or "request", status=400, code="invalid_message"))
            return health_pb2.HealthCheckResponse()
        status = await self._grpc_health(request)
        if status is None:
            self._grpc_fail(grpc_context, RequestError(f"service: unknown health service {getattr(request, 'service', None)!r}",
                                                       param="service", status=404))
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, grpc_context: Any = None):
        """The current status, then each change (polled every ``ingress.health_refresh_s``)."""
        import asyncio

        from grpc_health.v1 import health_pb2

        last = None
        while True:
            status = await self._grpc_health(request)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(max(self.config.ingress.health_refresh_s, 0.1))

    async def GenerateStream(self, request: Any, grpc_context: Any = None):
        from router.proto import flashprefill_pb2 as pb

        try:
            req = self._grpc_request(request, grpc_context, stream=True)
        except RequestError as err:
            # Serve ends a stream with the status set on grpc_context only when the method raises
            self._grpc_fail(grpc_context, err)
            raise
        completion_tokens = 0
        cached: dict[int, int] = {}  # per choice, from whichever message carried timing; summed as HTTP
        sparse = None
        left = len(req.batch or (req.prompt_token_ids,)) * req.n  # choices still running
        tool_streams: dict[int, ToolChoiceStream] = {}  # chat with tools: per choice, its call parser
        deltas = self._single_choice(req) if req.single else self.pipeline.stream_choices(req)
        try:
            async for index, delta in deltas:
                completion_tokens += len(delta.token_ids)
                if delta.timing is not None and delta.timing.get("cached_tokens") is not None:
                    cached[index] = delta.timing["cached_tokens"]
                if delta.timing is not None:
                    sparse = delta.timing.get("sparse_attention") or sparse
                echo = req.echo and delta.first
                text, token_ids, logprobs = (delta.prompt_text or "") + delta.text if echo else delta.text, \
                    delta.token_ids, delta.logprobs
                finish, calls = delta.finish_reason, None
                if req.tool_format is not None:  # content as it comes, calls in the message they complete in
                    if index not in tool_streams:
                        tool_streams[index] = ToolChoiceStream(req)
                    stream = tool_streams[index]
                    events, finish = stream.push(text, finish)
                    text = "".join(value for kind, value in events if kind == "content")
                    calls = [value for kind, value in events if kind == "call"]
                msg = pb.GenerateStreamResponse(request_id=req.request_id, index=index, text=text or "",
                                                token_ids=token_ids, finish_reason=finish or "",
                                                logprobs=self._grpc_logprobs(pb, logprobs),
                                                prompt_logprobs=self._grpc_logprobs(
                                                    pb, _scored(delta.prompt_logprobs) if echo else []),
                                                system_fingerprint=SYSTEM_FINGERPRINT,
                                                tool_calls=self._grpc_tool_calls(pb, calls))
                if delta.finish_reason is not None:
                    self._grpc_timing(pb, msg, delta.timing, delta.routing)
                    left -= 1
                    if not left:  # the stream's last message: usage of every choice
                        self._grpc_usage(pb, msg, req, completion_tokens, sum(cached.values()) if cached else None,
                                         sparse)
                yield msg
                if not left:
                    break
        except Exception as exc:
            self._grpc_fail(grpc_context, _as_request_error(exc))
            raise
        finally:
            await deltas.aclose()


# --------------------------------------------------------------------------- the builder
def _default_worker_options(config: ServiceConfig, cluster_gpus: float | None = None) -> dict:
    """GPU replicas when the cluster has GPUs and the config does not pin the CPU: one GPU each
    with two or more GPUs; with exactly one, prefill and decode share it (half each), and
    ``auto`` moves their KV pages over CUDA IPC (NCCL refuses two ranks on one device)."""
    if cluster_gpus is None:
        import ray

        cluster_gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    gpus = 0.0
    if config.model.device != "cpu":
        gpus = 1.0 if cluster_gpus >= 2 else 0.5 if cluster_gpus >= 1 else 0.0
    if config.model.device == "cuda" and gpus == 0.0:
        gpus = 1.0
    return {"ray_actor_options": {"num_cpus": 1, "num_gpus": gpus}}


def build_application(
    config: ServiceConfig | dict | None = None,
    *,
    prefill: dict | None = None,
    decode: dict | None = None,
    ingress: dict | None = None,
):
    """The bound application. ``prefill``/``decode``/``ingress``: Serve deployment options
    (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``, ...) over the defaults."""
    from ray.serve.config import BackpressureConfig, RequestRouterConfig

    from decode_worker.deployment import make_decode_deployment
    from prefill_worker.deployment import make_prefill_deployment

    from .scheduling import DecodeRequestRouter, PrefillRequestRouter

    def routed_by(router_class: type) -> dict:
        return {"request_router_config": RequestRouterConfig(
            request_router_class=router_class, request_routing_stats_period_s=0.5,
            request_routing_stats_timeout_s=5.0)}

    config = ServiceConfig.from_dict(config)
    worker_defaults = _default_worker_options(config)
    prefill_opts = {**worker_defaults, **routed_by(PrefillRequestRouter), **(prefill or {})}
    decode_opts = {**worker_defaults, **routed_by(DecodeRequestRouter), **(decode or {})}
    raw = config.to_dict()
    worker_raw = config.worker_dict()  # the auth token stays with the ingress
    prefill_dep = make_prefill_deployment(config, **prefill_opts)
    decode_dep = make_decode_deployment(config, **decode_opts)
    ingress_options: dict[str, Any] = {
        "name": "OpenAIIngress",
        "max_ongoing_requests": 256,
        "max_queued_requests": 1024,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=config.ingress.retry_after_s or 1),
        "ray_actor_options": {"num_cpus": 0.5},
        "graceful_shutdown_timeout_s": 60.0,
    }
    ingress_options.update(ingress or {})
    ingress_dep = serve.deployment(OpenAIIngress).options(**ingress_options)
    return ingress_dep.bind(prefill_dep.bind(worker_raw), decode_dep.bind(worker_raw), raw)


def build_app(args: dict | None = None):
    """``import_path: router.app:build_app`` in a Serve config file; ``args`` are ServiceConfig
    options (per-deployment options go in the config file's ``deployments`` section)."""
    return build_application(dict(args or {}))
