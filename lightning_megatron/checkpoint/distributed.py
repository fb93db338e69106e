"""Sharded checkpoint directories (``ckpt_format="torch_dist"``, Megatron's ``--ckpt-format torch_dist``):
``torch.distributed.checkpoint`` writes each rank's shards, and a directory is complete or absent.

:class:`ShardedCheckpointIO` writes a checkpoint into a sibling temporary directory ``.<name>.dcp-tmp-<pid>``
(``pid``: rank 0's process), and rank 0 renames it to ``<name>`` once every rank's data and DCP's ``.metadata``
are on disk (fsync'ed): an older checkpoint of the same name is moved aside to ``.<name>.dcp-old`` first and
removed after. A save killed at any point leaves either the old directory or the new one under ``<name>``; the
next save or load in that directory removes temporary directories whose process is gone and puts a moved-aside
old checkpoint back if the new one never arrived. With ``async_save`` the state is copied to host memory and DCP's
``async_save`` writes it from a background thread over a separate gloo group; the rename happens when it
completes, and removals that Lightning asks for meanwhile (``ModelCheckpoint`` rotating files) wait for it, so
an older complete checkpoint is never deleted before its successor is complete.

Loading checks, before reading, that every file the ``.metadata`` indexes exists and is long enough (a truncated
or missing shard file is named), and reads pickled values (the loop state) with ``weights_only=True``.

:func:`save_sharded` / :func:`load_sharded` turn Lightning's checkpoint dict into such a directory and back (the
strategy's ``save_checkpoint`` / ``load_checkpoint`` under ``ckpt_format="torch_dist"``).
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.utils import find_state_dict_object

from lightning_megatron.data._io import _process_alive
from lightning_megatron.checkpoint.sharded_state import ShardedEntry

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"
_TMP_TAG, _OLD_TAG = ".dcp-tmp-", ".dcp-old"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a sharded (DCP) checkpoint directory."""
    return os.path.isdir(str(path)) and os.path.isfile(os.path.join(str(path), METADATA_FILE))


def _lookup(state: Dict[str, Any], index: MetadataIndex) -> Any:
    obj = state.get(index.fqn)
    if isinstance(obj, ShardedEntry):
        return obj.__get_tensor_shard__(index)
    return find_state_dict_object(state, index)


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also finds the blocks of a
    :class:`~lightning_megatron.checkpoint.sharded_state.ShardedEntry`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a flat state, writing into the blocks of a ``ShardedEntry`` and reading
    pickled values with ``weights_only=True`` (no code in a checkpoint runs)."""

    def set_up_planner(self, state_dict: Dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        # The state is flat and holds no meta tensors: DCP's own set-up would pass it through its state-dict
        # iterator, which replaces values of types it does not know (a ShardedEntry) with None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        self.state_dict[read_item.dest_index.fqn] = obj
        self.original_state_dict[read_item.dest_index.fqn] = obj


class _Staged:
    """An ``AsyncStager`` that hands DCP the state as it is: :class:`ShardedCheckpointIO`'s caller already copied
    it to host memory."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_leftovers(directory: str, keep: Optional[List[str]] = None) -> None:
    """In ``directory``: remove temporary checkpoint directories whose writing process is gone, and put a
    moved-aside old checkpoint back where its replacement never arrived (local filesystem; rank 0 only)."""
    if not os.path.isdir(directory):
        return
    keep = keep or []
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if not entry.startswith(".") or path in keep:
            continue
        if _TMP_TAG in entry:
            pid = entry.rsplit(_TMP_TAG, 1)[1]
            if pid.isdigit() and (int(pid) == os.getpid() or not _process_alive(int(pid))):
                shutil.rmtree(path, ignore_errors=True)
                log.info("removed the incomplete checkpoint %s", path)
        elif entry.endswith(_OLD_TAG):
            final = os.path.join(directory, entry[1:-len(_OLD_TAG)])
            if os.path.lexists(final):
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            else:
                os.rename(path, final)
                log.info("restored %s (its replacement was not completed)", final)


def _commit(tmp: str, final: str) -> None:
    """Rename the complete ``tmp`` to ``final`` (an older ``final`` moved aside first, removed after)."""
    parent, name = os.path.split(final)
    old = os.path.join(parent, f".{name}{_OLD_TAG}")
    if os.path.lexists(final):
        if os.path.lexists(old):
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(parent)
    if os.path.lexists(old):
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)


