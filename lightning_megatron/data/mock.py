"""``MockGPTDataModule``: random tokens, for runs that measure or smoke-test without a dataset
(Megatron's ``--mock-data``)."""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["MockGPTDataModule", "MockGPTDataset"]


class MockGPTDataset(Dataset):
    """``num_samples`` sequences of ``seq_length + 1`` uniformly random ids in ``[0, vocab_size)``.

    Sample ``i`` depends only on ``(seed, i)`` (its own ``torch.Generator``), so every rank and every run reads
    the same sample for the same index, whichever sampler picks it. Items: ``tokens`` and ``labels``
    (``LongTensor[seq_length]``, the labels shifted left by one) and ``position_ids`` (``arange``); no loss mask,
    every token counts.
    """

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 1234) -> None:
        for name, value in (("vocab_size", vocab_size), ("seq_length", seq_length), ("num_samples", num_samples)):
            if value < 1:
                raise ValueError(f"MockGPTDataset: {name}={value} must be >= 1")
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} outside [0, {self.num_samples})")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=gen)
        return {"tokens": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(self.seq_length)}


class MockGPTDataModule(L.LightningDataModule):
    """Random-token train / validation sets (:class:`MockGPTDataset`) for a run without data files.

    The loss cannot fall below ``ln(vocab_size)`` on such data: it measures speed and memory, or checks that a
    configuration starts. Under distributed training Lightning gives each data-parallel rank its share through
    the strategy's sampler arguments (tensor / pipeline / context-parallel peers read the same samples).

    Args:
        vocab_size: ids are drawn from ``[0, vocab_size)`` (at most the model's vocabulary).
        seq_length: tokens per sample.
        micro_batch_size: samples per batch of each data-parallel rank.
        num_train_samples, num_val_samples: sizes of the two sets (the validation set uses other seeds).
        seed: the samples' seed.
        num_workers: DataLoader worker processes.
    """

    def __init__(self, vocab_size: int, seq_length: int = 128, micro_batch_size: int = 8,
                 num_train_samples: int = 100_000, num_val_samples: int = 1_000, seed: int = 1234,
                 num_workers: int = 0) -> None:
        super().__init__()
        if micro_batch_size < 1 or num_workers < 0:
            raise ValueError(f"MockGPTDataModule: micro_batch_size={micro_batch_size} must be >= 1 and "
                             f"num_workers={num_workers} >= 0")
        self.save_hyperparameters()
        self.train_dataset = MockGPTDataset(vocab_size, seq_length, num_train_samples, seed)
        self.val_dataset = MockGPTDataset(vocab_size, seq_length, num_val_samples, seed + 1)
        self.micro_batch_size, self.num_workers = micro_batch_size, num_workers

    @property
    def vocab_size(self) -> int:
        """The ids' upper bound."""
        return self.train_dataset.vocab_size

    def _loader(self, dataset: MockGPTDataset) -> DataLoader:
        return DataLoader(dataset, batch_size=self.micro_batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        """Batches ``{"tokens", "labels", "position_ids"}`` of ``[micro_batch_size, seq_length]``."""
        return self._loader(self.train_dataset)

    def val_dataloader(self) -> DataLoader:
        """Validation batches, as :meth:`train_dataloader`."""
        return self._loader(self.val_dataset)
