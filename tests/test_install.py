"""The serving install carries no test or benchmark tool: ``scripts/setup.sh`` installs the
project's serving extras, ``scripts/test.sh`` adds the ``test`` and ``bench`` ones."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVING = ("serve", "gguf", "structured")
TOOLS = {"pytest", "hypothesis", "import-linter", "lm-eval", "openai", "httpx", "jsonschema", "matplotlib", "psutil",
         "nvidia-cutlass", "grpcio-tools", "guidellm"}


def name(req: str) -> str:
    return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def installed_by(script: str) -> set[str]:
    """Requirement names a script passes to pip (quoted), and the extras of its ``-e .[...]``."""
    text = (ROOT / "scripts" / script).read_text()
    names = {name(q) for q in re.findall(r'"([A-Za-z][^"]*)"', text) if not q.startswith((".", "$"))}
    found = re.findall(r'-e "\.\[([a-z,]+)\]"', text)
    return names | {f"[{x}]" for group in found for x in group.split(",")}


def test_the_serving_install_has_no_tool():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    serving = {name(r) for r in project["dependencies"]} | {name(r) for e in SERVING for r in extras()[e]}
    assert not serving & TOOLS, serving & TOOLS
    setup = installed_by("setup.sh")
    assert {f"[{e}]" for e in SERVING} <= setup and not setup & TOOLS, setup
    assert not {"[test]", "[bench]"} & setup


def test_test_sh_adds_the_tools_the_suite_imports():
    added = installed_by("test.sh")
    assert {"[test]", "[bench]"} <= added, added
    tools = {name(r) for e in ("test", "bench") for r in extras()[e]} | added
    # what the tests import or run, beyond the service
    assert {"pytest", "hypothesis", "import-linter", "openai", "httpx", "psutil", "matplotlib", "grpcio-tools",
            "nvidia-cutlass", "lm-eval"} <= tools, tools
