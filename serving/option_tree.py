"""OptionTree: a nested, frozen pydantic config read as a tree of dotted option paths.

A root model whose fields are options (``int``, ``Literal[...]``, ...) or sections (fields whose
type is itself a pydantic model) is a tree: ``prefill.chunk_tokens`` is the option
``chunk_tokens`` of the section ``prefill``. :class:`OptionTree` walks it once and gives what
every way in needs: :meth:`~OptionTree.nest` turns a mapping of sections, dotted paths and old
names (mixed) into the nested dict the root model takes, :meth:`~OptionTree.parse_value` reads a
command line's ``PATH=TEXT`` by the option's type, :meth:`~OptionTree.config_error` turns
pydantic's errors into one line per option, and :meth:`~OptionTree.section_tables` /
:meth:`~OptionTree.listing` render the documentation. It knows nothing of any particular
config: ``serving.config`` builds the one of ``ServiceConfig``.

Why not pydantic-settings: it reads environment variables and a command line into a model, but
has no old names mixed with nested sections (and no "given twice with different values" check
between them), no moved options, and its errors and help are its own; the messages here are
what the service's users and tests see.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined


class ConfigError(ValueError):
    """Bad options: one line per problem, each starting with the option's dotted path."""


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The section's model, if a field of this type is a section (a pydantic model), else None."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Dotted path -> FieldInfo of every option and section under ``model``, depth first."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        out[path] = info
        sub = section_type(info.annotation)
        if sub is not None:
            out.update(_fields(sub, f"{path}."))
    return out


def _walk(tree: dict, path: str) -> dict:
    node = tree
    for part in path.split(".") if path else ():
        if part not in node:
            node[part] = {}
        node = node[part]
    return node


