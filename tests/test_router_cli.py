"""``python -m router serve``: how the command line becomes a ServiceConfig (no Ray started)."""

from __future__ import annotations

import json

import pytest

from router.__main__ import load_config_file, main, parse_option, service_options
from serving.config import ServiceConfig


@pytest.fixture
def parsed(monkeypatch):
    """argv -> the parsed serve arguments, taken where _serve would start Ray."""
    import router.__main__ as cli

    seen = []
    monkeypatch.setattr(cli, "_serve", lambda args: seen.append(args) or 0)

    def parse(argv):
        assert main(["serve", *argv]) == 0
        return seen[-1]

    return parse


def test_defaults_are_the_service_defaults(parsed):
    assert ServiceConfig.from_dict(service_options(parsed([]))) == ServiceConfig()


def test_parse_option_values():
    assert parse_option("prefill_chunk_tokens=8192") == ("prefill_chunk_tokens", 8192)
    assert parse_option("alpha=0.25") == ("alpha", 0.25)
    assert parse_option("cuda_graphs=false") == ("cuda_graphs", False)
    assert parse_option("served_model_name=null") == ("served_model_name", None)
    assert parse_option("model=/models/llama-3.1-8b") == ("model", "/models/llama-3.1-8b")
    assert parse_option(" transport =nccl") == ("transport", "nccl")
    assert parse_option("fault_injection={\"prefill_fail_rate\": 0.5}") == (
        "fault_injection", {"prefill_fail_rate": 0.5})
    for bad in ("alpha", "=3", ""):
        with pytest.raises(ValueError, match="--option: expected KEY=VALUE"):
            parse_option(bad)


def test_file_then_flags_then_options(tmp_path, parsed):
    path = tmp_path / "svc.yaml"
    path.write_text("alpha: 0.3\nprefill_chunk_tokens: 4096\nmodel: builtin:structured-tiny\n")
    args = parsed(["--config", str(path), "--alpha", "0.2", "--option", "prefill_chunk_tokens=8192",
                  "--option", "prefix_caching=false", "--debug-routing"])
    cfg = ServiceConfig.from_dict(service_options(args))
    assert (cfg.alpha, cfg.prefill_chunk_tokens, cfg.model) == (0.2, 8192, "builtin:structured-tiny")
    assert cfg.prefix_caching is False and cfg.debug_routing is True
    assert cfg.decode_kv_pages == ServiceConfig().decode_kv_pages  # not given anywhere: the default
    js = tmp_path / "svc.json"
    js.write_text(json.dumps({"max_running": 16}))
    assert load_config_file(str(js)) == {"max_running": 16}


@pytest.mark.parametrize("argv, message", [
    (["--option", "nope=1"], "config: unknown option(s) ['nope']"),
    (["--option", "prefill_chunk_tokens=-5"], "prefill_chunk_tokens: expected an int >= 0"),
    (["--option", "alpha"], "--option: expected KEY=VALUE"),
    (["--config", "/nonexistent/svc.json"], "--config: cannot read '/nonexistent/svc.json'"),
])
def test_bad_options_exit_2_before_ray(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, text, message", [
    ("bad.json", "{not json", "is not valid JSON"),
    ("bad.yaml", "a: [1,\n", "is not valid YAML"),
    ("list.json", "[1, 2]", "must hold a mapping of options, got list"),
])
def test_bad_config_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config_file(str(path))
