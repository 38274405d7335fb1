"""docs/OPTIONS.md, generated from the service's option tree (``serving/config.py``) and its flat
and moved names (``serving/option_aliases.py``): ``python -m router options --markdown``."""

from __future__ import annotations

from serving.config import OPTION_TREE
from serving.option_aliases import MOVED_OPTIONS, OPTION_ALIASES


def options_markdown() -> str:
    """docs/OPTIONS.md: every option (path, type, default, description), then the flat names."""
    lines = [
        "# Service options",
        "",
        "Generated from `serving/config.py` by `python -m router options --markdown` (a test keeps this",
        "file equal to the output). Set them in a YAML/JSON file of nested sections (`--config FILE`,",
        "`serve_config.yaml`'s `args`) or one at a time (`--option prefill.chunk_tokens=8192`, the value",
        "parsed by the option's type; `null` for none). Later wins: `--config`, then the flags, then",
        "each `--option`.",
        "",
        *OPTION_TREE.section_tables(),
        "## Flat names",
        "",
        "The option names from before the sections are still accepted (in files, `args`, `--option` and",
        "`ServiceConfig(...)`), as the option they name. Giving a flat name and its dotted path with",
        "different values is an error. `model` with a string value is `model.model`; with a mapping it is",
        "the section.",
        "",
        "| Flat name | Option |",
        "|---|---|",
        *(f"| `{flat}` | `{path}` |" for flat, path in OPTION_ALIASES.items()),
        "",
        "Options that moved to another section are accepted under their old path too:",
        "",
        "| Old path | Option |",
        "|---|---|",
        *(f"| `{old}` | `{path}` |" for old, path in MOVED_OPTIONS.items()),
        "",
    ]
    return "\n".join(lines)
