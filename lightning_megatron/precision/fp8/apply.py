"""FP8 as one step of :func:`lightning_megatron.parallelize`: :func:`apply_fp8` converts the model's linear layers
(:func:`~lightning_megatron.precision.fp8.layers.convert_to_fp8`) with the amax groups of the mesh and returns the
handle (:class:`~lightning_megatron.precision.fp8.layers.Float8Layers`) that owns FP8 from then on: its records on
the device and its end-of-step amax update, registered as a hook of the gradient finaliser
(:meth:`Float8Layers.install`), its compile stance and its checkpoint state. :class:`Float8Step` is that step as
the precision plugin hands it to ``parallelize`` (:meth:`lightning_megatron.MegatronPrecision.parallelize_step`):
the same conversion, keeping the handle for the plugin that made it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from torch import nn

from lightning_megatron.precision.fp8.config import Float8Config
from lightning_megatron.precision.fp8.layers import Float8Layers, convert_to_fp8

if TYPE_CHECKING:
    from lightning_megatron.parallel.config import ParallelConfig
    from lightning_megatron.parallel.mesh import ParallelMesh


@dataclass(eq=False)
class Float8Step:
    """The FP8 step of :func:`lightning_megatron.parallelize` from a precision plugin: ``config`` (its backend
    resolved) and, once the step ran, ``layers``, the handle it returned (None before). The plugin that made the step
    reads its handle here (compile stance, checkpoint state); nothing else hands it back.

    Attributes:
        config: the FP8 recipe (:class:`~lightning_megatron.precision.fp8.Float8Config`, backend resolved).
        layers: the conversion's handle (:class:`~lightning_megatron.precision.fp8.Float8Layers`), or None before
            :meth:`apply`.
    """

    config: Float8Config
    layers: Optional[Float8Layers] = None

    def apply(self, module: nn.Module, mesh: Optional["ParallelMesh"], config: "ParallelConfig") -> Float8Layers:
        """:func:`apply_fp8` with this step's ``config``; the handle is kept in :attr:`layers` and returned."""
        self.layers = _convert(module, mesh, config, self.config)
        return self.layers

    def adopt(self, layers: Optional[Float8Layers]) -> None:
        """Take the handle of a module converted earlier (``parallelize`` returns an already-parallelised module's
        record as it is, e.g. ``trainer.test`` after ``trainer.fit`` with a new plugin)."""
        self.layers = layers


def apply_fp8(module: nn.Module, mesh: Optional["ParallelMesh"], config: "ParallelConfig",
              fp8: Union[Float8Config, Float8Step, None]) -> Optional[Float8Layers]:
    """The FP8 step of :func:`lightning_megatron.parallelize` (after ``apply_recompute``, before ``apply_compile``
    and ``split_pipeline``, on the meta device): FP8 local GEMMs for the linear layers and routed experts
    (:func:`~lightning_megatron.precision.fp8.layers.convert_to_fp8`) when ``fp8`` is given, a
    :class:`~lightning_megatron.precision.fp8.Float8Config` (backend resolved) or a :class:`Float8Step` (which then
    keeps the handle). The delayed recipe reduces amaxes over this stage's ``tp`` and ``dp_cp`` groups of ``mesh``
    (the routed experts' over ``etp`` and ``edp``); no collective runs here.

    Returns the handle (None without ``fp8``); after materialisation ``parallelize`` calls its
    :meth:`~lightning_megatron.precision.fp8.Float8Layers.install`.

    Raises:
        ValueError: FP8 layers with ``tp_comm_overlap`` under sequence parallelism (the overlapped rings are built for
            bf16 GEMMs only); an unresolved backend.
    """
    if isinstance(fp8, Float8Step):
        return fp8.apply(module, mesh, config)
    if fp8 is None:
        return None
    return _convert(module, mesh, config, fp8)


def _convert(module: nn.Module, mesh: Optional["ParallelMesh"], config: "ParallelConfig",
             fp8: Float8Config) -> Float8Layers:
    groups = [mesh.group("tp"), mesh.group("dp_cp")] if mesh is not None else []
    expert_groups = [mesh.group("etp"), mesh.group("edp")] if mesh is not None else []
    layers = convert_to_fp8(module, fp8, amax_groups=groups, expert_amax_groups=expert_groups)
    if layers.gemms and config.tp_comm_overlap and config.sequence_parallel and config.tp > 1:
        raise ValueError(
            f"tp_comm_overlap=True with FP8 layers (tp={config.tp}, sequence_parallel=True): the overlapped rings of "
            "chunked GEMMs are built for bf16 GEMMs only, so the FP8 layers would run without the overlap; drop "
            "tp_comm_overlap, or FP8 (MegatronPrecision(fp8=None))")
    return layers


__all__ = ["Float8Step", "apply_fp8"]
