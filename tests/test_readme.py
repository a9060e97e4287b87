"""Every ```python block of the README and of docs/*.md runs as written, in a fresh process whose
torch is unseeded (as a user's script is), on whatever devices the machine has.

A block that cannot run on its own on a CPU-only machine (a fragment of a larger script, one that
needs GPUs or mpiexec) is fenced ```python fragment instead: it must still be valid Python. Any
other info string on a Python fence is refused, so no block escapes both checks. The runnable
blocks start together (as many at a time as there are cores), so the whole set costs about as
long as its slowest few.
"""
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(python|py|python3)\b([^\n]*)\n(.*?)^```", re.S | re.M)
NEEDS = ("transformers", "accelerate", "mpi4py", "lightning")
"""Optional packages: a block that imports one is skipped when it is not installed."""


def python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line, info string after the language, code)`` of each fenced Python block, in order."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(2).strip(), m.group(3)) for m in FENCE.finditer(text)]


BLOCKS = [(f"{doc}:{line}", info, code) for doc in DOCS for line, info, code in python_blocks(ROOT / doc)]
RUNNABLE = [(where, code) for where, info, code in BLOCKS if info == ""]
FRAGMENTS = [(where, code) for where, info, code in BLOCKS if info == "fragment"]


def _missing(code: str) -> str | None:
    needs = re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M)
    if "cgdp.integrations.transformers" in code:
        needs += ["transformers", "accelerate"]  # the hf extra
    if "cgdp.integrations.lightning" in code:
        needs += ["lightning"]
    if "cgdp.integrations.accelerate" in code:
        needs += ["accelerate"]
    for module in needs:
        if module in NEEDS and importlib.util.find_spec(module) is None:
            return module
    return None


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def results():
    """Every runnable block's process, started together (``os.cpu_count()`` at a time)."""
    todo = {where: code for where, code in RUNNABLE if _missing(code) is None}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {where: pool.submit(_run, code) for where, code in todo.items()}
        return {where: f.result() for where, f in futures.items()}


def test_every_python_fence_is_runnable_or_a_fragment():
    odd = [(where, info) for where, info, _ in BLOCKS if info not in ("", "fragment")]
    assert not odd, f"python fences must be ```python (runs as written) or ```python fragment: {odd}"
    assert sum(1 for where, _ in RUNNABLE if where.startswith("README.md")) >= 2
    assert any(where.startswith("docs/") for where, _ in RUNNABLE)


@pytest.mark.parametrize("where, code", FRAGMENTS, ids=[w for w, _ in FRAGMENTS])
def test_fragment_is_valid_python(where, code):
    compile(code, where, "exec")


@pytest.mark.parametrize("where, code", RUNNABLE, ids=[w for w, _ in RUNNABLE])
def test_example_runs_as_written(where, code, results):
    missing = _missing(code)
    if missing:
        pytest.skip(f"{where} needs {missing}")
    p = results[where]
    assert p.returncode == 0, f"the example at {where} failed:\n{p.stderr[-3000:]}"


def test_the_readme_figures_about_the_tests_and_the_tuner_hold():
    """The test commands and counts a newcomer reads are those they will see: CI's exact command, a
    quick subset of files that exist, the suite's size, how many tests ``-m "not slow and not mpi"``
    leaves out, and how many steps the auto tuner takes with its defaults."""
    from cgdp.planning.tuner import AutoTunerConfig
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme, "README's full test command must be .ci/run's"
    quick = re.search(r"^python -m pytest -q (tests/\S+\.py(?: tests/\S+\.py)*)$", readme, re.M)
    assert quick and readme.index(quick.group(0)) < readme.index(ci), "a quick subset comes first"
    assert all((ROOT / f).is_file() for f in quick.group(1).split()), quick.group(1)
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                        "not slow and not mpi"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    kept, total, left = map(int, re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", p.stdout).groups())
    about = int(re.search(r"The whole suite \(about (\d+) tests", readme).group(1))
    assert abs(about - total) <= 0.1 * total, f"README says about {about} tests; {total} are collected"
    said = int(re.search(r'-m "not slow and not mpi"` leaves out the (\d+) tests', readme).group(1))
    assert said == left, f"README says -m 'not slow and not mpi' leaves out {said} tests; it leaves out {left}"
    c = AutoTunerConfig()
    lo = c.warmup_steps + 2 * c.profile_rounds + c.verify_rounds  # one candidate
    hi = lo + c.verify_rounds * c.candidates  # the model's best plans and the naive one
    assert f"tunes it over the first {lo} to {hi} steps" in readme
