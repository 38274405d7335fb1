"""``python -m router serve | options``: how the command line becomes a ServiceConfig (no Ray
started), and the generated option table (docs/OPTIONS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.__main__ import load_config_file, main, parse_option, service_options
from serving.config import OPTION_ALIASES, OPTIONS, ServiceConfig
from serving.options_doc import options_markdown

REPO = Path(__file__).resolve().parent.parent


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
    args = parsed([])
    assert ServiceConfig.from_dict(service_options(args)) == ServiceConfig() == args.service_config


def test_parse_option_values_by_the_option_type():
    assert parse_option("prefill.chunk_tokens=8192") == ("prefill.chunk_tokens", 8192)
    assert parse_option("prefill_chunk_tokens=8192") == ("prefill_chunk_tokens", 8192)  # a flat name
    assert parse_option("prefill.chunk_tokens=null") == ("prefill.chunk_tokens", None)
    assert parse_option("sparse.alpha=0.25") == ("sparse.alpha", 0.25)
    assert parse_option("sparse.alpha=1") == ("sparse.alpha", 1.0) and isinstance(parse_option("sparse.alpha=1")[1], float)
    assert parse_option("decode.cuda_graphs=false") == ("decode.cuda_graphs", False)
    assert parse_option("model.served_model_name=null") == ("model.served_model_name", None)
    assert parse_option("model.served_model_name=123") == ("model.served_model_name", "123")  # a str option: the text
    assert parse_option("model=/models/llama-3.1-8b") == ("model", "/models/llama-3.1-8b")
    assert parse_option(" transfer.transport =nccl") == ("transfer.transport", "nccl")
    assert parse_option("transfer.channel.chunk_bytes=1048576") == ("transfer.channel.chunk_bytes", 1 << 20)
    assert parse_option('fault_injection={"mode": "break"}') == ("fault_injection", {"mode": "break"})
    for bad in ("sparse.alpha", "=3", ""):
        with pytest.raises(ValueError, match="--option: expected PATH=VALUE"):
            parse_option(bad)
    with pytest.raises(ValueError, match=r"^prefill.chunk_tokens: cannot read 'many' as int \| null"):
        parse_option("prefill_chunk_tokens=many")
    with pytest.raises(ValueError, match=r"^decode.cuda_graphs: cannot read 'maybe' as bool"):
        parse_option("decode.cuda_graphs=maybe")
    with pytest.raises(ValueError, match=r"^fault_injection: cannot read"):
        parse_option("fault_injection={mode")
    with pytest.raises(ValueError, match=r"^prefill.chunk_tokns: unknown option; did you mean 'chunk_tokens'"):
        parse_option("prefill.chunk_tokns=3")


def test_file_then_flags_then_options(tmp_path, parsed):
    path = tmp_path / "svc.yaml"
    path.write_text("sparse:\n  alpha: 0.3\nprefill:\n  chunk_tokens: 4096\nmodel: builtin:structured-tiny\n"
                    "transfer:\n  channel:\n    ring_depth: 2\n")
    args = parsed(["--config", str(path), "--alpha", "0.2", "--option", "prefill.chunk_tokens=8192",
                   "--option", "prefix_caching=false", "--option", "transfer.channel.chunk_bytes=65536", "--debug-routing"])
    cfg = args.service_config
    assert (cfg.sparse.alpha, cfg.prefill.chunk_tokens, cfg.model.model) == (0.2, 8192, "builtin:structured-tiny")
    assert cfg.prefill.prefix_caching is False and cfg.ingress.debug_routing is True
    assert (cfg.transfer.channel.ring_depth, cfg.transfer.channel.chunk_bytes) == (2, 65536)  # both layers kept
    assert cfg.kv.decode_pages == ServiceConfig().kv.decode_pages  # not given anywhere: the default
    # each --option is a layer of its own: the later one wins, whatever name it uses
    later = parsed(["--option", "alpha=0.5", "--option", "sparse.alpha=0.7"]).service_config
    assert later.sparse.alpha == 0.7
    js = tmp_path / "svc.json"
    js.write_text(json.dumps({"max_running": 16, "decode": {"adopt_wait_s": 1.5}}))  # flat names and sections mixed
    assert load_config_file(str(js)) == {"max_running": 16, "decode": {"adopt_wait_s": 1.5}}
    cfg = parsed(["--config", str(js)]).service_config
    assert (cfg.decode.max_running, cfg.decode.adopt_wait_s) == (16, 1.5)


@pytest.mark.parametrize("argv, message", [
    (["--option", "nope=1"], "nope: unknown section or option"),
    (["--option", "prefil.chunk_tokens=1"], "prefil: unknown section or option; did you mean 'prefill'?"),
    (["--option", "prefill_chunk_tokens=-5"], "prefill.chunk_tokens: Input should be greater than or equal to 0, got -5"),
    (["--option", "prefill.chunk_tokens=many"], "prefill.chunk_tokens: cannot read 'many' as int | null"),
    (["--option", "transfer.channel.ring_depth=0"], "transfer.channel.ring_depth: Input should be greater than or equal to 1"),
    (["--alpha", "3"], "sparse.alpha: Input should be less than or equal to 1, got 3.0"),
    (["--option", "alpha"], "--option: expected PATH=VALUE"),
    (["--config", "/nonexistent/svc.json"], "--config: cannot read '/nonexistent/svc.json'"),
])
def test_bad_options_exit_2_before_ray(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name, text, message", [
    ("type.yaml", "prefill:\n  chunk_tokens: '8192'\n", "prefill.chunk_tokens: Input should be a valid integer, got '8192'"),
    ("section.yaml", "prefil:\n  chunk_tokens: 8192\n", "prefil: unknown section or option; did you mean 'prefill'?"),
    ("option.yaml", "decode:\n  max_runing: 8\n", "decode.max_runing: unknown option; did you mean 'max_running'?"),
    ("both.yaml", "prefill_chunk_tokens: 4096\nprefill:\n  chunk_tokens: 8192\n",
     "prefill.chunk_tokens: given twice with different values, as prefill_chunk_tokens (4096) and as "
     "prefill.chunk_tokens (8192)"),
    ("scalar.json", '{"transfer": "nccl"}', "transfer: expected a mapping of options, got str 'nccl'"),
])
def test_bad_config_file_contents_exit_2(tmp_path, name, text, message, capsys):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(path)])
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


def test_options_command_lists_every_option_and_writes_the_table(tmp_path, capsys):
    assert main(["options"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.partition("=")[0] for line in lines] == list(OPTIONS)
    assert "prefill.chunk_tokens=2048" in lines and "transfer.channel.ring_depth=3" in lines
    # every listed default parses back through --option to the default config
    assert ServiceConfig.from_dict(dict(parse_option(line) for line in lines)) == ServiceConfig()
    assert main(["options", "--markdown"]) == 0
    assert capsys.readouterr().out == options_markdown()
    out = tmp_path / "OPTIONS.md"
    assert main(["options", "--write", str(out)]) == 0
    assert out.read_text() == options_markdown()


def test_committed_options_doc_is_the_generated_one():
    """docs/OPTIONS.md is generated: `python -m router options --write docs/OPTIONS.md`."""
    assert (REPO / "docs" / "OPTIONS.md").read_text() == options_markdown()


def test_options_table_has_every_option_and_every_flat_name():
    table = options_markdown()
    for path in OPTIONS:
        assert f"| `{path}` |" in table
    for flat, path in OPTION_ALIASES.items():
        assert f"| `{flat}` | `{path}` |" in table
    assert "| `prefill.chunk_tokens` | int \\| null (>= 0) | 2048 |" in table


def test_the_listing_takes_given_values_and_defaults_for_the_rest():
    from serving.config import OPTION_TREE

    lines = OPTION_TREE.listing({"sparse": {"layer_alpha": [0.0, 0.5], "energy_rule": "visible"},
                                 "prefill": {}}).splitlines()
    assert "sparse.layer_alpha=[0.0, 0.5]" in lines and "sparse.energy_rule=visible" in lines
    assert "prefill.chunk_tokens=2048" in lines  # not given: the field's default
    # a list given back as --option parses to the same list
    got = ServiceConfig.from_dict(dict(parse_option(line) for line in lines if line.startswith("sparse.layer_alpha")))
    assert got.sparse.layer_alpha == [0.0, 0.5]
    assert OPTION_TREE.listing() == OPTION_TREE.listing({})  # nothing given: every default
