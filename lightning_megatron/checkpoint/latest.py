"""Find the newest complete checkpoint in a set of directories (``MegatronStrategy(auto_resume=True)``).

A checkpoint is a file (``ckpt_format="torch"``: a ``torch.save`` zip archive, complete when its central directory,
written last, is there) or a sharded directory (``"torch_dist"``: complete when its DCP ``.metadata`` indexes files
that all exist at their full length, :func:`~lightning_megatron.checkpoint.distributed.verify_checkpoint`).
Temporary entries of interrupted saves (names starting with ``.``) are never candidates; a sharded checkpoint that
was moved aside for a replacement that never arrived is put back first
(:func:`~lightning_megatron.checkpoint.distributed.clean_leftovers`). "Newest" is the latest modification time of
the file, or of the directory's ``.metadata`` (written once all shards are on disk).
"""
from __future__ import annotations

import logging
import os
import zipfile
from typing import Iterable, List, Optional, Tuple

log = logging.getLogger(__name__)

__all__ = ["complete_checkpoints", "latest_checkpoint"]


def _written_at(path: str) -> Optional[int]:
    """Modification time (ns) of the complete checkpoint at ``path``; None when it is not a complete one."""
    from lightning_megatron.checkpoint.distributed import METADATA_FILE, is_sharded_checkpoint, verify_checkpoint

    if os.path.isdir(path):
        if not is_sharded_checkpoint(path):
            return None
        try:
            verify_checkpoint(path)
        except (RuntimeError, OSError, ValueError) as err:
            log.warning("skipping the incomplete checkpoint %s: %s", path, err)
            return None
        return os.stat(os.path.join(path, METADATA_FILE)).st_mtime_ns
    if os.path.isfile(path) and zipfile.is_zipfile(path):
        return os.stat(path).st_mtime_ns
    return None


def complete_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(written_at_ns, path)`` of every complete checkpoint directly in ``directory``, oldest first (nothing
    when it does not exist). Local filesystem; call on one rank."""
    from lightning_megatron.checkpoint.distributed import clean_leftovers

    if not os.path.isdir(directory):
        return []
    clean_leftovers(directory)   # a moved-aside checkpoint whose replacement never arrived is put back
    found = []
    for entry in sorted(os.listdir(directory)):
        if entry.startswith("."):
            continue
        path = os.path.join(directory, entry)
        at = _written_at(path)
        if at is not None:
            found.append((at, path))
    return sorted(found)


def latest_checkpoint(directories: Iterable[str]) -> Optional[str]:
    """The newest complete checkpoint in any of ``directories`` (see the module doc), or None."""
    found = [c for d in dict.fromkeys(str(d) for d in directories if d) for c in complete_checkpoints(d)]
    return max(found)[1] if found else None
