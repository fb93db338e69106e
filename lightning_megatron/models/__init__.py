"""Plain GPT / LLaMA models (no parallelism inside) and the LightningModule around them."""
from lightning_megatron.models.config import GPTConfig
from lightning_megatron.models.gpt import GPTModel

__all__ = ["GPTConfig", "GPTModel"]
