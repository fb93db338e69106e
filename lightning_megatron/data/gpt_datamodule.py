"""``GPTDataModule``: Megatron-LM indexed datasets as a LightningDataModule, with exact resume.

Batches follow Megatron-LM's pretraining sampler: the (already shuffled) dataset is read
in order, ``global_batch_size`` samples per optimizer step, split into
``num_microbatches`` micro-batches of ``micro_batch_size`` samples on each of the
``dp`` data-parallel ranks::

    global_batch_size = micro_batch_size x dp x num_microbatches

Global micro-batch ``g`` is samples ``[g*m*dp, (g+1)*m*dp)``; data-parallel rank ``r``
takes ``[g*m*dp + r*m, g*m*dp + (r+1)*m)`` (tensor/pipeline/context-parallel peers share a
dp rank and so get identical batches). The number of samples consumed,
``optimizer steps x global_batch_size``, is saved in checkpoints and the sampler restarts
at the exact next sample on resume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_megatron.data.gpt_dataset import (
    SPLIT_NAMES,
    BlendedDataset,
    GPTDataset,
    blend_sizes,
    check_eod_options,
    parse_data_path,
    parse_split,
    split_ranges,
)
from lightning_megatron.data.indexed_dataset import IndexedDataset

__all__ = ["GPTDataModule", "MegatronDataLoader", "MegatronPretrainingSampler", "compute_num_microbatches"]


def compute_num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """``global_batch_size // (micro_batch_size * data_parallel_size)``, checking divisibility.

    Raises:
        ValueError: a size below 1, or ``global_batch_size`` not divisible by
            ``micro_batch_size * data_parallel_size`` (the message names all three numbers).
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) is not divisible by micro_batch_size ({micro_batch_size}) x "
            f"data-parallel size ({data_parallel_size}) = {per_step}; the rule is global_batch_size = "
            "micro_batch_size x data-parallel size x num_microbatches"
        )
    return global_batch_size // per_step


