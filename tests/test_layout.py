"""The house's rules, checked on the source: imports flow one way (no cycle, counting the
imports made inside functions), and Hydra's private APIs live in one module."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moe_exp"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The package's modules `name` imports, anywhere in its file."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods and "." in t:
                t = t.rpartition(".")[0]
            if t in mods and t != name:
                out.add(t)
                break
    return out


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles[:5])
    # the direction: the command line above the sweeps above one run's pipeline
    assert "moe_exp.sweep.callback" in graph["moe_exp.cli"]
    assert "moe_exp.pipeline" in graph["moe_exp.sweep.job"]


def test_hydras_private_apis_live_in_one_module():
    users = sorted(p.name for p in PKG.rglob("*.py") if "hydra._internal" in p.read_text())
    assert users == ["hydra_internals.py"]
