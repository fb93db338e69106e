"""Pipeline parallelism: splitting a GPT-layout model into stages and running ``torch.distributed.pipelining``
schedules on them.

A model follows the *GPT layout* when it has ``embedding`` (called as ``model.embed(tokens, pos)``),
``decoder.layers`` (an ``nn.ModuleDict`` keyed by global layer index, run as ``model.run_layers(keys, x, rotary)``),
``decoder.final_layernorm`` + ``output_layer`` (called as ``model.head(x)``), and ``positions`` / ``rotary``
helpers, as :class:`lightning_megatron.GPTModel` does.

Placement (Megatron's): with ``pp`` ranks and ``vp`` virtual stages per rank there are ``pp*vp`` global
stages; virtual stage ``v`` on pipeline rank ``r`` is global stage ``v*pp + r`` ("loop" placement). The
V-shaped schedules (``zbv``, ``dualpipev``) need ``vp=2`` and place global stages ``r`` and ``2*pp-1-r`` on
rank ``r``. The model is pruned in place to the rank's layers, so parameter names (``decoder.layers.<global
index>...``) do not depend on the split and checkpoints stay layout-independent.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.parallel.dry_run import is_fake_group
from lightning_megatron.parallel.layout_rules import (SINGLE_STAGE_SCHEDULES, V_SHAPE_SCHEDULES, layers_per_stage,
                                                     min_microbatches, stage_placement)

class PipelineStageModule(nn.Module):
    """One pipeline stage of a GPT-layout model, sharing (not copying) the model's submodules.

    Input: token ids ``[b, s]`` on the first stage, else hidden ``[s(/tp under SP), b, h]``. Output: hidden
    of the same shape, or logits ``[s, b, V_pad/tp]`` on the last stage.
    """

    def __init__(self, model: nn.Module, layer_keys: Sequence[str], is_first: bool, is_last: bool,
                 tp_size: int) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.embedding = model.embedding if is_first else None
        self.layers = nn.ModuleDict({k: model.decoder.layers[k] for k in layer_keys})
        self.final_layernorm = model.decoder.final_layernorm if is_last else None
        self.output_layer = model.output_layer if is_last else None
        tied = is_last and getattr(model.output_layer, "weight", None) is None
        self.tied_word_embeddings = model.embedding.word_embeddings if tied and not is_first else None
        object.__setattr__(self, "_model", model)  # not a submodule: only this stage's parts are registered
        self.tp_size = tp_size
        self.forward_context: Callable[[], ContextManager] = contextlib.nullcontext
        #: the current micro-batch's ``(position_ids, document_ids)`` (each ``[b, s]`` or None), set by the runner
        self.sequence_inputs: Callable[[], Tuple[Optional[Tensor], Optional[Tensor]]] = lambda: (None, None)
        #: set for incremental decoding (generation): the layers attend to and extend this cache
        self.kv_cache: Optional[Any] = None

    def forward(self, x: Tensor) -> Tensor:
        model = self._model
        with self.forward_context():
            position_ids, document_ids = self.sequence_inputs()
            if self.is_first:
                pos = model.positions(x, position_ids)
                x = model.embed(x, pos)
            elif position_ids is not None:
                pos = position_ids.t()
            else:
                s = x.shape[0] * (self.tp_size if getattr(model, "sequence_parallel", False) else 1)
                pos = model.default_positions(s, x.shape[1], x.device)
            rotary = model.rotary(pos, x)
            if self.kv_cache is not None:
                x = model.run_layers_cached(list(self.layers.keys()), x, rotary, self.kv_cache)
            else:
                x = (model.run_layers(list(self.layers.keys()), x, rotary) if document_ids is None
                     else model.run_layers(list(self.layers.keys()), x, rotary, document_ids))
            if self.is_last:
                return model.head(x)
            return x


def split_model(model: nn.Module, pp_rank: int, pp: int, vp: int, schedule: str, tp_size: int,
                num_layers_in_first: Optional[int] = None,
                num_layers_in_last: Optional[int] = None) -> Tuple[List[PipelineStageModule], List[int], int]:
    """Prune ``model`` in place to pipeline rank ``pp_rank``'s layers and build its stage modules.

    Returns ``(stage modules in chunk order, their global stage indices, number of global stages)``.
    Layers of other stages are deleted; ``embedding`` is kept only where stage 0 lives (and, for tied
    embeddings, where the last stage lives), ``final_layernorm`` / ``output_layer`` only on the last stage.
    """
    num_stages = pp * vp
    keys = list(model.decoder.layers.keys())
    counts = layers_per_stage(len(keys), num_stages, num_layers_in_first, num_layers_in_last)
    bounds = [sum(counts[:i]) for i in range(num_stages + 1)]
    mine = stage_placement(pp, vp, schedule in V_SHAPE_SCHEDULES)[pp_rank]
    stages = [
        PipelineStageModule(model, keys[bounds[g]:bounds[g + 1]], g == 0, g == num_stages - 1, tp_size)
        for g in mine
    ]
    kept = {k for st in stages for k in st.layers.keys()}
    for k in keys:
        if k not in kept:
            del model.decoder.layers[k]
    holds_first = any(st.is_first for st in stages)
    holds_last = any(st.is_last for st in stages)
    tied = getattr(model.output_layer, "weight", None) is None
    if not holds_first:
        if holds_last and tied:
            model.embedding.position_embeddings = None  # the last stage only needs the word embeddings
        else:
            model.embedding = None
    if not holds_last:
        model.decoder.final_layernorm = None
        model.output_layer = None
    return stages, mine, num_stages


def build_schedule(schedule: str, stages: list, n_microbatches: int, loss_fn: Callable) -> Any:
    """The ``torch.distributed.pipelining`` schedule object. Its own division of ``p.grad`` by the micro-batch count
    is off (``scale_grads=False``): ``loss_fn`` returns each micro-batch's loss already divided by it, as the plain
    loop does, so every gradient route (``p.grad``, fp32 main gradients moved out of ``p.grad`` by a hook, bucketed
    reductions started in the backward, the zero-bubble schedules' separate weight gradients) sees the same scale."""
    from torch.distributed import pipelining as P

    classes = {
        "gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B, "interleaved_1f1b": P.ScheduleInterleaved1F1B,
        "looped_bfs": P.ScheduleLoopedBFS, "interleaved_zero_bubble": P.ScheduleInterleavedZeroBubble,
        "zbv": P.ScheduleZBVZeroBubble, "dualpipev": getattr(P, "ScheduleDualPipeV", None),
    }
    cls = classes[schedule]
    if cls is None:
        raise ValueError(f"pipeline_schedule={schedule!r} needs a newer torch (no ScheduleDualPipeV in {torch.__version__})")
    try:
        if schedule in SINGLE_STAGE_SCHEDULES:
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(
            f"pipeline_schedule={schedule!r} cannot run {n_microbatches} micro-batches per step on these stages "
            f"({e}). The micro-batches per optimizer step come from Trainer(accumulate_grad_batches=...)"
        ) from e


def _skip_self_init_p2p(stage: Any) -> None:
    """Drop the warm-up send/recv a stage would make to its own rank.

    Before the first step a schedule exchanges one dummy tensor with each neighbouring stage's rank. Under a
    V placement two neighbouring stages live on the same rank; torch 2.11 still posts that exchange, which
    gloo cannot do (no connection to itself; NCCL can). Activations between same-rank stages are passed
    directly by the schedule, so the self exchange has no purpose and is filtered out here.
    """
    make_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if make_ops is None:
        return

    def ops_without_self() -> list:
        return [op for op in make_ops() if getattr(op, "group_peer", None) != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = ops_without_self


def dry_run_stage(module: PipelineStageModule, index: int, num_stages: int, device: torch.device,
                  group: dist.ProcessGroup, b: int, s: int, token_dtype: torch.dtype) -> Any:
    """A torch ``PipelineStage`` for a dry run (:mod:`lightning_megatron.parallel.dry_run`): its input and output
    shapes are given (tokens ``[b, s]`` into the first stage, hidden ``[s(/tp under SP), b, h]`` between stages,
    logits ``[s, b, V_pad/tp]`` out of the last; ``s`` this rank's part of the sequence under CP), its warm-up vote is
    "static" without asking its neighbours (over fake groups every received value is unfilled memory), and its
    receive buffers (activations, gradients) are filled once with random values, which the fake receives leave
    in place for every micro-batch."""
    from torch.distributed.pipelining import PipelineStage

    model = module._model
    h = model.config.hidden_size
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    s_hidden = s // module.tp_size if getattr(model, "sequence_parallel", False) else s
    meta = torch.device("meta")
    hidden = torch.empty(s_hidden, b, h, dtype=dtype, device=meta, requires_grad=True)
    inputs = torch.empty(b, s, dtype=token_dtype, device=meta) if module.is_first else hidden
    head = model.output_layer if getattr(model.output_layer, "weight", None) is not None else module.tied_word_embeddings
    vocab = head.weight.shape[0] if module.is_last and head is not None else h
    outputs = torch.empty(s, b, vocab, dtype=dtype, device=meta, requires_grad=True) if module.is_last else hidden

    class DryRunStage(PipelineStage):
        def _warmup_forward_vote(self, has_backward: bool, received_acc: Optional[Tensor] = None) -> Tensor:
            return torch.ones(1, dtype=torch.int32, device=self.device)

        def _warmup_backward_result(self, received_result: Optional[Tensor] = None) -> Tensor:
            return torch.ones(1, dtype=torch.int32, device=self.device)

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_forward_infra(*args, **kwargs)
            _fill_receive_buffers(self.args_recv_info, 1.0)
            return out

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_backward_infra(*args, **kwargs)
            _fill_receive_buffers(self.grad_recv_info, 1e-3)
            return out

        def _validate_fwd_outputs(self, outputs: Any) -> None:
            # the last stage's logits are the autocast dtype under mixed precision (bf16 on CUDA), not the
            # parameters' declared above; they are never sent, so only the inner stages' outputs are checked
            if not self.is_last:
                super()._validate_fwd_outputs(outputs)

    return DryRunStage(module, index, num_stages, device, input_args=inputs, output_args=outputs, group=group)


def _fill_receive_buffers(infos: Dict[int, Any], std: float) -> None:
    """Random values (``std``) in every floating receive buffer of a torch stage's ``{micro-batch: infos}``."""
    for per_microbatch in infos.values():
        for info in per_microbatch:
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, Tensor) and buffer.is_floating_point() and not getattr(info, "is_root_arg", False):
                with torch.no_grad():
                    buffer.normal_(0.0, std)


#: a schedule that runs any number of micro-batches on the same stages, for a step with fewer than a schedule needs
#: (GPipe for one stage per rank; looped BFS for the loop placement of virtual stages; ZBV runs any number itself;
#: DualPipeV needs as many micro-batches as stages and has no stand-in)
SHORT_STEP_SCHEDULES = {"gpipe": "gpipe", "1f1b": "gpipe", "interleaved_1f1b": "looped_bfs",
                        "looped_bfs": "looped_bfs", "interleaved_zero_bubble": "looped_bfs", "zbv": "zbv"}


class PipelineRunner:
    """Runs training steps (a schedule) and forward-only passes over this rank's pipeline stages.

    Args:
        stage_modules: this rank's :class:`PipelineStageModule` s, in chunk order.
        stage_indices: their global stage indices; ``num_stages``: ``pp*vp``.
        pp_group: the pipeline group; ``pp_ranks``: its global ranks (index = pipeline rank).
        schedule: a name in :data:`SCHEDULE_NAMES`; ``device``: where activations live.
        weight_grad_sink: called with a stage's parameters, a context entered around each of its separate
            weight-gradient passes (the zero-bubble schedules' ``backward_weight_one_chunk``, which writes
            ``weight.grad`` without the parameters' post-accumulate hooks); e.g. :meth:`~lightning_megatron.parallel.
            param_buffer.buffer.MainParams.weight_grads`, so that every schedule's gradients reach the buffer per micro-batch.
    """

    def __init__(self, stage_modules: List[PipelineStageModule],
                 stage_indices: List[int], num_stages: int, pp_group: dist.ProcessGroup, pp_ranks: List[int],
                 schedule: str, device: torch.device, v_shape: bool,
                 weight_grad_sink: Optional[Callable[[List[nn.Parameter]], ContextManager[None]]] = None) -> None:
        self.stage_modules = stage_modules
        self.stage_indices, self.num_stages = stage_indices, num_stages
        self.pp_group, self.pp_ranks = pp_group, pp_ranks
        self.pp = len(pp_ranks)
        self.schedule_name, self.device, self.v_shape = schedule, device, v_shape
        self._schedules: Dict[int, Any] = {}
        self._pipeline_stages: Optional[list] = None
        self._example_shapes: Optional[Tuple[int, int, torch.dtype]] = None   # dry runs: (b, s, token dtype)
        self._loss_fn: Optional[Callable] = None
        self._sequence_inputs: List[Tuple[Optional[Tensor], Optional[Tensor]]] = []
        self._forward_counts = [0] * len(stage_modules)
        self.weight_grad_sink = weight_grad_sink
        for i, module in enumerate(stage_modules):
            module.sequence_inputs = self._sequence_provider(i)

    def _route_weight_grads(self, stage: Any, module: nn.Module) -> None:
        """After each separate weight-gradient pass of ``stage``, hand ``module``'s parameters to the sink."""
        sink = self.weight_grad_sink
        if sink is None:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        backward_weight = stage.backward_weight_one_chunk

        def backward_weight_then_sink(bwd_chunk_id: int, last_backward: bool = False) -> None:
            with sink(params):
                backward_weight(bwd_chunk_id, last_backward=last_backward)

        stage.backward_weight_one_chunk = backward_weight_then_sink

    # ---- placement
    def holder(self, global_stage: int) -> int:
        """Global rank holding ``global_stage``."""
        placement = stage_placement(self.pp, self.num_stages // self.pp, self.v_shape)
        for r, stages in enumerate(placement):
            if global_stage in stages:
                return self.pp_ranks[r]
        raise ValueError(global_stage)

    @property
    def last_stage_rank(self) -> int:
        return self.holder(self.num_stages - 1)

    @property
    def holds_last(self) -> bool:
        return (self.num_stages - 1) in self.stage_indices

    def _uncounted_metadata_forward(self, stage: Any, i: int) -> None:
        """Before its first step a torch stage may run one forward of its own to infer the shapes it exchanges
        (torch 2.13's ``_forward_metadata_inference``); that forward must not count as a micro-batch's, or every
        later forward of the step would get the next micro-batch's ``position_ids`` / ``document_ids``."""
        infer = getattr(stage, "_forward_metadata_inference", None)
        if infer is None:
            return

        def infer_uncounted(*args: Any, **kwargs: Any) -> Any:
            count = self._forward_counts[i]
            try:
                return infer(*args, **kwargs)
            finally:
                self._forward_counts[i] = count

        stage._forward_metadata_inference = infer_uncounted

    def _sequence_provider(self, i: int) -> Callable[[], Tuple[Optional[Tensor], Optional[Tensor]]]:
        """Stage module ``i``'s source of ``(position_ids, document_ids)``: its ``k``-th forward of a step runs
        micro-batch ``k`` (every schedule runs a stage's forwards in micro-batch order)."""
        def provide() -> Tuple[Optional[Tensor], Optional[Tensor]]:
            if not self._sequence_inputs:
                return None, None
            n = len(self._sequence_inputs)
            value = self._sequence_inputs[self._forward_counts[i] % n]
            self._forward_counts[i] += 1
            return value

        return provide

    def _set_sequence_inputs(self, position_ids: List[Optional[Tensor]],
                             document_ids: Optional[List[Optional[Tensor]]] = None) -> None:
        documents = list(document_ids) if document_ids is not None else [None] * len(position_ids)
        if len(documents) != len(position_ids):
            raise ValueError(f"{len(documents)} document_ids for {len(position_ids)} micro-batches")
        pairs = list(zip(position_ids, documents))
        self._sequence_inputs = [] if all(p is None and d is None for p, d in pairs) else pairs
        self._forward_counts = [0] * len(self.stage_modules)

    # ---- training
    @property
    def runs_short_steps(self) -> bool:
        """Whether a step of fewer micro-batches than the schedule needs (``fast_dev_run``, an epoch's short last
        step) runs, under a stand-in schedule of the same stages (:data:`SHORT_STEP_SCHEDULES`)."""
        return self.schedule_name in SHORT_STEP_SCHEDULES

    def _schedule(self, n_microbatches: int) -> Any:
        name = self.schedule_name
        need = min_microbatches(name, self.pp)
        if n_microbatches < need:
            # same stages, same gradients (a schedule only orders the micro-batches' passes): one that runs any number
            name = SHORT_STEP_SCHEDULES.get(name)
            if name is None:
                raise ValueError(
                    f"pipeline_schedule={self.schedule_name!r} with pp={self.pp} needs at least {need} micro-batches "
                    f"per optimizer step, got a step of {n_microbatches} (Trainer(accumulate_grad_batches=...), "
                    "fast_dev_run, or an epoch's short last step): give every step enough or use a schedule that runs "
                    "any number (its placement has no stand-in)")
        if n_microbatches not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            # Stages of their own per micro-batch count: a torch stage keeps the buffers of the first count it ran,
            # and a schedule prepares its stages once, so a step of another count (an epoch's short last step, a
            # changed accumulate_grad_batches) on shared stages would run past their buffers
            if self._example_shapes is not None:   # a dry run: static shapes, no exchange of them (fake groups)
                stages = [dry_run_stage(module, index, self.num_stages, self.device, self.pp_group,
                                        *self._example_shapes)
                          for module, index in zip(self.stage_modules, self.stage_indices)]
            else:
                stages = [PipelineStage(module, index, self.num_stages, self.device, group=self.pp_group)
                          for module, index in zip(self.stage_modules, self.stage_indices)]
            for stage, module in zip(stages, self.stage_modules):
                _skip_self_init_p2p(stage)
                self._uncounted_metadata_forward(stage, self.stage_modules.index(module))
                self._route_weight_grads(stage, module)
            self._pipeline_stages = stages
            self._schedules[n_microbatches] = build_schedule(name, stages, n_microbatches, self._call_loss)
        return self._schedules[n_microbatches]

    def _call_loss(self, output: Tensor, target: Tensor) -> Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, int(target[0]))

    def train_step(self, tokens: Tensor, position_ids: List[Optional[Tensor]],
                   loss_fn: Callable[[Tensor, int], Tensor],
                   document_ids: Optional[List[Optional[Tensor]]] = None) -> None:
        """Forward and backward of all micro-batches (``tokens [M*b, s]``, M = ``len(position_ids)``; each
        micro-batch's ``position_ids`` and ``document_ids`` reach every stage with it, on every rank).

        ``loss_fn(last-stage output, microbatch index)`` returns the loss to differentiate, already divided by M (the
        schedule does not scale gradients, see :func:`build_schedule`).
        """
        n = len(position_ids)
        b = tokens.shape[0] // n
        if is_fake_group(self.pp_group):
            self._example_shapes = (b, tokens.shape[1], tokens.dtype)
        schedule = self._schedule(n)
        self._loss_fn = loss_fn
        self._set_sequence_inputs(position_ids, document_ids)
        # Only the rank holding stage 0 feeds inputs and only the one holding the last stage takes targets
        # (torch 2.11's schedules reject inputs on other stages; later versions ignore them).
        args = (tokens,) if 0 in self.stage_indices else ()
        kwargs: Dict[str, Any] = {}
        if self.holds_last:
            kwargs = {"target": torch.arange(n).repeat_interleave(b), "losses": []}  # per-row micro-batch index
        schedule.step(*args, **kwargs)
        self._set_sequence_inputs([])

    # ---- forward only (validation / test / predict)
    @torch.no_grad()
    def forward_only(self, tokens: Tensor, position_ids: Optional[Tensor],
                     document_ids: Optional[Tensor] = None) -> Optional[Tensor]:
        """Run one batch through every stage in order (blocking send/recv between ranks, each activation preceded
        by its shape and dtype, so no stage needs to know the model's sizes).

        Returns the last stage's output (logits ``[s, b, V_pad/tp]``) on the rank holding it, else None.
        RuntimeError in a dry run (the shapes it receives would be unfilled memory).
        """
        if is_fake_group(self.pp_group):
            raise RuntimeError("a dry run (fake collectives) trains only: validation, test and predict under "
                               "pipeline parallelism receive each activation's shape from the previous stage; use "
                               "Trainer(limit_val_batches=0) and no test / predict in a dry run")
        self._set_sequence_inputs([position_ids], [document_ids])
        me = dist.get_rank()
        x: Optional[Tensor] = None
        result = None
        for g in range(self.num_stages):
            owner = self.holder(g)
            if owner != me:
                continue
            module = self.stage_modules[self.stage_indices.index(g)]
            self._forward_counts = [0] * len(self.stage_modules)
            if g == 0:
                inp = tokens
            elif self.holder(g - 1) == me:
                inp = x
            else:
                inp = _recv_any(self.holder(g - 1), self.device)
            x = module(inp)
            if g == self.num_stages - 1:
                result = x
            elif self.holder(g + 1) != me:
                _send_any(x, self.holder(g + 1))
        self._set_sequence_inputs([])
        return result

    def broadcast_from_last(self, t: Tensor) -> Tensor:
        """Broadcast ``t`` (same shape everywhere) from the last stage's rank over the pipeline group."""
        t = t.contiguous()  # a collective sends the storage as laid out: a transposed view would scramble
        dist.broadcast(t, src=self.last_stage_rank, group=self.pp_group)
        return t

    def broadcast_any_from_last(self, t: Optional[Tensor]) -> Tensor:
        """Broadcast the last stage's ``t`` over the pipeline group; other ranks pass None and learn its shape and
        dtype from a small header broadcast first."""
        header = _header(t, self.device) if t is not None else torch.zeros(_HEADER_LEN, dtype=torch.long, device=self.device)
        dist.broadcast(header, src=self.last_stage_rank, group=self.pp_group)
        if t is None:
            t = _empty_from_header(header, self.device)
        return self.broadcast_from_last(t)


_HEADER_LEN = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


def _header(t: Tensor, device: torch.device) -> Tensor:
    """``[dtype index, ndim, *shape]`` padded to :data:`_HEADER_LEN` int64s."""
    if t.dim() > _HEADER_LEN - 2:
        raise ValueError(f"cannot exchange a {t.dim()}-d tensor between pipeline stages (at most {_HEADER_LEN - 2})")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_HEADER_LEN - len(values)), dtype=torch.long, device=device)


