"""``python -m lightning_megatron.planner verify --config examples/configs/llama3_70b.yaml``: run chosen ranks of a
layout for real, one at a time, each in a dry run (:class:`~lightning_megatron.DryRun`: one process, fake collectives)
of the Trainer's real steps on mock data, and print what each rank holds and does beside the planner's prediction.

Per rank: parameters held, static state bytes (parameters, gradients, optimizer states), the allocator's peak
allocated and reserved memory (CUDA; on the CPU only the tensor-size accounting of the static bytes), compute time
per optimizer step and compute-only MFU (the job's model FLOPs per GPU per step over this rank's step time, against
the hardware profile's bf16 peak, 989 TFLOP/s on an H200). The numbers are per rank and without communication: the
fake collectives return at once, so no TP / CP / EP / pipeline / data-parallel transfer and no pipeline bubble is in
them. Each rank runs in a subprocess of its own (a fresh process group and allocator per rank):
``python -m lightning_megatron.cli.dry_run`` (:mod:`lightning_megatron.cli.dry_run`) with the same flags.

``--tiny`` keeps the layout (tp, pp, vp, cp, ep, world size, sharding, recompute, precision) and shrinks the model
to a few-second CPU run: 2 layers per pipeline stage, hidden 64, vocabulary 512, sequence 16 x cp x tp, the fewest
micro-batches the schedule takes. This module imports neither torch nor Lightning.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

from lightning_megatron.models.config import GPTConfig
from lightning_megatron.planner.calibration import HARDWARE_NAMES, load_hardware
from lightning_megatron.planner.layout import RECOMPUTE_PRESETS, Layout
from lightning_megatron.planner.memory import state_bytes
from lightning_megatron.planner.model import GIB, Workload, predict

__all__ = ["VerifyJob", "load_job", "tiny_job", "parse_ranks", "rank_coordinates", "predicted", "job_of",
           "build_parser", "format_rank", "main", "RESULT_MARK", "RANK_RUNNER"]

#: the marker before a rank's JSON result on its subprocess's stdout
RESULT_MARK = "VERIFY_RESULT "
#: the module each rank's subprocess runs (``python -m``; it trains the rank: torch, Lightning and the strategy live
#: there, above the planner's layer)
RANK_RUNNER = "lightning_megatron.cli.dry_run"
#: the note every table ends with
PER_RANK_NOTE = ("Per rank, without communication: the collectives are fake (they return at once), so no TP / CP / "
                 "EP / pipeline / data-parallel transfer and no pipeline bubble is in these numbers.")


@dataclass(frozen=True)
class VerifyJob:
    """What a LightningCLI configuration trains, as far as a dry run needs it: ``model`` (a ``GPTConfig``),
    ``module_kwargs`` (``ParallelGPTModule``'s other arguments), ``strategy_kwargs`` (``MegatronStrategy``'s),
    ``precision_kwargs`` (``MegatronPrecision``'s, None: fp32), ``world`` (devices x nodes), ``micro_batch_size``,
    ``num_microbatches`` (``accumulate_grad_batches``)."""

    model: GPTConfig
    strategy_kwargs: Dict[str, Any]
    world: int
    micro_batch_size: int = 1
    num_microbatches: int = 1
    precision_kwargs: Optional[Dict[str, Any]] = None
    module_kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        """The planner's :class:`Layout` of this job (``ValueError`` for a recompute setting no preset names)."""
        kw = self.strategy_kwargs
        tp, pp, cp = kw.get("tp", 1), kw.get("pp", 1), kw.get("cp", 1)
        if self.world % (tp * pp * cp):
            raise ValueError(f"world={self.world} is not divisible by tp*pp*cp={tp * pp * cp}")
        sharding = kw.get("data_parallel_sharding_strategy") or (
            "optim" if kw.get("use_distributed_optimizer") else "no_shard")
        recompute = "none"
        if kw.get("recompute_granularity"):
            given = {k: kw[k] for k in ("recompute_granularity", "recompute_method", "recompute_num_layers",
                                        "recompute_modules") if k in kw}
            names = [n for n, o in RECOMPUTE_PRESETS.items() if o == given]
            if given.get("recompute_method") == "block":
                names = [f"full_block:{given['recompute_num_layers']}"]
            if not names:
                raise ValueError(f"recompute options {given} are none of the planner's presets "
                                 f"{tuple(RECOMPUTE_PRESETS)} or full_block:N")
            recompute = names[0]
        return Layout(tp=tp, pp=pp, cp=cp, dp=self.world // (tp * pp * cp), ep=kw.get("ep", 1), vp=kw.get("vp"),
                      etp=kw.get("etp"), sequence_parallel=bool(kw.get("sequence_parallel", False)),
                      sharding=sharding, recompute=recompute, micro_batch_size=self.micro_batch_size,
                      num_microbatches=self.num_microbatches, cp_comm_type=kw.get("cp_comm_type", "p2p"),
                      **({"schedule": kw["pipeline_schedule"]} if kw.get("pipeline_schedule") else {}))

    @property
    def workload(self) -> Workload:
        """The planner's :class:`Workload` (precision: ``fp8`` with an FP8 recipe, bf16 parameters when asked)."""
        pk = self.precision_kwargs or {}
        params_dtype = "bf16" if "bfloat16" in str(pk.get("params_dtype", "")) else "fp32"
        moments = {k: "bf16" if "bfloat16" in str(self.module_kwargs.get(k, "")) else "fp32"
                   for k in ("exp_avg_dtype", "exp_avg_sq_dtype")}
        return Workload(self.model, self.model.seq_length, self.micro_batch_size * self.num_microbatches
                        * self.layout.dp, precision="fp8" if pk.get("fp8") else "bf16", params_dtype=params_dtype,
                        **moments)


def _init_args(node: Any) -> Dict[str, Any]:
    return dict(node.get("init_args") or {}) if isinstance(node, dict) else {}


def load_job(path: str) -> VerifyJob:
    """Read a LightningCLI YAML (``examples/configs/*.yaml``): the trainer's strategy and precision plugin, its
    devices x nodes and ``accumulate_grad_batches``, the model's ``config`` and the data's micro-batch size."""
    import yaml

    with open(path) as f:
        conf = yaml.safe_load(f)
    trainer, model, data = conf.get("trainer") or {}, dict(conf.get("model") or {}), conf.get("data") or {}
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if not isinstance(devices, int):
        raise ValueError(f"{path}: trainer.devices={devices!r}: give the number of devices per node")
    precision = None
    for plugin in trainer.get("plugins") or []:
        if isinstance(plugin, dict) and str(plugin.get("class_path", "")).endswith("MegatronPrecision"):
            precision = _init_args(plugin)
    config = GPTConfig(**(model.pop("config", None) or {}))
    return VerifyJob(model=config, strategy_kwargs=_init_args(trainer.get("strategy")), world=devices * nodes,
                     micro_batch_size=_init_args(data).get("micro_batch_size", 1),
                     num_microbatches=trainer.get("accumulate_grad_batches", 1), precision_kwargs=precision,
                     module_kwargs=model)


def tiny_job(job: VerifyJob) -> VerifyJob:
    """The same layout with a model a CPU trains in seconds: 2 layers per pipeline stage (per virtual stage), hidden
    64, ``2 tp`` heads (at least 4) in ``tp`` query groups, ffn 128 (experts 64), vocabulary 512, sequence
    ``16 cp tp``; the fewest micro-batches per step the schedule takes (``pp``; 1 without a pipeline)."""
    kw = job.strategy_kwargs
    tp, pp, cp, vp = kw.get("tp", 1), kw.get("pp", 1), kw.get("cp", 1), kw.get("vp") or 1
    heads = max(4, 2 * tp)
    seq = 16 * cp * tp
    changes: Dict[str, Any] = dict(num_layers=2 * pp * vp, hidden_size=64, num_attention_heads=heads,
                                   num_query_groups=tp if heads % tp == 0 and tp > 1 else 2, ffn_hidden_size=128,
                                   vocab_size=512, seq_length=seq, max_position_embeddings=seq, kv_channels=None)
    if job.model.num_moe_experts:
        changes["moe_ffn_hidden_size"] = 64
    model = job.model.replace(**changes)
    return replace(job, model=model, num_microbatches=pp if pp > 1 else 1, micro_batch_size=1)


def rank_coordinates(layout: Layout, rank: int) -> Dict[str, int]:
    """The mesh coordinates of global ``rank``: dense order tp fastest, then cp, dp, pp; expert order etp, ep, edp,
    pp (:class:`~lightning_megatron.ParallelMesh`). ``zero``: the rank's index in its dp x cp group."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    etp = layout.etp or tp
    per_stage = layout.world // layout.pp
    coords = {"tp": rank % tp, "cp": (rank // tp) % cp, "dp": (rank // (tp * cp)) % dp, "pp": rank // per_stage}
    coords["zero"] = coords["dp"] * cp + coords["cp"]
    coords["edp"] = (rank % per_stage) // (etp * layout.ep)
    return coords


def parse_ranks(spec: str, layout: Layout) -> List[int]:
    """``"first,last"`` / ``"0,63"``: ``first`` is rank 0 (the first pipeline stage, the embedding), ``last`` the
    highest rank (the last stage: the output layer, the logits), ``middle`` the first rank of pipeline stage
    ``pp // 2``; integers are global ranks. Duplicates are dropped, order kept."""
    out: List[int] = []
    named = {"first": 0, "last": layout.world - 1, "middle": (layout.pp // 2) * (layout.world // layout.pp)}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in named:
            rank = named[item]
        elif item.isdigit():
            rank = int(item)
        else:
            raise ValueError(f"--ranks {spec!r}: {item!r} is neither first, last, middle nor a rank number")
        if not 0 <= rank < layout.world:
            raise ValueError(f"--ranks {spec!r}: rank {rank} is outside the job's {layout.world} ranks")
        if rank not in out:
            out.append(rank)
    return out


def predicted(job: VerifyJob, rank: int, hardware: str = "h200") -> Dict[str, Any]:
    """The planner's numbers for ``rank`` of ``job``: its parameters and static bytes (exact,
    :func:`~lightning_megatron.planner.state_bytes` at the rank's pipeline, ZeRO and expert-data-parallel index),
    peak memory (GiB, the rank's pipeline stage), compute time per step (``time["rank compute"]``), the compute-only
    MFU that gives, and whether the layout fits the GPU (predicted peak + 5% + 2 GiB, the planner's rule)."""
    from lightning_megatron.planner.memory import rank_parameters

    layout, work, hw = job.layout, job.workload, load_hardware(hardware)
    at = rank_coordinates(layout, rank)
    sb = state_bytes(job.model, layout, at["pp"], dp_rank=at["zero"], edp_rank=at["edp"],
                     moment_bytes=work.moment_bytes, params_dtype=work.params_dtype,
                     store_param_remainders=work.store_param_remainders)
    p = predict(layout, work, hw, pp_rank=at["pp"])
    compute_s = p.time["rank compute"]
    return {"params": sum(t.numel for t in rank_parameters(job.model, layout, at["pp"])),
            "state_params": sb.params, "state_grads": sb.grads, "state_optimizer": sb.optimizer,
            "peak_gib": p.peak_gib, "compute_s": compute_s, "mfu": mfu(job, compute_s, hw.bf16_tflops),
            "fits": hw.fits(p.peak_gib)}


def mfu(job: VerifyJob, step_s: float, tflops: float) -> float:
    from lightning_megatron.callbacks.flops import num_floating_point_operations

    flops = num_floating_point_operations(job.model, job.workload.global_batch_size, job.model.seq_length)
    return flops / job.world / step_s / (tflops * 1e12)


def _bytes(v: Optional[int]) -> str:
    return "n/a" if v is None else f"{v:,}"


def format_rank(job: VerifyJob, got: Dict[str, Any], want: Dict[str, Any]) -> str:
    """One rank's measured numbers beside the planner's (measured / predicted / ratio)."""
    at = rank_coordinates(job.layout, got["rank"])
    head = (f"rank {got['rank']} (pp {at['pp']}, dp {at['dp']}, cp {at['cp']}, tp {at['tp']}) on {got['device']}, "
            f"{got['steps']} steps; the planner {'fits' if want['fits'] else 'does not fit'} this rank")
    if got.get("out_of_memory"):   # nothing else was measured
        return (f"{head}\n  OUT OF MEMORY on {got['device']} (planner: peak {want['peak_gib']:.2f} GiB): "
                f"{got['out_of_memory']}")
    state_got = sum(got[k] or 0 for k in ("state_params", "state_grads", "state_optimizer"))
    state_want = want["state_params"] + want["state_grads"] + want["state_optimizer"]
    rows = [("parameters held", f"{got['params']:,}", f"{want['params']:,}"),
            ("static bytes: parameters", _bytes(got["state_params"]), _bytes(want["state_params"])),
            ("static bytes: gradients", _bytes(got["state_grads"]), _bytes(want["state_grads"])),
            ("static bytes: optimizer", _bytes(got["state_optimizer"]), _bytes(want["state_optimizer"])),
            ("static bytes: total", _bytes(state_got), _bytes(state_want)),
            ("peak allocated GiB", f"{got['peak_allocated_gib']:.2f}" if "peak_allocated_gib" in got else "n/a (CPU)",
             f"{want['peak_gib']:.2f}"),
            ("peak reserved GiB", f"{got['peak_reserved_gib']:.2f}" if "peak_reserved_gib" in got else "n/a (CPU)",
             f"{want['peak_gib']:.2f}"),
            ("compute s / step", f"{got['compute_s']:.4g}", f"{want['compute_s']:.4g}"),
            ("compute-only MFU", f"{100 * got['mfu']:.1f}%", f"{100 * want['mfu']:.1f}%")]
    lines = [head, f"  {'':30s} {'measured':>16s} {'planner':>16s} {'ratio':>7s}"]
    for name, a, b in rows:
        try:
            ratio = f"{float(a.rstrip('%').replace(',', '')) / float(b.rstrip('%').replace(',', '')):.3f}"
        except (ValueError, ZeroDivisionError):
            ratio = ""
        lines.append(f"  {name:30s} {a:>16s} {b:>16s} {ratio:>7s}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``verify`` subcommand's flags."""
    about = textwrap.fill("Run chosen ranks of a LightningCLI configuration, one at a time, each alone in a dry run "
                          "(fake collectives, mock data, the Trainer's real steps), and print what each holds and "
                          "does beside the planner's prediction. Numbers are per rank, without communication.", 79)
    example = ("example (mixtral_8x7b.yaml's layout with a tiny model: CPU, seconds):\n"
               "  python -m lightning_megatron.planner verify \\\n"
               "      --config examples/configs/mixtral_8x7b.yaml --tiny")
    p = argparse.ArgumentParser(prog="python -m lightning_megatron.planner verify", description=about,
                                epilog=example, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a LightningCLI YAML (examples/configs/*.yaml)")
    p.add_argument("--ranks", default="first,last",
                   help="ranks to run: first (rank 0), last (the highest), middle, or rank numbers (default "
                        "first,last: the first and last pipeline stages, the heaviest)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per rank (the first is not timed)")
    p.add_argument("--tiny", action="store_true", help="the same layout with a tiny model (a CPU run of seconds)")
    p.add_argument("--accumulate-grad-batches", type=int, default=None,
                   help="micro-batches per step (default: the config's; --tiny: the fewest the schedule takes)")
    p.add_argument("--fp8", choices=("e4m3", "hybrid"), default=None,
                   help="FP8 GEMMs (MegatronPrecision(fp8=...); the planner's fp8 precision)")
    p.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--hardware", choices=HARDWARE_NAMES, default="h200", help="the planner's hardware profile")
    p.add_argument("--json", default=None, help="also write every rank's numbers to this JSON file")
    return p


def job_of(args: argparse.Namespace) -> VerifyJob:
    """The job the flags describe."""
    job = load_job(args.config)
    if args.tiny:
        job = tiny_job(job)
    if args.accumulate_grad_batches:
        job = replace(job, num_microbatches=args.accumulate_grad_batches)
    if args.fp8:
        job = replace(job, precision_kwargs={"precision": "bf16-mixed", **(job.precision_kwargs or {}),
                                             "fp8": args.fp8})
    return job


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Run each chosen rank in a subprocess of its own, print the per-rank tables; returns the results.
    RuntimeError at the end when a rank's run failed (the others still run; running out of GPU memory is a result,
    not a failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: give at least 1")
    job = job_of(args)
    layout = job.layout
    print(f"{args.config}{' (--tiny)' if args.tiny else ''}: {layout.world} ranks, tp {layout.tp} pp {layout.pp} "
          f"vp {layout.vp or 1} cp {layout.cp} ep {layout.ep} dp {layout.dp}, {layout.sharding}, recompute "
          f"{layout.recompute}, micro-batch {job.micro_batch_size} x {job.num_microbatches}, seq "
          f"{job.model.seq_length}")
    results: List[Dict[str, Any]] = []
    failed: List[int] = []
    for rank in parse_ranks(args.ranks, layout):
        cmd = [sys.executable, "-m", RANK_RUNNER, *argv, "--rank", str(rank)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        found = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if proc.returncode != 0 or not found:   # reported, and the other ranks still run
            failed.append(rank)
            print(f"rank {rank}: the dry run failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
            continue
        got = json.loads(found[-1][len(RESULT_MARK):])
        want = predicted(job, rank, args.hardware)
        results.append({"measured": got, "predicted": want})
        print(format_rank(job, got, want))
    hw = load_hardware(args.hardware)
    whole = predict(layout, job.workload, hw)   # the layout's largest pipeline rank
    print(f"planner: the layout {'fits' if hw.fits(whole.peak_gib) else 'does not fit'} on one {args.hardware} "
          f"({hw.memory_gib:.1f} GiB): its largest rank's predicted peak {whole.peak_gib:.1f} GiB, + 5% + 2 GiB")
    print(PER_RANK_NOTE)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if failed:
        raise RuntimeError(f"the dry runs of ranks {failed} failed (their errors are above)")
    return results
