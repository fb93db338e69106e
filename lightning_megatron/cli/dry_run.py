"""One rank of a configuration in a dry run, measured: what ``python -m lightning_megatron.planner verify`` runs in a
subprocess per rank (:mod:`lightning_megatron.planner.verify`), with the same flags plus ``--rank R``.

``python -m lightning_megatron.cli.dry_run --config examples/configs/llama3_70b.yaml --rank 63`` trains the
configuration's model as rank 63 of its job (``MegatronStrategy(..., dry_run=DryRun(world_size, 63))``,
``Trainer(devices=1)``, mock data, fake collectives) and prints one line ``VERIFY_RESULT {json}``: parameters held,
static state bytes (:class:`StateBytesProbe`), compute time per optimizer step (the fastest after the first), the
compute-only MFU, the allocator's peak allocated and reserved GiB on CUDA, and each parameter's local shape.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import lightning.pytorch as pl
import torch

from lightning_megatron.parallel.dry_run import DryRun
from lightning_megatron.parallel.param_gather import zero_optimizers
from lightning_megatron.planner.calibration import load_hardware
from lightning_megatron.planner.model import GIB
from lightning_megatron.planner.verify import RESULT_MARK, VerifyJob, build_parser, job_of, mfu

__all__ = ["StateBytesProbe", "run_rank", "main"]


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class StateBytesProbe(pl.Callback):
    """Bytes of this rank's parameters, gradients and optimizer states at the end of each optimizer step (the
    planner's :func:`~lightning_megatron.planner.state_bytes` counts the same, as ``tests/test_planner_memory.py``
    checks under gloo), and the wall time of each step (CUDA synchronised at its ends when ``cuda``).

    ``state``: ``params`` (the local shards; with bf16 parameters also their fp32 main parameters or remainders),
    ``grads`` (``p.grad``; with bf16 parameters the fp32 main gradients before the optimizer step),
    ``optimizer`` (every tensor of the local optimizer states: the distributed optimizer's shards), ``numel``
    (parameters held). ``step_s``: seconds of each optimizer step, the first from ``on_train_start``."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.marks: List[float] = []
        self.main_grads: Optional[int] = None
        self.state: Dict[str, int] = {}

    @property
    def step_s(self) -> List[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def _mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._mark()

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        main = trainer.strategy.parallelized.main_params
        if main is not None:
            self.main_grads = sum(_nbytes(main.main_grad(p)) for p in main.params if main.main_grad(p) is not None)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == len(self.marks) - 1:   # a micro-batch, not the end of an optimizer step
            return
        self._mark()
        params = list(pl_module.parameters())
        # the states' owner: ZeRO's local optimizer, the distributed optimizer's (over this rank's runs), or itself
        local = [z.optim for z in zero_optimizers(trainer.optimizers)] or [
            getattr(getattr(o, "_optimizer", o), "inner", getattr(o, "_optimizer", o)) for o in trainer.optimizers]
        local = [o for o in local if o is not None]
        main = trainer.strategy.parallelized.main_params
        state = {"params": sum(_nbytes(p) for p in params),
                 "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
                 "optimizer": sum(_nbytes(v) for o in local for s in o.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor)),
                 "numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)}
        if main is not None:   # the buffer's buckets (padded under the distributed optimizer) and main parameters
            state["params"] = sum(_nbytes(b.compute) for b in main.buckets)
            if not main.keeps_dtype:
                state["params"] += sum(_nbytes(b.remainder if b.remainder is not None
                                               else b.main_shard if b.shard is not None else b.main)
                                       for b in main.buckets)
            state["grads"] = self.main_grads or state["grads"]   # a direct step keeps them on p.grad
        self.state = state


def run_rank(job: VerifyJob, rank: int, steps: int = 3, accelerator: str = "auto",
             hardware: str = "h200") -> Dict[str, Any]:
    """Train ``steps`` optimizer steps of ``rank`` of ``job`` in this process (a dry run; it starts the fake process
    group, so once per process) on mock data, and return the measured numbers (see the module docstring)."""
    from lightning_megatron.data import MockGPTDataModule
    from lightning_megatron.models.module import ParallelGPTModule
    from lightning_megatron.precision.plugin import MegatronPrecision
    from lightning_megatron.strategy import MegatronStrategy

    cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    layout = job.layout
    pl.seed_everything(1234, verbose=False)
    module = ParallelGPTModule(job.model, **job.module_kwargs)
    plugins = [MegatronPrecision(**job.precision_kwargs)] if job.precision_kwargs is not None else []
    strategy = MegatronStrategy(**job.strategy_kwargs, dry_run=DryRun(world_size=job.world, rank=rank))
    probe = StateBytesProbe(cuda)
    samples = job.micro_batch_size * job.num_microbatches * layout.dp * (steps + 1)
    data = MockGPTDataModule(job.model.vocab_size, job.model.seq_length, job.micro_batch_size,
                             num_train_samples=samples, num_val_samples=1, num_workers=0)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, plugins=plugins,
                         precision=None if plugins else "32-true", max_steps=steps,
                         accumulate_grad_batches=job.num_microbatches, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[probe])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, datamodule=data)
    timed = probe.step_s[1:] or probe.step_s   # the first step builds the schedule and warms the kernels up
    compute_s = min(timed)
    out = {"rank": rank, "device": torch.cuda.get_device_name() if cuda else "cpu", "steps": len(probe.step_s),
           "params": probe.state.get("numel"), "state_params": probe.state.get("params"),
           "state_grads": probe.state.get("grads"), "state_optimizer": probe.state.get("optimizer"),
           "compute_s": compute_s, "mfu": mfu(job, compute_s, load_hardware(hardware).bf16_tflops),
           "shapes": {n: list(p.shape) for n, p in module.named_parameters()}}
    if cuda:
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Parse ``verify``'s flags plus ``--rank``, run that rank, print ``VERIFY_RESULT {json}``."""
    parser = build_parser()
    parser.prog = "python -m lightning_megatron.cli.dry_run"
    parser.add_argument("--rank", type=int, required=True, help="the global rank this process plays")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        result = run_rank(job_of(args), args.rank, args.steps, args.accelerator, args.hardware)
    except torch.cuda.OutOfMemoryError as e:   # the planner's "does not fit", measured
        result = {"rank": args.rank, "device": torch.cuda.get_device_name(), "steps": 0,
                  "out_of_memory": str(e).splitlines()[0][:300]}
    print(RESULT_MARK + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
