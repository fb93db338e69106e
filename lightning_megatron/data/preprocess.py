"""Tokenise a JSONL corpus into Megatron-LM's indexed-dataset format (``.bin`` + ``.idx``).

Command line (same flags as Megatron-LM's ``tools/preprocess_data.py`` where they overlap)::

    python -m lightning_megatron.data.preprocess --input train.jsonl --output-prefix out/train \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --workers 8 --append-eod

writes ``out/train_text_document.bin`` / ``.idx`` (one pair per ``--json-keys`` key). Each
line of the input is one JSON object; its ``text`` (or each ``--json-keys``) string is one
document (a list of strings is joined into one document, as Megatron does without
``--split-sentences``). Blank lines are ignored.

A bad line (not UTF-8, not JSON, not an object, key missing, value not a string, text the
tokenizer cannot encode such as a lone surrogate ``"\ud800"``) stops the run with an error
naming ``file:line``; with ``--skip-bad-lines`` it is skipped, counted and reported at the
end. Outputs are written under temporary names in the output directory and renamed only
after the whole input is processed, so a failed run leaves no partial files behind (and does
not touch existing outputs); the temporary files of a killed run are removed by the next run
writing into that directory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

import numpy as np

from lightning_megatron.data.indexed_dataset import IndexedDatasetWriter, best_dtype_for_vocab
from lightning_megatron.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = ["PreprocessError", "PreprocessResult", "main", "output_prefix_for", "preprocess_jsonl"]


class PreprocessError(ValueError):
    """A bad input line or an unusable input, with ``file:line`` in the message."""


@dataclass
class PreprocessResult:
    """What :func:`preprocess_jsonl` wrote."""

    outputs: dict[str, str]
    """json key -> output prefix (``<output_prefix>_<key>_document``)."""
    documents: int = 0
    """Documents written (per key)."""
    tokens: dict[str, int] = field(default_factory=dict)
    """json key -> tokens written."""
    skipped_lines: list[int] = field(default_factory=list)
    """Line numbers of bad lines skipped (``skip_bad_lines=True``)."""
    blank_lines: int = 0
    """Blank lines ignored."""
    dtype: str = ""
    """Token dtype of the ``.bin`` files."""
    seconds: float = 0.0


def output_prefix_for(output_prefix: str | os.PathLike[str], key: str) -> str:
    """Megatron's output naming: ``<output_prefix>_<key>_document``."""
    return f"{os.fspath(output_prefix)}_{key}_document"


# ----------------------------------------------------------------------------- per-line work (runs in workers)
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_type: str, tokenizer_model: str | None, json_keys: tuple[str, ...], append_eod: bool,
                 dtype: str) -> None:
    _WORKER["tokenizer"] = build_tokenizer(tokenizer_type, tokenizer_model)
    _WORKER["keys"] = json_keys
    _WORKER["append_eod"] = append_eod
    _WORKER["dtype"] = np.dtype(dtype)


