"""The gRPC methods of ``router/proto/flashprefill.proto`` (and ``grpc.health.v1.Health``) on
the Serve ingress deployment: :class:`GrpcIngress` is a mixin of ``router.app.OpenAIIngress``,
whose HTTP routes share its parser, pipeline, auth and readiness probe. Serve's gRPC proxy
calls these methods by name; ``router/grpc_service.py`` registers them (``GRPC_SERVICER``)
with a deserializer that turns bad bytes into INVALID_ARGUMENT instead of a crash.

A message is converted to HTTP's JSON body and parsed by the same ``RequestParser``
(:meth:`GrpcIngress._grpc_parse`), so both front ends validate alike; the answers render from
the same accounts (``router/accounting.py``) as HTTP's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from serving.errors import RequestError

from .accounting import StreamAccount, StreamStep
from .errors import UNAUTHORIZED, as_request_error
from .generation import GenerationRequest
from .render import SYSTEM_FINGERPRINT, models_response, split_tool_calls
from .usage import choices_usage
from .request_log import log_request_error
from .security import grpc_authorization

GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED",
              413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
              502: "UNAVAILABLE", 503: "UNAVAILABLE"}


# GenerateRequest's optional scalars that rules of their own read: logprobs (completions' k,
# chat's top_logprobs), parallel_tool_calls (with the tools); every other one is the HTTP field of
# the same name, copied when set (``_plain_fields``)
_OWN_RULES = frozenset({"logprobs", "parallel_tool_calls"})
_PLAIN: dict[str, tuple[tuple[str, bool], ...]] = {}


def _plain_fields(message: Any) -> tuple[tuple[str, bool], ...]:
    """``(name, is_float)`` of the message's optional scalar fields that pass as given, from
    its descriptor (a new one in the .proto needs no code here)."""
    desc = message.DESCRIPTOR
    got = _PLAIN.get(desc.full_name)
    if got is None:
        float_type = desc.fields[0].TYPE_FLOAT
        got = _PLAIN[desc.full_name] = tuple(
            (f.name, f.type == float_type) for f in desc.fields
            if f.has_presence and f.message_type is None and f.name not in _OWN_RULES)
    return got


def _scored(prompt_logprobs: list | None) -> list:
    """gRPC's prompt_logprobs: the echoed tokens that have a logprob (all but a first token
    the client sent, which nothing predicts)."""
    entries = list(prompt_logprobs or ())
    return entries[1:] if entries and entries[0].logprob is None else entries


def stream_message(pb: Any, req: GenerationRequest, step: StreamStep, usage: dict | None = None) -> Any:
    """One ``GenerateStreamResponse`` of a streamed choice; its finishing message carries the
    choice's timing, and ``usage`` (the request's, on the stream's last message)."""
    delta, text, calls = step.delta, step.text, None
    if step.events is not None:  # content as it comes, calls in the message they complete in
        text = "".join(value for kind, value in step.events if kind == "content")
        calls = [value for kind, value in step.events if kind == "call"]
    msg = pb.GenerateStreamResponse(request_id=req.request_id, index=step.index, text=text or "",
                                    token_ids=delta.token_ids, finish_reason=step.finish_reason or "",
                                    logprobs=_logprobs(pb, step.logprobs),
                                    prompt_logprobs=_logprobs(pb, _scored(step.prompt_logprobs)),
                                    system_fingerprint=SYSTEM_FINGERPRINT, tool_calls=_tool_calls(pb, calls))
    if delta.finish_reason is not None:
        _timing(pb, msg, delta.timing, delta.routing)
    if usage is not None:
        _usage(pb, msg, usage)
    return msg


def _usage(pb: Any, msg: Any, u: dict) -> None:
    """``usage`` as HTTP reports it (a ``protocol.UsageAccount``'s)."""
    cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    msg.usage.CopyFrom(pb.Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                                total_tokens=u["total_tokens"], cached_tokens=cached,
                                prompt_tokens_details=pb.PromptTokensDetails(cached_tokens=cached)))
    sparse = u.get("sparse_attention")
    if sparse:
        msg.usage.sparse_attention.CopyFrom(pb.SparseAttentionUsage(
            alpha=sparse["alpha"], dense=sparse["dense"], density=sparse.get("density"),
            **{k: sparse[k] for k in ("last_dense_tiles", "energy_rule", "dense_layers") if k in sparse}))


def _timing(pb: Any, msg: Any, timing: dict | None, routing: dict | None) -> None:
    fields = pb.Timing.DESCRIPTOR.fields_by_name
    msg.timing.CopyFrom(pb.Timing(**{k: float(v) for k, v in (timing or {}).items() if k in fields and v is not None}))
    if routing:
        msg.routing.CopyFrom(pb.Routing(**{k: v or "" for k, v in routing.items()}))


