"""The house's rules, checked on the source, counting the imports made inside functions:
imports run down the layers, no module takes another's `_private` name, no circle anywhere
(hydra_plugins included), and Hydra's private APIs live in one module. Each rule is also
shown to catch a violation planted in the sources it reads."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# lowest first: a module imports from its own layer and the layers below it
LAYERS = [
    ("config", ["moe_exp", "moe_exp.knobs", "moe_exp.config", "moe_exp.conf", "moe_exp.ranks",
                "moe_exp.host", "moe_exp.record", "moe_exp.results", "moe_exp.hardware",
                "moe_exp.tracking", "moe_exp.hydra_internals", "moe_exp.shapes"]),
    ("instruments", ["moe_exp.bench"]),
    ("runtime", ["moe_exp.distributed", "moe_exp.data"]),
    ("model", ["moe_exp.model"]),
    ("optimizations", ["moe_exp.optimizations", "moe_exp.optim"]),
    ("train", ["moe_exp.train"]),
    ("planner and serving", ["moe_exp.plan", "moe_exp.infer"]),
    ("tasks", ["moe_exp.tasks"]),
    ("pipeline", ["moe_exp.validate", "moe_exp.pipeline"]),
    ("sweep", ["moe_exp.sweep", "hydra_plugins"]),
    ("command line", ["moe_exp.cli", "moe_exp.run", "moe_exp.help", "moe_exp.report",
                      "moe_exp.compare", "moe_exp.flop_check", "moe_exp.data.__main__"]),
]


def sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """{module: (its source, is a package's __init__)} of moe_exp and hydra_plugins."""
    out = {}
    for pkg in ("moe_exp", "hydra_plugins"):
        for p in (root / pkg).rglob("*.py"):
            parts = p.relative_to(root).with_suffix("").parts
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (p.read_text(), init)
    return out


def imports(srcs: dict) -> list[tuple[str, str, str]]:
    """(importer, imported module, name taken) of every import between the sources' modules,
    wherever in its file it is."""
    out = []
    for name, (text, init) in srcs.items():
        pkg = name if init else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                pairs = [(f"{mod}.{a.name}", "") if f"{mod}.{a.name}" in srcs else (mod, a.name)
                         for a in node.names]
            elif isinstance(node, ast.Import):
                pairs = [(a.name, "") for a in node.names]
            else:
                continue
            for target, taken in pairs:
                while target and target not in srcs and "." in target:
                    target = target.rpartition(".")[0]
                if target in srcs and target != name:
                    out.append((name, target, taken))
    return out


def layer(module: str) -> int:
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module}: in no layer of tests/test_layout.py (place it)"
    return best[1]


def against_layers(srcs) -> list[str]:
    return [f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})"
            for a, b, _ in imports(srcs) if layer(b) > layer(a)]


def private_names(srcs) -> list[str]:
    return [f"{a} takes {n} from {b}" for a, b, n in imports(srcs)
            if n.startswith("_") and not n.startswith("__")]


def cycles(srcs) -> list[str]:
    graph = {m: set() for m in srcs}
    for a, b, _ in imports(srcs):
        graph[a].add(b)
    found, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                found.append(" -> ".join(path[path.index(n):] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_imports_run_down_the_layers():
    assert against_layers(sources()) == []


def test_no_module_takes_another_modules_private_name():
    assert private_names(sources()) == []


def test_no_import_cycle():
    srcs = sources()
    assert cycles(srcs) == []
    graph = {(a, b) for a, b, _ in imports(srcs)}
    # the direction: the command line above the sweeps above one run's pipeline
    assert ("moe_exp.cli", "moe_exp.sweep.callback") in graph
    assert ("moe_exp.sweep.job", "moe_exp.pipeline") in graph


def test_each_rule_catches_a_planted_violation():
    srcs = sources()
    planted = {**srcs, "moe_exp.train.planted": ("def f():\n    from ..tasks import TASKS\n",
                                                 False)}
    assert against_layers(planted) == [
        "moe_exp.train.planted (train) imports moe_exp.tasks (tasks)"]
    planted = {**srcs, "moe_exp.tasks.planted": ("from ..bench.memory import _x\n", False)}
    assert private_names(planted) == ["moe_exp.tasks.planted takes _x from moe_exp.bench.memory"]
    planted = {**srcs, "moe_exp.sweep.table": (srcs["moe_exp.sweep.table"][0]
                                               + "\nfrom ..report import main\n", False)}
    assert any("moe_exp.sweep.table" in c and "moe_exp.report" in c for c in cycles(planted))
    searcher = "moe_exp.sweep.searcher"  # (it and the plugin imported each other once)
    planted = {**srcs, searcher: (srcs[searcher][0] + "\nfrom hydra_plugins.moe_exp_search."
                                  "search_sweeper import SearchSweeper\n", False)}
    assert any(searcher in c and "hydra_plugins" in c for c in cycles(planted))


def test_hydras_private_apis_live_in_one_module():
    users = sorted(p.name for p in (ROOT / "moe_exp").rglob("*.py")
                   if "hydra._internal" in p.read_text())
    assert users == ["hydra_internals.py"]
