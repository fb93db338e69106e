"""The optional packages of Hugging Face interop (``pip install 'lightning-megatron[hf]'``)."""
from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

SAFETENSORS = RequirementCache("safetensors")


def require_safetensors() -> None:
    """Raise ModuleNotFoundError naming the extra when ``safetensors`` is not installed."""
    if not SAFETENSORS:
        raise ModuleNotFoundError(
            "reading and writing Hugging Face checkpoints needs the `safetensors` package: "
            f"pip install 'lightning-megatron[hf]' ({SAFETENSORS.message})")
