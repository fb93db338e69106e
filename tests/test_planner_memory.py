"""The planner's byte accounting against what the strategy really allocates, on CPU with gloo (no torch.cuda):
for each rank of tp2 x pp2 and of tp2+SP x dp2 with the distributed optimizer, and of tp2+SP x dp2 under FSDP
(``optim_grads``, ``optim_grads_params``), after training steps, the bytes of the rank's parameters, gradients and
optimizer states (sum of numel x element size of the local shards: FSDP's DTensors count their local part, Adam's
moments and step counters) equal ``lightning_megatron.planner.state_bytes`` of that rank exactly; also with the
precision-aware optimizer's bf16 moments (``moment_bytes=4``) under the distributed optimizer and FSDP, and with bf16
parameters (``MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16)``, ``params_dtype="bf16"``: the bf16
copies and fp32 main parameters, the fp32 main gradients before the optimizer step, which then drops them) without
sharding and under the distributed optimizer, and with their fp32 main parameters as int16 remainders
(``store_param_remainders=True``: 4 bytes per parameter instead of 6); under FSDP bf16 parameters are FSDP2's own
(fp32 shards, the same bytes as fp32 parameters)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronPrecision, MegatronStrategy
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


# bf16 parameters with fp32 main parameters and main gradients (6 + 4 bytes per parameter), whole and under the
# distributed optimizer (which shards the main parameters with the Adam states: the buffers' even runs)
BF16_PARAMS = {
    "tp2xpp2-bf16-params": (dict(tp=2, pp=2), Layout(tp=2, pp=2), 2),
    "tp2sp-dp2-bf16-params": (dict(tp=2, sequence_parallel=True), Layout(tp=2, dp=2, sequence_parallel=True), 2),
    "tp2sp-dp2-distopt-bf16-params": CASES["tp2sp-dp2-distopt"],
}
# the same with the fp32 main parameters held as int16 remainders next to the bf16 copies
BF16_PARAMS.update({f"{name}-rem": case for name, case in BF16_PARAMS.items() if "distopt" in name})
# the distributed optimizer's main gradients as bf16 buffers (grad_reduce_in_bf16): 2 bytes per parameter
BF16_PARAMS["tp2sp-dp2-distopt-bf16-params-bf16-grads"] = (
    dict(CASES["tp2sp-dp2-distopt"][0], grad_reduce_in_bf16=True), CASES["tp2sp-dp2-distopt"][1], 1)
CASES.update(BF16_PARAMS)
#: FSDP's levels with bf16 parameters: FSDP2 holds them (fp32 shards, bf16 compute copies gathered per unit)
CASES["tp2sp-dp2-fsdp-optim_grads-bf16-params"] = CASES["tp2sp-dp2-fsdp-optim_grads"]


def _moment_bytes(case: str) -> int:
    return 4 if case.endswith("-bf16-moments") else 8


def _params_dtype(case: str) -> str:
    return "bf16" if case.endswith(("-bf16-params", "-bf16-params-rem", "-bf16-grads")) else "fp32"


def _remainders(case: str) -> bool:
    return case.endswith("-rem")


def _bf16_grads(case: str) -> bool:
    return case.endswith("-bf16-grads")


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class Allocated(pl.Callback):
    """Bytes of this rank's parameters, gradients and optimizer states after the last training step. With bf16
    parameters the parameters are the bf16 copies (``pl_module``'s) and the fp32 main parameters, the gradients the
    fp32 main gradients just before the optimizer step (``main_grads``), and ``left_grads`` what the step left of
    them (the planner counts none between steps)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        main = trainer.strategy.parallelized.main_params
        if main is not None:
            self.main_grads = sum(_bytes(main.main_grad(p)) for p in main.params if main.main_grad(p) is not None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = [p for p in pl_module.parameters()]
        opt = trainer.optimizers[0]
        local = getattr(opt, "optim", opt)  # the shard's own optimizer under the distributed optimizer
        main = trainer.strategy.parallelized.main_params
        self.result = {
            "params": sum(_bytes(p) for p in params),
            "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_bytes(v) for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        }
        if main is not None and main.sharded:   # the distributed optimizer: padded buffers, shards of the mains
            assert {p.dtype for p in params} == {torch.float32 if main.keeps_dtype else torch.bfloat16}
            self.result["params"] = sum(_bytes(b.compute) + (0 if main.keeps_dtype else _bytes(
                b.remainder if b.remainder is not None else b.main_shard)) for b in main.buckets)
            inner = getattr(opt, "inner", None)
            self.result["optimizer"] = sum(_bytes(v) for s in (inner.state.values() if inner is not None else [])
                                           for v in s.values() if isinstance(v, torch.Tensor))
        elif main is not None and not main.keeps_dtype:   # fp32 parameters are their own main parameters
            assert {p.dtype for p in params} == {torch.bfloat16}, {p.dtype for p in params}
            main_bytes = main.remainder if main.store_param_remainders else main.main_param
            self.result["params"] += sum(_bytes(main_bytes(p)) for p in params)
        if main is not None:
            self.result["left_grads"] = self.result["grads"] + sum(
                _bytes(main.main_grad(p)) for p in main.params if main.main_grad(p) is not None)
            self.result["grads"] = getattr(self, "main_grads", None)   # None before the first optimizer step


def _run(rank: int, world: int, kwargs: Dict[str, Any], accumulate: int, model: Dict[str, Any],
         adamw: Any = None, params_dtype: str = "fp32", remainders: bool = False) -> Dict[str, int]:
    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config(num_layers=4, **model)
    module = new_module(cfg, STEPS, adamw)
    allocated = Allocated()
    # the planner's fp32 bytes, or bf16 parameters with fp32 main parameters
    precision = (dict(plugins=[MegatronPrecision("bf16-mixed", params_dtype=torch.bfloat16,
                                                 store_param_remainders=remainders)])
                 if params_dtype == "bf16" else dict(precision="32-true"))
    trainer = trainer_for(world, MegatronStrategy(**kwargs), STEPS, callbacks=[allocated],
                          accumulate_grad_batches=accumulate, **precision)
    samples = make_samples(cfg, 16)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=2, shuffle=False))
    return allocated.result


@pytest.fixture(scope="module")
def allocations():
    cases = [(name, (case[0], case[2], case[3] if len(case) > 3 else {},
                     "bf16_moments" if _moment_bytes(name) == 4 else None, _params_dtype(name), _remainders(name)))
             for name, case in CASES.items()]
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
                           moment_bytes=_moment_bytes(case), params_dtype=_params_dtype(case),
                           store_param_remainders=_remainders(case), grad_reduce_in_bf16=_bf16_grads(case))
        assert (got["params"], got["grads"], got["optimizer"]) == (want.params, want.grads, want.optimizer), (
            case, rank, got, want)
        if want.main_grads:   # bf16 parameters: the optimizer step dropped the main gradients
            assert got["left_grads"] == 0 and want.between_steps == want.params + want.optimizer, (case, rank, got)
            fp32 = state_bytes(cfg, layout, pp_rank, dp_rank=dp_rank * layout.cp + cp_rank)
            per_param = 4 if _remainders(case) else 6   # bf16 copy + int16 remainder, or + fp32 main parameter
            if layout.sharding == "no_shard" or layout.dp * layout.cp == 1:
                assert (want.params, want.grads) == (fp32.params * per_param // 4, fp32.grads), (want, fp32)
            else:   # the distributed optimizer: the main parameters (or remainders) sharded with the states
                grads = fp32.grads // 2 if _bf16_grads(case) else fp32.grads   # bf16 buffers: 2 bytes
                assert want.grads == grads and want.params < fp32.params * per_param // 4, (want, fp32)
        if layout.dp > 1 and layout.sharding != "no_shard":  # really sharded: less than the rank's whole states
            whole = state_bytes(cfg, dataclasses.replace(layout, sharding="no_shard"), pp_rank,
                                moment_bytes=_moment_bytes(case), params_dtype=_params_dtype(case))
            assert 0 < got["optimizer"] < whole.optimizer, (case, rank, got, whole)
            if layout.sharding.startswith("optim_grads"):  # FSDP: gradients and parameters sharded too, unevenly
                assert 0 < got["grads"] < whole.grads and 0 < got["params"] < whole.params, (case, rank, got, whole)
                other = state_bytes(cfg, layout, pp_rank, dp_rank=1 - dp_rank)
                assert got["params"] != other.params, (case, rank, got, other)
