"""The Serve application: the OpenAI-compatible HTTP ingress (FastAPI), the gRPC methods of
``router/proto/flashprefill.proto`` on the same deployment, and the application builder.

    client --HTTP/gRPC--> OpenAIIngress --(PrefillRequestRouter)--> PrefillServer x N
                                  |                                     | KV frame (object store)
                                  +-------(DecodeRequestRouter)--> DecodeServer x M

``build_app(args)`` is the ``import_path`` target of ``serve_config.yaml`` (``args`` are
:class:`~router.config.ServiceConfig` options); :func:`build_application` is the Python API
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

from .config import ServiceConfig
from .pipeline import Delta, DisaggregatedPipeline
from .protocol import (
    GenerationRequest,
    RequestError,
    RequestParser,
    completion_response,
    models_response,
    stream_chunk,
    usage_chunk,
)
from .runtime import load_tokenizer

logger = logging.getLogger("ray.serve")

api = FastAPI(title="FlashPrefill Serve", description="OpenAI-compatible disaggregated-prefill LLM service")

GRPC_SERVICER = "router.proto.flashprefill_pb2_grpc.add_FlashPrefillServicer_to_server"

_GRPC_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 429: "RESOURCE_EXHAUSTED",
               499: "CANCELLED", 500: "INTERNAL", 502: "UNAVAILABLE", 503: "UNAVAILABLE"}


def error_response(err: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.to_dict(), status_code=err.status, headers=headers)


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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@serve.ingress(api)
class OpenAIIngress:
    """HTTP (OpenAI) and gRPC front end; one DisaggregatedPipeline per replica."""

    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, config: dict | None = None) -> None:
        self.config = ServiceConfig.from_dict(config)
        self.tokenizer = load_tokenizer(self.config)
        self.parser = RequestParser(
            self.tokenizer, model_id=self.config.model_id, max_model_len=self.config.max_model_len,
            default_max_tokens=self.config.default_max_tokens,
        )
        self.pipeline = DisaggregatedPipeline(prefill, decode, self.config, self.tokenizer)
        self.created = int(time.time())

    # -- HTTP ----------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return models_response(self.config.model_id, self.created)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http(request, "chat")

    async def _http(self, request: Request, kind: str):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(RequestError(f"body: expected JSON ({exc})", status=400, code="invalid_json"))
        try:
            req = self.parser.parse(body, kind, request_id=request.headers.get("x-request-id"))
        except RequestError as err:
            return error_response(err)
        if not req.stream:
            try:
                result = await self.pipeline.complete(req)
            except Exception as exc:
                return error_response(_as_request_error(exc))
            return JSONResponse(completion_response(req, result))
        deltas = self.pipeline.stream(req)
        try:  # wait for the first token before committing to a 200: errors keep their status
            first = await deltas.__anext__()
        except Exception as exc:
            await deltas.aclose()
            return error_response(_as_request_error(exc))
        return StreamingResponse(self._sse_stream(req, first, deltas), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse_stream(self, req: GenerationRequest, first: Delta, deltas):
        completion_tokens = 0
        try:
            delta = first
            while True:
                completion_tokens += len(delta.token_ids)
                chunk = stream_chunk(req, delta.text, delta.token_ids, delta.finish_reason, first=delta.first)
                if delta.finish_reason is not None:
                    chunk["timing"] = delta.timing
                    if delta.routing is not None:
                        chunk["routing"] = delta.routing
                yield _sse(chunk)
                if delta.finish_reason is not None:
                    break
                delta = await deltas.__anext__()
            if req.include_usage:
                yield _sse(usage_chunk(req, completion_tokens))
        except StopAsyncIteration:
            pass
        except Exception as exc:  # after a 200 went out, the error travels in-band
            yield _sse(_as_request_error(exc).to_dict())
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    # -- gRPC (router/proto/flashprefill.proto) -------------------------------------------
    def _grpc_request(self, message: Any) -> GenerationRequest:
        body: dict[str, Any] = {"model": message.model}
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if
                 (getattr(message, name) if name == "prompt" else len(getattr(message, name)))]
        if len(given) != 1:
            raise RequestError(f"prompt: expected exactly one of prompt, prompt_token_ids, messages; got {given or 'none'}",
                               param="prompt", status=400)
        kind = "chat" if given[0] == "messages" else "completion"
        if kind == "chat":
            body["messages"] = [{"role": m.role, "content": m.content} for m in message.messages]
        else:
            body["prompt"] = message.prompt if given[0] == "prompt" else list(message.prompt_token_ids)
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            if message.HasField(name):
                body[name] = getattr(message, name)
        if "temperature" in body:  # float32 on the wire: 0.7 arrives as 0.699999988
            body["temperature"] = round(body["temperature"], 6)
        if "top_p" in body:
            body["top_p"] = round(body["top_p"], 6)
        if message.stop:
            body["stop"] = list(message.stop)
        if message.request_id:
            body["request_id"] = message.request_id
        return self.parser.parse(body, kind)

    @staticmethod
    def _grpc_fail(grpc_context: Any, err: RequestError) -> None:
        import grpc

        if grpc_context is not None:
            grpc_context.set_code(getattr(grpc.StatusCode, _GRPC_CODES.get(err.status, "INTERNAL")))
            grpc_context.set_details(err.message)

    @staticmethod
    def _grpc_extras(pb: Any, msg: Any, req: GenerationRequest, timing: dict | None, routing: dict | None,
                     completion_tokens: int) -> None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=req.prompt_len, completion_tokens=completion_tokens,
                                    total_tokens=req.prompt_len + completion_tokens))
        t = {k: float(v) for k, v in (timing or {}).items() if k in ("ttft_s", "queue_s", "prefill_s", "transfer_s", "total_s") and v is not None}
        msg.timing.CopyFrom(pb.Timing(**t))
        if routing:
            msg.routing.CopyFrom(pb.Routing(**{k: v or "" for k, v in routing.items()}))

    async def Generate(self, request: Any, grpc_context: Any = None):
        from router.proto import flashprefill_pb2 as pb

        try:
            req = self._grpc_request(request)
            result = await self.pipeline.complete(req)
        except Exception as exc:
            self._grpc_fail(grpc_context, _as_request_error(exc))
            return pb.GenerateResponse()
        out = pb.GenerateResponse(request_id=req.request_id, model=req.model, text=result.text,
                                  token_ids=result.token_ids, finish_reason=result.finish_reason)
        self._grpc_extras(pb, out, req, result.timing, result.routing, len(result.token_ids))
        return out

    async def GenerateStream(self, request: Any, grpc_context: Any = None):
        from router.proto import flashprefill_pb2 as pb

        try:
            req = self._grpc_request(request)
        except RequestError as err:
            # Serve ends a stream with the status set on grpc_context only when the method raises
            self._grpc_fail(grpc_context, err)
            raise
        completion_tokens = 0
        deltas = self.pipeline.stream(req)
        try:
            async for delta in deltas:
                completion_tokens += len(delta.token_ids)
                msg = pb.GenerateStreamResponse(request_id=req.request_id, text=delta.text,
                                                token_ids=delta.token_ids, finish_reason=delta.finish_reason or "")
                if delta.finish_reason is not None:
                    self._grpc_extras(pb, msg, req, delta.timing, delta.routing, completion_tokens)
                yield msg
        except Exception as exc:
            self._grpc_fail(grpc_context, _as_request_error(exc))
            raise
        finally:
            await deltas.aclose()


# --------------------------------------------------------------------------- the builder
def _default_worker_options(config: ServiceConfig) -> dict:
    """GPU replicas when the cluster has GPUs and the config does not pin the CPU."""
    import ray

    gpus = 0.0
    if config.device != "cpu" and ray.is_initialized():
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    if config.device == "cuda":
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
    from ray.serve.config import BackpressureConfig

    from decode_worker.deployment import make_decode_deployment
    from prefill_worker.deployment import make_prefill_deployment

    config = ServiceConfig.from_dict(config)
    raw = config.to_dict()
    worker_defaults = _default_worker_options(config)
    prefill_dep = make_prefill_deployment(config, **{**worker_defaults, **(prefill or {})})
    decode_dep = make_decode_deployment(config, **{**worker_defaults, **(decode or {})})
    ingress_options: dict[str, Any] = {
        "name": "OpenAIIngress",
        "max_ongoing_requests": 256,
        "max_queued_requests": 1024,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=config.retry_after_s or 1),
        "ray_actor_options": {"num_cpus": 0.5},
        "graceful_shutdown_timeout_s": 60.0,
    }
    ingress_options.update(ingress or {})
    ingress_dep = serve.deployment(OpenAIIngress).options(**ingress_options)
    return ingress_dep.bind(prefill_dep.bind(raw), decode_dep.bind(raw), raw)


def build_app(args: dict | None = None):
    """``import_path: router.app:build_app`` in a Serve config file; ``args`` are ServiceConfig
    options (per-deployment options go in the config file's ``deployments`` section)."""
    return build_application(dict(args or {}))
