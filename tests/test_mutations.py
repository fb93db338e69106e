"""The mutation check (:mod:`tests.mutations`): that its planted bugs still apply to the current source (fast, in
the default suite), and the check itself (minutes: skipped unless pytest is given ``--mutations``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutations import MUTATIONS, ROOT, Edit, apply_edits, check_edits


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_targets_occur_once_in_the_source(mutation):
    """Every planted bug's target text is in the source exactly once, and every test it runs exists: a refactor
    that moves the target fails here, in the default suite, rather than in the minutes-long check."""
    check_edits(ROOT, mutation.edits)
    for node in mutation.tests + mutation.fp32_tests:
        path, _, name = node.partition("::")
        func = name.split("[")[0]
        assert (ROOT / path).is_file(), node
        assert f"def {func}(" in (ROOT / path).read_text(encoding="utf-8"), node


def test_edits_refuse_missing_or_repeated_targets(tmp_path: Path):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    with pytest.raises(RuntimeError, match="occurs 0 times"):
        apply_edits(tmp_path, [Edit("a.py", "z = 3\n", "z = 4\n")])
    with pytest.raises(RuntimeError, match="occurs 2 times"):
        apply_edits(tmp_path, [Edit("a.py", "x = 1\n", "x = 2\n")])
    with pytest.raises(RuntimeError, match="does not exist"):
        apply_edits(tmp_path, [Edit("b.py", "x", "y")])
    apply_edits(tmp_path, [Edit("a.py", "y = 2\n", "y = 3\n")])
    assert (tmp_path / "a.py").read_text() == "x = 1\nx = 1\ny = 3\n"


@pytest.mark.mutations
def test_every_planted_bug_is_caught():
    """``python tests/mutations.py``: the unmutated copy passes every selection and each mutation fails its own."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mutations.py")], capture_output=True, text=True,
                          timeout=1800)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert f"all {len(MUTATIONS)} mutations caught" in proc.stdout, proc.stdout[-8000:]
