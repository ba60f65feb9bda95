"""The module graph of docs/DESIGN.md ("Architecture"), checked by parsing jaxseq's imports.

Every import of a jaxseq module counts, at the top of a file or inside a function: a local import
is still a dependency (and was how the old cycle train → loop → train hid)."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxseq")

# Which jaxseq modules each module may import. A new module must be added here (and to the graph
# in docs/DESIGN.md); an edge that is not listed fails the test.
ALLOWED = {
    # the core: configuration, the paper's ideas, the model and its step
    "config": {"remat"},
    "remat": set(),
    "mesh": {"config"},
    "model": {"config", "mesh", "remat"},
    "train_step": {"config", "mesh", "model", "pipeline"},
    "schedule": {"cli", "config"},
    "pipeline": {"config", "mesh", "model", "remat", "schedule"},
    # accounting: the paper's formulas, XLA's compiled programs read back
    "formulas": {"config", "remat"},
    "hlo": set(),
    "aot": {"config", "mesh", "model", "train_step"},
    # formats and the outside world
    "cli": {"config"},
    "checkpoint": {"config"},
    "rundir": {"checkpoint", "config", "mesh", "train_step"},
    "hf": {"config"},
    "data": {"cli", "config"},
    "distributed": {"config"},
    "metrics": {"config", "formulas"},
    # the training loop, then the commands
    "loop": {"aot", "checkpoint", "config", "data", "distributed", "generate", "mesh", "metrics", "model", "rundir",
             "schedule", "train_step"},
    "generate": {"cli", "config", "data", "mesh", "model", "rundir"},
    "train": {"cli", "config", "data", "distributed", "loop", "mesh", "rundir"},
    "convert": {"checkpoint", "cli", "config", "hf", "mesh", "model", "rundir", "train_step"},
    "search": {"config", "formulas", "remat", "schedule"},
    "plan": {"aot", "cli", "config", "formulas", "hlo", "mesh", "model", "pipeline", "remat", "schedule", "search",
             "train_step"},
}


def jaxseq_imports(path: str) -> set[str]:
    """The jaxseq modules a source file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("jaxseq.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jaxseq":
                found |= {a.name for a in node.names}
            elif node.module.startswith("jaxseq."):
                found.add(node.module.split(".")[1])
    return found


def module_graph(package: str = PACKAGE) -> dict[str, set[str]]:
    return {name[:-3]: jaxseq_imports(os.path.join(package, name))
            for name in sorted(os.listdir(package)) if name.endswith(".py") and name != "__init__.py"}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, …, a], or None."""
    state: dict[str, str] = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    problems = [f"{m} is not in the module graph (add it to ALLOWED and docs/DESIGN.md)" for m in graph if m not in ALLOWED]
    problems += [f"{m} imports {d}" for m in sorted(graph) if m in ALLOWED for d in sorted(graph[m] - ALLOWED[m])]
    return problems


def test_every_import_is_an_allowed_edge():
    assert forbidden_edges(module_graph()) == []


def test_the_allowed_graph_itself_has_no_cycle():
    assert find_cycle(ALLOWED) is None


def test_no_import_cycle():
    assert find_cycle(module_graph()) is None


@pytest.mark.parametrize("graph, cycle", [
    # The cycle this test was written against: loop.setup_devices imported train.parse_mesh.
    ({"train": {"loop", "config"}, "loop": {"train", "config"}, "config": set()}, ["loop", "train", "loop"]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_the_checks_catch_a_cycle_and_a_forbidden_edge(graph, cycle):
    assert find_cycle(graph) == cycle
    if cycle and "loop" in graph:
        assert "loop imports train" in forbidden_edges(graph)


def test_local_imports_count(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from jaxseq.train import parse_mesh\n    import jaxseq.data\n"
                                   "from jaxseq import model as M, mesh\n")
    assert jaxseq_imports(str(tmp_path / "m.py")) == {"train", "data", "model", "mesh"}
