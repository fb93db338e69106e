"""Megatron-LM's GPT dataset, dataset blending and train/valid/test splits, on numpy.

:class:`GPTDataset` turns the documents of an :class:`~lightning_megatron.data.IndexedDataset`
into fixed-length samples with Megatron-LM's three indices (same algorithms, same random
stream, so the same seed and sizes give the same samples as Megatron-LM's ``GPTDataset``):

* **document index** ``[num_epochs * num_docs]`` (int32): the documents of the split,
  repeated once per epoch and shuffled with ``numpy.random.RandomState(seed)``. When the
  last epoch is needed for less than 80% of an epoch's samples, it is shuffled separately
  (appended after the others) so that its partial use is still a uniform sample.
* **sample index** ``[num_samples + 1, 2]``: for sample ``i``, row ``i`` is the
  (position in the document index, token offset in that document) where the sample
  starts and row ``i + 1`` where it ends. Samples tile the concatenated documents:
  sample ``i`` covers stream tokens ``[i*s, i*s + s]`` (``s + 1`` tokens, the last one shared
  with the next sample); a trailing partial sample is dropped.
* **shuffle index** ``[num_samples]`` (uint32/int64): a permutation of the samples (the
  separately shuffled last epoch is permuted on its own, after the others).

The indices are cached beside the data as ``.npy`` files named with the md5 of their
parameters and reused on the next run. The parameters include an md5 of the split's sequence
lengths (read from the ``.idx``), the only content the indices depend on: re-preprocessed data
with other lengths (the same documents in another order, say) gets new indices, never stale ones. :class:`BlendedDataset` mixes datasets with
Megatron's greedy error-minimising schedule; :func:`split_ranges` is Megatron's split rule.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_megatron.data._io import atomic_write
from lightning_megatron.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

__all__ = [
    "SPLIT_NAMES",
    "BlendedDataset",
    "GPTDataset",
    "blend_sizes",
    "build_blending_indices",
    "build_document_index",
    "build_sample_index",
    "build_shuffle_index",
    "check_eod_options",
    "document_ids_after_eod",
    "positions_in_documents",
    "parse_data_path",
    "parse_split",
    "split_ranges",
]

log = logging.getLogger(__name__)

#: Split names in Megatron's order.
SPLIT_NAMES: tuple[str, str, str] = ("train", "valid", "test")
# Megatron builds each blended component this much larger than its share (mid_level_dataset_surplus).
_BLEND_SURPLUS = 0.005
# A last epoch needed for fewer than this fraction of an epoch's samples is shuffled on its own.
_SEPARATE_LAST_EPOCH_THRESHOLD = 0.80
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


# ============================================================================ splits
def parse_split(split: str | Sequence[float]) -> list[float]:
    """Megatron's split parsing: numbers of ``"969,30,1"`` (or a sequence), padded with zeros
    to three, normalised to sum 1.

    Raises:
        ValueError: more than three parts, a negative part, or all zero.
    """
    if isinstance(split, str):
        parts = [float(x) for x in re.findall(r"[-.0-9]+", split)]
    else:
        parts = [float(x) for x in split]
    if len(parts) > 3:
        raise ValueError(f"split {split!r} has {len(parts)} parts; give at most three (train,valid,test)")
    if any(p < 0 for p in parts):
        raise ValueError(f"split {split!r} has a negative part")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    if total <= 0:
        raise ValueError(f"split {split!r} is all zero")
    return [p / total for p in parts]


def split_ranges(split: str | Sequence[float], num_elements: int) -> list[tuple[int, int] | None]:
    """Element (sequence) ranges ``[begin, end)`` of train/valid/test, Megatron's rule.

    The normalised split weights are accumulated into book-ends ``0 = b0 <= b1 <= b2 <= b3 = 1``;
    split ``k`` is ``[round(b_k * n), round(b_{k+1} * n))``, or ``None`` when its weight is 0.
    E.g. ``"969,30,1"`` over 1000 documents gives ``(0, 969), (969, 999), (999, 1000)``.
    """
    weights = parse_split(split)
    bookends = [0.0]
    for w in weights:
        bookends.append(bookends[-1] + w)
    ranges: list[tuple[int, int] | None] = []
    for k in range(3):
        if weights[k] == 0:
            ranges.append(None)
            continue
        begin = int(round(bookends[k] * float(num_elements)))
        end = int(round(bookends[k + 1] * float(num_elements)))
        ranges.append((begin, min(end, num_elements)))
    return ranges


# ============================================================================ data paths / blending
def parse_data_path(data_path: str | os.PathLike[str] | Sequence[Any]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path``: a prefix, a list of prefixes, or ``[w1, p1, w2, p2, ...]``.

    Returns the prefixes and the normalised weights (``None`` when no weights were given).
    Weights may be numbers or numeric strings. A trailing ``.bin``/``.idx`` is stripped.
    """
    if isinstance(data_path, (str, os.PathLike)):
        items: list[Any] = [data_path]
    else:
        items = list(data_path)
    if not items:
        raise ValueError("data_path is empty")

    def as_weight(x: Any) -> float | None:
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        try:
            return float(str(x))
        except ValueError:
            return None

    weights: list[float] | None = None
    prefixes: list[Any] = items
    if len(items) % 2 == 0:
        candidate = [as_weight(x) for x in items[0::2]]
        if all(w is not None for w in candidate):
            weights = [float(w) for w in candidate if w is not None]
            prefixes = items[1::2]
        elif any(isinstance(x, (int, float)) for x in items[0::2]):
            raise ValueError(f"data_path {data_path!r}: mix of weights and prefixes is not [w1, p1, w2, p2, ...]")
    out = []
    for p in prefixes:
        if isinstance(p, (int, float)) and not isinstance(p, bool):
            raise ValueError(f"data_path {data_path!r}: expected [w1, p1, w2, p2, ...] or prefixes, got {p!r}")
        text = os.fspath(p).strip()
        for suffix in (".bin", ".idx"):
            if text.endswith(suffix):
                text = text[: -len(suffix)]
        out.append(text)
    if weights is not None:
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"data_path weights must be >= 0 and not all zero, got {weights}")
        total = sum(weights)
        weights = [w / total for w in weights]
    return out, weights


