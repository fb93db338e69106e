"""The written contract between models and the parallelize pipeline / the strategy.

Two sides, each a set of small :class:`typing.Protocol` s (checked with ``isinstance``, never by probing
attribute names one at a time):

* **the plain model** (an ``nn.Module``, e.g. :class:`lightning_megatron.GPTModel`): what
  :func:`lightning_megatron.parallelize` may call on it, one protocol per parallelism. A model implements only
  the ones it supports; asking for a parallelism its model does not implement raises an error naming the
  protocol.
* **the LightningModule** (e.g. :class:`lightning_megatron.ParallelGPTModule`): what
  :class:`lightning_megatron.MegatronStrategy` calls to run one optimizer step (:class:`ParallelLightningModule`),
  and what the strategy hands the module's own step hooks for the library's forward and loss (:class:`StepRunner`).
  A LightningModule without it still trains under the strategy through Lightning's own loop (pp = 1 only).

Nothing here imports the strategy; the strategy and ``parallelize`` import this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

from torch import Tensor, nn

Batch = Dict[str, Tensor]


# ---------------------------------------------------------------------------------------------- plain model
@runtime_checkable
class TensorParallelModel(Protocol):
    """A model that can be tensor-parallelised by :func:`lightning_megatron.parallel.apply_tp`."""

    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool) -> Dict[str, object]:
        """Module-name pattern -> TP style (``ColumnParallelStyle``, ``RowParallelStyle``, ...)."""


@runtime_checkable
class TensorParallelAware(Protocol):
    """A model that wants to know its TP group after ``apply_tp`` swapped its layers (optional)."""

    def set_tensor_parallel(self, group: Any, sequence_parallel: bool,
                            tp_fork: Optional[Callable[[], ContextManager]] = None) -> None:
        """Called after the layers are swapped: the TP group for the loss, SP scatters and dropout streams."""


@runtime_checkable
class ContextParallelModel(Protocol):
    """A model whose core attention can run over a context-parallel group.

    ``supports_delayed_wgrad``: whether its layers can hand weight-gradient GEMMs to the CP attention's backward
    (``delay_wgrad_compute``); the strategy's automatic default applies only to models that declare it.
    """

    supports_delayed_wgrad: bool

    def set_context_parallel(self, attention_for_layer: Callable[[int], Callable[..., Tensor]],
                             delay_wgrad_for_layer: Optional[Callable[[int], bool]] = None) -> None:
        """Route layer ``i``'s core attention through ``attention_for_layer(i)``."""


@runtime_checkable
class ExpertParallelModel(Protocol):
    """A mixture-of-experts model whose experts can be sharded over the expert-parallel groups."""

    def moe_layers(self) -> Dict[str, nn.Module]:
        """``{layer key: MoE layer}`` of the MoE layers this model (or pipeline stage) holds."""

    def set_expert_parallel(self, ep_group: Any, etp_group: Any = None, ep_etp_group: Any = None) -> None:
        """Shard the experts (on the meta device, before initialisation)."""

    def set_moe_token_groups(self, sequence_groups: Sequence[Any] = (), batch_groups: Sequence[Any] = ()) -> None:
        """Where the rest of a micro-batch's tokens are, for the routers' global statistics."""


