"""The process grid: Megatron's rank order on top of ``torch.distributed.DeviceMesh``."""
from __future__ import annotations

from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_megatron.parallel.config import ParallelConfig

DENSE_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")


class ParallelMesh:
    """Dense and expert process grids for one process, with rank/size/group queries.

    Dense grid ``(pp, dp, cp, tp)`` with tp fastest-varying (Megatron's ``tp-cp-ep-dp-pp`` order: ranks
    ``0..tp-1`` form the first TP group). Expert grid ``(pp, edp, ep, etp)`` over the same ranks (ep is
    folded into dp x cp x tp). Groups: ``tp, pp, dp, cp, dp_cp, ep, etp, edp, ep_etp`` (the ep x etp block that
    shares one set of tokens between its experts) and ``embedding`` (the first
    and last pipeline stage of this rank's pipeline; a middle stage (pp > 2) is in none, as in Megatron:
    its ``group("embedding")`` is None, ``ranks`` empty, ``size`` 0 and ``rank`` -1). Build it once per run
    (the strategy does) and pass it around; there is no module-level state.

    Args:
        config: the layout; :meth:`ParallelConfig.resolve` is called with the world size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
        timeout: timeout of every group the mesh creates (a collective waiting longer raises); None: torch's
            default for new groups (30 minutes on gloo, 10 on NCCL), which ignores the world group's.
    """

    def __init__(self, config: ParallelConfig, device_type: str = "cpu", timeout: Optional[timedelta] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs torch.distributed initialised (the strategy does this)")
        self.config = config.resolve(dist.get_world_size())
        self.timeout = timeout
        c = self.config
        world = torch.arange(c.world_size)
        self.dense = DeviceMesh(device_type, world.view(c.pp, c.dp, c.cp, c.tp), mesh_dim_names=DENSE_DIMS)
        self.expert = DeviceMesh(
            device_type, world.view(c.pp, c.edp, c.ep, c.etp), mesh_dim_names=EXPERT_DIMS
        )
        self.dp_cp_mesh = self.dense["dp", "cp"]._flatten("dp_cp")
        self.ep_etp_mesh = self.expert["ep", "etp"]._flatten("ep_etp")
        self._groups: Dict[str, Optional[dist.ProcessGroup]] = {d: self.dense.get_group(d) for d in DENSE_DIMS}
        self._groups.update({d: self.expert.get_group(d) for d in ("edp", "ep", "etp")})
        self._groups["dp_cp"] = self.dp_cp_mesh.get_group()
        self._groups["ep_etp"] = self.ep_etp_mesh.get_group()
        self._groups["embedding"] = self._new_embedding_group(world.view(c.pp, -1))
        if c.cp > 1 and c.hierarchical_context_parallel_sizes:
            self._groups.update(self._new_hierarchical_cp_groups(world.view(c.pp, c.dp, c.cp, c.tp)))
        if timeout is not None:
            self._set_timeout(timeout)
        self._coords = dict(zip(DENSE_DIMS, self.dense.get_coordinate()))
        self._coords.update(zip(EXPERT_DIMS, self.expert.get_coordinate()))

    def _set_timeout(self, timeout: timedelta) -> None:
        """Give every group of both grids (and the flattened and extra ones) ``timeout`` (local, no communication):
        ``DeviceMesh`` creates its groups with torch's default timeout, not the world group's."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        groups = [self.dense.get_group(d) for d in DENSE_DIMS] + [self.expert.get_group(d) for d in EXPERT_DIMS]
        groups += [g for g in self._groups.values() if g is not None]
        for group in {id(g): g for g in groups}.values():
            _set_pg_timeout(timeout, group)

    @staticmethod
    def _new_embedding_group(pp_major: torch.Tensor) -> Optional[dist.ProcessGroup]:
        """Groups of [first stage, last stage] of every pipeline; every rank takes part in each creation.

        Returns this rank's group, or None on a middle pipeline stage (it holds no embedding).
        """
        mine: Optional[dist.ProcessGroup] = None
        rank = dist.get_rank()
        for column in pp_major.t().tolist():
            ranks: List[int] = sorted({column[0], column[-1]})
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine

    def _new_hierarchical_cp_groups(self, grid: torch.Tensor) -> Dict[str, dist.ProcessGroup]:
        """``cp_inner`` / ``cp_outer`` for ``cp_comm_type="a2a+p2p"``: each CP group cut into consecutive
        inner groups of ``hierarchical_context_parallel_sizes[0]`` ranks (all-to-all) and strided outer groups
        across them (ring). Every rank takes part in creating every group."""
        inner_size = self.config.hierarchical_context_parallel_sizes[0]
        rank = dist.get_rank()
        mine: Dict[str, dist.ProcessGroup] = {}
        for cp_ranks in grid.permute(0, 1, 3, 2).reshape(-1, self.config.cp).tolist():
            inner = [cp_ranks[i:i + inner_size] for i in range(0, len(cp_ranks), inner_size)]
            outer = [cp_ranks[j::inner_size] for j in range(inner_size)]
            for name, groups in (("cp_inner", inner), ("cp_outer", outer)):
                for ranks in groups:
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine[name] = group
        return mine

    def group(self, name: str) -> Optional[dist.ProcessGroup]:
        """Process group of dimension ``name`` (``tp, pp, dp, cp, dp_cp, ep, etp, edp, ep_etp, embedding``, and
        ``cp_inner`` / ``cp_outer`` with hierarchical context parallelism)."""
        return self._groups[name]

    def size(self, name: str) -> int:
        """Size of dimension ``name``."""
        if self._groups[name] is None:  # embedding group on a middle pipeline stage
            return 0
        return dist.get_world_size(self._groups[name])

    def rank(self, name: str) -> int:
        """This process's rank inside dimension ``name``."""
        if name == "dp_cp":
            return self._coords["dp"] * self.config.cp + self._coords["cp"]
        if name == "ep_etp":
            return self._coords["ep"] * self.config.etp + self._coords["etp"]
        if name == "embedding":
            return -1 if self._groups[name] is None else dist.get_rank(self._groups[name])
        return self._coords[name]

    def ranks(self, name: str) -> List[int]:
        """Global ranks of this process's group in dimension ``name``."""
        if self._groups[name] is None:
            return []
        return dist.get_process_group_ranks(self._groups[name])

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._groups["tp"]

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        return self._groups["dp_cp"]

    @property
    def is_first_stage(self) -> bool:
        return self._coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self._coords["pp"] == self.config.pp - 1

    def __repr__(self) -> str:
        c = self.config
        return (
            f"ParallelMesh(rank={dist.get_rank()}, tp={c.tp}, pp={c.pp}, dp={c.dp}, cp={c.cp}, ep={c.ep}, "
            f"etp={c.etp}, edp={c.edp}, coords={self._coords})"
        )
