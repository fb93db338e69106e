"""The Lightning face of the library: :class:`MegatronStrategy` (Lightning's hooks, translated into the library's
calls) and its pieces, one concern per module: ``options`` (which keyword goes where), ``step_path`` (the one
forward/backward path of every layout, joining the module's own step hooks to Lightning's loop or the pipeline
schedule), ``lightning_features`` (Lightning features a layout cannot run, refused at setup; SWA's average),
``gradients`` (finish, clip, skip), ``checkpoints`` (full and sharded checkpoint hooks), ``launcher`` (process
launch), ``resilience`` (automatic resume, save on an exit signal), ``registry`` (the ``"megatron"`` strategy names).

The names are imported on first use (PEP 562): importing the package, as the strategy registration does, does not
import Lightning."""
from __future__ import annotations

from typing import Dict, List

from lightning_megatron.utils.lazy import lazy_exports

_EXPORTS: Dict[str, str] = {
    "MegatronStrategy": "lightning_megatron.strategy.megatron_strategy",
    "LAYOUT_OPTIONS": "lightning_megatron.strategy.options",
    "REQUEUE_EXIT_CODE": "lightning_megatron.strategy.resilience",
}
__all__: List[str] = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