def merge(base: Mapping, override: Mapping) -> dict:
    """Nested dicts: ``override``'s leaves win (layers of options: file, flags, --option)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


class OptionTree:
    """The options and sections of ``root`` by dotted path.

    ``aliases``: old flat names -> the dotted path each sets (a name that is also a section
    sets the option when its value is not a mapping). ``moved``: old dotted paths -> where the
    option is now. ``secrets``: dotted paths whose values are never shown. ``unknown_hint``:
    what an unknown top-level name's error adds after the list of sections.
    """

    def __init__(self, root: type[BaseModel], *, aliases: Mapping[str, str] | None = None,
                 moved: Mapping[str, str] | None = None, secrets: frozenset[str] = frozenset(),
                 unknown_hint: str = "") -> None:
        self.root = root
        self.aliases = dict(aliases or {})
        self.moved = dict(moved or {})
        self.secrets = secrets
        self.unknown_hint = unknown_hint
        self.fields = _fields(root)
        self.sections = tuple(p for p, info in self.fields.items() if section_type(info.annotation) is not None)
        self.options = tuple(p for p in self.fields if p not in self.sections)
        for name, path in {**self.aliases, **self.moved}.items():
            if path not in self.options:
                raise ValueError(f"aliases/moved: {name!r} names {path!r}, which is not an option of {root.__name__}")

    # ------------------------------------------------------------------------- names
    def unknown(self, path: str) -> ConfigError:
        """The error of a name that is not there: its first missing part, a close match, the siblings."""
        parts = path.split(".")
        for i in range(1, len(parts) + 1):  # name the first part that is not there
            if ".".join(parts[:i]) not in self.fields:
                path = ".".join(parts[:i])
                break
        parent, _, leaf = path.rpartition(".")
        if parent:
            known = [p.rpartition(".")[2] for p in self.fields if p.rpartition(".")[0] == parent]
            hint = f"{parent} has: {', '.join(known)}"
            close = difflib.get_close_matches(leaf, known, n=1)
        else:
            top = [p for p in self.fields if "." not in p]
            hint = f"sections: {', '.join(top)}" + (f"; {self.unknown_hint}" if self.unknown_hint else "")
            close = difflib.get_close_matches(leaf, [*top, *self.aliases, *self.options], n=1)
        did = f"did you mean {close[0]!r}? " if close else ""
        return ConfigError(f"{path or '<empty>'}: unknown {'option' if parent else 'section or option'}; {did}({hint})")

    def resolve(self, key: str, value: Any = None) -> str:
        """The dotted path that ``key`` (a dotted path, a section or a flat name) sets."""
        if key in self.aliases and key in self.sections and not isinstance(value, (Mapping, BaseModel)):
            return self.aliases[key]  # the flat option, not the section of the same name
        if key in self.fields:
            return key
        if key in self.aliases:
            return self.aliases[key]
        if key in self.moved:
            return self.moved[key]
        raise self.unknown(key)

    def shown(self, path: str, value: Any) -> str:
        return "<hidden>" if path in self.secrets else repr(value)

    # ------------------------------------------------------------------------- nesting
    def nest(self, raw: Mapping[str, Any]) -> dict:
        """A mapping of sections, dotted paths and flat names (mixed) -> the nested dict of sections.
        An option set twice with different values, an unknown name or an unknown section is a
        :class:`ConfigError`; values are checked later, by the sections."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config: expected a mapping of options, got {type(raw).__name__}")
        tree: dict = {}
        origin: dict[str, str] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                raise ConfigError(f"config: option names are strings, got {key!r}")
            self._put(tree, self.resolve(key, value), value, origin, key)
        return tree

    def _put(self, tree: dict, path: str, value: Any, origin: dict[str, str], key: str) -> None:
        """Set ``path`` in ``tree``; a section's mapping is flattened into its options (so that an
        alias and the nested form meet at the same leaf)."""
        section = section_type(self.fields[path].annotation)
        if section is not None:
            if not isinstance(value, (Mapping, section)):
                raise ConfigError(f"{path}: expected a mapping of options, got {type(value).__name__} {value!r}")
            items = value.model_dump() if isinstance(value, BaseModel) else value
            for sub, sub_value in items.items():
                full = f"{path}.{sub}"
                if isinstance(sub, str) and full in self.moved:
                    self._put(tree, self.moved[full], sub_value, origin, f"{key}.{sub}" if key else full)
                    continue
                if not isinstance(sub, str) or full not in self.fields:
                    raise self.unknown(full)
                self._put(tree, full, sub_value, origin, f"{key}.{sub}" if key else sub)
            if not items:
                _walk(tree, path)
            return
        node = _walk(tree, path.rpartition(".")[0])
        leaf = path.rpartition(".")[2]
        if leaf in node and path in origin and node[leaf] != value:
            first = origin[path]
            raise ConfigError(
                f"{path}: given twice with different values, as {first} ({self.shown(path, node[leaf])}) and as "
                f"{key} ({self.shown(path, value)}); keep one"
                + ("" if {first, key} == {path} else
                   f" ({', '.join(sorted({first, key} - {path}))} is the old name of {path})"))
        node[leaf] = value
        origin[path] = key

    # ------------------------------------------------------------------------- errors
    def config_error(self, exc: ValidationError, prefix: str = "") -> ConfigError:
        """pydantic's errors as one line per option: ``dotted.path: what is wrong, got value``."""
        lines = []
        for err in exc.errors(include_url=False):
            path = ".".join([prefix, *map(str, err["loc"])] if prefix else map(str, err["loc"]))
            cause = err.get("ctx", {}).get("error")
            if isinstance(cause, ConfigError):  # a nested section's own __init__ named its options already
                lines.append(str(cause))
                continue
            if err["type"] == "extra_forbidden":
                lines.append(str(self.unknown(path)))
                continue
            msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
            if not path:  # a whole-config problem: the message names what it is about
                lines.append(msg)
                continue
            leaf = path.rpartition(".")[2]
            msg = msg.removeprefix(f"{leaf}: ")
            shown = "" if err["type"] == "value_error" else f", got {self.shown(path, err.get('input'))}"
            lines.append(f"{path}: {msg}{shown}")
        return ConfigError("\n".join(lines))

    # ------------------------------------------------------------------------- the command line's values
    def parse_value(self, path: str, text: str) -> Any:
        """``--option PATH=TEXT``: TEXT parsed by the option's type (``null``: None where allowed;
        a section or a mapping option takes a JSON object, a list option a JSON array). ``path`` is a
        dotted path or a flat name."""
        resolved = self.resolve(path)  # a flat name that is also a section is the option
        annotation = self.fields[resolved].annotation
        if _allows_none(annotation) and text.strip().lower() in ("null", "none"):
            return None
        if _is_text(annotation):
            return text
        try:
            if section_type(annotation) is not None or _is_json(annotation):
                return json.loads(text)
            return TypeAdapter(annotation).validate_strings(text.strip())
        except ValueError as exc:
            detail = exc.errors(include_url=False)[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            raise ConfigError(f"{resolved}: cannot read {text!r} as {type_name(annotation)}: {detail}") from None

    # ------------------------------------------------------------------------- documentation
    def section_tables(self) -> list[str]:
        """Markdown lines: per section, its heading, its docstring's first line and a table of its
        options (path, type with constraints, default, description)."""
        lines: list[str] = []
        for section in self.sections:
            sub = section_type(self.fields[section].annotation)
            lines += [f"## `{section}`", "", (sub.__doc__ or "").strip().splitlines()[0], "",
                      "| Option | Type | Default | Description |", "|---|---|---|---|"]
            for path, info in self.fields.items():
                if path.rpartition(".")[0] != section or path in self.sections:
                    continue
                kind = type_name(info.annotation, " \\| ")  # a table cell: escaped pipes
                bounds = _constraints(info)
                kind = f"{kind} ({bounds})" if bounds else kind
                lines.append(f"| `{path}` | {kind} | {_default(info)} | {info.description or ''} |")
            lines.append("")
        return lines

    def listing(self, values: Mapping[str, Any] | None = None) -> str:
        """One ``path=value`` line per option (what ``--option`` takes): its value in ``values``
        (nested sections, e.g. a config's ``to_dict()``), else its default."""
        lines = []
        for path in self.options:
            node: Any = values if values is not None else {}
            for part in path.split("."):
                node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
            if node is _MISSING:
                text = _default(self.fields[path])
            else:  # a container as --option parses it (JSON)
                text = json.dumps(node) if isinstance(node, (list, tuple, dict)) else _format(node)
            lines.append(f"{path}={text.strip(QUOTE)}\n")
        return "".join(lines)


QUOTE = '"'


def _allows_none(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType) and type(None) in typing.get_args(annotation)


def _is_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return all(_is_text(a) for a in typing.get_args(annotation) if a is not type(None))
    return False


def _is_json(annotation: Any) -> bool:
    """An option given as JSON on the command line: a mapping or a list (or either, or null)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return any(_is_json(a) for a in typing.get_args(annotation))
    return annotation in (dict, list, tuple) or typing.get_origin(annotation) in (dict, list, tuple)


def type_name(annotation: Any, sep: str = " | ") -> str:
    """An option's type as the documentation and the errors write it (``int | null``, ``"a" | "b"``)."""
    if typing.get_origin(annotation) is Literal:
        return sep.join(f'"{a}"' for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return sep.join("null" if a is type(None) else type_name(a, sep) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info: Any) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "multiple_of": "multiple of", "min_length": "length >="}
    out = []
    for meta in info.metadata:
        for attr, word in words.items():
            bound = getattr(meta, attr, None)
            if bound is not None:
                out.append(f"{word} {bound!r}")
    return ", ".join(out)


_MISSING = object()


def _default(info: Any) -> str:
    return _format(info.default if info.default is not PydanticUndefined else info.default_factory())


def _format(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


__all__ = ["ConfigError", "OptionTree", "merge", "section_type", "type_name"]
