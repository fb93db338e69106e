"""Shared pieces of the end-to-end numerics oracle: the same model, data and optimizer in one process
(the reference) and under MegatronStrategy in several gloo processes."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_megatron import GPTConfig, MegatronStrategy, ParallelGPTModule

SEED = 1234
LR = 1e-3

#: Precision of the CPU parity runs (under :func:`trainer_for` without a precision plugin) and of their
#: single-process reference (:func:`reference_loop`, :func:`to_reference_dtype`). float64, because AdamW's first
#: steps move a weight whose gradient is near zero by about ``lr * sign(grad)``: in float32 the reduction order
#: of a parallel layout (noise ~1e-7 of the gradient) reaches the final weights at ~1e-5 relative, the tolerance
#: itself, and whether a case passes depends on the CPU's kernels. In float64 the same layouts agree to ~1e-13.
CPU_PRECISION = "64-true"


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


def lightning_train_order(n: int, epoch: int = 0) -> List[int]:
    """Sample order of Lightning's injected ``DistributedSampler`` (shuffled with the global seed) in ``epoch``.

    Data-parallel rank r takes ``order[r::dp]``, so global batch i is ``order[i*B:(i+1)*B]`` as a set.
    """
    g = torch.Generator().manual_seed(SEED + epoch)
    return torch.randperm(n, generator=g).tolist()


class AdamWGPTModule(ParallelGPTModule):
    """:class:`ParallelGPTModule` with a chosen kind of AdamW on any device: ``adamw="fused"`` (torch's fused one, on
    the CPU too, as on CUDA: it skips a non-finite step on the device, so the strategy decides its non-finite checks
    there) or ``"foreach"`` (on CUDA too: the checks stay synchronous)."""

    adamw = "fused"

    def configure_optimizers(self) -> Any:
        conf = super().configure_optimizers()
        fused = True if self.adamw == "fused" else None
        foreach = True if self.adamw == "foreach" else None
        groups = [dict(g, fused=fused, foreach=foreach) for g in conf["optimizer"].param_groups]
        optimizer = torch.optim.AdamW(groups, fused=fused, foreach=foreach)
        lambdas = conf["lr_scheduler"]["scheduler"].lr_lambdas
        conf["optimizer"] = optimizer
        conf["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        return conf


#: ``ParallelGPTModule`` arguments of the precision-aware optimizer with both moments in bf16
BF16_MOMENTS = dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


class PlainSGDModule(ParallelGPTModule):
    """:class:`ParallelGPTModule` trained by plain SGD (no momentum, no weight decay, constant learning rate): a
    step moves every parameter by exactly ``-lr`` times its gradient, so the weight change records the gradients."""

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.hparams.lr, momentum=0.0, weight_decay=0.0)


def new_module(cfg: GPTConfig, steps: int, adamw: Optional[str] = None) -> ParallelGPTModule:
    """The parity tests' module; ``adamw`` ("fused" or "foreach"): :class:`AdamWGPTModule` with that AdamW,
    ``"bf16_moments"``: the precision-aware AdamW with bf16 moments (:data:`BF16_MOMENTS`); ``"sgd"``:
    :class:`PlainSGDModule` (learning rate 0.5)."""
    kwargs = dict(lr=LR, min_lr=LR / 10, lr_warmup_iters=1, lr_decay_iters=steps, weight_decay=0.1)
    if adamw == "sgd":
        return PlainSGDModule(cfg, lr=0.5)
    if adamw == "bf16_moments":
        return ParallelGPTModule(cfg, **kwargs, **BF16_MOMENTS)
    if adamw is None:
        return ParallelGPTModule(cfg, **kwargs)
    if adamw not in ("fused", "foreach"):
        raise ValueError(f"adamw={adamw!r} must be 'fused', 'foreach' or 'bf16_moments'")
    module = AdamWGPTModule(cfg, **kwargs)
    module.adamw = adamw
    return module


class PoisonGradientOnce(pl.Callback):
    """One parameter's gradient (``decoder.layers["1"].mlp.linear_fc2.weight``) is NaN on global rank ``rank`` at
    optimizer step ``at`` only."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank:
            p = pl_module.model.decoder.layers["1"].mlp.linear_fc2.weight
            p.register_hook(lambda g: torch.full_like(g, float("nan")) if trainer.global_step == self.at else g)


class WeightsAfterStep(pl.Callback):
    """All parameters, flattened into one tensor, after every training batch (``after_step``)."""

    def __init__(self) -> None:
        self.after_step: List[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step.append(torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]))


