"""The planner's byte accounting against what the strategy really allocates, on CPU with gloo (no torch.cuda):
for each rank of tp2 x pp2 and of tp2+SP x dp2 with the distributed optimizer, and of tp2+SP x dp2 under FSDP
(``optim_grads``, ``optim_grads_params``), after training steps, the bytes of the rank's parameters, gradients and
optimizer states (sum of numel x element size of the local shards: FSDP's DTensors count their local part, Adam's
moments and step counters) equal ``lightning_megatron.planner.state_bytes`` of that rank exactly; also with the
precision-aware optimizer's bf16 moments (``moment_bytes=4``) under the distributed optimizer and FSDP."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.planner import Layout, state_bytes
from tests._dist import run_distributed, run_each
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for

STEPS = 2
#: the FSDP cases' model: a vocabulary of 101 rows per tensor-parallel rank, which FSDP cuts into 51 + 50 rows
UNEVEN = dict(vocab_size=202, make_vocab_size_divisible_by=1)
CASES = {
    # id: (strategy keywords, planner layout of 4 ranks, micro-batches per step[, model overrides])
    "tp2xpp2": (dict(tp=2, pp=2, use_distributed_optimizer=True), Layout(tp=2, pp=2, sharding="optim"), 2),
    "tp2sp-dp2-distopt": (dict(tp=2, sequence_parallel=True, use_distributed_optimizer=True),
                          Layout(tp=2, dp=2, sequence_parallel=True, sharding="optim"), 1),
    "tp2sp-dp2-fsdp-optim_grads": (dict(tp=2, sequence_parallel=True, data_parallel_sharding_strategy="optim_grads"),
                                   Layout(tp=2, dp=2, sequence_parallel=True, sharding="optim_grads"), 1, UNEVEN),
    "tp2sp-dp2-fsdp-optim_grads_params": (
        dict(tp=2, sequence_parallel=True, data_parallel_sharding_strategy="optim_grads_params"),
        Layout(tp=2, dp=2, sequence_parallel=True, sharding="optim_grads_params"), 2, UNEVEN),
}
# the precision-aware optimizer (bf16 moments: 4 bytes per parameter instead of 8)
CASES.update({f"{name}-bf16-moments": CASES[name]
              for name in ("tp2sp-dp2-distopt", "tp2sp-dp2-fsdp-optim_grads_params")})


def _moment_bytes(case: str) -> int:
    return 4 if case.endswith("-bf16-moments") else 8


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class Allocated(pl.Callback):
    """Bytes of this rank's parameters, gradients and optimizer states after the last training step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = [p for p in pl_module.parameters()]
        opt = trainer.optimizers[0]
        local = getattr(opt, "optim", opt)  # the shard's own optimizer under the distributed optimizer
        self.result = {
            "params": sum(_bytes(p) for p in params),
            "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_bytes(v) for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        }


def _run(rank: int, world: int, kwargs: Dict[str, Any], accumulate: int, model: Dict[str, Any],
         adamw: Any = None) -> Dict[str, int]:
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config(num_layers=4, **model)
    module = new_module(cfg, STEPS, adamw)
    allocated = Allocated()
    trainer = trainer_for(world, MegatronStrategy(**kwargs), STEPS, callbacks=[allocated],
                          accumulate_grad_batches=accumulate, precision="32-true")   # the planner's fp32 bytes
    samples = make_samples(cfg, 16)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    return allocated.result


@pytest.fixture(scope="module")
def allocations():
    cases = [(name, (case[0], case[2], case[3] if len(case) > 3 else {},
                     "bf16_moments" if _moment_bytes(name) == 4 else None)) for name, case in CASES.items()]
    return run_distributed(run_each, 4, _run, cases)


@pytest.mark.parametrize("case", list(CASES))
def test_planner_bytes_equal_what_each_rank_allocates(allocations, case):
    layout = CASES[case][1]
    cfg = tiny_config(num_layers=4, **(CASES[case][3] if len(CASES[case]) > 3 else {}))
    for rank, result in enumerate(allocations):
        got = result[case]
        assert isinstance(got, dict), got  # a traceback string when the case failed on that rank
        # the process grid (pp, dp, cp, tp), tp fastest; ZeRO's rank is the index in the dp x cp group
        rest = rank // layout.tp
        cp_rank, dp_rank, pp_rank = rest % layout.cp, (rest // layout.cp) % layout.dp, rest // (layout.cp * layout.dp)
        want = state_bytes(cfg, layout, pp_rank, dp_rank=dp_rank * layout.cp + cp_rank,
                           moment_bytes=_moment_bytes(case))
        assert (got["params"], got["grads"], got["optimizer"]) == (want.params, want.grads, want.optimizer), (
            case, rank, got, want)
        if layout.dp > 1:  # really sharded: less than the whole states of the rank's parameters
            whole = state_bytes(cfg, dataclasses.replace(layout, sharding="no_shard"), pp_rank,
                                moment_bytes=_moment_bytes(case))
            assert 0 < got["optimizer"] < whole.optimizer, (case, rank, got, whole)
            if layout.sharding.startswith("optim_grads"):  # FSDP: gradients and parameters sharded too, unevenly
                assert 0 < got["grads"] < whole.grads and 0 < got["params"] < whole.params, (case, rank, got, whole)
                other = state_bytes(cfg, layout, pp_rank, dp_rank=1 - dp_rank)
                assert got["params"] != other.params, (case, rank, got, other)
