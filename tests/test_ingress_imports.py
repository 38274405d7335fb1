"""The ingress replica never imports torch (issue #48): each Serve replica process that imports
it pays seconds of CPU, and the ingress (HTTP/gRPC parsing, the request driver, rendering)
needs none of it. A subprocess imports what the ingress's processes import (the ingress
replica, the gRPC proxy's servicer, the request routers in the ingress's handles, the
start-up health application) and runs the ingress's start-up and request parsing on the
built-in tiny model; torch appearing anywhere fails with the import chain that pulled it in.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# a meta-path finder that records, on the first import of torch, the modules whose top-level
# code was running (the chain), then lets the import go on
_PROBE = textwrap.dedent(
    """
    import importlib.abc, sys

    chain = []

    class Watch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "torch" and not chain:
                f = sys._getframe(1)
                while f is not None:
                    if f.f_code.co_name == "<module>":
                        chain.insert(0, f.f_globals.get("__name__"))
                    f = f.f_back
                chain.append(name)
            return None

    sys.meta_path.insert(0, Watch())

    def check(step):
        if chain:
            print("torch imported by " + step + ": " + " -> ".join(map(str, chain)))
            sys.exit(3)

    for module in ("router.app", "router.grpc_ingress", "router.grpc_service", "router.scheduling",
                   "router.health_app", "serving.messages"):
        __import__(module)
        check("import " + module)

    # what OpenAIIngress.__init__ does (router/app.py), then one request of each kind
    from model_executor.model_info import load_tokenizer
    from router.app import _model_type
    from router.parsing import RequestParser
    from serving.config import ServiceConfig, resolve_max_model_len
    from serving.costs import PrefillCostModel, prefix_hint
    from serving.messages import PrefillCall

    config = ServiceConfig.from_dict({"model": {"model": "builtin:tiny"}})
    tokenizer = load_tokenizer(config.model.model)
    parser = RequestParser(tokenizer, model_id=config.model_id, max_model_len=resolve_max_model_len(config),
                           default_max_tokens=config.ingress.default_max_tokens, model_type=_model_type(config),
                           strict_fields=config.ingress.strict_fields, page_size=config.kv.page_size,
                           max_sequence_tokens=config.kv.decode_pages * config.kv.page_size)
    check("the ingress's start-up")
    completion = parser.parse({"model": config.model_id, "prompt": "hello " * 40, "max_tokens": 4,
                               "temperature": 0.7, "seed": 1, "logprobs": 2}, "completion")
    chat = parser.parse({"model": config.model_id, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 3}, "chat")
    hint = prefix_hint(completion.prompt_token_ids, config.kv.page_size, PrefillCostModel.for_config(config))
    assert hint and chat.prompt_token_ids, (hint, chat)
    check("parsing a request")
    guided = parser.parse({"model": config.model_id, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
                               "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
                          "chat")
    tools = parser.parse({"model": config.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                          "tool_choice": "required"}, "chat")
    assert guided.guided and tools.guided, (guided.guided, tools.guided)
    check("parsing a structured-output or tool-call request")
    for model in ("builtin:structured-tiny", "builtin:structured-8b"):  # the benchmarks' models
        other = ServiceConfig.from_dict({"model": {"model": model}})
        assert resolve_max_model_len(other) > 0 and _model_type(other) == "llama"
    check("the ingress's start-up on a built-in structured model")
    print("no torch")
    """
)


def test_ingress_processes_import_no_torch():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip().endswith("no torch"), run.stdout


def test_probe_names_the_chain(tmp_path):
    """The probe can fail: a module that imports torch, imported at the top of the probe, is
    reported with its chain."""
    (tmp_path / "pulls_torch.py").write_text("import torch\n")
    probe = _PROBE.replace('for module in ("router.app",', 'for module in ("pulls_torch", "router.app",')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 3, run.stdout + run.stderr[-3000:]
    assert "torch imported by import pulls_torch: __main__ -> pulls_torch -> torch" in run.stdout, run.stdout
