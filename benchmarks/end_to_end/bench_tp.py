"""Throughput of MegatronStrategy against the peers on the 1.3B LLaMA-style benchmark model, and an NCCL
numerics check of tp=2 against tp=1.

Arms (one per invocation; ``benchmarks/end_to_end/run_tp_bench.sh`` runs them all in one device call):
  python benchmarks/end_to_end/bench_tp.py ours                     # MegatronStrategy(tp=1), 1 GPU, bf16-mixed
  torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py ours --tp 2 [--sp]
  python benchmarks/end_to_end/bench_tp.py check                    # 5 fp32 steps, tiny-ish model, prints losses
  torchrun --nproc_per_node=2 benchmarks/end_to_end/bench_tp.py check --tp 2 [--sp]
The plain-PyTorch and Lightning-strategy peers are ``peer_baseline.py`` / ``peer_x2.py`` (copied from the
shared peer baselines, unchanged). Model, data (random tokens), optimizer (AdamW lr 1e-4), steps (4 warm-up,
10 timed) and the FLOPs formula (attention counted non-causal, as PEERS.md) are the same in every arm.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_megatron import ColumnParallelLinear, GPTConfig, MegatronStrategy, ParallelGPTModule
from lightning_megatron.callbacks.flops import flops_per_token
from lightning_megatron.parallel.context_parallel.kernels import _CUDNN_FAILED
from lightning_megatron.parallel.context_parallel.ring import _CUDA_MERGE, _merge_rows

PEAK = 989e12


def build_strategy(args) -> MegatronStrategy:
    """The layout the command line asks for (same in every arm)."""
    return MegatronStrategy(tp=args.tp, pp=args.pp, vp=args.vp, cp=args.cp, cp_comm_type=args.cp_comm_type,
                            ep=args.ep, sequence_parallel=args.sp, pipeline_schedule=args.schedule,
                            grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                            use_distributed_optimizer=args.use_distributed_optimizer,
                            data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
                            delay_wgrad_compute=args.delay_wgrad_compute, cp_attention_kernel=args.cp_attention_kernel,
                            cp_compile_merge=args.cp_compile_merge, cp_sm_carveout=args.cp_sm_carveout,
                            compile=args.compile, recompute_granularity=args.recompute_granularity,
                            recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
                            recompute_modules=args.recompute_modules, overlap_grad_reduce=args.overlap_grad_reduce,
                            bucket_size=args.ddp_bucket_size, overlap_param_gather=args.overlap_param_gather,
                            tp_comm_overlap=args.tp_comm_overlap,
                            check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad)


def layout_prefix(args) -> str:
    """``tp<N>[-pp<N>][-vp<N>]``: the start of every result's name."""
    return f"tp{args.tp}" + (f"-pp{args.pp}" if args.pp > 1 else "") + (f"-vp{args.vp}" if args.vp else "")


def option_suffix(args) -> str:
    """``[-cp<N>-<comm>[-<kernel>][-eagermerge][-carveout<N>]][-gradbf16][-distopt][-delaywgrad|-nodelay]``: the
    options in every result's name (the CP kernel options only where they differ from the defaults)."""
    cp_options = ((f"-{args.cp_attention_kernel}" if args.cp_attention_kernel != "auto" else "")
                  + ("" if args.cp_compile_merge else "-eagermerge")
                  + (f"-carveout{args.cp_sm_carveout}" if args.cp_sm_carveout is not None else ""))
    return ((f"-cp{args.cp}-{args.cp_comm_type}{cp_options}" if args.cp > 1 else "")
            + ("-gradbf16" if args.grad_reduce_in_bf16 else "") + ("-distopt" if args.use_distributed_optimizer else "")
            + (f"-{args.data_parallel_sharding_strategy}" if args.data_parallel_sharding_strategy else "")
            + {True: "-delaywgrad", False: "-nodelay", None: ""}[args.delay_wgrad_compute]
            + ("-compile" if args.compile else "") + recompute_suffix(args)
            + {True: "-overlapgrad", False: "-nooverlapgrad", None: ""}[args.overlap_grad_reduce]
            + (f"-bucket{args.ddp_bucket_size}" if args.ddp_bucket_size else "")
            + ("-overlapparam" if args.overlap_param_gather else "") + ("-tpoverlap" if args.tp_comm_overlap else "")
            + ("" if args.check_for_nan_in_loss_and_grad else "-nonancheck"))


