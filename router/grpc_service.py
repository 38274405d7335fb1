"""The gRPC servicer registration for Serve's gRPC proxy, hardened against bad bytes.

The generated ``add_FlashPrefillServicer_to_server`` parses requests with
``GenerateRequest.FromString``: bytes that are not a valid message make grpcio answer
``INTERNAL: Exception deserializing request!`` before any of our code runs. This module
registers the same methods with a tolerant parser: bytes that do not parse become a
:class:`MalformedMessage`, which the ingress answers with ``INVALID_ARGUMENT`` naming the
problem. Use ``router.grpc_service.add_FlashPrefillServicer_to_server`` in
``grpc_servicer_functions`` (``router.app.GRPC_SERVICER``).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from router.proto import flashprefill_pb2 as pb

SERVICE = "flashprefill.v1.FlashPrefill"


@dataclass(frozen=True)
class MalformedMessage:
    """Stands in for a request whose bytes did not parse (picklable: it travels to the
    ingress replica like a parsed message)."""

    size: int
    reason: str


def parse_generate_request(raw: bytes) -> pb.GenerateRequest | MalformedMessage:
    try:
        return pb.GenerateRequest.FromString(raw)
    except Exception as exc:  # DecodeError, RuntimeWarning-as-error, ...
        return MalformedMessage(len(raw), type(exc).__name__)


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
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    register = getattr(server, "add_registered_method_handlers", None)
    if register is not None:
        register(SERVICE, handlers)
