"""The model's real context (``model.max_model_len``), refused requests in the logs, the gRPC
client's display of nested messages and the exported tokenizer's silence: no Ray.

The service side (a prompt past SmolLM2's 8192 tokens over HTTP and gRPC, /v1/models and
/tokenize, the replica and proxy logs of a bad gRPC stream) is in tests/test_real_model_service.py.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest

from model_executor.loading import BUILTIN_TINY, TINY_MAX_POSITIONS, context_of_config, model_context
from model_executor.tokenizer import ByteTokenizer
from serving.errors import RequestError
from router.parsing import RequestParser
from serving.config import ConfigError, ServiceConfig, parse_option_value, resolve_max_model_len

SMOLLM2 = "builtin:smollm2-135m"
YARN4 = {"rope_type": "yarn", "factor": 4.0}
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smollm2_config():
    """The converted SmolLM2 directory's config.json (skipped where the GGUF file is missing)."""
    from model_executor.gguf import gguf_dir

    try:
        return json.loads((gguf_dir(SMOLLM2) / "config.json").read_text())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _model_dir(tmp_path: Path, **raw) -> Path:
    """A directory with only a config.json (all model_context reads)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **raw}))
    return tmp_path


# -- the model's context ---------------------------------------------------------------------
def test_smollm2_context_is_its_config_8192(smollm2_config):
    assert smollm2_config["max_position_embeddings"] == 8192  # what the model card says
    ctx = model_context(SMOLLM2)
    assert (ctx.tokens, ctx.trained) == (8192, True) and "max_position_embeddings" in ctx.source
    assert resolve_max_model_len(ServiceConfig()) == 8192  # the default model, the default option
    assert model_context(SMOLLM2, YARN4).tokens == 4 * 8192


def test_context_of_config_follows_the_rope_scaling():
    rng = random.Random(5)
    for _ in range(20):
        trained, original, factor = rng.randint(64, 1 << 17), rng.randint(64, 1 << 15), rng.choice([2, 4, 8, 2.5])
        assert context_of_config({"max_position_embeddings": trained}).tokens == trained
        assert context_of_config({"max_position_embeddings": trained,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}).tokens == trained
        yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        assert context_of_config({"max_position_embeddings": trained, "rope_scaling": yarn}).tokens == int(original * factor)
        # transformers 5 writes rope_parameters; YaRN without the original: the trained context stretched
        assert context_of_config({"max_position_embeddings": trained,
                                  "rope_parameters": {"rope_type": "yarn", "factor": factor}}).tokens == int(trained * factor)
        assert context_of_config({"max_position_embeddings": trained,
                                  "rope_scaling": {"type": "linear", "factor": factor}}).tokens == int(trained * factor)
        # llama3's max_position_embeddings is the stretched context already
        llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": original}
        assert context_of_config({"max_position_embeddings": trained, "rope_parameters": llama3}).tokens == trained
    for raw in ({}, {"max_position_embeddings": "8192"}, {"max_position_embeddings": 0}, {"max_position_embeddings": True}):
        assert context_of_config(raw) is None


def test_model_context_of_builtins_and_directories(tmp_path):
    assert model_context(BUILTIN_TINY).tokens == TINY_MAX_POSITIONS == 32768
    from model_executor.loading import tiny_config

    assert tiny_config().max_position_embeddings == TINY_MAX_POSITIONS
    structured = model_context("builtin:structured-8b")
    assert (structured.tokens, structured.trained) == (131072, False)
    d = _model_dir(tmp_path / "m", max_position_embeddings=4096, rope_theta=1e4)
    assert model_context(d).tokens == 4096 and model_context(d, {"rope_type": "linear", "factor": 3}).tokens == 12288
    assert model_context(tmp_path / "absent") is None
    with pytest.raises(ValueError, match="^rope_scaling: only model directories"):
        model_context(BUILTIN_TINY, YARN4)
    scaled = _model_dir(tmp_path / "s", max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="already scaled"):
        model_context(scaled, YARN4)


# -- model.max_model_len ---------------------------------------------------------------------
def test_max_model_len_defaults_to_the_model_and_may_be_lowered(tmp_path):
    d = _model_dir(tmp_path, max_position_embeddings=2048, rope_theta=1e4)
    assert resolve_max_model_len(ServiceConfig(model={"model": str(d)})) == 2048
    assert resolve_max_model_len(ServiceConfig(model={"model": str(d), "max_model_len": 1000})) == 1000
    assert resolve_max_model_len(ServiceConfig(model={"model": BUILTIN_TINY})) == 32768
    # the old path and the flat name still set it
    for given in ({"ingress": {"max_model_len": 777}}, {"ingress.max_model_len": 777}, {"max_model_len": 777}):
        cfg = ServiceConfig.from_dict({"model": BUILTIN_TINY, **given})
        assert cfg.model.max_model_len == 777 and resolve_max_model_len(cfg) == 777


def test_raising_max_model_len_needs_rope_scaling(tmp_path):
    d = str(_model_dir(tmp_path, max_position_embeddings=2048, rope_theta=1e4))
    with pytest.raises(ConfigError) as info:
        resolve_max_model_len(ServiceConfig(model={"model": d, "max_model_len": 2049}))
    msg = str(info.value)
    assert msg.startswith("model.max_model_len: 2049 exceeds the context") and "(2048 tokens" in msg
    assert "model.rope_scaling" in msg
    yarn = ServiceConfig(model={"model": d, "max_model_len": 8192, "rope_scaling": YARN4})
    assert resolve_max_model_len(yarn) == 8192
    assert resolve_max_model_len(yarn.replace({"model.max_model_len": None})) == 8192  # YaRN's 4 x 2048
    with pytest.raises(ConfigError, match=r"^model.max_model_len: 8193 exceeds .*\(8192 tokens: yarn RoPE scaling"):
        resolve_max_model_len(yarn.replace({"model.max_model_len": 8193}))
    # the structured models were constructed, not trained: a longer context is theirs to take
    assert resolve_max_model_len(ServiceConfig(model={"model": "builtin:structured-8b", "max_model_len": 131136})) == 131136
    with pytest.raises(ConfigError, match="^model.max_model_len: the context of .* cannot be read here"):
        resolve_max_model_len(ServiceConfig(model={"model": str(tmp_path / "elsewhere")}))
    assert resolve_max_model_len(ServiceConfig(model={"model": str(tmp_path / "elsewhere"), "max_model_len": 99})) == 99


def test_max_model_len_beyond_the_model_fails_at_launch(smollm2_config, capsys):
    from router.__main__ import main
    from router.app import build_application

    with pytest.raises(ValueError, match=r"^model.max_model_len: 32768 exceeds the context of builtin:smollm2-135m \(8192"):
        build_application({"max_model_len": 32768})
    with pytest.raises(SystemExit) as info:  # before Ray starts
        main(["serve", "--option", "model.max_model_len=9000"])
    assert info.value.code == 2 and "model.max_model_len: 9000 exceeds" in capsys.readouterr().err


def test_rope_scaling_option_errors():
    assert parse_option_value("model.rope_scaling", '{"rope_type": "yarn", "factor": 2}') == {"rope_type": "yarn", "factor": 2}
    assert parse_option_value("model.rope_scaling", "null") is None
    bad = [({"rope_type": "yarn"}, "model.rope_scaling: expected {'rope_type'"),
           ({"rope_type": "ntk", "factor": 2.0}, "model.rope_scaling: rope_type: expected one of"),
           ({"rope_type": "yarn", "factor": 1.0}, "model.rope_scaling: factor: expected a number > 1"),
           ("yarn", "model.rope_scaling: Input should be a valid dictionary")]
    for value, message in bad:
        with pytest.raises(ConfigError) as info:
            ServiceConfig(model={"model": SMOLLM2, "rope_scaling": value})
        assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(ConfigError, match="^model.rope_scaling: only model directories and GGUF models"):
        ServiceConfig(model={"model": BUILTIN_TINY, "rope_scaling": YARN4})


# -- the parser's limits -----------------------------------------------------------------------
def test_prompt_past_the_context_is_a_400_naming_both_numbers():
    rng = random.Random(11)
    limit = rng.randint(40, 90)
    parser = RequestParser(ByteTokenizer(), model_id="m", max_model_len=limit, default_max_tokens=16)
    ids = [rng.randrange(256) for _ in range(limit + 1)]
    for body, kind, field in (({"prompt": ids}, "completion", "prompt"),
                              ({"messages": [{"role": "user", "content": "x" * limit}]}, "chat", "messages")):
        with pytest.raises(RequestError) as info:
            parser.parse({"model": "m", **body, "max_tokens": 1}, kind)
        err = info.value
        assert (err.status, err.param) == (400, field) and f"(max_model_len) is {limit} tokens" in err.message
        assert err.message.startswith(f"{field}: the prompt has ")
        if kind == "completion":
            assert err.message.startswith(f"prompt: the prompt has {limit + 1} tokens")
    n = rng.randint(5, limit - 5)
    prompt = [rng.randrange(256) for _ in range(n)]
    with pytest.raises(RequestError) as info:
        parser.parse({"model": "m", "prompt": prompt, "max_tokens": limit - n + 1}, "completion")
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    assert f"prompt ({n} tokens) + max_tokens ({limit - n + 1}) = {limit + 1} exceeds" in info.value.message
    assert f"of {limit} tokens" in info.value.message and f"at most {limit - n}" in info.value.message
    # the whole context is allowed; without max_tokens chat runs to its end, completions take 16
    assert parser.parse({"model": "m", "prompt": prompt, "max_tokens": limit - n}, "completion").max_tokens == limit - n
    assert parser.parse({"model": "m", "prompt": prompt}, "completion").max_tokens == min(16, limit - n)
    chat = parser.parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert chat.max_tokens == limit - len(chat.prompt_token_ids)


# -- refused requests in the logs ------------------------------------------------------------------
def test_a_refused_request_is_one_line_and_serve_tracebacks_of_it_are_dropped(caplog):
    from router.request_log import QuietRequestErrors, log_request_error

    err = RequestError("prompt: the prompt has 9 tokens", param="prompt", status=400, code="invalid_value")
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        log_request_error(err, "gRPC", request_id="req-7")
        log_request_error(RequestError("no replica", status=503, code="unavailable"), "HTTP", request_id="req-8")
    first, second = caplog.records
    assert (first.levelno, first.exc_info) == (logging.INFO, None)
    # not the message: it may quote what the client sent
    assert first.getMessage() == "gRPC request req-7: 400 invalid_value, field prompt"
    assert second.levelno == logging.WARNING and second.getMessage().startswith("HTTP request req-8: 503 unavailable, field -")

    quiet = QuietRequestErrors()

    def record_of(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.getLogger("ray.serve").makeRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.",
                                                             (), sys.exc_info())

    class StatusError(Exception):  # the shape of Serve's gRPCStatusError in the proxy
        def __init__(self, original):
            super().__init__("wrapped")
            self.original_exception = original

    assert not quiet.filter(record_of(err)) and not quiet.filter(record_of(StatusError(err)))
    assert quiet.filter(record_of(RuntimeError("a bug"))) and quiet.filter(record_of(StatusError(KeyError("x"))))
    assert quiet.filter(logging.LogRecord("ray.serve", logging.INFO, __file__, 1, "plain", (), None))


def test_install_is_idempotent():
    from router.request_log import install_quiet_request_errors

    serve_logger = logging.getLogger("ray.serve")
    before = list(serve_logger.filters)
    try:
        install_quiet_request_errors()
        install_quiet_request_errors()
        assert len(serve_logger.filters) - len(before) <= 1 and any(
            type(f).__name__ == "QuietRequestErrors" for f in serve_logger.filters)
    finally:
        serve_logger.filters[:] = before


# -- the gRPC client's display ------------------------------------------------------------------------
def test_grpc_client_shows_nested_messages_as_dicts():
    from router.client import _msg_dict
    from router.proto import flashprefill_pb2 as pb

    rng = random.Random(3)
    cached, prompt = rng.randint(1, 50), rng.randint(60, 99)
    resp = pb.GenerateResponse(text="hi", token_ids=[5, 6])
    resp.usage.CopyFrom(pb.Usage(prompt_tokens=prompt, completion_tokens=2, total_tokens=prompt + 2, cached_tokens=cached,
                                 prompt_tokens_details=pb.PromptTokensDetails(cached_tokens=cached)))
    resp.choices.add(index=1, text="hi", token_ids=[5, 6], finish_reason="length")  # 0 is proto3's unset
    usage = _msg_dict(resp.usage)
    assert usage == {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2, "cached_tokens": cached,
                     "prompt_tokens_details": {"cached_tokens": cached}}
    whole = _msg_dict(resp)
    assert whole["choices"] == [{"index": 1, "text": "hi", "token_ids": [5, 6], "finish_reason": "length"}]
    assert whole["token_ids"] == [5, 6] and whole["usage"] == usage


# -- the exported tokenizer ----------------------------------------------------------------------------
_DECODE = """
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(repr(tok.decode(tok.encode("Hello , world ! How are you ?"))))
"""


def _env() -> dict:
    import os

    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "warning"}


def _decode_stderr(directory: Path) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", _DECODE, str(directory)], capture_output=True, text=True, timeout=300,
                          env=_env())
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


def test_exported_tokenizer_makes_transformers_warn_nowhere(smollm2_config, tmp_path):
    """In a fresh process each (transformers warns once per process): the converted model's own
    tokenizer_config (clean_up_tokenization_spaces true) warns; the exported one does not, and
    decodes the same."""
    from model_executor.gguf import gguf_dir
    from model_executor.loading import export_tokenizer

    source = gguf_dir(SMOLLM2)
    assert json.loads((source / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is True
    out = export_tokenizer(SMOLLM2, tmp_path / "tok")
    assert json.loads((out / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False
    src_text, src_err = _decode_stderr(source)
    out_text, out_err = _decode_stderr(out)
    assert "clean_up_tokenization_spaces" in src_err  # the check can see the warning
    assert "clean_up_tokenization_spaces" not in out_err and "warn" not in out_err.lower(), out_err
    assert out_text == src_text == repr("Hello , world ! How are you ?") + "\n"


def test_the_service_tokenizer_does_not_warn(smollm2_config):
    code = ("from model_executor.loading import load_tokenizer\n"
            "t = load_tokenizer('builtin:smollm2-135m')\nprint(repr(t.decode(t.encode('a , b !'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout == repr("a , b !") + "\n" and "clean_up_tokenization_spaces" not in done.stderr, done.stderr
