"""Benchmark arms that compile together and are timed one at a time, on one GPU (imported as a sibling module: run
the benchmarks as scripts).

Compiling the 1.3B benchmark model on a fresh machine takes 120-200 s per arm, so arms run one after another rarely
fit three into one 10-minute call, and a ratio is only firm when both arms ran in the same call. Run together, every
arm starts at once: they compile and run their warm-up steps side by side (the GPU shared, which only warm-up sees),
then each waits until every arm is warmed up, and they take turns for the timed and profiled steps, in the order
given. While one arm is timed the others sit in a file poll with nothing queued on the GPU.

The protocol is files in one folder: ``ready-<i>`` when arm ``i`` is warmed up (or gone), ``done-<i>`` when its
measured steps are over (or it is gone). :func:`run_together` starts the arms and stands in for one that exits, so
the others never wait on a crashed arm; an arm uses :class:`Turns`. Given ``ready_by_s``, it kills the arms not
warmed up by then, so one slow compile does not cost the others their turns.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence


@dataclass
class Turns:
    """Arm ``index`` of ``total`` arms coordinating through ``folder`` (see the module docstring)."""

    folder: Path
    index: int
    total: int
    poll_s: float = 0.1

    @classmethod
    def parse(cls, spec: Optional[str]) -> Optional["Turns"]:
        """``"<folder>:<index>:<total>"`` (the ``--turns`` argument :func:`run_together` gives an arm) or None."""
        if not spec:
            return None
        folder, index, total = spec.rsplit(":", 2)
        return cls(Path(folder), int(index), int(total))

    def _count(self, kind: str, below: Optional[int] = None) -> int:
        last = self.total if below is None else below
        return sum((self.folder / f"{kind}-{i}").exists() for i in range(last))

    def wait_for_my_turn(self) -> float:
        """Mark this arm warmed up, then block until every arm is warmed up (or gone) and every arm before this one
        is done. Returns the seconds waited. Call it with nothing queued on the GPU (after a synchronize)."""
        mark(self.folder, "ready", self.index)
        start = time.perf_counter()
        while self._count("ready") < self.total or self._count("done", below=self.index) < self.index:
            time.sleep(self.poll_s)
        return time.perf_counter() - start

    def done(self) -> None:
        """Mark this arm's measured steps over: the next arm's turn."""
        mark(self.folder, "done", self.index)


def mark(folder: Path, kind: str, index: int) -> None:
    """Write the marker ``<kind>-<index>`` in ``folder``."""
    (folder / f"{kind}-{index}").touch()


@dataclass
class ArmRun:
    """What one arm's process left: its exit code (None: killed at the time limit) and its output."""

    rc: Optional[int]
    stdout: str
    stderr: str
    killed_after_s: Optional[float] = None   #: when it was killed (seconds after the start), if it was


def run_together(commands: Sequence[List[str]], folder: Path, timeout_s: float, env: Optional[Dict[str, str]] = None,
                 cwd: Optional[Path] = None, ready_by_s: Optional[float] = None) -> List[ArmRun]:
    """Start every command at once, each with ``--turns <folder>:<i>:<n>`` appended, and wait for all of them; an arm
    that exits is marked ready and done for the others. Past ``timeout_s`` seconds in all, or when this process gets
    SIGTERM (then it exits after), the remaining arms are killed with their process groups (``rc`` None, their output
    so far kept). Past ``ready_by_s`` seconds, the arms not yet warmed up (no ``ready-<i>`` marker) are killed the
    same way and the others take their turns."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(commands)
    procs = [subprocess.Popen([*cmd, "--turns", f"{folder}:{i}:{n}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)
             for i, cmd in enumerate(commands)]
    outputs: List[Optional[ArmRun]] = [None] * n
    readers = [_Reader(p) for p in procs]
    began = time.perf_counter()
    deadline = began + timeout_s

    def kill(i: int) -> None:
        os.killpg(procs[i].pid, signal.SIGKILL)
        procs[i].wait()
        out, err = readers[i].finish()
        outputs[i] = ArmRun(None, out, err, killed_after_s=round(time.perf_counter() - began, 1))

    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)   # so the finally below runs when we are stopped
    try:
        while any(o is None for o in outputs) and time.perf_counter() <= deadline:
            for i, p in enumerate(procs):
                if outputs[i] is None and p.poll() is not None:
                    out, err = readers[i].finish()
                    outputs[i] = ArmRun(p.returncode, out, err)
                    mark(folder, "ready", i)
                    mark(folder, "done", i)
            if ready_by_s is not None and time.perf_counter() - began >= ready_by_s:
                for i, p in enumerate(procs):
                    if outputs[i] is None and p.poll() is None and not (folder / f"ready-{i}").exists():
                        kill(i)
                        mark(folder, "ready", i)
                        mark(folder, "done", i)
            time.sleep(0.2)
    finally:   # past the limit, or stopped ourselves: no arm outlives this call, nor its compile workers
        signal.signal(signal.SIGTERM, previous)
        for i, p in enumerate(procs):
            if outputs[i] is None:
                if p.poll() is None:
                    kill(i)
                else:
                    out, err = readers[i].finish()
                    outputs[i] = ArmRun(p.returncode, out, err)
    return [o for o in outputs if o is not None]


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class _Reader:
    """Drains a process's stdout and stderr on threads (a full pipe would block an arm that prints much)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.parts: Dict[str, List[str]] = {"out": [], "err": []}
        self.threads = [threading.Thread(target=self._drain, args=(stream, self.parts[key]), daemon=True)
                        for key, stream in (("out", proc.stdout), ("err", proc.stderr))]
        for t in self.threads:
            t.start()

    @staticmethod
    def _drain(stream, into: List[str]) -> None:
        for line in stream:
            into.append(line)

    def finish(self) -> tuple:
        for t in self.threads:
            t.join(timeout=5)
        return "".join(self.parts["out"]), "".join(self.parts["err"])
