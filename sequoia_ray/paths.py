"""Paths a user gives (flags, config values, environment variables), with ``~`` expanded."""

from __future__ import annotations

import os
from pathlib import Path


def user_path(text: str | os.PathLike) -> Path:
    """``Path(text).expanduser()``; a ``~user`` with no home here is a ValueError naming the path and the fix.
    pathlib raises RuntimeError ("Could not determine home directory"), which every command line took for a bug of
    ours: ``--storage '~plans'`` (a typo for ``~/plans``) ended in a traceback."""
    try:
        return Path(text).expanduser()
    except RuntimeError as exc:
        user = str(text)[1:].split("/", 1)[0]
        raise ValueError(f"{text}: '~{user}' names no user with a home directory here ({exc}); give an absolute "
                         "path, or one under '~/' (your own home)") from None
