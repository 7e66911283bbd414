"""Generate the API reference (`docs/api.md`) from the public names of packages and their docstrings.

    python -m torchtitan_ckpt.apidoc [package ...] > docs/api.md

A package's public names are its `__all__`, each rendered with its signature and docstring (a
class with the public methods and properties it defines; a type alias with the docstring under
its assignment), so the reference says what the code says and a test fails when the file falls
behind it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
from typing import Any

from .config import attribute_docs

_HEADER = """# API reference

Generated from the docstrings of the public names (each package's `__all__`) by `make docs`:

    python -m torchtitan_ckpt.apidoc > docs/api.md

A test fails when this file is stale. The `[checkpoint]` keys are in docs/config.md, the
`torchtitan-ckpt` command in docs/cli.md, and TorchTitan's trainer taking this package as its
checkpointer in docs/torchtitan.md.
"""

PACKAGES = ["torchtitan_ckpt", "torchtitan_ckpt.hf"]
"""This package's public surface, rendered when no package is named."""

_WIDTH = 100
"""A signature longer than this is written one parameter per line."""


def _default(value: Any) -> str:
    """A default as the code spells it; a function by its name (its repr holds an address)."""
    if callable(value):
        return getattr(value, "__name__", type(value).__name__).replace("<lambda>", "(a function)")
    return repr(value)


def _annotation(annotation: Any) -> str:
    """An annotation as written (a module of postponed annotations keeps it as text)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _signature(name: str, fn: Any, skip_first: bool = False) -> str:
    """`name(parameters) -> result` of `fn`, annotations as written in the code, in a code block."""
    sig = inspect.signature(fn)
    given = list(sig.parameters.values())
    params, star_done = [], False
    for i, p in enumerate(given):
        if skip_first and i == 0:
            continue
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, star_done = "*" + text, True
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + text
        elif p.kind is p.KEYWORD_ONLY and not star_done:
            params.append("*")
            star_done = True
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}"
        params.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(given) or given[i + 1].kind is not p.POSITIONAL_ONLY):
            params.append("/")
    result = "" if sig.return_annotation is sig.empty else f" -> {_annotation(sig.return_annotation)}"
    line = f"{name}({', '.join(params)}){result}"
    if len(line) > _WIDTH:
        line = f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){result}"
    return f"```python\n{line}\n```"


def _doc(obj: Any) -> str:
    return inspect.getdoc(obj) or ""


def _own_members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties `cls` defines itself (an inherited one is its base's)."""
    return [(name, member) for name, member in vars(cls).items() if not name.startswith("_")
            and (inspect.isfunction(member) or isinstance(member, (property, classmethod, staticmethod)))]


def _member(cls: type, name: str, member: Any) -> list[str]:
    if isinstance(member, property):
        return [f"#### `{cls.__name__}.{name}` (property)", "", _doc(member), ""]
    fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
    return [f"#### `{cls.__name__}.{name}`", "",
            _signature(name, fn, skip_first=not isinstance(member, staticmethod)), "", _doc(fn), ""]


def _class(name: str, cls: type) -> list[str]:
    bases = ", ".join(b.__name__ for b in cls.__bases__ if b is not object and not b.__name__.startswith("_"))
    out = [f"### class `{name}`" + (f"({bases})" if bases else ""), ""]
    doc = _doc(cls)
    if dataclasses.is_dataclass(cls):  # its own docstring, not the signature dataclass writes without one
        out += ["" if doc.startswith(f"{cls.__name__}(") else doc, ""]
        fields = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls))
        out += [f"A dataclass; its fields, each a keyword of the constructor: {fields}.", ""]
    else:
        out += [doc, ""]
        if "__init__" in vars(cls) and not issubclass(cls, BaseException) and not getattr(cls, "_is_protocol", False):
            out += [_signature(name, cls.__init__, skip_first=True), ""]
            if cls.__init__.__doc__:
                out += [_doc(cls.__init__), ""]
    for member_name, member in _own_members(cls):
        out += _member(cls, member_name, member)
    return out


def _defined_in(package: Any, name: str) -> Any:
    """The module whose top level assigns `name`, as the package's `__init__` imports it."""
    tree = ast.parse(inspect.getsource(package))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names):
            return importlib.import_module("." * node.level + (node.module or ""), package.__name__)
    return package


def _value(package: Any, name: str, value: Any) -> list[str]:
    if inspect.isfunction(value):
        return [f"### `{name}`", "", _signature(name, value), "", _doc(value), ""]
    source = ast.parse(inspect.getsource(_defined_in(package, name))).body
    assigned, doc = attribute_docs(source).get(name, (None, ""))
    if isinstance(value, dict):
        shown = ", ".join(f"`{k}`: `{getattr(v, '__name__', v)}`" for k, v in value.items())
        what = f"A `dict`: {shown}."
    else:
        what = f"`{ast.unparse(assigned) if assigned is not None else value}`"
    return [f"### `{name}`", "", what, "", inspect.cleandoc(doc), ""]


def render(packages: list[str]) -> str:
    """The reference of every name in the `__all__` of each of `packages`, in that order."""
    out = [_HEADER]
    for package in packages:
        module = importlib.import_module(package)
        out += [f"## `{package}`", "", _doc(module), ""]
        for name in module.__all__:
            value = getattr(module, name)
            out += _class(name, value) if inspect.isclass(value) else _value(module, name, value)
    text = "\n".join(out)
    while "\n\n\n" in text:  # an empty docstring leaves two blank lines
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(sys.argv[1:] or PACKAGES), end="")