def to_reference_dtype(module: torch.nn.Module, device: str = "cpu", precision: Optional[str] = None) -> None:
    """Make a reference model built with float32 weights float64 when the parallel run it is compared with is a
    CPU run at :data:`CPU_PRECISION` (``precision`` None, ``device`` the CPU): the weights are drawn in float32
    and cast, as ``Trainer(precision="64-true")`` does."""
    if precision is None and torch.device(device).type == "cpu":
        module.double()


def reference_run(cfg: GPTConfig, samples, steps: int, global_batch: int, clip: Optional[float] = None):
    """Single process, plain loop: per-step loss (global token-mean) and final state dict."""
    out = reference_loop(cfg, samples, steps, global_batch, clip)
    return out["losses"], out["state"]


AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def reference_loop(cfg: GPTConfig, samples, steps: int, global_batch: int, clip: Optional[float] = None, *,
                   order: Optional[List[int]] = None, accumulate: int = 1, stop_after: Optional[int] = None,
                   after_step: Optional[Callable[[int, ParallelGPTModule], None]] = None,
                   device: str = "cpu", precision: Optional[str] = None) -> Dict[str, Any]:
    """Single process, plain loop of a ``steps``-step run (LR schedule included).

    Optimizer step s takes ``accumulate`` global micro-batches of ``global_batch`` samples each, consumed in
    ``order`` (sample indices; default epoch 0 of :func:`lightning_train_order`), and backpropagates each
    micro-batch's global token-mean divided by ``accumulate`` (what Lightning does). ``stop_after`` ends the
    run after that many optimizer steps (a run stopped for a checkpoint); ``after_step(step, module)`` is
    called after each optimizer step (step counts from 1). ``device``: where the model is built and initialised
    (``"cuda"``: the 1-GPU reference of a GPU run, weights drawn on the device as the strategy draws them).

    ``precision`` ``"bf16-mixed"`` / ``"16-mixed"``: the forward runs under CPU autocast in that dtype, as
    Lightning's ``MixedPrecision``; ``"16-mixed"`` also scales the loss with a default ``GradScaler`` and
    unscales before clipping (a step with non-finite gradients is skipped and the scale halved).

    Returns ``losses`` (one per micro-batch), ``state`` (model state dict, on ``device``), ``optimizer`` (its
    state dict), ``module``, ``scales`` (the loss scale after each step; empty without a scaler) and
    ``first_grads`` (the gradients of the first optimizer step, unscaled and before clipping).
    """
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps)
    with torch.device(device):
        module.configure_model()
    to_reference_dtype(module, device, precision)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    autocast = precision is not None
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    losses, scales, first_grads = [], [], {}
    order = lightning_train_order(len(samples)) if order is None else order
    micro = 0
    for step in range(steps if stop_after is None else stop_after):
        for _ in range(accumulate):
            indices = order[micro * global_batch:(micro + 1) * global_batch]
            assert len(indices) == global_batch, "not enough samples in order for the requested steps"
            batch = {k: v.to(device) for k, v in collate([samples[i] for i in indices]).items()}
            with torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES.get(precision, torch.bfloat16), enabled=autocast):
                loss_sum, count = module.loss_sum_and_count(batch)
                loss = loss_sum / count
            scaled = loss / accumulate
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            losses.append(loss.item())
            micro += 1
        if scaler is not None:
            scaler.unscale_(opt)
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        sched.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step + 1, module)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": opt.state_dict(), "module": module, "scales": scales, "first_grads": first_grads}