def blend_sizes(weights: Sequence[float], size: int) -> tuple[list[int], list[int]]:
    """Megatron's sizes for a blend of ``size`` samples.

    Returns ``(target, build)``: ``target[i] = ceil(size * w_i)`` samples are planned from
    dataset ``i`` (the blended dataset has ``sum(target)`` samples) and
    ``build[i] = ceil(target[i] * 1.005)`` are built, a 0.5% surplus.
    """
    target = [int(math.ceil(size * w)) for w in weights]
    build = [int(math.ceil(t * (1 + _BLEND_SURPLUS))) for t in target]
    return target, build


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending schedule.

    For each blended sample ``n`` it picks the dataset whose share is furthest behind its
    weight, ``argmax_i (w_i * max(n, 1) - count_i)`` (ties to the lowest index), so after any
    prefix of ``n`` samples dataset ``i`` has contributed ``w_i * n`` samples to within one.

    Returns:
        ``dataset_index`` (int16 ``[size]``, which dataset) and ``dataset_sample_index``
        (int64 ``[size]``, which sample of that dataset: its running count).
    """
    w = [float(x) for x in weights]
    k = len(w)
    if k == 0:
        raise ValueError("need at least one dataset to blend")
    if k > np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended, got {k}")
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * k
    if k == 1:
        dataset_index[:] = 0
        sample_index[:] = np.arange(size)
        return dataset_index, sample_index
    chosen = [0] * size
    taken = [0] * size
    rng_k = range(1, k)
    for n in range(size):
        nd = float(n) if n > 1 else 1.0
        best = 0
        best_err = w[0] * nd - counts[0]
        for i in rng_k:
            err = w[i] * nd - counts[i]
            if err > best_err:
                best, best_err = i, err
        chosen[n] = best
        taken[n] = counts[best]
        counts[best] += 1
    dataset_index[:] = chosen
    sample_index[:] = taken
    return dataset_index, sample_index


# ============================================================================ the three GPT indices
def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last_epoch: bool
) -> np.ndarray:
    """The documents repeated ``num_epochs`` times and shuffled (int32).

    With ``separate_last_epoch`` the first ``num_epochs - 1`` epochs are shuffled together
    and the last one on its own, appended after them (same random stream as Megatron).
    """
    if not separate_last_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """The ``[num_samples + 1, 2]`` sample index (Megatron's ``build_sample_idx``, trailing partial dropped).

    ``num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length``; row ``i`` is the
    (document-index position, offset) of stream token ``i * seq_length``, where the stream
    is the documents concatenated in document-index order. Vectorised: a binary search of
    each boundary in the cumulative document lengths.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[doc_pos] - lengths[doc_pos])
    big = max(len(document_index), int(lengths.max(initial=0))) >= np.iinfo(np.int32).max
    out = np.empty((num_samples + 1, 2), dtype=np.int64 if big else np.int32)
    out[:, 0] = doc_pos
    out[:, 1] = offsets
    out[0] = 0  # Megatron always starts at (0, 0), even when the first document is empty
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``arange(num_samples)`` shuffled, then ``arange(num_samples, total_size)`` shuffled on its own."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


