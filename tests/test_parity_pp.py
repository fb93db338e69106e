"""End-to-end numerics of pipeline parallelism: MegatronStrategy(pp=...) under the real Trainer against the
single-process run of the same model, data and optimizer (loss per optimizer step and final weights)."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from tests._dist import run_distributed
from tests.parity import (
    SEED,
    ListDataset,
    assert_state_close,
    check_layout_matches_single_process,
    make_samples,
    new_module,
    reference_loop,
    tiny_config,
    trainer_for,
)

STEPS = 3


CASES = {
    # id: (world, strategy kwargs, config overrides, micro-batches per step, clip)
    "pp2-1f1b": (2, dict(pp=2), {}, 4, None),
    "pp2-gpipe-clip": (2, dict(pp=2, pipeline_schedule="gpipe"), {}, 2, 0.05),
    "pp4-1f1b": (4, dict(pp=4), dict(num_layers=4), 4, None),
    "pp4-gpipe": (4, dict(pp=4, pipeline_schedule="gpipe"), dict(num_layers=4), 4, None),
    "pp2-vp2-interleaved": (2, dict(pp=2, vp=2), dict(num_layers=4), 4, 0.05),
    "pp2-zbv": (2, dict(pp=2, vp=2, pipeline_schedule="zbv"), dict(num_layers=4), 4, None),
    "pp2-dualpipev": (2, dict(pp=2, vp=2, pipeline_schedule="dualpipev"), dict(num_layers=4), 4, None),
    "pp2-vp2-looped-bfs": (2, dict(pp=2, vp=2, pipeline_schedule="looped_bfs"), dict(num_layers=4), 4, None),
    "pp2-vp2-interleaved-zb": (2, dict(pp=2, vp=2, pipeline_schedule="interleaved_zero_bubble"), dict(num_layers=4),
                               4, 0.05),
    "pp2-uneven": (2, dict(pp=2, num_layers_in_first_pipeline_stage=1), dict(num_layers=3), 2, None),
    "pp2-uneven-last": (2, dict(pp=2, num_layers_in_last_pipeline_stage=1), dict(num_layers=3), 2, 0.05),
    "pp2-tied": (2, dict(pp=2), dict(untie_embeddings_and_output_weights=False), 2, 0.05),
    "tp2xpp2-sp": (4, dict(tp=2, pp=2, sequence_parallel=True), dict(num_query_groups=4), 2, 0.05),
    "tp2xpp2xdp2": (8, dict(tp=2, pp=2, sequence_parallel=True), dict(num_query_groups=4), 2, 0.05),
}


# Cases whose final weights sit above the 1e-5 default, with the measured reason.
STATE_RTOL = {
    # looped BFS runs a stage's backwards for all micro-batches in reverse micro-batch order (torch's
    # ScheduleLoopedBFS: reversed(range(n_microbatches))), so the micro-batch gradients are summed in reverse
    # order: the first step's gradients differ from the reference by 4.7e-9 relative (9.3e-10 absolute at most).
    # AdamW's first steps move each weight by about lr * sign(grad), which amplifies that where gradients are
    # near zero: after 3 steps the word embeddings differ by 1.39e-5 relative, every other tensor by 4.7e-7 at
    # most, the losses by 6.7e-8. A single-process loop that backpropagates the micro-batches in reverse order
    # lands on the same 1.39e-5 (other orders on 3e-6 to 7e-6): summation order, not a schedule error.
    "pp2-vp2-looped-bfs": 3e-5,
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_single_process(case):
    world, kwargs, overrides, accumulate, clip = CASES[case]
    check_layout_matches_single_process(world, kwargs, tiny_config(**overrides), accumulate, clip, STEPS,
                                        state_rtol=STATE_RTOL.get(case, 1e-5))


# ------------------------------------------------------------------------------------------ checkpoints
def save_under(rank, world, cfg, strategy_kwargs, samples, micro_batch, accumulate, path):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, STEPS)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 2, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch))
    trainer.save_checkpoint(path)
    return None


def test_pp_checkpoint_holds_full_state(tmp_path):
    """A checkpoint saved under tp=2 x pp=2 (tied embeddings) holds the full single-process state: weights and
    Adam moments of every stage, keyed by name, the tied embedding once."""
    cfg = tiny_config(num_query_groups=4, untie_embeddings_and_output_weights=False)
    accumulate, micro_batch = 2, 2
    samples = make_samples(cfg, STEPS * accumulate * micro_batch)
    ref = reference_loop(cfg, samples, STEPS, micro_batch, accumulate=accumulate, stop_after=2)
    path = str(tmp_path / "pp.ckpt")
    run_distributed(save_under, 4, cfg, dict(tp=2, pp=2), samples, micro_batch, accumulate, path)
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    assert_state_close(ckpt["state_dict"], ref["state"])
    named = dict(ref["module"].named_parameters())
    opt = ckpt["optimizer_states"][0]
    assert sorted(opt["state"]) == sorted(named)
    flat = [n for g in opt["param_groups"] for n in g["params"]]
    assert sorted(flat) == sorted(named) and len(flat) == len(set(flat))
    want = ref["optimizer"]["state"]
    want_names = [n for n, p in named.items() if p.dim() >= 2] + [n for n, p in named.items() if p.dim() < 2]
    for index, values in want.items():
        assert_state_close({"m": opt["state"][want_names[index]]["exp_avg"]}, {"m": values["exp_avg"]})


# ------------------------------------------------------------------------------------------ predict
def predict_under(rank, world, cfg, strategy_kwargs, samples):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, 1)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1)
    out = trainer.predict(module, DataLoader(ListDataset(samples), batch_size=len(samples)))
    return out[0]


def test_predict_under_pp2_matches_single_process():
    cfg = tiny_config()
    samples = make_samples(cfg, 4)
    ref = reference_loop(cfg, samples, 1, 4, stop_after=0)["module"]
    from tests.parity import collate

    batch = collate(samples)
    with torch.no_grad():
        ref.eval()
        want = ref(batch["tokens"], batch["position_ids"], batch["labels"])
    for got in run_distributed(predict_under, 2, cfg, dict(pp=2, pipeline_schedule="gpipe"), samples):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ errors
def fit_expecting_error(rank, world, cfg, strategy_kwargs, accumulate):
    pl.seed_everything(SEED, verbose=False)
    samples = make_samples(cfg, 8)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1, accumulate_grad_batches=accumulate)
    try:
        trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(samples), batch_size=2))
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("overrides,kwargs,accumulate,pattern", [
    (dict(num_layers=3), dict(pp=2), 2, "num_layers=3 is not divisible by the 2 pipeline stages"),
    (dict(num_layers=4), dict(pp=2, vp=4), 2, "num_layers=4 is not divisible by the 8 pipeline stages"),
    # 1f1b runs a step shorter than pp under GPipe (tests/test_lightning_conformance.py); DualPipeV has no stand-in
    (dict(num_layers=4), dict(pp=2, vp=2, pipeline_schedule="dualpipev"), 2,
     "needs at least 4 micro-batches per optimizer step, and accumulate_grad_batches=2"),
], ids=["layers-not-divisible", "layers-not-divisible-vp", "too-few-microbatches"])
def test_pipeline_errors(overrides, kwargs, accumulate, pattern):
    messages = run_distributed(fit_expecting_error, 2, tiny_config(**overrides), kwargs, accumulate)
    assert all(pattern in m for m in messages), messages


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(pp=2, vp=2, pipeline_schedule="1f1b"), "runs one stage per rank but vp=2"),
    (dict(pp=2, pipeline_schedule="zbv"), "needs vp=2"),
    (dict(pp=2, pipeline_schedule="interleaved_1f1b"), "needs vp >= 2"),
    (dict(pp=2, pipeline_schedule="pipedream"), "is not one of"),
])
def test_unsupported_schedule_combinations(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MegatronStrategy(**kwargs)


class TrainLossTrace(pl.Callback):
    """``(global_step, train_loss or None)`` after every Lightning batch (micro-batch)."""

    def __init__(self) -> None:
        self.trace = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train_loss")
        self.trace.append((trainer.global_step, None if value is None else float(value)))


def _train_loss_trace(rank, world, cfg, samples, strategy_kwargs, accumulate, steps):
    pl.seed_everything(SEED, verbose=False)
    trace = TrainLossTrace()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, callbacks=[trace],
                          accumulate_grad_batches=accumulate)
    trainer.fit(new_module(cfg, steps), DataLoader(ListDataset(samples), batch_size=1, shuffle=False))
    return trace.trace


def test_train_loss_means_the_same_under_pp1_and_pp2():
    """``train_loss`` is the optimizer step's global token-mean, logged once per step at its last micro-batch, under
    every layout: pp=2 (the pipeline schedule) and pp=1 (the plain loop) log the same value at the same micro-batch
    (None before the first step ends, then the last finished step's value), and it equals the reference's step mean."""
    cfg, accumulate, steps = tiny_config(), 4, 2
    samples = make_samples(cfg, steps * accumulate)
    plain = run_distributed(_train_loss_trace, 1, cfg, samples, dict(), accumulate, steps)[0]
    piped = run_distributed(_train_loss_trace, 2, cfg, samples, dict(pp=2), accumulate, steps)
    ref = reference_loop(cfg, samples, steps, 1, accumulate=accumulate)["losses"]
    ref_steps = [sum(ref[i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(steps)]
    assert len(plain) == steps * accumulate
    for i, (step, value) in enumerate(plain):
        finished = (i + 1) // accumulate
        assert step == finished
        if finished == 0:
            assert value is None, plain
        else:
            assert abs(value - ref_steps[finished - 1]) <= 1e-5 * ref_steps[finished - 1], (plain, ref_steps)
    for trace in piped:
        assert [s for s, _ in trace] == [s for s, _ in plain]
        for (_, got), (_, want) in zip(trace, plain):
            assert (got is None) == (want is None) and (got is None or abs(got - want) <= 1e-6 * want), (trace, plain)
