"""The gRPC servicer registration for Serve's gRPC proxy, hardened against bad bytes.

The generated ``add_FlashPrefillServicer_to_server`` parses requests with
``GenerateRequest.FromString``: bytes that are not a valid message make grpcio answer
``INTERNAL: Exception deserializing request!`` before any of our code runs. This module
registers the same methods with a tolerant parser: bytes that do not parse become a
:class:`MalformedMessage`, which the ingress answers with ``INVALID_ARGUMENT`` naming the
problem. Use ``router.grpc_service.add_FlashPrefillServicer_to_server`` in
``grpc_servicer_functions`` (``router.app.GRPC_SERVICER``).

The same call registers the standard health service, ``grpc.health.v1.Health`` (``Check``,
``Watch``), answered by the ingress: SERVING while every role has a running replica,
NOT_SERVING otherwise (``router/health.py``), for the service names ``""`` and
``flashprefill.v1.FlashPrefill``.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from router.proto import flashprefill_pb2 as pb
from router.request_log import install_quiet_request_errors

SERVICE = "flashprefill.v1.FlashPrefill"
HEALTH_SERVICE = "grpc.health.v1.Health"
HEALTH_SERVICES = ("", SERVICE)  # names a health check may ask about: the server, this service


@dataclass(frozen=True)
class MalformedMessage:
    """Stands in for a request whose bytes did not parse (picklable: it travels to the
    ingress replica like a parsed message). ``field``: the path of a string field whose bytes
    are not valid UTF-8 (``prompts[1].text``, ``messages[0].content``, ``stop[2]``), when that
    is why it did not parse."""

    size: int
    reason: str
    field: str | None = None


def bad_utf8_field(raw: bytes, descriptor=pb.GenerateRequest.DESCRIPTOR, prefix: str = "") -> str | None:
    """The path of the first string field of ``raw`` (a ``descriptor`` message on the wire)
    whose bytes are not valid UTF-8, nested messages and map entries included; None when there
    is none or the bytes are not a message at all. proto3 refuses such a string while parsing
    the whole message, without saying which: this walks the fields as unknown ones to find it."""
    from google.protobuf import empty_pb2, unknown_fields

    try:
        fields = unknown_fields.UnknownFieldSet(empty_pb2.Empty.FromString(raw))
    except Exception:
        return None
    seen: dict[int, int] = {}
    for entry in fields:
        if entry.wire_type != 2:  # length-delimited: strings, bytes, messages, packed scalars
            continue
        fd = descriptor.fields_by_number.get(entry.field_number)
        if fd is None:
            continue
        k = seen[entry.field_number] = seen.get(entry.field_number, -1) + 1
        repeated = fd.is_repeated and not (fd.message_type and fd.message_type.GetOptions().map_entry)
        path = f"{prefix}{fd.name}[{k}]" if repeated else f"{prefix}{fd.name}"
        if fd.type == fd.TYPE_STRING:
            try:
                bytes(entry.data).decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif fd.type == fd.TYPE_MESSAGE:
            if fd.message_type.GetOptions().map_entry or fd.message_type.full_name.startswith("google.protobuf."):
                inner = bad_utf8_field(entry.data, fd.message_type, path + ".")
                if inner is not None:
                    return path  # a map's key or value, a Struct's content: the field itself
            else:
                inner = bad_utf8_field(entry.data, fd.message_type, path + ".")
                if inner is not None:
                    return inner
    return None


def parse_generate_request(raw: bytes) -> pb.GenerateRequest | MalformedMessage:
    try:
        return pb.GenerateRequest.FromString(raw)
    except Exception as exc:  # DecodeError, RuntimeWarning-as-error, ...
        return MalformedMessage(len(raw), type(exc).__name__, bad_utf8_field(raw))


def parse_list_models_request(raw: bytes) -> pb.ListModelsRequest | MalformedMessage:
    try:
        return pb.ListModelsRequest.FromString(raw)
    except Exception as exc:
        return MalformedMessage(len(raw), type(exc).__name__)


def parse_health_request(raw: bytes):
    from grpc_health.v1 import health_pb2

    try:
        return health_pb2.HealthCheckRequest.FromString(raw)
    except Exception as exc:
        return MalformedMessage(len(raw), type(exc).__name__,
                                bad_utf8_field(raw, health_pb2.HealthCheckRequest.DESCRIPTOR))


def _register(server, service: str, handlers: dict) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:
        register(service, handlers)


def add_HealthServicer_to_server(servicer, server) -> None:  # noqa: N802 - gRPC's naming
    """``grpc.health.v1.Health`` with the tolerant parser (registered with the service below)."""
    from grpc_health.v1 import health_pb2

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    _register(server, HEALTH_SERVICE, {
        "Check": grpc.unary_unary_rpc_method_handler(servicer.Check, request_deserializer=parse_health_request,
                                                     response_serializer=serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(servicer.Watch, request_deserializer=parse_health_request,
                                                      response_serializer=serialize),
    })


def add_FlashPrefillServicer_to_server(servicer, server) -> None:  # noqa: N802 - gRPC's naming
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=parse_generate_request,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=parse_generate_request,
            response_serializer=pb.GenerateStreamResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=parse_list_models_request,
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
    }
    _register(server, SERVICE, handlers)
    add_HealthServicer_to_server(servicer, server)
    # this runs in Serve's gRPC proxy: a stream that ends with a RequestError's status is logged
    # by the ingress in one line, not again here with a traceback (router/request_log.py)
    install_quiet_request_errors()
