"""Megatron-LM's indexed dataset format (``.bin`` + ``.idx``): a memory-mapped reader and a writer.

The files are byte-compatible with Megatron-LM's ``MMapIndexedDataset`` /
``megatron.core.datasets.indexed_dataset.IndexedDataset`` (non-multimodal), so data
preprocessed here trains in Megatron-LM and vice versa.

``<prefix>.bin`` holds the token ids of all sequences back to back, in one numpy dtype,
little-endian, with no header.

``<prefix>.idx`` (all integers little-endian)::

    offset  size           field
    0       9              magic b"MMIDIDX\\x00\\x00"
    9       8  uint64      version, always 1
    17      1  uint8       dtype code of the .bin tokens (see DTYPE_CODES)
    18      8  uint64      S = sequence count
    26      8  uint64      D = document-index count (number of documents + 1)
    34      4*S int32      sequence lengths (tokens per sequence)
    ..      8*S int64      sequence pointers (byte offset of each sequence in .bin)
    ..      8*D int64      document indices: 0, then the sequence count after each document

Our preprocessing writes one sequence per non-empty document (Megatron's default without
``--split-sentences``), so ``document_indices`` is ``0, 1, 2, ...`` except that an empty
document adds no sequence and repeats the previous value.
"""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from lightning_megatron.data._io import remove_stale_temporaries

__all__ = [
    "DTYPE_CODES",
    "INDEX_HEADER",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "best_dtype_for_vocab",
    "data_file_path",
    "index_file_path",
]

