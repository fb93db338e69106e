"""``TinyCorpusDataModule``: the shipped corpus, tokenised and cut into training windows."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_megatron.data._io import atomic_write
from lightning_megatron.data.corpus import TokenizedCorpusDataset, corpus_files
from lightning_megatron.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer, train_sentencepiece

__all__ = ["TinyCorpusDataModule", "default_cache_dir"]

# Bump when the tokenizer recipe or the cache layout changes, to invalidate old caches.
_CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """Return the default cache directory (pass ``cache_dir=`` / ``--data-cache-path`` to choose another).

    ``~/.cache/lightning_megatron`` when it can be created and written, else ``<system temp dir>/lightning_megatron``.
    """
    base = Path.home() / ".cache"
    candidate = base / "lightning_megatron"
    try:
        candidate.mkdir(parents=True, exist_ok=True)
        if os.access(candidate, os.W_OK):
            return candidate
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "lightning_megatron"


class TinyCorpusDataModule(L.LightningDataModule):
    """Small-data pipeline for the default example run.

    The corpus (by default the shipped one, ``lightning_megatron/data/corpus/*.txt``) is
    tokenised into one stream (each document followed by the tokenizer's eod id), the
    last ``val_fraction`` of the stream becomes the validation split, and both splits are
    cut into :class:`TokenizedCorpusDataset` windows of ``seq_length`` tokens.

    * :meth:`prepare_data` (local rank 0) trains the SentencePiece model if needed and
      writes the token stream as ``tokens.npy``, both into a cache directory keyed by a
      hash of the corpus content, tokenizer kind and vocabulary size. Files are written
      under a temporary name and renamed, so a crash never leaves a half-written file and
      concurrent writers (e.g. one per node on a shared filesystem) are harmless.
    * :meth:`setup` (every rank) loads the stream and builds the datasets. If the cache is
      missing (``prepare_data`` not run, or run on another node without a shared
      filesystem) it builds it itself; the build is deterministic, so every process ends
      up with the same tokens.
    * :attr:`vocab_size` / :attr:`tokenizer` are available before ``setup`` (they prepare
      the cache on first use), so the model config can be sized from them.

    Args:
        seq_length: tokens per sample.
        micro_batch_size: samples per batch of each data-parallel rank.
        tokenizer: ``"sentencepiece"`` (trained on the corpus) or ``"byte"`` (UTF-8 bytes).
        vocab_size: SentencePiece vocabulary size requested (ignored for ``"byte"``); the
            trained model may be smaller if the corpus is tiny, so read :attr:`vocab_size`.
        val_fraction: fraction of the token stream, taken from its end, used for validation.
        cache_dir: where the tokenizer and tokens are cached (default: :func:`default_cache_dir`).
        num_workers: DataLoader worker processes.
        corpus_dir: directory of ``*.txt`` documents (default: the shipped corpus).
    """

    def __init__(
        self,
        seq_length: int = 128,
        micro_batch_size: int = 8,
        tokenizer: Literal["sentencepiece", "byte"] = "sentencepiece",
        vocab_size: int = 2048,
        val_fraction: float = 0.05,
        cache_dir: str | os.PathLike[str] | None = None,
        num_workers: int = 0,
        corpus_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if tokenizer not in ("sentencepiece", "byte"):
            raise ValueError(f"tokenizer must be 'sentencepiece' or 'byte', got {tokenizer!r}")
        if seq_length < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_length ({seq_length}) and micro_batch_size ({micro_batch_size}) must be >= 1")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.tokenizer_kind = tokenizer
        self.requested_vocab_size = vocab_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.corpus_dir = corpus_dir
        self.cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.train_dataset: TokenizedCorpusDataset | None = None
        self.val_dataset: TokenizedCorpusDataset | None = None
        self._tokenizer: Tokenizer | None = None
        self._cache_path: Path | None = None

    # ------------------------------------------------------------------ cache layout
    @property
    def cache_path(self) -> Path:
        """Cache directory of this corpus/tokenizer combination (``<cache_dir>/<kind>-<hash>``)."""
        if self._cache_path is None:
            digest = hashlib.sha256(f"v{_CACHE_VERSION}|{self.tokenizer_kind}|".encode())
            if self.tokenizer_kind == "sentencepiece":
                digest.update(f"vocab={self.requested_vocab_size}|spm={_spm_version()}|".encode())
            for file in corpus_files(self.corpus_dir):
                data = file.read_bytes()
                digest.update(f"{file.name}|{len(data)}|".encode())
                digest.update(data)
            name = self.tokenizer_kind + (f"{self.requested_vocab_size}" if self.tokenizer_kind == "sentencepiece" else "")
            self._cache_path = self.cache_root / f"{name}-{digest.hexdigest()[:16]}"
        return self._cache_path

    @property
    def tokenizer_model_path(self) -> Path:
        """Path of the cached SentencePiece model (unused for the byte tokenizer)."""
        return self.cache_path / "spm.model"

    @property
    def tokens_path(self) -> Path:
        """Path of the cached token stream (``.npy``, uint16 or int32)."""
        return self.cache_path / "tokens.npy"

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer; on first use it is trained/loaded from the cache as needed."""
        if self._tokenizer is None:
            if self.tokenizer_kind == "byte":
                self._tokenizer = ByteTokenizer()
            else:
                if not self.tokenizer_model_path.exists():
                    self._build_cache()
                self._tokenizer = SentencePieceTokenizer(self.tokenizer_model_path)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (what the model's embedding must cover)."""
        return self.tokenizer.vocab_size

    # ------------------------------------------------------------------ Lightning hooks
    def prepare_data(self) -> None:
        """Train the tokenizer and tokenise the corpus into the cache, unless already cached."""
        if not self.tokens_path.exists():
            self._build_cache()

    def setup(self, stage: str | None = None) -> None:
        """Load the cached token stream and build the train/validation datasets (idempotent)."""
        if self.train_dataset is not None:
            return
        if not self.tokens_path.exists():
            self._build_cache()  # e.g. prepare_data was not called on this node
        tokens = torch.from_numpy(np.load(self.tokens_path).astype(np.int64))
        num_val = int(tokens.numel() * self.val_fraction)
        num_train = tokens.numel() - num_val
        self.train_dataset = self._make_dataset("train", tokens[:num_train])
        self.val_dataset = self._make_dataset("validation", tokens[num_train:])

    def train_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Shuffled batches of ``micro_batch_size`` samples, incomplete last batch dropped.

        A plain shuffling DataLoader: under distributed training Lightning replaces the
        sampler with a ``DistributedSampler`` built from the strategy's sampler kwargs.
        """
        return self._loader(self._require(self.train_dataset), shuffle=True)

    def val_dataloader(self) -> DataLoader[dict[str, torch.Tensor]]:
        """Validation batches in order; the incomplete last batch is dropped too, so every
        batch is ``[micro_batch_size, seq_length]``."""
        return self._loader(self._require(self.val_dataset), shuffle=False)

    # ------------------------------------------------------------------ internals
    def _build_cache(self) -> None:
        """Train the SentencePiece model (if needed) and write ``tokens.npy``, each atomically."""
        texts = [f.read_text(encoding="utf-8") for f in corpus_files(self.corpus_dir)]
        tokenizer: Tokenizer
        if self.tokenizer_kind == "byte":
            tokenizer = ByteTokenizer()
        else:
            if not self.tokenizer_model_path.exists():
                train_sentencepiece(
                    texts, str(self.tokenizer_model_path.with_suffix("")), vocab_size=self.requested_vocab_size
                )
            tokenizer = SentencePieceTokenizer(self.tokenizer_model_path)
        stream: list[int] = []
        for text in texts:
            stream.extend(tokenizer.encode(text))
            stream.append(tokenizer.eod)
        dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        array = np.asarray(stream, dtype=dtype)
        atomic_write(self.tokens_path, lambda f: np.save(f, array, allow_pickle=False))

    def _make_dataset(self, split: str, tokens: torch.Tensor) -> TokenizedCorpusDataset:
        """Build one split's dataset, explaining which split is too small if it is."""
        needed = self.micro_batch_size * self.seq_length + 1
        if tokens.numel() < needed:
            raise ValueError(
                f"{split} split too short: {tokens.numel()} tokens (val_fraction={self.val_fraction} of the corpus), "
                f"but one batch of micro_batch_size={self.micro_batch_size} x seq_length={self.seq_length} "
                f"needs {needed}"
            )
        return TokenizedCorpusDataset(tokens, self.seq_length)

    def _loader(self, dataset: TokenizedCorpusDataset, shuffle: bool) -> DataLoader[dict[str, torch.Tensor]]:
        """DataLoader with this module's batch size and worker settings."""
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            shuffle=shuffle,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @staticmethod
    def _require(dataset: TokenizedCorpusDataset | None) -> TokenizedCorpusDataset:
        """Return ``dataset`` or fail with a hint to call ``setup`` first."""
        if dataset is None:
            raise RuntimeError("TinyCorpusDataModule.setup() must be called before requesting dataloaders")
        return dataset


def _spm_version() -> str:
    """Installed sentencepiece version (a new version may train a different model)."""
    import sentencepiece

    return str(getattr(sentencepiece, "__version__", "unknown"))
