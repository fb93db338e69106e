"""Tests for the small-data pipeline (``lightning_megatron.data``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

import lightning_megatron.data.datamodule as datamodule_mod
from lightning_megatron.data import (
    DEFAULT_CORPUS_DIR,
    ByteTokenizer,
    SentencePieceTokenizer,
    TinyCorpusDataModule,
    TokenizedCorpusDataset,
    Tokenizer,
    read_corpus,
    train_sentencepiece,
)
from lightning_megatron.data._io import atomic_write

SENTENCE = "Ownership is Rust's most unique feature — it has deep implications (déjà vu, 42 €).\n\nNext  paragraph."
KEYS = {"tokens", "labels", "loss_mask", "position_ids"}


# ----------------------------------------------------------------------------- corpus
def test_shipped_corpus_is_present_and_sized() -> None:
    files = sorted(DEFAULT_CORPUS_DIR.glob("*.txt"))
    total = sum(f.stat().st_size for f in files)
    assert files and 300_000 <= total <= 1_500_000
    assert (DEFAULT_CORPUS_DIR / "SOURCE.md").is_file()
    assert len(read_corpus()) == len(files)


# ----------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eod) == (257, 256)
    ids = tok.encode(SENTENCE)
    assert ids == list(SENTENCE.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == SENTENCE
    assert tok.decode(ids + [tok.eod]) == SENTENCE  # eod is dropped


def test_sentencepiece_train_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    texts = read_corpus()
    path_a = train_sentencepiece(texts, str(tmp_path / "a" / "spm"), vocab_size=1024)
    path_b = train_sentencepiece(texts, str(tmp_path / "b" / "other_name"), vocab_size=1024)
    path_c = train_sentencepiece(DEFAULT_CORPUS_DIR, str(tmp_path / "c"), vocab_size=1024)  # from a directory
    assert path_a == str(tmp_path / "a" / "spm.model")
    data = Path(path_a).read_bytes()
    assert data == Path(path_b).read_bytes() == Path(path_c).read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["spm.model"]  # no temp files left

    tok = SentencePieceTokenizer(path_a)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 1024
    ids = tok.encode(SENTENCE)
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.eod not in ids
    plain = "The compiler checks that every reference is valid before the program runs."
    assert len(tok.encode(plain)) < len(plain) / 3  # it actually compresses English
    assert tok.decode(ids) == SENTENCE
    assert tok.decode(ids + [tok.eod]) == SENTENCE


def test_sentencepiece_rejects_empty_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no text"):
        train_sentencepiece(["", "   \n"], str(tmp_path / "spm"))


# ----------------------------------------------------------------------------- dataset
def test_dataset_windows_are_the_token_stream() -> None:
    stream = torch.randint(0, 1000, (103,))
    ds = TokenizedCorpusDataset(stream, seq_length=10)
    assert len(ds) == 10  # (103 - 1) // 10
    items = [ds[i] for i in range(len(ds))]
    for i, item in enumerate(items):
        assert set(item) == KEYS
        assert item["tokens"].dtype == torch.long and item["tokens"].shape == (10,)
        assert item["labels"].dtype == torch.long and item["labels"].shape == (10,)
        assert item["loss_mask"].dtype == torch.float32 and torch.equal(item["loss_mask"], torch.ones(10))
        assert item["position_ids"].dtype == torch.long and torch.equal(item["position_ids"], torch.arange(10))
        assert torch.equal(item["tokens"], stream[i * 10 : i * 10 + 10])
        assert torch.equal(item["labels"], stream[i * 10 + 1 : i * 10 + 11])
    # Inputs tile the stream exactly; labels are the same stream shifted by one.
    assert torch.equal(torch.cat([it["tokens"] for it in items]), stream[:100])
    assert torch.equal(torch.cat([it["labels"] for it in items]), stream[1:101])
    assert torch.equal(ds[-1]["tokens"], items[-1]["tokens"])
    with pytest.raises(IndexError):
        ds[len(ds)]
    # Exactly seq_length + 1 tokens make one sample.
    assert len(TokenizedCorpusDataset(torch.arange(11), seq_length=10)) == 1


def test_dataset_rejects_too_short_corpus() -> None:
    with pytest.raises(ValueError, match=r"has 10 tokens .*seq_length=10 needs 11"):
        TokenizedCorpusDataset(torch.arange(10), seq_length=10)
    with pytest.raises(ValueError, match="1-D"):
        TokenizedCorpusDataset(torch.zeros(2, 20, dtype=torch.long), seq_length=4)


# ----------------------------------------------------------------------------- datamodule
@pytest.fixture(scope="module")
def spm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory shared by the sentencepiece datamodule tests (trains once)."""
    return tmp_path_factory.mktemp("lm_cache")


def _check_batch(batch: dict[str, torch.Tensor], batch_size: int, seq_length: int, vocab_size: int) -> None:
    assert set(batch) == KEYS
    for key in KEYS:
        assert batch[key].shape == (batch_size, seq_length)
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"], torch.arange(seq_length).expand(batch_size, -1))
    assert 0 <= int(batch["tokens"].min()) and int(batch["labels"].max()) < vocab_size