def _empty_from_header(header: Tensor, device: torch.device) -> Tensor:
    values = header.tolist()
    dtype, ndim = _DTYPES[values[0]], values[1]
    return torch.empty(values[2:2 + ndim], dtype=dtype, device=device)


def _send_any(t: Tensor, dst: int) -> None:
    dist.send(_header(t, t.device), dst=dst)
    dist.send(t.contiguous(), dst=dst)


def _recv_any(src: int, device: torch.device) -> Tensor:
    header = torch.empty(_HEADER_LEN, dtype=torch.long, device=device)
    dist.recv(header, src=src)
    t = _empty_from_header(header, device)
    dist.recv(t, src=src)
    return t


class PipelineStages:
    """This rank's part of a pipeline-parallel model (the result of :func:`split_pipeline`).

    Attributes:
        modules: this rank's :class:`PipelineStageModule` s in chunk order; ``indices``: their global stage
            indices; ``num_stages``: ``pp * vp``; ``schedule``: the schedule's name.
        model: the pruned GPT-layout model they share submodules with.
        tied_copy: under tied embeddings with the loop placement, the word-embedding weight of a rank holding
            the last stage but not the first (a copy whose gradient is summed with the first stage's each step and
            which the gradient norm leaves out); else None.
    """

    def __init__(self, modules: List[PipelineStageModule], indices: List[int], num_stages: int, schedule: str,
                 model: nn.Module, tied_embeddings: bool) -> None:
        self.modules, self.indices, self.num_stages, self.schedule = modules, indices, num_stages, schedule
        self.model, self.tied_embeddings = model, tied_embeddings
        #: handed to every :class:`PipelineRunner` of these stages (see its ``weight_grad_sink``); set by
        #: :func:`lightning_megatron.parallelize` when the parameters have fp32 main gradients
        self.weight_grad_sink: Optional[Callable[[List[nn.Parameter]], ContextManager[None]]] = None

    @property
    def v_shape(self) -> bool:
        return self.schedule in V_SHAPE_SCHEDULES

    @property
    def tied(self) -> bool:
        """Tied word embeddings whose two uses sit on different ranks (loop placement)."""
        return self.tied_embeddings and not self.v_shape

    def word_embeddings(self) -> Optional[nn.Parameter]:
        embedding = self.model.embedding
        return embedding.word_embeddings.weight if embedding is not None else None

    def tied_copy(self) -> Optional[nn.Parameter]:
        holds_first, holds_last = 0 in self.indices, self.num_stages - 1 in self.indices
        return self.word_embeddings() if self.tied and holds_last and not holds_first else None

    def runner(self, pp_group: dist.ProcessGroup, pp_ranks: List[int], device: torch.device) -> "PipelineRunner":
        """The :class:`PipelineRunner` of these stages over ``pp_group``."""
        return PipelineRunner(self.modules, self.indices, self.num_stages, pp_group, pp_ranks, self.schedule,
                              device, self.v_shape, self.weight_grad_sink)


