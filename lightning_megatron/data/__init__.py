"""Data pipelines.

* Small data: the shipped text corpus, tokenizers, :class:`TinyCorpusDataModule`.
* Megatron-LM compatible: the ``.bin``/``.idx`` indexed-dataset format
  (:class:`IndexedDataset`, :class:`IndexedDatasetWriter`, the ``preprocess`` CLI),
  :class:`GPTDataset`, :class:`BlendedDataset`, splits, and :class:`GPTDataModule`.
"""

from lightning_megatron.data.corpus import DEFAULT_CORPUS_DIR, TokenizedCorpusDataset, corpus_files, read_corpus
from lightning_megatron.data.datamodule import TinyCorpusDataModule, default_cache_dir
from lightning_megatron.data.gpt_datamodule import (
    GPTDataModule,
    MegatronDataLoader,
    MegatronPretrainingSampler,
    compute_num_microbatches,
)
from lightning_megatron.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_blending_indices,
    document_ids_after_eod,
    parse_data_path,
    positions_in_documents,
    parse_split,
    split_ranges,
)
from lightning_megatron.data.mock import MockGPTDataModule, MockGPTDataset
from lightning_megatron.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype_for_vocab,
)
from lightning_megatron.data.tokenizers import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    train_sentencepiece,
)

# The two command-line modules are imported lazily, so that ``python -m lightning_megatron.data.preprocess``
# does not find its own module already imported by this package (runpy warns about that).
_LAZY = {
    "PreprocessError": "lightning_megatron.data.preprocess",
    "PreprocessResult": "lightning_megatron.data.preprocess",
    "preprocess_jsonl": "lightning_megatron.data.preprocess",
    "train_sentencepiece_from_jsonl": "lightning_megatron.data.train_tokenizer",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "document_ids_after_eod",
    "positions_in_documents",
    "DEFAULT_CORPUS_DIR",
    "DTYPE_CODES",
    "BlendedDataset",
    "ByteTokenizer",
    "GPTDataModule",
    "GPTDataset",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MegatronDataLoader",
    "MegatronPretrainingSampler",
    "MockGPTDataModule",
    "MockGPTDataset",
    "PreprocessError",
    "PreprocessResult",
    "SentencePieceTokenizer",
    "TinyCorpusDataModule",
    "TokenizedCorpusDataset",
    "Tokenizer",
    "best_dtype_for_vocab",
    "build_blending_indices",
    "build_tokenizer",
    "compute_num_microbatches",
    "corpus_files",
    "default_cache_dir",
    "parse_data_path",
    "parse_split",
    "preprocess_jsonl",
    "read_corpus",
    "split_ranges",
    "train_sentencepiece",
    "train_sentencepiece_from_jsonl",
]
