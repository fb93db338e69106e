"""FP8 GEMMs for the linear layers: the torch-native backend (``torch._scaled_mm``) and the Transformer Engine one.

:func:`apply_fp8` (the ``apply_fp8`` step of :func:`lightning_megatron.parallelize`) gives every converted layer
an FP8 local GEMM (``layer.fp8_gemm``): the local GEMMs of :class:`ColumnParallelLinear` /
:class:`RowParallelLinear` and plain ``nn.Linear`` layers (swapped for :class:`Float8Linear`, same parameters).
The tensor-parallel communication around the GEMM is unchanged; parameters stay in their dtype (fp32 master
weights) and are quantised on the fly.

Torch-native GEMM (:class:`Float8Gemm`), per layer, three GEMMs::

    forward   y  = x  @ W^T      x: e4m3, W: e4m3
    backward  dx = dy @ W        dy: e5m2 ("hybrid") or e4m3 ("e4m3")
              dW = dy^T @ x

each ``torch._scaled_mm`` with fp32 accumulation and the step's compute dtype as output (bf16 under
``bf16-mixed``). Scales are powers of two (multiplying by them is exact) chosen so that the tensor's amax lands
at most at the format's largest value, minus ``margin`` powers of two. Recipes:

* ``"tensorwise"``: one scale per tensor from its current amax (no communication; Megatron's "current scaling").
* ``"rowwise"``: one scale per row of each GEMM operand along its reduction dimension, from the current values.
* ``"delayed"``: one scale per tensor from an amax history (``amax_history_len`` steps, ``"most_recent"`` or
  ``"max"``). Each step records the amaxes it saw; at the end of the optimizer step
  (:meth:`Float8Layers.end_step`, called by :class:`~lightning_megatron.parallel.finalize_grads.GradientFinalizer`)
  they are reduced (max) over the amax group, tensor x data x context parallel (Megatron's), and rolled into the
  histories, so every rank of that group uses the same scales, the ones a single process would use. The first
  step, with no history yet, scales each tensor from its current amax reduced over the same group.

Routed experts (:class:`~lightning_megatron.moe.experts.GroupedMLPExperts`, torch backend): each local expert's
two GEMMs get a :class:`Float8Gemm` of their own (``experts.fp8_gemms``; the experts then loop instead of one
grouped GEMM), with scales per expert; the delayed recipe reduces their amaxes over expert tensor x expert data
parallel (the ranks that hold the same experts).

Layers kept out of FP8: the embedding and output layer, MoE routers, routed experts under the Transformer Engine
backend, the first / last transformer layers with ``first_last_layers_bf16``, and layers whose local GEMM sizes are
not multiples of 16 (cuBLAS FP8 needs them). Which modules were converted is in :attr:`Float8Layers.converted`.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.optional import TRANSFORMER_ENGINE
from lightning_megatron.contract import PipelineModel
from lightning_megatron.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lightning_megatron.parallel.tensor_parallel.mappings import group_size

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: largest finite value of each format; both are 0.875 * 2**k (k = 9 and 16)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_FP8_MAX_EXPONENT = {E4M3: 9, E5M2: 16}

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "rowwise", "mxfp8")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
FP8_BACKENDS = ("auto", "te", "torch")
TE_INSTALL_HINT = (
    "install Transformer Engine for your CUDA and torch (`pip install --no-build-isolation "
    "transformer_engine[pytorch]`, see https://github.com/NVIDIA/TransformerEngine#installation; this "
    "repository's GPU machines: shared/te/README.md), or use fp8_backend='torch' (torch._scaled_mm)"
)
#: cuBLAS FP8 GEMMs need every GEMM dimension to be a multiple of this
GEMM_ALIGNMENT = 16


def _check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")


@dataclass(frozen=True)
class Float8Config:
    """What :func:`apply_fp8` converts and how (Megatron's names; every field validated here).

    Attributes:
        fp8_format: ``"e4m3"`` (every GEMM operand in e4m3) or ``"hybrid"`` (e4m3 forward, e5m2 gradients).
        recipe: ``"delayed"``, ``"tensorwise"``, ``"rowwise"`` (torch backend) or ``"mxfp8"`` (Transformer Engine
            on compute capability >= 10.0 only).
        margin: scales leave this many powers of two of headroom above the amax.
        amax_history_len, amax_compute_algo: the delayed recipe's history (``"most_recent"`` or ``"max"``).
        backend: ``"torch"`` (``torch._scaled_mm``) or ``"te"`` (Transformer Engine); ``"auto"`` is resolved by
            :meth:`resolve_backend`.
        first_last_layers_bf16: keep the first ``num_layers_at_start_in_bf16`` and the last
            ``num_layers_at_end_in_bf16`` transformer layers out of FP8 (Megatron's ``--first-last-layers-bf16``).
        sequence_parallel_gather: under sequence parallelism, all-gather the input of a column-parallel layer in
            FP8 (1 byte per element instead of 2) instead of gathering it in bf16 and casting after (the result is
            the same, bit for bit). None (default): with the delayed recipe, whose scale is known before the
            gather; True also with ``"tensorwise"`` (one more all-reduce of the input's amax over tp per layer).
            Torch backend only.
    """

    fp8_format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    backend: str = "auto"
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    sequence_parallel_gather: Optional[bool] = None

    def __post_init__(self) -> None:
        _check_choice("fp8", self.fp8_format, FP8_FORMATS)
        _check_choice("fp8_recipe", self.recipe, FP8_RECIPES + ("blockwise",))
        if self.recipe == "blockwise":
            raise ValueError("fp8_recipe='blockwise' (1x128 / 128x128 blocks) is not supported; use 'tensorwise', "
                             "'rowwise' or 'delayed'")
        _check_choice("fp8_backend", self.backend, FP8_BACKENDS)
        _check_choice("fp8_amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        for name in ("margin", "amax_history_len", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"fp8_{name}={value!r} must be an int" if name in ("margin", "amax_history_len")
                                 else f"{name}={value!r} must be an int")
        if self.margin < 0:
            raise ValueError(f"fp8_margin={self.margin} must be >= 0 (powers of two of headroom)")
        if self.amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len={self.amax_history_len} must be >= 1")
        if self.amax_history_len > 1 and self.recipe != "delayed":
            raise ValueError(f"fp8_amax_history_len={self.amax_history_len} applies to fp8_recipe='delayed' only "
                             f"(fp8_recipe={self.recipe!r} scales from current values); drop it or use 'delayed'")
        if not isinstance(self.first_last_layers_bf16, bool):
            raise ValueError(f"first_last_layers_bf16={self.first_last_layers_bf16!r} must be True or False")
        if self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0:
            raise ValueError(f"num_layers_at_start_in_bf16={self.num_layers_at_start_in_bf16} and "
                             f"num_layers_at_end_in_bf16={self.num_layers_at_end_in_bf16} must be >= 0")
        if self.first_last_layers_bf16 and self.recipe == "delayed":
            raise ValueError("first_last_layers_bf16=True does not work with fp8_recipe='delayed' (as in Megatron: "
                             "\"Delayed scaling does not support first / last layer in BF16\"); use "
                             "fp8_recipe='tensorwise' or 'rowwise'")
        if self.recipe == "mxfp8" and self.backend != "te":
            raise ValueError("fp8_recipe='mxfp8' needs fp8_backend='te' (Transformer Engine) and a GPU with compute "
                             "capability >= 10.0 (Blackwell); the torch backend offers 'tensorwise', 'rowwise' and "
                             "'delayed'")
        if self.sequence_parallel_gather not in (None, True, False):
            raise ValueError(f"fp8_sequence_parallel_gather={self.sequence_parallel_gather!r} must be None (auto), "
                             "True or False")
        if self.sequence_parallel_gather and (self.recipe not in ("delayed", "tensorwise") or self.backend == "te"):
            raise ValueError(f"fp8_sequence_parallel_gather=True with fp8_recipe={self.recipe!r}, "
                             f"fp8_backend={self.backend!r}: the FP8 all-gather of the sequence-parallel input is the "
                             "torch backend's, with one scale per tensor ('delayed' or 'tensorwise'); drop it")
        if self.recipe == "rowwise" and self.backend == "te":
            raise ValueError("fp8_recipe='rowwise' is the torch backend's (fp8_backend='torch'); Transformer Engine "
                             "offers 'delayed', 'tensorwise' (current scaling) and 'mxfp8'")

    @property
    def forward_dtype(self) -> torch.dtype:
        """Format of activations and weights (e4m3)."""
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        """Format of output gradients: e5m2 under ``"hybrid"``, else e4m3."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def resolve_backend(self, device: torch.device) -> "Float8Config":
        """This config with ``backend="auto"`` resolved: ``"te"`` on CUDA when ``transformer_engine.pytorch``
        imports (:func:`transformer_engine_available`) and the recipe is one of its own (not ``"rowwise"``), else
        ``"torch"``. Checks that an explicit ``"te"`` can run."""
        backend = self.backend
        if backend == "auto":   # TE's own recipes on CUDA (checked, i.e. imported, only there)
            te = device.type == "cuda" and self.recipe != "rowwise" and transformer_engine_available()
            backend = "te" if te else "torch"
        if backend == "te" and device.type != "cuda":
            raise ValueError(f"fp8_backend='te': Transformer Engine runs on CUDA GPUs only, this run is on "
                             f"{device.type!r}; use fp8_backend='torch' (torch._scaled_mm also runs on CPU)")
        if backend == "te" and self.sequence_parallel_gather:
            raise ValueError("fp8_sequence_parallel_gather=True: the FP8 all-gather of the sequence-parallel input is "
                             "the torch backend's, and fp8_backend='auto' chose Transformer Engine here; pass "
                             "fp8_backend='torch' or drop it")
        return self if backend == self.backend else _replace(self, backend=backend)

    @property
    def gathers_in_fp8(self) -> bool:
        """Whether a column-parallel layer under sequence parallelism all-gathers its input in FP8
        (``sequence_parallel_gather`` resolved: None means the delayed recipe on the torch backend)."""
        if self.backend == "te" or self.recipe not in ("delayed", "tensorwise"):
            return False
        return self.recipe == "delayed" if self.sequence_parallel_gather is None else self.sequence_parallel_gather

    def layers_in_bf16(self, num_layers: int) -> List[int]:
        """Global indices of the transformer layers kept out of FP8 (``first_last_layers_bf16``)."""
        if not self.first_last_layers_bf16:
            return []
        start = range(min(self.num_layers_at_start_in_bf16, num_layers))
        end = range(max(num_layers - self.num_layers_at_end_in_bf16, 0), num_layers)
        return sorted(set(start) | set(end))


def _replace(config: Float8Config, **changes: Any) -> Float8Config:
    values = {name: getattr(config, name) for name in Float8Config.__dataclass_fields__}
    values.update(changes)
    return Float8Config(**values)


# ---------------------------------------------------------------------------------------------- scaling
def scale_from_amax(amax: Tensor, dtype: torch.dtype, margin: int = 0) -> Tensor:
    """The power-of-two scale ``s`` (fp32, shape of ``amax``) with ``amax * s <= FP8_MAX[dtype] / 2**margin``, as
    large as possible; ``s = 1`` where ``amax`` is 0 or not finite. Exact (``frexp``), no host synchronisation."""
    amax = amax.float()
    good = torch.isfinite(amax) & (amax > 0)
    mantissa, exponent = torch.frexp(torch.where(good, amax, torch.ones_like(amax)))
    # amax = m * 2**e with m in [0.5, 1); the format's max is 0.875 * 2**E
    power = _FP8_MAX_EXPONENT[dtype] - exponent - (mantissa > 0.875).to(exponent.dtype) - margin
    power = power.clamp(-126, 126).float()
    return torch.where(good, torch.exp2(power), torch.ones_like(amax))


def quantize(t: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``t * scale`` rounded to ``dtype`` (saturating at its largest value)."""
    fmax = FP8_MAX[dtype]
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def _col_major(t: Tensor) -> Tensor:
    """The same matrix stored column-major (what ``torch._scaled_mm`` wants for its second operand)."""
    return t.t().contiguous().t()


def _scaled_mm(a: Tensor, b: Tensor, inv_a: Tensor, inv_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a * inv_a) @ (b * inv_b)``: ``a`` row-major, ``b`` column-major, ``inv_*`` the reciprocals of their
    quantisation scales (what ``torch._scaled_mm`` multiplies by). One per row / column (rowwise) gives bf16 out
    (what cuBLAS supports), cast to ``out_dtype``."""
    rowwise = inv_a.numel() > 1 or inv_b.numel() > 1
    mm_dtype = torch.bfloat16 if rowwise else out_dtype
    return torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype).to(out_dtype)


def _pad_tokens(a_t: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zero-pad the token dimension (the reduction dimension of the weight-gradient GEMM ``a_t [out, N] @ b [N, in]``)
    to a multiple of :data:`GEMM_ALIGNMENT` (cuBLAS FP8 needs it; the zeros add nothing). Rowwise scales along N
    (``scale_b [1, in]`` from N; scales or their reciprocals) are unchanged; ``b`` stays column-major."""
    n = a_t.shape[1]
    pad = -n % GEMM_ALIGNMENT
    if pad == 0:
        return a_t, b, scale_a, scale_b
    a_t = torch.cat([a_t, a_t.new_zeros(a_t.shape[0], pad)], dim=1)
    b = _col_major(torch.cat([b, b.new_zeros(pad, b.shape[1])], dim=0))
    return a_t, b, scale_a, scale_b


def compute_dtype(x: Tensor) -> torch.dtype:
    """The GEMM output dtype: the autocast dtype inside autocast, else ``x``'s."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


_INPUT, _WEIGHT, _GRAD = 0, 1, 2
_NO_RING = ("end_step(num_microbatches=...) counts the last uses of each FP8 GEMM, which needs their record ring: "
            "allocate the records with Float8Layers.allocate(device, ring=True) (parallelize does under pipeline "
            "parallelism)")
#: training uses per step a GEMM's delayed-scaling records keep at first (the last ones; the amax of older ones
#: still counts when all uses do; ``end_step(num_microbatches)`` with more micro-batches grows the ring to twice that)
AMAX_RING = 64
KINDS = ("input", "weight", "grad_output")


class Float8Gemm:
    """The torch-native FP8 local GEMM of one linear layer: ``gemm(x [..., in], weight [out, in], bias) ->
    [..., out]`` in the compute dtype (autocast's, else ``x``'s), differentiable in ``x`` and ``weight``.

    Holds the delayed recipe's state: per tensor kind (input, weight, output gradient) an amax history
    ``[3, amax_history_len]``, and the current amax of every training forward / backward since the last
    :meth:`end_step`. ``amax_groups``: the process groups the delayed recipe reduces amaxes over (tensor parallel,
    then data x context parallel). Until the first :meth:`end_step` (no history yet) it scales every tensor from
    its current amax reduced over those groups (one all-reduce per tensor, first step only).
    """

    def __init__(self, config: Float8Config, amax_groups: Sequence[Any] = ()) -> None:
        self.config = config
        self.amax_groups = [g for g in amax_groups if group_size(g) > 1]
        self.history: Optional[Tensor] = None       # [3, L]; None until the first end_step
        # the delayed recipe's records of this step's training uses, on the device and changed only in place (so a
        # compiled layer records without leaving its graph): per kind the largest amax of the uses (-1: none yet);
        # under a pipeline schedule also a ring of the last uses' amaxes (-1: free slot), the number of uses, and the
        # largest amax of the uses the ring dropped (end_step(num_microbatches) counts only the last uses)
        self.running: Optional[Tensor] = None        # [3]
        self.uses: Optional[Tensor] = None           # [3, capacity] (pipeline only)
        self.use_count: Optional[Tensor] = None      # [3] int64 (pipeline only)
        self.dropped: Optional[Tensor] = None        # [3] (pipeline only)
        self.static = False                          # records marked static graph inputs (allocate(static=True))
        # six 0-d fp32 tensors: per kind the scale the history gives, then the three reciprocals, computed for all
        # GEMMs at once whenever the histories change (end_step, load_state_dict), so a layer reads them instead of
        # computing them per use; set exactly when ``history`` is. Each is a tensor of its own, not a view into a
        # shared one: Inductor's CUDA lowering of ``torch._scaled_mm`` (its Triton templates) fails on a scale that is
        # a view at a storage offset of a graph input
        self.scales: Optional[Tuple[Tensor, ...]] = None
        #: forward calls that all-gathered the sequence-parallel input in FP8 (:meth:`sequence_parallel`)
        self.fp8_gathers = 0

    def __call__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return self._apply(_Float8LinearFn, x, weight, bias)

    def _apply(self, fn: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], *extra: Any) -> Tensor:
        """``fn.apply(x, weight, self, out_dtype, record, *extra)`` outside autocast, in the compute dtype, plus
        ``bias``."""
        record = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        out_dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            y = fn.apply(x, weight, self, out_dtype, record, *extra)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y

    def sequence_parallel(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Any) -> Tensor:
        """``all_gather(x) @ weight^T + bias`` for a column-parallel layer under sequence parallelism: ``x``
        ``[s/tp, b, in]`` is cast to FP8 with the whole input's scale and all-gathered over ``group`` (tp) in FP8,
        ``-> [s, b, out/tp]``; the input gradient is reduce-scattered over ``group`` in the compute dtype. Equal to
        gathering in bf16 and calling this GEMM (``config.gathers_in_fp8`` decides which a layer does)."""
        self.fp8_gathers += 1
        return self._apply(_Float8SequenceParallelLinearFn, x, weight, bias, group)

    def tensor_scale(self, kind: int, t: Tensor, dtype: torch.dtype, record: bool,
                     shard_group: Optional[Any] = None) -> Tensor:
        """Scale (0-dim fp32) for quantising tensor ``t`` of ``kind`` to ``dtype``: :meth:`scale_and_inverse`'s
        scale."""
        return self.scale_and_inverse(kind, t, dtype, record, shard_group)[0]

    def scale_and_inverse(self, kind: int, t: Tensor, dtype: torch.dtype, record: bool,
                          shard_group: Optional[Any] = None) -> Tuple[Tensor, Tensor]:
        """Scale (0-dim fp32) for quantising tensor ``t`` of ``kind`` (0 input, 1 weight, 2 output gradient) to
        ``dtype``, and its reciprocal (what ``torch._scaled_mm`` takes). ``record``: a training use (its amax joins
        the step's record). ``shard_group``: ``t`` is this rank's part of a tensor split over that group, and the
        scale is the whole tensor's, the same on every rank of it (where the scale comes from the current amax, that
        amax is all-reduced (max) over the group: one collective).

        With the delayed recipe's history both are the ones its per-step update computed from the history
        (:func:`_refresh_scales`, in the kind's format): two tensors read, no kernel."""
        cfg = self.config
        if self.scales is not None:   # delayed, with a history
            if record:
                self._record(kind, t.detach().abs().amax().float())
            return self.scales[kind], self.scales[3 + kind]
        current = t.detach().abs().amax().float()
        if shard_group is not None and group_size(shard_group) > 1:
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=shard_group)
        amax = current
        if cfg.recipe == "delayed" and record:   # no history yet: the current amax, the same on every rank of the
            self._record(kind, current)          # amax group (evaluation before any training step: this rank's)
            amax = current.clone()
            for g in self.amax_groups:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
        scale = scale_from_amax(amax, dtype, cfg.margin)
        return scale, scale.reciprocal()

    def allocate(self, device: torch.device, ring: bool = False, capacity: int = AMAX_RING,
                 static: bool = False) -> None:
        """The delayed recipe's record buffers on ``device`` (the strategy allocates them after materialisation,
        before any compiled forward; a direct eager use allocates them, with a ring, at its first record): the
        running amax per kind, and with ``ring`` a ring of the last ``capacity`` uses per kind (pipeline schedules,
        :meth:`Float8Layers.end_step` with ``num_microbatches``). Empty records. ``static``: mark them static
        addresses (unguarded, as parameters are), so layers replayed as CUDA graphs (``enable_cuda_graph``) write
        them in place; an ID guard per tensor would instead compile every layer once more, past dynamo's
        recompile limit."""
        if self.config.recipe != "delayed":
            return
        self.static = static
        self.running = torch.full((3,), -1.0, device=device)
        if ring:
            self.uses = torch.full((3, capacity), -1.0, device=device)
            self.use_count = torch.zeros(3, dtype=torch.int64, device=device)
            self.dropped = torch.full((3,), -1.0, device=device)
        else:
            self.uses = self.use_count = self.dropped = None
        if static:   # written in place inside the layers' CUDA graphs (and the scales, read there)
            from torch._dynamo import mark_static_address

            for t in (self.running, self.uses, self.use_count, self.dropped, *(self.scales or ())):
                if t is not None:
                    mark_static_address(t, guard=False)

    def _record(self, kind: int, current: Tensor) -> None:
        """Record a training use's amax (0-dim fp32) of ``kind``: in-place writes only (no host synchronisation, no
        Python state changed, so it stays inside a compiled graph)."""
        if self.running is None:
            self.allocate(current.device, ring=True)
        assert self.running is not None
        running = self.running[kind:kind + 1]
        torch.maximum(running, current.reshape(1).to(running.dtype), out=running)
        if self.uses is not None:
            assert self.use_count is not None and self.dropped is not None
            ring, count, dropped = self.uses[kind], self.use_count[kind:kind + 1], self.dropped[kind:kind + 1]
            slot = count % ring.shape[0]
            torch.maximum(dropped, ring.gather(0, slot), out=dropped)
            ring.scatter_(0, slot, current.reshape(1).to(ring.dtype))
            count.add_(1)

    def forget_uses(self) -> None:
        """Drop the records of this step's uses."""
        _forget_uses([self])

    def last_uses_amax(self, last: int) -> Tensor:
        """``[3]``: per kind the largest amax of the last ``last`` recorded uses (-1 for a kind without any), on the
        device; ``last`` larger than the ring counts the ring's uses. Needs the ring (``allocate(ring=True)``)."""
        if self.uses is None or self.use_count is None:
            raise RuntimeError(_NO_RING)
        return _ring_last_amax(self.uses, self.use_count, last)


def _ring_last_amax(uses: Tensor, use_count: Tensor, last: int) -> Tensor:
    """Record rings ``uses`` ``[..., 3, capacity]`` with their use counts ``[..., 3]`` -> ``[..., 3]``: per ring the
    largest amax of its last ``last`` uses (-1 where it has none); ``last`` larger than the ring counts the ring's."""
    capacity = uses.shape[-1]
    counts = use_count.unsqueeze(-1)
    j = torch.arange(min(last, capacity), device=uses.device)
    slots = (counts - 1 - j) % capacity                                              # [..., 3, k]: newest first
    return torch.where(j < counts, uses.gather(-1, slots), -1.0).amax(dim=-1)


def _forget_uses(gemms: Sequence[Float8Gemm]) -> None:
    """Drop the records of ``gemms``' uses since the last step: one multi-tensor copy per kind of buffer and shape."""
    for attr, empty in (("running", -1.0), ("uses", -1.0), ("use_count", 0), ("dropped", -1.0)):
        by_shape: Dict[Tuple[Tuple[int, ...], torch.device], List[Tensor]] = {}
        for g in gemms:
            t = getattr(g, attr)
            if t is not None:
                by_shape.setdefault((tuple(t.shape), t.device), []).append(t)
        for tensors in by_shape.values():
            torch._foreach_copy_(tensors, [torch.full_like(tensors[0], empty)] * len(tensors))


def _rowwise_scale(t: Tensor, dim: int, dtype: torch.dtype, margin: int) -> Tensor:
    """Scales of ``t`` (2-D) along ``dim``: ``[rows, 1]`` for ``dim=1``, ``[1, cols]`` for ``dim=0``."""
    return scale_from_amax(t.detach().abs().amax(dim=dim, keepdim=True), dtype, margin)


def _per_tensor_backward(ctx: Any, g2: Tensor, need_x: bool,
                         need_w: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The two backward GEMMs with one scale per tensor (tensorwise, delayed) from the FP8 operands the forward
    saved (``xq, wq`` and the reciprocals of their scales): ``dx = dy @ W`` ``[N, in]`` and ``dW = dy^T @ x``
    ``[out, in]`` in ``ctx.out_dtype`` (None where not needed); ``g2`` is the output gradient ``[N, out]``, quantised
    here."""
    gemm: Float8Gemm = ctx.gemm
    bwd = gemm.config.grad_dtype
    xq, wq, inv_x, inv_w = ctx.saved_tensors
    sg, inv_g = gemm.scale_and_inverse(_GRAD, g2, bwd, ctx.record)
    gq = quantize(g2, sg, bwd)
    grad_x = _scaled_mm(gq, _col_major(wq), inv_g, inv_w, ctx.out_dtype) if need_x else None
    grad_w = (_scaled_mm(*_pad_tokens(gq.t().contiguous(), _col_major(xq), inv_g, inv_x), ctx.out_dtype)
              if need_w else None)
    return grad_x, grad_w


class _Float8LinearFn(torch.autograd.Function):
    """``x @ W^T`` with all three GEMMs in FP8 (:class:`Float8Gemm`)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, gemm: Float8Gemm, out_dtype: torch.dtype, record: bool) -> Tensor:
        cfg = gemm.config
        fwd = cfg.forward_dtype
        x2 = x.reshape(-1, x.shape[-1])
        ctx.gemm, ctx.out_dtype, ctx.record = gemm, out_dtype, record
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        if cfg.recipe == "rowwise":
            sx = _rowwise_scale(x2, 1, fwd, cfg.margin)                  # [N, 1]
            sw = _rowwise_scale(weight, 1, fwd, cfg.margin)              # [out, 1]
            y = _scaled_mm(quantize(x2, sx, fwd), quantize(weight, sw, fwd).t(), sx.reciprocal(),
                           sw.t().contiguous().reciprocal(), out_dtype)
            ctx.save_for_backward(x2, weight)
        else:
            sx, inv_x = gemm.scale_and_inverse(_INPUT, x2, fwd, record)
            sw, inv_w = gemm.scale_and_inverse(_WEIGHT, weight, fwd, record)
            xq, wq = quantize(x2, sx, fwd), quantize(weight, sw, fwd)
            y = _scaled_mm(xq, wq.t(), inv_x, inv_w, out_dtype)
            ctx.save_for_backward(xq, wq, inv_x, inv_w)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        gemm: Float8Gemm = ctx.gemm
        cfg = gemm.config
        fwd, bwd, out_dtype = cfg.forward_dtype, cfg.grad_dtype, ctx.out_dtype
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = None
        if cfg.recipe == "rowwise":
            x2, weight = ctx.saved_tensors
            if need_x:   # dx [N, in] = dy [N, out] @ W [out, in]: reduction over out
                sg = _rowwise_scale(g2, 1, bwd, cfg.margin)                  # [N, 1]
                sw = _rowwise_scale(weight, 0, fwd, cfg.margin)              # [1, in]
                grad_x = _scaled_mm(quantize(g2, sg, bwd), _col_major(quantize(weight, sw, fwd)), sg.reciprocal(),
                                    sw.reciprocal(), out_dtype)
            if need_w:   # dW [out, in] = dy^T [out, N] @ x [N, in]: reduction over N
                gt = g2.t()
                sg = _rowwise_scale(gt, 1, bwd, cfg.margin)                  # [out, 1]
                sx = _rowwise_scale(x2, 0, fwd, cfg.margin)                  # [1, in]
                grad_w = _scaled_mm(*_pad_tokens(quantize(gt, sg, bwd).contiguous(), _col_major(quantize(x2, sx, fwd)),
                                                 sg.reciprocal(), sx.reciprocal()), out_dtype)
        else:
            grad_x, grad_w = _per_tensor_backward(ctx, g2, need_x, need_w)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape).to(ctx.x_dtype)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None


class _Float8SequenceParallelLinearFn(torch.autograd.Function):
    """``all_gather(x) @ W^T`` with the sequence-parallel input gathered in FP8 and all three GEMMs in FP8 (one scale
    per tensor: tensorwise or delayed); :meth:`Float8Gemm.sequence_parallel`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, gemm: Float8Gemm, out_dtype: torch.dtype, record: bool,
                group: Any) -> Tensor:
        from lightning_megatron.parallel.tensor_parallel.mappings import all_gather_dim0

        fwd = gemm.config.forward_dtype
        size = group_size(group)
        x2 = x.reshape(-1, x.shape[-1])
        sx, inv_x = gemm.scale_and_inverse(_INPUT, x2, fwd, record, shard_group=group)
        xq = all_gather_dim0(quantize(x2, sx, fwd).view(torch.uint8), group).view(fwd)   # [s * b, in]
        sw, inv_w = gemm.scale_and_inverse(_WEIGHT, weight, fwd, record)
        wq = quantize(weight, sw, fwd)
        y = _scaled_mm(xq, wq.t(), inv_x, inv_w, out_dtype)
        ctx.gemm, ctx.out_dtype, ctx.record, ctx.group = gemm, out_dtype, record, group
        ctx.x_shape = (x.shape[0] * size,) + tuple(x.shape[1:])
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.save_for_backward(xq, wq, inv_x, inv_w)
        return y.view(*ctx.x_shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        from lightning_megatron.parallel.tensor_parallel.mappings import reduce_scatter_dim0

        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x, grad_w = _per_tensor_backward(ctx, g2, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if grad_x is not None:   # the whole input's gradient, reduce-scattered to this rank's shard
            grad_x = reduce_scatter_dim0(grad_x.view(ctx.x_shape).to(ctx.x_dtype), ctx.group)
        if grad_w is not None:
            grad_w = grad_w.to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


# ---------------------------------------------------------------------------------------------- Transformer Engine
def import_transformer_engine() -> Any:
    """``transformer_engine.pytorch`` (imported here, only when asked for); ImportError saying how to install."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
    except ImportError as e:
        raise ImportError(f"fp8_backend='te' needs Transformer Engine, which is not importable here ({e}): "
                          f"{TE_INSTALL_HINT}") from e
    return te


def transformer_engine_available() -> bool:
    """Whether ``transformer_engine.pytorch`` imports here (it is imported: call only where it would be used). A
    broken installation (e.g. its library not loadable) counts as unavailable; the reason is logged."""
    if not TRANSFORMER_ENGINE:   # not installed (lightning_utilities RequirementCache)
        return False
    try:
        import_transformer_engine()
    except (ImportError, OSError, RuntimeError) as e:
        log.warning("fp8_backend='auto': Transformer Engine is installed but does not import (%s); using the torch "
                    "backend", e)
        return False
    return True


def transformer_engine_recipe(config: Float8Config) -> Any:
    """The Transformer Engine recipe object of ``config`` (imports ``transformer_engine``)."""
    import_transformer_engine()
    from transformer_engine.common import recipe as te_recipe

    fmt = te_recipe.Format.HYBRID if config.fp8_format == "hybrid" else te_recipe.Format.E4M3
    if config.recipe == "delayed":
        return te_recipe.DelayedScaling(fp8_format=fmt, margin=config.margin,
                                        amax_history_len=config.amax_history_len,
                                        amax_compute_algo=config.amax_compute_algo)
    if config.recipe == "tensorwise":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    if config.recipe == "mxfp8":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0):
            cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
            raise ValueError(f"fp8_recipe='mxfp8' needs a GPU with compute capability >= 10.0 (Blackwell); this one "
                             f"has {cap}; use fp8_recipe='delayed' or 'tensorwise'")
        return te_recipe.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"fp8_recipe={config.recipe!r} has no Transformer Engine recipe")


