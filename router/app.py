"""The Serve application: the OpenAI-compatible HTTP ingress (FastAPI), which also serves the
gRPC methods of ``router/proto/flashprefill.proto`` (``router/grpc_ingress.py``'s mixin), and
the application builder.

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

from serving.config import ServiceConfig, resolve_max_model_len
from serving.errors import RequestError
from .accounting import Delta, StreamAccount, StreamStep
from .admission import Admission, Ticket
from .grpc_ingress import GrpcIngress
from .pipeline import DisaggregatedPipeline
from .errors import UNAUTHORIZED, as_request_error
from .generation import GenerationRequest
from .parsing import RequestParser
from .render import completion_response, models_response, openapi_extra, stream_chunk, tool_chunks, usage_chunk
from model_executor.model_info import load_tokenizer
from serving.prefill_client import PrefillClient
from .health import ReadinessProbe
from .request_log import install_quiet_request_errors, log_request_error
from .tokenize import detokenize, tokenize
from .security import BearerAuth

logger = logging.getLogger("ray.serve")

api = FastAPI(title="FlashPrefill Serve", description="OpenAI-compatible disaggregated-prefill LLM service")

# the hardened registration (bad bytes -> INVALID_ARGUMENT); the generated
# router.proto.flashprefill_pb2_grpc.add_FlashPrefillServicer_to_server works too
GRPC_SERVICER = "router.grpc_service.add_FlashPrefillServicer_to_server"


def error_response(err: RequestError) -> JSONResponse:
    log_request_error(err, "HTTP")
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


def _model_type(config: ServiceConfig) -> str | None:
    """config.json's ``model_type`` of the served model (the tool-call format of a Hugging Face
    template), without loading weights; ``None`` where it cannot be read here."""
    from model_executor.model_info import model_type

    try:
        return model_type(config.model.model)
    except (OSError, ValueError):
        return None


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_chunks(req: GenerationRequest, step: StreamStep, running_usage: dict | None = None) -> list[dict]:
    """The SSE chunks of one streamed step (at least one); the finishing one carries the
    choice's timing (and routing). ``running_usage``: vLLM's ``continuous_usage_stats``, the
    tokens so far of every choice, on each chunk."""
    delta = step.delta
    if step.events is not None:  # chat with tools: content streams, each call goes out whole once complete
        chunks = tool_chunks(req, step.events, step.finish_reason, delta.token_ids, first=delta.first,
                             logprobs=step.echoed_logprobs, index=step.index)
    else:
        chunks = [stream_chunk(req, step.text, delta.token_ids, delta.finish_reason, first=delta.first,
                               logprobs=step.echoed_logprobs, text_offset=step.text_offset, index=step.index)]
    if running_usage is not None:
        for chunk in chunks:
            chunk["usage"] = dict(running_usage)
    if delta.finish_reason is not None:
        chunks[-1]["timing"] = delta.timing
        if delta.routing is not None:
            chunks[-1]["routing"] = delta.routing
    return chunks


def fixed_pages(config: ServiceConfig, side: str) -> int | None:
    """``kv.{side}_pages`` when given, None for "auto" (each replica's memory plan decides)."""
    pages = getattr(config.kv, f"{side}_pages")
    return None if pages == "auto" else pages


def decode_tokens(config: ServiceConfig) -> int | None:
    """Tokens a decode replica's pool holds, when ``kv.decode_pages`` is given."""
    pages = fixed_pages(config, "decode")
    return None if pages is None else pages * config.kv.page_size


@serve.ingress(api)
class OpenAIIngress(GrpcIngress):
    """HTTP (OpenAI) and gRPC (:class:`~router.grpc_ingress.GrpcIngress`) front end; one
    DisaggregatedPipeline per replica."""

    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, config: dict | None = None) -> None:
        self.config = ServiceConfig.from_dict(config)
        install_quiet_request_errors()  # a refused request is one line (router/request_log.py)
        self.tokenizer = load_tokenizer(self.config.model.model)  # the ingress never loads weights
        self.parser = RequestParser(
            self.tokenizer, model_id=self.config.model_id, max_model_len=resolve_max_model_len(self.config),
            default_max_tokens=self.config.ingress.default_max_tokens, model_type=_model_type(self.config),
            strict_fields=self.config.ingress.strict_fields,
            max_sequence_tokens=decode_tokens(self.config),
            page_size=self.config.kv.page_size,
        )
        self.pipeline = DisaggregatedPipeline(prefill, decode, self.config, self.tokenizer,
                                              release_lease=PrefillClient().lease_releaser(prefill))
        self.admission = Admission(self.config.ingress.max_inflight, self.config.ingress.max_queued,
                                   retry_after_s=self.config.ingress.retry_after_s, metrics=self.pipeline.metrics)
        self.auth = BearerAuth.from_config(self.config)
        self.created = int(time.time())
        self.readiness = ReadinessProbe(prefill.app_name, {"prefill": prefill.deployment_name, "decode": decode.deployment_name},
                                        refresh_s=self.config.ingress.health_refresh_s)

    def _check_capacity(self, req: GenerationRequest) -> None:
        """Requests no replica could ever hold are bad input (400), not overload (429). With
        "auto" pools (sized by each replica's memory plan) the replicas refuse them instead:
        the prefill replica with the same 400, the decode replica before it adopts the pages."""
        ps = self.config.kv.page_size
        prefill_pages, decode_pages = fixed_pages(self.config, "prefill"), fixed_pages(self.config, "decode")
        prompt_len = max(len(p) for p in req.batch or (req.prompt_token_ids,))  # each prompt runs alone
        prompt_pages = -(-prompt_len // ps)
        if prefill_pages is not None and prompt_pages > prefill_pages:
            raise RequestError(
                f"prompt: {prompt_len} tokens need {prompt_pages} KV pages; a prefill replica holds "
                f"{prefill_pages}", param="prompt", status=400, code="prompt_too_long")
        final_pages = -(-(prompt_len + req.max_tokens) // ps)
        if decode_pages is not None and final_pages > decode_pages:
            raise RequestError(
                f"max_tokens: prompt ({prompt_len}) + max_tokens ({req.max_tokens}) need {final_pages} KV pages; "
                f"a decode replica holds {decode_pages}: lower max_tokens",
                param="max_tokens", status=400, code="invalid_value")

    async def _admit(self, req: GenerationRequest) -> Ticket:
        """Waits for the request's slots (router/admission.py: one per prompt); 429 when the
        ingress's queue is full."""
        return await self.admission.acquire(len(req.batch) if req.batch else 1)

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

    async def health_answer(self, probe: str = "ready") -> tuple[int, dict, dict]:
        """(status, JSON body, headers) of ``/health/ready`` (``probe`` "ready") or ``/health``
        ("health"); the routes below and the start-up health application (router/health_app.py,
        through a handle) both answer with it."""
        if probe not in ("ready", "health"):
            raise ValueError(f"probe: expected 'ready' or 'health', got {probe!r}")
        state = await self.readiness.check()
        if state.ready:
            return 200, state.to_dict() if probe == "ready" else {"status": "ok"}, {}
        body = state.to_dict() if probe == "ready" else {"status": "unavailable", "reason": state.reason}
        return 503, body, {"Retry-After": str(self.config.ingress.retry_after_s or 1)}

    @api.get("/health/ready")
    async def health_ready(self):
        status, body, headers = await self.health_answer("ready")
        return JSONResponse(body, status_code=status, headers=headers or None)

    @api.get("/health")
    async def health(self):
        """Readiness under the name load balancers poll by default (503 while a role is down)."""
        status, body, headers = await self.health_answer("health")
        return JSONResponse(body, status_code=status, headers=headers or None)

    @api.get("/v1/models")
    async def models(self, request: Request):
        if not self.auth.check(request.headers.get("authorization")):
            return error_response(UNAUTHORIZED)
        return models_response(self.config.model_id, self.created, self.parser.max_model_len)

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        if not self.auth.check(request.headers.get("authorization")):
            return error_response(UNAUTHORIZED)
        if model_id != self.config.model_id:
            return error_response(RequestError(f"model: {model_id!r} does not exist; this service serves "
                                               f"{self.config.model_id!r}", param="model", status=404,
                                               code="model_not_found"))
        return models_response(self.config.model_id, self.created, self.parser.max_model_len)["data"][0]

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
            ticket = await self._admit(req)
        except RequestError as err:
            return error_response(err)
        if not req.stream:
            try:
                if req.single:
                    return JSONResponse(completion_response(req, await self.pipeline.complete(req)))
                choices, generated = await self.pipeline.complete_choices(req)
            except Exception as exc:
                return error_response(as_request_error(exc))
            finally:
                ticket.release()
            return JSONResponse(completion_response(req, choices[0][2], choices=choices, completion_tokens=generated))
        deltas = self.pipeline.stream_choices(req)
        try:  # wait for the first token before committing to a 200: errors keep their status
            first = await deltas.__anext__()
        except BaseException as exc:
            ticket.release()
            await deltas.aclose()
            if not isinstance(exc, Exception):
                raise
            return error_response(as_request_error(exc))
        return StreamingResponse(self._sse_stream(req, first, deltas, ticket), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse_stream(self, req: GenerationRequest, first: tuple[int, Delta], deltas, ticket: Ticket):
        account = StreamAccount(req)
        try:
            index, delta = first
            while True:
                step = account.step(index, delta)
                chunks = sse_chunks(req, step, account.usage.running() if req.continuous_usage else None)
                for chunk in chunks:
                    yield _sse(chunk)
                if step.last:
                    break
                index, delta = await deltas.__anext__()
            if req.include_usage:
                yield _sse(usage_chunk(req, account.usage.usage()))
        except StopAsyncIteration:
            pass
        except Exception as exc:  # after a 200 went out, the error travels in-band
            yield _sse(as_request_error(exc).to_dict())
        finally:
            ticket.release()
            await deltas.aclose()
        yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------- the builder
# ingress slots beyond its own bound and queue: health probes, /v1/models, /tokenize and the
# requests being parsed or refused while the queue is full (a burst arrives faster than one
# event loop parses it) find room, rather than Serve's rejection of a replica at capacity
CONTROL_HEADROOM = 256
SERVE_INGRESS_QUEUE = 1024


def ingress_replicas_bound(options: dict) -> int:
    """The most ingress replicas ``options`` (Serve deployment options) can run: ``num_replicas``,
    or the autoscaling config's ``max_replicas``; 1 by default."""
    auto = options.get("autoscaling_config")
    if auto is not None:
        top = auto.get("max_replicas") if isinstance(auto, dict) else getattr(auto, "max_replicas", None)
        return max(int(top or 1), 1)
    n = options.get("num_replicas", 1)
    return max(int(n), 1) if isinstance(n, int) else 1


def worker_max_ongoing(config: ServiceConfig, ingress_replicas: int = 1) -> int:
    """A worker deployment's ``max_ongoing_requests`` with room for every ingress replica's
    admitted requests (``ingress.max_inflight`` slots each, a slot being one prefill call or one
    decode stream at a time) plus as many side calls (``send_pages``, ``stage_pages``,
    ``release_pages``, ``cancel_choice``): one replica alone can take all of them, so Serve's
    router never finds every replica full and never retries (router/admission.py)."""
    if ingress_replicas < 1:
        raise ValueError(f"ingress_replicas: expected >= 1, got {ingress_replicas}")
    return 2 * config.ingress.max_inflight * ingress_replicas


def ingress_max_ongoing(config: ServiceConfig) -> int:
    """The ingress deployment's ``max_ongoing_requests``: its own bound and queue (the waiting
    happens in our queue, visible in the metrics) plus :data:`CONTROL_HEADROOM`."""
    return config.ingress.max_inflight + config.ingress.max_queued + CONTROL_HEADROOM


def _default_worker_options(config: ServiceConfig, cluster_gpus: float | None = None) -> dict:
    """GPU replicas when the cluster has GPUs and the config does not pin the CPU: one GPU each
    with two or more GPUs; with exactly one, prefill and decode share it (half each), and
    ``auto`` moves their KV pages over CUDA IPC (NCCL refuses two ranks on one device)."""
    if cluster_gpus is None:
        import ray

        cluster_gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    from serving.runtime import placement_share

    return {"ray_actor_options": {"num_cpus": 1, "num_gpus": placement_share(config, cluster_gpus)}}


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
    resolve_max_model_len(config)  # a max_model_len beyond the model's context fails here, at launch
    worker_defaults = {**_default_worker_options(config),
                       "max_ongoing_requests": worker_max_ongoing(config, ingress_replicas_bound(ingress or {}))}
    prefill_opts = {**worker_defaults, **routed_by(PrefillRequestRouter), **(prefill or {})}
    decode_opts = {**worker_defaults, **routed_by(DecodeRequestRouter), **(decode or {})}
    raw = config.to_dict()
    worker_raw = config.worker_dict()  # the auth token stays with the ingress
    prefill_dep = make_prefill_deployment(config, **prefill_opts)
    decode_dep = make_decode_deployment(config, **decode_opts)
    ingress_options: dict[str, Any] = {
        "name": "OpenAIIngress",
        "max_ongoing_requests": ingress_max_ongoing(config),
        # Serve's own queue, in the proxy: requests arriving faster than the ingress's event loop
        # parses them (each then gets the ingress's own answer, a 429 with an OpenAI error object
        # past ingress.max_queued); Serve's plain-text 429 only past this
        "max_queued_requests": max(SERVE_INGRESS_QUEUE, config.ingress.max_queued),
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