@torch.no_grad()
def reference_val_loss(module: ParallelGPTModule, samples) -> float:
    """Token-mean of the masked per-token loss over all ``samples`` (eval mode), in one process."""
    was_training = module.training
    module.eval()
    loss_sum, count = module.loss_sum_and_count(collate(list(samples)))
    module.train(was_training)
    return (loss_sum / count).item()


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def trainer_for(world: int, strategy: MegatronStrategy, steps: int, accelerator: str = "cpu",
                **kwargs: Any) -> pl.Trainer:
    """A quiet ``Trainer`` of ``steps`` optimizer steps; a CPU run without a precision of its own runs at
    :data:`CPU_PRECISION`, as its reference does."""
    from lightning.pytorch.plugins.precision import Precision

    own_precision = "precision" in kwargs or any(isinstance(p, Precision) for p in kwargs.get("plugins") or ())
    if accelerator == "cpu" and not own_precision:
        kwargs["precision"] = CPU_PRECISION
    kwargs.setdefault("enable_checkpointing", any(isinstance(c, ModelCheckpoint) for c in kwargs.get("callbacks") or ()))
    kwargs.setdefault("enable_progress_bar", False)
    return pl.Trainer(accelerator=accelerator, devices=world, strategy=strategy, max_steps=steps, logger=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


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


def assert_state_close(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], rtol: float = 1e-5) -> float:
    """Every tensor within ``rtol`` of the reference: ``||a - e|| / ||e||`` (Frobenius norms, on the CPU).
    Returns the largest such error."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    worst = 0.0
    for k, e in expected.items():
        a, e = actual[k].detach().cpu().float(), e.detach().cpu().float()
        assert a.shape == e.shape, (k, a.shape, e.shape)
        err = float((a - e).norm() / e.norm().clamp(min=1e-12))
        assert err <= rtol, f"{k}: relative error {err:.3e} > {rtol}"
        worst = max(worst, err)
    return worst


class StepLossRecorder(pl.Callback):
    """Per optimizer step, each logged metric of ``keys``: MegatronStrategy logs the step's value (the mean over
    its micro-batches, the quantity the single-process reference reports) once, at the step's last micro-batch,
    under every layout."""

    def __init__(self, accumulate: int, keys: Sequence[str] = ("train_loss",)) -> None:
        self.accumulate = accumulate
        self.values: Dict[str, List[float]] = {k: [] for k in keys}

    @property
    def losses(self) -> List[float]:
        return self.values["train_loss"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.accumulate == 0:
            for k in self.values:
                self.values[k].append(float(trainer.callback_metrics[k]))


def layout_run(rank: int, world: int, cfg: GPTConfig, strategy_kwargs: Dict[str, Any], samples, micro_batch: int,
               accumulate: int, clip: Optional[float], steps: int, accelerator: str = "cpu",
               callbacks: Sequence[pl.Callback] = ()) -> Dict[str, Any]:
    """One rank of a ``steps``-step run under ``MegatronStrategy(**strategy_kwargs)`` with ``accumulate``
    micro-batches per optimizer step on ``accelerator`` (``"gpu"``: one GPU per rank, NCCL): the loss of each
    step and (rank 0) the full final state, on the CPU."""
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps)
    recorder = StepLossRecorder(accumulate)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, accelerator=accelerator,
                          callbacks=[recorder, *callbacks], gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "state": {k: v.cpu() for k, v in state.items()} if rank == 0 else None}


def check_layout_matches_single_process(world: int, strategy_kwargs: Dict[str, Any], cfg: GPTConfig,
                                        accumulate: int, clip: Optional[float], steps: int = 3,
                                        micro_batch: int = 2, accelerator: str = "cpu",
                                        rtol: float = 1e-5, state_rtol: Optional[float] = None,
                                        callbacks: Sequence[pl.Callback] = ()) -> Dict[str, float]:
    """The numerics oracle for one layout: loss of every optimizer step within ``rtol`` (1e-5) relative of the
    single-process run of the same model, data and optimizer, and final weights within ``state_rtol`` (default
    ``rtol``; a case that needs more says why where it sets it).

    ``accelerator="gpu"``: the layout runs one GPU per rank over NCCL and the reference on one GPU (this process's
    current CUDA device). Returns the measured worst relative errors: ``{"loss": ..., "state": ...}``.
    """
    from tests._dist import run_distributed

    model_parallel = 1
    for name in ("tp", "pp", "cp"):
        model_parallel *= strategy_kwargs.get(name, 1)
    global_batch = micro_batch * (world // model_parallel)
    samples = make_samples(cfg, steps * accumulate * global_batch)
    ref = reference_loop(cfg, samples, steps, global_batch, clip, accumulate=accumulate,
                         device="cuda" if accelerator == "gpu" else "cpu")
    ref_steps = [sum(ref["losses"][i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(steps)]
    results = run_distributed(layout_run, world, cfg, strategy_kwargs, samples, micro_batch, accumulate, clip, steps,
                              accelerator, callbacks)
    loss_err = 0.0
    for r in results:
        assert len(r["losses"]) == steps, r["losses"]
        for got, want in zip(r["losses"], ref_steps):
            assert abs(got - want) <= rtol * abs(want), (r["losses"], ref_steps)
            loss_err = max(loss_err, abs(got - want) / abs(want))
    state_err = assert_state_close(results[0]["state"], ref["state"], rtol if state_rtol is None else state_rtol)
    return {"loss": loss_err, "state": state_err}


def precision_plugins(precision: Optional[str]) -> List[Any]:
    """Trainer plugins for ``precision`` on CPU. ``Trainer(precision="16-mixed")`` on CPU silently becomes
    bf16-mixed, so fp16 (with its ``GradScaler``) is asked for through the plugin itself."""
    if precision is None:
        return []
    from lightning.pytorch.plugins.precision import MixedPrecision

    return [MixedPrecision(precision, "cpu")]


def zigzag_batch(cfg: GPTConfig, cp: int, rank: int, seed: int = 3) -> List[torch.Tensor]:
    """A fixed ``[2, seq_length]`` batch (tokens, labels, position ids) cut to CP rank ``rank``'s zigzag shard."""
    from lightning_megatron.parallel.context_parallel import zigzag_split

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    pos = torch.arange(cfg.seq_length).expand(2, -1)
    return [zigzag_split(t, cp, rank, dim=1) for t in (tokens, labels, pos)]