#: First 9 bytes of every ``.idx`` file.
INDEX_HEADER: bytes = b"MMIDIDX\x00\x00"
#: The only index version Megatron-LM writes or reads.
INDEX_VERSION: int = 1
#: Megatron-LM's dtype codes (``DType`` enum in ``megatron/core/datasets/indexed_dataset.py``).
DTYPE_CODES: dict[int, type[np.number[Any]]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF_DTYPE: dict[np.dtype[Any], int] = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
# Fixed part of the header: magic, version, dtype code, sequence count, document count.
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    """``<prefix>.idx``."""
    return os.fspath(prefix) + ".idx"


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    """``<prefix>.bin``."""
    return os.fspath(prefix) + ".bin"


def _strip_suffix(prefix: str | os.PathLike[str]) -> str:
    """Accept ``x.bin`` / ``x.idx`` as well as the prefix ``x``."""
    text = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def best_dtype_for_vocab(vocab_size: int) -> type[np.number[Any]]:
    """Megatron's rule for the token dtype: ``uint16`` when ``vocab_size < 65500``, else ``int32``."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDataset:
    """Memory-mapped reader of a Megatron ``<prefix>.bin`` / ``<prefix>.idx`` pair.

    ``dataset[i]`` is sequence ``i`` as a read-only numpy array view into the ``.bin`` file
    (no copy); :meth:`get` reads part of one. Sequence lengths, pointers and document
    indices are exposed as arrays (views into the memory-mapped ``.idx``). Pickling
    stores only the prefix (e.g. for DataLoader workers) and re-opens the files.

    Args:
        prefix: path prefix of the two files (a trailing ``.bin``/``.idx`` is tolerated).

    Raises:
        FileNotFoundError: if either file is missing.
        ValueError: if the ``.idx`` is not in the format above (bad magic, version, dtype
            code, truncated arrays, pointers past the end of ``.bin``).
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = _strip_suffix(prefix)
        self._open()

    # ------------------------------------------------------------------ loading
    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        if idx.size < _HEADER_BYTES:
            raise ValueError(f"{idx_path}: too short ({idx.size} bytes) for an MMIDIDX header")
        header = bytes(idx[: _HEADER_BYTES])
        if header[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(f"{idx_path}: bad magic {header[:9]!r}, expected {INDEX_HEADER!r} (not a Megatron .idx)")
        version, code, num_sequences, num_doc_indices = struct.unpack_from("<QBQQ", header, len(INDEX_HEADER))
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path}: unsupported index version {version}, expected {INDEX_VERSION}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        needed = _HEADER_BYTES + 4 * num_sequences + 8 * num_sequences + 8 * num_doc_indices
        if idx.size < needed:
            raise ValueError(
                f"{idx_path}: truncated: header announces {num_sequences} sequences and {num_doc_indices} "
                f"document indices ({needed} bytes) but the file has {idx.size} bytes"
            )
        offset = _HEADER_BYTES
        self.sequence_lengths: np.ndarray = np.frombuffer(idx, dtype="<i4", count=num_sequences, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers: np.ndarray = np.frombuffer(idx, dtype="<i8", count=num_sequences, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices: np.ndarray = np.frombuffer(idx, dtype="<i8", count=num_doc_indices, offset=offset)
        if num_doc_indices == 0 or self.document_indices[-1] != num_sequences:
            last = int(self.document_indices[-1]) if num_doc_indices else None
            raise ValueError(
                f"{idx_path}: document indices must start at 0 and end at the sequence count {num_sequences}, "
                f"got {num_doc_indices} entries ending at {last}"
            )
        self._idx = idx
        bin_size = os.path.getsize(bin_path)
        if bin_size == 0:
            # np.memmap cannot map an empty file; an empty dataset has nothing to read anyway.
            self._bin: np.ndarray = np.zeros(0, dtype=np.uint8)
        else:
            self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r")
        if num_sequences:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if end > bin_size:
                raise ValueError(f"{bin_path}: truncated: the index needs {end} bytes but the file has {bin_size}")

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prefix = state["prefix"]
        self._open()

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in all sequences."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``index`` (to its end if ``length`` is None)."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sequence index {index} out of range for {len(self)} sequences")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"range [{offset}, {offset + length}) out of sequence {index} of length {size}")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, index: int) -> np.ndarray:
        """Sequence ``index`` (negative indices count from the end)."""
        if index < 0:
            index += len(self)
        return self.get(index)

    def document(self, doc: int) -> list[np.ndarray]:
        """The sequences of document ``doc`` (one array per sequence; empty list for an empty document)."""
        begin, end = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        return [self.get(i) for i in range(begin, end)]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"dtype={self.dtype.name})"
        )


class IndexedDatasetWriter:
    """Write a Megatron ``.bin``/``.idx`` pair, crash-safely.

    Tokens are streamed to a temporary ``.bin`` in the destination directory; the ``.idx`` is
    written next to it by :meth:`finalize`, but both keep their temporary names until
    :meth:`commit` renames them (``.bin`` first, then ``.idx``) to ``<prefix>.bin`` /
    ``<prefix>.idx``. :meth:`abort` (or leaving the ``with`` block with an exception)
    deletes the temporary files, so a failed run never leaves a half-written dataset and
    never touches an existing one. A run killed before it could clean up leaves its temporary
    files; the next writer into the same directory removes them
    (:func:`~lightning_megatron.data._io.remove_stale_temporaries`).

    Used as a context manager, a clean exit finalizes and commits::

        with IndexedDatasetWriter("out/train_text_document", dtype=np.uint16) as w:
            w.add_document([5, 6, 7, 0])

    Args:
        prefix: output path prefix.
        dtype: token dtype (one of :data:`DTYPE_CODES`'s), see :func:`best_dtype_for_vocab`.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.number[Any]] | np.dtype[Any] = np.int32) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype.newbyteorder("<") not in _CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code; use one of {list(_CODE_OF_DTYPE)}")
        self.dtype = self.dtype.newbyteorder("<")
        directory = Path(self.prefix).parent
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(directory)   # what killed runs left behind
        tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        name = Path(self.prefix).name
        self._tmp_bin = directory / f".{name}.bin.{tag}"
        self._tmp_idx = directory / f".{name}.idx.{tag}"
        self._bin: BinaryIO | None = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._lengths: list[int] = []
        self._doc_indices: list[int] = [0]
        self._num_tokens = 0
        self._finalized = False
        self._done = False

    @property
    def num_documents(self) -> int:
        """Documents added so far."""
        return len(self._doc_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens written so far."""
        return self._num_tokens

    def add_document(self, tokens: Any) -> None:
        """Append one document as one sequence (an empty document adds no sequence).

        Raises:
            ValueError: if a token does not fit the dtype.
        """
        if self._bin is None:
            raise RuntimeError("IndexedDatasetWriter is closed")
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {array.shape}")
        if array.size:
            if array.dtype != self.dtype:
                if np.issubdtype(self.dtype, np.integer):
                    info = np.iinfo(self.dtype)
                    lo, hi = int(array.min()), int(array.max())
                    if lo < info.min or hi > info.max:
                        raise ValueError(f"token id out of range for dtype {self.dtype.name}: min {lo}, max {hi}")
                array = array.astype(self.dtype)
            self._bin.write(array.tobytes(order="C"))
            self._lengths.append(int(array.size))
            self._num_tokens += int(array.size)
        self._doc_indices.append(len(self._lengths))

    def finalize(self) -> None:
        """Close the ``.bin`` and write the ``.idx`` (still under temporary names)."""
        if self._finalized:
            return
        assert self._bin is not None
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._bin = None
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_indices = np.asarray(self._doc_indices, dtype="<i8")
        with open(self._tmp_idx, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<QBQQ", INDEX_VERSION, _CODE_OF_DTYPE[self.dtype], len(lengths), len(doc_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_indices.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self._finalized = True

    def commit(self) -> tuple[str, str]:
        """Finalize if needed and rename the files into place; returns ``(bin_path, idx_path)``."""
        self.finalize()
        bin_path, idx_path = data_file_path(self.prefix), index_file_path(self.prefix)
        os.replace(self._tmp_bin, bin_path)
        os.replace(self._tmp_idx, idx_path)
        self._done = True
        return bin_path, idx_path

    def abort(self) -> None:
        """Close and delete the temporary files; the destination is left untouched."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        if not self._done:
            self._tmp_bin.unlink(missing_ok=True)
            self._tmp_idx.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
