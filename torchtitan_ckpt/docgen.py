"""Generate the config reference (`docs/config.md`) from a config tree's field docstrings.

    python -m torchtitan_ckpt.docgen torchtitan_ckpt.example.config:JobConfig > docs/config.md

The root is named on the command line (`module:Class`), so any trainer's config tree that embeds
`Checkpoint` renders the same way and the library imports no particular one.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import typing

from .config import field_docs, sections

_HEADER = """# Config reference

Generated from the field docstrings of the config dataclasses by
`python -m torchtitan_ckpt.docgen {root}` (`make docs`); a test fails when this file is stale.
`[checkpoint]` is the library's section (`torchtitan_ckpt.config.Checkpoint`); the others are the
example job's (`torchtitan_ckpt/example/config.py`). Every key can be set in the job's TOML file
or on the command line as `--section.key value` (lists as `a,b`, booleans as `true`/`false` or a
bare `--section.key`).
"""


def _type_name(tp: typing.Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' for a in typing.get_args(tp))
    text = getattr(tp, "__name__", None) if origin is None else str(tp)
    return f"`{text or tp}`".replace("typing.", "").replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        value = f.default
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value is None:
        return "unset"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def render(root: type, root_name: str) -> str:
    """The reference of every table of `root`, one markdown table each."""
    out = [_HEADER.format(root=root_name)]
    for name, cls in sections(root).items():
        out.append(f"\n## [{name}]\n\n| key | type | default | meaning |\n|---|---|---|---|")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[f.name]):
                out.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {docs[f.name]} |")
    return "\n".join(out) + "\n"


def load_root(spec: str) -> type:
    """`package.module:Class` -> the class."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    print(render(load_root(sys.argv[1]), sys.argv[1]), end="")
