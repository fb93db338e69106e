"""The optional packages, checked in one place with ``lightning_utilities``' :class:`RequirementCache`.

Each constant is true when the package is installed (the check runs on first use and is cached); ``str()`` of
a missing one is the pip command that installs it. :func:`require` turns a missing package into an
``ImportError`` naming what needs it. None of these packages is imported here.

========================  ===================  ===========================================================
constant                  package              used for
========================  ===================  ===========================================================
``TRANSFORMER_ENGINE``    transformer-engine   FP8 GEMMs with ``fp8_backend="te"`` / ``"auto"`` on CUDA
``TORCHAO``               torchao              the FP8 peer in ``benchmarks/peers/`` (the library calls
                                               ``torch._scaled_mm`` itself)
``TRANSFORMERS``          transformers         Hugging Face checkpoints
``TENSORBOARD``           tensorboard          ``--tensorboard-dir`` (else CSV files there)
``SENTENCEPIECE``         sentencepiece        SentencePiece tokenizers (a core dependency)
``TOKENIZERS``            tokenizers           ``HuggingFaceTokenizer`` on a ``tokenizer.json``
``MATPLOTLIB``            matplotlib           the loss-curve PNG (else an SVG) and ``benchmarks/plot_results.py``
``JSONARGPARSE``          jsonargparse         ``python -m lightning_megatron fit --config ...``
========================  ===================  ===========================================================
"""
from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

__all__ = ["JSONARGPARSE", "MATPLOTLIB", "SENTENCEPIECE", "TENSORBOARD", "TOKENIZERS", "TORCHAO", "TRANSFORMERS",
           "TRANSFORMER_ENGINE", "require"]

TRANSFORMER_ENGINE = RequirementCache("transformer-engine", "transformer_engine")
TORCHAO = RequirementCache("torchao")
TRANSFORMERS = RequirementCache("transformers")
TENSORBOARD = RequirementCache("tensorboard")
SENTENCEPIECE = RequirementCache("sentencepiece")
TOKENIZERS = RequirementCache("tokenizers")
MATPLOTLIB = RequirementCache("matplotlib")
JSONARGPARSE = RequirementCache("jsonargparse[signatures]>=4.27", "jsonargparse")


def require(requirement: RequirementCache, needed_for: str) -> None:
    """Raise ``ImportError("<needed_for> needs ...: pip install ...")`` when ``requirement`` is not met."""
    if not requirement:
        raise ImportError(f"{needed_for} needs a package that is not installed: {requirement}")
