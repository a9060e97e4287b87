"""The folders are the architecture: imports between cgdp's parts run one way (README, Layout)."""
import ast
import pathlib

import cgdp

PKG = pathlib.Path(cgdp.__file__).parent
ALLOWED = {  # part -> the parts it may import
    "cli": {"cli", "engine", "planning", "comm", "data", "models"},
    "engine": {"engine", "planning", "comm"},
    "planning": {"planning"},
    "comm": {"comm"},
    "data": {"data"},
    "models": {"models"},
}


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cgdp."):
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("cgdp.")]
    return out


def test_parts_import_one_way():
    wrong = []
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).parts
        if len(rel) < 2:
            continue  # cgdp/__init__.py and the python -m shims import anything
        part = rel[0]
        assert part in ALLOWED, f"new part cgdp/{part}: add it to README's Layout and to ALLOWED"
        for m in _imports(f):
            target = m.split(".")[1]
            if target in ALLOWED and target not in ALLOWED[part]:
                wrong.append(f"{'/'.join(rel)} imports {m}")
    assert not wrong, wrong


def test_engine_modules_stay_small():
    big = {f.name: n for f in (PKG / "engine").rglob("*.py")
           if (n := len(f.read_text().splitlines())) > 600}
    assert not big, f"split these engine modules (STYLE.md: a few hundred lines): {big}"
