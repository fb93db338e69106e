"""The shipped text corpus and a map-style dataset of fixed-length training windows."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["DEFAULT_CORPUS_DIR", "TokenizedCorpusDataset", "corpus_files", "read_corpus"]

#: Directory of the shipped corpus (see ``corpus/SOURCE.md`` for its origin and licence).
DEFAULT_CORPUS_DIR: Path = Path(__file__).resolve().parent / "corpus"


def corpus_files(corpus_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Return the ``*.txt`` documents of ``corpus_dir`` (default: the shipped corpus), sorted by name."""
    directory = Path(corpus_dir) if corpus_dir is not None else DEFAULT_CORPUS_DIR
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in corpus directory {directory}")
    return files


def read_corpus(corpus_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Return the documents of ``corpus_dir`` (default: the shipped corpus) as strings, in file-name order."""
    return [f.read_text(encoding="utf-8") for f in corpus_files(corpus_dir)]


class TokenizedCorpusDataset(Dataset[dict[str, torch.Tensor]]):
    """Next-token-prediction samples cut from one long token stream.

    Sample ``i`` reads the ``seq_length + 1`` tokens ``stream[i*s : i*s + s + 1]``
    (``s = seq_length``): its inputs are the first ``s`` of them and its labels the last
    ``s``. The input windows tile the stream without overlap (Megatron's GPT-dataset
    convention), so the last label of sample ``i`` is the first input of sample ``i+1``
    and every token after the first is predicted exactly once. There are
    ``(len(tokens) - 1) // seq_length`` samples; a leftover tail is dropped.

    Each item is a dict of

    * ``tokens``: ``LongTensor[s]``, the inputs,
    * ``labels``: ``LongTensor[s]``, the inputs shifted left by one,
    * ``loss_mask``: ``FloatTensor[s]`` of ones,
    * ``position_ids``: ``LongTensor[s]`` equal to ``arange(s)``.

    Args:
        tokens: the token stream, a 1-D integer tensor (kept as int64).
        seq_length: tokens per sample, at least 1.

    Raises:
        ValueError: if ``tokens`` is not 1-D/integer, ``seq_length < 1``, or the stream
            is shorter than the ``seq_length + 1`` tokens one sample needs.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if tokens.numel() < seq_length + 1:
            raise ValueError(
                f"token stream too short: it has {tokens.numel()} tokens but one sample of "
                f"seq_length={seq_length} needs {seq_length + 1}"
            )
        self.tokens = tokens.long()
        self.seq_length = seq_length
        self._num_samples = (tokens.numel() - 1) // seq_length
        self._position_ids = torch.arange(seq_length, dtype=torch.long)
        self._loss_mask = torch.ones(seq_length, dtype=torch.float32)

    def __len__(self) -> int:
        """Number of samples, ``(len(tokens) - 1) // seq_length``."""
        return self._num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Return sample ``index`` (negative indices count from the end)."""
        if index < 0:
            index += self._num_samples
        if not 0 <= index < self._num_samples:
            raise IndexError(f"sample index out of range for a dataset of {self._num_samples} samples")
        start = index * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1]
        return {
            "tokens": window[:-1].clone(),
            "labels": window[1:].clone(),
            "loss_mask": self._loss_mask.clone(),
            "position_ids": self._position_ids.clone(),
        }