@runtime_checkable
class PipelineModel(Protocol):
    """The GPT layout :func:`lightning_megatron.parallel.pipeline.split_model` cuts into stages.

    Besides these methods the model holds ``embedding`` (run by ``embed``), ``decoder.layers`` (a ``ModuleDict`` keyed
    by global layer index, run by ``run_layers``), ``decoder.final_layernorm`` and ``output_layer`` (run by
    ``head``). They are submodules, which ``isinstance`` cannot see on every Python (3.12 looks attributes up
    statically), so the protocol names only the methods.
    """

    def positions(self, tokens: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """Position ids ``[s, b]``."""

    def embed(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """``tokens [b, s]`` -> hidden ``[s(/tp under SP), b, h]``."""

    def rotary(self, pos: Tensor, like: Tensor) -> Any:
        """RoPE tables for ``pos`` (None without RoPE)."""

    def run_layers(self, keys: Sequence[str], x: Tensor, rotary: Any, document_ids: Optional[Tensor] = None) -> Tensor:
        """Run the consecutive layers ``keys`` (global indices, in order) on hidden ``x`` -> same shape; the stage
        passes ``document_ids`` ``[b, s]`` only for a packed micro-batch (positionally, after ``rotary``)."""

    def head(self, x: Tensor) -> Tensor:
        """Final norm and LM head: hidden -> logits ``[s, b, V/tp]``."""


class RecomputeTarget(NamedTuple):
    """One call activation recompute covers: ``getattr(module, method)``. ``single_consumer``: its output feeds one
    op that computes in the autocast dtype (a linear layer), so output-discarding recompute may hand the output on
    in that dtype under autocast (the op would cast it anyway; with several consumers the gradients would then be
    summed in that dtype instead of float32, so it is not)."""

    module: nn.Module
    method: str
    single_consumer: bool = False


@runtime_checkable
class RecomputeModel(Protocol):
    """A model whose activations :func:`lightning_megatron.parallel.recompute.apply_recompute` can recompute in
    backward (Megatron's ``recompute_granularity`` / ``recompute_method`` / ``recompute_modules``).

    ``layer_keys()``: the keys of its transformer layers, in order. ``run_layers(keys, x, rotary)``: runs
    consecutive layers (``keys``, in order) on hidden ``x`` ``[s, b, h]``; every caller of the layer stack goes
    through it (the whole model's forward, each pipeline stage), so full recompute can checkpoint groups of them.
    ``recompute_targets(name)``: the calls (:class:`RecomputeTarget`) that one of Megatron's ``recompute_modules``
    names covers in this model (``[]`` where it has none), e.g. ``"core_attn"`` -> each attention's
    ``core_attention``. Recompute changes how these calls run, never what they compute.
    """

    def layer_keys(self) -> List[str]:
        """Keys of the transformer layers, in order."""

    def run_layers(self, keys: Sequence[str], x: Tensor, rotary: Any, document_ids: Optional[Tensor] = None) -> Tensor:
        """Run the consecutive layers ``keys`` on hidden ``x`` -> same shape (``document_ids``: a packed batch's,
        handed on to the layers; recompute replays them with the group)."""

    def recompute_targets(self, name: str) -> List[RecomputeTarget]:
        """The calls a ``recompute_modules`` name covers."""


@runtime_checkable
class ReplayAware(Protocol):
    """A module whose training forward records state besides computing its output (token counters, loss
    histories, ...). Activation recompute sets ``recomputing`` to True while it runs the forward again in backward;
    the module must then compute the same outputs and record nothing (else every replay would count twice)."""

    recomputing: bool


@runtime_checkable
class InitialisableModel(Protocol):
    """A model that initialises its (possibly sharded) parameters layout-independently from a seed."""

    def init_weights(self, seed: Optional[int] = None) -> None: ...


@runtime_checkable
class TiedWeightsModel(Protocol):
    """A model with modules that read a parameter another module owns (a tied LM head reads the word embedding)."""

    def tied_weight_readers(self) -> Dict[nn.Module, List[nn.Parameter]]:
        """``{module: [parameters it reads but does not own]}`` for the modules this (pipeline-split) model holds."""
        ...


# ---------------------------------------------------------------------------------------------- LightningModule
@runtime_checkable
class ConfiguredModule(Protocol):
    """A LightningModule carrying its model's shape (``config``, Megatron's field names): the strategy checks it
    against the layout (heads, query groups, layers, sequence length, experts) before the model is built."""

    config: Any


@runtime_checkable
class StepRunner(Protocol):
    """The library's forward and loss of one batch under :class:`MegatronStrategy`, for a LightningModule's own
    Lightning hooks (the strategy's step path: ``lightning_megatron.strategy.step_path.StepPath``).

    The strategy calls the module's ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step``
    (Lightning's hooks, so a subclass's overrides run); :class:`lightning_megatron.ParallelGPTModule`'s own
    implementations call these methods (an override reaches them through ``super()``). Every rank of the layout calls
    them for every batch, pipeline stages included.
    """

    def train(self, batch: Batch) -> Tensor:
        """This micro-batch's training loss: the value is this data-parallel rank's token-mean loss of the micro-batch
        (what one process holding that batch computes; the same on its tensor-, context- and pipeline-parallel peers),
        its gradient that of the library's global token-mean (pp == 1; Lightning's backward runs it). Under pipeline
        parallelism the schedule has already run the step's forward and backward when the strategy calls
        ``training_step``; the value is the same and carries no gradient."""

    def evaluate(self, batch: Batch) -> Tuple[Tensor, Tensor]:
        """``(totals, loss)``: ``totals`` = ``[loss_sum, token_count]`` of this rank's part of ``batch`` (summed over
        the data-parallel x context-parallel group at the epoch's end); ``loss`` = this data-parallel rank's token-mean
        loss of the batch, on every rank of the layout."""

    def predict(self, batch: Batch) -> Tensor:
        """Per-token loss ``[b, s]`` (with labels) or logits ``[b, s, V_pad/tp]``, on every rank."""


@dataclass(frozen=True)
class ParallelContext:
    """What a LightningModule learns about the layout from the strategy (:meth:`set_parallel_context`).

    Attributes:
        dp_group, dp_size: the data-parallel x context-parallel group the loss is averaged over.
        token_groups: groups that together hold the rest of a micro-batch's tokens (dp x cp, and tp under
            sequence parallelism): MoE routers' global statistics are reduced over them.
        pp_group: the pipeline group, or None without pipeline parallelism.
        step: the strategy's :class:`StepRunner` (the library's forward and loss for the module's own step hooks),
            or None outside :class:`MegatronStrategy`.
    """

    dp_group: Any = None
    dp_size: int = 1
    token_groups: List[Any] = field(default_factory=list)
    pp_group: Any = None
    step: Optional[StepRunner] = None

    @property
    def pipeline(self) -> bool:
        return self.pp_group is not None


@runtime_checkable
class ParallelLightningModule(Protocol):
    """What :class:`MegatronStrategy` calls on a LightningModule to run its one step path.

    The strategy calls the module's own Lightning step hooks (``training_step`` and the others), which reach the
    library's forward and loss through ``ParallelContext.step`` (:class:`StepRunner`). With pp == 1 Lightning's own
    loop runs the rest (zero_grad, backward, DDP's ``no_sync`` for accumulated micro-batches). With pp > 1 the
    strategy collects the micro-batches of one optimizer step, runs them through the pipeline schedule of
    :func:`~lightning_megatron.parallel.forward_backward.forward_backward` at the last one, then calls
    ``training_step`` for each of them in order on every rank; evaluation and prediction go through the same
    pieces (:meth:`forward_step`, :meth:`loss_sum`).
    """

    def set_parallel_context(self, context: ParallelContext) -> None:
        """Receive the layout (before the first step)."""

    def forward_step(self, batch: Batch) -> Tensor:
        """The whole model's output for one micro-batch: logits ``[s, b, V/tp]`` (used when pp == 1)."""

    def loss_sum(self, output: Tensor, batch: Batch) -> Tensor:
        """Sum of the masked per-token losses of ``batch`` from the (last stage's) ``output``: a scalar."""

    def token_count(self, batch: Batch) -> Tensor:
        """Number of tokens the loss counts in ``batch`` (a scalar tensor)."""

    def per_token_loss(self, output: Tensor, batch: Batch) -> Tensor:
        """Per-token loss ``[b, s]`` of ``batch`` (with labels) from ``output``."""

    def set_moe_aux_loss_scale(self, scale: float) -> None:
        """Gradient scale of auxiliary losses attached in forward (the main loss's scale)."""

    def log_train_step(self, loss: Tensor, num_microbatches: int) -> None:
        """Log the step's loss (global token-mean, the same on every rank), once per optimizer step (called inside
        the step's last ``training_step``)."""

    def accumulate_eval_totals(self, totals: Tensor) -> None:
        """Add ``[loss_sum, token_count]`` of one evaluation batch."""


#: the attribute of a parallelised module holding what :func:`~lightning_megatron.parallelize.parallelize` did
#: (its ``ParallelizedModel``): a plain attribute, not a submodule, so state dicts are unchanged
PARALLELIZED_RECORD = "_lightning_megatron_parallelized"


def keep_parallelized_record(module: nn.Module, record: Any) -> None:
    """Attach ``record`` (a ``ParallelizedModel``) to ``module``: :func:`parallelized_record` reads it back."""
    module.__dict__[PARALLELIZED_RECORD] = record


def parallelized_record(module: nn.Module) -> Any:
    """What :func:`~lightning_megatron.parallelize.parallelize` did to ``module`` (its ``ParallelizedModel``: the
    models, the pipeline stages, the FP8 layers, ...), or None if it was not parallelised. Declared here, in the
    contract, so that a model reads its record without importing the layer that writes it."""
    return module.__dict__.get(PARALLELIZED_RECORD)


class RoutedExperts(nn.Module):
    """Base of the modules holding a mixture-of-experts layer's routed experts
    (:class:`~lightning_megatron.moe.experts.GroupedMLPExperts`, ``SequentialMLPExperts``): their parameters differ
    between data-parallel ranks (each expert-parallel rank holds its own experts) and are reduced over expert data
    parallel instead of dp x cp. The parallel layer finds them by this type without importing the MoE layer."""


class TokenRouter(nn.Module):
    """Base of mixture-of-experts routers (:class:`~lightning_megatron.moe.router.TopKRouter`): their buffers are
    per-rank token counts, which data parallelism must leave alone."""
