"""On-disk formats of a step, one strategy object each; the manager asks a format, never branches on one.

A format knows how a step is written (`write`), recognised (`holds`), described (`index`: which
keys it holds, tensor sizes) and read into a state dict (`read`). The commit marker records
the format's `name`, so `load()` picks the same format back. A new format is one module beside
these and one line in `FORMATS`.
"""

from __future__ import annotations

from .base import Context, StepFormat, StepIndex, Written
from .dcp import DcpFormat
from .hf import HfFormat

FORMATS: dict[str, type[StepFormat]] = {
    DcpFormat.name: DcpFormat,
    HfFormat.name: HfFormat,
}
"""Format name (as the commit marker records it) -> its strategy class."""

__all__ = ["FORMATS", "Context", "DcpFormat", "HfFormat", "StepFormat", "StepIndex", "Written"]