def _encode_text(tokenizer: Tokenizer, key: str, text: str) -> tuple[list[int] | None, str | None]:
    """Token ids of ``text``, or an error naming what the tokenizer could not take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return None, (f"key {key!r} holds {text[err.start:err.end]!r} at character {err.start}, which is not "
                      f"encodable as UTF-8 ({err.reason})")
    try:
        return list(tokenizer.encode(text)), None
    except Exception as err:  # noqa: BLE001 - any tokenizer failure becomes a file:line error
        return None, f"the tokenizer failed on key {key!r}: {type(err).__name__}: {err}"


def _encode_line(item: tuple[int, bytes | str]) -> tuple[int, str | None, list[np.ndarray] | None, int]:
    """Return ``(line_no, error, arrays_per_key, n_bytes)``; ``error`` ``"blank"`` for a blank line."""
    line_no, raw = item
    if isinstance(raw, bytes):
        n_bytes = len(raw)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return line_no, (f"not valid UTF-8 ({err.reason}: byte {raw[err.start:err.start + 1]!r} at byte "
                             f"{err.start + 1} of the line)"), None, n_bytes
    else:
        line, n_bytes = raw, len(raw.encode("utf-8", "surrogatepass"))
    if not line.strip():
        return line_no, "blank", None, n_bytes
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return line_no, f"not valid JSON ({err.msg} at column {err.colno})", None, n_bytes
    if not isinstance(record, dict):
        return line_no, f"expected a JSON object, got {type(record).__name__}", None, n_bytes
    tokenizer: Tokenizer = _WORKER["tokenizer"]
    dtype: np.dtype[Any] = _WORKER["dtype"]
    arrays = []
    for key in _WORKER["keys"]:
        if key not in record:
            present = ", ".join(repr(k) for k in list(record)[:10]) or "none"
            return line_no, f"key {key!r} missing (keys present: {present})", None, n_bytes
        value = record[key]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            ids: list[int] = []
            for part in value:
                part_ids, error = _encode_text(tokenizer, key, part)
                if error is not None:
                    return line_no, error, None, n_bytes
                ids.extend(part_ids)
        elif isinstance(value, str):
            ids, error = _encode_text(tokenizer, key, value)
            if error is not None:
                return line_no, error, None, n_bytes
        else:
            return line_no, f"key {key!r} is {type(value).__name__}, expected a string", None, n_bytes
        if ids and _WORKER["append_eod"]:
            ids.append(tokenizer.eod)
        arrays.append(np.asarray(ids, dtype=dtype))
    return line_no, None, arrays, n_bytes


def _numbered_lines(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw bytes)``: lines are split on ``\\n`` and decoded one by one, so an encoding fault is
    reported (or skipped) as its ``file:line``, not as an offset into a read buffer."""
    for i, line in enumerate(stream, start=1):
        yield i, line


