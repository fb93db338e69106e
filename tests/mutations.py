"""Mutation check: plant known bugs, one at a time, in a temporary copy of the repository and show that the
default suite catches each of them.

Run from anywhere (a git checkout is needed: the copy is made from ``git ls-files``)::

    python tests/mutations.py            # every mutation (3 to 4 minutes on 2 busy cores)
    python tests/mutations.py --list     # the mutations and the tests each one runs
    python tests/mutations.py --only sp-grads-summed-twice --keep

What it does:

1. copies the checkout's files (tracked, plus untracked ones that git does not ignore, as they are in the working
   tree) into a temporary directory; the real tree is never written to;
2. runs the union of the selections below once on the unmutated copy and requires every test to pass (so a broken
   environment cannot pass for a catch);
3. for each mutation, makes a fresh copy, applies its exact source replacements (each ``old`` text must occur
   exactly once in its file, else the script stops: a refactor cannot silently stop the bug from being planted),
   checks that ``lightning_megatron`` and ``tests`` resolve inside that copy, runs its tests there with
   ``PYTHONPATH`` set to the copy, and requires pytest to report failed tests (exit status 1 with at least one
   failure; collection errors or crashes of pytest itself count as "broken", not as a catch);
4. prints a table (mutation, tests run, outcome, failing test ids) and exits non-zero if any mutation survived or
   any run was broken.

The selections are small, fast subsets of the default suite chosen to catch the planted bug: the float64 Hugging
Face comparison (shuffled and gapped position ids) and the RoPE closed forms for RoPE; the float64 SGD tier
(:mod:`tests.sharp`, weight change at 1e-10) for gradient scale, where a doubled gradient shows at ~1 unclipped
and at 3e-7 under clipping. The fp32 AdamW tier (1e-5) is left out by default (``--with-fp32`` adds it): AdamW
divides a constant factor out except through its ``eps``, so all gradients x2 leave the final weights 1.3e-4 off in
the unclipped tp2-sp case (caught, 13x above the bar) and within the bar in the clipped tp2-sp-clip case (missed).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of ``old`` in ``path`` (relative to the repository root) by ``new``."""
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    """A planted bug: its ``edits`` and the pytest node ids that must catch it."""
    name: str
    bug: str
    edits: Tuple[Edit, ...]
    tests: Tuple[str, ...]
    fp32_tests: Tuple[str, ...] = field(default=())   # run only with --with-fp32 (informative, not required)


GPT = "lightning_megatron/models/gpt.py"
ROTARY_CALL = "        tables = rotary_cos_sin(pos, c.kv_channels, c.rotary_base, dtype, c if c.rope_scaling else None)\n"
GRAD_SYNC = "lightning_megatron/parallel/grad_sync.py"
STEP = "lightning_megatron/parallel/forward_backward.py"
FLAT = "tests/test_flat_buffers.py::"
PACKED = "tests/test_packed_sequences.py::"
SHARDS = "tests/test_main_param_shards.py::"
CP_INIT = "lightning_megatron/parallel/context_parallel/__init__.py"
LONG = "tests/test_long_runs.py::"


def sharp(case: str) -> str:
    return f"tests/test_parity_sharp.py::test_layout_matches_float64_reference[{case}]"


def recipe(name: str, layout: str) -> str:
    return f"tests/test_parity_recipes.py::test_recipe_under_layout_matches_one_process_with_sgd[{name}-{layout}]"


ROPE_TESTS = (
    "tests/test_model_reference.py::test_llama_matches_hf",   # 3 cases; position ids shuffled and gapped
    "tests/test_model_reference.py::test_rotary_rotates_each_pair_by_position_times_frequency",
    "tests/test_model_reference.py::test_rotary_scores_depend_only_on_relative_position",
)

