"""The documented one-GPU setups: every fenced Python block of README.md and docs/*.md that builds a Trainer with
``accelerator="gpu", devices=1``. The GPU tier runs each of them on a small model
(``tests/gpu/test_documented_setups.py``); the CPU suite checks that they are found and parse
(``tests/test_docs.py``), so a documented setup cannot drop out of the tier unnoticed."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Snippet:
    """One documented GPU setup: its file, the line its block starts on, and its code."""

    path: Path
    line: int
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def gpu_setups() -> List[Snippet]:
    """The Python blocks of the documents that build a Trainer on one GPU (``Trainer(`` with ``accelerator="gpu"``
    and ``devices=1``). Blocks for several GPUs (the README's 8-GPU example) are not among them: the tier runs on
    one GPU."""
    out = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            code = m.group(1)
            if "Trainer(" in code and 'accelerator="gpu"' in code and re.search(r"\bdevices=1\b", code):
                out.append(Snippet(path, text.count("\n", 0, m.start()) + 1, code))
    return out
