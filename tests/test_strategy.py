"""MegatronStrategy end to end on CPU/gloo: checkpoint resharding and resume, validation and test loss, the
spawn launcher, error messages and gradient accumulation, each against a single-process reference.

How Lightning 2.6 resumes (what the resume reference is built on): ``trainer.fit(max_steps=2)`` ends with
the epoch counter advanced (``current_epoch == 1``) although the epoch was cut short, so the checkpoint that
``trainer.save_checkpoint`` writes afterwards says "epoch 1, 2 batches done". ``fit(ckpt_path=...)`` then
restores optimizer, LR scheduler and ``global_step`` exactly, but a plain DataLoader is not resumable: the
sampler is re-seeded for epoch 1 (``seed + 1``) and its iterator starts from the first batch, while
``batch_idx`` continues at 2 (Lightning warns "resuming from a checkpoint that ended before the epoch
ended"), so epoch 1 ends 2 batches early. Steps 3-4 therefore train on batches 0-1 of the epoch-1 order,
not on batches 2-3 of epoch 0 as an uninterrupted run would; a checkpoint written mid-fit (from a callback)
instead replays epoch 0 from its first batch. The reference below is a plain 4-step loop over exactly the
batches Lightning feeds, and the test checks that order explicitly.
"""
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.multiprocessing import ProcessExitedException
from torch.utils.data import DataLoader

from lightning_megatron import GPTModel, MegatronStrategy
from lightning_megatron.parallel.context_parallel import zigzag_split
from tests._dist import run_distributed
from tests.parity import (
    SEED,
    ListDataset,
    LossRecorder,
    StepLossRecorder,
    assert_state_close,
    lightning_train_order,
    make_samples,
    new_module,
    reference_loop,
    reference_run,
    reference_val_loss,
    tiny_config,
    trainer_for,
)

GLOBAL_BATCH = 4


def assert_losses_close(got, want, rtol=1e-5):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= rtol * abs(w), (got, want)


def sample_ids(samples, batch, cp: int = 1, cp_rank: int = 0):
    """Indices into ``samples`` of the rows of ``batch`` (matched by tokens; under context parallelism the
    batch holds this CP rank's zigzag chunks of each sample)."""
    return [next(i for i, s in enumerate(samples) if torch.equal(zigzag_split(s["tokens"], cp, cp_rank, 0), t))
            for t in batch["tokens"]]


class BatchRecorder(pl.Callback):
    """Per training batch: (global_step, current_epoch, sample ids of this rank's batch)."""

    def __init__(self, samples) -> None:
        self.samples, self.seen = samples, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        mesh = trainer.strategy.mesh
        ids = sample_ids(self.samples, batch, mesh.size("cp"), mesh.rank("cp"))
        self.seen.append((trainer.global_step, trainer.current_epoch, ids))


# ---------------------------------------------------------------------------------------------- 1. resharding
RESUME_STEPS = 4
SAVE_AT = 2
N_TRAIN = 16  # 4 global batches per epoch: the saved run and the resumed steps stay inside one sampler epoch


def resume_order():
    """Global batches Lightning feeds: steps 1-2 = epoch-0 batches 0-1, steps 3-4 = epoch-1 batches 0-1."""
    n = SAVE_AT * GLOBAL_BATCH
    return lightning_train_order(N_TRAIN, 0)[:n] + lightning_train_order(N_TRAIN, 1)[:n]


def train_and_save(rank, world, cfg, samples, strategy_kwargs, micro_batch, path):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, RESUME_STEPS)  # the LR schedule of the whole 4-step run
    recorder = LossRecorder()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), SAVE_AT, callbacks=[recorder])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch))
    trainer.save_checkpoint(path)
    return {"losses": recorder.losses, "epoch": trainer.current_epoch}


def resume(rank, world, cfg, samples, strategy_kwargs, micro_batch, path):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, RESUME_STEPS)
    recorder, batches = LossRecorder(), BatchRecorder(samples)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), RESUME_STEPS, callbacks=[recorder, batches])
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch), ckpt_path=path)
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "batches": batches.seen, "global_step": trainer.global_step,
            "lr": trainer.optimizers[0].param_groups[0]["lr"], "state": state if rank == 0 else None}