MUTATIONS: Tuple[Mutation, ...] = (
    Mutation(
        "rope-angles-zero", "rotary_cos_sin multiplies the positions by 0 (RoPE becomes the identity)",
        (Edit(GPT, "    freqs = position_ids.to(compute).unsqueeze(-1) * inv_freq\n",
              "    freqs = 0 * position_ids.to(compute).unsqueeze(-1) * inv_freq\n"),),
        ROPE_TESTS),
    Mutation(
        "rope-arange", "GPTModel.rotary builds its tables from arange(s) instead of the given positions",
        (Edit(GPT, ROTARY_CALL,
              "        pos = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1).expand_as(pos)\n" + ROTARY_CALL),),
        ROPE_TESTS),
    Mutation(
        "given-positions-dropped", "the batch's position ids are left out whatever they are, not only when they "
        "are arange(s)",
        (Edit("lightning_megatron/models/module.py",
              "    if not torch.equal(positions, default):\n        return batch\n", ""),),
        ("tests/test_model_reference.py::test_default_position_ids_are_left_out_on_the_host_and_give_the_same_loss",)),
    Mutation(
        "sp-grads-summed-twice", "allreduce_sequence_parallel_grads sums the SP norm/bias gradients over TP twice "
        "(x tp)",
        (Edit(GRAD_SYNC, "    _allreduce_grads(params, group, average=False)\n",
              "    _allreduce_grads(params, group, average=False)\n"
              "    _allreduce_grads(params, group, average=False)\n"),),
        (sharp("tp2-sp"), sharp("tp2-sp-clip"))),
    Mutation(
        "loss-x2-plain-loop", "the pp = 1 step path (the loss the module's training_step returns) backpropagates "
        "twice the loss: every gradient x2",
        (Edit("lightning_megatron/strategy/step_path.py",
              "loss = _ValueWithGradientOf.apply(loss_sum * dp / total, value)",
              "loss = _ValueWithGradientOf.apply(2 * loss_sum * dp / total, value)"),),
        (sharp("dp2"), sharp("tp2-sp-clip")),
        fp32_tests=("tests/test_parity_tp_dp.py::test_matches_single_process[tp2-sp]",
                    "tests/test_parity_tp_dp.py::test_matches_single_process[tp2-sp-clip]")),
    Mutation(
        "loss-x2-pipeline", "the pipeline loss_fn returns twice the loss: every gradient x2 under pp",
        (Edit(STEP, "return fns.scale_loss(loss_sum * dp / counts[index] / m)",
              "return fns.scale_loss(2 * loss_sum * dp / counts[index] / m)"),),
        (sharp("pp2-1f1b"), sharp("pp2-tied-clip")),
        fp32_tests=("tests/test_parity_pp.py::test_pipeline_matches_single_process[pp2-1f1b]",)),
    Mutation(
        "adam-no-bias-correction1", "PrecisionAwareAdamW steps with lr instead of lr / (1 - beta1 ** step)",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "p = p_old * (1 - lr * weight_decay) - (lr / bias_correction1) * (m / denom)",
              "p = p_old * (1 - lr * weight_decay) - lr * (m / denom)"),),
        ("tests/test_precision_aware_optimizer.py::"
         "test_update_equals_float64_adamw_with_moments_rounded_to_their_dtype",)),
    Mutation(
        "fp8-sp-gather-local-scale", "the FP8 all-gather of the sequence-parallel input casts each shard with its own "
        "tensorwise scale (the amax is not all-reduced over tp)",
        (Edit("lightning_megatron/precision/fp8/gemm.py", "sx, inv_x = gemm.scale_and_inverse(_INPUT, x2, fwd, record, shard_group=group)",
              "sx, inv_x = gemm.scale_and_inverse(_INPUT, x2, fwd, record)"),),
        ("tests/test_fp8.py::test_fp8_all_gather_of_the_sequence_parallel_input_equals_the_bf16_gather",)),
    Mutation(
        "fp8-delayed-history-frozen", "the FP8 delayed recipe's batched per-step update leaves existing amax histories "
        "as they were (only the first step's entry is ever written)",
        (Edit("lightning_megatron/precision/fp8/delayed.py", "torch.where(valid, rolled, old).unbind(0)", "torch.where(valid, old, old).unbind(0)"),),
        ("tests/test_fp8.py::test_delayed_end_of_step_costs_the_same_few_ops_for_any_number_of_gemms",
         "tests/test_fp8.py::test_delayed_scaling_uses_the_amax_history")),
    Mutation(
        "end-step-hooks-not-run", "the gradient finaliser no longer runs the end-of-step hooks (FP8's delayed-scaling "
        "amax update among them: the histories never start)",
        (Edit("lightning_megatron/parallel/finalize_grads.py",
              "            hook(num_microbatches if p.pipeline is not None else None)\n", "            pass\n"),),
        ("tests/test_fp8.py::test_the_finaliser_runs_end_step_hooks_and_fp8_scales_move_through_its_hook",)),
    Mutation(
        "fp8-end-step-hook-not-registered", "the FP8 handle installs its records but does not register its amax update "
        "as an end-of-step hook (the delayed recipe scales from the first step's current amaxes forever)",
        (Edit("lightning_megatron/precision/fp8/layers.py",
              "        parallelized.add_end_step_hook(self.end_step)\n", "        pass\n"),),
        ("tests/test_fp8.py::test_the_finaliser_runs_end_step_hooks_and_fp8_scales_move_through_its_hook",)),
    Mutation(
        "fp8-handle-lost-by-a-later-plugin", "a later run on an already parallelised module (validate after fit, a new "
        "MegatronPrecision) does not take the first conversion's FP8 handle: its checkpoints lose the amax histories",
        (Edit("lightning_megatron/parallelize.py", "            fp8.adopt(done.fp8)\n", "            pass\n"),),
        ("tests/test_fp8.py::test_the_plugin_reads_its_handle_from_its_step_also_in_a_later_run",)),
    Mutation(
        "cuda-graph-no-generation", "with enable_cuda_graph the step path no longer starts a graph generation before "
        "each forward (a replay could overwrite the previous micro-batch's memory)",
        (Edit("lightning_megatron/strategy/step_path.py", "            if cuda_graphs:   # one graph generation",
              "            if False:   # one graph generation"),),
        ("tests/test_compile.py::test_cuda_graph_step_path_starts_a_generation_before_every_forward",)),
    Mutation(
        "hf-import-one-key-head", "the Hugging Face import gives every query group key head 0 (GQA grouping lost)",
        (Edit("lightning_megatron/hf/mapping.py", "Rows(k, g * d, (g + 1) * d)", "Rows(k, 0, d)"),),
        ("tests/test_hf.py::test_single_process_round_trip_and_generate",)),
    Mutation(
        "flat-spans-across-gaps", "adjacent views are merged by storage alone: a gap between two views of one buffer "
        "ends up inside a flat span",
        (Edit("lightning_megatron/utils/tensors.py", "if previous is None or previous != (key, offset):",
              "if previous is None or previous[0] != key:"),),
        (FLAT + "test_spans_merge_exactly_the_adjacent_views",)),
    Mutation(
        "flat-runs-ignore-step-counts", "PrecisionAwareAdamW updates adjacent parameters as one run even where their "
        "step counts differ (one bias correction for a parameter that missed a step)",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "cuts = [i for i in range(1, len(members)) if counts[i] != counts[i - 1]]", "cuts = []"),),
        (FLAT + "test_a_group_of_adjacent_parameters_is_one_run",)),
    Mutation(
        "flat-bf16-copies-not-written", "the update over the buffers no longer writes the bf16 compute copies (MainParams "
        "then skips its copy: the model computes with stale weights)",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py", "        param_copy.copy_(p)\n",
              "        pass\n"),),
        (FLAT + "test_optimizer_on_main_params_sees_one_tensor_per_bucket",)),
    Mutation(
        "flat-dp-average-not-divided", "the data-parallel average of a buffer's span (reduced in place) sums without "
        "dividing by the group size",
        (Edit(GRAD_SYNC, "                if average:\n                    bucket[0].div_(size)\n", ""),),
        (FLAT + "test_data_parallel_average_reduces_the_buffer_in_place",)),
    Mutation(
        "progress-bar-reads-the-loss", "ParallelGPTModule logs train_loss with prog_bar=True again (Lightning converts "
        "it to a number at every batch's end: a host wait per step on CUDA)",
        (Edit("lightning_megatron/models/module.py", '        self.log("train_loss", loss)\n',
              '        self.log("train_loss", loss, prog_bar=True)\n'),),
        ("tests/test_host_value.py::test_progress_bar_shows_the_loss_and_loggers_get_the_tensor",)),
    Mutation(
        "attention-backend-ignored", "SelfAttention always uses torch's dispatch, whatever attention_backend says",
        (Edit(GPT, "            return causal_attention(q, k, v, dropout, self.attention_backend)\n",
              '            return causal_attention(q, k, v, dropout, "auto")\n'),),
        ("tests/test_attention_backend.py::test_the_option_is_validated_and_reaches_the_kernel_choice",)),
    Mutation(
        "main-grads-copied-per-parameter", "MainParams copies each first bf16 gradient into its main gradient on its own "
        "(a copy kernel per parameter) instead of one multi-tensor copy per bucket",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py", "                if len(bucket.pending) >= bucket.expecting:\n",
              "                if True:\n"),),
        (FLAT + "test_first_gradients_are_copied_per_bucket_and_accumulate_in_fp32",)),
    Mutation(
        "update-plan-ignores-membership", "PrecisionAwareAdamW uses its previous update plan again when as many "
        "parameters have gradients as then, even if they are other ones",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "        if len(ids) != len(self.members) or any(id(p) not in ids for p in self.members):\n",
              "        if len(ids) != len(self.members):\n"),),
        (FLAT + "test_update_plan_is_kept_while_its_layout_holds_and_rebuilt_when_it_changes",)),
    Mutation(
        "update-plan-ignores-gradient-layout", "PrecisionAwareAdamW uses its previous update plan again without "
        "checking that the gradients are still adjacent views over its runs",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "        return span_starts(grads) == self.grad_starts\n", "        return True\n"),),
        (FLAT + "test_update_plan_is_kept_while_its_layout_holds_and_rebuilt_when_it_changes",)),
    Mutation(
        "update-plan-ignores-swapped-data", "PrecisionAwareAdamW uses its previous update plan again after a "
        "parameter's data was swapped for another tensor (it would update the old one)",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "        return addresses == self.held[1] and all(", "        return all("),),
        (FLAT + "test_update_plan_is_kept_while_its_layout_holds_and_rebuilt_when_it_changes",)),
    Mutation(
        "swiglu-backward-halves-swapped", "SwiGLU's one-pass backward writes the up gradient into the gate half and the "
        "gate gradient into the up half",
        (Edit("lightning_megatron/models/swiglu.py",
              "    return torch.cat([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=-1).to(h.dtype)\n",
              "    return torch.cat([g * gate * s, g * up * s * (1 + gate * (1 - s))], dim=-1).to(h.dtype)\n"),),
        ("tests/test_swiglu.py::test_backward_is_autograds_gradient",
         "tests/test_swiglu.py::test_half_precision_is_computed_in_fp32_and_rounded_once")),
    Mutation(
        "verdict-names-current-gradients", "a device-decided non-finite verdict names the parameter from the gradients "
        "at hand when it is read (the next step's by then), not from the norms sent with it",
        (Edit("lightning_megatron/parallel/nonfinite.py",
              "grad_norms={id(p): v for p, v in zip(pending.params, norms)} if pending.params else None)",
              "grad_norms=None)"),),
        ("tests/test_robustness.py::test_device_decided_verdict_is_read_after_the_next_backward_and_still_names_the_"
         "gradient",)),
    Mutation(
        "verdict-read-at-step-start", "the previous step's device-decided verdict is read at the optimizer step's start "
        "again (the host waits for the GPU before queueing the next forward)",
        (Edit("lightning_megatron/strategy/gradients.py", "        if guard is not None:\n            if self._skips_unlogged:",
              "        if guard is not None:\n            self.settle_non_finite()\n            if self._skips_unlogged:"),),
        ("tests/test_robustness.py::test_device_decided_verdict_is_read_after_the_next_backward_and_still_names_the_"
         "gradient",)),
    Mutation(
        "direct-step-updates-the-bf16-copies", "a step that keeps its bf16 gradients steps what the parameters hold "
        "(the bf16 compute copies) instead of the fp32 main parameters",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "        return local_tensor(self._main_param(p) if self._main_param is not None else p)\n",
              "        return local_tensor(p)\n"),),
        ("tests/test_main_grad.py::test_a_step_nothing_accumulates_keeps_its_bf16_gradients_with_the_same_result",)),
    Mutation(
        "run-optimizer-not-attached", "the run shards the optimizers but does not attach the parameter buffer's "
        "post-step hook (PrecisionAwareAdamW then steps the bf16 copies, not the fp32 main parameters)",
        (Edit("lightning_megatron/run/parallel_run.py", "                main_params.attach(optimizer)\n",
              "                pass\n"),),
        ("tests/test_main_grad.py::test_a_step_nothing_accumulates_keeps_its_bf16_gradients_with_the_same_result",)),
    Mutation(
        "run-start-step-not-armed", "the run's start_step leaves the buffer's reductions unarmed: every bucket waits "
        "for finalize instead of starting inside the backward (no overlap, same numbers)",
        (Edit("lightning_megatron/run/parallel_run.py", "        if num_microbatches is not None:\n",
              "        if False:\n"),),
        ("tests/test_parallel_run.py::test_plain_loop_over_the_run_matches_one_process",)),
    Mutation(
        "direct-step-despite-a-reduction", "a step keeps its bf16 gradients although the finaliser averages them over "
        "data parallel (the reduction would then run in bf16)",
        (Edit("lightning_megatron/parallel/finalize_grads.py",
              "        return (mesh.size(\"dp_cp\") > 1 or self.fsdp is not None or p.pipeline is not None\n",
              "        return (self.fsdp is not None or p.pipeline is not None\n"),
         # the buffer refuses a direct step while it owns a data-parallel reduction, whatever the caller says
         Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "        self.direct = direct and self._optimizer_steps_main and self._reduce is None\n",
              "        self.direct = direct and self._optimizer_steps_main\n")),
        ("tests/test_main_grad.py::test_layouts_that_reduce_gradients_keep_fp32_main_gradients",)),
    Mutation(
        "fc1-grad-amax-handed-over-and-dropped", "linear_fc1's GEMM leaves its output gradient's amax to SwiGLU's "
        "backward, which does not record it",
        (Edit("lightning_megatron/precision/fp8/gemm.py",
              "        if self._producer_records():\n            self._record(_GRAD, amax)\n",
              "        if self._producer_records():\n            pass\n"),),
        ("tests/test_fp8.py::test_swiglu_hands_linear_fc1_its_output_gradient_amax",)),
    Mutation(
        "fp8-weight-gradient-rounded-to-bf16", "the FP8 weight-gradient GEMM of fp32 weights writes bf16 (rounded), "
        "then casts to fp32",
        (Edit("lightning_megatron/precision/fp8/gemm.py",
              "gq.t().contiguous(), _col_major(xq), inv_g, inv_x), ctx.w_dtype)",
              "gq.t().contiguous(), _col_major(xq), inv_g, inv_x), ctx.out_dtype)"),),
        ("tests/test_fp8.py::test_weight_gradient_leaves_the_gemm_in_the_weights_dtype",)),
    Mutation(
        "max-abs-drops-the-order", "the per-tensor max-abs pass returns its values in another order than the tensors'",
        (Edit("lightning_megatron/utils/max_abs.py",
              "            return torch.stack([v.float() for v in values])\n",
              "            return torch.stack([v.float() for v in values][::-1])\n"),),
        ("tests/test_max_abs.py::test_each_tensors_largest_absolute_value_in_order",
         "tests/test_max_abs.py::test_guards_per_gradient_values_name_the_parameters_in_order")),
    Mutation(
        "remainder-rounds-ties-to-even", "the bf16 half of a main parameter held as remainder is rounded to even at "
        "ties, whose remainder (2**15) an int16 cannot hold",
        (Edit("lightning_megatron/optimizer/param_remainders.py",
              "    high = torch.bitwise_right_shift(bits + 32768, 16)\n",
              "    high = torch.bitwise_right_shift(bits + 32767 + (torch.bitwise_right_shift(bits, 16) & 1), 16)\n"),),
        ("tests/test_param_remainders.py::test_split_and_join_are_exact_inverses",)),
    Mutation(
        "update-drops-the-remainder", "the update over bf16 copies and remainders writes the bf16 half only",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "        remainder.copy_(low)\n", "        pass\n"),),
        ("tests/test_param_remainders.py::test_twenty_steps_over_the_halves_keep_the_fp32_main_parameters_bit_for_bit",)),
    Mutation(
        "main-view-writes-not-split-back", "with remainders, what the main view wrote (a loaded checkpoint, another "
        "optimizer) is dropped instead of split into the two halves",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "                if copy:\n                    high, low = split_fp32(bucket.main)\n",
              "                if False:\n                    high, low = split_fp32(bucket.main)\n"),),
        ("tests/test_param_remainders.py::test_main_view_writes_are_split_back",
         "tests/test_main_grad.py::test_remainders_train_as_fp32_main_parameters_do")),
    Mutation(
        "update-plan-swaps-the-halves", "with remainders, the update plan takes the remainders as the parameters' "
        "column and the bf16 copies as the extra one",
        (Edit("lightning_megatron/optimizer/precision_aware_adamw.py",
              "        params, extra = (copies, stepped) if held_in_halves else (stepped, copies)\n",
              "        params, extra = (stepped, copies) if held_in_halves else (stepped, copies)\n"),),
        ("tests/test_param_remainders.py::test_twenty_steps_over_the_halves_keep_the_fp32_main_parameters_bit_for_bit",
         "tests/test_main_grad.py::test_remainders_train_as_fp32_main_parameters_do")),
    Mutation(
        "layers-compiled-without-their-cuda-graphs", "enable_cuda_graph=True compiles the layers with the library's "
        "options but without triton.cudagraphs (what mode=\"reduce-overhead\" set before the options replaced it)",
        (Edit("lightning_megatron/parallel/compile.py",
              "        options[\"triton.cudagraphs\"] = True\n",
              "        options[\"triton.cudagraphs\"] = False\n"),),
        ("tests/test_compile.py::test_enable_cuda_graph_compiles_the_layers_in_reduce_overhead_mode",)),
    Mutation(
        "fp8-weight-quantised-again-with-another-scale", "the backward quantises a bf16 weight again with a scale "
        "other than its forward's",
        (Edit("lightning_megatron/precision/fp8/gemm.py",
              "    wq = quantize(w, sw, gemm.config.forward_dtype) if ctx.requantize else w\n",
              "    wq = quantize(w, sw * 2, gemm.config.forward_dtype) if ctx.requantize else w\n"),),
        ("tests/test_fp8.py::test_bf16_weights_are_quantised_again_in_the_backward_not_held_in_fp8",)),
    Mutation(
        "fp8-copy-of-bf16-weight-held-to-the-backward", "every layer's FP8 copy of its bf16 weight is kept from the "
        "forward to the backward",
        (Edit("lightning_megatron/precision/fp8/gemm.py",
              "    ctx.requantize = weight.element_size() <= 2\n", "    ctx.requantize = False\n"),),
        ("tests/test_fp8.py::test_bf16_weights_are_quantised_again_in_the_backward_not_held_in_fp8",)),
    Mutation(
        "main-grads-not-divided-by-the-microbatch-count", "under a pipeline the loss is not divided by the "
        "micro-batch count and the schedule divides p.grad instead (which fp32 main gradients never pass through)",
        (Edit(STEP, "            return fns.scale_loss(loss_sum * dp / counts[index] / m)\n",
              "            return fns.scale_loss(loss_sum * dp / counts[index])\n"),
         Edit("lightning_megatron/parallel/pipeline.py",
              "            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)\n",
              "            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)\n"),
         Edit("lightning_megatron/parallel/pipeline.py",
              "        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)\n",
              "        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)\n")),
        (recipe("bf16p", "pp2-1f1b-m4"), recipe("bf16p", "pp2-vp2-interleaved"))),
    Mutation(
        "buffer-replicas-not-broadcast", "the data-parallel replicas are not made equal when fitting starts (torch "
        "DDP's broadcast at wrap time, which the buffer replaced)",
        (Edit("lightning_megatron/run/model_setup.py",
              "    parallelized.main_params.broadcast_replicas(lambda bucket: _bucket_group(mesh, bucket))\n",
              "    pass\n"),),
        ("tests/test_param_buffer.py::test_replicas_start_equal_from_the_first_rank",)),
    Mutation(
        "scattered-runs-not-zeroed", "after the reduce-scatter each rank keeps its own sums outside its shard's run, "
        "and the clip norm counts them",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "                grad[:lo].zero_()\n                grad[hi:].zero_()\n",
              "                pass\n"),),
        ("tests/test_param_buffer.py::test_distributed_optimizer_reduce_scatters_each_bucket_into_the_shards",
         sharp("dp2-distopt-clip"))),
    Mutation(
        "distributed-optimizer-all-reduces", "under the distributed optimizer with reduce_scatter=True (NCCL's "
        "default) each bucket is all-reduced whole (twice a reduce-scatter's traffic) and the shard keeps its run",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "        if shard is not None and shard.size > 1 and scatter:\n",
              "        if False:\n"),),
        ("tests/test_param_buffer.py::test_distributed_optimizer_reduce_scatters_each_bucket_into_the_shards",)),
    Mutation(
        "scattered-run-not-copied", "the reduce-scattered run stays beside the bucket: the main gradients keep this "
        "rank's own unreduced sums",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "                flat[lo:hi].copy_(bucket.scattered)\n",
              "                pass\n"),),
        ("tests/test_param_buffer.py::test_distributed_optimizer_reduce_scatters_each_bucket_into_the_shards",)),
    Mutation(
        "compiled-module-not-adopted", "a module passed through torch.compile keeps its whole steps compiled (dynamo "
        "traces the step path and fails)",
        (Edit("lightning_megatron/strategy/megatron_strategy.py",
              "        adopt_compiled_module(model, self.parallel_config)\n",
              "        pass\n"),),
        ("tests/test_compile.py::test_a_module_passed_through_torch_compile_trains_with_its_layers_compiled",)),
    Mutation(
        "script-launcher-with-lightnings-observer", "under popen the launching rank keeps Lightning's script launcher, "
        "whose child observer SIGKILLs the job when a rank exits with the requeue code",
        (Edit("lightning_megatron/strategy/megatron_strategy.py",
              "            self._launcher = MegatronScriptLauncher(self.cluster_environment, self.num_processes, "
              "self.num_nodes)\n",
              "            pass\n"),),
        ("tests/test_long_runs.py::test_the_script_launcher_lets_a_requeue_exit_go_and_ends_the_job_on_a_failure",)),
    Mutation(
        "requeue-exit-counted-as-failure", "the launching rank's watcher ends the job when a rank exits with the "
        "requeue code of an exit-signal checkpoint",
        (Edit("lightning_megatron/strategy/launcher.py",
              "p.poll() not in (None, 0, REQUEUE_EXIT_CODE)]",
              "p.poll() not in (None, 0)]"),),
        ("tests/test_long_runs.py::test_the_script_launcher_lets_a_requeue_exit_go_and_ends_the_job_on_a_failure",)),
    Mutation(
        "parallelize-module-not-callable", "lightning_megatron.parallelize stays a plain module: after the strategy's "
        "import, `from lightning_megatron import parallelize` gives a module that cannot be called",
        (Edit("lightning_megatron/parallelize.py",
              "sys.modules[__name__].__class__ = _CallableModule\n",
              "pass\n"),),
        ("tests/test_package.py::test_parallelize_parallelises_whatever_was_imported_first",)),
    Mutation(
        "refit-finaliser-without-fsdp", "a second fit under FSDP rebuilds the gradient finaliser without the FSDP "
        "units, so it clips by this rank's shard",
        (Edit("lightning_megatron/run/parallel_run.py",
              "        self.finalizer = GradientFinalizer(self.parallelized, self.mesh, self.fsdp)   # a later fit",
              "        self.finalizer = GradientFinalizer(self.parallelized, self.mesh)   # a later fit"),),
        ("tests/test_fsdp.py::test_a_second_fit_under_fsdp_clips_by_the_whole_norm",)),
    Mutation(
        "scattered-norm-not-summed-over-dp", "the clip norm of reduce-scattered gradients counts this rank's runs only",
        (Edit("lightning_megatron/parallel/finalize_grads.py",
              "        scattered = main is not None and main.scatters ",
              "        scattered = False and main.scatters "),),
        (sharp("dp2-distopt-clip"), sharp("ep2xdp2-distopt-clip"))),
    Mutation(
        "tied-embedding-shares-a-bucket", "the tied word embedding and its last-stage copy sit at other offsets of "
        "other buckets, so their reduce-scattered runs do not line up when the stages sum them",
        (Edit("lightning_megatron/parallelize.py",
              "                                          own_buckets=[w for w in tied if w is not None])",
              "                                          own_buckets=[])"),),
        (sharp("pp2xdp2-distopt-tied-clip"),)),
    Mutation(
        "fp32-gradients-not-views-of-the-buffer", "parameters in their own dtype keep the autograd gradient on p.grad "
        "after their bucket's copy, apart from the buffer that is reduced",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "                if p.grad is grad:\n                    p.grad = self._grads[id(p)]\n",
              "                if False:\n                    p.grad = self._grads[id(p)]\n"),),
        ("tests/test_param_buffer.py::test_fp32_gradients_are_views_of_the_buffer_and_every_parameter_lives_in_it",)),
    Mutation(
        "weight-gradient-route-skipped", "the zero-bubble schedules' separate weight-gradient pass is not handed to "
        "the buffer's gradients",
        (Edit("lightning_megatron/parallel/pipeline.py",
              "            with sink(params):\n                backward_weight(bwd_chunk_id, last_backward=last_backward)\n",
              "            backward_weight(bwd_chunk_id, last_backward=last_backward)\n"),),
        (recipe("bf16p", "pp2-zbv"), recipe("bf16p-rem", "pp2-vp2-interleaved-zero-bubble"))),
    Mutation(
        "imported-weights-written-before-the-main-parameters", "the Hugging Face loader writes the bf16 copies in "
        "the compute view, and the first optimizer step writes the old main parameters back over them",
        (Edit("lightning_megatron/hf/convert.py",
              "    with _main_parameters_view(target, model):\n        _copy_hf_tensors(model, builders)\n",
              "    _copy_hf_tensors(model, builders)\n"),),
        ("tests/test_hf.py::test_import_with_bf16_parameters_survives_the_optimizer_steps",)),
    Mutation(
        "loaded-bf16-copies-not-adopted", "load_state_dict in the compute view writes only the bf16 copies",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "        if not self.in_main_view and not self.keeps_dtype:\n            self.adopt_compute_copies(",
              "        if False:\n            self.adopt_compute_copies("),),
        ("tests/test_hf.py::test_load_state_dict_with_bf16_parameters_survives_the_optimizer_steps",)),
    Mutation(
        "gathered-main-parameters-not-copied-to-bf16", "with bf16 parameters the distributed optimizer's overlapped "
        "broadcast writes the fp32 main parameters but the bf16 copies of other ranks' shards stay stale",
        (Edit("lightning_megatron/run/model_setup.py",
              "after_wait=main.adopt_broadcast if main is not None else None)", "after_wait=None)"),),
        (SHARDS + "test_sharded_step_equals_the_unsharded_step_bit_for_bit[rmsprop-fallback-param-gather]",)),
    Mutation(
        "bf16-buffers-not-gathered", "the distributed optimizer over the bf16 parameters' buffers steps its shard but "
        "never all-gathers the bf16 buffers: the other ranks' shards stay stale",
        (Edit("lightning_megatron/parallel/param_buffer/optimizer.py",
              "            if shard.size == 1:\n                continue\n            mine = bucket.compute",
              "            if shard.size >= 1:\n                continue\n            mine = bucket.compute"),),
        (SHARDS + "test_sharded_step_equals_the_unsharded_step_bit_for_bit[sgd]",
         SHARDS + "test_sharded_step_equals_the_unsharded_step_bit_for_bit[adamw-remainders-param-gather]")),
    Mutation(
        "bf16-buffers-averaged-twice", "grad_reduce_in_bf16 under the distributed optimizer: a bf16 gradient bucket, "
        "averaged in place before its all-reduce, is divided by the group's size again after it",
        (Edit("lightning_megatron/parallel/param_buffer/buffer.py",
              "            elif reduce.reduce_dtype is None:   # else divided before the sum (_launch)\n",
              "            else:\n"),),
        (SHARDS + "test_sharded_step_equals_the_unsharded_step_bit_for_bit[sgd-bf16-reduce]",)),
    Mutation(
        "shard-main-not-written-to-bf16", "the stepped fp32 main-parameter shard is not written into the bf16 copies "
        "(the next forward runs on the old weights)",
        (Edit("lightning_megatron/parallel/param_buffer/optimizer.py",
              "            if bucket.main_shard is not None:\n                self.main_params.write_shard(bucket)",
              "            if bucket.main_shard is None:\n                self.main_params.write_shard(bucket)"),),
        (SHARDS + "test_sharded_step_equals_the_unsharded_step_bit_for_bit[adamw]",)),
    Mutation(
        "planner-main-params-whole", "the planner counts whole fp32 main parameters on every rank under the "
        "distributed optimizer with bf16 parameters",
        (Edit("lightning_megatron/planner/memory.py",
              "        params = BF16_BYTES * padded + main_bytes * length\n",
              "        params = BF16_BYTES * padded + main_bytes * n\n"),),
        ("tests/test_planner_memory.py::test_planner_bytes_equal_what_each_rank_allocates"
         "[tp2sp-dp2-distopt-bf16-params]",)),
    Mutation(
        "planner-experts-sharded-over-dp", "the planner's distributed-optimizer bytes split the routed experts' "
        "states over dp x cp instead of expert data parallelism",
        (Edit("lightning_megatron/planner/memory.py",
              "    runs = [bucket_runs(dense, dp_cp, dp_rank), bucket_runs(expert, edp, edp_rank)]\n",
              "    runs = [bucket_runs(dense, dp_cp, dp_rank), bucket_runs(expert, dp_cp, edp_rank)]\n"),),
        ("tests/test_dry_run.py::test_reference_rows_every_rank_kind_trains_and_holds_what_the_planner_counts"
         "[mixtral_8x7b-64]",)),
    Mutation(
        "dry-run-stage-ignores-sequence-parallel", "a dry run's pipeline stages take the whole sequence between "
        "stages under sequence parallelism (static shapes not cut over tp)",
        (Edit("lightning_megatron/parallel/pipeline.py",
              "    s_hidden = s // module.tp_size if getattr(model, \"sequence_parallel\", False) else s\n",
              "    s_hidden = s\n"),),
        ("tests/test_dry_run.py::test_dry_run_ranks_hold_what_real_gloo_ranks_hold[tp2sp-pp2]",)),
    Mutation(
        "packed-documents-ignored", "document_attention masks only causally: a packed row's documents see each other",
        (Edit("lightning_megatron/models/attention.py", "    mask = document_causal_mask(document_ids, document_ids)\n",
              "    mask = document_causal_mask(document_ids * 0, document_ids * 0)\n"),),
        (PACKED + "test_packed_row_equals_each_document_alone",
         PACKED + "test_changing_one_document_leaves_the_others_exactly")),
    Mutation(
        "cp-documents-ignored", "context_parallel_attention drops the document ids (plain causal attention over the "
        "CP group)",
        (Edit(CP_INIT, "        global_ids = zigzag_gather(document_ids, group, dim=1) if cp > 1 else document_ids\n",
              "        global_ids = None\n"),),
        (PACKED + "test_layout_matches_single_process[cp2-p2p]",
         "tests/test_context_parallel_attention.py::test_document_masked_matches_full_attention_and_is_exact")),
    Mutation(
        "ring-key-documents-of-own-rank", "the ring masks each K/V block with the query rank's document ids instead "
        "of the block's own",
        (Edit("lightning_megatron/parallel/context_parallel/ring.py",
              "                                            kernel, _doc_mask(documents, rank, src, rows, cols))",
              "                                            kernel, _doc_mask(documents, rank, rank, rows, cols))"),),
        ("tests/test_context_parallel_attention.py::test_document_masked_matches_full_attention_and_is_exact",)),
    Mutation(
        "pp-metadata-forward-counted", "a pipeline stage counts torch's shape-inference forward as micro-batch 0's: "
        "every micro-batch of the first step gets the next one's position and document ids",
        (Edit("lightning_megatron/parallel/pipeline.py",
              "                self._uncounted_metadata_forward(stage, self.stage_modules.index(module))\n", ""),),
        (PACKED + "test_layout_matches_single_process[pp2-recompute-full]",)),
    Mutation(
        "pp-documents-dropped", "the pipeline step does not hand the micro-batches' document ids to the stages",
        (Edit(STEP, "                            [mb.get(\"document_ids\") for mb in microbatches])",
              "                            None)"),),
        (PACKED + "test_layout_matches_single_process[pp2-recompute-full]",)),
    Mutation(
        "eod-opens-its-own-document", "document_ids_after_eod puts the eod token into the next document (Megatron: it "
        "closes its own)",
        (Edit("lightning_megatron/data/gpt_dataset.py", "    return eod.cumsum(-1) - eod\n",
              "    return eod.cumsum(-1)\n"),),
        ("tests/test_data_megatron.py::test_gpt_dataset_reset_position_ids_and_attention_mask",)),
    Mutation(
        "spawn-launcher-never-restarts", "MegatronStrategy(start_method='spawn', max_restarts=N) gives up at the "
        "first failed rank",
        (Edit("lightning_megatron/strategy/launcher.py", "                if self.restarts >= self.max_restarts:\n",
              "                if True:\n"),),
        (LONG + "test_the_strategys_own_launcher_restarts_a_killed_rank_and_ends_bit_exact",)),
    Mutation(
        "restart-attempts-share-keys", "under torchrun's shared agent store the process group starts without a "
        "prefix of its restart attempt (a restarted rank reads the dead attempt's gloo addresses)",
        (Edit("lightning_megatron/strategy/launcher.py",
              '    return dist.PrefixStore(f"/lightning_megatron/{run}/attempt_{attempt}/", store)\n',
              '    return dist.PrefixStore(f"/lightning_megatron/{run}/", store)\n'),),
        (LONG + "test_restart_attempts_start_on_stores_of_their_own",)),
    Mutation(
        "auto-resume-takes-the-oldest", "auto_resume loads the oldest complete checkpoint instead of the newest",
        (Edit("lightning_megatron/checkpoint/latest.py", "    return max(found)[1] if found else None\n",
              "    return min(found)[1] if found else None\n"),),
        (LONG + "test_latest_checkpoint_is_the_newest_complete_one",
         LONG + "test_auto_resume_after_two_failures_is_bit_exact_under_every_layout")),
    Mutation(
        "exit-signal-recorded-but-not-acted-on", "exit_signal_handler records SIGTERM but no end-of-step save runs: "
        "the job trains on and the progress since the last interval checkpoint is lost at the next kill",
        (Edit("lightning_megatron/strategy/megatron_strategy.py",
              "                trainer.callbacks.append(saver)\n", "                pass\n"),),
        (LONG + "test_exit_signal_saves_every_rank_and_exits_requeue_then_resumes_bit_exact",)),
    Mutation(
        "straggler-counts-waiting-as-busy", "StragglerMonitor's sampler does not tell waiting in a collective from "
        "work (every rank of a synchronous job then looks as slow as the slowest)",
        (Edit("lightning_megatron/callbacks/straggler.py", "                    waiting = True\n",
              "                    waiting = False\n"),),
        (LONG + "test_straggler_monitor_names_the_slow_rank_and_no_other",)),
    Mutation(
        "rerun-drops-the-step", "check_for_nan_in_loss_and_grad='rerun' drops a non-finite step instead of "
        "replaying it",
        (Edit("lightning_megatron/strategy/gradients.py",
              "            result = self._replay(optimizer, closure_then_finalize, model, skipped, rng, **kwargs)\n",
              "            self._count_skipped(skipped)\n            return None\n"),),
        (LONG + "test_rerun_replays_a_non_finite_step_and_stops_only_when_it_repeats",)),
    Mutation(
        "loss-curve-svg-y-flipped", "the loss curve's SVG maps the loss upwards in SVG coordinates (a falling loss "
        "drawn rising)",
        (Edit("lightning_megatron/callbacks/svg_plot.py",
              "        return min(max(box.bottom - (y - y0) / (y1 - y0) * (box.bottom - box.top), -_FAR), _FAR)\n",
              "        return min(max(box.top + (y - y0) / (y1 - y0) * (box.bottom - box.top), -_FAR), _FAR)\n"),),
        ("tests/test_loss_curve.py::test_the_series_follow_the_data_through_the_documented_mapping",
         "tests/test_loss_curve.py::test_loss_curve_writes_csv_and_svg_without_matplotlib")),
    Mutation(
        "planner-help-table-misaligned", "the planner's --help prints its sharding table's descriptions at the "
        "end of each key instead of in one column",
        (Edit("lightning_megatron/planner/cli.py", "        lines.append(f\"  {key:<{column - 4}}  {wrapped[0]}\")\n",
              "        lines.append(f\"  {key}  {wrapped[0]}\")\n"),),
        ("tests/test_planner.py::test_help_is_plain_text_with_aligned_tables[planner]",)),
)


