"""Where a checkpoint folder's bytes live: one `Store` strategy per kind of storage, chosen once
by the folder's URL scheme (a plain path is the local or shared file system).

Kept import-light (config validation imports it): a backend's module and its client library
are imported only when a store of that kind is opened.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import Checkpoint
    from .base import Store

STORES = {"s3": "torchtitan_ckpt.storage.s3:S3Store"}
"""URL scheme -> the store class for it; a plain path (no scheme) is `local.LocalStore`."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?")
"""A scheme and its colon; with `//` after them, a URL."""


def scheme_of(path: str) -> str | None:
    """"s3" for "s3://bucket/prefix", None for a plain path."""
    m = _SCHEME.match(path)
    return m.group(1).lower() if m and m.group(2) else None


def under(base: str, folder: str) -> str:
    """Where `folder` is for a job whose outputs go under `base`: a URL as it is, a path
    joined onto `base`."""
    return folder if scheme_of(folder) else os.path.join(base, folder)


def below(path: str, folder: str) -> list[str] | None:
    """The names leading from `folder` down to `path` ([] for `folder` itself), or None when
    `path` is not `folder` or below it: paths once links are resolved, URLs by their keys (a
    trailing slash aside)."""
    if scheme_of(path) != scheme_of(folder):
        return None
    if scheme_of(path) is None:
        path, folder = os.path.realpath(path), os.path.realpath(folder)
        if os.path.commonpath([path, folder]) != folder:
            return None
        rel = os.path.relpath(path, folder)
        return [] if rel == "." else rel.split(os.sep)
    path, folder = path.rstrip("/"), folder.rstrip("/")
    if path == folder:
        return []
    return path[len(folder) + 1:].split("/") if path.startswith(folder + "/") else None


def check_url(key: str, url: str) -> None:
    """A `ConfigError` naming `key` unless the URL `url` names a kind of storage there is a
    store for (`STORES`), and a bucket in it."""
    scheme = scheme_of(url)
    if scheme not in STORES:
        raise ConfigError(key, url, f"{scheme}:// is not a supported storage; expected a path on a file "
                          f"system every rank shares, or one of {', '.join(s + '://bucket/prefix' for s in STORES)}")
    if not url.partition("://")[2].split("/", 1)[0]:
        raise ConfigError(key, url, f"expected {scheme}://bucket/prefix (no bucket given)")


_VARIABLE = re.compile(r"\$(\{\w+\}|[A-Za-z_]\w*)")
"""An environment variable as a shell names it in a path ($SCRATCH, ${USER})."""


def check_location(key: str, value: str, local: bool = False) -> None:
    """A `ConfigError` naming `key` unless `value` is a URL `check_url` takes (none when `local`)
    or a path that is no mistyped URL. A path keeps what a URL would drop, so a mistyped one
    silently became a local folder: white space at either end (" s3://b/x"), or a scheme and a
    colon without `//` ("s3:/b/x", "s3:", "s3:b/x") where a URL of a supported store was meant
    (another scheme-like name, "run:1" or "C:/x", is a local path as it always was). A path is
    refused where a shell would expand it (`~`, `$NAME`): it would be a folder of that name."""
    if value != value.strip():
        raise ConfigError(key, value, "starts or ends with white space, which a path keeps; remove it")
    m = _SCHEME.match(value)
    url = bool(m and m.group(2))
    mistyped = m and not url and m.group(1).lower() in STORES
    if local and (url or mistyped):
        raise ConfigError(key, value, f"expected a local folder, not a URL (for a folder of that name: ./{value})")
    if url:
        check_url(key, value)
    elif value.startswith("~") or _VARIABLE.search(value):
        raise ConfigError(key, value, "a path is read as it is written: neither '~' nor an environment variable "
                          "is expanded (TorchTitan does not either); write the folder's path")
    elif mistyped:
        raise ConfigError(key, value, f"a mistyped URL ({m.group(0)} without //)? expected one of "
                          f"{', '.join(s + '://bucket/prefix' for s in STORES)}, or for a local folder of "
                          f"that name ./{value}")


def open_store(path: str, key: str, rank: int, config: Checkpoint) -> Store:
    """The store for `path` (the value of config key `key`) as seen by `rank`; a `ConfigError`
    for a URL `check_url` refuses."""
    scheme = scheme_of(path)
    if scheme is None:
        from .local import LocalStore  # noqa: PLC0415 - keeps this module import-light

        return LocalStore(path)
    check_url(key, path)
    module, _, name = STORES[scheme].partition(":")
    return getattr(importlib.import_module(module), name)(path, key, rank, config)