@pytest.fixture(scope="module")
def resharding_case(tmp_path_factory):
    cfg = tiny_config(num_query_groups=4)  # tp=4 shards it too (and pads the vocabulary differently)
    samples = make_samples(cfg, N_TRAIN)
    path = str(tmp_path_factory.mktemp("ckpt") / "tp2.ckpt")
    saved = run_distributed(train_and_save, 2, cfg, samples, dict(tp=2), GLOBAL_BATCH, path)
    ref = reference_loop(cfg, samples, RESUME_STEPS, GLOBAL_BATCH, order=resume_order())
    ref_at_save = reference_loop(cfg, samples, RESUME_STEPS, GLOBAL_BATCH, order=resume_order(), stop_after=SAVE_AT)
    return dict(cfg=cfg, samples=samples, path=path, saved=saved, ref=ref, ref_at_save=ref_at_save)


def test_tp2_checkpoint_holds_full_tp1_state(resharding_case):
    case = resharding_case
    cfg, ref = case["cfg"], case["ref_at_save"]
    for r in case["saved"]:
        assert_losses_close(r["losses"], ref["losses"])
        assert r["epoch"] == 1  # Lightning advances the epoch counter when max_steps stops it mid-epoch
    ckpt = torch.load(case["path"], weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == SAVE_AT
    assert_state_close(ckpt["state_dict"], ref["state"])
    # the plain (tp=1) model loads it as it is
    plain = GPTModel(cfg)
    plain.load_state_dict({k[len("model."):]: v for k, v in ckpt["state_dict"].items()}, strict=True)
    # optimizer moments gathered to full tp=1 shapes, keyed by parameter name (layout-independent)
    opt, want = ckpt["optimizer_states"][0], ref["optimizer"]
    # ParallelGPTModule's groups: weights (decayed) then norms and biases, each in parameter order
    named = list(ref["module"].named_parameters())
    want_groups = [[n for n, p in named if p.dim() >= 2], [n for n, p in named if p.dim() < 2]]
    assert [g["params"] for g in opt["param_groups"]] == want_groups
    flat_names = [n for g in want_groups for n in g]
    assert sorted(opt["state"]) == sorted(flat_names[i] for i in want["state"])
    for index, values in want["state"].items():
        name = flat_names[index]
        for key in ("exp_avg", "exp_avg_sq"):
            got = opt["state"][name][key]
            assert got.shape == values[key].shape, (name, key, got.shape, values[key].shape)
            assert_state_close({key: got}, {key: values[key]})
        assert float(opt["state"][name]["step"]) == SAVE_AT
    assert ckpt["lr_schedulers"][0]["last_epoch"] == SAVE_AT


@pytest.mark.parametrize("world,kwargs", [(2, dict(tp=1)), (1, dict(tp=1)), (4, dict(tp=4, sequence_parallel=True)),
                                          (4, dict(tp=2, pp=2, pipeline_schedule="gpipe")), (4, dict(tp=1, cp=2)),
                                          (2, dict(tp=1, use_distributed_optimizer=True))],
                         ids=["tp2-to-dp2", "tp2-to-single", "tp2-to-tp4-sp", "tp2-to-tp2xpp2", "tp2-to-cp2xdp2",
                              "tp2-to-dp2-distributed-optimizer"])
def test_resume_under_another_layout(resharding_case, world, kwargs):
    case = resharding_case
    dp = world // (kwargs["tp"] * kwargs.get("pp", 1) * kwargs.get("cp", 1))
    results = run_distributed(resume, world, case["cfg"], case["samples"], kwargs, GLOBAL_BATCH // dp, case["path"])
    order, ref = resume_order(), case["ref"]
    for r in results:
        assert r["global_step"] == RESUME_STEPS
        # data order on resume: the ranks' batches of steps 3-4 together are epoch 1's first two global batches
        assert [(step, epoch) for step, epoch, _ in r["batches"]] == [(2, 1), (3, 1)], r["batches"]
        assert_losses_close(r["losses"], ref["losses"][SAVE_AT:])
        assert r["lr"] == pytest.approx(ref["optimizer"]["param_groups"][0]["lr"], rel=1e-12)
    # one model replica (same batches) = tp x cp consecutive ranks, times pp (tests here use pp only with dp=1)
    tp = kwargs["tp"] * kwargs.get("pp", 1) * kwargs.get("cp", 1)
    for i, step in enumerate(range(SAVE_AT, RESUME_STEPS)):
        # TP peers see the same batch; one rank per dp rank together see the step's global batch
        assert all(r["batches"][i] == results[k - k % tp]["batches"][i] for k, r in enumerate(results))
        seen = sorted(j for r in results[::tp] for j in r["batches"][i][2])
        assert seen == sorted(order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]), (step, seen)
    assert_state_close(results[0]["state"], ref["state"])


# ---------------------------------------------------------------------------------------------- 2. validation
N_VAL = 6  # batches of 4 and 2 at dp=1, 2 and 1 per rank at dp=2 (no DistributedSampler padding at dp <= 3)


def validate_run(rank, world, cfg, strategy_kwargs, val_samples, micro_batch):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, 1)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1)
    out = trainer.validate(module, DataLoader(ListDataset(val_samples), batch_size=micro_batch))
    return out[0]["val_loss"]


