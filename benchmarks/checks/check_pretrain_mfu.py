"""GPU check of MFUMonitor: the benchmark model trained from preprocessed data through ``examples/pretrain_gpt.py``
with ``MFUMonitor``, its logged tokens/s and MFU compared with an independent measurement in the same run.

    python benchmarks/checks/check_pretrain_mfu.py [--model bench|tiny] [--accelerator gpu|cpu] [--iters 60]

Steps (all in a temporary directory):
1. JSONL from the shipped corpus (one paragraph per line) -> ``python -m lightning_megatron.data.preprocess
   --tokenizer-type ByteTokenizer --append-eod`` -> ``train_text_document.bin/.idx``.
2. ``examples/pretrain_gpt.py`` on that data with the 1.3B benchmark model's shape (``NullTokenizer
   --vocab-size 31999``: 32000 embedding rows, as the benchmark model), bf16, micro = global batch 4,
   ``--log-interval 5``. It runs as a child process; this script stamps every ``iteration`` line with
   ``time.perf_counter()`` as it arrives (the printer reads the loss, which synchronises the GPU).
3. Independent tokens/s = tokens between two logged iterations / time between their lines; it is compared with
   the mean of ``tokens_per_sec`` that MFUMonitor logged for the same iterations, and the MFU implied by the
   independent rate (logged ``mfu`` x ratio) with the logged ``mfu``. Prints one JSON line; ``ok`` when they
   agree within 3%.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
         "--num-query-groups", "8", "--ffn-hidden-size", "5632", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--rotary-base", "500000"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "128", "--max-position-embeddings", "128"]
LINE = re.compile(r"iteration\s+(\d+)/")


def write_jsonl(path: Path) -> int:
    from lightning_megatron.data.corpus import read_corpus

    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in read_corpus():
            for para in doc.split("\n\n"):
                if para.strip():
                    f.write(json.dumps({"text": para}) + "\n")
                    n += 1
    return n


def metrics_of(line: str) -> dict:
    out = {}
    for part in line.split("|"):
        bits = part.strip().rsplit(" ", 1)
        if len(bits) == 2:
            try:
                out[bits[0]] = float(bits[1])
            except ValueError:
                pass
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["bench", "tiny"], default="bench")
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--from-iter", type=int, default=20, help="first logged iteration of the compared window")
    a = p.parse_args()
    model_flags = BENCH if a.model == "bench" else TINY
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = write_jsonl(tmp / "train.jsonl")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "lightning_megatron.data.preprocess", "--input", str(tmp / "train.jsonl"),
                        "--output-prefix", str(tmp / "data" / "train"), "--tokenizer-type", "ByteTokenizer",
                        "--append-eod", "--workers", "4", "--quiet"], check=True, env=env)
        prep_s = time.perf_counter() - t0
        cmd = [sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), "--accelerator", a.accelerator,
               "--devices", "1", "--tensor-model-parallel-size", "1", *model_flags,
               "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.mbs), "--train-iters", str(a.iters),
               "--lr", "1e-4", "--lr-warmup-iters", "5", "--bf16", "--data-path", str(tmp / "data" / "train_text_document"),
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "31999", "--log-interval", "5", "--eval-iters", "0",
               "--data-cache-path", str(tmp / "cache")]
        print("command:", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        stamps, logged = {}, {}
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter()
            m = LINE.search(line)
            if m:
                it = int(m.group(1))
                stamps[it], logged[it] = now, metrics_of(line)
                print(line.rstrip(), flush=True)
            elif "Error" in line or "Traceback" in line or line.startswith(("layout", "done", "note")):
                print(line.rstrip(), flush=True)
        rc = proc.wait()
        if rc != 0:
            raise SystemExit(f"pretrain_gpt.py exited with {rc}")
    its = sorted(i for i in stamps if i >= a.from_iter)
    first, last = its[0], its[-1]
    seq = int(model_flags[model_flags.index("--seq-length") + 1])
    tokens = (last - first) * a.mbs * seq
    independent = tokens / (stamps[last] - stamps[first])
    window = [logged[i] for i in its[1:] if "tokens_per_sec" in logged[i]]
    logged_tps = sum(m["tokens_per_sec"] for m in window) / len(window)
    logged_mfu = sum(m.get("mfu", float("nan")) for m in window) / len(window)
    ratio = independent / logged_tps
    print(json.dumps(dict(check="pretrain_gpt-mfu", model=a.model, documents=docs, preprocess_s=round(prep_s, 1),
                          iterations=[first, last], independent_tokens_per_s=round(independent),
                          logged_tokens_per_s=round(logged_tps), logged_mfu=round(logged_mfu, 4),
                          independent_mfu=round(logged_mfu * ratio, 4), rel_diff=round(abs(ratio - 1), 4),
                          ok=abs(ratio - 1) < 0.03)), flush=True)


if __name__ == "__main__":
    main()