def _tool_calls(pb: Any, calls: list[dict] | None) -> list:
    return [pb.ToolCall(id=c["id"], type=c["type"], function=pb.FunctionCall(
        name=c["function"]["name"], arguments=c["function"]["arguments"])) for c in calls or ()]


def _logprobs(pb: Any, entries: list | None) -> list:
    return [pb.TokenLogprob(token_id=e.token_id, token=e.token, logprob=e.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=i, token=t, logprob=lp) for i, t, lp in e.top])
            for e in entries or ()]


class GrpcIngress:
    """The gRPC methods. The class that mixes it in provides ``config``, ``auth``, ``parser``,
    ``pipeline``, ``readiness``, ``created``, ``_check_capacity(req)`` and ``_admit(req)``
    (router/admission.py)."""

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
        if message.HasField("response_format"):
            body["response_format"] = self._grpc_response_format(message.response_format)
        self._grpc_tools(message, body)  # completions refuse them (as HTTP's parser refuses tools there)
        for name, is_float in _plain_fields(message):  # as HTTP's field of the same name
            if message.HasField(name):  # float32 on the wire: 0.7 arrives as 0.699999988
                body[name] = round(getattr(message, name), 6) if is_float else getattr(message, name)
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
            own = {name: getattr(sa, name) for name in ("last_dense_tiles", "energy_rule", "dense_layers")
                   if sa.HasField(name)}
            if sa.HasField("alpha"):
                own["alpha"] = round(sa.alpha, 6)
            if sa.dense and own:
                raise RequestError("sparse_attention: give dense or options, not both", param="sparse_attention",
                                   status=400, code="invalid_value")
            body["sparse_attention"] = False if sa.dense else (own or True)
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

        log_request_error(err, "gRPC")
        if grpc_context is not None:
            grpc_context.set_code(getattr(grpc.StatusCode, GRPC_CODES.get(err.status, "INTERNAL")))
            grpc_context.set_details(err.message)
            if err.retry_after_s is not None:  # the retry hint, as HTTP's Retry-After
                grpc_context.set_trailing_metadata([("retry-after", str(err.retry_after_s))])

    def _grpc_choice(self, pb: Any, req: GenerationRequest, index: int, result: Any) -> Any:
        text = (result.prompt_text or "") + result.text if req.echo else result.text
        content, calls, finish = split_tool_calls(req, text, result.finish_reason)  # chat with tools only
        return pb.Choice(index=index, text=content or "", token_ids=result.token_ids, finish_reason=finish,
                         logprobs=_logprobs(pb, result.logprobs),
                         prompt_logprobs=_logprobs(pb, _scored(result.prompt_logprobs)),
                         tool_calls=_tool_calls(pb, calls))

    async def Generate(self, request: Any, grpc_context: Any = None):
        from router.proto import flashprefill_pb2 as pb

        ticket = None
        try:
            req = self._grpc_request(request, grpc_context)
            ticket = await self._admit(req)
            if req.single:
                result = await self.pipeline.complete(req)
                choices, generated = [(0, req.prompt_token_ids, result)], len(result.token_ids)
            else:  # n, best_of, a list of prompts: the pipeline runs the choices (as for HTTP)
                choices, generated = await self.pipeline.complete_choices(req)
        except Exception as exc:
            self._grpc_fail(grpc_context, as_request_error(exc))
            return pb.GenerateResponse()
        finally:
            if ticket is not None:
                ticket.release()
        out_choices = [self._grpc_choice(pb, req, index, res) for index, _, res in choices]
        first, result = out_choices[0], choices[0][2]
        out = pb.GenerateResponse(request_id=req.request_id, model=req.model, text=first.text, token_ids=first.token_ids,
                                  finish_reason=first.finish_reason, logprobs=first.logprobs,
                                  prompt_logprobs=first.prompt_logprobs, system_fingerprint=SYSTEM_FINGERPRINT,
                                  choices=out_choices, tool_calls=first.tool_calls)
        _usage(pb, out, choices_usage(req, choices, generated))
        _timing(pb, out, result.timing, result.routing)
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
        model = models_response(self.config.model_id, self.created, self.parser.max_model_len)["data"][0]
        return pb.ListModelsResponse(models=[pb.Model(id=model["id"], created=model["created"],
                                                      owned_by=model["owned_by"], max_model_len=model["max_model_len"])])

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
            ticket = await self._admit(req)
        except RequestError as err:
            # Serve ends a stream with the status set on grpc_context only when the method raises
            self._grpc_fail(grpc_context, err)
            raise
        account = StreamAccount(req)
        deltas = self.pipeline.stream_choices(req)
        try:
            async for index, delta in deltas:
                step = account.step(index, delta)
                # the stream's last message carries the usage of every choice
                yield stream_message(pb, req, step, account.usage.usage() if step.last else None)
                if step.last:
                    break
        except Exception as exc:
            self._grpc_fail(grpc_context, as_request_error(exc))
            raise
        finally:
            ticket.release()
            await deltas.aclose()
