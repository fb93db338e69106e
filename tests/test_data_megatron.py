"""Tests for the Megatron-LM compatible data pipeline: preprocessing CLI, .bin/.idx format,
GPTDataset indices, blending, splits and GPTDataModule (batch arithmetic, dp sharding, resume)."""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from lightning_megatron.data import (
    BlendedDataset,
    ByteTokenizer,
    GPTDataModule,
    GPTDataset,
    HuggingFaceTokenizer,
    IndexedDataset,
    IndexedDatasetWriter,
    MegatronPretrainingSampler,
    PreprocessError,
    best_dtype_for_vocab,
    build_blending_indices,
    build_tokenizer,
    compute_num_microbatches,
    parse_data_path,
    preprocess_jsonl,
    read_corpus,
    split_ranges,
    train_sentencepiece,
    train_sentencepiece_from_jsonl,
)
from lightning_megatron.data import train_tokenizer
from lightning_megatron.data.gpt_dataset import build_sample_index, document_ids_after_eod, positions_in_documents
from lightning_megatron.data.preprocess import main as preprocess_main

KEYS = {"tokens", "labels", "loss_mask", "position_ids"}


# ----------------------------------------------------------------------------- helpers
def make_texts(n: int, seed: int = 0, alphabet: str = "abcdefghij klmnop\nqé€", max_len: int = 60) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, max_len))) for _ in range(n)]
    texts[3] = ""  # an empty document: no sequence, document index repeats
    return texts


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "id": i}, ensure_ascii=False) + "\n")
    return path


def preprocess(tmp: Path, texts: list[str], name: str = "train", **kw: Any) -> str:
    src = write_jsonl(tmp / f"{name}.jsonl", texts)
    kw.setdefault("append_eod", True)
    result = preprocess_jsonl(src, tmp / "out" / name, tokenizer_type="ByteTokenizer", progress=False, **kw)
    return result.outputs["text"]


def expected_docs(texts: list[str], append_eod: bool = True) -> list[list[int]]:
    tok = ByteTokenizer()
    return [tok.encode(t) + ([tok.eod] if append_eod and t else []) for t in texts]


def fake_trainer(dp: int = 1, rank: int = 0, accumulate: int = 1, global_step: int = 0) -> SimpleNamespace:
    """What GPTDataModule reads from a Trainer, without starting one."""
    return SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}),
        accumulate_grad_batches=accumulate,
        global_step=global_step,
        local_rank=0,
        world_size=1,
    )


# ----------------------------------------------------------------------------- preprocessing / format
def test_preprocess_round_trip_exact_token_ids(tmp_path: Path) -> None:
    texts = make_texts(120)
    src = write_jsonl(tmp_path / "train.jsonl", texts)
    rc = preprocess_main(
        ["--input", str(src), "--output-prefix", str(tmp_path / "out" / "train"), "--tokenizer-type", "ByteTokenizer",
         "--workers", "2", "--append-eod", "--quiet"]
    )
    assert rc == 0
    prefix = tmp_path / "out" / "train_text_document"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "train_text_document.bin", "train_text_document.idx"]  # no temporary files left
    ds = IndexedDataset(prefix)
    docs = expected_docs(texts)
    assert ds.num_documents == len(texts) and len(ds) == len(texts) - 1 and ds.dtype == np.uint16
    assert [d[0].tolist() if d else [] for d in map(ds.document, range(ds.num_documents))] == docs
    stream = np.concatenate([ds[i] for i in range(len(ds))])
    assert stream.tolist() == [t for d in docs for t in d]
    # GPTDataset over one epoch in document order (no shuffle visible through the stream):
    # every sample is seq_length + 1 consecutive tokens of the shuffled-document stream.
    gpt = GPTDataset(ds, seq_length=32, num_samples=None, seed=7, cache_dir=False)
    shuffled = np.concatenate([ds[int(i)] for i in gpt.document_index]).astype(np.int64)
    for j in range(len(gpt)):
        i = int(gpt.shuffle_index[j])
        item = gpt[j]
        np.testing.assert_array_equal(item["tokens"].numpy(), shuffled[i * 32 : i * 32 + 32])
        np.testing.assert_array_equal(item["labels"].numpy(), shuffled[i * 32 + 1 : i * 32 + 33])


