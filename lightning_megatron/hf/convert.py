"""Load a Hugging Face checkpoint into a model of any layout, and export one back.

:func:`load_hf_weights` fills this rank's parameters of a (possibly tensor / pipeline / expert parallel) ``GPTModel``
reading only what they hold: the pipeline stage's tensors, and of each only the rows / columns / experts of this
rank's shard (safetensors ``get_slice``). No communication. :func:`export_hf` gathers the full model (collective
over the TP, EP and pipeline groups, as checkpoints do) and writes it from global rank 0.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager, Dict, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron.hf.checkpoint import DTYPES, HFCheckpoint, save_hf_checkpoint
from lightning_megatron.hf.config import config_to_hf
from lightning_megatron.hf.mapping import Lazy, PaddedRows, from_hf, to_hf
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.gpt import VOCAB_PARAMS, GPTModel
from lightning_megatron.callbacks.checkpoint_weights import WeightsAtStart
from lightning_megatron.checkpoint.state_dict import full_model_state_dict
from lightning_megatron.contract import parallelized_record
from lightning_megatron.parallel.tensor_parallel.layers import TensorParallelModule
from lightning_megatron.parallel.tensor_parallel.mappings import group_rank, group_size

Target = Union[GPTModel, pl.LightningModule]


def _model_and_pp_group(target: Target) -> Tuple[GPTModel, Any]:
    """The ``GPTModel`` of ``target`` (itself, or a LightningModule's ``model``) and its pipeline group (or None)."""
    if isinstance(target, GPTModel):
        return target, None
    model = getattr(target, "model", None)
    if not isinstance(model, GPTModel):
        raise ValueError(f"{type(target).__name__} holds no GPTModel in .model (build it first: configure_model(), or "
                         "let the Trainer set it up)")
    context = getattr(target, "_parallel", None)
    return model, getattr(context, "pp_group", None)


def _split_read(full: Lazy, box: list, dim: int, stride: int, rank: int, size: int) -> Tensor:
    """Rank ``rank`` of ``size``'s part of ``full[box]`` along ``dim``, the dim cut into ``stride`` blocks first (the
    layout of :func:`lightning_megatron.parallel.tensor_parallel.layers.shard_tensor`)."""
    n = box[dim].stop - box[dim].start
    if n % (stride * size) != 0:
        raise ValueError(f"dimension {dim} of size {n} does not split into {stride} block(s) over {size} ranks")
    block, per = n // stride, n // stride // size
    pieces = []
    for b in range(stride):
        part = list(box)
        start = box[dim].start + b * block + rank * per
        part[dim] = slice(start, start + per)
        pieces.append(full.read(tuple(part)))
    return torch.cat(pieces, dim=dim)


def read_local(module: nn.Module, pname: str, name: str, full: Lazy, local_shape: tuple) -> Tensor:
    """This rank's value of parameter ``pname`` of ``module`` (full name ``name``) from its full value ``full``:
    a TP shard (vocabulary padded), this rank's experts and expert-TP slice, or the whole tensor."""
    box = [slice(0, n) for n in full.shape]
    if isinstance(module, TensorParallelModule) and pname in module._partition:
        dim, stride = module._partition[pname]
        if module._vocab_rows is not None and dim == 0:
            full = PaddedRows(full, module._padded_rows)
            box[0] = slice(0, full.shape[0])
        return _split_read(full, box, dim, stride, module.tp_rank, module.tp_size)
    if all(hasattr(module, a) for a in ("expert_offset", "num_local_experts", "_etp_split")):
        box[0] = slice(module.expert_offset, module.expert_offset + module.num_local_experts)
        dim, stride = module._etp_split(pname)
        etp = getattr(module, "etp_group", None)
        return _split_read(full, box, dim, stride, group_rank(etp), group_size(etp))
    if name in VOCAB_PARAMS and full.shape[0] < local_shape[0]:
        full = PaddedRows(full, local_shape[0])
    return full.read_all()


@torch.no_grad()
def load_hf_weights(target: Target, path: Union[str, "os.PathLike[str]"]) -> None:
    """Fill the parameters of ``target`` (a ``GPTModel`` or a LightningModule holding one in ``.model``, under any
    layout, e.g. after ``MegatronStrategy`` set it up) from the Hugging Face checkpoint directory ``path``.

    Each rank reads only the tensors of its pipeline stage and of each only its shard. The model's config must be
    the checkpoint's (:func:`lightning_megatron.hf.config_from_hf`; fields that do not change shapes, e.g.
    ``seq_length``, may differ). Padded vocabulary rows are set to zero. Buffers (router statistics) are left as
    they are. No communication.

    Raises:
        KeyError: a tensor the model needs is not in the checkpoint.
        ValueError: a tensor's shape does not fit the model (another config).
    """
    model, _ = _model_and_pp_group(target)
    checkpoint = HFCheckpoint(os.fspath(path))
    builders = from_hf(model.config, checkpoint.names, checkpoint.get_slice)
    with _main_parameters_view(target, model):
        _copy_hf_tensors(model, builders)


def _main_parameters_view(target: Target, model: GPTModel) -> ContextManager:
    """With bf16 parameters (``MegatronPrecision(params_dtype=torch.bfloat16)``), the context in which the
    parameters hold their fp32 main values, so that written weights are the main parameters themselves (the bf16
    copies follow on exit) and the first optimizer step does not write the old main parameters back; else none."""
    for holder in (target, model):
        record = parallelized_record(holder)
        if record is not None:
            return record.main_view()
    return contextlib.nullcontext()


def _copy_hf_tensors(model: GPTModel, builders: Dict[str, Any]) -> None:
    for mod_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            if name not in builders:
                raise KeyError(f"parameter {name!r} has no Hugging Face counterpart (a config that transformers' "
                               "Llama / Mistral / Mixtral cannot express)")
            full = builders[name]()
            local = read_local(module, pname, name, full, tuple(param.shape))
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}: the checkpoint gives this rank shape {tuple(local.shape)} (full "
                                 f"{full.shape}), the model holds {tuple(param.shape)}: build the model from the "
                                 "checkpoint's config (lightning_megatron.hf.config_from_hf)")
            param.copy_(local.to(param.dtype))