# ============================================================================ packed documents
def check_eod_options(eod_id: int | None, **flags: bool) -> None:
    """Raise ValueError when one of the eod-based options (``eod_mask_loss``, ``reset_position_ids``,
    ``reset_attention_mask``) is on without ``eod_id``."""
    on = [name for name, value in flags.items() if value]
    if on and eod_id is None:
        raise ValueError(f"{', '.join(f'{name}=True' for name in on)} needs eod_id (the end-of-document token id)")


def document_ids_after_eod(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Document index of every position of ``tokens`` ``[..., s]``: the number of eod tokens *before* it in its row
    (int64, same shape), Megatron's rule: the eod token closes its document and the next token opens a new one."""
    eod = (tokens == eod_id).long()
    return eod.cumsum(-1) - eod


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document, ``[..., s]`` int64: ``arange(s)`` restarting at 0 wherever
    ``document_ids`` (``[..., s]``, equal ids contiguous) changes (Megatron's ``--reset-position-ids``)."""
    s = document_ids.shape[-1]
    index = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - start_index


# ============================================================================ GPTDataset
class GPTDataset(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length GPT samples from the documents of an indexed dataset, Megatron-LM's way.

    Item ``i`` is a dict of ``tokens`` (``LongTensor[s]``), ``labels`` (``LongTensor[s]``, the
    tokens shifted left by one), ``loss_mask`` (``FloatTensor[s]``, ones; with
    ``eod_mask_loss`` zero where the *input* token is the eod id, as in Megatron) and
    ``position_ids`` (``arange(s)``; with ``reset_position_ids`` restarting at 0 after every eod input
    token, as Megatron's ``--reset-position-ids``), where ``s = seq_length``; with ``reset_attention_mask``
    also ``document_ids`` (``LongTensor[s]``: the number of eod input tokens before each position, so a token
    after an eod starts a new document and attends only to its own document, Megatron's
    ``--reset-attention-mask``; see :func:`document_ids_after_eod`). It is read from
    ``seq_length + 1`` consecutive tokens of the shuffled document stream (see the module
    docstring for the indices).

    ``len(dataset)`` is the number of samples in the epochs built, at least ``num_samples``
    (``num_samples=None`` builds one epoch), as in Megatron.

    Args:
        indexed: the :class:`IndexedDataset` or its path prefix.
        seq_length: tokens per sample (``>= 1``).
        num_samples: samples wanted; enough epochs are built to provide them.
        seed: seed of the document and sample shuffles.
        document_range: sequences ``[begin, end)`` of ``indexed`` to use (a split); all by default.
        split_name: ``"train"``/``"valid"``/``"test"``, only used in cache names and messages.
        cache_dir: where the indices are cached; default ``<data dir>/cache/GPTDataset_indices``;
            ``False`` disables caching. A directory that cannot be written only warns.
        eod_mask_loss: zero the loss mask on eod input tokens (Megatron's ``--eod-mask-loss``).
        eod_id: the eod token id (needed for ``eod_mask_loss``, ``reset_position_ids`` and
            ``reset_attention_mask``).
        reset_position_ids: positions restart at 0 after each eod input token
            (Megatron's ``--reset-position-ids``).
        reset_attention_mask: items carry ``document_ids``; the model then lets a token attend only
            to the earlier tokens of its own document (Megatron's ``--reset-attention-mask``).

    Raises:
        ValueError: empty range, or too few tokens for one sample.
    """

    def __init__(
        self,
        indexed: IndexedDataset | str | os.PathLike[str],
        seq_length: int,
        num_samples: int | None,
        seed: int = 1234,
        document_range: tuple[int, int] | None = None,
        split_name: str = "train",
        cache_dir: str | os.PathLike[str] | bool | None = None,
        eod_mask_loss: bool = False,
        eod_id: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
    ) -> None:
        self.indexed = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 or None, got {num_samples}")
        check_eod_options(eod_id, eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                          reset_attention_mask=reset_attention_mask)
        begin, end = document_range if document_range is not None else (0, len(self.indexed))
        if not 0 <= begin <= end <= len(self.indexed):
            raise ValueError(f"document_range ({begin}, {end}) is outside the {len(self.indexed)} sequences")
        self.seq_length = int(seq_length)
        self.num_samples = None if num_samples is None else int(num_samples)
        self.seed = int(seed)
        self.document_range = (int(begin), int(end))
        self.split_name = split_name
        self.eod_mask_loss = eod_mask_loss
        self.eod_id = eod_id
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.documents = np.arange(begin, end, dtype=np.int32)
        self.tokens_per_epoch = int(np.asarray(self.indexed.sequence_lengths[begin:end], dtype=np.int64).sum())
        if end == begin:
            raise ValueError(
                f"{split_name} split of {self.indexed.prefix} is empty (sequences [{begin}, {end})); "
                "adjust split or add data"
            )
        if self.tokens_per_epoch < self.seq_length + 1:
            raise ValueError(
                f"{split_name} split of {self.indexed.prefix} has {self.tokens_per_epoch} tokens in "
                f"{end - begin} documents, fewer than the seq_length + 1 = {self.seq_length + 1} of one sample"
            )
        self.description = self._description()
        self.description_hash = hashlib.md5(self.description.encode("utf-8")).hexdigest()
        self.cache_dir = self._resolve_cache_dir(cache_dir)
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build()
        self._position_ids = torch.arange(self.seq_length, dtype=torch.long)

    # ------------------------------------------------------------------ description / cache
    def _description(self) -> str:
        idx_path = index_file_path(self.indexed.prefix)
        begin, end = self.document_range
        lengths = np.ascontiguousarray(self.indexed.sequence_lengths[begin:end])
        params = {
            "class": type(self).__name__,
            "dataset_path": os.path.realpath(self.indexed.prefix),
            "idx_bytes": os.path.getsize(idx_path),
            "bin_bytes": os.path.getsize(data_file_path(self.indexed.prefix)),
            "num_sequences": len(self.indexed),
            "sequence_lengths_md5": hashlib.md5(memoryview(lengths).cast("B")).hexdigest(),
            "document_range": list(self.document_range),
            "split": self.split_name,
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "random_seed": self.seed,
            "add_extra_token_to_sequence": True,
            "index_version": 2,
        }
        return json.dumps(params, indent=4, sort_keys=True)

    def _resolve_cache_dir(self, cache_dir: str | os.PathLike[str] | bool | None) -> Path | None:
        if cache_dir is False:
            return None
        if cache_dir is None or cache_dir is True:
            return Path(self.indexed.prefix).resolve().parent / "cache" / "GPTDataset_indices"
        return Path(cache_dir)

    def cache_paths(self) -> dict[str, Path] | None:
        """Paths of the cached description and indices (``None`` without a cache dir)."""
        if self.cache_dir is None:
            return None
        base = f"{self.description_hash}-{type(self).__name__}-{self.split_name}"
        return {
            name: self.cache_dir / f"{base}-{name}.{ext}"
            for name, ext in (
                ("description", "txt"),
                ("document_index", "npy"),
                ("sample_index", "npy"),
                ("shuffle_index", "npy"),
            )
        }

    def _load_or_build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        paths = self.cache_paths()
        names = _INDEX_NAMES
        if paths is not None and all(paths[n].is_file() for n in names):
            try:
                loaded = tuple(np.load(paths[n], mmap_mode="r", allow_pickle=False) for n in names)
                self.built_anew = False
                return loaded  # type: ignore[return-value]
            except (OSError, ValueError) as err:  # corrupt cache: rebuild it
                log.warning("rebuilding unreadable GPTDataset index cache %s: %s", paths["sample_index"], err)
        indices = self._build()
        self.built_anew = True
        if paths is not None:
            try:
                for name, array in zip(names, indices):
                    atomic_write(paths[name], lambda f, a=array: np.save(f, a, allow_pickle=False))
                atomic_write(paths["description"], lambda f: f.write(self.description.encode("utf-8")))
            except OSError as err:
                warnings.warn(
                    f"could not cache the GPTDataset indices in {self.cache_dir} ({err}); they are rebuilt next time. "
                    "Pass cache_dir= a writable directory to cache them.",
                    stacklevel=3,
                )
        return indices

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, tokens = self.seq_length, self.tokens_per_epoch
        num_epochs = 1
        if self.num_samples is not None:
            needed = self.num_samples * s + 1
            num_epochs = max(1, -(-needed // tokens))
        separate_last = False
        if num_epochs > 1:
            samples_before_last = ((num_epochs - 1) * tokens - 1) // s
            samples_from_last = self.num_samples - samples_before_last  # type: ignore[operator]
            samples_per_epoch = (tokens - 1) // s
            separate_last = samples_from_last < int(_SEPARATE_LAST_EPOCH_THRESHOLD * samples_per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.documents, num_epochs, rng, separate_last)
        sample_index = build_sample_index(self.indexed.sequence_lengths, document_index, s, num_epochs, tokens)
        total = sample_index.shape[0] - 1
        if separate_last:
            shuffle_index = build_shuffle_index(samples_before_last, total, rng)
        else:
            shuffle_index = build_shuffle_index(total, total, rng)
        self.num_epochs = num_epochs
        return document_index, sample_index, shuffle_index

    def __getstate__(self) -> dict[str, Any]:
        # For spawned DataLoader workers: send cache paths instead of copying memory-mapped indices.
        state = self.__dict__.copy()
        paths = self.cache_paths()
        if paths is not None and all(isinstance(state[n], np.memmap) for n in _INDEX_NAMES):
            for n in _INDEX_NAMES:
                state[n] = str(paths[n])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for n in _INDEX_NAMES:
            if isinstance(state[n], str):
                state[n] = np.load(state[n], mmap_mode="r", allow_pickle=False)
        self.__dict__.update(state)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def sample_tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``index`` (int64), before splitting into inputs/labels."""
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        i = int(self.shuffle_index[index])
        doc_beg, off_beg = (int(x) for x in self.sample_index[i])
        doc_end, off_end = (int(x) for x in self.sample_index[i + 1])
        if doc_beg == doc_end:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1)]
        else:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg)]
            parts += [self.indexed.get(int(self.document_index[d])) for d in range(doc_beg + 1, doc_end)]
            parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.sample_tokens(int(index)))
        tokens = text[:-1].contiguous()
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens == self.eod_id] = 0.0
        item = {
            "tokens": tokens,
            "labels": text[1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": self._position_ids.clone(),
        }
        if self.reset_position_ids or self.reset_attention_mask:
            documents = document_ids_after_eod(tokens, self.eod_id)
            if self.reset_position_ids:
                item["position_ids"] = positions_in_documents(documents)
            if self.reset_attention_mask:
                item["document_ids"] = documents
        return item

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.indexed.prefix!r}, split={self.split_name}, documents={self.document_range}, "
            f"seq_length={self.seq_length}, samples={len(self)})"
        )