class TransformerEngineGemm:
    """A layer's local GEMM through Transformer Engine's ``te.Linear`` (no bias, ``parallel_mode=None``: the
    layer's own tensor-parallel communication stays around it), which uses the layer's weight parameter.
    Runs in FP8 inside TE's autocast (the precision plugin's forward context).

    Under ``MegatronStrategy(compile=True)`` the call is left out of the compiled graph (``torch.compiler.disable``):
    dynamo cannot trace TE's modules (torch 2.11 fails guarding them), so a compiled layer runs its norms, rotary
    embedding, attention and activation as compiled graphs between TE's own FP8 GEMMs."""

    def __init__(self, in_features: int, out_features: int) -> None:
        self.in_features, self.out_features = in_features, out_features
        self._linear: Optional[nn.Module] = None

    @torch.compiler.disable
    def __call__(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        if self._linear is None:
            te = import_transformer_engine()
            self._linear = te.Linear(self.in_features, self.out_features, bias=False, params_dtype=weight.dtype,
                                     device=weight.device)
        if self._linear.weight is not weight:
            self._linear.weight = weight   # the layer's parameter (materialisation replaces it once)
        y = self._linear(x)
        return y + bias.to(y.dtype) if bias is not None else y


def transformer_engine_context(config: Float8Config, amax_group: Any = None) -> Callable[[], ContextManager]:
    """Context factory entering Transformer Engine's autocast with ``config``'s recipe, amaxes reduced over
    ``amax_group``: ``te.autocast`` where TE has it (``fp8_autocast`` is its deprecated wrapper, one
    ``DeprecationWarning`` per call), else ``te.fp8_autocast`` (older TE)."""
    te = import_transformer_engine()
    recipe = transformer_engine_recipe(config)
    if hasattr(te, "autocast"):
        return lambda: te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_group)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)


