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

__all__ = [
    "TOKENIZER_TYPES",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "train_sentencepiece",
]

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


# Candidate end-of-document tokens of Hugging Face tokenizers, most specific first.
_HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|eot_id|>", "<eos>", "<|im_end|>", "[SEP]")


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer, without downloads: the model's ``tokenizer.json`` (read with the
    ``tokenizers`` package), or its SentencePiece ``tokenizer.model`` (read with ``sentencepiece``).

    ``path`` is a ``tokenizer.json``, a SentencePiece ``.model`` file, or a model directory holding one of them
    (``tokenizer.json`` preferred). The end-of-document id is, in order: the ``eod_token`` argument; the
    ``eos_token`` of a ``tokenizer_config.json`` / ``special_tokens_map.json`` beside the file; then, for a
    ``tokenizer.json``, the first of ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<|eot_id|>``,
    ``<eos>``, ``<|im_end|>``, ``[SEP]`` in the vocabulary, and for a SentencePiece model its eos piece.

    Args:
        path: a ``tokenizer.json`` / ``.model`` file, or a directory containing one.
        eod_token: the end-of-document token's text, overriding the search.

    Raises:
        ImportError: ``tokenizers`` (for a ``tokenizer.json``) is not installed (with the pip command to fix it).
        FileNotFoundError: no ``tokenizer.json`` / ``tokenizer.model`` at ``path``.
        ValueError: the file is not what its name says (e.g. Llama 3's ``tokenizer.model``, a tiktoken file
            rather than a SentencePiece model), naming the file to give instead; or no end-of-document token.
    """

    def __init__(self, path: str | os.PathLike[str], eod_token: str | None = None) -> None:
        p = Path(path)
        if p.is_dir() and not (p / "tokenizer.json").is_file() and (p / "tokenizer.model").is_file():
            p = p / "tokenizer.model"
        if p.suffix == ".model":
            self._init_sentencepiece(p, eod_token)
            return
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HuggingFaceTokenizer needs the 'tokenizers' package for a tokenizer.json, which is not installed: "
                "pip install tokenizers (or pip install 'lightning-megatron[tokenizers]'; it only reads a local "
                "tokenizer.json; nothing is downloaded)"
            ) from err
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no Hugging Face tokenizer file at {file} (expected a tokenizer.json, a "
                                    "SentencePiece tokenizer.model, or a model directory holding one)")
        self.path = str(file)
        try:
            self._tok = _HFTokenizer.from_file(self.path)
        except Exception as err:  # noqa: BLE001 - the Rust library raises a bare Exception
            raise ValueError(f"{self.path} is not a Hugging Face tokenizer.json ({err}); HuggingFaceTokenizer "
                             "needs the model's tokenizer.json (or its directory), or a SentencePiece .model") from err
        self._sp = None
        token = eod_token or _hf_configured_eos(file.parent)
        candidates = (token,) if token else _HF_EOD_CANDIDATES
        eod = None
        for cand in candidates:
            eod = self._tok.token_to_id(cand)
            if eod is not None:
                break
        if eod is None:
            raise ValueError(
                f"{self.path}: no end-of-document token ({', '.join(candidates)}) in the vocabulary; pass eod_token="
            )
        self._eod = int(eod)

    def _init_sentencepiece(self, file: Path, eod_token: str | None) -> None:
        """A SentencePiece ``tokenizer.model`` (LLaMA-1/2, Mistral, Mixtral ship one beside tokenizer.json)."""
        if not file.is_file():
            raise FileNotFoundError(f"no SentencePiece model at {file}")
        self.path = str(file)
        self._tok = None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as err:
            raise ValueError(
                f"{self.path} is not a SentencePiece model ({err}). Llama 3's tokenizer.model is a tiktoken file, "
                f"which is not read here: give the tokenizer.json of the same model directory "
                f"(--tokenizer-model {file.parent / 'tokenizer.json'})") from err
        token = eod_token or _hf_configured_eos(file.parent)
        eod = self._sp.piece_to_id(token) if token else self._sp.eos_id()
        if eod < 0 or (token and self._sp.id_to_piece(eod) != token):
            raise ValueError(f"{self.path}: no end-of-document token ({token or 'eos piece'}) in the model; "
                             "pass eod_token=")
        self._eod = int(eod)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        if self._sp is not None:
            return int(self._sp.get_piece_size())
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eod(self) -> int:
        """The end-of-document id."""
        return self._eod

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no BOS/EOS added)."""
        if self._sp is not None:
            return list(self._sp.encode(text))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids, special tokens dropped."""
        if self._sp is not None:
            return str(self._sp.decode([int(i) for i in ids]))
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _hf_configured_eos(directory: Path) -> str | None:
    """The ``eos_token`` named in ``tokenizer_config.json`` / ``special_tokens_map.json``, if any."""
    import json

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = directory / name
        if not f.is_file():
            continue
        try:
            value = json.loads(f.read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, OSError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


#: Tokenizer types accepted by :func:`build_tokenizer` (Megatron-LM's names where they exist).
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "ByteTokenizer")


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Build a tokenizer by Megatron-style type name.

    * ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer``: ``tokenizer_model`` is the ``.model`` file.
    * ``HuggingFaceTokenizer``: ``tokenizer_model`` is a local ``tokenizer.json``, a SentencePiece
      ``tokenizer.model``, or the model directory holding one.
    * ``ByteTokenizer``: UTF-8 bytes, no model.

    Raises:
        ValueError: unknown type, or a missing model path for a type that needs one.
    """
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_model is None:
        raise ValueError(f"tokenizer type {tokenizer_type} needs a tokenizer model path (--tokenizer-model)")
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if not Path(tokenizer_model).is_file():
        raise FileNotFoundError(f"SentencePiece model not found: {tokenizer_model}")
    return SentencePieceTokenizer(tokenizer_model)
