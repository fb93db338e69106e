"""Small-data pipeline: shipped text corpus, tokenizers, dataset and LightningDataModule."""

from lightning_megatron.data.corpus import DEFAULT_CORPUS_DIR, TokenizedCorpusDataset, corpus_files, read_corpus
from lightning_megatron.data.datamodule import TinyCorpusDataModule, default_cache_dir
from lightning_megatron.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer, train_sentencepiece

__all__ = [
    "DEFAULT_CORPUS_DIR",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "TinyCorpusDataModule",
    "TokenizedCorpusDataset",
    "Tokenizer",
    "corpus_files",
    "default_cache_dir",
    "read_corpus",
    "train_sentencepiece",
]