def model_loss_and_grads(cfg: GPTConfig, batch: Sequence[torch.Tensor], configure: Callable[[Any], None]):
    """One forward/backward of a freshly initialised ``GPTModel`` on ``batch`` (:func:`zigzag_batch`) after
    ``configure(model)``: ``(summed loss, {parameter name: grad})``."""
    from lightning_megatron import GPTModel

    model = GPTModel(cfg)
    model.init_weights(seed=5)
    configure(model)
    loss = model(batch[0], position_ids=batch[2], labels=batch[1]).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------- with a precision plugin
class InitialState(pl.Callback):
    """The full model state at the start of training (rank 0; collective on every rank)."""

    def __init__(self) -> None:
        self.state: Optional[Dict[str, torch.Tensor]] = None

    def on_train_start(self, trainer, pl_module) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        self.state = {k: v.detach().cpu().clone() for k, v in state.items()} if trainer.global_rank == 0 else None


def plugin_layout_run(rank: int, world: int, cfg: GPTConfig, strategy_kwargs: Dict[str, Any],
                      precision: Dict[str, Any], samples, micro_batch: int, accumulate: int, clip: Optional[float],
                      steps: int, accelerator: str = "cpu", adamw: Optional[str] = None) -> Dict[str, Any]:
    """One rank of a ``steps``-step AdamW run under ``MegatronStrategy(**strategy_kwargs)`` with
    ``MegatronPrecision(**precision)`` on ``accelerator`` (``"gpu"``: one GPU per rank, NCCL): the loss of each step
    and (rank 0) the full ``initial`` and ``final`` states, on the CPU. ``world=1`` with ``strategy_kwargs={}`` is
    the one-process reference of runs whose numerics the plain loop of :func:`reference_loop` does not reproduce
    (FP8, fp16). ``adamw``: the optimizer kind (:func:`new_module`)."""
    from lightning_megatron import MegatronPrecision

    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps, adamw)
    recorder, initial = StepLossRecorder(accumulate), InitialState()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, accelerator=accelerator,
                          callbacks=[recorder, initial], plugins=[MegatronPrecision(**precision)],
                          gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch, shuffle=False))
    final = trainer.strategy.lightning_module_state_dict()
    fp8 = trainer.strategy.parallelized.fp8
    return {"losses": recorder.losses, "initial": initial.state,
            "final": {k: v.detach().cpu().clone() for k, v in final.items()} if rank == 0 else None,
            "fp8_converted": fp8.converted if fp8 is not None else None,
            "fp8_gathers": sum(getattr(g, "fp8_gathers", 0) for g in fp8.gemms) if fp8 is not None else 0,
            "late_grads": main.late_grads if (main := trainer.strategy.parallelized.main_params) is not None else 0}


def run_plugin_cases(rank: int, world: int, cases: Sequence[Tuple[str, Tuple]]) -> Dict[str, Any]:
    """Each ``(name, plugin_layout_run arguments)`` in turn in this one process group (:func:`tests._dist.run_each`)."""
    from tests._dist import run_each

    return run_each(rank, world, plugin_layout_run, cases)


def weight_change_errors(result: Dict[str, Any], ref: Dict[str, Any]) -> Dict[str, float]:
    """Per parameter ``||(final - initial) - (final_ref - initial_ref)|| / ||final_ref - initial_ref||`` after
    checking that both runs started from the same weights (exactly)."""
    assert result["initial"].keys() == ref["initial"].keys() == ref["final"].keys() == result["final"].keys()
    errors = {}
    for k, init in ref["initial"].items():
        assert torch.equal(result["initial"][k], init), f"{k}: the runs start from different weights"
        want = (ref["final"][k] - init).double()
        got = (result["final"][k] - result["initial"][k]).double()
        errors[k] = float((got - want).norm() / want.norm().clamp(min=1e-30))
    return errors
