"""``ParallelRun`` without Lightning: a plain loop over the run's calls (``parallelize``, ``prepare_data_parallel``,
``shard_optimizers``, then per step ``start_step``, backward, ``finalize``, ``clip``, the optimizer) at dp = 2 matches
one process training the same weights on the whole batch with plain torch (float64, SGD, clipped), with the
buffer's reductions started inside the backward and with the distributed optimizer."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests._dist import init_gloo, run_distributed, run_each

STEPS, BATCH, LR, MAX_NORM = 3, 2, 0.1, 0.05


def _config() -> Any:
    from lightning_megatron import GPTConfig

    return GPTConfig.tiny(hidden_size=32, ffn_hidden_size=64, num_layers=2, seq_length=16, vocab_size=128)


def _batches(dp: int) -> torch.Tensor:
    """``[steps, dp * BATCH, seq + 1]`` token ids, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, _config().vocab_size, (STEPS, dp * BATCH, _config().seq_length + 1), generator=gen)


def _model() -> Any:
    from lightning_megatron import GPTModel

    with torch.device("meta"):
        return GPTModel(_config())


def _run_case(rank: int, world: int, options: Dict[str, Any]) -> Dict[str, Any]:
    from lightning_megatron import ParallelConfig, ParallelMesh, ParallelRun

    device = torch.device("cpu")
    mesh = ParallelMesh(ParallelConfig(**options), "cpu")
    model = _model()
    run = ParallelRun(mesh, device)
    run.parallelize(model, seed=7, convert=lambda m: m.double())
    run.prepare_data_parallel(model)
    optimizer, = run.shard_optimizers([torch.optim.SGD(model.parameters(), lr=LR)], model)
    dp, dp_rank = mesh.size("dp_cp"), mesh.rank("dp_cp")
    main = run.parallelized.main_params
    norms: List[float] = []
    launched_in_backward = 0
    for ids in _batches(dp):
        mine = ids[dp_rank * BATCH:(dp_rank + 1) * BATCH]
        run.start_step(1)
        model(mine[:, :-1], None, mine[:, 1:]).mean().backward()
        launched_in_backward += sum(b.flat is not None for b in main.buckets)
        run.finalize()
        norms.append(float(run.clip(list(model.parameters()), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms,
            "launched_in_backward": launched_in_backward, "sharded": main.sharded, "buckets": len(main.buckets)}


def _runs(rank: int, world: int) -> Dict[str, Any]:
    init_gloo(rank, world)
    cases = [("overlap", (dict(overlap_grad_reduce=True, bucket_size=4000),)),
             ("distributed-optimizer", (dict(overlap_grad_reduce=True, bucket_size=4000,
                                             use_distributed_optimizer=True),))]
    return run_each(rank, world, _run_case, cases)


def _reference(rank: int, world: int) -> Dict[str, Any]:
    """One process, plain torch on the whole batch: the same initial weights (``parallelize`` at world 1, no buffer),
    torch's clipping and SGD."""
    from lightning_megatron import ParallelConfig, ParallelMesh
    from lightning_megatron.parallelize import parallelize

    init_gloo(rank, world)
    mesh = ParallelMesh(ParallelConfig(), "cpu")
    model = _model()
    parallelize(model, mesh, mesh.config, device=torch.device("cpu"), seed=7)
    model.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for ids in _batches(2):
        model(ids[:, :-1], None, ids[:, 1:]).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms}


@pytest.fixture(scope="module")
def results() -> Dict[str, Any]:
    reference, = run_distributed(_reference, 1)
    return {"reference": reference, "runs": run_distributed(_runs, 2)}


@pytest.mark.parametrize("case", ["overlap", "distributed-optimizer"])
def test_plain_loop_over_the_run_matches_one_process(results, case):
    reference = results["reference"]
    for rank, runs in enumerate(results["runs"]):
        got = runs[case]
        assert isinstance(got, dict), got   # a traceback: the case raised
        assert got["buckets"] > 1 and got["launched_in_backward"] > 0, got   # reductions started in the backward
        assert got["sharded"] == (case == "distributed-optimizer")
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-10, abs=0)
        assert max(reference["norms"]) > MAX_NORM   # the clip acted
        for name, want in reference["weights"].items():
            diff = (got["weights"][name] - want).abs().max().item()
            assert diff < 1e-10, (case, rank, name, diff)