def verify_checkpoint(path: str) -> Metadata:
    """Read ``path``'s DCP metadata and check every file it indexes exists and holds its bytes.

    Raises:
        RuntimeError: not a complete sharded checkpoint; a missing or truncated shard file, named with its size
            and the size its index needs.
    """
    if not is_sharded_checkpoint(path):
        raise RuntimeError(f"{path} is not a complete sharded checkpoint directory (no {METADATA_FILE}): a save "
                           "that did not finish leaves none; load an earlier checkpoint")
    metadata = FileSystemReader(path).read_metadata()
    need: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        file = os.path.join(path, rel)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated: it holds {have} bytes, its index needs {size}"
            raise RuntimeError(f"checkpoint {path} is damaged: shard file {file} {what}. The checkpoint cannot be "
                               "loaded; load an earlier one")
    return metadata


class ShardedCheckpointIO:
    """Writes and reads sharded checkpoint directories (see the module docstring). Collective: every rank calls
    :meth:`save`, :meth:`load` and :meth:`wait` together; :meth:`remove_checkpoint` is rank 0's.

    Args:
        async_save: write in the background (``dcp.async_save``) over ``async_group``.
        async_group: a process group with a CPU (gloo) backend over all ranks, used only by background saves.
    """

    def __init__(self, async_save: bool = False, async_group: Optional[dist.ProcessGroup] = None) -> None:
        if async_save and async_group is None:
            raise ValueError("ShardedCheckpointIO(async_save=True) needs async_group: a gloo group over all ranks")
        self.async_save, self.async_group = async_save, async_group
        self._pending: Optional[threading.Thread] = None
        self._pending_error: List[BaseException] = []
        self._deferred_removals: List[Callable[[], None]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @staticmethod
    def _barrier() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def _agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (world group)."""
        if not (dist.is_available() and dist.is_initialized()):
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ------------------------------------------------------------------ save
    def save(self, state: Dict[str, Any], path: str) -> None:
        """Write ``state`` (DCP entries: tensors, :class:`~lightning_megatron.checkpoint.sharded_state.ShardedEntry`,
        DTensors, picklable values) to directory ``path``; with ``async_save`` return once the background write
        has started (``state`` must then be a host copy)."""
        self.wait()
        final = os.path.abspath(str(path))
        parent, name = os.path.split(final)
        tmp = None
        if self._rank() == 0:
            os.makedirs(parent, exist_ok=True)
            clean_leftovers(parent)
            tmp = os.path.join(parent, f".{name}{_TMP_TAG}{os.getpid()}")
            os.makedirs(tmp)
        tmp = self._agree(tmp)
        writer = FileSystemWriter(tmp, sync_files=True)
        planner = _SavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True)
        if not self.async_save:
            dcp.save(state, storage_writer=writer, planner=planner)
            if self._rank() == 0:
                _commit(tmp, final)
            self._barrier()
            return
        future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=self.async_group,
                                async_stager=_Staged())
        self._pending = threading.Thread(target=self._finish, args=(future, tmp, final),
                                         name=f"checkpoint-commit-{name}", daemon=True)
        self._pending.start()

    def _finish(self, future: Future, tmp: str, final: str) -> None:
        try:
            future.result()
            if self._rank() == 0:
                _commit(tmp, final)
                log.info("checkpoint %s complete", final)
        except BaseException as e:  # noqa: BLE001 - raised again by wait() in the training thread
            self._pending_error.append(e)
        finally:
            with self._lock:
                removals, self._deferred_removals = self._deferred_removals, []
            for remove in removals:
                remove()

    def wait(self) -> None:
        """Wait for a background save to complete (and be renamed into place); raise its error if it failed."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error:
            error = self._pending_error.pop()
            self._pending_error.clear()
            raise RuntimeError(f"the background checkpoint save failed: {error!r}") from error

    @property
    def pending(self) -> bool:
        """Whether a background save is still running."""
        return self._pending is not None and self._pending.is_alive()

    def remove_checkpoint(self, path: str) -> None:
        """Remove checkpoint ``path`` (a directory or file); while a background save runs, after it completes."""
        def remove() -> None:
            target = str(path)
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.lexists(target):
                os.remove(target)

        with self._lock:
            if self.pending:
                self._deferred_removals.append(remove)
                return
        remove()

    # ------------------------------------------------------------------ load
    def metadata(self, path: str) -> Metadata:
        """The checkpoint's DCP metadata, after :func:`verify_checkpoint` (every rank reads and checks it)."""
        self.wait()
        final = os.path.abspath(str(path))
        if self._rank() == 0:
            clean_leftovers(os.path.dirname(final))
        self._barrier()
        return verify_checkpoint(final)

    def load(self, state: Dict[str, Any], path: str) -> None:
        """Fill ``state`` (load targets; pickled values are set into it) from directory ``path``."""
        dcp.load(state, storage_reader=FileSystemReader(os.path.abspath(str(path))),
                 planner=_SafeLoadPlanner(flatten_state_dict=False, allow_partial_load=True))


# ---------------------------------------------------------------------------------------------- Lightning checkpoints
class ShardedModelState(dict):
    """This rank's model state read from a sharded checkpoint (already in the current layout)."""


def rng_state(device: torch.device, tp_rng: Any = None) -> Dict[str, Any]:
    """This process's RNG states: torch (and CUDA on ``device``), Python's, the tensor-parallel stream's."""
    import random

    version, words, gauss = random.getstate()
    out: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(words), "python_version": version,
                           "python_gauss": gauss}
    if device.type == "cuda" and torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state(device)
    if tp_rng is not None:
        out["tensor_parallel"] = tp_rng._get_state().cpu()
    return out


