"""Where a checkpoint folder's bytes live: one `Store` strategy per kind of storage, chosen once
by the folder's URL scheme (a plain path is the local or shared file system).

Kept import-light (config validation imports it): a backend's module and its client library
are imported only when a store of that kind is opened.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import Checkpoint
    from .base import Store

STORES = {"s3": "torchtitan_ckpt.storage.s3:S3Store"}
"""URL scheme -> the store class for it; a plain path (no scheme) is `local.LocalStore`."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(path: str) -> str | None:
    """"s3" for "s3://bucket/prefix", None for a plain path."""
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def open_store(path: str, key: str, rank: int, config: Checkpoint) -> Store:
    """The store for `path` (the value of config key `key`) as seen by `rank`."""
    scheme = scheme_of(path)
    if scheme is None:
        from .local import LocalStore  # noqa: PLC0415 - keeps this module import-light

        return LocalStore(path)
    module, _, name = STORES[scheme].partition(":")
    return getattr(importlib.import_module(module), name)(path, key, rank, config)
