"""The device tables of the multi-tensor Triton kernels (:mod:`lightning_megatron.utils.chunk_tables`), on the CPU:
which chunk belongs to which tensor and where it starts, the address tables kept and dropped, and the alignment rule
that lets a kernel load 16 bytes at a time. The kernels themselves run in the GPU tier."""
from __future__ import annotations

import torch

from lightning_megatron.optimizer.adamw_kernel import MultiTensorAdamW
from lightning_megatron.utils.chunk_tables import ChunkTables, aligned

CPU = torch.device("cpu")


def test_every_element_belongs_to_exactly_one_chunk_of_its_tensor():
    tables = ChunkTables(chunk=8)
    numels = [20, 8, 1, 17]
    sizes, tensor, start = tables.layout(CPU, numels)
    assert sizes.tolist() == numels
    assert tensor.dtype == torch.int32 and start.dtype == torch.int64
    covered = {}
    for t, s in zip(tensor.tolist(), start.tolist()):
        for e in range(s, min(s + 8, numels[t])):
            covered[(t, e)] = covered.get((t, e), 0) + 1
    assert covered == {(t, e): 1 for t, n in enumerate(numels) for e in range(n)}
    assert tensor.tolist() == [0, 0, 0, 1, 2, 3, 3, 3]
    assert tables.layout(CPU, numels)[1] is tensor   # kept per layout


def test_address_tables_are_kept_for_the_last_few_sets():
    tables = ChunkTables(chunk=8, keep=2)
    first = tables.addresses(CPU, [16, 32])
    assert first.tolist() == [16, 32] and first.dtype == torch.int64
    assert tables.addresses(CPU, [16, 32]) is first
    tables.addresses(CPU, [48])
    tables.addresses(CPU, [16, 32])           # used again: the most recent
    tables.addresses(CPU, [64])               # drops [48], the least recently used
    assert tables.addresses(CPU, [16, 32]) is first
    assert list(tables._addresses) == [(CPU, (64,)), (CPU, (16, 32))]


def test_alignment_needs_16_byte_starts_and_counts_of_8():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    assert aligned([buffer[:16], buffer[16:24]])
    assert not aligned([buffer[1:9]])          # starts 2 bytes in
    assert not aligned([buffer[:12]])          # 12 elements
    assert aligned([])


def test_the_one_launch_update_does_not_apply_off_cuda():
    params = [torch.zeros(16)]
    assert not MultiTensorAdamW.applies(params, [torch.zeros(16)], [torch.zeros(16)], [torch.zeros(16)],
                                        torch.ones(()))