# ============================================================================ BlendedDataset
class BlendedDataset(Dataset[dict[str, torch.Tensor]]):
    """Mix of datasets in fixed proportions, Megatron's way.

    Sample ``n`` is sample ``dataset_sample_index[n]`` of dataset ``dataset_index[n]`` from
    :func:`build_blending_indices`; over any prefix of the blend each dataset's share is
    within one sample of its weight.

    Args:
        datasets: the components.
        weights: their weights (normalised here).
        size: number of blended samples.

    Raises:
        ValueError: weights/datasets mismatch, or a component too small for its share.
    """

    def __init__(self, datasets: Sequence[Dataset[Any]], weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        total = float(sum(weights))
        if total <= 0 or any(w < 0 for w in weights):
            raise ValueError(f"weights must be >= 0 and not all zero, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        for i, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == i]
            need = int(used.max()) + 1 if used.size else 0
            if need > len(ds):  # type: ignore[arg-type]
                raise ValueError(
                    f"blended dataset {i} ({ds!r}) has {len(ds)} samples but its weight "  # type: ignore[arg-type]
                    f"{self.weights[i]:.4f} of {self.size} needs {need}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]

    def __repr__(self) -> str:
        return f"BlendedDataset(datasets={len(self.datasets)}, weights={self.weights}, size={self.size})"