def recompute_suffix(args) -> str:
    """``[-rc-full-<method><N>|-rc-<modules joined by +>]``: the activation recompute of the run."""
    if args.recompute_granularity == "full":
        return f"-rc-full-{args.recompute_method}{args.recompute_num_layers}"
    if args.recompute_granularity == "selective":
        return "-rc-" + "+".join(args.recompute_modules or ["core_attn"])
    return ""


class RandomTokens(Dataset):
    """Deterministic random token samples (sample i from seed i)."""

    def __init__(self, c: GPTConfig, n: int = 10**6) -> None:
        self.c, self.n = c, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.c.vocab_size, (self.c.seq_length + 1,), generator=g)
        return {"tokens": ids[:-1], "labels": ids[1:]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(pl.Callback):
    """Wall time of batches [start, stop) with CUDA synchronisation, and the losses seen. On CUDA also the
    memory allocated when the timed window starts (parameters, gradients and optimizer states) and the peaks of
    allocated and of reserved memory inside the window (reserved counts CUDA graph pools, allocated does not)."""

    def __init__(self, start: int = 4, stop: int = 14, every_step: bool = False) -> None:
        self.start, self.stop, self.times, self.losses = start, stop, [], []
        self.every_step = every_step  # reading the loss each step synchronises the GPU: only for checks
        self.base_mem = self.peak_mem = self.peak_reserved = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.start:
            _sync()
            if torch.cuda.is_available():
                self.base_mem = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            self.times.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every_step:  # the optimizer step's loss, logged once per step at its last micro-batch
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                self.losses.append(float(trainer.callback_metrics["train_loss"]))
        elif batch_idx == self.stop - 1:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if batch_idx == self.stop - 1:
            _sync()
            self.times.append(time.perf_counter())
            if torch.cuda.is_available():
                self.peak_mem = torch.cuda.max_memory_allocated()
                self.peak_reserved = torch.cuda.max_memory_reserved()


class ProfileSteps(pl.Callback):
    """Profile Lightning batches [start, start + n) with torch.profiler and print the ops with the most self
    device time (rank 0)."""

    def __init__(self, start: int, n: int = 2, rows: int = 30, json_path: str = "") -> None:
        self.start, self.n, self.rows, self.prof, self.json_path = start, n, rows, None, json_path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.start:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.prof is not None and batch_idx == self.start + self.n - 1:
            _sync()
            self.prof.__exit__(None, None, None)
            if trainer.global_rank == 0:
                events = self.prof.key_averages()
                key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
                print(events.table(sort_by=key, row_limit=self.rows, max_name_column_width=70), flush=True)
                if self.json_path:
                    with open(self.json_path, "w") as f:
                        json.dump(profile_summary(self.prof, key), f, indent=1)
            self.prof = None


def _merged(intervals):
    """Union of ``(start, end)`` intervals as sorted disjoint intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap_us(a: float, b: float, merged) -> float:
    """Length of ``[a, b)`` covered by the disjoint sorted intervals ``merged``."""
    import bisect

    i = max(bisect.bisect_right([m[0] for m in merged], a) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < b:
        total += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
        i += 1
    return total


def device_kernels(prof) -> list:
    """``(start_us, end_us, name)`` of every kernel of a ``torch.profiler`` run, sorted by start. The device-side
    ranges of ``record_function`` annotations are left out by their flag, not by name: Inductor's Triton kernels
    share their names with their host-side launch ranges, so a name filter drops every compiled kernel."""
    from torch.autograd import DeviceType

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                  and e.name != "Command Buffer Full")


def profile_summary(prof, key: str, top: int = 80) -> dict:
    """Ops with the most self device time (us, calls) and the device timeline: the window from the first to the
    last kernel, busy time (union of all kernels) and compute time (union of non-NCCL kernels); per NCCL kernel
    the time no compute kernel ran beside it ("exposed"); and the idle gaps (no kernel at all) over 20 us, the
    largest with the kernels around them."""
    from torch.autograd import DeviceType

    ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    events = prof.events()
    kern = device_kernels(prof)
    out: dict = {"ops": [[e.key, round(getattr(e, key)), e.count] for e in ops]}
    if not kern:
        return out
    busy = _merged([(a, b) for a, b, _ in kern])
    compute = _merged([(a, b) for a, b, n in kern if "nccl" not in n.lower()])
    out["window_us"] = kern[-1][1] - kern[0][0]
    out["busy_us"] = sum(b - a for a, b in busy)
    out["compute_busy_us"] = sum(b - a for a, b in compute)
    exposed: dict = {}
    for a, b, n in kern:
        if "nccl" in n.lower():
            name = n.split("(")[0]
            e = exposed.setdefault(name, [0.0, 0.0, 0])
            e[0] += b - a
            e[1] += (b - a) - _overlap_us(a, b, compute)
            e[2] += 1
    out["nccl_total_exposed_calls"] = {k: [round(v[0]), round(v[1]), v[2]] for k, v in exposed.items()}
    gaps = [(busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)]
    gaps = [g for g in gaps if g[0] > 20]
    out["idle_gaps_over_20us"] = [len(gaps), round(sum(g for g, _ in gaps))]
    ends = {b: n for a, b, n in kern}
    largest = []
    for g, at in sorted(gaps, reverse=True)[:12]:
        after = next((n for a, b, n in kern if a >= at + g - 1e-3), "")
        largest.append([round(g), ends.get(at, "")[:60], after[:60]])
    out["largest_gaps"] = largest
    api: dict = {}  # host-side CUDA runtime calls: a synchronising one stalls the host and starves the device
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("cuda"):
            t = api.setdefault(e.name, [0.0, 0, 0.0])
            dur = e.time_range.end - e.time_range.start
            t[0], t[1], t[2] = t[0] + dur, t[1] + 1, max(t[2], dur)
    out["host_cuda_api_total_calls_max"] = {k: [round(v[0]), v[1], round(v[2])] for k, v in
                                            sorted(api.items(), key=lambda kv: -kv[1][0])[:10]}
    return out


def run_ours(args) -> None:
    if args.model == "moe":  # Mixtral-shaped: 8 experts, top-2, hidden 2048, 8 layers
        cfg = GPTConfig.mixtral_small_bench(moe_grouped_gemm=not args.moe_loop,
                                            moe_token_dispatcher_type=args.dispatcher)
    elif args.model == "tiny_moe":
        cfg = GPTConfig.tiny_moe(moe_grouped_gemm=not args.moe_loop, moe_token_dispatcher_type=args.dispatcher)
    elif args.model == "llama3_8b":
        cfg = GPTConfig.llama3_8b()
    else:
        cfg = GPTConfig.llama_1b_bench() if args.model == "bench" else GPTConfig.tiny(num_layers=4)
    if args.seq:
        cfg = dataclasses.replace(cfg, seq_length=args.seq)
    ColumnParallelLinear.recompute_input_gather = args.recompute_gather
    world = int(os.environ.get("WORLD_SIZE", 1))
    pl.seed_everything(0, verbose=False)
    acc = args.accumulate
    timer = StepTimer(4 * acc, 14 * acc) if acc == 1 else StepTimer(2 * acc, 7 * acc)
    module = ParallelGPTModule(cfg, lr=1e-4, weight_decay=0.0, lr_decay_style="constant")
    strategy = build_strategy(args)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=world, strategy=strategy, accumulate_grad_batches=acc,
                         precision="bf16-mixed", max_steps=timer.stop // acc + (1 if args.profile else 0), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer] + ([ProfileSteps(timer.stop, acc, json_path=args.profile_json)] if args.profile else []))
    trainer.fit(module, DataLoader(RandomTokens(cfg), batch_size=args.mbs, num_workers=2, pin_memory=True))
    if trainer.global_rank == 0:
        dp = world // (args.tp * args.pp * args.cp)
        steps = timer.stop - timer.start  # micro-batches (Lightning batches) timed
        dt = timer.times[1] - timer.times[0]
        tok_per_gpu = args.mbs * cfg.seq_length * dp * steps / dt / world
        # attention counted non-causal: for dense models PEERS.md's 3*(L*(2*(2h^2+2h*kv)+6hf+4sh)+2hV)
        # (tests/test_mfu.py checks the two agree); MoE models count the routed top-k experts and the router
        tflops = tok_per_gpu * flops_per_token(cfg, causal=False)
        layout = layout_prefix(args)
        layout += f"-{args.schedule}" if args.schedule else ""
        layout += option_suffix(args)
        layout += f"-s{cfg.seq_length}" if args.seq else ""
        if cfg.num_moe_experts:
            layout = f"moe-ep{args.ep}-{layout}-{'loop' if args.moe_loop else 'grouped'}-{args.dispatcher}"
        layout += f"-m{acc}" if acc > 1 else ""
        print(json.dumps(dict(name=f"lightning-megatron-{layout}{'-sp' if args.sp else ''}{'-regather' if args.recompute_gather else ''}-{world}gpu",
                              tokens_per_s_per_gpu=round(tok_per_gpu), tflops_per_gpu=round(tflops / 1e12, 1),
                              mfu=round(tflops / PEAK, 4), step_ms=round(dt / steps * acc * 1e3, 1),
                              peak_mem_gib=round(timer.peak_mem / 2**30, 2) if torch.cuda.is_available() else None,
                              peak_reserved_gib=(round(timer.peak_reserved / 2**30, 2)
                                                 if torch.cuda.is_available() else None),
                              # peak in the timed window above what is held between steps (params, grads, optimizer
                              # states: Lightning frees the grads only inside the next step's closure)
                              activation_mem_gib=round((timer.peak_mem - timer.base_mem) / 2**30, 2)
                              if torch.cuda.is_available() else None,
                              loss=round(timer.losses[-1], 4),
                              **(cp_kernels_used(args) if args.cp > 1 and torch.cuda.is_available() else {}))), flush=True)


def cp_kernels_used(args) -> dict:
    """Which CP block kernel ran (the one asked for; under ``auto`` cuDNN, or flash after cuDNN refused) and whether
    the ring's merge compiled."""
    if not args.cp_compile_merge:
        merge = "eager (--no-cp-compile-merge)"
    else:
        merge = "none (no ring merge)" if not _CUDA_MERGE else ("eager" if _CUDA_MERGE[0] is _merge_rows else "compiled")
    kernel = args.cp_attention_kernel
    if kernel == "auto":
        kernel = "flash (cuDNN refused)" if _CUDNN_FAILED else "cudnn"
    return {"cp_block_kernel": kernel, "cp_merge": merge}


def run_check(args) -> None:
    """5 optimizer steps of a small model on fixed data; prints the per-step losses (same on every rank).
    ``--precision 32-true`` (default) for exact parity; ``bf16-mixed`` exercises the fused attention kernels."""
    # no aux loss: it is per micro-batch, and the two layouts group the same samples differently
    moe = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408, moe_aux_loss_coeff=0.0,
               moe_grouped_gemm=not args.moe_loop, moe_token_dispatcher_type=args.dispatcher)
    cfg = GPTConfig(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1408,
                    vocab_size=32000, seq_length=args.seq or 1024, **(moe if args.model in ("moe", "tiny_moe") else {}))
    world = int(os.environ.get("WORLD_SIZE", 1))
    pl.seed_everything(0, verbose=False)
    acc = args.accumulate
    timer = StepTimer(0, 5 * acc, every_step=True)
    module = ParallelGPTModule(cfg, lr=1e-3, lr_decay_style="constant")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    strategy = build_strategy(args)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=world, strategy=strategy, accumulate_grad_batches=acc,
                         precision=args.precision, max_steps=5, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(module, DataLoader(RandomTokens(cfg, 64 * acc), batch_size=args.mbs, shuffle=False))
    if trainer.global_rank == 0:
        layout = layout_prefix(args) + option_suffix(args)
        layout += f"-moe-ep{args.ep}-{'loop' if args.moe_loop else 'grouped'}-{args.dispatcher}" if "moe" in args.model else ""
        print(json.dumps(dict(name=f"check-{layout}{'-sp' if args.sp else ''}-m{acc}-{args.precision}",
                              losses=[round(x, 6) for x in timer.losses])), flush=True)


