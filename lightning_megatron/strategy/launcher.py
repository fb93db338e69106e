"""Process launch for :class:`~lightning_megatron.MegatronStrategy`: the spawn launcher that hands the main
process full (gathered) weights, the one environment variable the library reads (Lightning's global seed), and
the guards that end a job as a whole (no rank left waiting, no orphan process):

- :func:`die_with_parent`: a launched rank gets SIGKILL when the process that started it exits;
- :func:`watch_children`: the launching rank ends every rank (and itself) when a rank it started exits non-zero;
- :func:`watch_signals`: SIGTERM / SIGINT end the process after a short grace, even when its main thread is
  blocked in a collective, where Python-level handlers (Lightning's) cannot run;
- :func:`end_process_groups`: at the process's exit the process groups are destroyed after gloo's worker threads
  have let go of their last collective's tensors.

Killing one rank is enough: its peers' next (or current) collective fails at once on the closed connection, and
the processes it started get SIGKILL from :func:`die_with_parent`.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

import lightning.pytorch as pl

from lightning_megatron.strategy.resilience import REQUEUE_EXIT_CODE

DEFAULT_SEED = 1234  # Megatron's --seed default, used when seed_everything was not called


def global_seed() -> int:
    """The seed ``lightning.seed_everything`` exported to this process (``PL_GLOBAL_SEED``; it reaches every
    launched rank), else :data:`DEFAULT_SEED`."""
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value is not None else DEFAULT_SEED


#: seconds a process gets after SIGTERM / SIGINT to stop on its own (Lightning's handling) before it is ended
SIGNAL_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1
_installed: List[str] = []   # which process-wide guards this process has (each once per process)


def die_with_parent(parent_pid: Optional[int] = None) -> bool:
    """Ask Linux to SIGKILL this process when the thread that started it exits (``prctl(PR_SET_PDEATHSIG)``); if
    the parent is already gone (``parent_pid`` given and no longer the parent), exit now. Returns whether it took
    effect (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
    return True


def _end(code: int, reason: str) -> None:
    sys.stderr.write(f"lightning-megatron: {reason}; ending process {os.getpid()} (exit code {code})\n")
    sys.stderr.flush()
    os._exit(code)


def watch_children(procs: Callable[[], List[subprocess.Popen]], poll_s: float = 0.5) -> None:
    """Start a daemon thread that, once any process of ``procs()`` exits with a non-zero code, kills the others
    (SIGKILL) and ends this process: a rank that died or timed out takes the job with it, even while this
    process's main thread is blocked or busy."""
    if "children" in _installed:
        return
    _installed.append("children")

    def run() -> None:
        while True:
            time.sleep(poll_s)
            children = list(procs())
            # a rank that saved on an exit signal and exits "requeue me" is not a failure: every rank does
            failed = [p for p in children if p.poll() not in (None, 0, REQUEUE_EXIT_CODE)]
            if failed:
                for p in children:
                    if p.poll() is None:
                        p.kill()
                _end(1, f"rank process {failed[0].pid} exited with code {failed[0].returncode}")

    threading.Thread(target=run, name="lightning-megatron-children", daemon=True).start()


def watch_signals(grace_s: float = SIGNAL_GRACE_S) -> bool:
    """End this process ``grace_s`` seconds after a SIGTERM or SIGINT that has a Python handler (Lightning's, or
    Python's KeyboardInterrupt), unless it has ended by then or the signal's handler has run and says it takes over
    (``handler.takes_over(signum)``: ``exit_signal_handler``'s, which saves at the end of the step and exits). Python runs signal handlers only between bytecodes of
    the main thread, so a rank blocked in a collective would otherwise never notice; the signal's arrival is seen
    through ``signal.set_wakeup_fd`` by a daemon thread. Call from the main thread; returns whether it is watching
    (False when another wakeup fd is set, e.g. by an asyncio loop, which is left alone)."""
    if "signals" in _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:
        return False
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return False
    _installed.append("signals")
    watched = {int(signal.SIGTERM), int(signal.SIGINT)}

    def run() -> None:
        while True:
            data = os.read(read_fd, 64)
            hit = [b for b in data if b in watched]
            if hit:
                time.sleep(grace_s)
                handler = signal.getsignal(hit[0])
                takes_over = getattr(handler, "takes_over", None)
                if callable(takes_over) and takes_over(hit[0]):
                    continue   # a handler of the main thread took it (exit_signal_handler: it saves, then exits)
                name = signal.Signals(hit[0]).name
                _end(128 + hit[0], f"{name} received {grace_s:.0f}s ago and the process did not stop")

    threading.Thread(target=run, name="lightning-megatron-signals", daemon=True).start()
    return True


#: how long the main thread yields at exit, with the GIL released, before the process groups are destroyed
GLOO_SETTLE_S = 0.05


def end_process_groups() -> None:
    """At the process's exit (``atexit``, registered by ``MegatronStrategy.setup_distributed``; a spawned worker's
    end, :class:`MegatronMultiProcessingLauncher`): destroy every process group while the interpreter is whole. Under gloo the main thread first sleeps :data:`GLOO_SETTLE_S` with the GIL
    released: a gloo worker thread releases a collective's tensors only after the caller's wait has returned, and a
    release that needs the GIL (a tensor with a Python object) once the interpreter is being torn down aborts the
    process ("terminate called without an active exception", torch 2.13) -- seen on a rank whose last collective
    came right before its exit, and on one whose last was a barrier (a gloo barrier holds the collectives before
    it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == dist.Backend.GLOO:
        time.sleep(GLOO_SETTLE_S)
    dist.destroy_process_group()


def restart_safe_store(main_address: str, main_port: int, timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun (torchelastic) with its shared rendezvous store, the store for ``init_process_group``: the
    agent's TCPStore at ``main_address:main_port`` under a prefix of this restart attempt; elsewhere None (torch's
    own ``env://`` rendezvous is right).

    torchrun's agent hosts one TCPStore for every restart of the job (``TORCHELASTIC_USE_AGENT_STORE=True``, the
    default since torch 2.4) and hands each attempt the same address, while the workers' ``env://`` rendezvous
    uses it without a per-attempt prefix. A restarted rank then finds the keys of the previous attempt: a peer's
    gloo address that nobody listens on any more ("connectFullMesh failed ... Connection refused" while that peer
    is still starting) or a store barrier that counts the dead ranks' arrivals (a hang at initialisation). The
    prefix holds torchrun's own ``TORCHELASTIC_RESTART_COUNT`` (and ``TORCHELASTIC_RUN_ID``), read like
    ``MASTER_ADDR``: the launcher's contract, not a switch."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    store = dist.TCPStore(main_address, int(main_port), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/lightning_megatron/{run}/attempt_{attempt}/", store)


def guard_processes(launcher: Any, cluster_environment: Any, world_size: int) -> None:
    """Install the job-wide guards for one rank: under Lightning's script launcher (``launcher`` with its
    ``procs``), the launching rank watches the ranks it started (:func:`watch_children`); a rank started by that
    launcher dies with its parent (:func:`die_with_parent`); with ``world_size`` > 1, SIGTERM and SIGINT end the
    process after a short grace (:func:`watch_signals`; a one-process run, a notebook, keeps its own Ctrl-C)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    if isinstance(launcher, _SubprocessScriptLauncher) and getattr(launcher, "procs", None):
        watch_children(lambda: launcher.procs)
    env = cluster_environment
    if type(env) is LightningEnvironment and env.creates_processes_externally and env.local_rank() > 0:
        die_with_parent()
    if world_size > 1:
        watch_signals()


class MegatronScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``: the user's script run again per rank) without
    Lightning's child-process observer, which SIGKILLs every rank, the launching one too, as soon as one rank exits
    with any non-zero code: a rank that saved on an exit signal and exits with
    :data:`~lightning_megatron.strategy.resilience.REQUEUE_EXIT_CODE` ("requeue me", as every rank does) would turn
    the job's exit into -9. The launching rank watches its ranks with :func:`watch_children` instead
    (:func:`guard_processes`), which lets the requeue code go."""

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        """Start the other ranks (unless the cluster starts them), then run ``function`` in this process."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def kill_launched(launcher: Any, wait: bool = False, wait_s: float = 60.0) -> None:
    """Kill the ranks Lightning's script ``launcher`` started that are still running (a failed rank takes them
    with it); ``wait``: first give them ``wait_s`` seconds to exit by themselves (they stop alike, e.g. after an
    exit-signal checkpoint). Any other launcher: nothing."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    if isinstance(launcher, _SubprocessScriptLauncher):
        for proc in getattr(launcher, "procs", []):
            if wait:
                try:
                    proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()


class MegatronMultiProcessingLauncher(_MultiProcessingLauncher):
    """Spawn launcher that hands the main process full (gathered) weights instead of rank 0's TP shards, and with
    ``max_restarts`` starts every rank again (on a new port) when one fails, up to that many times: with
    ``auto_resume`` each attempt resumes from the newest complete checkpoint (:attr:`restarts` counts them)."""

    def __init__(self, strategy: Any, start_method: str = "spawn", max_restarts: int = 0) -> None:
        super().__init__(strategy, start_method=start_method)
        self.max_restarts = max_restarts
        self.restarts = 0

    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        from lightning.fabric.plugins.environments.lightning import find_free_network_port
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn
        from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

        while True:
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except (ProcessRaisedException, ProcessExitedException) as err:
                if self.restarts >= self.max_restarts:
                    raise
                self.restarts += 1
                first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                rank_zero_warn(f"a rank failed ({first}); starting every rank again, restart {self.restarts} of "
                               f"max_restarts={self.max_restarts}, from the newest complete checkpoint")
                port = find_free_network_port()   # the failed attempt's port may still be held
                env = self._strategy.cluster_environment
                if hasattr(env, "_main_port"):
                    env._main_port = port
                os.environ["MASTER_PORT"] = str(port)

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # the process groups torn down before the worker exits, as at any exit; no barrier first: a gloo barrier
        # holds the collectives before it until its worker thread lets go of it, which can be during teardown
        end_process_groups()

    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        strategy = self._strategy
        state_dict = strategy.full_state_dict() if trainer.state.fn == TrainerFn.FITTING else None
        if strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: "pl.Trainer") -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None:
            if not any(True for _ in module.parameters()):
                with torch.device("meta"):
                    module.configure_model()
            ckpt = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(ckpt, strict=False, assign=True)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)
