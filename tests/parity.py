"""Shared pieces of the end-to-end numerics oracle: the same model, data and optimizer in one process
(the reference) and under MegatronStrategy in several gloo processes."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule

SEED = 1234
LR = 1e-3


def tiny_config(**overrides: Any) -> GPTConfig:
    """Tiny LLaMA-style model; vocab 200 so the embedding is padded differently at every tp."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                vocab_size=200, seq_length=16)
    base.update(overrides)
    return GPTConfig(**base)


def make_samples(cfg: GPTConfig, n: int, seed: int = 7) -> List[Dict[str, torch.Tensor]]:
    """``n`` fixed samples with a loss mask that drops some tokens (tests the global token-mean)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (cfg.seq_length + 1,), generator=g)
        mask = (torch.rand(cfg.seq_length, generator=g) > 0.2).float()
        out.append({"tokens": ids[:-1], "labels": ids[1:], "loss_mask": mask,
                    "position_ids": torch.arange(cfg.seq_length)})
    return out


class ListDataset(Dataset):
    def __init__(self, samples: List[Dict[str, torch.Tensor]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.samples[i]


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def lightning_train_order(n: int) -> List[int]:
    """Sample order of Lightning's injected ``DistributedSampler`` (shuffled with the global seed, epoch 0).

    Data-parallel rank r takes ``order[r::dp]``, so global batch i is ``order[i*B:(i+1)*B]`` as a set.
    """
    g = torch.Generator().manual_seed(SEED)
    return torch.randperm(n, generator=g).tolist()


def new_module(cfg: GPTConfig, steps: int) -> ParallelGPTModule:
    return ParallelGPTModule(cfg, lr=LR, min_lr=LR / 10, lr_warmup_iters=1, lr_decay_iters=steps, weight_decay=0.1)


def reference_run(cfg: GPTConfig, samples, steps: int, global_batch: int, clip: Optional[float] = None):
    """Single process, plain loop: per-step loss (global token-mean) and final state dict."""
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps)
    module.configure_model()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    losses = []
    order = lightning_train_order(len(samples))
    for step in range(steps):
        batch = collate([samples[i] for i in order[step * global_batch:(step + 1) * global_batch]])
        loss_sum, count = module.loss_sum_and_count(batch)
        loss = loss_sum / count
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def trainer_for(world: int, strategy: MegatronStrategy, steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **kwargs)


def parallel_run(rank: int, world: int, cfg: GPTConfig, strategy_kwargs: Dict[str, Any], samples, steps: int,
                 micro_batch: int, clip: Optional[float] = None) -> Dict[str, Any]:
    """One rank of the same training under MegatronStrategy via a real Trainer."""
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps)
    recorder = LossRecorder()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, callbacks=[recorder],
                          gradient_clip_val=clip)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "state": state if rank == 0 else None}


def assert_state_close(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """Every tensor within ``rtol`` of the reference: ``||a - e|| / ||e||`` (Frobenius norms)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for k, e in expected.items():
        a = actual[k]
        assert a.shape == e.shape, (k, a.shape, e.shape)
        err = (a.float() - e.float()).norm() / e.float().norm().clamp(min=1e-12)
        assert err <= rtol, f"{k}: relative error {err:.3e} > {rtol}"