def test_idx_parsed_by_independent_reader(tmp_path: Path) -> None:
    """Read our .idx/.bin straight from the format description, with struct and np.frombuffer."""
    texts = make_texts(30, seed=1)
    prefix = preprocess(tmp_path, texts)
    docs = expected_docs(texts)
    raw = Path(prefix + ".idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, len(texts) - 1, len(texts) + 1)  # 8 = uint16
    sizes = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=34)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=34 + 4 * n_seq)
    doc_idx = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=34 + 12 * n_seq)
    assert len(raw) == 34 + 12 * n_seq + 8 * n_doc  # nothing else (no sequence modes)
    nonempty = [d for d in docs if d]
    assert sizes.tolist() == [len(d) for d in nonempty]
    assert pointers.tolist() == [2 * int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
    expected_doc_idx = [0]
    for d in docs:
        expected_doc_idx.append(expected_doc_idx[-1] + (1 if d else 0))
    assert doc_idx.tolist() == expected_doc_idx
    data = np.frombuffer(Path(prefix + ".bin").read_bytes(), dtype="<u2")
    assert data.tolist() == [t for d in nonempty for t in d]

    # large vocabularies use int32 (code 4); the writer and reader agree on it
    assert best_dtype_for_vocab(65499) is np.uint16 and best_dtype_for_vocab(65500) is np.int32
    with IndexedDatasetWriter(tmp_path / "big", best_dtype_for_vocab(100_000)) as w:
        w.add_document([70_000, 1, 2])
        w.add_document([])
        w.add_document([99_999])
    raw = (tmp_path / "big.idx").read_bytes()
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 4, 2, 4)
    big = IndexedDataset(tmp_path / "big")
    assert big.dtype == np.int32 and big[0].tolist() == [70_000, 1, 2] and big[1].tolist() == [99_999]
    assert big.document_indices.tolist() == [0, 1, 1, 2]


def test_workers_give_identical_output_and_skip_bad_lines(tmp_path: Path) -> None:
    texts = make_texts(80, seed=2)
    lines = [json.dumps({"text": t}) for t in texts]
    lines.insert(10, "{not json")  # line 11
    lines.insert(20, json.dumps({"body": "x"}))  # line 21
    lines.insert(30, "")  # blank: ignored, not counted as bad
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    outs = []
    for workers in (1, 2):
        res = preprocess_jsonl(src, tmp_path / f"w{workers}" / "d", tokenizer_type="ByteTokenizer", append_eod=True,
                               workers=workers, chunksize=7, skip_bad_lines=True, progress=False)
        assert res.skipped_lines == [11, 21] and res.blank_lines == 1 and res.documents == len(texts)
        prefix = res.outputs["text"]
        outs.append((Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()))
    assert outs[0] == outs[1]


def test_bad_lines_fail_with_file_and_line_and_leave_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = [json.dumps({"text": f"doc {i}"}) for i in range(50)]
    out_dir = tmp_path / "out"

    def run(lines: list[str], **kw: Any) -> None:
        src = tmp_path / "in.jsonl"
        src.write_text("\n".join(lines) + "\n", encoding="utf-8")
        preprocess_jsonl(src, out_dir / "x", tokenizer_type="ByteTokenizer", progress=False, **kw)

    with pytest.raises(PreprocessError, match=r"in\.jsonl:41: not valid JSON"):
        run(good[:40] + ['{"text": "unterminated'] + good[40:], workers=2)
    assert not out_dir.exists() or list(out_dir.iterdir()) == []  # nothing half-written
    with pytest.raises(PreprocessError, match=r"in\.jsonl:3: key 'text' missing \(keys present: 'txt'\)"):
        run(good[:2] + [json.dumps({"txt": "a"})] + good[2:])
    with pytest.raises(PreprocessError, match=r"in\.jsonl:2: expected a JSON object"):
        run(good[:1] + ["[1, 2]"])
    with pytest.raises(PreprocessError, match=r"in\.jsonl:1: key 'text' is int"):
        run([json.dumps({"text": 5})])
    assert not out_dir.exists() or list(out_dir.iterdir()) == []

    # an existing output is left untouched by a failed run
    run(good)
    before = (out_dir / "x_text_document.idx").read_bytes()
    with pytest.raises(PreprocessError):
        run(good + ["oops"])
    assert (out_dir / "x_text_document.idx").read_bytes() == before
    assert sorted(p.name for p in out_dir.iterdir()) == ["x_text_document.bin", "x_text_document.idx"]

    # the CLI turns it into an error message and exit status 1
    src = tmp_path / "cli.jsonl"
    src.write_text('{"text": "a"}\nnope\n', encoding="utf-8")
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type",
                          "ByteTokenizer", "--quiet"])
    assert rc == 1 and f"{src}:2: not valid JSON" in capsys.readouterr().err


