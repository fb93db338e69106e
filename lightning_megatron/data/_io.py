"""Small filesystem helpers: crash-safe (atomic) file writes."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

#: names of the temporary files of :func:`atomic_write` and ``IndexedDatasetWriter``: ``.<name>.tmp-<pid>-<hex>``
TEMPORARY_NAME = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{12,32}$")


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


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, another user's
        return True
    return True


def remove_stale_temporaries(directory: str | os.PathLike[str], min_age_s: float = 60.0) -> list[Path]:
    """Delete the temporary files that killed writers left in ``directory`` (names as :data:`TEMPORARY_NAME`)
    whose process is gone and which have not been modified for ``min_age_s`` seconds; returns what was removed.

    A live writer's file is kept (its process exists, or it is still being written); files of other names are
    never touched. Call before writing into a directory, so that interrupted runs do not leak disk space.
    """
    removed: list[Path] = []
    folder = Path(directory)
    if not folder.is_dir():
        return removed
    now = time.time()
    for entry in folder.iterdir():
        match = TEMPORARY_NAME.match(entry.name)
        if match is None or not entry.is_file() or _process_alive(int(match["pid"])):
            continue
        try:
            if now - entry.stat().st_mtime >= min_age_s:
                entry.unlink()
                removed.append(entry)
        except FileNotFoundError:   # another process cleaned it meanwhile
            continue
    return removed
