"""Command line: ``python -m router serve | client | gen-proto``."""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    from .config import ServiceConfig
    from .launcher import LocalServeOptions, serve_forever

    options = {
        "model": args.model, "alpha": args.alpha, "device": args.device,
        "prefill_kv_pages": args.prefill_kv_pages, "decode_kv_pages": args.decode_kv_pages,
        "debug_routing": args.debug_routing,
    }
    if args.served_model_name:
        options["served_model_name"] = args.served_model_name
    config = ServiceConfig.from_dict(options)
    local = LocalServeOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                              prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                              num_cpus=args.num_cpus)
    return serve_forever(config, local)


def _gen_proto(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parent.parent
    return protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}",
                        str(root / "router" / "proto" / "flashprefill.proto")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description="FlashPrefill Serve")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a local Ray on 127.0.0.1 and deploy the service")
    s.add_argument("--model", default="builtin:tiny", help="'builtin:tiny' or a local Hugging Face directory")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument("--alpha", type=float, default=0.1, help="FlashPrefill V2 threshold (0 = dense)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=9000)
    s.add_argument("--prefill-replicas", type=int, default=1)
    s.add_argument("--decode-replicas", type=int, default=1)
    s.add_argument("--prefill-kv-pages", type=int, default=1024)
    s.add_argument("--decode-kv-pages", type=int, default=1024)
    s.add_argument("--num-cpus", type=int, default=None, help="logical CPUs for the local Ray")
    s.add_argument("--debug-routing", action="store_true", help="add replica ids to responses")
    s.set_defaults(func=_serve)

    c = sub.add_parser("client", help="send one prompt and print the reply")
    c.add_argument("prompt")
    c.add_argument("--grpc", action="store_true", help="use gRPC instead of HTTP")
    c.add_argument("--stream", action="store_true")
    c.add_argument("--chat", action="store_true", help="chat completions instead of completions")
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--model", default=None, help="default: the served model (GET /v1/models)")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--grpc-target", default="127.0.0.1:9000")
    c.add_argument("--application", default=None, help="Serve application name (gRPC metadata)")
    c.set_defaults(func=lambda a: __import__("router.client", fromlist=["run_client"]).run_client(a))

    g = sub.add_parser("gen-proto", help="regenerate router/proto stubs (needs grpcio-tools)")
    g.set_defaults(func=_gen_proto)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