if __name__ == "__main__":
    import faulthandler

    p = argparse.ArgumentParser()
    p.add_argument("arm", choices=["ours", "check"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vp", type=int, default=None)
    p.add_argument("--schedule", default=None)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--cp-comm-type", default="p2p")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's 2048)")
    p.add_argument("--model", default="bench", choices=["bench", "tiny", "moe", "tiny_moe", "llama3_8b"],
                   help="bench: 1.3B dense; moe: Mixtral-shaped 8x top-2; tiny*: CPU smoke tests of the script")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--grad-reduce-in-bf16", action="store_true", help="data-parallel gradient reduction in bf16")
    p.add_argument("--use-distributed-optimizer", action="store_true", help="optimizer states sharded over dp x cp")
    p.add_argument("--data-parallel-sharding-strategy", default=None,
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="Megatron's sharding level (optim_grads / optim_grads_params: FSDP2 over dp x cp)")
    p.add_argument("--delay-wgrad-compute", action=argparse.BooleanOptionalAction, default=None,
                   help="a2a CP: weight-gradient GEMMs run during the backward all-to-alls (default: the strategy's, "
                        "on where it applies; --no-delay-wgrad-compute: the plain backward)")
    p.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="MegatronStrategy(overlap_grad_reduce=...) (default: each path's own)")
    p.add_argument("--ddp-bucket-size", type=int, default=None, help="MegatronStrategy(bucket_size=...) in elements")
    p.add_argument("--overlap-param-gather", action="store_true", help="MegatronStrategy(overlap_param_gather=True)")
    p.add_argument("--tp-comm-overlap", action="store_true", help="MegatronStrategy(tp_comm_overlap=True): SP rings")
    p.add_argument("--compile", action="store_true", help="MegatronStrategy(compile=True): torch.compile each layer")
    p.add_argument("--cp-attention-kernel", default="auto", choices=["auto", "cudnn", "flash", "math"],
                   help="CP block kernel on CUDA half types (MegatronStrategy(cp_attention_kernel=...))")
    p.add_argument("--cp-compile-merge", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the ring's output merge (--no-cp-compile-merge: eager)")
    p.add_argument("--cp-sm-carveout", type=int, default=None,
                   help="SMs the delayed weight-gradient GEMMs leave to the a2a exchanges "
                        "(default: 16 on CUDA; 0: none)")
    p.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="the non-finite guard (MegatronStrategy(check_for_nan_in_loss_and_grad=...))")
    p.add_argument("--profile", action="store_true", help="profile one optimizer step after the timed window")
    p.add_argument("--profile-json", default="", help="with --profile: also write the top ops and busy time here")
    p.add_argument("--moe-loop", action="store_true", help="per-expert GEMM loop instead of one grouped GEMM")
    p.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"])
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--recompute-gather", action="store_true", help="SP: all-gather the input again in backward")
    p.add_argument("--recompute-granularity", default=None, choices=["selective", "full"],
                   help="activation recompute (MegatronStrategy(recompute_granularity=...))")
    p.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--recompute-modules", nargs="+", default=None,
                   help="selective: Megatron's names (default core_attn)")
    p.add_argument("--watchdog", type=float, default=300.0,
                   help="seconds after which every process prints its Python stacks and exits (0: off)")
    a = p.parse_args()
    if a.watchdog > 0:  # a hung collective then shows where each rank waits instead of eating the device time
        faulthandler.dump_traceback_later(a.watchdog, exit=True)
    {"ours": run_ours, "check": run_check}[a.arm](a)
