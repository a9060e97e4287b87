"""Every ```python block of the README and of docs/step.md runs as written, in a fresh process
whose torch is unseeded (as a user's script is), on whatever devices the machine has."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/step.md", "docs/huggingface.md"]


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of each fenced ```python block, in order (not those tagged ``fragment``)."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python(?! fragment)[^\n]*\n(.*?)^```", text, re.S | re.M)]


BLOCKS = [(f"{doc}:{line}", code) for doc in DOCS for line, code in python_blocks(ROOT / doc)]


def test_the_docs_have_examples():
    assert sum(1 for where, _ in BLOCKS if where.startswith("README.md")) >= 2
    assert any(where.startswith("docs/step.md") for where, _ in BLOCKS)


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_example_runs_as_written(where, code):
    needs = re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M)
    if "cgdp.integrations.transformers" in code:
        needs += ["transformers", "accelerate"]  # the hf extra
    for module in needs:
        if module in ("transformers", "accelerate", "mpi4py") and importlib.util.find_spec(module) is None:
            pytest.skip(f"{where} needs {module}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"the example at {where} failed:\n{p.stderr[-3000:]}"


def test_ci_runs_the_readmes_test_command():
    """.ci/run is the README's install-and-test command, character for character."""
    command = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip "))
    assert "python -m pytest" in command
    assert f"```bash\n{command}\n```" in (ROOT / "README.md").read_text()