@pytest.mark.parametrize("world,kwargs", [(2, dict(tp=2)), (4, dict(tp=2, sequence_parallel=True)), (2, dict(pp=2)),
                                          (4, dict(tp=2, pp=2, sequence_parallel=True)), (2, dict(cp=2)),
                                          (4, dict(cp=2, cp_comm_type="a2a")),
                                          (2, dict(cp=2, cp_comm_type="a2a", delay_wgrad_compute=False))],
                         ids=["tp2", "tp2xdp2-sp", "pp2", "tp2xpp2-sp", "cp2", "cp2xdp2-a2a", "cp2-a2a-no-delay"])
def test_validate_is_global_token_mean(world, kwargs):
    cfg = tiny_config()
    val = make_samples(cfg, N_VAL, seed=11)
    ref = reference_loop(cfg, make_samples(cfg, GLOBAL_BATCH), 1, GLOBAL_BATCH, stop_after=0)
    want = reference_val_loss(ref["module"], val)
    dp = world // (kwargs.get("tp", 1) * kwargs.get("pp", 1) * kwargs.get("cp", 1))
    got = run_distributed(validate_run, world, cfg, kwargs, val, GLOBAL_BATCH // dp)
    for g in got:
        assert abs(g - want) <= 1e-5 * abs(want), (got, want)


TEST_STEPS, TEST_ACCUMULATE, TEST_MICRO_BATCH = 2, 2, 2


def run_test_stages(rank, world, cfg, strategy_kwargs, samples, test_samples):
    """``trainer.test`` of a fresh module, then ``trainer.fit`` and ``trainer.test`` of another module on one
    Trainer (Lightning's usual order). Returns both test losses; a stage that raised returns its error."""
    pl.seed_everything(SEED, verbose=False)
    loader = DataLoader(ListDataset(test_samples), batch_size=TEST_MICRO_BATCH)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), TEST_STEPS)
    fresh = trainer.test(new_module(cfg, TEST_STEPS), loader)
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, TEST_STEPS)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), TEST_STEPS,
                          accumulate_grad_batches=TEST_ACCUMULATE)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=TEST_MICRO_BATCH))
    try:
        after_fit = trainer.test(module, loader)[0]["test_loss"]
    except Exception as e:  # noqa: BLE001 - the test reports it
        after_fit = f"{type(e).__name__}: {e}"
    return {"fresh": fresh[0]["test_loss"], "after_fit": after_fit}


