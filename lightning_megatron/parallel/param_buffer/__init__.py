"""The parameter-and-gradient buffer (Megatron's ``ParamAndGradBuffer``): the parameters, their main parameters and
their gradients as views of contiguous per-dtype buckets (:class:`MainParams`), each bucket's data-parallel
reduction, and the distributed optimizer over the buckets' shards (:class:`DistributedOptimizer`)."""
from lightning_megatron.parallel.param_buffer.buffer import (DEFAULT_BUCKET_ELEMENTS, PARAMS_DTYPES, BucketShard,
                                                             MainParams, bucket_layout)
from lightning_megatron.parallel.param_buffer.optimizer import (ELEMENTWISE_OPTIMIZERS, BucketParamGather,
                                                                DistributedOptimizer, WholeStateView, elementwise)

__all__ = ["MainParams", "BucketShard", "PARAMS_DTYPES", "DEFAULT_BUCKET_ELEMENTS", "bucket_layout",
           "DistributedOptimizer", "BucketParamGather", "WholeStateView", "ELEMENTWISE_OPTIMIZERS", "elementwise"]