def test_sentencepiece_from_jsonl_then_preprocess(tmp_path: Path) -> None:
    docs = [p for chapter in read_corpus()[:3] for p in chapter.split("\n\n") if p.strip()][:300]
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    model = train_sentencepiece_from_jsonl(src, str(tmp_path / "tok"), vocab_size=400)
    res = preprocess_jsonl(src, tmp_path / "sp", tokenizer_type="SentencePieceTokenizer", tokenizer_model=model,
                           append_eod=True, workers=2, progress=False)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    ds = IndexedDataset(res.outputs["text"])
    assert len(ds) == len(docs)
    for i in (0, 7, len(docs) - 1):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.decode(ids) == docs[i]


def test_train_tokenizer_cli_on_the_shipped_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m lightning_megatron.data.train_tokenizer``: reads the JSONL's text (skipping bad lines, up to
    --max-documents), writes the same model as training on exactly those documents, and round-trips text."""
    docs = [p for chapter in read_corpus()[:2] for p in chapter.split("\n\n") if p.strip()][:120]
    src = tmp_path / "c.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        f.write("not json\n\n[1, 2]\n")  # skipped: not JSON, blank, not an object
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "id": i}) + "\n")
    assert list(train_tokenizer.iter_jsonl_texts(src, max_documents=100)) == docs[:100]
    rc = train_tokenizer.main(["--input", str(src), "--model-prefix", str(tmp_path / "cli"), "--vocab-size", "400",
                               "--max-documents", "100"])
    assert rc == 0 and "wrote" in capsys.readouterr().err
    direct = train_sentencepiece(docs[:100], str(tmp_path / "direct"), vocab_size=400)
    assert (tmp_path / "cli.model").read_bytes() == Path(direct).read_bytes()
    tok = build_tokenizer("SentencePieceTokenizer", tmp_path / "cli.model")
    assert tok.vocab_size == 400 and tok.eod == 2
    for text in (docs[0], docs[119], "Unseen: naïve 漢字 🙂\n\ttabs  and   spaces"):
        ids = tok.encode(text)
        assert all(0 <= i < 400 for i in ids) and tok.decode(ids + [tok.eod]) == text
    plain = "The compiler checks that every reference is valid before the program runs."
    assert len(tok.encode(plain)) < 0.8 * len(plain)  # it learned pieces, not bytes (measured: 48 for 74 bytes)
    # list values under several keys
    multi = write_jsonl(tmp_path / "m.jsonl", ["a"])
    multi.write_text(json.dumps({"text": "a", "extra": ["b", 3, "c"]}) + "\n", encoding="utf-8")
    assert list(train_tokenizer.iter_jsonl_texts(multi, json_keys=("text", "extra"))) == ["a", "b", "c"]
    # no text under the key: exit code 1 and the reason
    rc = train_tokenizer.main(["--input", str(multi), "--model-prefix", str(tmp_path / "x"), "--json-keys", "body"])
    assert rc == 1
    assert "no text under keys ['body']" in capsys.readouterr().err
    assert not (tmp_path / "x.model").exists()


def test_tokenizer_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="needs a tokenizer model"):
        build_tokenizer("SentencePieceTokenizer")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer("HuggingFaceTokenizer", "tokenizer.json")


def _hf_tokenizer_file(directory: Path, specials: list[str]) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained here on part of the shipped corpus (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(read_corpus()[:2], trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def test_huggingface_tokenizer_local_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    path = _hf_tokenizer_file(tmp_path / "hf", ["<unk>", "<|endoftext|>"])
    raw = HFTokenizer.from_file(str(path))
    for source in (path, path.parent):  # the file or its directory
        tok = build_tokenizer("HuggingFaceTokenizer", source)
        assert isinstance(tok, HuggingFaceTokenizer)
        assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 500
        assert tok.eod == raw.token_to_id("<|endoftext|>") == 1
    text = "Ownership is Rust's most unique feature — déjà vu, 42 €.\n\nNext  paragraph."
    ids = tok.encode(text)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.eod not in ids and all(0 <= i < tok.vocab_size for i in ids)
    plain = "The compiler checks that every reference is valid before the program runs."
    assert len(tok.encode(plain)) < 0.8 * len(plain)  # merges learned from the corpus
    assert tok.decode(ids) == text and tok.decode(ids + [tok.eod]) == text
    # the eos of a tokenizer_config.json beside the file wins over the built-in candidates
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    assert HuggingFaceTokenizer(path).eod == 0
    assert HuggingFaceTokenizer(path, eod_token="<|endoftext|>").eod == 1
    # preprocessing with it: each document's ids then the eod (now <unk>, id 0, from tokenizer_config.json)
    src = write_jsonl(tmp_path / "d.jsonl", [text, "second"])
    res = preprocess_jsonl(src, tmp_path / "out" / "hf", tokenizer_type="HuggingFaceTokenizer",
                           tokenizer_model=path, append_eod=True, progress=False)
    ds = IndexedDataset(res.outputs["text"])
    assert ds[0].tolist() == ids + [0] and ds[1].tolist() == tok.encode("second") + [0]


def test_huggingface_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Hugging Face tokenizer file"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path)
    path = _hf_tokenizer_file(tmp_path / "noeod", ["<unk>"])
    with pytest.raises(ValueError, match="no end-of-document token"):
        HuggingFaceTokenizer(path)


def test_huggingface_tokenizer_sentencepiece_model_and_unreadable_files(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory's SentencePiece ``tokenizer.model`` is read with sentencepiece (the same ids as
    SentencePieceTokenizer); a ``.model`` that is not SentencePiece (Llama 3's is tiktoken text) or a
    ``tokenizer.json`` that is not one is a ValueError naming the file to give, and preprocessing with it
    exits 1 with one ``error:`` line, no traceback."""
    model = Path(train_sentencepiece(read_corpus()[:2], str(tmp_path / "hf" / "tokenizer"), vocab_size=400))
    ref = build_tokenizer("SentencePieceTokenizer", model)
    text = "Ownership is Rust's most unique feature.\nNext line."
    for source in (model, model.parent):   # the file, or a directory with tokenizer.model and no tokenizer.json
        tok = build_tokenizer("HuggingFaceTokenizer", source)
        assert isinstance(tok, HuggingFaceTokenizer)
        assert (tok.vocab_size, tok.eod, tok.encode(text)) == (ref.vocab_size, ref.eod, ref.encode(text))
        assert tok.decode(tok.encode(text) + [tok.eod]) == text
    (model.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    assert HuggingFaceTokenizer(model).eod == 1   # <s>, named beside the model
    tiktoken = tmp_path / "llama3" / "tokenizer.model"
    tiktoken.parent.mkdir()
    tiktoken.write_text("IQ== 0\nIg== 1\nIw== 2\n")   # tiktoken's format: base64 token, rank
    with pytest.raises(ValueError, match=r"is not a SentencePiece model .*give the tokenizer.json"):
        HuggingFaceTokenizer(tiktoken)
    pytest.importorskip("tokenizers")
    bad_json = tmp_path / "bad" / "tokenizer.json"
    bad_json.parent.mkdir()
    bad_json.write_bytes(model.read_bytes())   # a binary file under the JSON name
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        HuggingFaceTokenizer(bad_json)
    src = write_jsonl(tmp_path / "d.jsonl", ["some text"])
    for bad in (tiktoken, bad_json):
        rc = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "x"), "--tokenizer-type",
                              "HuggingFaceTokenizer", "--tokenizer-model", str(bad), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 1 and err.startswith("error: ") and "Traceback" not in err and str(bad) in err, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------- GPTDataset indices
