"""``ParallelGPTModule``: the LightningModule around :class:`GPTModel` (subclass it to customise)."""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.contract import ParallelContext, parallelized_record
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.generation import check_sampling, generate_tokens
from lightning_megatron.models.kv_cache import KVCache
from lightning_megatron.models.gpt import VOCAB_PARAMS, GPTModel
from lightning_megatron.moe.training import pop_aux_loss_sums, set_aux_loss_scale_of, update_expert_biases
from lightning_megatron.optimizer import PrecisionAwareAdamW, optimizer_state_dtype, optimizer_state_dtype_name
from lightning_megatron.parallel.tensor_parallel.inference import sequence_parallel_disabled
from lightning_megatron.parallel.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from lightning_megatron.utils.host_value import LaggedHostValue

Batch = Dict[str, Tensor]

# Lightning warns on every run that passes a LightningDataModule, in the middle of the progress bar: "You have
# overridden `on_before_batch_transfer` in `LightningModule` but have passed in a `LightningDataModule`. It will use
# the implementation from `LightningModule` instance." That is what ParallelGPTModule means: its hook checks the token
# ids on the host (and drops default position ids) under any data module. Only this message is silenced.
warnings.filterwarnings("ignore", message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but "
                                          r"have passed in a `LightningDataModule`")


def megatron_lr_lambda(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: Optional[int],
                       decay_style: str) -> float:
    """Megatron's learning-rate schedule as a multiplier of ``lr`` at optimizer step ``step``.

    Linear warmup from ``lr/warmup_iters`` to ``lr`` over ``warmup_iters`` steps, then ``decay_style``
    ("cosine", "linear" or "constant") from ``lr`` to ``min_lr`` at ``decay_iters``, ``min_lr`` after.
    """
    if warmup_iters > 0 and step < warmup_iters:
        return (step + 1) / warmup_iters
    if decay_style == "constant" or decay_iters is None or decay_iters <= warmup_iters:
        return 1.0
    if step >= decay_iters:
        return min_lr / lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"lr_decay_style={decay_style!r} is not one of 'cosine', 'linear', 'constant'")
    return (min_lr + coeff * (lr - min_lr)) / lr


def without_default_positions(batch: Any) -> Any:
    """``batch`` without its ``position_ids`` when they are ``arange(s)`` in every row (a ``[b, s]`` tensor on the
    host, compared there before the batch reaches the device), as every dataset of ours and Megatron's ``GPTDataset``
    without ``reset_position_ids`` give them; anything else as it is. The model takes absent positions to be those very
    numbers, and keeps its RoPE tables for them between steps (:meth:`GPTModel.rotary`) instead of computing tables
    for each batch, which per-layer CUDA graphs would also copy in at every replay."""
    if not isinstance(batch, dict):
        return batch
    positions = batch.get("position_ids")
    if not (isinstance(positions, Tensor) and positions.device.type == "cpu" and positions.dim() == 2):
        return batch
    default = torch.arange(positions.shape[1], dtype=positions.dtype).expand_as(positions)
    if not torch.equal(positions, default):
        return batch
    return {key: value for key, value in batch.items() if key != "position_ids"}


def check_token_ids(batch: Any, vocab_size: int) -> None:
    """Raise ValueError when ``batch["tokens"]`` or ``batch["labels"]`` hold an id outside ``[0, vocab_size)``.

    One min/max per tensor. On host tensors (the batch before it moves to the device) this costs no device sync;
    on device tensors it syncs once. Without it an id at or above ``vocab_size`` would index a padding row of the
    vocabulary-parallel embedding at tp > 1 (a zero vector: a finite, meaningless loss) and a label there gives an
    infinite loss. Batches that are not mappings, and other keys, are left alone.
    """
    if not isinstance(batch, Mapping):
        return
    for key in ("tokens", "labels"):
        ids = batch.get(key)
        if not isinstance(ids, Tensor) or ids.numel() == 0:
            continue
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"batch[{key!r}] has dtype {ids.dtype}: token ids must be an integer tensor (int64)")
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= vocab_size:
            what = "every label (masked or not)" if key == "labels" else "every token id"
            raise ValueError(
                f"batch[{key!r}] holds ids from {low} to {high}, outside the vocabulary [0, {vocab_size}) of "
                f"GPTConfig.vocab_size={vocab_size}: {what} must be in it. Check the tokenizer's vocabulary against "
                "GPTConfig.vocab_size (--vocab-size; a NullTokenizer needs vocab_size + 1 for its end-of-document "
                "id) and the dataset the batch came from"
            )


