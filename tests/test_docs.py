"""The project's documentation and benchmark scripts stay true to the tree.

- README.md is at most 200 lines and gives the test command exactly as CI (``.ci/run``) runs it;
- every relative link in README.md, docs/ (reports included) and benchmarks/ (RESULTS.md, README.md, reports/)
  points to an existing file, and a ``#anchor`` to a heading of that file (GitHub's heading ids);
- the bench entry points (``benchmarks/*/run_*.sh``) call only scripts that exist, with only the flags and arms
  that ``bench_tp.py``'s argument parser defines;
- project text (README, docs, benchmarks, examples, the library; not the shipped corpus) does not narrate its own
  making: no "session".
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINKED_DOCS = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
               ROOT / "benchmarks" / "README.md", *sorted((ROOT / "benchmarks" / "reports").glob("*.md"))]
PROJECT_TEXT = [README, ROOT / "docs", ROOT / "benchmarks", ROOT / "examples", ROOT / "lightning_megatron"]
NOT_PROJECT_TEXT = [ROOT / "lightning_megatron" / "data" / "corpus"]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose_lines(text: str) -> List[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            out.append(line)
    return out


def github_anchor(heading: str) -> str:
    """GitHub's id of a heading: lower case, punctuation dropped (letters, digits, ``_`` and ``-`` kept), spaces
    turned into hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """Ids of every heading of a markdown file, with GitHub's ``-1``, ``-2`` suffixes for repeats."""
    seen: Dict[str, int] = {}
    out = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = github_anchor(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_github_anchor_rule():
    assert github_anchor("Throughput by commit (tokens/s per GPU, ratio)") == "throughput-by-commit-tokenss-per-gpu-ratio"
    assert github_anchor("## `MFUMonitor`".lstrip("# ")) == "mfumonitor"
    assert github_anchor("1-GPU speed against the peers") == "1-gpu-speed-against-the-peers"
    assert github_anchor("Delayed weight gradients (`delay_wgrad_compute`)") == "delayed-weight-gradients-delay_wgrad_compute"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference material into docs/ (limit 200)"


def test_readme_test_command_is_the_ci_command():
    """The README's test command is the one CI runs: the same installs and the same pytest invocation."""
    readme = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    pytest_lines = [line.strip() for line in ci if line.strip().startswith("python -m pytest")]
    installs = [re.sub(r"\s-q\b", "", line.strip()) for line in ci
                if line.strip().startswith("python -m pip install") and "--upgrade" not in line]
    assert pytest_lines and installs, ".ci/run has no pytest or install line to compare with"
    for line in pytest_lines + installs:
        assert line in readme, f"README.md does not show CI's command {line!r}"


def _relative_links(path: Path) -> List[Tuple[int, str]]:
    out = []
    for i, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), start=1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            out.append((i, target))
    return out


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    assert doc.exists(), doc
    broken = []
    for line, target in _relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"prose line {line}: {target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"prose line {line}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_docs_pages_exist():
    """The topic pages the README and the code point readers to."""
    for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel", "expert_parallel",
                 "precision", "checkpoints", "data", "performance", "testing"):
        assert (ROOT / "docs" / f"{name}.md").exists(), f"docs/{name}.md is missing"


def _project_text_files() -> List[Path]:
    files = []
    for top in PROJECT_TEXT:
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".so"):
                continue
            if any(path.is_relative_to(skip) for skip in NOT_PROJECT_TEXT):
                continue
            files.append(path)
    return files


def test_project_text_does_not_narrate_its_making():
    hits = []
    for path in _project_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), start=1):
            if re.search(r"\bsession", line, re.IGNORECASE):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "project text mentions a session (state dated results and commits instead):\n" + "\n".join(hits)


def _argparse_flags(script: Path) -> Tuple[Set[str], Set[str]]:
    """The ``--flags`` (with ``--no-`` forms of BooleanOptionalAction) and the first positional's choices of the
    ``add_argument`` calls in ``script``."""
    flags: Set[str] = set()
    choices: Set[str] = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        name = node.args[0].value
        kw = {k.arg: k.value for k in node.keywords}
        if name.startswith("--"):
            flags.add(name)
            action = kw.get("action")
            if isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction":
                flags.add("--no-" + name[2:])
        elif "choices" in kw and not choices:
            choices = {c.value for c in kw["choices"].elts}
    return flags, choices


def _expanded_commands(script: Path) -> List[str]:
    """The script's lines with comments dropped and its own simple variables (``NAME="..."``) substituted."""
    lines, variables = [], {}
    for raw in script.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
        line = raw.split(" #", 1)[0] if not raw.lstrip().startswith("#") else ""
        m = re.match(r'^\s*([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"\s*(?:#.*)?$', raw)
        if m:
            variables[m.group(1)] = m.group(2)
            continue
        lines.append(line)
    for _ in range(5):  # variables defined through other variables
        for name, value in variables.items():
            lines = [re.sub(r"\$\{?" + name + r"\b\}?", value, line) for line in lines]
    return lines


RUN_SCRIPTS = sorted((ROOT / "benchmarks").rglob("run_*.sh"))


@pytest.mark.parametrize("script", RUN_SCRIPTS, ids=lambda p: p.name)
def test_bench_scripts_call_existing_scripts_and_flags(script: Path):
    bench_flags, bench_arms = _argparse_flags(ROOT / "benchmarks" / "end_to_end" / "bench_tp.py")
    assert bench_flags and bench_arms, "could not read bench_tp.py's argument parser"
    problems = []
    for line in _expanded_commands(script):
        for called in re.findall(r"benchmarks/[\w./-]+\.(?:py|sh)", line):
            if not (ROOT / called).exists():
                problems.append(f"{called} does not exist: {line.strip()}")
        m = re.search(r"benchmarks/end_to_end/bench_tp\.py\s+(\S+)(.*)", line)
        if m:
            arm, rest = m.group(1), m.group(2)
            if arm not in bench_arms:
                problems.append(f"bench_tp.py has no arm {arm!r}: {line.strip()}")
            for flag in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", rest):
                if flag not in bench_flags:
                    problems.append(f"bench_tp.py has no flag {flag}: {line.strip()}")
    assert not problems, f"{script.name}:\n" + "\n".join(problems)


def test_documented_gpu_setups_are_found_and_parse():
    """The GPU tier runs every documented one-GPU setup (``tests/gpu/test_documented_setups.py``): the fastest bf16
    and FP8 setups of docs/performance.md are among them, and each block is valid Python that names a precision."""
    from tests.doc_snippets import gpu_setups

    setups = gpu_setups()
    assert len([s for s in setups if s.path.name == "performance.md"]) >= 3, [s.name for s in setups]
    assert any('fp8="hybrid"' in s.code for s in setups) and any("params_dtype=torch.bfloat16" in s.code for s in setups)
    for s in setups:
        ast.parse(s.code)
        assert "MegatronPrecision(" in s.code or "precision=" in s.code, s.name
