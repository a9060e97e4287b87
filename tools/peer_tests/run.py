"""Run Lightning's and Accelerate's own tests unmodified (baseline) and through cgdp, and compare.

    python tools/peer_tests/run.py --lightning /tmp/peer/tests --accelerate /tmp/peer/acc --out /tmp/peer/out

See README.md for where the test sources come from. Prints, per test file, the tests that passed
through cgdp / passed on the baseline, then every test that passes on the baseline and not through
cgdp. ``--only cgdp`` reruns the cgdp side against a kept baseline.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# tests_pytorch/...: the single-device and generic strategy tests, loops, checkpoints, hooks, optimization
LIGHTNING = [
    "tests_pytorch/strategies/test_single_device.py", "tests_pytorch/strategies/test_common.py",
    "tests_pytorch/strategies/test_custom_strategy.py", "tests_pytorch/strategies/test_registry.py",
    "tests_pytorch/loops",
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_model_checkpoint.py", "tests_pytorch/checkpointing/test_torch_saving.py",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/trainer/connectors/test_checkpoint_connector.py",
    "tests_pytorch/trainer/connectors/test_callback_connector.py",
    "tests_pytorch/trainer/connectors/test_data_connector.py",
    "tests_pytorch/trainer/connectors/test_logger_connector.py",
    "tests_pytorch/trainer/connectors/test_accelerator_connector.py",
]
# tests/... of the accelerate repository, and the one-process functions of its test_sync.py script (sync_script.py)
ACCELERATE = [
    "tests/test_accelerator.py", "tests/test_grad_sync.py", "tests/test_optimizer.py", "tests/test_scheduler.py",
    "tests/test_state_checkpointing.py", str(HERE / "sync_script.py"),
]


def run(suite: str, root: Path, files: list[str], mode: str, out: Path) -> Path:
    xml = out / f"{suite}_{mode}.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "CGDP_PEER": suite if mode == "cgdp" else "", "CGDP_PEER_LOG": str(out / f"{suite}_{mode}.used")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "cgdp_peer", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={xml}", "--rootdir", str(root), *files]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL if not os.environ.get("CGDP_PEER_VERBOSE") else None)
    return xml


def outcomes(xml: Path) -> dict[str, str]:
    found = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname') or 'tools.peer_tests.sync_script'}::{case.get('name')}"
        kinds = [c.tag for c in case]
        found[name] = ("failed" if "failure" in kinds or "error" in kinds else
                       "skipped" if "skipped" in kinds else "passed")
    return found


def substituted(path: Path) -> set[str]:
    """The JUnit names of the tests (pytest node ids in ``path``) that built a substituted Trainer or Accelerator."""
    names = set()
    for node in path.read_text().split() if path.is_file() else []:
        file, _, rest = node.partition("::")
        module = ("tools.peer_tests.sync_script" if file in ("", "sync_script.py")  # outside the rootdir
                  else file.removesuffix(".py").replace("/", "."))
        *classes, test = rest.split("::")
        names.add(f"{'.'.join([module, *classes])}::{test}")
    return names


def report(suite: str, base: dict[str, str], ours: dict[str, str], used: set[str]) -> None:
    per = collections.defaultdict(lambda: [0, 0, 0])
    lost = []
    for name, outcome in base.items():
        if outcome != "passed":
            continue
        module = name.split("::")[0]
        per[module][1] += 1
        per[module][2] += name in used
        if ours.get(name) == "passed":
            per[module][0] += 1
        else:
            lost.append((name, ours.get(name, "missing")))
    print(f"\n{suite}: passed through cgdp / passed on the baseline (of which ran through cgdp)")
    for module in sorted(per):
        print(f"  {per[module][0]:4d} / {per[module][1]:4d} ({per[module][2]:4d})  {module}")
    total = [sum(v[i] for v in per.values()) for i in (0, 1, 2)]
    print(f"  {total[0]:4d} / {total[1]:4d} ({total[2]:4d})  total")
    for name, outcome in lost:
        print(f"  {outcome:8s} {name}")
    gained = [n for n, o in ours.items() if o == "passed" and base.get(n) != "passed"]
    print(f"  passed through cgdp only ({len(gained)}): what several processes expect, or a baseline failure")
    for name in gained:
        print(f"  {base.get(name, 'missing'):8s} {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lightning", type=Path, help="a checkout's tests/ folder (holds tests_pytorch)")
    p.add_argument("--accelerate", type=Path, help="a folder holding the accelerate repository's tests/")
    p.add_argument("--out", type=Path, default=Path("/tmp/peer/out"))
    p.add_argument("--only", choices=["baseline", "cgdp", "report"],
                   help="run one side (the other is read from --out), or neither: the report of the kept results")
    p.add_argument("-k", dest="select", help="pytest's -k, for a rerun of some tests")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for suite, root, files in (("lightning", args.lightning, LIGHTNING), ("accelerate", args.accelerate, ACCELERATE)):
        if root is None:
            continue
        files = files + (["-k", args.select] if args.select else [])
        xmls = {mode: (run(suite, root.resolve(), files, mode, args.out) if args.only in (None, mode)
                       else args.out / f"{suite}_{mode}.xml") for mode in ("baseline", "cgdp")}
        report(suite, outcomes(xmls["baseline"]), outcomes(xmls["cgdp"]), substituted(args.out / f"{suite}_cgdp.used"))


if __name__ == "__main__":
    main()