def split_pipeline(model: nn.Module, pp_rank: int, config: Any,
                   forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> PipelineStages:
    """Pipeline parallelism: prune ``model`` (a :class:`~lightning_megatron.contract.PipelineModel`, on the
    meta device) to pipeline rank ``pp_rank``'s stages under ``config`` (a ``ParallelConfig``: pp, vp, tp, schedule,
    uneven splits). Each stage runs its forward inside ``forward_context()`` (the precision plugin's autocast).

    Raises:
        ValueError: ``model`` does not follow the GPT layout.
    """
    from lightning_megatron.contract import PipelineModel

    if not isinstance(model, PipelineModel):
        raise ValueError(
            f"pp={config.pp} needs a model implementing lightning_megatron.contract.PipelineModel (the GPT "
            f"layout: embedding, decoder.layers, output_layer, positions/embed/rotary/head, as "
            f"lightning_megatron.GPTModel); got {type(model).__name__}"
        )
    tied = model.output_layer.weight is None
    modules, indices, num_stages = split_model(
        model, pp_rank, config.pp, config.vp or 1, config.pipeline_schedule, config.tp,
        config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage,
    )
    for stage in modules:
        stage.forward_context = forward_context
    return PipelineStages(modules, indices, num_stages, config.pipeline_schedule, model, tied)