# ------------------------------------------------------------------------------------------------ the copy
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def checkout_files() -> List[str]:
    """Tracked files and untracked, not ignored ones (relative paths) that exist in the working tree."""
    try:
        out = git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"{ROOT} must be a git checkout with git on PATH (the copy is made from git ls-files): "
                           f"{e}") from e
    files = sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})
    if not files:
        raise RuntimeError(f"git ls-files listed no files under {ROOT}")
    return files


def make_copy(files: Sequence[str], dest: Path) -> Path:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target, follow_symlinks=False)
    return dest


def check_edits(root: Path, edits: Sequence[Edit]) -> None:
    """Every ``old`` text occurs exactly once in its file under ``root`` (raises RuntimeError otherwise)."""
    for e in edits:
        path = root / e.path
        if not path.is_file():
            raise RuntimeError(f"mutation target {e.path} does not exist under {root}")
        n = path.read_text(encoding="utf-8").count(e.old)
        if n != 1:
            raise RuntimeError(f"mutation target text occurs {n} times (must be exactly 1) in {e.path}; update the "
                               f"mutation in tests/mutations.py to the current source:\n{e.old}")


def apply_edits(copy: Path, edits: Sequence[Edit]) -> None:
    check_edits(copy, edits)
    for e in edits:
        path = (copy / e.path).resolve()
        if copy.resolve() not in path.parents:
            raise RuntimeError(f"refusing to edit {path}: outside the temporary copy {copy}")
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(e.old, e.new), encoding="utf-8")


