"""The torch-native FP8 GEMM of one linear layer (:class:`Float8Gemm`): scaling, quantisation, the three
``torch._scaled_mm`` GEMMs as autograd functions (plain and sequence-parallel), and the delayed recipe's per-GEMM
records (amax of each training use) that :mod:`lightning_megatron.precision.fp8.delayed` rolls into histories."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatron.parallel.tensor_parallel.mappings import group_size
from lightning_megatron.precision.fp8.config import _FP8_MAX_EXPONENT, FP8_MAX, GEMM_ALIGNMENT, Float8Config

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
        #: the op that produces this GEMM's output gradient hands its amax to :meth:`record_grad_amax` (SwiGLU before
        #: ``linear_fc1``: :func:`convert_to_fp8` sets it), so the backward does not read that gradient for it again
        self.grad_amax_from_producer = False

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
            if record and not (kind == _GRAD and self._producer_records()):
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

    def _producer_records(self) -> bool:
        """Whether this step's output-gradient amaxes come from :meth:`record_grad_amax`: the producer hands them
        over, the recipe has a history (the scale does not wait for the amax) and the records keep no ring of uses
        (whose order the backward's own record keeps)."""
        return (self.grad_amax_from_producer and self.scales is not None and self.running is not None
                and self.uses is None)

    def record_grad_amax(self, amax: Tensor) -> None:
        """Record ``amax`` (0-d fp32), the largest absolute value of this GEMM's output gradient, handed over by the
        op that produced that gradient in the backward (before this GEMM's backward runs), when
        :meth:`_producer_records`; otherwise the backward records it itself and this does nothing."""
        if self._producer_records():
            self._record(_GRAD, amax)

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


def _save_operands(ctx: Any, xq: Tensor, weight: Tensor, wq: Tensor, sw: Tensor, inv_x: Tensor,
                   inv_w: Tensor) -> None:
    """Save what the backward GEMMs with one scale per tensor need: the FP8 input and, for a weight of 4 bytes per
    element, its FP8 copy; a weight of 2 bytes or less is saved itself (a reference, no memory) with its scale ``sw``,
    and the backward quantises it again: the same bits (the weight does not change between a forward and its
    backward), for one more read of the weight and no FP8 copy of every layer's weight held from the forward to the
    backward."""
    ctx.requantize = weight.element_size() <= 2
    ctx.save_for_backward(xq, weight if ctx.requantize else wq, sw, inv_x, inv_w)


def _per_tensor_backward(ctx: Any, g2: Tensor, need_x: bool,
                         need_w: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The two backward GEMMs with one scale per tensor (tensorwise, delayed) from the FP8 operands the forward
    saved (:func:`_save_operands`: ``xq``, ``wq`` or the weight to quantise again, and the reciprocals of their
    scales): ``dx = dy @ W`` ``[N, in]`` in ``ctx.out_dtype`` and
    ``dW = dy^T @ x`` ``[out, in]`` in the weight's dtype ``ctx.w_dtype`` (None where not needed); ``g2`` is the
    output gradient ``[N, out]``, quantised here. The weight gradient leaves the GEMM in the weight's dtype: fp32
    weights under bf16 autocast get the GEMM's fp32 accumulation as it is, with no bf16 rounding and no cast kernel
    after it (cuBLAS writes fp32 output for one scale per tensor)."""
    gemm: Float8Gemm = ctx.gemm
    bwd = gemm.config.grad_dtype
    xq, w, sw, inv_x, inv_w = ctx.saved_tensors
    wq = quantize(w, sw, gemm.config.forward_dtype) if ctx.requantize else w
    sg, inv_g = gemm.scale_and_inverse(_GRAD, g2, bwd, ctx.record)
    gq = quantize(g2, sg, bwd)
    grad_x = _scaled_mm(gq, _col_major(wq), inv_g, inv_w, ctx.out_dtype) if need_x else None
    grad_w = (_scaled_mm(*_pad_tokens(gq.t().contiguous(), _col_major(xq), inv_g, inv_x), ctx.w_dtype)
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
            _save_operands(ctx, xq, weight, wq, sw, inv_x, inv_w)
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
        _save_operands(ctx, xq, weight, wq, sw, inv_x, inv_w)
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
