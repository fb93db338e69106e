"""Tokenizers for the small-data pipeline: raw UTF-8 bytes and SentencePiece.

Both implement the :class:`Tokenizer` protocol: ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size`` and ``eod`` (the end-of-document id that is
appended after every document when a corpus is turned into one token stream).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import sentencepiece as spm

from lightning_megatron.data._io import atomic_write_bytes

__all__ = ["ByteTokenizer", "SentencePieceTokenizer", "Tokenizer", "train_sentencepiece"]

# Ids of the special pieces in models made by :func:`train_sentencepiece`.
_UNK_ID, _BOS_ID, _EOS_ID = 0, 1, 2
# Lines longer than this (in bytes) are skipped by the SentencePiece trainer.
_MAX_SENTENCE_BYTES = 1 << 16


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline (and a model's config) needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids; every id produced by :meth:`encode` and :attr:`eod` is below it."""
        ...

    @property
    def eod(self) -> int:
        """Id of the end-of-document token."""
        ...

    def encode(self, text: str) -> list[int]:
        """Turn ``text`` into token ids (no end-of-document token is added)."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Turn token ids back into text; special tokens such as :attr:`eod` are dropped."""
        ...


class ByteTokenizer:
    """Tokenizer over the UTF-8 bytes of the text: ids ``0..255`` are bytes, ``256`` is eod.

    Needs no training and round-trips any string exactly.
    """

    EOD: int = 256

    @property
    def vocab_size(self) -> int:
        """257: the 256 byte values plus the end-of-document id."""
        return 257

    @property
    def eod(self) -> int:
        """The end-of-document id, 256."""
        return self.EOD

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ints."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Decode byte ids as UTF-8, dropping ids >= 256; invalid sequences become U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257)"


class SentencePieceTokenizer:
    """Wraps a trained SentencePiece model file (e.g. one made by :func:`train_sentencepiece`).

    Args:
        model_path: path to the ``.model`` file.

    The end-of-document id is the model's ``</s>`` (eos) piece, which must exist.
    """

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        self.model_path = str(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        if self._sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {self.model_path} has no eos piece to use as end-of-document")

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model."""
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        """Id of the model's eos (``</s>``) piece."""
        return int(self._sp.eos_id())

    def encode(self, text: str) -> list[int]:
        """Return the piece ids of ``text``."""
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of the piece ids; control pieces (eos, bos) decode to nothing."""
        return str(self._sp.decode([int(i) for i in ids]))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def _read_texts(texts: Iterable[str] | str | os.PathLike[str]) -> Iterator[str]:
    """Yield documents: the given strings, or the ``*.txt`` files of a path (file or directory)."""
    if isinstance(texts, (str, os.PathLike)):
        path = Path(texts)
        if path.is_dir():
            files: Sequence[Path] = sorted(path.glob("*.txt"))
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
        for file in files:
            yield file.read_text(encoding="utf-8")
    else:
        yield from texts


def train_sentencepiece(
    texts: Iterable[str] | str | os.PathLike[str],
    model_prefix: str,
    vocab_size: int = 4096,
    *,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
) -> str:
    """Train a SentencePiece model and write it to ``model_prefix + ".model"``.

    Each non-blank line of the input is one training sentence. The model is set up for
    exact round trips of arbitrary text: identity normalisation, whitespace kept as is,
    no dummy prefix, byte fallback for unseen characters, ``"\\n"`` as its own piece, and
    digits split. Special ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (used as end-of-document).

    Training is deterministic (all input used, no shuffling/sampling, one thread), so the
    same input and arguments give a byte-identical model file wherever it is written.
    It is quiet (SentencePiece logs errors only), writes the file atomically, and takes
    well under a second on the shipped corpus. ``vocab_size`` is an upper bound: if the
    text has too few distinct pieces the model comes out smaller (check ``vocab_size`` on
    the loaded tokenizer). Lines over 64 KiB are skipped by the trainer.

    Args:
        texts: documents as strings, or a path to a ``.txt`` file or to a directory whose
            ``*.txt`` files are read in sorted order. A ``str`` is always taken as a path.
        model_prefix: output path without the ``.model`` suffix; no ``.vocab`` is written.
        vocab_size: requested number of pieces (including the 3 special ones, 256 byte
            pieces and ``"\\n"``), so it must be comfortably above 260.
        model_type: SentencePiece algorithm, ``"unigram"`` or ``"bpe"``.
        character_coverage: fraction of characters covered by dedicated pieces.

    Returns:
        The path of the written model file.
    """
    sentences = [line for doc in _read_texts(texts) for line in doc.splitlines() if line.strip()]
    if not sentences:
        raise ValueError("train_sentencepiece: the input contains no text")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_digits=True,
            user_defined_symbols=["\n"],
            unk_id=_UNK_ID,
            bos_id=_BOS_ID,
            eos_id=_EOS_ID,
            pad_id=-1,
            hard_vocab_limit=False,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise ValueError(f"SentencePiece training failed (vocab_size={vocab_size}): {err}") from err
    model_path = f"{model_prefix}.model"
    atomic_write_bytes(model_path, buf.getvalue())
    return model_path