LR_DECAY_STYLES = ("cosine", "linear", "constant")


def gpt_config_of(config: Any) -> GPTConfig:
    """``config`` as a :class:`GPTConfig`: itself, or built from its :meth:`GPTConfig.to_dict` mapping (the form the
    hyper-parameters and checkpoints hold it in, so ``ParallelGPTModule.load_from_checkpoint(path)`` rebuilds the
    module from a checkpoint's ``hyper_parameters``).

    Raises:
        ValueError: a mapping that is not a valid ``GPTConfig`` (an unknown or invalid field, named).
        TypeError: anything else.
    """
    if isinstance(config, GPTConfig):
        return config
    if isinstance(config, Mapping):
        try:
            return GPTConfig(**dict(config))
        except TypeError as e:
            raise ValueError(f"config (a mapping of GPTConfig fields, e.g. a checkpoint's hyper_parameters['config']) "
                             f"is not a GPTConfig: {e}") from e
    raise TypeError(f"config={config!r} ({type(config).__name__}) must be a GPTConfig or the dict of its fields "
                    "(GPTConfig.to_dict())")


def check_optimizer_arguments(*, lr: float, min_lr: float, weight_decay: float, adam_beta1: float, adam_beta2: float,
                              adam_eps: float, lr_warmup_iters: int, lr_decay_iters: Optional[int],
                              lr_decay_style: str) -> None:
    """Raise ValueError naming the first bad optimizer / schedule argument of :class:`ParallelGPTModule`."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    for name, value, low in (("lr", lr, 0.0), ("min_lr", min_lr, 0.0), ("weight_decay", weight_decay, 0.0),
                             ("adam_eps", adam_eps, 0.0)):
        if not number(value) or value < low:
            raise ValueError(f"{name}={value!r} must be a finite number >= {low:g}")
    for name, value in (("adam_beta1", adam_beta1), ("adam_beta2", adam_beta2)):
        if not number(value) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name}={value!r} must be in [0, 1)")
    if min_lr > lr:
        raise ValueError(f"min_lr={min_lr} is larger than lr={lr}")
    for name, value in (("lr_warmup_iters", lr_warmup_iters), ("lr_decay_iters", lr_decay_iters)):
        if value is None and name == "lr_decay_iters":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r} must be an integer >= 0" + (" or None (Trainer.max_steps)"
                                                                          if name == "lr_decay_iters" else ""))
    if lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"lr_decay_style={lr_decay_style!r} is not one of {LR_DECAY_STYLES}")


class ParallelGPTModule(pl.LightningModule):
    """Trains a :class:`GPTModel` under any layout of :class:`MegatronStrategy` (or any other strategy).

    Batches are dicts with ``tokens`` ``[b, s]`` and ``labels`` ``[b, s]`` (int64), optional ``loss_mask``
    ``[b, s]`` (float, 1 = counted), ``position_ids`` ``[b, s]`` and ``document_ids`` ``[b, s]`` (int64, packed
    sequences: a token attends only to the earlier tokens with its id; cut with the sequence under context
    parallelism and carried with each micro-batch through the pipeline stages; docs/data.md). The loss is the global token-mean over
    the data-parallel (x context-parallel) group: the gradient is exactly that of the mean over all tokens
    of the global micro-batch, and ``train_loss`` / ``val_loss`` are the same value on every rank.

    ``config`` is the model's :class:`GPTConfig`, or the dict of its fields (:meth:`GPTConfig.to_dict`): the
    hyper-parameters hold it as that dict, so checkpoints carry it and ``ParallelGPTModule.load_from_checkpoint(path)``
    rebuilds the module (a plain one, full weights on the CPU) from a checkpoint of any layout.

    Optimizer: AdamW with Megatron's defaults (``weight_decay=0.01``, betas ``(0.9, 0.999)``, eps ``1e-8``),
    no weight decay on norms and biases (1-D parameters); torch's (fused on CUDA) with fp32 moments and fp32
    parameters, or, with ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` ``"bf16"`` or with bf16 parameters
    (``MegatronPrecision(params_dtype=torch.bfloat16)``), Megatron's precision-aware optimizer
    (:class:`~lightning_megatron.optimizer.PrecisionAwareAdamW`: moments stored in their dtype, updated in fp32; it
    steps the fp32 main parameters, or their bf16 halves and remainders, in place); schedule:
    linear warmup over ``lr_warmup_iters`` then ``lr_decay_style`` to ``min_lr`` at ``lr_decay_iters`` (default
    ``Trainer.max_steps``). With ``decoupled_lr`` (Megatron's ``--decoupled-lr``) the word-embedding and output-layer
    weights (:data:`~lightning_megatron.models.gpt.VOCAB_PARAMS`) have their own group whose schedule runs from
    ``decoupled_lr`` to ``decoupled_min_lr`` (default ``min_lr``) with the same warmup and decay.

    Under :class:`MegatronStrategy` the model is built on the meta device in :meth:`configure_model` and
    the strategy materialises it already sharded, so no rank ever holds the full model.

    Mixture of experts (``config.num_moe_experts``): the routers' aux / z losses reach the gradient through
    autograd with the main loss's scale (:meth:`set_moe_aux_loss_scale`) and are logged as ``moe_aux_loss``
    (the load-balancing loss, summed over MoE layers) and ``moe_z_loss``: the global value of the micro-batch
    (of the step, averaged over micro-batches, under pipeline parallelism), the same on every rank.
    ``train_loss`` stays the language-model loss. With ``moe_router_enable_expert_bias`` the expert biases
    are updated once per optimizer step from the step's global token counts (:meth:`on_before_optimizer_step`).
    """

    def __init__(
        self,
        config: GPTConfig,
        lr: float = 3e-4,
        min_lr: float = 0.0,
        weight_decay: float = 0.01,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        lr_warmup_iters: int = 0,
        lr_decay_iters: Optional[int] = None,
        lr_decay_style: str = "cosine",
        decoupled_lr: Optional[float] = None,
        decoupled_min_lr: Optional[float] = None,
        exp_avg_dtype: Union[str, torch.dtype] = "fp32",
        exp_avg_sq_dtype: Union[str, torch.dtype] = "fp32",
    ) -> None:
        super().__init__()
        config = gpt_config_of(config)
        check_optimizer_arguments(lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=adam_beta1,
                                  adam_beta2=adam_beta2, adam_eps=adam_eps, lr_warmup_iters=lr_warmup_iters,
                                  lr_decay_iters=lr_decay_iters, lr_decay_style=lr_decay_style)
        if decoupled_lr is None and decoupled_min_lr is not None:
            raise ValueError(f"decoupled_min_lr={decoupled_min_lr} needs decoupled_lr (the embedding and output "
                             "layer's own learning rate)")
        if decoupled_lr is not None:
            check_optimizer_arguments(lr=decoupled_lr, min_lr=min_lr if decoupled_min_lr is None else decoupled_min_lr,
                                      weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
                                      adam_eps=adam_eps, lr_warmup_iters=lr_warmup_iters,
                                      lr_decay_iters=lr_decay_iters, lr_decay_style=lr_decay_style)
        # stored by Megatron's name ("fp32" / "bf16") in the hyper-parameters
        exp_avg_dtype = optimizer_state_dtype_name(exp_avg_dtype, "exp_avg_dtype")
        exp_avg_sq_dtype = optimizer_state_dtype_name(exp_avg_sq_dtype, "exp_avg_sq_dtype")
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = config.to_dict()
        self.config = config
        self.model: Optional[GPTModel] = None
        self._val_totals: Optional[Tensor] = None
        #: the training loss as the progress bar shows it: a step behind, never waiting for the GPU
        self._shown_loss = LaggedHostValue()
        self._parallel: Optional[ParallelContext] = None

    # ---------------------------------------------------------------- model
    def configure_model(self) -> None:
        """Build the plain model; idempotent. Under :class:`MegatronStrategy` this runs inside the strategy's
        ``tensor_init_context`` (the meta device), and the strategy materialises the model already sharded."""
        if self.model is None:
            self.model = GPTModel(self.config)

    def forward(self, tokens: Tensor, position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        """Per-token loss ``[b, s]`` with ``labels``, else logits ``[b, s, V_pad/tp]``."""
        if self.model is None:
            self.configure_model()
        return self.model(tokens, position_ids, labels, document_ids=document_ids)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Check the token ids and labels against the vocabulary (:func:`check_token_ids`) while the batch is still
        on the host, under every strategy and layout, and leave out ``position_ids`` that are the default positions
        (:func:`without_default_positions`). An override should call ``super()``. A LightningDataModule's own
        ``on_before_batch_transfer`` replaces this one (Lightning's rule); Lightning's warning that this one runs with
        a data module that has none is silenced (this module's import filters that one message)."""
        check_token_ids(batch, self.config.vocab_size)
        return without_default_positions(batch)

    # ---------------------------------------------------------------- the step pieces (ParallelLightningModule)
    def set_parallel_context(self, context: ParallelContext) -> None:
        """The layout, from :class:`MegatronStrategy` (the data-parallel group of the loss, MoE token groups)."""
        self._parallel = context

    def forward_step(self, batch: Batch) -> Tensor:
        """Logits ``[s, b, V_pad/tp]`` of the whole model for one micro-batch."""
        if self.model is None:
            self.configure_model()
        return self.model.logits(batch["tokens"], batch.get("position_ids"), document_ids=batch.get("document_ids"))

    def per_token_loss(self, output: Tensor, batch: Batch) -> Tensor:
        """Per-token loss ``[b, s]`` (fp32) of ``batch`` from logits ``[s, b, V_pad/tp]``."""
        return self.model.per_token_loss(output, batch["labels"].to(output.device))

    def loss_sum(self, output: Tensor, batch: Batch) -> Tensor:
        """Masked loss sum of one micro-batch from logits ``[s, b, V_pad/tp]``."""
        return self._masked_sum(self.per_token_loss(output, batch), batch)

    def loss_sum_and_count(self, batch: Batch) -> Tuple[Tensor, Tensor]:
        """Sum of the masked per-token losses of this rank's batch and the number of counted tokens."""
        return self.loss_sum(self.forward_step(batch), batch), self.token_count(batch)

    def _masked_sum(self, per_token: Tensor, batch: Batch) -> Tensor:
        mask = batch.get("loss_mask")
        if mask is None:
            return per_token.sum()
        return (per_token * mask.to(per_token.device, per_token.dtype)).sum()

    def token_count(self, batch: Batch) -> Tensor:
        """Number of tokens the loss counts in ``batch`` (the loss mask's sum, else ``b * s``)."""
        mask = batch.get("loss_mask")
        if mask is None:
            # torch.full launches a fill kernel; torch.tensor(...) would copy from the host and synchronise.
            return torch.full((), float(batch["labels"].numel()), device=batch["labels"].device)
        return mask.float().sum()

    def log_train_step(self, loss: Tensor, num_microbatches: int) -> None:
        """Log ``train_loss`` (the optimizer step's global token-mean, the same on every rank) and the MoE losses,
        once per optimizer step. The progress bar shows ``loss``: the newest step's loss that has reached the host
        (:class:`~lightning_megatron.utils.host_value.LaggedHostValue`, usually the previous step's), written into
        ``trainer.progress_bar_metrics`` as a number. Lightning reads logged progress-bar values at every batch's end,
        so ``train_loss`` there would make the host wait for the whole step and leave the GPU idle while the host
        prepares the next one (and ``self.log`` of a number copies it to the GPU, which waits too)."""
        self.log("train_loss", loss)
        shown = self._shown_loss.send(loss)
        if shown is not None and self._trainer is not None:
            self.trainer.progress_bar_metrics["loss"] = shown
        self._log_moe_losses(num_microbatches)

    # ---------------------------------------------------------------- mixture of experts
    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """Gradient the routers' aux / z losses get in backward (see :func:`lightning_megatron.moe.set_aux_loss_scale_of`):
        the main loss's scale (``dp_cp / micro-batches``, times the fp16 loss scale)."""
        if self.model is not None and self.config.is_moe:
            set_aux_loss_scale_of(self.model, scale)

    def _moe_token_groups(self) -> list:
        """Groups holding the rest of a micro-batch's tokens (dp x cp, and tp under sequence parallelism)."""
        if self._parallel is None:
            return [dist.group.WORLD] if self._is_distributed() else []   # plain DDP: each rank routes its own batch
        return list(self._parallel.token_groups)

    def _moe_loss_names(self) -> list:
        c = self.config
        names = []
        if c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff > 0:
            names.append(("moe_aux_loss", c.moe_router_load_balancing_type))
        if c.moe_z_loss_coeff:
            names.append(("moe_z_loss", "z_loss"))
        return names

    def _log_moe_losses(self, num_forwards: int) -> None:
        """Log the global aux / z losses of the last ``num_forwards`` forwards, averaged (collective over the token
        groups and, under pipeline parallelism, the pipeline group)."""
        if not self.config.is_moe or self.model is None:
            return
        names = self._moe_loss_names()
        sums = pop_aux_loss_sums(self.model, num_forwards)
        if not names:
            return
        device = next(iter(self.model.parameters())).device
        values = torch.stack([sums.get(key, torch.zeros((), device=device)).float().to(device) for _, key in names])
        groups = self._moe_token_groups()
        if self._parallel is not None and self._parallel.pipeline:
            groups.append(self._parallel.pp_group)
        for g in groups:
            dist.all_reduce(values, group=g)
        if self._parallel is None and groups:   # plain DDP: the mean of the ranks' own values
            values = values / dist.get_world_size()
        values = values / max(num_forwards, 1)
        for (log_name, _), v in zip(names, values.unbind(0)):
            self.log(log_name, v, sync_dist=False)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Aux-loss-free balancing: update the expert biases from the step's global token counts."""
        if self.config.is_moe and self.config.moe_router_enable_expert_bias and self.model is not None:
            pipeline = self._parallel is not None and self._parallel.pipeline
            last = self.trainer.accumulate_grad_batches if pipeline else None
            update_expert_biases(self.model, self._moe_token_groups(), last)

    def accumulate_eval_totals(self, totals: Tensor) -> None:
        """Add ``[loss_sum, token_count]`` of one evaluation batch (this data-parallel rank's part)."""
        self._val_totals = totals if self._val_totals is None else self._val_totals + totals

    # ---------------------------------------------------------------- Lightning steps
    # Under MegatronStrategy these hooks are called by the strategy (a subclass's overrides run, on every rank) and
    # reach the library's forward and loss through the strategy's step runner (ParallelContext.step); under any
    # other strategy (single device, Lightning's DDP) they compute them here.
    def _dp_group(self) -> Tuple[Optional[dist.ProcessGroup], int]:
        if self._parallel is None:
            return None, 1
        return self._parallel.dp_group, self._parallel.dp_size

    def _global(self, value: Tensor, group: Optional[dist.ProcessGroup], size: int) -> Tensor:
        value = value.detach().clone()
        if size > 1:
            dist.all_reduce(value, group=group)
        return value

    def _step_runner(self) -> Any:
        """The strategy's :class:`~lightning_megatron.contract.StepRunner`, or None outside MegatronStrategy."""
        return self._parallel.step if self._parallel is not None else None

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """One micro-batch's loss: its value is this data-parallel rank's token-mean loss of the micro-batch (what
        one process holding that batch computes), so ``self.log(name, value, sync_dist=True)`` of it (or of anything
        computed from it) in an override logs what Lightning's DDP logs.

        Under :class:`MegatronStrategy` the gradient is the library's global token-mean over the data-parallel
        group (pp = 1: Lightning's backward runs it, so an override may add loss terms to what this returns);
        ``train_loss`` (the optimizer step's global token-mean) is logged once per step, at its last micro-batch.
        Under pp > 1 the schedule has run the step's forward and backward when the strategy calls this (once per
        micro-batch, on every rank, in order, at the step's last micro-batch): the returned loss carries no
        gradient and an override must return it unchanged. Under other strategies ``train_loss`` is logged per
        micro-batch (``sync_dist``)."""
        runner = self._step_runner()
        if runner is not None:
            return runner.train(batch)
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        scaler = getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None
        loss_scale = float(scaler.get_scale()) if scaler is not None else 1.0   # fp16: the aux losses' too
        self.set_moe_aux_loss_scale(loss_scale / accumulate)
        loss_sum, count = self.loss_sum_and_count(batch)
        count = count.clamp(min=1.0)
        self.log("train_loss", loss_sum.detach() / count, prog_bar=True, sync_dist=self._is_distributed())
        if self.config.is_moe:
            self._log_moe_losses(1)
        return loss_sum / count

    def _is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _eval_step(self, batch: Batch) -> Tensor:
        runner = self._step_runner()
        if runner is not None:
            totals, loss = runner.evaluate(batch)
            self.accumulate_eval_totals(totals)
            return loss
        loss_sum, count = self.loss_sum_and_count(batch)
        totals = torch.stack([loss_sum.detach().float(), count.float()])
        self.accumulate_eval_totals(totals)
        return totals[0] / totals[1].clamp(min=1.0)

    def _eval_epoch_end(self, name: str) -> None:
        if self._val_totals is None:
            return
        group, dp = self._dp_group()
        if group is None and self._is_distributed():
            totals = self._global(self._val_totals, None, 2)
        else:
            totals = self._global(self._val_totals, group, dp)
        # Already the global value on every rank; sync_dist (a mean of equal values) only tells Lightning so.
        self.log(name, totals[0] / totals[1].clamp(min=1.0), prog_bar=True, sync_dist=self._is_distributed())
        self._val_totals = None

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Add the batch to the epoch's ``val_loss`` (the global token-mean, logged at the epoch's end); returns this
        data-parallel rank's token-mean loss of the batch (on every rank of its layout), for an override to log."""
        return self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val_loss")

    def test_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """As :meth:`validation_step`, for ``test_loss``."""
        return self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test_loss")

    def predict_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Per-token loss ``[b, s]`` if the batch has labels, else this rank's logits ``[b, s, V_pad/tp]`` (under
        :class:`MegatronStrategy` on every rank of the layout, pipeline stages included)."""
        runner = self._step_runner()
        if runner is not None:
            return runner.predict(batch)
        return self(batch["tokens"], batch.get("position_ids"), batch.get("labels"), batch.get("document_ids"))

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompt_tokens: Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Continue ``prompt_tokens`` ``[b, s]`` (int64, rows of equal length) by ``max_new_tokens`` tokens with a
        KV cache: returns ``[b, s + max_new_tokens]`` (the prompt, then the new tokens), on every rank.

        ``temperature=0`` (default) is greedy; otherwise tokens are drawn from ``softmax(logits / temperature)``
        restricted to the ``top_k`` most likely and the ``top_p`` nucleus, with ``generator``. Only the real
        vocabulary (``config.vocab_size``) is ever chosen, never a padded row. Runs in eval mode.

        Works on a plain module and under :class:`MegatronStrategy` after ``Trainer.fit`` / ``validate`` /
        ``predict`` set it up: under tensor parallelism the last position's logits are all-gathered over the TP
        group and TP rank 0's choice is broadcast over it; under pipeline parallelism the stages pass the new
        positions' activations along and the last stage broadcasts the tokens over the pipeline group. Every
        rank of a layout must call it (with its own prompts across data-parallel ranks, the same
        ``max_new_tokens``). Under sequence parallelism the TP layers run without it meanwhile (same values).
        Not supported with context parallelism, nor with experts under sequence parallelism.
        """
        check_sampling(temperature, top_k, top_p, max_new_tokens)
        if self.model is None:
            self.configure_model()
        model = self.model
        if model.sequence_parallel and self.config.is_moe:
            raise ValueError("generate() does not support a mixture-of-experts model under sequence parallelism "
                             "(its routers expect the sequence split over tp): generate under tp=1")
        if not isinstance(prompt_tokens, Tensor) or prompt_tokens.dim() != 2 or prompt_tokens.shape[1] == 0:
            raise ValueError(f"prompt_tokens must be a [batch, length >= 1] token tensor, got "
                             f"{getattr(prompt_tokens, 'shape', type(prompt_tokens).__name__)}")
        vocab = self.config.vocab_size
        check_token_ids({"tokens": prompt_tokens}, vocab)
        total = prompt_tokens.shape[1] + max_new_tokens
        if self.config.position_embedding_type == "learned_absolute" and total > self.config.max_position_embeddings:
            raise ValueError(f"prompt length + max_new_tokens = {total} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings} of the learned position embeddings")
        device = next(model.parameters()).device
        prompt = prompt_tokens.to(device)
        record = parallelized_record(self)
        stages = record.pipeline if record is not None else None
        tp_group = model.tp_group
        cache = KVCache()

        def real_vocabulary(logits: Tensor) -> Tensor:   # [s, b, V_pad/tp] -> the last position's [b, V]
            last = gather_from_tensor_model_parallel_region(logits[-1].contiguous(), tp_group)
            return last[:, :vocab]

        runner = None
        if stages is None:
            def next_logits(tokens: Tensor, positions: Tensor) -> Optional[Tensor]:
                return real_vocabulary(model.logits(tokens, positions, kv_cache=cache))
        else:
            if self._parallel is None or self._parallel.pp_group is None:
                raise ValueError("generate() under pipeline parallelism needs the pipeline group: set the module up "
                                 "with MegatronStrategy (Trainer.fit / validate / predict), or call "
                                 "set_parallel_context(ParallelContext(pp_group=...)) after parallelize()")
            pp_group = self._parallel.pp_group
            ranks = [dist.get_global_rank(pp_group, i) for i in range(dist.get_world_size(pp_group))]
            runner = stages.runner(pp_group, ranks, device)
            for stage in stages.modules:
                stage.kv_cache = cache

            def next_logits(tokens: Tensor, positions: Tensor) -> Optional[Tensor]:
                out = runner.forward_only(tokens, positions)
                return real_vocabulary(out) if out is not None else None

        def share(chosen: Optional[Tensor]) -> Tensor:
            if chosen is not None and tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.broadcast(chosen, src=dist.get_global_rank(tp_group, 0), group=tp_group)
            if runner is not None:
                if chosen is None:
                    chosen = torch.empty(prompt.shape[0], dtype=torch.long, device=device)
                chosen = runner.broadcast_from_last(chosen)
            return chosen

        was_training = self.training
        self.eval()
        try:
            with sequence_parallel_disabled(model):   # new tokens one at a time: the whole sequence on every TP rank
                return generate_tokens(next_logits, share, prompt, max_new_tokens, temperature, top_k, top_p,
                                       generator)
        finally:
            self.train(was_training)
            for stage in (stages.modules if stages is not None else []):
                stage.kv_cache = None

    # ---------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decoupled_lr = hp.get("decoupled_lr")
        params = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        vocab = [p for n, p in params if decoupled_lr is not None and n.endswith(VOCAB_PARAMS)]
        decay = [p for n, p in params if p.dim() >= 2 and not any(p is v for v in vocab)]
        no_decay = [p for n, p in params if p.dim() < 2 and not any(p is v for v in vocab)]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if vocab:   # not on pipeline stages without the embedding / output layer
            groups.append({"params": vocab, "weight_decay": hp.weight_decay, "lr": decoupled_lr})
        on_cuda = any(p.is_cuda for p in decay)
        moments = (optimizer_state_dtype(hp.get("exp_avg_dtype", "fp32")),
                   optimizer_state_dtype(hp.get("exp_avg_sq_dtype", "fp32")))
        # bf16 parameters (Megatron's --bf16): the precision-aware AdamW steps their fp32 main parameters (or the
        # bf16 halves and remainders) in place and writes the bf16 copies in its update, also with fp32 moments
        bf16_params = any(p.dtype == torch.bfloat16 for p in decay)
        if moments == (torch.float32, torch.float32) and not bf16_params:
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                groups, lr=hp.lr, betas=(hp.adam_beta1, hp.adam_beta2), eps=hp.adam_eps,
                fused=True if on_cuda else None)
        else:
            optimizer = PrecisionAwareAdamW(groups, lr=hp.lr, betas=(hp.adam_beta1, hp.adam_beta2), eps=hp.adam_eps,
                                            exp_avg_dtype=moments[0], exp_avg_sq_dtype=moments[1])
        decay_iters = hp.lr_decay_iters
        if decay_iters is None and self._trainer is not None and self.trainer.max_steps and self.trainer.max_steps > 0:
            decay_iters = self.trainer.max_steps
        lambdas = [lambda step: megatron_lr_lambda(step, hp.lr, hp.min_lr, hp.lr_warmup_iters, decay_iters,
                                                   hp.lr_decay_style)] * 2
        if vocab:
            low = hp.min_lr if hp.get("decoupled_min_lr") is None else hp.decoupled_min_lr
            lambdas.append(lambda step: megatron_lr_lambda(step, decoupled_lr, low, hp.lr_warmup_iters, decay_iters,
                                                           hp.lr_decay_style))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
