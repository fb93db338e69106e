"""Long runs: resume by itself, save on preemption (``MegatronStrategy(auto_resume=..., exit_signal_handler=...)``).

- :func:`install_auto_resume`: a ``fit`` given no ``ckpt_path`` loads the newest complete checkpoint of the
  trainer's ``ModelCheckpoint`` directories (:func:`~lightning_megatron.checkpoint.latest.latest_checkpoint`),
  chosen on rank 0 and broadcast over the world group, so that a job restarted by ``torchrun --max-restarts`` or
  requeued by SLURM goes on where it stopped.
- :class:`ExitSignalHandler` + :class:`PreemptionCheckpoint`: a signal of ``exit_signals`` only raises a flag; at
  the end of each training step the ranks agree on the flags (one all-reduce of one integer over the world group),
  and when any rank got one every rank writes :data:`PREEMPTED_CHECKPOINT` into the ``ModelCheckpoint`` directory
  (waiting for a background save to complete) and raises :class:`Preempted`, a ``SystemExit`` with
  :data:`REQUEUE_EXIT_CODE`. A process blocked in a collective does not run Python signal handlers: the
  launcher's signal watcher (:func:`~lightning_megatron.strategy.launcher.watch_signals`) still ends it after its
  grace unless this handler took the signal (``takes_over``).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning.pytorch as pl
from lightning_megatron.parallel.config import check_exit_signals  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

__all__ = ["REQUEUE_EXIT_CODE", "PREEMPTED_CHECKPOINT", "Preempted", "ExitSignalHandler", "PreemptionCheckpoint",
           "install_auto_resume", "checkpoint_directories", "check_exit_signals", "check_requeue_signal"]

#: exit code of a rank that saved on an exit signal: "requeue me" (``EX_TEMPFAIL`` of sysexits.h: a temporary
#: failure, the user is invited to retry). A SLURM batch script requeues on it (``scontrol requeue``); torchrun
#: counts it as a failure and restarts the job in place while it has restarts left.
REQUEUE_EXIT_CODE = 75
#: the checkpoint written on an exit signal (its name starts with ``last``: Lightning's ``ckpt_path="last"``
#: finds it too)
PREEMPTED_CHECKPOINT = "last-preempted.ckpt"


class Preempted(SystemExit):
    """Raised on every rank after the exit-signal checkpoint is written; the process exits with its ``code``
    (:data:`REQUEUE_EXIT_CODE`) unless caught."""

    def __init__(self, path: str, signum: int) -> None:
        super().__init__(REQUEUE_EXIT_CODE)
        self.path, self.signum = path, signum


class ExitSignalHandler:
    """A Python signal handler for ``signals`` (names) that only records the signal (no collective, no kill: it
    runs in the main thread between two bytecodes, possibly inside a collective's Python wrapper).

    ``received``: the first signal number recorded, or None. ``takes_over(signum)``: whether this handler ran for
    it (the main thread is alive and will save and exit at the end of the step).
    """

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals = [signal.Signals[n] for n in signals]
        self.received: Optional[int] = None
        self._previous: List[Tuple[int, Any]] = []

    def __call__(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            log.warning("received %s: saving a checkpoint at the end of this step, then exiting with code %d",
                        signal.Signals(signum).name, REQUEUE_EXIT_CODE)

    def takes_over(self, signum: int) -> bool:
        """Whether this handler recorded ``signum``'s arrival (the process will stop by itself)."""
        return self.received is not None and signum in self.signals

    def install(self) -> bool:
        """Become the handler of every signal (main thread only; returns whether it was installed)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous.append((sig, signal.signal(sig, self)))
        return True

    def uninstall(self) -> None:
        """Put the previous handlers back (those still ours)."""
        while self._previous:
            sig, previous = self._previous.pop()
            if signal.getsignal(sig) is self and previous is not None:
                signal.signal(sig, previous)

    def agreed(self, device: torch.device) -> Optional[int]:
        """The signal number any rank recorded (the largest), or None: one all-reduce (MAX) over the world group
        (collective on every rank; without a process group, this rank's own)."""
        mine = self.received or 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([mine], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = int(flag.item())
        return mine or None


def check_requeue_signal(trainer: "pl.Trainer", signals: Sequence[str]) -> None:
    """Under Lightning's ``SLURMEnvironment(auto_requeue=True)`` its ``requeue_signal`` belongs to Lightning (which
    saves an ``hpc`` checkpoint and requeues the job): ValueError when ``signals`` also claims it."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = trainer._accelerator_connector.cluster_environment
    if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
        name = signal.Signals(env.requeue_signal).name
        if name in signals:
            raise ValueError(f"exit_signals={tuple(signals)!r} claims {name}, the requeue_signal of "
                             "SLURMEnvironment(auto_requeue=True), which saves and requeues by itself: drop "
                             f"{name} from exit_signals, or give SLURMEnvironment another requeue_signal")


def checkpoint_directories(trainer: "pl.Trainer") -> List[str]:
    """The directories of the trainer's ``ModelCheckpoint`` callbacks (resolved once their ``setup`` ran)."""
    return [str(cb.dirpath) for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is not None]


class PreemptionCheckpoint(Callback):
    """The strategy's ``exit_signal_handler``: after every training step (after ``ModelCheckpoint``), the ranks
    agree whether any got an exit signal; if so every rank writes :data:`PREEMPTED_CHECKPOINT` into the first
    ``ModelCheckpoint`` directory, waits for it to be complete and raises :class:`Preempted`.

    Added to the trainer's callbacks by ``MegatronStrategy`` (not meant to be added by hand)."""

    def __init__(self, handler: ExitSignalHandler) -> None:
        self.handler = handler

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        signum = self.handler.agreed(trainer.strategy.root_device)
        if signum is None:
            return
        directories = checkpoint_directories(trainer)
        if not directories:
            raise RuntimeError("exit_signal_handler=True needs a ModelCheckpoint with a directory to save into")
        path = os.path.join(directories[0], PREEMPTED_CHECKPOINT)
        trainer.save_checkpoint(path)
        finish: Optional[Callable[[], None]] = getattr(trainer.strategy, "finish_checkpoints", None)
        if finish is not None:
            finish()
        trainer.strategy.barrier("PreemptionCheckpoint")
        name = signal.Signals(signum).name
        log.warning("%s: saved %s at step %d; exiting with code %d (requeue)", name, path, trainer.global_step,
                    REQUEUE_EXIT_CODE)
        raise Preempted(path, signum)


def install_auto_resume(trainer: "pl.Trainer", strategy: Any) -> None:
    """Make the trainer's checkpoint loading take the newest complete checkpoint of its ``ModelCheckpoint``
    directories when ``fit`` was given no ``ckpt_path`` (Lightning's own choices, e.g. SLURM's ``hpc``
    checkpoints, come first). The path is chosen on rank 0 and broadcast (``strategy.broadcast``, world group);
    nothing found: a fresh start. Installed once per trainer."""
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_megatron.checkpoint.latest import latest_checkpoint

    connector = trainer._checkpoint_connector
    if getattr(connector, "_megatron_auto_resume", False):
        return
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: Optional[bool] = None) -> None:
        if checkpoint_path is None and trainer.state.fn == TrainerFn.FITTING and strategy.parallel_config.auto_resume:
            found = latest_checkpoint(checkpoint_directories(trainer)) if strategy.is_global_zero else None
            checkpoint_path = strategy.broadcast(found)
            if checkpoint_path is not None:
                log.info("auto_resume: resuming from %s", checkpoint_path)
        return original(checkpoint_path, weights_only=weights_only)

    connector.resume_start = resume_start
    connector._megatron_auto_resume = True