@pytest.mark.parametrize("kind", ["sentencepiece", "byte"])
def test_datamodule_batches_and_disjoint_splits(kind: str, spm_cache: Path) -> None:
    dm = TinyCorpusDataModule(seq_length=64, micro_batch_size=4, tokenizer=kind, vocab_size=1024, cache_dir=spm_cache)
    assert dm.vocab_size == (1024 if kind == "sentencepiece" else 257)  # available before setup
    dm.prepare_data()
    dm.setup("fit")
    assert dm.train_dataset is not None and dm.val_dataset is not None

    train_batch = next(iter(dm.train_dataloader()))
    val_batch = next(iter(dm.val_dataloader()))
    _check_batch(train_batch, 4, 64, dm.vocab_size)
    _check_batch(val_batch, 4, 64, dm.vocab_size)

    # The splits are consecutive, disjoint pieces of the cached stream: train first, val = the last 5%.
    stream = torch.from_numpy(np.load(dm.tokens_path).astype(np.int64))
    train_tokens, val_tokens = dm.train_dataset.tokens, dm.val_dataset.tokens
    assert train_tokens.numel() + val_tokens.numel() == stream.numel()
    assert val_tokens.numel() == int(stream.numel() * 0.05)
    assert torch.equal(torch.cat([train_tokens, val_tokens]), stream)
    assert int((stream == dm.tokenizer.eod).sum()) == len(read_corpus())  # one eod per document

    # Validation is in order; training is shuffled and drops the incomplete batch.
    assert torch.equal(val_batch["tokens"], torch.stack([dm.val_dataset[i]["tokens"] for i in range(4)]))
    assert len(dm.train_dataloader()) == len(dm.train_dataset) // 4
    assert len(dm.val_dataloader()) == len(dm.val_dataset) // 4
    text = dm.tokenizer.decode(train_batch["tokens"][0].tolist())
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)  # English prose


def test_datamodule_cache_is_reused(spm_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_train = datamodule_mod.train_sentencepiece

    def counting_train(*args: object, **kwargs: object) -> str:
        calls.append("train")
        return real_train(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(datamodule_mod, "train_sentencepiece", counting_train)
    dm = TinyCorpusDataModule(tokenizer="sentencepiece", vocab_size=512, cache_dir=spm_cache)
    dm.prepare_data()
    assert calls == ["train"]
    stamps = {p: p.stat().st_mtime_ns for p in (dm.tokenizer_model_path, dm.tokens_path)}
    assert sorted(p.name for p in dm.cache_path.iterdir()) == ["spm.model", "tokens.npy"]

    dm2 = TinyCorpusDataModule(tokenizer="sentencepiece", vocab_size=512, cache_dir=spm_cache)
    assert dm2.cache_path == dm.cache_path
    dm2.prepare_data()
    dm2.setup("fit")
    assert dm2.vocab_size == 512
    assert calls == ["train"]  # not retrained
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing rewritten

    # A different vocabulary size is a different cache entry.
    assert TinyCorpusDataModule(vocab_size=768, cache_dir=spm_cache).cache_path != dm.cache_path


def test_setup_without_prepare_data_builds_cache(tmp_path: Path) -> None:
    dm = TinyCorpusDataModule(tokenizer="byte", seq_length=32, cache_dir=tmp_path)
    dm.setup("fit")  # e.g. a rank on a node where prepare_data did not run
    assert dm.tokens_path.is_file() and np.load(dm.tokens_path).dtype == np.uint16
    assert len(dm.train_dataset or []) > 0


def test_datamodule_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        TinyCorpusDataModule(tokenizer="bpe", cache_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="val_fraction"):
        TinyCorpusDataModule(val_fraction=1.0, cache_dir=tmp_path)
    dm = TinyCorpusDataModule(tokenizer="byte", seq_length=4096, micro_batch_size=64, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="validation split too short"):
        dm.setup("fit")
    with pytest.raises(RuntimeError, match="setup"):
        TinyCorpusDataModule(tokenizer="byte", cache_dir=tmp_path).train_dataloader()


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    def failing_write(f: object) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "tokens.npy", failing_write)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


class _BigramLM(L.LightningModule):
    """Smallest possible LM, just to run the datamodule through a Trainer."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.logits = torch.nn.Embedding(vocab_size, vocab_size)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses = torch.nn.functional.cross_entropy(
            self.logits(batch["tokens"]).flatten(0, 1), batch["labels"].flatten(), reduction="none"
        )
        mask = batch["loss_mask"].flatten()
        return (losses * mask).sum() / mask.sum()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.1)


def test_datamodule_runs_in_trainer(tmp_path: Path) -> None:
    dm = TinyCorpusDataModule(tokenizer="byte", seq_length=32, micro_batch_size=4, cache_dir=tmp_path)
    model = _BigramLM(dm.vocab_size)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=30,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 30
    assert float(trainer.callback_metrics["val_loss"]) < np.log(257)  # learned something