def reference_sample_index(sizes: np.ndarray, doc_index: np.ndarray, s: int, epochs: int, tokens: int) -> np.ndarray:
    """Straight port of the loop of Megatron's build_sample_idx (drop last partial, one extra token)."""
    n = (epochs * tokens - 1) // s
    out = [(0, 0)]
    d, off = 0, 0
    while len(out) <= n:
        remaining = s + 1
        while remaining != 0:
            length = int(sizes[doc_index[d]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            else:
                d += 1
                off = 0
        out.append((d, off))
    return np.array(out)


def test_sample_index_matches_megatron_loop() -> None:
    rng = np.random.RandomState(0)
    for trial in range(20):
        sizes = rng.randint(0, 40, size=rng.randint(1, 30)).astype(np.int32)
        sizes[rng.randint(len(sizes))] += 5
        epochs = rng.randint(1, 4)
        doc_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_index)
        tokens = int(sizes.sum())
        s = int(rng.randint(1, 25))
        if epochs * tokens - 1 < s:
            continue
        ours = build_sample_index(sizes, doc_index, s, epochs, tokens)
        np.testing.assert_array_equal(ours, reference_sample_index(sizes, doc_index, s, epochs, tokens), f"{trial}")


def test_gpt_dataset_epochs_determinism_and_cache(tmp_path: Path) -> None:
    texts = make_texts(40, seed=3)
    indexed = IndexedDataset(preprocess(tmp_path, texts))
    s = 16
    per_epoch = (indexed.num_tokens - 1) // s
    n = 2 * per_epoch + per_epoch // 2  # 3 epochs, the last one used for half: shuffled separately
    cache = tmp_path / "cache"
    a = GPTDataset(indexed, s, n, seed=5, cache_dir=cache)
    assert a.built_anew and a.num_epochs == 3 and len(a) >= n
    docs = np.arange(len(indexed))
    assert np.array_equal(np.sort(a.document_index), np.repeat(docs, 3))  # every document once per epoch
    last = np.asarray(a.document_index[-len(indexed):])
    assert np.array_equal(np.sort(last), docs)  # separate last epoch is a permutation of its own
    samples_before_last = (2 * indexed.num_tokens - 1) // s
    assert np.array_equal(np.sort(a.shuffle_index[:samples_before_last]), np.arange(samples_before_last))
    # samples are consecutive windows of the document-index stream (across epoch boundaries)
    stream = np.concatenate([indexed[int(i)] for i in a.document_index]).astype(np.int64)
    for j in [0, 1, per_epoch - 1, per_epoch, n - 1]:
        i = int(a.shuffle_index[j])
        np.testing.assert_array_equal(a.sample_tokens(j), stream[i * s : i * s + s + 1])
    # the same random stream as Megatron's _build_document_index / _build_shuffle_index
    ref_rng = np.random.RandomState(5)
    first = np.mgrid[0:2, 0 : len(docs)][1].reshape(-1).astype(np.int32)
    ref_rng.shuffle(first)
    last_ref = docs.astype(np.int32).copy()
    ref_rng.shuffle(last_ref)
    np.testing.assert_array_equal(a.document_index, np.concatenate([first, last_ref]))
    ref_shuffle = np.arange(samples_before_last, dtype=np.uint32)
    ref_rng.shuffle(ref_shuffle)
    np.testing.assert_array_equal(a.shuffle_index[:samples_before_last], ref_shuffle)
    # cache: three .npy named by the md5 of the parameters, reused by the next construction
    names = sorted(p.name for p in cache.iterdir())
    assert len(names) == 4 and all(x.startswith(f"{a.description_hash}-GPTDataset-train-") for x in names)
    b = GPTDataset(indexed, s, n, seed=5, cache_dir=cache)
    assert not b.built_anew
    assert all(np.array_equal(x, y) for x, y in zip(
        (a.document_index, a.sample_index, a.shuffle_index), (b.document_index, b.sample_index, b.shuffle_index)))
    c = GPTDataset(indexed, s, n, seed=6, cache_dir=cache)
    assert c.built_anew and not np.array_equal(a.shuffle_index, c.shuffle_index)
    # default cache location: beside the data
    GPTDataset(indexed, s, 10, seed=5)
    assert any((Path(indexed.prefix).parent / "cache" / "GPTDataset_indices").glob("*-document_index.npy"))


def test_gpt_dataset_items_and_masks(tmp_path: Path) -> None:
    indexed = IndexedDataset(preprocess(tmp_path, make_texts(20, seed=4)))
    ds = GPTDataset(indexed, 24, 30, seed=1, cache_dir=False)
    item = ds[3]
    assert set(item) == KEYS
    assert item["tokens"].dtype == torch.long and item["tokens"].shape == (24,)
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert torch.equal(item["loss_mask"], torch.ones(24)) and torch.equal(item["position_ids"], torch.arange(24))
    masked = GPTDataset(indexed, 24, 30, seed=1, cache_dir=False, eod_mask_loss=True, eod_id=ByteTokenizer.EOD)
    for j in range(len(masked)):
        it = masked[j]
        assert torch.equal(it["loss_mask"] == 0, it["tokens"] == ByteTokenizer.EOD)
    with pytest.raises(ValueError, match="fewer than the seq_length"):
        GPTDataset(indexed, 10_000, 1, cache_dir=False)
    with pytest.raises(ValueError, match="reset_attention_mask=True needs eod_id"):
        GPTDataset(indexed, 24, 30, cache_dir=False, reset_attention_mask=True)
    with pytest.raises(ValueError, match="empty"):
        GPTDataset(indexed, 8, 1, document_range=(5, 5), cache_dir=False)


def test_gpt_dataset_reset_position_ids_and_attention_mask(tmp_path: Path) -> None:
    """Megatron's --reset-position-ids / --reset-attention-mask: the token after an eod input starts a new document
    at position 0; ``document_ids`` counts the eods before each position."""
    indexed = IndexedDataset(preprocess(tmp_path, make_texts(20, seed=4)))
    eod = ByteTokenizer.EOD
    packed = GPTDataset(indexed, 24, 30, seed=1, cache_dir=False, eod_id=eod, reset_position_ids=True,
                        reset_attention_mask=True)
    plain = GPTDataset(indexed, 24, 30, seed=1, cache_dir=False)
    crossed = 0
    for j in range(len(packed)):
        it, ref = packed[j], plain[j]
        assert torch.equal(it["tokens"], ref["tokens"]) and torch.equal(it["labels"], ref["labels"])
        tokens, docs, pos = it["tokens"].tolist(), it["document_ids"].tolist(), it["position_ids"].tolist()
        doc = start = 0
        for i, token in enumerate(tokens):   # the rule, token by token
            assert docs[i] == doc and pos[i] == i - start
            if token == eod:
                doc, start = doc + 1, i + 1
        crossed += docs[-1] > 0
    assert crossed > 0   # the test data packs several documents into a sample
    only_positions = GPTDataset(indexed, 24, 30, seed=1, cache_dir=False, eod_id=eod, reset_position_ids=True)[3]
    assert "document_ids" not in only_positions
    assert torch.equal(only_positions["position_ids"], packed[3]["position_ids"])
    assert torch.equal(positions_in_documents(torch.tensor([[0, 0, 1, 1, 1, 4]])), torch.tensor([[0, 1, 0, 1, 2, 0]]))
    assert torch.equal(document_ids_after_eod(torch.tensor([5, 9, 5, 5, 9]), 9), torch.tensor([0, 0, 1, 1, 1]))


# ----------------------------------------------------------------------------- blending / splits
def test_blending_indices_hold_ratios_within_one_sample() -> None:
    for weights in ([0.3, 0.7], [0.5, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]):
        idx, sample = build_blending_indices(weights, 2000)
        onehot = np.eye(len(weights), dtype=np.int64)[idx]
        counts = np.cumsum(onehot, axis=0)  # counts after n+1 samples
        n = np.arange(1, 2001)[:, None]
        assert np.abs(counts - n * np.asarray(weights)[None, :]).max() <= 1.0
        for i in range(len(weights)):  # each dataset's samples are taken in order 0, 1, 2, ...
            assert np.array_equal(sample[idx == i], np.arange((idx == i).sum()))


def test_blended_data_path_through_datamodule(tmp_path: Path) -> None:
    a = preprocess(tmp_path, ["a" * (20 + i % 7) for i in range(40)], name="a")
    b = preprocess(tmp_path, ["b" * (15 + i % 5) for i in range(40)], name="b")
    assert parse_data_path(["30", a, "70", b + ".bin"]) == ([a, b], [0.3, 0.7])
    dm = GPTDataModule([0.3, a, 0.7, b], seq_length=8, micro_batch_size=4, global_batch_size=8, split="1,0,0",
                       train_iters=25, eval_iters=0, num_workers=0, cache_dir=tmp_path / "cache")
    dm.setup("fit")
    blend = dm.datasets["train"]
    assert isinstance(blend, BlendedDataset) and len(blend) >= 200
    from_a = 0
    for j in range(200):
        toks = set(blend[j]["tokens"].tolist()) - {ByteTokenizer.EOD}
        assert toks in ({ord("a")}, {ord("b")})
        from_a += toks == {ord("a")}
        assert abs(from_a - 0.3 * (j + 1)) <= 1.0
    batches = list(dm.train_dataloader())
    assert len(batches) == 50 and batches[0]["tokens"].shape == (4, 8)


def test_split_ranges_megatron_rule(tmp_path: Path) -> None:
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("969, 30, 1", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("8,1,1", 10) == [(0, 8), (8, 9), (9, 10)]
    assert split_ranges("98,2", 100) == [(0, 98), (98, 100), None]
    assert split_ranges([1, 0, 0], 7) == [(0, 7), None, None]
    with pytest.raises(ValueError, match="at most three"):
        split_ranges("1,1,1,1", 10)
    prefix = preprocess(tmp_path, make_texts(50, seed=5))
    dm = GPTDataModule(prefix, seq_length=8, micro_batch_size=2, global_batch_size=2, split="8,1,1",
                       train_iters=3, eval_iters=2, num_workers=0, cache_dir=tmp_path / "cache")
    dm.setup()
    n_seq = len(IndexedDataset(prefix))
    for name, rng in zip(("train", "valid", "test"), split_ranges("8,1,1", n_seq)):
        ds = dm.datasets[name]
        assert isinstance(ds, GPTDataset) and ds.document_range == rng
        assert set(np.unique(ds.document_index)) == set(range(*rng))
    assert len(list(dm.val_dataloader())) == 2 and len(list(dm.test_dataloader())) == 2


# ----------------------------------------------------------------------------- GPTDataModule
def datamodule(prefix: str, tmp: Path, **kw: Any) -> GPTDataModule:
    args: dict[str, Any] = dict(seq_length=8, micro_batch_size=2, global_batch_size=8, split="1,0,0", train_iters=6,
                                eval_iters=0, num_workers=0, cache_dir=tmp / "cache")
    args.update(kw)
    return GPTDataModule(prefix, **args)


def test_batch_arithmetic_errors(tmp_path: Path) -> None:
    assert compute_num_microbatches(32, 2, 4) == 4
    with pytest.raises(ValueError, match=r"global_batch_size \(30\) is not divisible by micro_batch_size \(2\) x "
                                         r"data-parallel size \(4\) = 8"):
        compute_num_microbatches(30, 2, 4)
    prefix = preprocess(tmp_path, make_texts(30, seed=6))
    dm = datamodule(prefix, tmp_path, global_batch_size=12)
    dm.trainer = fake_trainer(dp=4, accumulate=1)  # 12 % (2*4) != 0
    with pytest.raises(ValueError, match=r"global_batch_size \(12\).*= 8"):
        dm.setup("fit")
    dm = datamodule(prefix, tmp_path, global_batch_size=16)
    assert dm.num_microbatches == 8  # before setup: dp assumed 1
    dm.trainer = fake_trainer(dp=2, accumulate=2)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) disagrees .*num_microbatches=4"):
        dm.setup("fit")
    dm.trainer = fake_trainer(dp=2, accumulate=4)
    dm.setup("fit")
    assert dm.num_microbatches == 4


def test_sampler_shards_by_dp_rank_and_lightning_keeps_it(tmp_path: Path) -> None:
    prefix = preprocess(tmp_path, make_texts(40, seed=7))
    seen: dict[int, list[list[int]]] = {}
    for rank in range(2):
        dm = datamodule(prefix, tmp_path)
        dm.trainer = fake_trainer(dp=2, rank=rank, accumulate=2)
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)  # Lightning leaves it alone
        seen[rank] = [b["tokens"][:, 0].tolist() for b in loader]
    single = datamodule(prefix, tmp_path, micro_batch_size=4)
    single.trainer = fake_trainer(dp=1, accumulate=2)
    single.setup("fit")
    whole = [b["tokens"][:, 0].tolist() for b in single.train_dataloader()]
    # global micro-batch g = rank 0's micro-batch g followed by rank 1's
    assert len(whole) == len(seen[0]) == len(seen[1]) == 6 * 8 // 4
    assert whole == [seen[0][g] + seen[1][g] for g in range(len(whole))]
    s = MegatronPretrainingSampler(range(100), total_samples=40, micro_batch_size=2, num_replicas=2, rank=1,
                                   consumed_samples=8, step_samples=8)
    assert len(s) == 20 and list(s)[:4] == [10, 11, 14, 15] and list(s)[:2] == [2, 3]  # resume once, then from 0


