"""The packages form layers: no import circle between them, function-level and TYPE_CHECKING imports included
(a circle hidden in a function is still a circle), the config schema imports nothing of the engine or the
benchmarks, and of the engine only build.py imports the parallel package. The graph is read from the source with ast,
so nothing is imported to check it."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _unit(module: str) -> str | None:
    """The layer a module belongs to: hybrid.<package> (a top-level module is its own), or tuner."""
    parts = module.split(".")
    if parts[0] == "tuner":
        return "tuner"
    if parts[0] != "hybrid" or len(parts) < 2 or parts[1] == "_native":
        return None
    return ".".join(parts[:2])


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def package_graph() -> dict[str, dict[str, list[str]]]:
    """unit -> {unit it imports: [the files that do]}."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted([*ROOT.glob("hybrid/**/*.py"), *ROOT.glob("tuner/**/*.py")]):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        src = _unit(module)
        for name in _imports(path):
            dst = _unit(name)
            if src and dst and dst != src:
                graph[src][dst].append(str(path.relative_to(ROOT)))
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_packages():
    graph = package_graph()
    found = cycles(graph)
    detail = [f"{a} -> {b} ({', '.join(sorted(set(graph[a][b])))})" for comp in found for a in comp for b in comp
              if b in graph.get(a, {})]
    assert not found, "import circles between packages:\n" + "\n".join(detail)


def test_cycles_finds_a_circle():
    """The check itself: a circle of three is found, a chain is not."""
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": []}, "b": {"c": []}}) == []


def test_schema_imports_neither_engine_nor_benchmarks():
    names = _imports(ROOT / "hybrid/config/schema.py")
    bad = sorted(n for n in names if n.startswith(("hybrid.engine", "hybrid.bench")))
    assert not bad, f"hybrid/config/schema.py imports {bad}"


def test_the_engine_reaches_the_parallel_peer_through_its_protocol():
    """Only build.py, which starts the peer process, imports hybrid.parallel; the rest of the engine sees the peer
    as peer_link.PrefillPeer."""
    bad = {str(path.relative_to(ROOT)): sorted(n for n in _imports(path) if n.startswith("hybrid.parallel"))
           for path in sorted(ROOT.glob("hybrid/engine/*.py")) if path.name != "build.py"}
    bad = {path: names for path, names in bad.items() if names}
    assert not bad, f"the engine imports the parallel package outside build.py: {bad}"