# ---------------------------------------------------------------------------------------------- conversion
class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMM runs through ``fp8_gemm`` (:class:`Float8Gemm` or :class:`TransformerEngineGemm`);
    holds the original layer's parameters (same names, so checkpoints do not change)."""

    def __init__(self, linear: nn.Linear, fp8_gemm: Callable[..., Tensor]) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.fp8_gemm = fp8_gemm

    def forward(self, x: Tensor) -> Tensor:
        return self.fp8_gemm(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fp8=True"


@dataclass
class Float8Layers:
    """What :func:`apply_fp8` converted. ``converted`` / ``kept``: module names (relative to the module given to
    :func:`apply_fp8`) of the layers whose GEMMs run in FP8 / the linear layers left as they were, with why."""

    config: Float8Config
    converted: List[str] = field(default_factory=list)
    kept: Dict[str, str] = field(default_factory=dict)
    gemms: List[Any] = field(default_factory=list)
    amax_groups: List[Any] = field(default_factory=list)
    #: the routed experts' FP8 GEMMs (torch backend), each with its name ``<experts module>.<global expert>.fc1|fc2``
    expert_gemms: List["Float8Gemm"] = field(default_factory=list)
    expert_gemm_names: List[str] = field(default_factory=list)
    expert_amax_groups: List[Any] = field(default_factory=list)
    #: optimizer steps whose amaxes joined the delayed recipe's histories (a loaded checkpoint with histories counts)
    steps: int = 0

    @contextlib.contextmanager
    def compile_stance(self) -> Iterator[None]:
        """The context the forward passes run in: until the delayed recipe (torch backend) has had its first
        update (:meth:`end_step`), compiled layers run eagerly (``torch.compiler.set_stance("force_eager")``), so
        ``compile=True`` compiles each layer once, with histories, instead of a second time for the first step's
        scaling from current amaxes. Nothing for other recipes and backends."""
        if self.config.recipe != "delayed" or self.config.backend != "torch" or self.steps > 0:
            yield
            return
        with torch.compiler.set_stance("force_eager"):
            yield

    def retain(self, module: nn.Module) -> None:
        """Forget the converted layers no longer in ``module`` (the other pipeline stages' after the split)."""
        present = {name for name, _ in module.named_modules()}
        keep = [i for i, name in enumerate(self.converted) if name in present]
        self.converted = [self.converted[i] for i in keep]
        self.gemms = [self.gemms[i] for i in keep]
        self.kept = {name: why for name, why in self.kept.items() if name in present}
        experts = [i for i, name in enumerate(self.expert_gemm_names) if name.rsplit(".", 2)[0] in present]
        self.expert_gemms = [self.expert_gemms[i] for i in experts]
        self.expert_gemm_names = [self.expert_gemm_names[i] for i in experts]

    def allocate(self, device: torch.device, ring: bool = False, static: bool = False) -> None:
        """The delayed recipe's record buffers of every torch-backend GEMM on ``device`` (after materialisation, before
        the first, possibly compiled, forward: :meth:`Float8Gemm.allocate`); ``ring``: also the rings of the last uses
        that :meth:`end_step` with ``num_microbatches`` reads (pipeline schedules); ``static``: as static inputs of
        the layers' CUDA graphs (``enable_cuda_graph``)."""
        for _, gemm in self._named_gemms():
            if isinstance(gemm, Float8Gemm):
                gemm.allocate(device, ring=ring, static=static)

    def _named_gemms(self) -> List[Tuple[str, Any]]:
        return list(zip(self.converted, self.gemms)) + list(zip(self.expert_gemm_names, self.expert_gemms))

    def state_dict(self) -> Dict[str, Tensor]:
        """The delayed recipe's amax histories ``[3, amax_history_len]`` (input, weight, output gradient) by
        converted layer name, on the CPU; empty for other recipes or before the first step. The same on every rank of
        the amax group (tensor x data x context parallel), so one rank's holds for its pipeline stage."""
        out: Dict[str, Tensor] = {}
        for name, gemm in self._named_gemms():
            history = getattr(gemm, "history", None)
            if history is not None:
                out[name] = history.detach().cpu().clone()
        return out

    def load_state_dict(self, state: Dict[str, Tensor], device: Optional[torch.device] = None) -> None:
        """Restore the amax histories of :meth:`state_dict` onto ``device`` (default: where they are, else the
        CPU): the layers of this rank present in ``state``; a layer the checkpoint has no history for starts without
        one, as in a fresh run."""
        for name, gemm in self._named_gemms():
            if name not in state or not isinstance(gemm, Float8Gemm):
                continue
            history = state[name]
            want = (3, self.config.amax_history_len)
            if tuple(history.shape) != want:
                raise ValueError(f"FP8 amax history of {name} in the checkpoint has shape {tuple(history.shape)}, this "
                                 f"run keeps {want} (fp8_amax_history_len={self.config.amax_history_len}); resume with "
                                 f"fp8_amax_history_len={history.shape[1]}")
            where = gemm.history.device if gemm.history is not None else device
            gemm.history = history.to(where) if where is not None else history.clone()
            gemm.forget_uses()
            self.steps = max(self.steps, 1)
        _refresh_scales([gemm for _, gemm in self._named_gemms() if isinstance(gemm, Float8Gemm)])

    def end_step(self, num_microbatches: Optional[int] = None) -> None:
        """The delayed recipe's per-step amax update: per GEMM the largest amax its training uses recorded this
        step, reduced (max) over the amax groups in one all-reduce per group, becomes the newest history entry.
        ``num_microbatches``: count only the last that many uses of each GEMM (a pipeline schedule's metadata
        inference runs an extra forward and backward on placeholder tensors first). No-op for other recipes.
        Call once per optimizer step on every rank (the gradient finaliser does)."""
        if self.config.recipe != "delayed" or self.config.backend != "torch":
            return
        for gemms, groups in ((self.gemms, self.amax_groups), (self.expert_gemms, self.expert_amax_groups)):
            _end_step(gemms, groups, num_microbatches)
        self.steps += 1


def _end_step(gemms: Sequence["Float8Gemm"], groups: Sequence[Any], num_microbatches: Optional[int]) -> None:
    """The step's amaxes ``[len(gemms), 3]`` of ``gemms`` (their records; the last ``num_microbatches`` uses when
    given), one all-reduce (max) per group, rolled into their histories: a fixed number of kernels for all GEMMs,
    none of them a host read once every GEMM has a history. A GEMM without uses this step contributes -1 (it must
    still join: every rank of a group calls with the same GEMMs) and leaves its history as it is."""
    if not gemms:
        return
    recorded = [g for g in gemms if g.running is not None]
    if not recorded and not any(group_size(g) > 1 for g in groups):
        return
    if recorded:
        device = recorded[0].running.device
    else:
        default = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = next((g.history.device for g in gemms if g.history is not None), default)
    none = torch.full((3,), -1.0, device=device)
    if num_microbatches is None:
        amax = torch.stack([g.running if g.running is not None else none for g in gemms])          # [n, 3]
    else:
        amax = _last_uses_amax(gemms, num_microbatches, none)
    used = (amax >= 0).any(dim=1, keepdim=True)           # a kind without uses beside used ones counts 0
    amax = torch.where(used, amax.clamp(min=0.0), -1.0)
    for g in recorded:
        if num_microbatches is not None and g.uses is not None and num_microbatches > g.uses.shape[1]:
            # room for every micro-batch next time, marked as before
            g.allocate(device, ring=True, capacity=2 * num_microbatches, static=g.static)
    _forget_uses(recorded)
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    _roll_histories(gemms, amax)
    _refresh_scales(gemms)


def _last_uses_amax(gemms: Sequence["Float8Gemm"], last: int, none: Tensor) -> Tensor:
    """``[n, 3]``: per GEMM and kind the largest amax of its last ``last`` recorded uses (``none`` for a GEMM that
    never recorded): rings of one capacity are read all at once, others one by one."""
    recorded = [g for g in gemms if g.running is not None]
    if any(g.uses is None for g in recorded):
        raise RuntimeError(_NO_RING)
    if len({g.uses.shape for g in recorded}) > 1:
        return torch.stack([g.last_uses_amax(last) if g.running is not None else none for g in gemms])
    mine = _ring_last_amax(torch.stack([g.uses for g in recorded]),                 # [k, 3, capacity]
                           torch.stack([g.use_count for g in recorded]), last).unbind(0)
    picked = iter(mine)
    return torch.stack([next(picked) if g.running is not None else none for g in gemms])


def _roll_histories(gemms: Sequence["Float8Gemm"], amax: Tensor) -> None:
    """Roll row ``i`` of ``amax`` ``[n, 3]`` into the history ``[3, L]`` of ``gemms[i]`` in place, unless it holds
    -1 (no use on any rank). The histories that exist are updated in one pass on the device; a GEMM without one (first
    steps) starts it when its row is valid, which is read on the host once for all of them."""
    rows = amax.unbind(0)     # views: picking rows by a host-side list launches no index copy to the device
    have = [i for i, g in enumerate(gemms) if g.history is not None]
    if have:
        histories = [gemms[i].history for i in have]
        old = torch.stack(histories)                                               # [k, 3, L]
        mine = torch.stack([rows[i] for i in have]) if len(have) < len(gemms) else amax
        rolled = torch.cat([mine.unsqueeze(2), old[:, :, :-1]], dim=2)
        valid = (mine >= 0).all(dim=1).view(-1, 1, 1)
        torch._foreach_copy_(histories, list(torch.where(valid, rolled, old).unbind(0)))
    new = [i for i, g in enumerate(gemms) if g.history is None]
    if new:
        starts = (torch.stack([rows[i] for i in new]) >= 0).all(dim=1).tolist()
        for i, start in zip(new, starts):
            if start:
                history = torch.zeros(3, gemms[i].config.amax_history_len, device=amax.device)
                history[:, 0] = rows[i]
                gemms[i].history = history


def _refresh_scales(gemms: Sequence["Float8Gemm"]) -> None:
    """Each history's scales and their reciprocals (``Float8Gemm.scales``, six 0-d tensors), for all GEMMs with a history
    at once: per kind the scale of the history's amax (its newest entry, or its largest with ``amax_compute_algo=
    "max"``) in the kind's format (the forward format for inputs and weights, the gradient format for output
    gradients), updated in place (a fixed number of operations for any number of GEMMs) so compiled layers and their
    CUDA graphs keep reading the same tensors. A GEMM's first scales are new tensors, marked as its records are
    (``static``)."""
    by_scaling: Dict[Tuple[Any, ...], List["Float8Gemm"]] = {}
    for g in gemms:
        if g.history is not None:
            c = g.config
            by_scaling.setdefault((c.forward_dtype, c.grad_dtype, c.margin, c.amax_compute_algo,
                                   g.history.device), []).append(g)
    for (fwd, bwd, margin, algo, _), group in by_scaling.items():
        histories = torch.stack([g.history for g in group])                                # [n, 3, L]
        amax = histories[:, :, 0] if algo == "most_recent" else histories.amax(dim=2)       # [n, 3]
        scale = torch.cat([scale_from_amax(amax[:, :_GRAD], fwd, margin),
                           scale_from_amax(amax[:, _GRAD:], bwd, margin)], dim=1)
        values = torch.cat([scale, scale.reciprocal()], dim=1).reshape(-1).unbind(0)          # 6n 0-d views
        have = [i for i, g in enumerate(group) if g.scales is not None]
        if have:
            torch._foreach_copy_([t for i in have for t in group[i].scales],
                                 [values[6 * i + j] for i in have for j in range(6)])
        for i, g in enumerate(group):
            if g.scales is None:
                g.scales = tuple(v.clone() for v in values[6 * i:6 * i + 6])   # six tensors of their own
                if g.static:
                    from torch._dynamo import mark_static_address

                    for t in g.scales:
                        mark_static_address(t, guard=False)


def _expert_types() -> Tuple[type, ...]:
    from lightning_megatron.moe.experts import GroupedMLPExperts, SequentialMLPExperts

    return (GroupedMLPExperts, SequentialMLPExperts)


def _fp8_capable(module: nn.Module) -> Optional[Tuple[int, int]]:
    """``(in, out)`` of the local GEMM of a linear layer FP8 can convert, else None."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or type(module) is nn.Linear:
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            return None
        return int(weight.shape[1]), int(weight.shape[0])
    return None


def _candidate_layers(module: nn.Module, config: Float8Config) -> Tuple[List[Tuple[str, nn.Module]], Dict[str, str]]:
    """Linear layers and routed-expert modules to convert (name, module) and those kept out with why: inside
    models with the GPT layout (:class:`~lightning_megatron.contract.PipelineModel`) the transformer layers' linears
    and experts; in any other module every linear layer."""
    models = [(name, m) for name, m in module.named_modules() if isinstance(m, PipelineModel)]
    kept: Dict[str, str] = {}
    out: List[Tuple[str, nn.Module]] = []
    if not models:
        return [(n, m) for n, m in module.named_modules() if _fp8_capable(m) is not None], kept
    for model_name, model in models:
        prefix = f"{model_name}." if model_name else ""
        layers = getattr(model.decoder, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            raise ValueError(f"{type(model).__name__}.decoder.layers must be an nn.ModuleDict keyed by global layer "
                             "index to apply FP8 per layer")
        bf16 = set(config.layers_in_bf16(len(layers)))
        for key, layer in layers.items():
            for sub, m in layer.named_modules():
                if _fp8_capable(m) is None and not isinstance(m, _expert_types()):
                    continue
                name = f"{prefix}decoder.layers.{key}" + (f".{sub}" if sub else "")
                if int(key) in bf16:
                    kept[name] = "first_last_layers_bf16"
                else:
                    out.append((name, m))
        for name, m in model.named_modules():
            if _fp8_capable(m) is not None and not name.startswith("decoder.layers."):
                kept[prefix + name] = "outside the transformer layers (embedding / output layer)"
    return out, kept


def _convert_experts(name: str, experts: nn.Module, config: Float8Config, result: Float8Layers) -> Optional[str]:
    """Give a :class:`~lightning_megatron.moe.experts.GroupedMLPExperts` one ``(fc1, fc2)`` pair of torch FP8 GEMMs
    per local expert (recorded in ``result`` by global expert index); returns why it stays as it is, or None."""
    from lightning_megatron.moe.experts import GroupedMLPExperts

    if not isinstance(experts, GroupedMLPExperts):
        return "reference experts (SequentialMLPExperts) are not converted"
    if config.backend != "torch":
        return "routed experts run FP8 with the torch backend only (fp8_backend='torch')"
    h, fc1_out = int(experts.weight1.shape[1]), int(experts.weight1.shape[2])
    f_local = int(experts.weight2.shape[1])
    if any(d % GEMM_ALIGNMENT for d in (h, fc1_out, f_local)):
        return f"expert GEMMs {h}x{fc1_out} / {f_local}x{h} are not multiples of {GEMM_ALIGNMENT}"
    pairs = []
    for e in range(experts.num_local_experts):
        pair = (Float8Gemm(config, result.expert_amax_groups), Float8Gemm(config, result.expert_amax_groups))
        pairs.append(pair)
        for which, gemm in zip(("fc1", "fc2"), pair):
            result.expert_gemms.append(gemm)
            result.expert_gemm_names.append(f"{name}.{experts.expert_offset + e}.{which}")
    experts.fp8_gemms = pairs
    return None


def apply_fp8(module: nn.Module, config: Float8Config, amax_groups: Sequence[Any] = (),
              expert_amax_groups: Sequence[Any] = ()) -> Float8Layers:
    """Give the linear layers of ``module`` FP8 local GEMMs, and its routed experts (torch backend) FP8 GEMMs per
    expert (in place; on the meta device or materialised).

    ``config`` must have its backend resolved (:meth:`Float8Config.resolve_backend`). ``amax_groups``: the
    process groups the delayed recipe reduces amaxes over (tensor parallel and data x context parallel of this
    pipeline stage); ``expert_amax_groups``: those of the experts' GEMMs (expert tensor parallel and expert data
    parallel: the ranks holding the same experts). They take part in :meth:`Float8Layers.end_step`, called once per
    step.
    """
    if config.backend == "auto":
        raise ValueError("apply_fp8 needs a resolved backend: call Float8Config.resolve_backend(device) first")
    result = Float8Layers(config=config, amax_groups=[g for g in amax_groups if group_size(g) > 1],
                          expert_amax_groups=[g for g in expert_amax_groups if group_size(g) > 1])
    targets, result.kept = _candidate_layers(module, config)
    for name, layer in targets:
        if isinstance(layer, _expert_types()):
            why = _convert_experts(name, layer, config, result)
            if why is None:
                result.converted.append(name)
            else:
                result.kept[name] = why
            continue
        in_features, out_features = _fp8_capable(layer)
        if in_features % GEMM_ALIGNMENT or out_features % GEMM_ALIGNMENT:
            result.kept[name] = f"local GEMM {in_features}x{out_features} is not a multiple of {GEMM_ALIGNMENT}"
            continue
        gemm = (Float8Gemm(config, result.amax_groups) if config.backend == "torch"
                else TransformerEngineGemm(in_features, out_features))
        result.gemms.append(gemm)
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            layer.fp8_gemm = gemm
        else:
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, child, Float8Linear(layer, gemm))
        result.converted.append(name)
    return result


def fp8_forward_context(config: Optional[Float8Config], amax_group: Any = None) -> Callable[[], ContextManager]:
    """The context FP8 GEMMs need around forward: TE's autocast for the TE backend, nothing for torch's."""
    if config is None or config.backend != "te":
        return contextlib.nullcontext
    return transformer_engine_context(config, amax_group)


__all__ = [
    "Float8Config",
    "Float8Gemm",
    "Float8Layers",
    "Float8Linear",
    "TransformerEngineGemm",
    "apply_fp8",
    "scale_from_amax",
    "quantize",
    "import_transformer_engine",
    "transformer_engine_available",
    "transformer_engine_recipe",
    "FP8_MAX",
]