def export_hf(target: Target, path: Union[str, "os.PathLike[str]"], architecture: Optional[str] = None,
              dtype: Optional[str] = None, max_shard_bytes: Optional[int] = 5 * 2**30) -> None:
    """Write ``target`` (a ``GPTModel`` or a LightningModule holding one, under any layout) as a Hugging Face
    checkpoint directory ``path`` that ``transformers`` loads with ``AutoModelForCausalLM.from_pretrained``:
    safetensors (sharded past ``max_shard_bytes``) and ``config.json`` (:func:`lightning_megatron.hf.config_to_hf`;
    ``architecture`` e.g. ``"MistralForCausalLM"``). ``dtype``: ``"float32"`` / ``"bfloat16"`` / ``"float16"``
    (default: the parameters'). The padded vocabulary rows are left out.

    Collective: every rank calls it; the full model is gathered over the TP, expert and pipeline groups (on every
    rank, as :func:`lightning_megatron.checkpoint.state_dict.full_model_state_dict` does) and global rank 0 writes.
    """
    model, pp_group = _model_and_pp_group(target)
    if dtype is None:
        dtype = {v: k for k, v in DTYPES.items()}.get(next(model.parameters()).dtype, "float32")
    config_to_hf(model.config, architecture, dtype)   # raises on every rank alike, before the collectives
    full = full_model_state_dict(model, pp_group)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        write_hf(full, model.config, path, architecture, dtype, max_shard_bytes)
    if distributed:
        dist.barrier()


def write_hf(state: Dict[str, Tensor], config: GPTConfig, path: Union[str, "os.PathLike[str]"],
             architecture: Optional[str] = None, dtype: str = "float32",
             max_shard_bytes: Optional[int] = 5 * 2**30) -> None:
    """Write a full (tp=1 names, e.g. a checkpoint's) model state ``state`` of ``config`` as a Hugging Face
    checkpoint directory (see :func:`export_hf`). No communication."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
    hf_config = config_to_hf(config, architecture, dtype)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in to_hf(state, config, fused_experts=False).items()}
    save_hf_checkpoint(os.fspath(path), tensors, hf_config, max_shard_bytes)


class HFCheckpointLoader(WeightsAtStart):
    """Loads a Hugging Face checkpoint into the LightningModule's ``GPTModel`` once the strategy has set it up (at
    the start of ``fit`` / ``validate`` / ``test`` / ``predict``, whichever comes first), on every rank, each reading
    its own shard (:func:`load_hf_weights`). Skipped when the Trainer resumes from ``ckpt_path``."""

    def load_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        load_hf_weights(pl_module, self.path)
