"""Plain GPT / LLaMA models (no parallelism inside) and the LightningModule around them."""
from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS = {
    "GPTConfig": "lightning_megatron.models.config",
    "GPTModel": "lightning_megatron.models.gpt",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
