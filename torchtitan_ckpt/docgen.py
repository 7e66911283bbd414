"""Generate `docs/config.md` from the config dataclasses' field docstrings.

    python -m torchtitan_ckpt.docgen > docs/config.md
"""

from __future__ import annotations

import dataclasses
import typing

from .config import field_docs, sections

_HEADER = """# Config reference

Generated from the field docstrings in `torchtitan_ckpt/config.py` by
`python -m torchtitan_ckpt.docgen` (`make docs`); a test fails when this file is stale.
Every key can be set in the job's TOML file or on the command line as `--section.key value`
(lists as `a,b`, booleans as `true`/`false` or a bare `--section.key`).
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


def render() -> str:
    out = [_HEADER]
    for name, cls in sections().items():
        out.append(f"\n## [{name}]\n\n| key | type | default | meaning |\n|---|---|---|---|")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {docs[f.name]} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
