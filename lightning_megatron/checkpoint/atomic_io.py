"""``AtomicCheckpointIO``: Lightning's ``TorchCheckpointIO`` with a crash-safe write for local files.

Lightning's own save serialises into memory and moves a file from the system temporary directory into place:
across filesystems that move is a copy, so a save killed midway can leave a truncated checkpoint under the final
name and a half-written file in ``/tmp``. Here a local checkpoint is written to a temporary name in its own
directory, flushed, fsync'ed and renamed over the destination (:func:`os.replace`, atomic on one filesystem): the
file under the final name is always the old one or the complete new one. Temporary files that killed saves left in
that directory are removed on the next save. Remote paths (``s3://`` ...) keep Lightning's behaviour.
``MegatronStrategy`` uses it unless given another ``checkpoint_io``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are complete or absent (a same-directory temporary file renamed into
    place; see the module docstring). Loading is Lightning's, with ``weights_only=True`` unless the caller says
    otherwise (``Trainer.fit(weights_only=False)``): no code in a checkpoint runs, whatever the environment's
    default."""

    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Lightning's load, ``weights_only=True`` when not given."""
        return super().load_checkpoint(path, map_location=map_location,
                                       weights_only=True if weights_only is None else weights_only)

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path``: a sibling temporary file, fsync, then ``os.replace`` (local paths)."""
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        from lightning_megatron.data._io import atomic_write, remove_stale_temporaries

        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(directory)
        atomic_write(path, lambda f: torch.save(checkpoint, f))