# ----------------------------------------------------------------------------- progress
class _Progress:
    """tqdm bar (documents/s, MB/s) if tqdm is installed, else a line every ``log_interval`` docs."""

    def __init__(self, enabled: bool, log_interval: int, stream: TextIO) -> None:
        self.enabled = enabled
        self.log_interval = max(1, log_interval)
        self.stream = stream
        self.start = time.perf_counter()
        self.docs = 0
        self.n_bytes = 0
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(unit=" docs", desc="tokenizing", file=stream, mininterval=0.5, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def update(self, docs: int, n_bytes: int) -> None:
        self.docs += docs
        self.n_bytes += n_bytes
        if not self.enabled:
            return
        if self._bar is not None:
            if docs:
                self._bar.update(docs)
        elif docs and self.docs % self.log_interval == 0:
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            print(
                f"processed {self.docs} documents ({self.docs / elapsed:.1f} docs/s, "
                f"{self.n_bytes / elapsed / 1e6:.2f} MB/s)",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ----------------------------------------------------------------------------- main entry point
def preprocess_jsonl(
    input: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
    tokenizer_type: str = "SentencePieceTokenizer",
    tokenizer_model: str | os.PathLike[str] | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    chunksize: int = 32,
    skip_bad_lines: bool = False,
    progress: bool = True,
    log_interval: int = 10000,
    log_stream: TextIO | None = None,
) -> PreprocessResult:
    """Tokenise the JSONL file ``input`` into ``<output_prefix>_<key>_document.bin/.idx``.

    Args:
        input: JSONL file, one JSON object per line.
        output_prefix: output path prefix (directories are created).
        tokenizer_type: one of :data:`~lightning_megatron.data.tokenizers.TOKENIZER_TYPES`.
        tokenizer_model: SentencePiece ``.model`` / Hugging Face ``tokenizer.json`` (or its directory).
        json_keys: keys to tokenise, one output pair each.
        append_eod: append the tokenizer's end-of-document id to every non-empty document.
        workers: tokenizer processes (``multiprocessing.Pool.imap``; 1 = in this process).
        chunksize: lines per task sent to a worker.
        skip_bad_lines: skip (and count) bad lines instead of failing.
        progress: show progress (tqdm if installed, else a line per ``log_interval`` docs).
        log_interval: documents between plain progress lines.
        log_stream: where progress and the summary go (default ``sys.stderr``).

    Returns:
        A :class:`PreprocessResult`.

    Raises:
        PreprocessError: a bad line (``file:line: reason``) without ``skip_bad_lines``, or no input.
        FileNotFoundError: missing input or tokenizer model.
    """
    stream = log_stream if log_stream is not None else sys.stderr
    path = os.fspath(input)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file not found: {path}")
    keys = tuple(json_keys)
    if not keys:
        raise PreprocessError("json_keys is empty")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    model = os.fspath(tokenizer_model) if tokenizer_model is not None else None
    tokenizer = build_tokenizer(tokenizer_type, model)  # fail fast here, not in a worker
    dtype = np.dtype(best_dtype_for_vocab(tokenizer.vocab_size))
    init_args = (tokenizer_type, model, keys, append_eod, dtype.str)
    outputs = {key: output_prefix_for(output_prefix, key) for key in keys}
    result = PreprocessResult(outputs=outputs, dtype=dtype.name)
    start = time.perf_counter()
    writers: list[IndexedDatasetWriter] = []
    pool = None
    bar: _Progress | None = None
    try:
        writers = [IndexedDatasetWriter(outputs[key], dtype) for key in keys]
        if workers > 1:  # start the workers before any progress-bar thread exists
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=init_args)
        bar = _Progress(progress, log_interval, stream)
        with open(path, "rb") as fin:
            if pool is None:
                _init_worker(*init_args)
                results: Iterator[Any] = map(_encode_line, _numbered_lines(fin))
            else:
                results = pool.imap(_encode_line, _numbered_lines(fin), chunksize)
            for line_no, error, arrays, n_bytes in results:
                if error == "blank":
                    result.blank_lines += 1
                    bar.update(0, n_bytes)
                    continue
                if error is not None:
                    if not skip_bad_lines:
                        raise PreprocessError(f"{path}:{line_no}: {error} (use --skip-bad-lines to skip bad lines)")
                    result.skipped_lines.append(line_no)
                    bar.update(0, n_bytes)
                    continue
                assert arrays is not None
                for writer, array in zip(writers, arrays):
                    writer.add_document(array)
                result.documents += 1
                bar.update(1, n_bytes)
        if result.documents == 0:
            raise PreprocessError(f"{path}: no documents (empty input, or every line was bad)")
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        for writer in writers:
            writer.finalize()
        for key, writer in zip(keys, writers):
            writer.commit()
            result.tokens[key] = writer.num_tokens
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    result.seconds = time.perf_counter() - start
    if progress:
        for key in keys:
            print(
                f"wrote {outputs[key]}.bin/.idx: {result.documents} documents, {result.tokens[key]} tokens "
                f"({dtype.name}) in {result.seconds:.1f} s ({result.documents / max(result.seconds, 1e-9):.1f} docs/s)",
                file=stream,
            )
        if result.skipped_lines:
            shown = ", ".join(str(n) for n in result.skipped_lines[:20])
            more = " ..." if len(result.skipped_lines) > 20 else ""
            print(f"skipped {len(result.skipped_lines)} bad lines of {path}: {shown}{more}", file=stream)
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_megatron.data.preprocess",
        description="Tokenise a JSONL file into Megatron-LM indexed datasets (<output-prefix>_<key>_document.bin/.idx).",
    )
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--output-prefix", required=True, help="output path prefix, e.g. out/train")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenise (default: text)")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", default=None, help="SentencePiece .model, or tokenizer.json (or its dir)")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--chunksize", type=int, default=32, help="lines per worker task (default 32)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad lines instead of failing")
    p.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines without tqdm")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (1 with ``error: ...`` on stderr for a bad input)."""
    args = _parser().parse_args(argv)
    try:
        preprocess_jsonl(
            args.input,
            args.output_prefix,
            tokenizer_type=args.tokenizer_type,
            tokenizer_model=args.tokenizer_model,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            chunksize=args.chunksize,
            skip_bad_lines=args.skip_bad_lines,
            progress=not args.quiet,
            log_interval=args.log_interval,
        )
    except (PreprocessError, FileNotFoundError, ImportError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; no output was written", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - a tokenizer library or the file system failed: say so, no traceback
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
