"""Train a small SentencePiece model from a JSONL corpus, locally (no downloads).

Command line::

    python -m lightning_megatron.data.train_tokenizer --input train.jsonl --model-prefix tok --vocab-size 4096

writes ``tok.model`` (use it with ``--tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model``).
It wraps :func:`~lightning_megatron.data.tokenizers.train_sentencepiece` (deterministic, round-trip
safe: byte fallback, whitespace and newlines kept; ids ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 = eod).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence

from lightning_megatron.data.tokenizers import train_sentencepiece

__all__ = ["iter_jsonl_texts", "main", "train_sentencepiece_from_jsonl"]


def iter_jsonl_texts(
    path: str | os.PathLike[str], json_keys: Sequence[str] = ("text",), max_documents: int | None = None
) -> Iterator[str]:
    """Yield the ``json_keys`` strings of each line of a JSONL file (bad or blank lines are skipped)."""
    count = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if max_documents is not None and count >= max_documents:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            for key in json_keys:
                value = record.get(key)
                if isinstance(value, str):
                    yield value
                elif isinstance(value, list):
                    yield from (v for v in value if isinstance(v, str))
            count += 1


def train_sentencepiece_from_jsonl(
    input: str | os.PathLike[str],
    model_prefix: str,
    vocab_size: int = 4096,
    json_keys: Sequence[str] = ("text",),
    max_documents: int | None = None,
    model_type: str = "unigram",
) -> str:
    """Train a SentencePiece model on the documents of a JSONL file; returns the ``.model`` path.

    ``max_documents`` caps how many lines are read (training reads all text into memory).
    """
    texts = list(iter_jsonl_texts(input, json_keys, max_documents))
    if not texts:
        raise ValueError(f"{input}: no text under keys {list(json_keys)}")
    return train_sentencepiece(texts, model_prefix, vocab_size=vocab_size, model_type=model_type)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(
        prog="python -m lightning_megatron.data.train_tokenizer",
        description="Train a SentencePiece model (<model-prefix>.model) on a JSONL corpus.",
    )
    p.add_argument("--input", required=True, help="JSONL file")
    p.add_argument("--model-prefix", required=True, help="output path without .model")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--max-documents", type=int, default=None, help="read at most this many lines")
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    args = p.parse_args(argv)
    try:
        path = train_sentencepiece_from_jsonl(
            args.input, args.model_prefix, args.vocab_size, args.json_keys, args.max_documents, args.model_type
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