@pytest.fixture(scope="module", params=[(2, dict(tp=2)), (2, dict(pp=2))], ids=["tp2", "pp2"])
def stages(request):
    world, kwargs = request.param
    cfg = tiny_config()
    samples = make_samples(cfg, TEST_STEPS * TEST_ACCUMULATE * TEST_MICRO_BATCH)
    test = make_samples(cfg, N_VAL, seed=11)
    ref = reference_loop(cfg, samples, TEST_STEPS, TEST_MICRO_BATCH, accumulate=TEST_ACCUMULATE)
    initial = reference_loop(cfg, samples, TEST_STEPS, TEST_MICRO_BATCH, stop_after=0)["module"]
    return {"results": run_distributed(run_test_stages, world, cfg, kwargs, samples, test),
            "want_fresh": reference_val_loss(initial, test), "want_after_fit": reference_val_loss(ref["module"], test)}


def test_test_loss_is_global_token_mean(stages):
    """``trainer.test`` logs ``test_loss``, the token-mean over the whole test set, as one process does."""
    want = stages["want_fresh"]
    for r in stages["results"]:
        assert abs(r["fresh"] - want) <= 1e-5 * abs(want), (r["fresh"], want)


def test_test_after_fit_on_the_same_trainer(stages):
    """``trainer.fit(model); trainer.test(model)``: the test loss of the trained weights, as one process."""
    want = stages["want_after_fit"]
    for r in stages["results"]:
        assert isinstance(r["after_fit"], float), r["after_fit"]
        assert abs(r["after_fit"] - want) <= 1e-5 * abs(want), (r["after_fit"], want)


class ValRecorder(pl.Callback):
    def __init__(self) -> None:
        self.values = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.values.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


def fit_with_val(rank, world, cfg, strategy_kwargs, samples, val_samples, steps, micro_batch):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps)
    recorder, val_recorder = LossRecorder(), ValRecorder()
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, callbacks=[recorder, val_recorder],
                          val_check_interval=1)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch),
                DataLoader(ListDataset(val_samples), batch_size=micro_batch))
    return {"losses": recorder.losses, "val": val_recorder.values}


def test_val_loss_during_fit_tp2():
    cfg, steps = tiny_config(), 2
    samples, val = make_samples(cfg, steps * GLOBAL_BATCH), make_samples(cfg, N_VAL, seed=11)
    want_val = []
    ref = reference_loop(cfg, samples, steps, GLOBAL_BATCH,
                         after_step=lambda step, module: want_val.append((step, reference_val_loss(module, val))))
    results = run_distributed(fit_with_val, 2, cfg, dict(tp=2), samples, val, steps, GLOBAL_BATCH)
    for r in results:
        assert_losses_close(r["losses"], ref["losses"])
        assert [s for s, _ in r["val"]] == [s for s, _ in want_val], (r["val"], want_val)
        assert_losses_close([v for _, v in r["val"]], [v for _, v in want_val])


# ---------------------------------------------------------------------------------------------- 3. spawn launcher
def test_registry_names():
    assert "megatron" in StrategyRegistry and "megatron_spawn" in StrategyRegistry
    strategy = StrategyRegistry.get("megatron_spawn")
    assert isinstance(strategy, MegatronStrategy) and strategy._start_method == "spawn"
    assert isinstance(StrategyRegistry.get("megatron"), MegatronStrategy)


def test_spawn_launcher_returns_full_weights_to_main_process():
    cfg, steps = tiny_config(), 2
    samples = make_samples(cfg, steps * GLOBAL_BATCH)
    ref_losses, ref_state = reference_run(cfg, samples, steps, GLOBAL_BATCH)
    env = dict(os.environ)
    torch_threads = torch.get_num_threads()
    try:
        for attempt in range(2):
            pl.seed_everything(SEED, verbose=False)
            module = new_module(cfg, steps)
            trainer = trainer_for(2, MegatronStrategy(tp=2, start_method="spawn"), steps)
            try:
                trainer.fit(module, DataLoader(ListDataset(samples), batch_size=GLOBAL_BATCH))
                break
            except ProcessExitedException as e:
                # gloo can abort a spawned worker at interpreter exit after its work is done (a few percent
                # of runs, plain Lightning "ddp_spawn" too); anything else, or twice in a row, fails
                if attempt or e.signal_name != "SIGABRT":
                    raise
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(torch_threads)
    state = {k: v for k, v in module.state_dict().items()}
    assert not any(v.is_meta for v in state.values())
    assert_state_close(state, ref_state)
    got = float(trainer.callback_metrics["train_loss"])
    assert abs(got - ref_losses[-1]) <= 1e-5 * abs(ref_losses[-1]), (got, ref_losses)