def child_env(copy: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy)
    return env


def check_imports_resolve_in(copy: Path) -> None:
    """``lightning_megatron`` and ``tests`` must be found in ``copy`` (not in an installed or other checkout)."""
    code = ("import importlib.util as u; "
            "print(u.find_spec('lightning_megatron').origin); print(u.find_spec('tests').origin)")
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=child_env(copy), capture_output=True,
                         text=True, check=True).stdout.split()
    for origin in out:
        if copy.resolve() not in Path(origin).resolve().parents:
            raise RuntimeError(f"{origin} is imported instead of the copy in {copy}: an installed package shadows "
                               f"PYTHONPATH; run with an environment where the checkout is not installed "
                               f"non-editable")


# ------------------------------------------------------------------------------------------------ pytest runs
@dataclass
class RunResult:
    rc: int
    passed: List[str]
    failed: List[str]
    errors: List[str]
    skipped: List[str]
    seconds: float
    log: Path


def node_id(case: ET.Element) -> str:
    module, name = case.get("classname", ""), case.get("name", "")
    return f"{module.replace('.', '/')}.py::{name}" if module else name   # no class name: a collection error


def run_pytest(copy: Path, tests: Sequence[str], logdir: Path, label: str, timeout: float) -> RunResult:
    report, log = logdir / f"{label}.xml", logdir / f"{label}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--junitxml={report}", *tests]
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, cwd=copy, env=child_env(copy), stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -1
            out.write(f"\n[mutations] pytest killed after {timeout:.0f} s\n")
    seconds = time.monotonic() - start
    res = RunResult(rc, [], [], [], [], seconds, log)
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            bucket = (res.failed if "failure" in kinds else res.errors if "error" in kinds
                      else res.skipped if "skipped" in kinds else res.passed)
            bucket.append(node_id(case))
    return res


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ------------------------------------------------------------------------------------------------ main
def short(test_id: str) -> str:
    return test_id.replace("tests/", "", 1).replace("test_layout_matches_float64_reference", "sharp")


