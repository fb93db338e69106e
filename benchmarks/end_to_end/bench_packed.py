"""Packed sequences on one GPU: a training step with document-masked attention against the full-causal one.

At seq 8192 with documents of 1024 tokens, the step of our ``GPTModel`` (bf16 weights, fused AdamW) with the batch's
``document_ids`` (FlexAttention with a document-causal block mask, ``lightning_megatron.models.attention``) and
without them (causal SDPA, cuDNN), and in the same run the peer: a plain PyTorch LLaMA block stack compiled whole with
``torch.compile``, attention by ``flex_attention`` with the block-causal mask of the same documents, against the same
stack with a plain causal mask. Prints one line per case (ms per step, tokens/s) for benchmarks/RESULTS.md.

    python benchmarks/end_to_end/bench_packed.py                      # H200: 1.3B-like model, seq 8192, documents of 1024
    python benchmarks/end_to_end/bench_packed.py --device cpu --tiny  # a smoke run of our two cases (numbers mean nothing)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from lightning_megatron import GPTConfig, GPTModel


def timed(step, device: torch.device, iters: int, warmup: int) -> float:
    """Mean milliseconds of ``step()`` over ``iters`` calls after ``warmup``."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / iters


def _built(model_class, cfg: GPTConfig, device: torch.device):
    """``model_class(cfg)`` on ``device`` (seed 0; bf16 weights on CUDA) and its AdamW (fused on CUDA)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(cfg)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")


def ours(cfg: GPTConfig, tokens, labels, positions, documents, device, iters, warmup) -> float:
    """One optimizer step of ``GPTModel`` (bf16 weights on CUDA, fused AdamW), with ``documents`` or without."""
    model, opt = _built(GPTModel, cfg, device)

    def step():
        loss = model(tokens, positions, labels, document_ids=documents).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, device, iters, warmup)


class PeerBlock(nn.Module):
    """Plain PyTorch LLaMA block (RMSNorm, GQA attention by ``flex_attention``, SwiGLU); no RoPE (the same for both
    peer cases: it does not change the attention work)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h, self.n, self.g = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
        self.d = h // self.n
        self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.qkv = nn.Linear(h, (self.n + 2 * self.g) * self.d, bias=False)
        self.o = nn.Linear(self.n * self.d, h, bias=False)
        self.gu = nn.Linear(h, 2 * cfg.ffn_hidden_size, bias=False)
        self.dn = nn.Linear(cfg.ffn_hidden_size, h, bias=False)

    def forward(self, x, block_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.n * self.d, self.g * self.d, self.g * self.d], -1)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))
        a = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gu(self.n2(x)).chunk(2, -1)
        return x + self.dn(F.silu(gate) * up)


class Peer(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(PeerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, labels, block_mask):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, block_mask)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def peer(cfg: GPTConfig, tokens, labels, documents, device, iters, warmup, compile_: bool) -> float:
    """One optimizer step of the plain PyTorch peer, compiled whole; ``documents`` None: causal block mask."""
    model, opt = _built(Peer, cfg, device)
    b, s = tokens.shape
    if documents is None:
        def mask_mod(bi, h, qi, ki):
            return qi >= ki
    else:
        def mask_mod(bi, h, qi, ki):
            return (qi >= ki) & (documents[bi, qi] == documents[bi, ki])
    block_mask = create_block_mask(mask_mod, b, None, s, s, device=device)
    run = torch.compile(model) if compile_ else model

    def step():
        run(tokens, labels, block_mask).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, device, iters, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and sequence (smoke run)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--document", type=int, default=1024, help="tokens per document")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        vocab_size=256, seq_length=256)
        seq, document = 256, 64
    else:
        cfg = GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
                        ffn_hidden_size=5632, vocab_size=32000, seq_length=args.seq, swiglu=True,
                        normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                        untie_embeddings_and_output_weights=True)
        seq, document = args.seq, args.document
    if seq % document:
        raise ValueError(f"--seq {seq} must be a multiple of --document {document}")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=g).to(device)
    labels = torch.randint(0, cfg.vocab_size, (1, seq), generator=g).to(device)
    documents = (torch.arange(seq) // document).unsqueeze(0).to(device)
    positions = (torch.arange(seq) % document).unsqueeze(0).to(device)
    tokens_per_step = seq
    rows = [
        ("ours document-masked (flex on CUDA)", ours(cfg, tokens, labels, positions, documents, device, args.iters,
                                                     args.warmup)),
        ("ours full causal (SDPA)", ours(cfg, tokens, labels, None, None, device, args.iters, args.warmup)),
    ]
    compile_ = device.type == "cuda"
    if device.type != "cuda":   # FlexAttention has no backward on the CPU
        print("# the peer runs on CUDA only (FlexAttention has no CPU backward)")
    else:
        rows += [
            ("peer document-masked (flex, compiled)", peer(cfg, tokens, labels, documents, device, args.iters,
                                                           args.warmup, compile_)),
            ("peer full causal (flex, compiled)", peer(cfg, tokens, labels, None, device, args.iters, args.warmup,
                                                       compile_)),
        ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, seq {seq}, documents of {document}, {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}")
    for label, ms in rows:
        print(f"{label:40s} {ms:9.1f} ms/step {tokens_per_step / ms * 1e3:12.0f} tokens/s")


if __name__ == "__main__":
    main()
