"""Long runs survive: automatic resume, in-place restarts under torchrun, save on preemption, slow ranks named.

Every job is ``tests/_resume_job.py`` (2 ranks, CPU/gloo, a tiny model, 8 steps of Megatron's data sampler, a
checkpoint every 2 steps, ``auto_resume=True``); its final weights are compared bit for bit with an uninterrupted
run of the same layout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron import MegatronStrategy
from lightning_megatron.checkpoint.latest import latest_checkpoint
from lightning_megatron.parallel.config import ParallelConfig
from lightning_megatron.strategy.resilience import PREEMPTED_CHECKPOINT, REQUEUE_EXIT_CODE
from tests._dist import free_port, run_distributed, run_each
from tests._resume_job import train
from tests.parity import SEED, ListDataset, make_samples, new_module, tiny_config, trainer_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "_resume_job.py")


def _log(out, rank=0):
    with open(os.path.join(out, f"log{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(out, rank=0):
    """step -> loss (the last one logged: a step trained again after a restart must give the same loss)."""
    seen = {}
    for r in _log(out, rank):
        if "step" in r:
            assert seen.get(r["step"], r["loss"]) == r["loss"], (r, seen)
            seen[r["step"]] = r["loss"]
    return seen


def _starts(out, rank=0):
    return [r["start"] for r in _log(out, rank) if "start" in r]


def _final(out):
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


def _assert_bit_equal(out, ref):
    a, b = _final(out), _final(ref)
    assert a.keys() == b.keys()
    diff = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not diff, f"final weights differ from the uninterrupted run: {diff}"
    assert _losses(out) == _losses(ref)


# ---------------------------------------------------------------------------------------------- options
def test_long_run_options_are_validated(tmp_path):
    """The options are typed: bools refuse strings; exit signals must be catchable signal names. Without a
    ModelCheckpoint exit_signal_handler has nowhere to save, and under SLURMEnvironment(auto_requeue=True) its
    requeue signal stays Lightning's."""
    for name in ("auto_resume", "exit_signal_handler"):
        with pytest.raises(ValueError, match=name):
            ParallelConfig(**{name: "yes"})
    for bad in ((), ("SIGKILL",), ("SIGNOPE",), (15,)):
        with pytest.raises(ValueError, match="exit_signals"):
            ParallelConfig(exit_signals=bad)
    assert ParallelConfig(exit_signals="SIGUSR1").exit_signals == ("SIGUSR1",)
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from lightning_megatron.strategy.resilience import check_requeue_signal

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, plugins=[SLURMEnvironment(auto_requeue=True)])
    with pytest.raises(ValueError, match="SIGUSR1, the requeue_signal"):
        check_requeue_signal(trainer, ("SIGTERM", "SIGUSR1"))
    check_requeue_signal(trainer, ("SIGTERM",))   # SIGTERM ours, SIGUSR1 Lightning's: no conflict
    strategy = MegatronStrategy(exit_signal_handler=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                         max_steps=1, enable_progress_bar=False, enable_model_summary=False)
    cfg = tiny_config()
    with pytest.raises(ValueError, match="add ModelCheckpoint"):
        trainer.fit(new_module(cfg, 1), DataLoader(ListDataset(make_samples(cfg, 4)), batch_size=4))


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    """Files that are not complete zip archives, directories without complete DCP metadata and temporary
    entries are passed over; among the complete ones the newest wins, in any of the directories."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    torch.save({"x": torch.ones(3)}, a / "step=2.ckpt")
    time.sleep(0.01)
    torch.save({"x": torch.ones(3)}, b / "step=4.ckpt")
    assert latest_checkpoint([str(a), str(b), str(tmp_path / "missing")]) == str(b / "step=4.ckpt")
    time.sleep(0.01)
    data = open(a / "step=2.ckpt", "rb").read()
    with open(a / "step=6.ckpt", "wb") as f:          # truncated: its zip directory is missing
        f.write(data[: len(data) // 2])
    (a / "step=8.ckpt").mkdir()                        # a directory without .metadata
    (a / ".step=10.ckpt.dcp-tmp-1").mkdir()            # a killed save's temporary directory
    assert latest_checkpoint([str(a), str(b)]) == str(b / "step=4.ckpt")
    assert latest_checkpoint([str(tmp_path / "missing")]) is None


def test_restart_attempts_start_on_stores_of_their_own(monkeypatch):
    """Under torchrun's shared agent store each restart attempt's process group keys live under a prefix of their
    own: what attempt 0 wrote (a dead rank's gloo address) is invisible to attempt 1. Outside torchrun: torch's
    own rendezvous (None)."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_megatron.strategy.launcher import restart_safe_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert restart_safe_store("127.0.0.1", 1, timedelta(seconds=5)) is None
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    stores = []
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        stores.append(restart_safe_store("127.0.0.1", agent.port, timedelta(seconds=5)))
    stores[0].set("rank_1", "127.0.0.1:50574")
    assert stores[0].check(["rank_1"]) and not stores[1].check(["rank_1"])
    assert not agent.check(["rank_1"])


# ---------------------------------------------------------------------------------------------- resume
def _failing_then_resumed(rank, world, out, ref, layout, fmt, faults):
    """The uninterrupted run, then the same run with ``faults`` (errors on both ranks at once), restarted in the
    same processes until it completes, each restart resuming by itself."""
    train(rank, world, ref, layout, fmt, "-")
    attempts = 0
    while True:
        attempts += 1
        try:
            train(rank, world, out, layout, fmt, faults)
            return attempts
        except RuntimeError as err:
            if "injected fault" not in str(err) or attempts > 3:
                raise


def test_auto_resume_after_two_failures_is_bit_exact_under_every_layout(tmp_path):
    """tp2 + SP (full checkpoints), pp2 and dp2 with the distributed optimizer (sharded checkpoints; background
    saves: the torchrun test below): the run fails at step 3 and again at step 7 (every rank raises); each restart
    passes no ckpt_path and resumes from the newest complete checkpoint (steps 2 and 6), the data position
    included. The final weights and every step's loss equal the uninterrupted run's bit for bit."""
    cases = [(f"{layout}-{fmt}", (str(tmp_path / layout), str(tmp_path / f"{layout}-ref"), layout, fmt,
                                  "raise@3:0,raise@3:1,raise@7:0,raise@7:1"))
             for layout, fmt in (("tp2", "torch"), ("pp2", "torch_dist"), ("dp2_distopt", "torch_dist"))]
    out = run_distributed(run_each, 2, _failing_then_resumed, cases)
    for name, (path, ref, *_rest) in cases:
        assert all(o[name] == 3 for o in out), (name, [o[name] for o in out])
        assert _starts(path) == [0, 2, 6], (name, _starts(path))
        _assert_bit_equal(path, ref)


def _torchrun(out, layout, fmt, faults, restarts, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           JOB, str(out), layout, fmt, faults, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_torchrun_restarts_in_place_twice_and_ends_bit_exact(tmp_path):
    """Under ``torchrun --max-restarts=2``: rank 1 SIGKILLed while the background save of step 4 is writing, then
    rank 0 raising at step 6. torchrun restarts the job in place twice in a row; each restart comes back (no
    connectFullMesh "Connection refused", no hang: every attempt starts its process group on a store of its own)
    and resumes from the newest complete checkpoint by itself; the job ends with the weights of an uninterrupted
    run. (Each attempt costs ~8 s of process start on 2 cores, hence two.)"""
    out, ref = tmp_path / "job", tmp_path / "ref"
    out.mkdir(), ref.mkdir()
    run_distributed(train, 2, str(ref), "dp2_distopt", "torch_dist_async", "-")
    done = _torchrun(out, "dp2_distopt", "torch_dist_async", "kill_in_save@4:1,raise@6:0", 2)
    assert done.returncode == 0, done.stdout[-4000:]
    starts = _starts(out)
    # step 4's save never completed; step 6's runs in the background while step 7 starts: a failure right then may
    # find it incomplete, and the restart resumes from step 4
    assert len(starts) == 3 and starts[:2] == [0, 2] and starts[2] in (4, 6), starts
    _assert_bit_equal(out, ref)


def test_the_strategys_own_launcher_restarts_a_killed_rank_and_ends_bit_exact(tmp_path):
    """``MegatronStrategy(start_method="spawn", max_restarts=1, auto_resume=True)`` from the user's process: rank 1
    SIGKILLed at step 3; the launcher starts both ranks again on a new port, the restart resumes from step 2's
    checkpoint by itself, and the weights handed back to the main process equal the uninterrupted run's bit for bit.
    ``max_restarts`` under popen, or without ``auto_resume``, is refused naming the way that works."""
    from tests._resume_job import spawn_train

    ref = tmp_path / "ref"
    run_distributed(train, 2, str(ref), "dp2_distopt", "torch", "-")
    env = dict(os.environ)
    try:
        trainer, restarts = spawn_train(str(tmp_path / "job"), "kill@3:1", max_restarts=1)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert restarts == 1 and _starts(str(tmp_path / "job"), 1) == [0, 2], _starts(str(tmp_path / "job"), 1)
    final, want = trainer.lightning_module.state_dict(), _final(str(ref))
    diff = {k: float((final[k].float() - want[k].float()).abs().max()) for k in want if not torch.equal(final[k], want[k])}
    assert not diff, diff
    assert _losses(str(tmp_path / "job"), 1) == _losses(str(ref), 1)
    with pytest.raises(ValueError, match="start_method='popen'.*torchrun --max-restarts"):
        MegatronStrategy(max_restarts=1, auto_resume=True)
    with pytest.raises(ValueError, match="without auto_resume=True"):
        MegatronStrategy(max_restarts=1, start_method="spawn")


# ---------------------------------------------------------------------------------------------- preemption
def _popen_job(out, faults):
    """The job as a user's script: rank 0 started by hand, rank 1 by Lightning's launcher."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, JOB, str(out), "tp2", "torch", faults, "--devices", "2",
                           "--exit-signal-handler"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_exit_signal_saves_every_rank_and_exits_requeue_then_resumes_bit_exact(tmp_path):
    """exit_signal_handler=True, tp2 + SP, a user's script (Lightning's popen launch): SIGTERM to rank 1 at the
    start of step 5, between two interval checkpoints (steps 4 and 6). Every rank finishes that step and writes
    last-preempted.ckpt at step 5; a second SIGTERM, to rank 0 while that checkpoint is being written, does not
    cut it short. The job exits with code 75 and leaves no process. The next start (no ckpt_path) resumes at step
    5 and ends with the weights of an uninterrupted run."""
    out, ref = tmp_path / "job", tmp_path / "ref"
    out.mkdir(), ref.mkdir()
    run_distributed(train, 2, str(ref), "tp2", "torch", "-")
    faults = "term@4:1,term_in_save@5:0"
    first = _popen_job(out, faults)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stdout[-4000:]
    assert first.stdout.count("received SIGTERM") == 2, first.stdout[-4000:]
    assert first.stdout.count("exiting with code 75 (requeue)") == 2, first.stdout[-4000:]   # both ranks saved
    assert torch.load(out / "ckpt" / PREEMPTED_CHECKPOINT, weights_only=True, map_location="cpu")["global_step"] == 5
    pids = [r["pid"] for rank in (0, 1) for r in _log(out, rank) if "pid" in r]
    assert all(not os.path.exists(f"/proc/{p}") for p in pids), pids
    second = _popen_job(out, faults)
    assert second.returncode == 0, second.stdout[-4000:]
    assert _starts(out) == [0, 5] and _starts(out, 1) == [0, 5]
    _assert_bit_equal(out, ref)


# ---------------------------------------------------------------------------------------------- stragglers
class _SlowRank(pl.Callback):
    def __init__(self, rank, seconds):
        self.rank, self.seconds = rank, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def _straggler_run(rank, world, slow_rank):
    from lightning_megatron import StragglerMonitor

    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    monitor = StragglerMonitor(every_n_steps=2, min_excess_s=0.05)   # tiny steps on 2 loaded cores: ms of noise
    callbacks = [monitor] + ([_SlowRank(slow_rank, 0.2)] if slow_rank is not None else [])
    trainer = trainer_for(world, MegatronStrategy(tp=2), 6, callbacks=callbacks)
    trainer.fit(new_module(cfg, 6), DataLoader(ListDataset(make_samples(cfg, 24)), batch_size=4))
    return monitor.reports


def test_straggler_monitor_names_the_slow_rank_and_no_other(tmp_path):
    """tp2, a report every 2 steps: rank 1 sleeping 200 ms per step (its peer waits for it in a collective) is named (with its coordinates: tp rank 1)
    in the first two reports and rank 0 never; without a slow rank nobody is named."""
    out = run_distributed(run_each, 2, _straggler_run, [("slow", (1,)), ("none", (None,))])
    for rank_out in out:
        slow, none = rank_out["slow"], rank_out["none"]
        assert isinstance(slow, list) and isinstance(none, list), (slow, none)
        assert len(slow) == 3 and len(none) == 3
        assert [r["slow"] for r in slow[:2]] in ([[1], [1]], [[], [1]]), slow
        assert all(0 not in r["slow"] for r in slow)
        assert slow[1]["relative_speed"][1] < 0.5 and slow[1]["coords"][1] == {"pp": 0, "tp": 1, "cp": 0, "dp": 0}
        assert all(r["slow"] == [] for r in none), none


# ---------------------------------------------------------------------------------------------- rerun
class _PoisonFirstBackwards(pl.Callback):
    """A NaN gradient (``decoder.layers["1"].mlp.linear_fc2.weight``) on rank 1 in the first ``times`` backward
    passes of step ``at`` (1: a transient fault; 2: one that repeats when the step is replayed)."""

    def __init__(self, at, times):
        self.at, self.times, self.fired = at, times, 0

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 1:
            p = pl_module.model.decoder.layers["1"].mlp.linear_fc2.weight
            p.register_hook(self._poison)
        self.trainer = trainer

    def _poison(self, g):
        if self.trainer.global_step == self.at and self.fired < self.times:
            self.fired += 1
            return torch.full_like(g, float("nan"))
        return g


def _rerun_case(rank, world, times):
    from tests.parity import WeightsAfterStep

    pl.seed_everything(SEED, verbose=False)
    cfg = tiny_config()
    weights = WeightsAfterStep()
    strategy = MegatronStrategy(tp=2, check_for_nan_in_loss_and_grad="rerun")
    callbacks = [weights] + ([_PoisonFirstBackwards(1, times)] if times else [])
    trainer = trainer_for(world, strategy, 4, callbacks=callbacks)
    trainer.fit(new_module(cfg, 4), DataLoader(ListDataset(make_samples(cfg, 16)), batch_size=4))
    return {"weights": weights.after_step, "reruns": strategy.rerun_steps}


def test_rerun_replays_a_non_finite_step_and_stops_only_when_it_repeats():
    """check_for_nan_in_loss_and_grad="rerun", tp2, a NaN gradient on rank 1 at step 1: a fault that does not
    repeat in the replay is counted and training goes on, every step's weights bit-equal to a clean run's; a fault
    that repeats raises NonFiniteError naming the step, the rank and the parameter, on every rank."""
    out = run_distributed(run_each, 2, _rerun_case, [("clean", (0,)), ("transient", (1,)), ("persistent", (2,))])
    for rank, res in enumerate(out):
        clean, transient, persistent = res["clean"], res["transient"], res["persistent"]
        assert isinstance(clean, dict) and isinstance(transient, dict), (clean, transient)
        assert clean["reruns"] == 0 and transient["reruns"] == 1
        assert len(transient["weights"]) == 4
        assert all(torch.equal(a, b) for a, b in zip(transient["weights"], clean["weights"])), rank
        assert isinstance(persistent, str) and "NonFiniteError" in persistent and "at step 1" in persistent \
            and "rank 1: gradient of model.decoder.layers.1.mlp.linear_fc2.weight (nan)" in persistent, persistent
        assert "NonFiniteStepSkipped" not in persistent.splitlines()[-1], persistent


def test_the_script_launcher_lets_a_requeue_exit_go_and_ends_the_job_on_a_failure(monkeypatch):
    """Under ``start_method="popen"`` the launching rank watches the ranks it started with ``watch_children``, not
    with Lightning's observer, which SIGKILLs the job (the launching rank too: exit -9) as soon as any rank exits
    non-zero, the requeue code 75 of an exit-signal checkpoint included. Real child processes: one exiting 75 is let
    go; one exiting 3 makes the watcher kill the others and end this (here: stand-in) process with code 1."""
    from lightning_megatron.strategy import launcher as launch

    strategy = MegatronStrategy()
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)   # configures the launcher
    assert type(strategy.launcher) is launch.MegatronScriptLauncher
    ended = []

    def end(code, reason):   # in place of ending this process: record, and stop the watching thread
        ended.append(code)
        raise SystemExit

    monkeypatch.setattr(launch, "_installed", [])
    monkeypatch.setattr(launch, "_end", end)
    requeue = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(75)"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs = [requeue, sleeper]
    launch.watch_children(lambda: procs, poll_s=0.05)
    requeue.wait()
    time.sleep(0.5)
    assert ended == [] and sleeper.poll() is None   # 75 is not a failure
    procs.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]))
    deadline = time.time() + 20
    while not ended and time.time() < deadline:
        time.sleep(0.05)
    assert ended == [1] and sleeper.wait(timeout=20) == -9