class MegatronPretrainingSampler(DistributedSampler):  # type: ignore[type-arg]
    """Megatron-LM's pretraining sampler: sequential, sharded by data-parallel rank, resumable.

    It is a :class:`~torch.utils.data.DistributedSampler` subclass only so that Lightning
    (``use_distributed_sampler=True``) keeps it instead of replacing it; it does not shuffle
    (the datasets are shuffled already) and yields, for each global micro-batch ``g``, the
    ``micro_batch_size`` indices of rank ``rank``: ``g*m*R + rank*m + [0, m)`` (``R`` =
    ``num_replicas``).

    One pass ("epoch") covers the first ``total_samples`` rounded down to a multiple of
    ``step_samples`` (the global batch), so every pass is a whole number of optimizer
    steps. ``len()`` is the per-rank sample count of a whole pass; the first iteration
    starts at ``consumed_samples`` modulo the pass length (a resumed pass yields only its
    remaining samples, as Lightning expects of a resumed loader), later ones at 0.

    Args:
        dataset: the dataset (only its length is used).
        total_samples: samples available per pass (``<= len(dataset)``; default all).
        micro_batch_size: samples per micro-batch per rank.
        num_replicas: data-parallel size.
        rank: data-parallel rank.
        consumed_samples: global samples already consumed (resume point).
        step_samples: samples per optimizer step (the global batch); default one global micro-batch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        total_samples: int | None,
        micro_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        consumed_samples: int = 0,
        step_samples: int | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=True)
        n = len(dataset)  # type: ignore[arg-type]
        total = n if total_samples is None else min(int(total_samples), n)
        self.micro_batch_size = int(micro_batch_size)
        self.global_micro_batch = self.micro_batch_size * self.num_replicas
        self.step_samples = int(step_samples) if step_samples is not None else self.global_micro_batch
        if self.micro_batch_size < 1 or self.step_samples % self.global_micro_batch:
            raise ValueError(
                f"step_samples ({self.step_samples}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
                f" x num_replicas ({self.num_replicas})"
            )
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.epoch_samples = (total // self.step_samples) * self.step_samples
        if self.epoch_samples == 0:
            raise ValueError(
                f"the dataset has {total} samples, fewer than one global batch of {self.step_samples}"
            )
        self.consumed_samples = int(consumed_samples)
        self._first_start = self.consumed_samples % self.epoch_samples
        # DistributedSampler's bookkeeping attributes, with this sampler's meaning.
        self.total_size = self.epoch_samples
        self.num_samples = self.epoch_samples // self.num_replicas

    def __len__(self) -> int:
        """Samples per rank in a whole pass."""
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start, self._first_start = self._first_start, 0
        m, gm = self.micro_batch_size, self.global_micro_batch
        for g in range(start // gm, self.epoch_samples // gm):
            base = g * gm + self.rank * m
            yield from range(base, base + m)


class MegatronDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader that Lightning treats as resumable.

    The resume point lives in :class:`GPTDataModule` (its ``state_dict``); this loader's own
    ``state_dict`` only reports where its sampler started, and ``load_state_dict`` ignores
    its argument (the sampler was already built at the restored position).
    """

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        start = getattr(sampler, "consumed_samples", 0)
        return {"sampler_consumed_samples_at_start": int(start)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


class GPTDataModule(L.LightningDataModule):
    """Megatron-LM pretraining data for Lightning: indexed datasets, blends, splits, exact resume.

    Args:
        data_path: a dataset prefix (``out/train_text_document``), a list of prefixes, or
            a blend ``[0.3, "a", 0.7, "b"]`` (weights normalised), as Megatron's ``--data-path``.
        seq_length: tokens per sample.
        micro_batch_size: samples per micro-batch on each data-parallel rank.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        split: train/valid/test weights over each dataset's documents (Megatron's rule, see
            :func:`~lightning_megatron.data.split_ranges`).
        seed: seed of the dataset shuffles.
        train_iters: optimizer steps to provide data for (``train_iters x global_batch_size``
            training samples); or give ``num_samples``. With neither, one epoch of the train split.
        num_samples: training samples (Megatron's ``--train-samples``), instead of ``train_iters``.
        eval_iters: global batches per validation / test run (0: no validation/test data).
        num_workers: DataLoader worker processes.
        cache_dir: where the dataset indices are cached (default beside each dataset).
        eod_mask_loss: zero the loss mask on end-of-document input tokens (needs ``eod_id``).
        eod_id: the end-of-document token id.
        reset_position_ids: positions restart at 0 after every eod input token (Megatron's
            ``--reset-position-ids``; needs ``eod_id``).
        reset_attention_mask: batches carry ``document_ids`` ``[b, s]`` and a token attends only to the earlier
            tokens of its own document (Megatron's ``--reset-attention-mask``; needs ``eod_id``; docs/data.md).
        data_parallel_size: dp assumed by :attr:`num_microbatches` *before* :meth:`setup`
            (default 1); setup reads the real one from the strategy.
        check_accumulation: in ``setup("fit")``, require ``Trainer(accumulate_grad_batches=num_microbatches)``.
        pin_memory: DataLoader ``pin_memory``; None (default): pinned when the trainer runs on CUDA, as Megatron's
            loaders are (a batch copied from pageable memory makes the host wait for every kernel queued before it,
            once per micro-batch).
    """

    def __init__(
        self,
        data_path: str | os.PathLike[str] | Sequence[Any],
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        split: str = "969,30,1",
        seed: int = 1234,
        train_iters: int | None = None,
        num_samples: int | None = None,
        eval_iters: int = 10,
        num_workers: int = 2,
        cache_dir: str | os.PathLike[str] | None = None,
        eod_mask_loss: bool = False,
        eod_id: int | None = None,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        data_parallel_size: int | None = None,
        check_accumulation: bool = True,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__()
        self.prefixes, self.weights = parse_data_path(data_path)
        parse_split(split)  # validate early
        if seq_length < 1 or micro_batch_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"seq_length ({seq_length}), micro_batch_size ({micro_batch_size}) and global_batch_size "
                f"({global_batch_size}) must be >= 1"
            )
        if train_iters is not None and num_samples is not None:
            raise ValueError(f"give train_iters ({train_iters}) or num_samples ({num_samples}), not both")
        if (train_iters is not None and train_iters < 1) or (num_samples is not None and num_samples < 1):
            raise ValueError(f"train_iters ({train_iters}) / num_samples ({num_samples}) must be >= 1")
        if eval_iters < 0 or num_workers < 0:
            raise ValueError(f"eval_iters ({eval_iters}) and num_workers ({num_workers}) must be >= 0")
        check_eod_options(eod_id, eod_mask_loss=eod_mask_loss, reset_position_ids=reset_position_ids,
                          reset_attention_mask=reset_attention_mask)
        self.data_path = data_path
        self.seq_length = int(seq_length)
        self.micro_batch_size = int(micro_batch_size)
        self.global_batch_size = int(global_batch_size)
        self.split = split
        self.seed = int(seed)
        self.train_iters = train_iters
        self.num_train_samples = num_samples if num_samples is not None else (
            train_iters * global_batch_size if train_iters is not None else None
        )
        self.eval_iters = int(eval_iters)
        self.num_workers = int(num_workers)
        self.cache_dir = cache_dir
        self.eod_mask_loss = eod_mask_loss
        self.eod_id = eod_id
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.check_accumulation = check_accumulation
        self.pin_memory = pin_memory
        self._assumed_dp = int(data_parallel_size) if data_parallel_size is not None else 1
        compute_num_microbatches(self.global_batch_size, self.micro_batch_size, self._assumed_dp)
        self.data_parallel_size: int | None = None
        self.data_parallel_rank: int | None = None
        self._num_microbatches: int | None = None
        self.datasets: dict[str, Dataset[Any] | None] = {}
        # resume bookkeeping: consumed = base + (global_step - step_base) * global_batch_size
        self._consumed_base = 0
        self._step_base: int | None = None
        self._restored = False

    # ------------------------------------------------------------------ sizes
    def num_microbatches_for(self, data_parallel_size: int) -> int:
        """Micro-batches per optimizer step at a given dp (raises if not divisible)."""
        return compute_num_microbatches(self.global_batch_size, self.micro_batch_size, data_parallel_size)

    @property
    def num_microbatches(self) -> int:
        """``global_batch_size // (micro_batch_size x dp)``; before :meth:`setup`, at ``data_parallel_size``."""
        if self._num_microbatches is not None:
            return self._num_microbatches
        return self.num_microbatches_for(self._assumed_dp)

    def num_samples_for(self, split: str) -> int | None:
        """Samples built for a split: train ``train_iters x global_batch_size`` (or ``num_samples``,
        or None = one epoch); valid/test ``eval_iters x global_batch_size`` (0 = none)."""
        if split == "train":
            return self.num_train_samples
        if split in ("valid", "test"):
            return self.eval_iters * self.global_batch_size
        raise ValueError(f"unknown split {split!r}; expected one of {SPLIT_NAMES}")

    # ------------------------------------------------------------------ datasets
    def build_dataset(self, split: str) -> Dataset[Any] | None:
        """Build (or load from the cache) the dataset of ``"train"``, ``"valid"`` or ``"test"``;
        ``None`` when the split has weight 0 or no samples are wanted."""
        num_samples = self.num_samples_for(split)
        k = SPLIT_NAMES.index(split)
        if num_samples == 0:
            return None
        if parse_split(self.split)[k] == 0:
            if split == "train":
                raise ValueError(f"split {self.split!r} gives the train split weight 0")
            return None
        common: dict[str, Any] = {
            "seq_length": self.seq_length,
            "seed": self.seed,
            "split_name": split,
            "cache_dir": self.cache_dir,
            "eod_mask_loss": self.eod_mask_loss,
            "eod_id": self.eod_id,
            "reset_position_ids": self.reset_position_ids,
            "reset_attention_mask": self.reset_attention_mask,
        }

        def component(prefix: str, n: int | None) -> GPTDataset:
            indexed = IndexedDataset(prefix)
            rng = split_ranges(self.split, len(indexed))[k]
            assert rng is not None
            return GPTDataset(indexed, num_samples=n, document_range=rng, **common)

        if len(self.prefixes) == 1:
            return component(self.prefixes[0], num_samples)
        if self.weights is not None:
            if num_samples is None:
                raise ValueError("a weighted blend needs a size: pass train_iters or num_samples")
            target, build = blend_sizes(self.weights, num_samples)
            parts = [component(p, n) for p, n in zip(self.prefixes, build)]
            return BlendedDataset(parts, self.weights, sum(target))
        # several prefixes without weights: Megatron weighs them by their (one-epoch) sizes
        parts = [component(p, None) for p in self.prefixes]
        sizes = [len(d) for d in parts]
        size = sum(sizes) if num_samples is None else min(num_samples, sum(sizes))
        return BlendedDataset(parts, sizes, size)

    def setup(self, stage: str | None = None) -> None:
        """Read dp size/rank from the strategy, check the batch arithmetic, build the datasets.

        Raises:
            ValueError: ``global_batch_size`` not divisible by ``micro_batch_size x dp``, or
                (``stage="fit"``) ``Trainer(accumulate_grad_batches=...)`` != :attr:`num_microbatches`.
        """
        trainer = self.trainer
        kwargs: dict[str, Any] = {}
        if trainer is not None:
            kwargs = dict(getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {})
        dp = int(kwargs.get("num_replicas", 1))
        rank = int(kwargs.get("rank", 0))
        self.data_parallel_size, self.data_parallel_rank = dp, rank
        self._num_microbatches = compute_num_microbatches(self.global_batch_size, self.micro_batch_size, dp)
        if stage in (None, "fit") and trainer is not None and self.check_accumulation:
            acc = int(getattr(trainer, "accumulate_grad_batches", 1))
            if acc != self._num_microbatches:
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={acc}) disagrees with GPTDataModule.num_microbatches="
                    f"{self._num_microbatches} (global_batch_size {self.global_batch_size} / (micro_batch_size "
                    f"{self.micro_batch_size} x data-parallel size {dp})); pass "
                    f"Trainer(accumulate_grad_batches={self._num_microbatches})"
                )
        wanted = {"fit": ("train", "valid"), "validate": ("valid",), "test": ("test",), "predict": ()}.get(
            stage or "", ("train", "valid", "test")
        )
        todo = [s for s in wanted if s not in self.datasets]
        if not todo:
            return
        # Build the index caches on local rank 0 first, the other ranks then load them.
        local_rank = int(getattr(trainer, "local_rank", 0)) if trainer is not None else 0
        world = int(getattr(trainer, "world_size", 1)) if trainer is not None else 1
        error: Exception | None = None
        if world > 1 and local_rank == 0:
            try:
                for s in todo:
                    self.datasets[s] = self.build_dataset(s)
            except Exception as err:  # reach the barrier anyway; the other ranks hit the same error below
                error = err
        if world > 1:
            trainer.strategy.barrier("GPTDataModule.setup")  # type: ignore[union-attr]
        if error is not None:
            raise error
        for s in todo:
            if s not in self.datasets:
                self.datasets[s] = self.build_dataset(s)

    # ------------------------------------------------------------------ resume
    @property
    def consumed_samples(self) -> int:
        """Global training samples consumed so far (optimizer steps x global batch, counting resumed ones)."""
        trainer = self.trainer
        if trainer is not None and self._step_base is not None:
            return self._consumed_base + (int(trainer.global_step) - self._step_base) * self.global_batch_size
        return self._consumed_base

    def state_dict(self) -> dict[str, Any]:
        """``{"consumed_samples": ..., "global_batch_size": ...}``, saved by Lightning in checkpoints."""
        return {"consumed_samples": self.consumed_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next train dataloader starts at sample ``consumed_samples``."""
        self._consumed_base = int(state_dict["consumed_samples"])
        self._step_base = None
        self._restored = True

    # ------------------------------------------------------------------ dataloaders
    def _sampler_kwargs(self) -> tuple[int, int]:
        if self.data_parallel_size is None or self.data_parallel_rank is None:
            raise RuntimeError("GPTDataModule.setup() must be called before requesting dataloaders")
        return self.data_parallel_size, self.data_parallel_rank

    def _loader(self, split: str, consumed: int) -> MegatronDataLoader:
        dataset = self.datasets.get(split)
        if dataset is None:
            raise RuntimeError(f"no {split} dataset (eval_iters=0, split weight 0, or setup not run for it)")
        dp, rank = self._sampler_kwargs()
        total = self.num_samples_for(split)
        sampler = MegatronPretrainingSampler(
            dataset,
            total_samples=total,
            micro_batch_size=self.micro_batch_size,
            num_replicas=dp,
            rank=rank,
            consumed_samples=consumed,
            step_samples=self.global_batch_size,
        )
        return MegatronDataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self._pins_memory(),
        )

    def _pins_memory(self) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        return isinstance(device, torch.device) and device.type == "cuda"

    def train_dataloader(self) -> MegatronDataLoader:
        """Training micro-batches of this dp rank, starting after the consumed samples."""
        trainer = self.trainer
        step = int(trainer.global_step) if trainer is not None else 0
        if self._restored or self._step_base is not None:
            consumed = self.consumed_samples
        else:  # no saved data state (fresh run, or a checkpoint without one): derive it from the step
            consumed = step * self.global_batch_size
        self._consumed_base, self._step_base = consumed, step
        return self._loader("train", consumed)

    def val_dataloader(self) -> MegatronDataLoader | list[Any]:
        """``eval_iters`` global batches of the valid split (the same ones every validation run)."""
        if self.datasets.get("valid") is None:
            return []
        return self._loader("valid", 0)

    def test_dataloader(self) -> MegatronDataLoader | list[Any]:
        """``eval_iters`` global batches of the test split."""
        if self.datasets.get("test") is None:
            return []
        return self._loader("test", 0)
