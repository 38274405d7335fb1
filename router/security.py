"""Who may call the service, and where it listens.

- Bearer-token auth (HTTP ``Authorization: Bearer <token>``, gRPC metadata ``authorization``
  with the same value). Off unless a token is configured: ``ingress.auth_token`` or the
  environment variable named by ``ingress.auth_token_env`` (default ``FLASHPREFILL_API_TOKEN``) in the
  ingress replica's environment. Compared in constant time (``hmac.compare_digest``); the
  token is never logged, never echoed, and never sent to the worker replicas.
- Loopback gRPC. Ray Serve 2.60's gRPC proxy listens on ``[::]`` (every interface) whatever
  ``http_options.host`` says. :func:`bind_grpc_to_host` is a Ray ``worker_process_setup_hook``
  that rewrites that address to ``FLASHPREFILL_GRPC_HOST`` (default ``127.0.0.1``) in the
  proxy process; the local launcher and the tests install it through ``ray.init``. A cluster
  started with ``ray start`` does not run it: firewall the gRPC port there.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

GRPC_HOST_ENV = "FLASHPREFILL_GRPC_HOST"
SETUP_HOOK = "router.security.bind_grpc_to_host"
_BEARER = "bearer "


class BearerAuth:
    """Checks ``Authorization`` values against one configured token (or allows everything
    when none is configured). ``repr`` never shows the token."""

    def __init__(self, token: str | None) -> None:
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("auth_token: expected a non-empty string or None")
        self._token = token.strip().encode() if token else None

    @classmethod
    def from_config(cls, config: Any) -> "BearerAuth":
        token = config.ingress.auth_token
        if token is None and config.ingress.auth_token_env:
            token = os.environ.get(config.ingress.auth_token_env) or None
        return cls(token)

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, authorization: str | bytes | None) -> bool:
        """True when auth is off, or ``authorization`` is ``"Bearer <the token>"``."""
        if self._token is None:
            return True
        if isinstance(authorization, bytes):
            try:
                authorization = authorization.decode("ascii")
            except UnicodeDecodeError:
                return False
        if not isinstance(authorization, str) or not authorization[: len(_BEARER)].lower() == _BEARER:
            # still compare, so a missing header and a wrong token take the same time
            hmac.compare_digest(self._token, self._token[::-1])
            return False
        given = authorization[len(_BEARER):].strip().encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self._token)

    def __repr__(self) -> str:
        return f"BearerAuth(enabled={self.enabled})"


def grpc_authorization(grpc_context: Any) -> str | None:
    """The ``authorization`` metadata value of a Serve gRPC call (None when absent)."""
    if grpc_context is None:
        return None
    for key, value in grpc_context.invocation_metadata() or ():
        if key.lower() == "authorization":
            return value
    return None


def bind_grpc_to_host() -> None:
    """Ray ``worker_process_setup_hook``: make Serve's gRPC proxy listen on
    ``$FLASHPREFILL_GRPC_HOST`` (default 127.0.0.1) instead of ``[::]``. Harmless in the
    other worker processes (it only wraps a function the proxy calls once)."""
    try:
        import ray.serve._private.default_impl as impl
    except ImportError:  # pragma: no cover - Serve absent
        return
    if getattr(impl.add_grpc_address, "_flashprefill", False):
        return
    original = impl.add_grpc_address
    host = os.environ.get(GRPC_HOST_ENV, "127.0.0.1")

    def add_grpc_address(server: Any, address: str) -> Any:
        if address.startswith("[::]:") and host not in ("", "::", "[::]", "0.0.0.0"):
            port = address.rsplit(":", 1)[1]
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return original(server, address)

    add_grpc_address._flashprefill = True  # type: ignore[attr-defined]
    impl.add_grpc_address = add_grpc_address
    _bind_replica_grpc_to_host(host)


def _bind_replica_grpc_to_host(host: str) -> None:
    """Each Serve replica also starts an inter-deployment gRPC server on ``[::]:0``. A local
    run (loopback host: every replica on this machine) keeps it on loopback too; the setup
    hook runs before the replica module is imported, which then picks up the wrapper."""
    if host not in ("127.0.0.1", "::1", "localhost"):
        return
    import sys

    import ray._common.tls_utils as tls

    if getattr(tls.add_port_to_grpc_server, "_flashprefill", False):
        return
    original = tls.add_port_to_grpc_server

    def add_port_to_grpc_server(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{'[::1]' if host == '::1' else '127.0.0.1'}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port_to_grpc_server._flashprefill = True  # type: ignore[attr-defined]
    tls.add_port_to_grpc_server = add_port_to_grpc_server
    replica = sys.modules.get("ray.serve._private.replica")
    if replica is not None:
        replica.add_port_to_grpc_server = add_port_to_grpc_server


def listening_addresses(port: int) -> list[str]:
    """Local addresses with a TCP socket in LISTEN on ``port`` (Linux ``/proc/net``)."""
    out = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, port_hex = fields[1].split(":")
            if int(port_hex, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            out.append(_decode_proc_addr(addr, v6))
    return out


def _decode_proc_addr(addr: str, v6: bool) -> str:
    import ipaddress

    raw = bytes.fromhex(addr)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    ip = ipaddress.IPv6Address(words)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)
