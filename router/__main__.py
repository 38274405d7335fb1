"""Command line: ``python -m router serve | client | options | tokenizer | calibrate | gen-proto``."""

from __future__ import annotations

import argparse
import json
import sys


# flags that set a service option (None: not given) -> its dotted path (serving/config.py)
_FLAG_OPTIONS = {"model": "model.model", "served_model_name": "model.served_model_name", "device": "model.device",
                 "alpha": "sparse.alpha", "prefill_kv_pages": "kv.prefill_pages", "decode_kv_pages": "kv.decode_pages"}


def parse_option(pair: str) -> tuple[str, object]:
    """``PATH=VALUE`` -> (PATH, value): PATH a dotted option path (``prefill.chunk_tokens``) or a
    flat name (``prefill_chunk_tokens``), VALUE parsed by the option's type (``null``: None where
    the option allows it; a section takes a JSON object)."""
    from serving.config import parse_option_value

    key, sep, text = pair.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--option: expected PATH=VALUE, got {pair!r}")
    key = key.strip()
    return key, parse_option_value(key, text)


def load_config_file(path: str) -> dict:
    """A JSON or YAML (``.yaml``/``.yml``) file holding one mapping of service options (nested
    sections, dotted paths or flat names)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path!r}: {exc.strerror or exc}") from None
    if path.endswith((".yaml", ".yml")):
        import yaml  # a Ray dependency

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"--config: {path!r} is not valid YAML: {exc}") from None
    else:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--config: {path!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping of options, got {type(raw).__name__}")
    return raw


def service_options(args: argparse.Namespace) -> dict:
    """The nested service options from the command line: the ``--config`` file, then the flags
    given, then each ``--option PATH=VALUE`` in order (later wins); unset options keep
    ServiceConfig's defaults. Within the file an option given twice (a flat name and its dotted
    path) with different values is an error."""
    from serving.config import merge, nest

    layers = [load_config_file(args.config) if args.config else {}]
    flags = {path: getattr(args, name) for name, path in _FLAG_OPTIONS.items() if getattr(args, name) is not None}
    if args.debug_routing:
        flags["ingress.debug_routing"] = True
    layers.append(flags)
    layers += [dict([parse_option(pair)]) for pair in args.option or ()]
    options: dict = {}
    for layer in layers:
        options = merge(options, nest(layer))
    return options


def _options(args: argparse.Namespace) -> int:
    from serving.config import options_listing
    from serving.options_doc import options_markdown

    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(options_markdown())
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(options_markdown() if args.markdown else options_listing())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .launcher import LocalServeOptions, check_port_free, serve_forever

    config = args.service_config  # built and checked by main, before Ray starts
    try:  # Ray's metrics agent would fail on a taken port inside the cluster, far from the flag
        check_port_free(args.metrics_port, "--metrics-port")
    except ValueError as exc:
        print(f"python -m router serve: error: {exc}", file=sys.stderr)
        return 2
    local = LocalServeOptions(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                              prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                              num_cpus=args.num_cpus, metrics_port=args.metrics_port,
                              ray_auth=not args.no_ray_auth, access_log=args.access_log, log_level=args.log_level)
    return serve_forever(config, local)


def gen_proto(out: str | None = None) -> int:
    """Regenerates ``router/proto/flashprefill_pb2*.py`` from the ``.proto`` (grpcio-tools, the
    ``dev`` extra); ``out``: another root to write ``router/proto/`` under (the freshness test)."""
    from pathlib import Path

    import grpc_tools
    from grpc_tools import protoc

    root = Path(__file__).resolve().parent.parent
    out = out or str(root)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/struct.proto
    return protoc.main(["protoc", f"-I{root}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}",
                        str(root / "router" / "proto" / "flashprefill.proto")])


def _tokenizer(args: argparse.Namespace) -> int:
    from model_executor.loading import DEFAULT_MODEL, export_tokenizer

    model = args.model or DEFAULT_MODEL
    try:
        out = export_tokenizer(model, args.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"python -m router tokenizer: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the tokenizer of {model} to {out}")
    return 0


def _gen_proto(args: argparse.Namespace) -> int:
    return gen_proto()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:
        from model_executor.calibration.cli import main as calibrate

        return calibrate(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m router", description="FlashPrefill Serve")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a local Ray on 127.0.0.1 and deploy the service")
    s.add_argument("--model", default=None, help="'builtin:smollm2-135m' (default), 'builtin:tiny', a local .gguf file or a local Hugging Face directory")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"), help="default auto")
    s.add_argument("--alpha", type=float, default=None, help="FlashPrefill V2 threshold (0 = dense; default 0.1)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=9000)
    s.add_argument("--prefill-replicas", type=int, default=1)
    s.add_argument("--decode-replicas", type=int, default=1)
    s.add_argument("--prefill-kv-pages", type=int, default=None, help="kv.prefill_pages (default auto: the memory plan on CUDA, 1024 on a CPU)")
    s.add_argument("--decode-kv-pages", type=int, default=None, help="kv.decode_pages (default auto: the memory plan on CUDA, 1024 on a CPU)")
    s.add_argument("--num-cpus", type=int, default=None, help="logical CPUs for the local Ray")
    s.add_argument("--metrics-port", type=int, default=8080,
                   help="Prometheus metrics on http://127.0.0.1:PORT/metrics (Ray's metrics export port; 0: a free port)")
    s.add_argument("--no-ray-auth", action="store_true",
                   help="start the local Ray without its token authentication (RAY_AUTH_MODE=disabled)")
    s.add_argument("--debug-routing", action="store_true", help="add replica ids to responses")
    s.add_argument("--access-log", action="store_true",
                   help="log one line per request (Serve's proxy: method, route, status, latency); default off")
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="level of every Serve component's log (default INFO; refused requests are INFO lines)")
    s.add_argument("--config", default=None, metavar="FILE",
                   help="JSON or YAML file of service options in nested sections (docs/OPTIONS.md; the flags override it)")
    s.add_argument("--option", action="append", metavar="PATH=VALUE",
                   help="any service option by its dotted path, VALUE parsed by its type, e.g. --option "
                        "prefill.chunk_tokens=8192 (repeatable, later wins; overrides --config and the flags; "
                        "`python -m router options` lists them)")
    s.set_defaults(func=_serve)

    c = sub.add_parser("client", help="send one prompt and print the reply")
    c.add_argument("prompt")
    c.add_argument("--grpc", action="store_true", help="use gRPC instead of HTTP")
    c.add_argument("--stream", action="store_true")
    c.add_argument("--chat", action="store_true", help="chat completions instead of completions")
    c.add_argument("--max-tokens", type=int, default=32)
    c.add_argument("--n", type=int, default=None, help="choices (each printed as '[i] text' when more than one)")
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--model", default=None, help="default: the served model (GET /v1/models)")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--grpc-target", default="127.0.0.1:9000")
    c.add_argument("--application", default=None, help="Serve application name (gRPC metadata)")
    c.set_defaults(func=lambda a: __import__("router.client", fromlist=["run_client"]).run_client(a))

    o = sub.add_parser("options", help="list every service option (PATH=DEFAULT), or the docs/OPTIONS.md table")
    o.add_argument("--markdown", action="store_true", help="print the Markdown table of docs/OPTIONS.md")
    o.add_argument("--write", default=None, metavar="FILE", help="write the Markdown table to FILE (docs/OPTIONS.md)")
    o.set_defaults(func=_options)

    t = sub.add_parser("tokenizer", help="write a model's tokenizer as a Hugging Face directory (lm-eval's "
                                         "tokenizer=DIR, guidellm's --processor DIR)")
    t.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created if missing)")
    t.add_argument("--model", default=None, help="the served model: 'builtin:smollm2-135m' (default), 'builtin:tiny', "
                                                 "a local .gguf file or Hugging Face directory")
    t.set_defaults(func=_tokenizer)

    # its options live with the calibration (model_executor/calibration/cli.py): main hands it the
    # command line, so that the other commands do not import torch
    sub.add_parser("calibrate", add_help=False,
                   help="measure sparse settings against dense and write the sparsest profile meeting a quality "
                        "budget (python -m router calibrate --help)")

    g = sub.add_parser("gen-proto", help="regenerate router/proto stubs (needs grpcio-tools)")
    g.set_defaults(func=_gen_proto)

    args = parser.parse_args(argv)
    if args.command == "serve":
        from serving.config import ServiceConfig, resolve_max_model_len

        try:  # bad options fail here, before Ray starts (model.max_model_len against the model's context too)
            args.service_config = ServiceConfig.from_dict(service_options(args))
            resolve_max_model_len(args.service_config)
        except ValueError as exc:  # serving.config.ConfigError is one
            parser.error(str(exc))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
