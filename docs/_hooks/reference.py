"""MkDocs hook: the pages that are generated from the code, so they cannot fall behind it.

A page line `<!-- generated: config-keys -->` becomes the table of every configuration
key `fzero.load_config` parses, read from `fzero.config`'s dataclasses: its type, its
default, and what it does (the field's docstring), or why it changes nothing or is taken
only at its default (the field's metadata), plus the DeepSpeed keys fzero refuses.
`<!-- generated: cli -->` becomes `fzero --help` and every subcommand's help.
`tests/test_docs.py` checks that every key has a description.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
import typing
from collections.abc import Iterator
from typing import Any

MARKER = "<!-- generated: {} -->"


@dataclasses.dataclass(frozen=True)
class Key:
    """One configuration key, as the reference lists it."""

    path: str
    type: str
    default: str
    origin: str  # "DeepSpeed" or "fzero"
    status: str  # "read", "no effect", "default only", "refused"
    description: str


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of a dataclass (as mkdocstrings reads it)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    found = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = inspect.cleandoc(after.value.value)
    return found


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, __import__("types").UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if dataclasses.is_dataclass(hint):
        return "object"
    if origin is not None:
        return {list: "list", dict: "object"}.get(origin, str(hint))
    return {bool: "bool", int: "int", float: "number", str: "string"}.get(hint, str(hint))


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "(required)"
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:_}".replace("_", ",")
    return repr(value) if isinstance(value, str) else str(value)


def config_keys() -> Iterator[Key]:
    """Every key `fzero.load_config` parses, section by section, then the refused ones."""
    from fzero.config import Config
    from fzero.config._parse import ALIASES, NOT_SUPPORTED

    yield from _section_keys(Config, "")
    for section, switches in sorted(NOT_SUPPORTED.items()):
        for name, switch in sorted(switches.items()):
            path = f"{section}.{name}" if section else name
            yield Key(
                path,
                "any",
                "off",
                "DeepSpeed",
                "refused",
                f"accepted only while switched off ({switch.off}); "
                "any other value is an error naming the key.",
            )
    for section, aliases in sorted(ALIASES.items()):
        for old, new in sorted(aliases.items()):
            path = f"{section}.{old}" if section else old
            target = f"{section}.{new}" if section else new
            yield Key(
                path, "alias", "—", "DeepSpeed", "read", f"DeepSpeed's older name of `{target}`."
            )


def _section_keys(cls: type, prefix: str) -> Iterator[Key]:
    hints = typing.get_type_hints(cls)
    docs = _attribute_docstrings(cls)
    nested = []
    for field in dataclasses.fields(cls):
        path = prefix + field.name
        hint = hints[field.name]
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        section = hint if dataclasses.is_dataclass(hint) else (inner[0] if inner else None)
        description = docs.get(field.name, "")
        status = "read"
        if "no_effect" in field.metadata:
            status, description = "no effect", field.metadata["no_effect"]
        elif "only_default" in field.metadata:
            status, description = "default only", field.metadata["only_default"]
        if section is not None and not description:
            description = inspect.cleandoc(section.__doc__ or "")
            if description.startswith(section.__name__ + "("):  # dataclass's own repr doc
                description = ""
        origin = "fzero" if description.startswith("fzero") else "DeepSpeed"
        description = description.removeprefix("fzero:").removeprefix("fzero,").strip()
        yield Key(path, _type_name(hint), _default(field), origin, status, description)
        if section is not None:
            nested.append((section, path + "."))
    for section, sub in nested:
        yield from _section_keys(section, sub)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_table() -> str:
    lines = [
        "| key | type | default | from | what fzero does |",
        "|---|---|---|---|---|",
    ]
    status_text = {
        "read": "",
        "no effect": "**Accepted, changes nothing:** ",
        "default only": "**Only the default is accepted:** ",
        "refused": "**Not supported yet:** ",
    }
    for key in config_keys():
        lines.append(
            f"| `{key.path}` | {_cell(key.type)} | `{_cell(key.default)}` | {key.origin} "
            f"| {status_text[key.status]}{_cell(key.description)} |"
        )
    return "\n".join(lines)


def optimizer_table() -> str:
    from fzero.optim import OPTIMIZER_PARAMS, SCHEDULE_PARAMS

    lines = ["| block | `type` (any case) | `params` keys |", "|---|---|---|"]
    for block, table in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULE_PARAMS)):
        for kind, params in sorted(table.items()):
            names = ", ".join(f"`{p}`" for p in sorted(params))
            lines.append(f"| `{block}` | `{kind}` | {names} |")
    return "\n".join(lines)


def cli_help() -> str:
    """`fzero --help` and each subcommand's, as the command prints them."""
    from fzero_cli import parser

    os.environ["COLUMNS"] = "90"  # argparse wraps to the terminal; the page has one width
    root = parser()
    parts = [("fzero --help", root.format_help())]

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    full = f"{name} {sub_name}"
                    parts.append((f"{full} --help", sub.format_help()))
                    walk(sub, full)

    walk(root, "fzero")
    return "\n\n".join(f"## `{title}`\n\n```\n{text.rstrip()}\n```" for title, text in parts)


GENERATORS = {
    "config-keys": config_table,
    "optimizer-params": optimizer_table,
    "cli": cli_help,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each generated-page marker with what it names."""
    for name, generate in GENERATORS.items():
        marker = MARKER.format(name)
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
