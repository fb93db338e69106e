"""Small filesystem helpers: crash-safe (atomic) file writes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> Path:
    """Write a file so that readers only ever see nothing or the complete file.

    ``write`` receives a binary file object for a uniquely named temporary file in the
    same directory; once it returns the data is flushed, fsync'ed and the temporary file
    is renamed over ``path`` with :func:`os.replace` (atomic on POSIX and Windows). If
    ``write`` raises, the temporary file is removed and ``path`` is left untouched.
    Several processes may write the same path concurrently; the last rename wins.

    Args:
        path: destination file. Its parent directory is created if needed.
        write: callback that writes the file's content to the given file object.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Atomically write ``data`` to ``path`` (see :func:`atomic_write`)."""
    return atomic_write(path, lambda f: f.write(data))
