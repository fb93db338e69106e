"""The FP8 options (:class:`Float8Config`, Megatron's names, validated) and the formats' constants."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from lightning_megatron.precision.fp8.te import transformer_engine_available

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: largest finite value of each format; both are 0.875 * 2**k (k = 9 and 16)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_FP8_MAX_EXPONENT = {E4M3: 9, E5M2: 16}

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "rowwise", "mxfp8")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
FP8_BACKENDS = ("auto", "te", "torch")
#: cuBLAS FP8 GEMMs need every GEMM dimension to be a multiple of this
GEMM_ALIGNMENT = 16


def _check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")


@dataclass(frozen=True)
class Float8Config:
    """What :func:`convert_to_fp8` converts and how (Megatron's names; every field validated here).

    Attributes:
        fp8_format: ``"e4m3"`` (every GEMM operand in e4m3) or ``"hybrid"`` (e4m3 forward, e5m2 gradients).
        recipe: ``"delayed"``, ``"tensorwise"``, ``"rowwise"`` (torch backend) or ``"mxfp8"`` (Transformer Engine
            on compute capability >= 10.0 only).
        margin: scales leave this many powers of two of headroom above the amax.
        amax_history_len, amax_compute_algo: the delayed recipe's history (``"most_recent"`` or ``"max"``).
        backend: ``"torch"`` (``torch._scaled_mm``) or ``"te"`` (Transformer Engine); ``"auto"`` is resolved by
            :meth:`resolve_backend`.
        first_last_layers_bf16: keep the first ``num_layers_at_start_in_bf16`` and the last
            ``num_layers_at_end_in_bf16`` transformer layers out of FP8 (Megatron's ``--first-last-layers-bf16``).
        sequence_parallel_gather: under sequence parallelism, all-gather the input of a column-parallel layer in
            FP8 (1 byte per element instead of 2) instead of gathering it in bf16 and casting after (the result is
            the same, bit for bit). None (default): with the delayed recipe, whose scale is known before the
            gather; True also with ``"tensorwise"`` (one more all-reduce of the input's amax over tp per layer).
            Torch backend only.
    """

    fp8_format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    backend: str = "auto"
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    sequence_parallel_gather: Optional[bool] = None

    def __post_init__(self) -> None:
        _check_choice("fp8", self.fp8_format, FP8_FORMATS)
        _check_choice("fp8_recipe", self.recipe, FP8_RECIPES + ("blockwise",))
        if self.recipe == "blockwise":
            raise ValueError("fp8_recipe='blockwise' (1x128 / 128x128 blocks) is not supported; use 'tensorwise', "
                             "'rowwise' or 'delayed'")
        _check_choice("fp8_backend", self.backend, FP8_BACKENDS)
        _check_choice("fp8_amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        for name in ("margin", "amax_history_len", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"fp8_{name}={value!r} must be an int" if name in ("margin", "amax_history_len")
                                 else f"{name}={value!r} must be an int")
        if self.margin < 0:
            raise ValueError(f"fp8_margin={self.margin} must be >= 0 (powers of two of headroom)")
        if self.amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len={self.amax_history_len} must be >= 1")
        if self.amax_history_len > 1 and self.recipe != "delayed":
            raise ValueError(f"fp8_amax_history_len={self.amax_history_len} applies to fp8_recipe='delayed' only "
                             f"(fp8_recipe={self.recipe!r} scales from current values); drop it or use 'delayed'")
        if not isinstance(self.first_last_layers_bf16, bool):
            raise ValueError(f"first_last_layers_bf16={self.first_last_layers_bf16!r} must be True or False")
        if self.num_layers_at_start_in_bf16 < 0 or self.num_layers_at_end_in_bf16 < 0:
            raise ValueError(f"num_layers_at_start_in_bf16={self.num_layers_at_start_in_bf16} and "
                             f"num_layers_at_end_in_bf16={self.num_layers_at_end_in_bf16} must be >= 0")
        if self.first_last_layers_bf16 and self.recipe == "delayed":
            raise ValueError("first_last_layers_bf16=True does not work with fp8_recipe='delayed' (as in Megatron: "
                             "\"Delayed scaling does not support first / last layer in BF16\"); use "
                             "fp8_recipe='tensorwise' or 'rowwise'")
        if self.recipe == "mxfp8" and self.backend != "te":
            raise ValueError("fp8_recipe='mxfp8' needs fp8_backend='te' (Transformer Engine) and a GPU with compute "
                             "capability >= 10.0 (Blackwell); the torch backend offers 'tensorwise', 'rowwise' and "
                             "'delayed'")
        if self.sequence_parallel_gather not in (None, True, False):
            raise ValueError(f"fp8_sequence_parallel_gather={self.sequence_parallel_gather!r} must be None (auto), "
                             "True or False")
        if self.sequence_parallel_gather and (self.recipe not in ("delayed", "tensorwise") or self.backend == "te"):
            raise ValueError(f"fp8_sequence_parallel_gather=True with fp8_recipe={self.recipe!r}, "
                             f"fp8_backend={self.backend!r}: the FP8 all-gather of the sequence-parallel input is the "
                             "torch backend's, with one scale per tensor ('delayed' or 'tensorwise'); drop it")
        if self.recipe == "rowwise" and self.backend == "te":
            raise ValueError("fp8_recipe='rowwise' is the torch backend's (fp8_backend='torch'); Transformer Engine "
                             "offers 'delayed', 'tensorwise' (current scaling) and 'mxfp8'")

    @property
    def forward_dtype(self) -> torch.dtype:
        """Format of activations and weights (e4m3)."""
        return E4M3

    @property
    def grad_dtype(self) -> torch.dtype:
        """Format of output gradients: e5m2 under ``"hybrid"``, else e4m3."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    def resolve_backend(self, device: torch.device) -> "Float8Config":
        """This config with ``backend="auto"`` resolved: ``"te"`` on CUDA when ``transformer_engine.pytorch``
        imports (:func:`transformer_engine_available`) and the recipe is one of its own (not ``"rowwise"``), else
        ``"torch"``. Checks that an explicit ``"te"`` can run."""
        backend = self.backend
        if backend == "auto":   # TE's own recipes on CUDA (checked, i.e. imported, only there)
            te = device.type == "cuda" and self.recipe != "rowwise" and transformer_engine_available()
            backend = "te" if te else "torch"
        if backend == "te" and device.type != "cuda":
            raise ValueError(f"fp8_backend='te': Transformer Engine runs on CUDA GPUs only, this run is on "
                             f"{device.type!r}; use fp8_backend='torch' (torch._scaled_mm also runs on CPU)")
        if backend == "te" and self.sequence_parallel_gather:
            raise ValueError("fp8_sequence_parallel_gather=True: the FP8 all-gather of the sequence-parallel input is "
                             "the torch backend's, and fp8_backend='auto' chose Transformer Engine here; pass "
                             "fp8_backend='torch' or drop it")
        return self if backend == self.backend else _replace(self, backend=backend)

    @property
    def gathers_in_fp8(self) -> bool:
        """Whether a column-parallel layer under sequence parallelism all-gathers its input in FP8
        (``sequence_parallel_gather`` resolved: None means the delayed recipe on the torch backend)."""
        if self.backend == "te" or self.recipe not in ("delayed", "tensorwise"):
            return False
        return self.recipe == "delayed" if self.sequence_parallel_gather is None else self.sequence_parallel_gather

    def layers_in_bf16(self, num_layers: int) -> List[int]:
        """Global indices of the transformer layers kept out of FP8 (``first_last_layers_bf16``)."""
        if not self.first_last_layers_bf16:
            return []
        start = range(min(self.num_layers_at_start_in_bf16, num_layers))
        end = range(max(num_layers - self.num_layers_at_end_in_bf16, 0), num_layers)
        return sorted(set(start) | set(end))


def _replace(config: Float8Config, **changes: Any) -> Float8Config:
    values = {name: getattr(config, name) for name in Float8Config.__dataclass_fields__}
    values.update(changes)
    return Float8Config(**values)
