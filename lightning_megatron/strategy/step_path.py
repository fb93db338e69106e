"""The strategy's side of the one step path: Lightning's per-batch hooks and a
:class:`~lightning_megatron.contract.ParallelLightningModule`'s own step hooks, joined.

The strategy calls the module's ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` (so a
subclass's overrides run, on every rank, once per batch); the library's implementations of those hooks call this
module's :class:`StepPath` (the module's :class:`~lightning_megatron.contract.StepRunner`, handed over in its
``ParallelContext``) for the forward and the loss.

* **pp = 1**: Lightning's own loop runs the step. :meth:`StepPath.train` runs one micro-batch's forward and loss inside
  the module's ``training_step`` and returns a loss whose gradient is the library's global token-mean; Lightning's
  ``zero_grad``, backward (with its ``on_before_backward`` / ``on_after_backward`` hooks; the buffer's buckets start
  their data-parallel reduction only at the step's last micro-batch) and optimizer step follow, as under Lightning's
  DDP. Manual optimization works the
  same way (the user calls ``manual_backward`` and ``optimizer.step()``).
* **pp > 1**: the schedule needs every micro-batch of a step at once. :meth:`StepPath.pipeline_training_step`
  collects them; at the step's last one it runs
  :func:`~lightning_megatron.parallel.forward_backward.forward_backward` (the schedule: forward and backward of all
  of them), then calls the module's ``training_step`` for each micro-batch in order on every rank (the library's
  part returns the loss the schedule computed, so what the user adds, logging and metrics, runs with the true
  values), firing ``on_before_backward`` / ``on_after_backward`` once per micro-batch. This is the one place
  Lightning's loop is bypassed: :meth:`pipeline_backward` is the strategy's ``backward`` there.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel import forward_backward as step
from lightning_megatron.parallel.compile import mark_step
from lightning_megatron.parallel.pipeline import PipelineRunner
from lightning_megatron.run import ParallelRun


class StepHost(Protocol):
    """What the step path reads of its strategy (:class:`~lightning_megatron.strategy.MegatronStrategy`), declared
    here so that this module does not import the strategy that owns it: Lightning's side (the module, the precision
    plugin, the optimizers) and the run (``run``: the mesh, the parameter buffer, the finaliser)."""

    lightning_module: Any
    precision_plugin: Any
    parallel_config: Any
    optimizers: List[Any]
    root_device: torch.device
    run: Optional[ParallelRun]

    def keeps_grads_as_computed(self, num_microbatches: int) -> bool: ...


class _ValueWithGradientOf(torch.autograd.Function):
    """``value`` in forward; in backward the incoming gradient goes to ``differentiable`` unchanged. A loss that reads
    as one number (this data-parallel rank's token-mean, what the user logs) and differentiates as another (the
    library's share of the global token-mean, whose data-parallel average is the true gradient)."""

    @staticmethod
    def forward(ctx: Any, differentiable: Tensor, value: Tensor) -> Tensor:  # type: ignore[override]
        return value.detach().to(differentiable.dtype).clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


class StepPath:
    """Runs a :class:`~lightning_megatron.contract.ParallelLightningModule` under a :class:`MegatronStrategy`; the
    module's :class:`~lightning_megatron.contract.StepRunner` (:meth:`train`, :meth:`evaluate`, :meth:`predict`).

    ``pipeline``: this rank's :class:`PipelineRunner` (pp > 1) or None (Lightning's own loop runs the step).
    """

    def __init__(self, strategy: StepHost, pipeline: Optional[PipelineRunner]) -> None:
        self.strategy, self.pipeline = strategy, pipeline
        #: micro-batches of the last optimizer step (the FP8 delayed recipe counts its last uses)
        self.step_microbatches: Optional[int] = None
        self._collected: List[Tuple[tuple, dict]] = []   # pp: Lightning's arguments of the step's micro-batches
        self._open = False        # pp = 1: the step's start done, its optimizer step not yet taken
        self._last = False        # pp = 1: the current micro-batch ends the step (its loss is logged there)
        self._parts: List[Tensor] = []   # pp = 1: each micro-batch's share of its global token-mean
        self._replay: Optional[Tensor] = None   # pp: the step's per-micro-batch losses while training_step replays
        self._replay_index = 0
        self._backward_due = False   # pp: Lightning's backward of the step's last micro-batch fires its hooks
        self._stash: List[Tuple[Tensor, Tensor]] = []   # pp: gradients kept out of a following zero_grad's reach

    # ------------------------------------------------------------------------------------------ shared pieces
    def _run(self) -> ParallelRun:
        """The strategy's run (set up before any step path exists)."""
        run = self.strategy.run
        assert run is not None, "the step path runs after the strategy's setup_environment"
        return run

    def functions(self, context: Callable[[], Any] = contextlib.nullcontext) -> step.StepFunctions:
        """The module's step pieces; without a pipeline its forward and loss run inside ``context`` (pipeline stages
        enter the precision plugin's forward context themselves); the loss is scaled by the precision plugin's loss
        scaler (fp16) without Lightning's hooks, which the strategy fires itself, once per micro-batch on every
        rank."""
        strategy, lm, pipeline = self.strategy, self.strategy.lightning_module, self.pipeline
        precision = strategy.precision_plugin
        cuda_graphs = strategy.parallel_config.enable_cuda_graph

        def forward(batch: Dict[str, Tensor]) -> Tensor:
            if cuda_graphs:   # one graph generation per micro-batch (lightning_megatron.parallel.compile)
                mark_step()
            with context():
                return lm.forward_step(batch)

        def loss_sum(output: Tensor, batch: Dict[str, Tensor]) -> Tensor:
            with contextlib.nullcontext() if pipeline is not None else context():
                return lm.loss_sum(output, batch)

        def backward(loss: Tensor) -> None:
            precision.backward(loss, lm, None)

        return step.StepFunctions(forward, loss_sum, lm.token_count, self._scale_loss, backward)

    def _scale_loss(self, loss: Tensor) -> Tensor:
        """The precision plugin's loss scale (fp16), nothing else (Lightning's ``pre_backward`` would also fire
        ``on_before_backward`` inside the schedule, on the last stage only)."""
        precision = self.strategy.precision_plugin
        ensure = getattr(precision, "_ensure_scaler", None)
        if ensure is not None:
            ensure()
        scaler = getattr(precision, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def _loss_scale(self) -> float:
        scaler = getattr(self.strategy.precision_plugin, "scaler", None)   # fp16: the aux losses get it too
        return float(scaler.get_scale()) if scaler is not None else 1.0

    def _value_dtype(self) -> torch.dtype:
        return torch.float64 if str(getattr(self.strategy.precision_plugin, "precision", "")) == "64-true" \
            else torch.float32

    # ------------------------------------------------------------------------------------------ pp = 1
    def begin_microbatch(self) -> None:
        """Before Lightning calls the module's ``training_step`` (pp = 1): start the optimizer step at its first
        micro-batch (bf16 parameters back to their compute copies, the MoE aux losses' gradient scale) and note
        whether this micro-batch ends the step. With manual optimization every call is a step of its own for the
        loss it logs; the step ends at the user's ``optimizer.step()``."""
        lm = self.strategy.lightning_module
        manual = not lm.automatic_optimization
        self._last = manual or not lm.trainer.fit_loop._should_accumulate()
        if self._open:
            return
        strategy, run = self.strategy, self._run()
        self._open, self._parts = True, []
        single = self._last and not manual
        # bf16 parameters back to their compute copies (a skipped optimizer step left the fp32 main view on); not
        # manual: the buckets' reductions start inside the step's last backward (overlap_grad_reduce)
        run.start_step(None if manual else lm.trainer.accumulate_grad_batches,
                       direct=single and strategy.keeps_grads_as_computed(1))
        # Lightning divides the returned loss by accumulate_grad_batches (automatic optimization); the aux losses too
        divisor = 1 if manual else lm.trainer.accumulate_grad_batches
        lm.set_moe_aux_loss_scale(run.mesh.size("dp_cp") / divisor * self._loss_scale())

    def end_step(self) -> None:
        """After an optimizer step (taken or skipped): the next micro-batch starts a new step."""
        self._open = False

    def train(self, batch: Any) -> Tensor:
        """The library's forward and loss of one training micro-batch (:class:`StepRunner`); see the module doc."""
        if self.pipeline is not None:
            if self._replay is None:
                raise RuntimeError(
                    "under pipeline parallelism (pp > 1) MegatronStrategy calls training_step itself after the "
                    "pipeline schedule ran the step's micro-batches; the library's training loss is available only "
                    "there, not from a training_step called elsewhere")
            return self._replay[self._replay_index]
        strategy = self.strategy
        lm, mesh, device = strategy.lightning_module, self._run().mesh, strategy.root_device
        fns = self.functions()   # inside Lightning's training_step: the precision context is on already
        loss_sum = fns.loss_sum(fns.forward(batch), batch)
        dp, cp = mesh.size("dp_cp"), mesh.size("cp")
        tokens = lm.token_count(batch).float().to(device)
        total = tokens.clone()
        if dp > 1:
            dist.all_reduce(total, group=mesh.group("dp_cp"))
        total = total.clamp(min=1.0)
        mine = torch.stack([loss_sum.detach().to(self._value_dtype()), tokens.to(self._value_dtype())])
        if cp > 1:   # this data-parallel rank's whole micro-batch: its context-parallel parts summed
            dist.all_reduce(mine, group=mesh.group("cp"))
        value = mine[0] / mine[1].clamp(min=1.0)
        self._parts.append(loss_sum.detach().float() / total)
        loss = _ValueWithGradientOf.apply(loss_sum * dp / total, value)
        if self._last:
            self._end_microbatches()
        return loss

    def _end_microbatches(self) -> None:
        """At the step's last micro-batch (pp = 1): the step's loss (mean over its micro-batches of each one's global
        token-mean, the same on every rank) checked for NaN / inf and logged once (``log_train_step``)."""
        mesh = self._run().mesh
        parts, self._parts = self._parts, []
        m = len(parts)
        self.step_microbatches = m
        loss = torch.stack(parts).sum() / m
        if mesh.size("dp_cp") > 1:
            dist.all_reduce(loss, group=mesh.group("dp_cp"))
        self._check_and_log(loss, m)

    def _check_and_log(self, loss: Tensor, m: int) -> None:
        strategy = self.strategy
        lm = strategy.lightning_module
        guard = self._run().guard
        guard.step = lm.trainer.global_step
        guard.check_loss(loss)   # NaN/inf: every rank raises here, before the optimizer step
        lm.log_train_step(loss, m)

    # ------------------------------------------------------------------------------------------ pp > 1
    def pipeline_training_step(self, args: tuple, kwargs: dict) -> Any:
        """Lightning's ``training_step`` call under pp > 1: collect the micro-batch; at the step's last one run the
        schedule, then the module's ``training_step`` for every micro-batch of the step in order (returning the last
        one's output). Earlier micro-batches return a zero placeholder (the step's losses do not exist yet)."""
        strategy = self.strategy
        lm = strategy.lightning_module
        self._collected.append((args, kwargs))
        if lm.trainer.fit_loop._should_accumulate():
            return torch.zeros((), device=strategy.root_device)
        collected, self._collected = self._collected, []
        batches = [call_args[0] if call_args else call_kwargs["batch"] for call_args, call_kwargs in collected]
        m = len(batches)
        loss, values = self._run_schedule(batches)
        # Lightning zeroes gradients after the training_step of a step's first micro-batch: when that is also this
        # one (a step of one micro-batch), the schedule's gradients wait outside its reach until the backward call
        self._stash_grads()
        precision = strategy.precision_plugin
        accumulate = lm.trainer.accumulate_grad_batches
        out: Any = None
        self._replay = values
        try:
            for i, (call_args, call_kwargs) in enumerate(collected):
                self._replay_index = i
                with precision.train_step_context():
                    out = lm.training_step(*call_args, **call_kwargs)
                returned = self._check_replayed(out, values[i], i)
                if i < m - 1:   # the last micro-batch's hooks fire in Lightning's own backward call
                    self._fire_backward_hooks(returned / accumulate)
        finally:
            self._replay = None
        self._check_and_log(loss, m)
        self._backward_due = True
        return out

    def _run_schedule(self, batches: List[Any]) -> Tuple[Tensor, Tensor]:
        """Forward and backward of the step's micro-batches through the schedule. Returns the step's loss (the same
        on every rank) and each micro-batch's loss of this data-parallel rank's batch, ``[M]``, on every rank."""
        strategy = self.strategy
        run = self._run()
        lm, mesh, device = strategy.lightning_module, run.mesh, strategy.root_device
        m, dp = len(batches), mesh.size("dp_cp")
        self.step_microbatches = m
        for optimizer in strategy.optimizers:   # before the schedule (Lightning's zero_grad may come after it)
            optimizer.zero_grad(set_to_none=True)
        # bf16 parameters back to their compute copies (a skipped optimizer step left the fp32 main view on); the
        # buckets' reductions armed for the step's micro-batches
        run.start_step(m, direct=strategy.keeps_grads_as_computed(m))
        # forward_backward divides each micro-batch's loss by M; Lightning divides by accumulate_grad_batches, also
        # in a shorter step (an epoch's last, fast_dev_run): that, as pp = 1 and Lightning's DDP do; the aux too
        accumulate = lm.trainer.accumulate_grad_batches
        lm.set_moe_aux_loss_scale(dp / accumulate * self._loss_scale())
        fns = self.functions()
        if m != accumulate:
            scale, ratio = fns.scale_loss, m / accumulate
            fns.scale_loss = lambda loss: scale(loss * ratio)
        index = {id(b): i for i, b in enumerate(batches)}
        sums: Dict[int, Tensor] = {}
        base_loss_sum = fns.loss_sum

        def loss_sum(output: Tensor, batch: Dict[str, Tensor]) -> Tensor:
            value = base_loss_sum(output, batch)
            sums[index[id(batch)]] = value.detach()
            return value

        fns.loss_sum = loss_sum
        loss = step.forward_backward(batches, fns, device=device, dp_group=mesh.group("dp_cp"), dp=dp,
                                     pipeline=self.pipeline)
        dtype = self._value_dtype()
        zero = torch.zeros((), dtype=dtype, device=device)
        mine = torch.stack([torch.stack([sums[i].to(dtype) if i in sums else zero for i in range(m)]),
                            torch.stack([lm.token_count(b).to(device, dtype) for b in batches])])
        if mesh.size("cp") > 1:
            dist.all_reduce(mine, group=mesh.group("cp"))
        mine = self.pipeline.broadcast_from_last(mine)   # the loss sums live on the last stage
        return loss, mine[0] / mine[1].clamp(min=1.0)

    def _check_replayed(self, out: Any, value: Tensor, i: int) -> Tensor:
        """The loss ``training_step`` returned for micro-batch ``i`` under pp > 1 must be the library's (the schedule
        already ran backward): RuntimeError otherwise, on every rank alike."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is value:
            return loss
        if isinstance(loss, Tensor) and loss.numel() == 1:
            same = loss.detach().reshape(()).to(value.dtype)
            if torch.equal(same, value) or bool(same.isnan() & value.isnan()):   # a dry run's loss may be NaN
                return loss
        what = "None" if loss is None else f"{loss!r}"[:80] if not isinstance(loss, Tensor) else \
            f"a loss of {float(loss.detach().float().reshape(-1)[0]):.6g}"
        lm = self.strategy.lightning_module
        raise RuntimeError(
            f"{type(lm).__name__}.training_step returned {what} for micro-batch {i} of the step, not the loss "
            f"super().training_step(batch, batch_idx) returned ({float(value):.6g}): under pipeline parallelism "
            f"(pp={self.strategy.parallel_config.pp}) the schedule runs the step's forward and backward before "
            "MegatronStrategy calls training_step (on every rank, once per micro-batch, for logging and metrics), so "
            "a changed or added loss term cannot reach the gradients. Return super().training_step(...)'s loss "
            "(or {'loss': it, ...}); put extra loss terms in the model's forward / loss_sum, or train with pp=1")

    def _fire_backward_hooks(self, loss: Tensor) -> Tensor:
        """Lightning's ``on_before_backward(loss)`` and ``on_after_backward`` (through the precision plugin, as its
        backward would), for a micro-batch whose backward the schedule ran."""
        precision, lm = self.strategy.precision_plugin, self.strategy.lightning_module
        loss = precision.pre_backward(loss, lm)
        return precision.post_backward(loss, lm)

    def pipeline_backward(self, closure_loss: Tensor) -> Tensor:
        """The strategy's ``backward`` under pp > 1: the schedule ran it already. At the step's last micro-batch the
        gradients come back from where :meth:`pipeline_training_step` kept them and its hooks fire; the earlier
        micro-batches' calls (their hooks fired in order at the last one) do nothing."""
        self.restore_grads()
        if not self._backward_due:
            return closure_loss.detach()
        self._backward_due = False
        return self._fire_backward_hooks(closure_loss)

    def _stash_grads(self) -> None:
        self._stash = [(p, p.grad) for p in self.strategy.lightning_module.parameters() if p.grad is not None]
        for p, _ in self._stash:
            p.grad = None

    def restore_grads(self) -> None:
        """Put back the gradients :meth:`pipeline_training_step` kept aside (idempotent)."""
        stash, self._stash = self._stash, []
        for p, grad in stash:
            p.grad = grad

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, batch: Any) -> Tuple[Tensor, Tensor]:
        """``(totals, loss)`` of one evaluation batch (:class:`StepRunner`): this rank's ``[loss_sum, token_count]``
        and this data-parallel rank's token-mean loss, on every rank."""
        mesh = self._run().mesh
        totals = step.eval_totals(batch, self.functions(), device=self.strategy.root_device, pipeline=self.pipeline)
        whole = totals.clone()
        if mesh.size("cp") > 1:
            dist.all_reduce(whole, group=mesh.group("cp"))
        return totals, whole[0] / whole[1].clamp(min=1.0)

    def predict(self, batch: Any) -> Tensor:
        """Per-token loss ``[b, s]`` (with labels) or logits ``[b, s, V_pad/tp]``, on every rank."""
        lm = self.strategy.lightning_module
        return step.predict(batch, self.functions(), lm.per_token_loss, pipeline=self.pipeline)