def print_table(rows: List[Tuple[str, str, str, List[str]]]) -> None:
    heads = ("mutation", "tests run", "outcome", "failing test ids")
    w0 = max(len(heads[0]), *(len(r[0]) for r in rows))
    w1 = max(len(heads[1]), *(len(r[1]) for r in rows))
    w2 = max(len(heads[2]), *(len(r[2]) for r in rows))
    line = f"{heads[0]:<{w0}}  {heads[1]:<{w1}}  {heads[2]:<{w2}}  {heads[3]}"
    print(line)
    print("-" * len(line))
    for name, ran, outcome, failing in rows:
        first, *rest = failing or ["-"]
        print(f"{name:<{w0}}  {ran:<{w1}}  {outcome:<{w2}}  {short(first)}")
        for f in rest:
            print(f"{'':<{w0}}  {'':<{w1}}  {'':<{w2}}  {short(f)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS], metavar="NAME",
                        help="run only this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument("--with-fp32", action="store_true",
                        help="also run the fp32 AdamW parity cases listed for the gradient-scale mutations "
                             "(informative: the unclipped ones catch them narrowly, the clipped one does not)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies and pytest logs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per pytest run")
    args = parser.parse_args(argv)

    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.bug}")
            for e in m.edits:
                print(f"  edit {e.path}: {e.old.strip()!r} -> {e.new.strip()!r}")
            for t in m.tests:
                print(f"  test {t}")
            for t in m.fp32_tests:
                print(f"  fp32 {t} (--with-fp32)")
        return 0

    files = checkout_files()
    for m in chosen:   # fail before any run if a target moved
        check_edits(ROOT, m.edits)
    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    commit = git("rev-parse", "--short=12", "HEAD").strip() + (" (+ uncommitted changes)" if dirty else "")
    load = os.getloadavg()
    print(f"mutation check of {ROOT} at {commit}; {len(files)} files copied per run")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at start", flush=True)

    def selection(m: Mutation) -> Tuple[str, ...]:
        return m.tests + (m.fp32_tests if args.with_fp32 else ())

    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="lm-mutations-"))
    logs = tmp / "logs"
    logs.mkdir()
    rows: List[Tuple[str, str, str, List[str]]] = []
    survived = 0
    try:
        union = list(dict.fromkeys(t for m in chosen for t in selection(m)))
        base = make_copy(files, tmp / "baseline")
        check_imports_resolve_in(base)
        res = run_pytest(base, union, logs, "baseline", args.timeout)
        print(f"baseline: {len(res.passed)} passed, {len(res.failed)} failed, {len(res.errors)} errors, "
              f"{len(res.skipped)} skipped, exit {res.rc} ({res.seconds:.0f} s)", flush=True)
        if res.rc != 0 or not res.passed or res.failed or res.errors or res.skipped:
            print(tail(res.log))
            print(f"\nthe unmutated copy does not pass the selection (log: {res.log}); a catch would mean nothing. "
                  f"Fix the tree or the environment first.")
            args.keep = True
            return 2
        rows.append(("(none: baseline)", f"{len(res.passed)} test{'s' * (len(res.passed) != 1)}, {res.seconds:.0f} s",
                     "passed", []))
        if not args.keep:
            shutil.rmtree(base)

        for m in chosen:
            copy = make_copy(files, tmp / m.name)
            apply_edits(copy, m.edits)
            check_imports_resolve_in(copy)
            res = run_pytest(copy, selection(m), logs, m.name, args.timeout)
            total = len(res.passed) + len(res.failed) + len(res.errors) + len(res.skipped)
            if res.rc == 1 and res.failed:
                outcome = "caught"
            elif res.rc == 0:
                outcome, survived = "SURVIVED", survived + 1
            else:
                outcome, survived = f"BROKEN (exit {res.rc})", survived + 1
            ran = f"{total} test{'s' * (total != 1)}, {res.seconds:.0f} s"
            rows.append((m.name, ran, outcome, res.failed + [f"{e} (error)" for e in res.errors]))
            print(f"{m.name}: {outcome}, {len(res.failed)}/{total} failed ({res.seconds:.0f} s)", flush=True)
            if outcome != "caught":
                print(tail(res.log))
            if not args.keep:
                shutil.rmtree(copy)
    finally:
        if args.keep:
            print(f"temporary copies and logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    load = os.getloadavg()
    print(f"\ntotal {time.monotonic() - start:.0f} s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at end\n")
    print_table(rows)
    print()
    for m in chosen:
        print(f"{m.name}: {m.bug}")
    if survived:
        print(f"\n{survived} mutation(s) not caught")
        return 1
    print(f"\nall {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
