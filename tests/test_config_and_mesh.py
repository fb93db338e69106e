"""ParallelConfig validation (one clear error per broken rule, naming the numbers) and ParallelMesh groups.

The mesh groups are checked on 8 real gloo processes (one spawned run for every layout) against an
independent re-implementation of Megatron-core's ``RankGenerator`` (``generate_masked_orthogonal_rank_groups``
with order ``tp-cp-ep-dp-pp`` for the dense grid and ``tp-ep-dp-pp`` for the expert grid), plus a few groups
written out literally. Pipeline layouts (which the strategy does not run yet) still have a well-defined mesh.
"""
from __future__ import annotations

import re
import warnings
from types import SimpleNamespace
from typing import Dict, List, Sequence

import pytest

from lightning_megatron import GPTConfig
from lightning_megatron.parallel import ParallelConfig
from tests._dist import init_gloo, run_distributed

# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        (dict(tp=2, pp=2, cp=2), 12, "world size 12 is not divisible by tp*pp*cp = 2*2*2 = 8"),
        (dict(tp=4), 6, "world size 6 is not divisible by tp*pp*cp = 4*1*1 = 4"),
        (dict(tp=2, ep=3), 8, "world size 8 is not divisible by etp*ep*pp = 2*3*1 = 6"),
        (dict(tp=1, ep=4, etp=2, pp=2), 8, "world size 8 is not divisible by etp*ep*pp = 2*4*2 = 16"),
    ],
    ids=["dense", "dense-tp", "expert", "expert-etp-pp"],
)
def test_resolve_rejects_world_size(kwargs, world, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**kwargs).resolve(world)


def test_resolve_derives_dp_and_edp():
    c = ParallelConfig(tp=2, pp=2, cp=2, ep=4, etp=1).resolve(16)
    assert (c.dp, c.world_size, c.model_parallel_size, c.edp) == (2, 16, 8, 2)
    c = ParallelConfig(tp=2, ep=4).resolve(8)
    assert (c.etp, c.dp, c.edp) == (2, 4, 1)


@pytest.mark.parametrize(
    "layout,model,message",
    [
        (dict(tp=4), dict(num_attention_heads=6), "num_attention_heads=6 is not divisible by tp=4"),
        (dict(tp=4), dict(num_attention_heads=8, num_query_groups=2), "num_query_groups=2 is not divisible by tp=4"),
        (dict(tp=4, sequence_parallel=True), dict(num_attention_heads=8, seq_length=10),
         "seq_length=10 is not divisible by tp=4"),
    ],
    ids=["heads", "query-groups", "seq-length-sp"],
)
def test_validate_model_rejects(layout, model, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**layout).validate_model(SimpleNamespace(**model))


def test_validate_model_accepts():
    # without SP the sequence need not divide; query groups default to the heads; GPTConfig has the names
    ParallelConfig(tp=4).validate_model(SimpleNamespace(num_attention_heads=8, seq_length=10))
    ParallelConfig(tp=2, sequence_parallel=True).validate_model(
        GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16))
    with pytest.raises(ValueError, match=re.escape("num_query_groups=2 is not divisible by tp=4")):
        ParallelConfig(tp=4).validate_model(
            GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16))


def test_sequence_parallel_with_tp1_warns_and_disables():
    with pytest.warns(UserWarning, match="sequence_parallel=True has no effect with tp=1"):
        c = ParallelConfig(tp=1, sequence_parallel=True)
    assert c.sequence_parallel is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ParallelConfig(tp=2, sequence_parallel=True).sequence_parallel is True


def test_vp_needs_pp():
    with pytest.raises(ValueError, match=re.escape("vp=2 (virtual pipeline stages) needs pp > 1, got pp=1")):
        ParallelConfig(vp=2)
    assert ParallelConfig(vp=2, pp=2).vp == 2


@pytest.mark.parametrize("value", ["ring", ["p2p", "allgather"]], ids=["str", "per-layer"])
def test_bad_cp_comm_type(value):
    bad = value if isinstance(value, str) else value[-1]
    with pytest.raises(ValueError, match=re.escape(f"cp_comm_type {bad!r} is not one of")):
        ParallelConfig(cp=2, cp_comm_type=value)
    ParallelConfig(cp=2, cp_comm_type=["p2p", "a2a", "all_gather", "a2a+p2p"],
                   hierarchical_context_parallel_sizes=[1, 2])  # all valid


def test_hierarchical_cp_sizes_must_multiply_to_cp():
    with pytest.raises(ValueError, match=re.escape("hierarchical_context_parallel_sizes=[2, 3] multiply to 6, not cp=4")):
        ParallelConfig(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 3])
    with pytest.raises(ValueError, match="needs hierarchical_context_parallel_sizes"):
        ParallelConfig(cp=4, cp_comm_type="a2a+p2p")
    assert ParallelConfig(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]).cp == 4