# ---------------------------------------------------------------------------------------------- 4. errors
class PlainModule(pl.LightningModule):
    """A LightningModule whose model has no ``tensor_parallel_plan``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_plain(rank, world):
    trainer = trainer_for(world, MegatronStrategy(tp=2), 1)
    trainer.fit(PlainModule(), DataLoader(torch.randn(8, 4), batch_size=2))


def fit_gpt(rank, world, cfg, strategy_kwargs):
    samples = make_samples(cfg, GLOBAL_BATCH)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), 1)
    trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(samples), batch_size=GLOBAL_BATCH))


def test_tp_without_plan_raises():
    with pytest.raises(AssertionError) as info:
        run_distributed(fit_plain, 2)
    text = str(info.value)
    assert "ValueError: tp=2 but PlainModule contains no module with a tensor_parallel_plan" in text, text


def test_query_groups_not_divisible_by_tp_raises():
    with pytest.raises(AssertionError) as info:
        run_distributed(fit_gpt, 2, tiny_config(num_query_groups=1), dict(tp=2))
    text = str(info.value)
    assert "ValueError: num_query_groups=1 is not divisible by tp=2" in text, text


# ---------------------------------------------------------------------------------------------- 5. accumulation
def test_gradient_accumulation_tp2xdp2_sp():
    """Each micro-batch's loss is its global token-mean over dp, so an optimizer step follows the mean of the two
    micro-batches' global token-means (not the token-mean over both: the masks count different numbers of tokens),
    and ``train_loss`` is that step mean, logged once per step."""
    cfg, steps, accumulate, clip = tiny_config(), 2, 2, 0.05
    samples = make_samples(cfg, steps * accumulate * GLOBAL_BATCH)
    ref = reference_loop(cfg, samples, steps, GLOBAL_BATCH, clip, accumulate=accumulate)
    results = run_distributed(accumulate_run, 4, cfg, dict(tp=2, sequence_parallel=True), samples, steps,
                              GLOBAL_BATCH // 2, clip, accumulate)
    ref_steps = [sum(ref["losses"][i * accumulate:(i + 1) * accumulate]) / accumulate for i in range(steps)]
    for r in results:
        assert_losses_close(r["losses"], ref_steps)  # one per optimizer step
    assert_state_close(results[0]["state"], ref["state"])


def accumulate_run(rank, world, cfg, strategy_kwargs, samples, steps, micro_batch, clip, accumulate):
    pl.seed_everything(SEED, verbose=False)
    module = new_module(cfg, steps)
    recorder = StepLossRecorder(accumulate)
    trainer = trainer_for(world, MegatronStrategy(**strategy_kwargs), steps, callbacks=[recorder],
                          gradient_clip_val=clip, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(ListDataset(samples), batch_size=micro_batch))
    state = trainer.strategy.lightning_module_state_dict()
    return {"losses": recorder.losses, "state": state if rank == 0 else None}


def test_strategy_keywords_are_the_constructor_parameters():
    """``STRATEGY_KEYWORDS`` (what the keyword routing treats as the strategy's own) is exactly the constructor's
    named parameters (read from its code: its shown signature also lists the layout options): a parameter added to
    one and not the other would be misrouted or refused."""
    from lightning_megatron.strategy.options import STRATEGY_KEYWORDS

    code = MegatronStrategy.__init__.__code__
    assert code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount] == STRATEGY_KEYWORDS
