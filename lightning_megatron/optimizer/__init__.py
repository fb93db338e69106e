"""Optimizers: Megatron's precision-aware AdamW (:class:`PrecisionAwareAdamW`, moments stored in bf16 or fp32, the
update computed in fp32). Imports torch only: the model layer builds it (``ParallelGPTModule``), the strategy's
non-finite guard reads its device-side skip."""
from lightning_megatron.optimizer.precision_aware_adamw import (OPTIMIZER_STATE_DTYPES, PrecisionAwareAdamW,
                                                                optimizer_state_dtype, optimizer_state_dtype_name)

__all__ = ["PrecisionAwareAdamW", "OPTIMIZER_STATE_DTYPES", "optimizer_state_dtype", "optimizer_state_dtype_name"]