def test_per_layer_cp_comm_type_needs_one_entry_per_layer():
    cfg = ParallelConfig(cp=2, cp_comm_type=["p2p", "a2a", "p2p"])
    with pytest.raises(ValueError, match=re.escape("cp_comm_type has 3 entries but the model has num_layers=2")):
        cfg.validate_model(GPTConfig.tiny())


def test_sizes_derived_only_after_resolve():
    cfg = ParallelConfig(tp=2)
    with pytest.raises(RuntimeError, match="resolve"):
        _ = cfg.edp
    assert cfg.resolve(8).dp == 4 and cfg.edp == 4


@pytest.mark.parametrize("name,value", [("tp", 0), ("pp", -1), ("cp", 1.5), ("ep", 0), ("etp", 0), ("vp", 0)])
def test_sizes_must_be_positive_integers(name, value):
    pattern = re.escape(f"{name} must be a positive integer") + ".*" + re.escape(repr(value))
    with pytest.raises(ValueError, match=pattern):
        ParallelConfig(**{name: value})


# --------------------------------------------------------------------------------------------- mesh groups

# Megatron-core's RankGenerator, re-implemented (parallel_state.generate_masked_orthogonal_rank_groups).


def _prefix_product(a: Sequence[int]) -> List[int]:
    out = [1]
    for v in a:
        out.append(out[-1] * v)
    return out