def test_resume_gives_next_unseen_sample_simulated(tmp_path: Path) -> None:
    prefix = preprocess(tmp_path, make_texts(40, seed=8))
    micro, dp, gbs = 2, 2, 8  # 2 micro-batches per step per rank

    def batches(rank: int, dm: GPTDataModule) -> list[torch.Tensor]:
        return [b["tokens"] for b in dm.train_dataloader()]

    for rank in range(dp):
        full_dm = datamodule(prefix, tmp_path, micro_batch_size=micro, global_batch_size=gbs)
        full_dm.trainer = fake_trainer(dp, rank, accumulate=2)
        full_dm.setup("fit")
        full = batches(rank, full_dm)
        for k_steps in (1, 4):
            dm = datamodule(prefix, tmp_path, micro_batch_size=micro, global_batch_size=gbs)
            dm.trainer = fake_trainer(dp, rank, accumulate=2, global_step=0)
            dm.setup("fit")
            it = iter(dm.train_dataloader())
            consumed = [next(it)["tokens"] for _ in range(2 * k_steps)]
            assert all(torch.equal(x, y) for x, y in zip(consumed, full))
            dm.trainer.global_step = k_steps  # the optimizer stepped k times
            state = dm.state_dict()
            assert state["consumed_samples"] == k_steps * gbs
            resumed = datamodule(prefix, tmp_path, micro_batch_size=micro, global_batch_size=gbs)
            resumed.trainer = fake_trainer(dp, rank, accumulate=2, global_step=k_steps)
            resumed.setup("fit")
            resumed.load_state_dict(state)
            nxt = next(iter(resumed.train_dataloader()))["tokens"]
            assert torch.equal(nxt, full[2 * k_steps])
            assert resumed.state_dict()["consumed_samples"] == k_steps * gbs


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["tokens"][:, :6].flatten().tolist())
        return (self.w * batch["tokens"].float().mean()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_resume_with_lightning_trainer_checkpoint(tmp_path: Path) -> None:
    """Real Trainer: k steps, save, resume from the checkpoint in a fresh process state -> same batches as
    an uninterrupted run, including across the end of a pass over the data (train_iters=5 < max_steps)."""
    prefix = preprocess(tmp_path, make_texts(40, seed=9))

    def run(max_steps: int, ckpt: str | None = None, save: str | None = None) -> tuple[list[Any], GPTDataModule]:
        dm = datamodule(prefix, tmp_path, micro_batch_size=2, global_batch_size=4, train_iters=5)
        model = _Recorder()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return model.seen, dm

    full, _ = run(7)
    assert len(full) == 14 and full[:10] != full[10:]
    assert full[10:] == full[:4]  # the second pass starts again at sample 0
    ckpt = str(tmp_path / "k.ckpt")
    first, dm = run(3, save=ckpt)
    assert torch.load(ckpt, weights_only=True)["GPTDataModule"]["consumed_samples"] == 12
    second, dm = run(7, ckpt=ckpt)
    assert first + second == full
    assert dm.state_dict()["consumed_samples"] == 28


# ----------------------------------------------------------------------------- real gloo processes
class _BatchRecorder(L.Callback):
    def __init__(self) -> None:
        self.tokens: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.tokens.append(batch["tokens"][:, :6].flatten().tolist())


def _distributed_worker(rank: int, world: int, prefix: str, cache: str) -> dict[str, Any]:
    from lightning_megatron import MegatronStrategy
    from tests.parity import new_module, tiny_config, trainer_for

    L.seed_everything(1234, verbose=False)
    dm = GPTDataModule(prefix, seq_length=16, micro_batch_size=2, global_batch_size=8, split="1,0,0", train_iters=3,
                       eval_iters=0, num_workers=0, cache_dir=cache)
    recorder = _BatchRecorder()
    trainer = trainer_for(world, MegatronStrategy(tp=1), 3, callbacks=[recorder], accumulate_grad_batches=2)
    trainer.fit(new_module(tiny_config(num_layers=1, vocab_size=257), 3), datamodule=dm)
    return {"tokens": recorder.tokens, "dp": dm.data_parallel_size, "rank": dm.data_parallel_rank,
            "sampler": type(trainer.train_dataloader.sampler).__name__, "state": dm.state_dict()}


def test_megatron_strategy_dp2_keeps_sampler_and_shards(tmp_path: Path) -> None:
    from tests._dist import run_distributed

    prefix = preprocess(tmp_path, make_texts(60, seed=10))
    results = run_distributed(_distributed_worker, 2, prefix, str(tmp_path / "cache"))
    single = GPTDataModule(prefix, seq_length=16, micro_batch_size=4, global_batch_size=8, split="1,0,0",
                           train_iters=3, eval_iters=0, num_workers=0, cache_dir=tmp_path / "cache")
    single.trainer = fake_trainer(accumulate=2)
    single.setup("fit")
    whole = [b["tokens"][:, :6] for b in single.train_dataloader()]
    for r, res in enumerate(results):
        assert (res["dp"], res["rank"], res["sampler"]) == (2, r, "MegatronPretrainingSampler")
        assert res["state"]["consumed_samples"] == 3 * 8
        assert res["tokens"] == [w[2 * r : 2 * r + 2].flatten().tolist() for w in whole]