def set_rng_state(state: Dict[str, Any], device: torch.device, tp_rng: Any = None) -> None:
    """Restore what :func:`rng_state` returned."""
    import random

    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "tensor_parallel" in state and tp_rng is not None:
        tp_rng._set_state(state["tensor_parallel"])


def save_sharded(io: ShardedCheckpointIO, checkpoint: Dict[str, Any], path: str, rank: int,
                 layout: Dict[str, int], device: torch.device, tp_rng: Any = None) -> None:
    """Write Lightning's ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` already DCP entries, from
    :mod:`lightning_megatron.checkpoint.sharded_state`) as sharded directory ``path``: the rest (loops, LR
    schedulers, callbacks, data position, optimizer hyper-parameters, ``layout``) once, this rank's RNG states
    under ``rng.<rank>``. Collective."""
    rest = dict(checkpoint)
    state: Dict[str, Any] = dict(rest.pop("state_dict", {}))
    hyper = []
    for entries, groups in rest.pop("optimizer_states", []):
        state.update(entries)
        hyper.append(groups)
    rest["optimizer_param_groups"] = hyper
    rest["megatron_layout"] = layout
    state["lightning"] = rest
    state[f"rng.{rank}"] = rng_state(device, tp_rng)
    io.save(state, path)


def check_keys(module_name: str, local: List[str], saved: List[str], strict: bool) -> None:
    """Missing and unexpected model keys over every rank's keys (one ``all_gather_object`` of names, so that all
    ranks raise together), in torch's wording. Collective over the world."""
    keys = set(local)
    if dist.is_available() and dist.is_initialized():
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        keys = {k for part in gathered for k in part}
    if not strict:
        return
    saved_set = set(saved)
    missing = sorted(k for k in keys if k not in saved_set)
    unexpected = sorted(k for k in saved_set if k not in keys)
    errors = []
    if missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {module_name}:\n\t" + "\n\t".join(errors)
                           + "\nThe checkpoint is of a model of another shape; build the model it was saved from, "
                           "or load the common keys with strict_loading=False")


def load_sharded(io: ShardedCheckpointIO, path: str, module: Any, optimizers: List[Any], rank: int,
                 layout: Dict[str, int], device: torch.device, tp_rng: Any = None) -> Dict[str, Any]:
    """Read sharded directory ``path`` for this rank: a Lightning checkpoint dict whose ``state_dict`` is a
    :class:`ShardedModelState` (this rank's tensors in the current layout) and whose ``optimizer_states`` are
    ``(LoadedOptimizerState, read values)`` for :func:`~lightning_megatron.checkpoint.sharded_state.
    apply_optimizer_state` (``optimizers``: empty when not fitting). Strictness follows ``module.strict_loading``;
    the RNG states come back when ``layout`` is the one that saved. Collective over the world."""
    from lightning_megatron.checkpoint.sharded_state import (
        ShardLayout,
        model_targets,
        optimizer_targets,
        saved_model_keys,
    )

    saved = io.metadata(path)
    shards = ShardLayout(module)
    local = module.state_dict()
    check_keys(type(module).__name__, list(local), saved_model_keys(saved), getattr(module, "strict_loading", True))
    state, tensors = model_targets(local, shards, saved)
    loaded = []
    for i, optimizer in enumerate(optimizers):
        targets, entry = optimizer_targets(i, optimizer, shards, saved, [])
        state.update(targets)
        loaded.append(entry)
    state["lightning"] = None
    rng_key = f"rng.{rank}"
    if rng_key in saved.state_dict_metadata:
        state[rng_key] = None
    io.load(state, path)
    checkpoint = dict(state["lightning"])
    if state.get(rng_key) is not None and checkpoint.get("megatron_layout") == layout:
        set_rng_state(state[rng_key], device, tp_rng)
    checkpoint["state_dict"] = ShardedModelState(
        {k: tensors.get(k, state.get("state_dict." + k)) for k in local if "state_dict." + k in saved.state_dict_metadata})
    if loaded and checkpoint.get("optimizer_param_groups"):
        for entry, hyper in zip(loaded, checkpoint["optimizer_param_groups"]):
            entry.hyper = hyper
        checkpoint["optimizer_states"] = [(entry, state) for entry in loaded]
    return checkpoint
