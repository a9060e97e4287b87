"""The engine's shape, for a maintainer: lines, the longest functions and files, and how many
calls and modules of cgdp one ``cgdp.DataParallel`` iteration crosses.

    python bench/engine_shape.py [--tree DIR]...

Each ``--tree`` (default: this checkout) is measured in a fresh process, so that two trees
(``--tree /tmp/cgdp-main --tree .``) compare in one run. The iteration is the README's loop on two
CPU-emulated devices: ``zero_grad``, forward, loss, ``backward``, ``clip_grad_norm_``,
``optimizer.step``, after 5 warm-up iterations (the chunk-plan tuner done: ``chunks=1``). The
trained parameters are checked against one device before anything is counted.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import collections, copy, json, sys, threading
import torch
import cgdp
root = cgdp.__file__.rsplit("/", 1)[0]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
ref = copy.deepcopy(net)
model = cgdp.DataParallel(net, ["cpu:0", "cpu:1"], chunks=1)
opt = model.bind(torch.optim.AdamW(model.parameters(), lr=1e-2))
ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)

def iteration(m, o, clip):
    o.zero_grad()
    loss = torch.nn.functional.cross_entropy(m(x), y)
    loss.backward()
    clip(1.0)
    o.step()

for _ in range(5):
    iteration(model, opt, model.clip_grad_norm_)
    iteration(ref, ropt, lambda n: torch.nn.utils.clip_grad_norm_(ref.parameters(), n))
err = max(float((a - b).abs().max()) for a, b in zip(net.parameters(), ref.parameters()))
assert err < 1e-5, err  # the answer first

calls, modules = collections.Counter(), set()
def prof(frame, event, arg):
    if event == "call":
        f = frame.f_code.co_filename
        if f.startswith(root):
            calls[frame.f_code.co_name] += 1
            modules.add(f[len(root) + 1:])
threading.setprofile(prof)
sys.setprofile(prof)
iteration(model, opt, model.clip_grad_norm_)
sys.setprofile(None)
threading.setprofile(None)
model.close()
print(json.dumps({"calls": sum(calls.values()), "distinct_functions": len(calls), "modules": sorted(modules)}))
"""


def shape(tree: Path) -> dict:
    eng = tree / "cgdp" / "engine"
    files, funcs = {}, []
    for p in sorted(eng.rglob("*.py")):
        text = p.read_text()
        rel = str(p.relative_to(tree / "cgdp"))
        files[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    over600 = {str(p.relative_to(tree)): n for p in (tree / "cgdp").rglob("*.py")
               if (n := len(p.read_text().splitlines())) > 600}
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd="/", capture_output=True, text=True, check=True)
    it = json.loads(out.stdout.strip().splitlines()[-1])
    funcs.sort(reverse=True)
    return {"engine_lines": sum(files.values()), "engine_files": len(files),
            "largest_files": sorted(files.items(), key=lambda kv: -kv[1])[:3], "longest_functions": funcs[:3],
            "cgdp_files_over_600": over600, "dp_iteration_calls": it["calls"],
            "dp_iteration_functions": it["distinct_functions"], "dp_iteration_modules": len(it["modules"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, help="a cgdp checkout (repeatable)")
    args = ap.parse_args()
    for tree in args.tree or [Path(__file__).resolve().parents[1]]:
        print(f"## {tree}")
        for k, v in shape(tree.resolve()).items():
            print(f"- {k}: {v}")


if __name__ == "__main__":
    main()