def _decompose(index: int, shape: Sequence[int]) -> List[int]:
    return [(index // d) % s for s, d in zip(shape, _prefix_product(shape))]


def megatron_groups(world: int, sizes: Dict[str, int], order: str, token: str) -> List[List[int]]:
    """All groups of ``token`` (e.g. ``"dp-cp"``) for the grid ``sizes`` in ``order`` (first = fastest)."""
    names = order.split("-")
    parallel = [sizes[n] for n in names]
    assert _prefix_product(parallel)[-1] == world
    mask = [n in token.split("-") for n in names]
    stride = _prefix_product(parallel)
    masked_shape = [s for s, m in zip(parallel, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel, mask) if not m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    size = _prefix_product(masked_shape)[-1]
    groups = []
    for g in range(world // size):
        gi = _decompose(g, unmasked_shape)
        groups.append([sum(a * b for a, b in zip(_decompose(r, masked_shape), masked_stride))
                       + sum(a * b for a, b in zip(gi, unmasked_stride)) for r in range(size)])
    return groups


def megatron_group_of(rank: int, world: int, layout: Dict[str, int], dim: str) -> List[int]:
    tp, pp, cp, ep = (layout.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    etp = layout.get("etp", tp)
    if dim in ("tp", "cp", "dp", "pp", "dp_cp"):
        sizes = dict(tp=tp, cp=cp, ep=1, dp=world // (tp * cp * pp), pp=pp)
        groups = megatron_groups(world, sizes, "tp-cp-ep-dp-pp", "dp-cp" if dim == "dp_cp" else dim)
    else:
        sizes = dict(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp)
        groups = megatron_groups(world, sizes, "tp-ep-dp-pp", {"etp": "tp", "ep": "ep", "edp": "dp"}[dim])
    (mine,) = [sorted(g) for g in groups if rank in g]
    return mine


MESH_WORLD = 8
DIMS = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "etp", "edp", "embedding")
LAYOUTS = {
    "tp2-cp2-dp2": dict(tp=2, cp=2),
    "tp2-ep4": dict(tp=2, ep=4),
    "tp2-ep4-etp1": dict(tp=2, ep=4, etp=1),
    "tp2-pp2-dp2": dict(tp=2, pp=2),
    "pp2-dp4": dict(pp=2),
    "tp2-pp4": dict(tp=2, pp=4),
}


def _mesh_worker(rank: int, world: int) -> Dict[str, Dict]:
    from lightning_megatron.parallel import ParallelMesh

    init_gloo(rank, world)
    out = {}
    for name, layout in LAYOUTS.items():
        mesh = ParallelMesh(ParallelConfig(**layout))
        out[name] = {
            "ranks": {d: mesh.ranks(d) for d in DIMS},
            "rank": {d: mesh.rank(d) for d in DIMS},
            "size": {d: mesh.size(d) for d in DIMS},
            "first": mesh.is_first_stage,
            "last": mesh.is_last_stage,
        }
    return out


@pytest.fixture(scope="module")
def meshes() -> List[Dict[str, Dict]]:
    return run_distributed(_mesh_worker, MESH_WORLD)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_groups_follow_megatron_order(meshes, layout):
    spec = LAYOUTS[layout]
    for rank, per_rank in enumerate(meshes):
        m = per_rank[layout]
        for dim in DIMS:
            if dim == "embedding":
                continue
            want = megatron_group_of(rank, MESH_WORLD, spec, dim)
            assert m["ranks"][dim] == want, f"rank {rank} {layout} {dim}: {m['ranks'][dim]} != {want}"
            assert m["size"][dim] == len(want), (rank, layout, dim)
            assert m["rank"][dim] == want.index(rank), (rank, layout, dim, m["rank"][dim])


def test_mesh_groups_literal(meshes):
    """The groups spelled out for two layouts, tp fastest-varying."""
    for r, per_rank in enumerate(meshes):
        dense, expert = per_rank["tp2-cp2-dp2"]["ranks"], per_rank["tp2-ep4"]["ranks"]
        folded = per_rank["tp2-ep4-etp1"]["ranks"]
        assert dense["tp"] == [r - r % 2, r - r % 2 + 1]  # [0,1], [2,3], [4,5], [6,7]
        assert dense["cp"] == [r - r % 4 + r % 2, r - r % 4 + r % 2 + 2]  # [0,2], [1,3], [4,6], [5,7]
        assert dense["dp"] == [r % 4, r % 4 + 4]  # [0,4], [1,5], [2,6], [3,7]
        assert dense["dp_cp"] == [r % 2 + 2 * i for i in range(4)]  # [0,2,4,6], [1,3,5,7]
        assert dense["pp"] == [r] and dense["ep"] == [r]
        assert dense["etp"] == dense["tp"] and dense["edp"] == dense["dp_cp"]  # etp defaults to tp
        # tp=2, ep=4 on 8 ranks: expert grid (pp=1, edp=1, ep=4, etp=2)
        assert expert["etp"] == [r - r % 2, r - r % 2 + 1]
        assert expert["ep"] == [r % 2 + 2 * i for i in range(4)]  # [0,2,4,6], [1,3,5,7]
        assert expert["edp"] == [r]
        assert expert["dp"] == expert["ep"]  # dense dp=4 over the same ranks
        # tp=2, ep=4, etp=1: expert grid (pp=1, edp=2, ep=4, etp=1)
        assert folded["etp"] == [r]
        assert folded["ep"] == [r - r % 4 + i for i in range(4)]  # [0,1,2,3], [4,5,6,7]
        assert folded["edp"] == [r % 4, r % 4 + 4]


def test_embedding_group(meshes):
    """First and last stage of each pipeline; just this rank at pp=1; none on a middle stage."""
    for r, per_rank in enumerate(meshes):
        for layout in ("tp2-cp2-dp2", "tp2-ep4"):
            assert per_rank[layout]["ranks"]["embedding"] == [r]
            assert per_rank[layout]["first"] and per_rank[layout]["last"]
        for layout in ("tp2-pp2-dp2", "pp2-dp4"):  # pp=2 over 8 ranks: pipelines [r, r+4]
            m = per_rank[layout]
            assert m["ranks"]["embedding"] == m["ranks"]["pp"] == [r % 4, r % 4 + 4], (r, layout, m["ranks"])
            assert m["rank"]["embedding"] == r // 4 and m["size"]["embedding"] == 2
            assert (m["first"], m["last"]) == (r < 4, r >= 4)
        m = per_rank["tp2-pp4"]  # pipelines [0,2,4,6] and [1,3,5,7]
        stage = r // 2
        assert m["ranks"]["pp"] == [r % 2 + 2 * i for i in range(4)]
        assert (m["first"], m["last"]) == (stage == 0, stage == 3)
        if stage in (0, 3):
            assert m["ranks"]["embedding"] == [r % 2, r % 2 + 6], (r, m["ranks"]["embedding"])
            assert m["size"]["embedding"] == 2 and m["rank"]["embedding"] == (stage == 3)
        else:
            assert m["ranks"]["embedding"] == [] and m["size"]["embedding"] == 0 and m["rank"]["embedding"] == -1


def test_parallel_config_fields_come_in_sections_by_concern():
    """Every option of ParallelConfig belongs to exactly one section of ``SECTIONS``, and the fields are declared in
    the sections' order (the docstring's and the validation's), so a new flag has to be placed by its concern."""
    import dataclasses

    from lightning_megatron.parallel.config import SECTIONS

    declared = [f.name for f in dataclasses.fields(ParallelConfig) if f.init]
    by_section = [name for names in SECTIONS.values() for name in names]
    assert by_section == declared
    doc = ParallelConfig.__doc__
    for name in declared:   # documented (a pair such as the uneven stages' two sizes shares one entry)
        assert re.search(rf"\n        ([a-z_0-9]+, )*{name}(, [a-z_0-9]+)*:", doc), name
