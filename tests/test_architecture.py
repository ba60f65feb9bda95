"""The module graph of docs/DESIGN.md ("Architecture"), checked by parsing jaxseq's imports, and two seams read
from the code the same way.

Every import of a jaxseq module counts, at the top of a file or inside a function: a local import
is still a dependency (and was how the old cycle train → loop → train hid). Two rules: each module
imports only the modules ALLOWED lists for it, and each folder imports only from itself and from the
layers below it (LAYERS), so no folder imports from a folder that imports it. The seams: no module outside
models/ and interop/ tells a model family by its name (`family_branches`), and sharding specs are derived in the
modules SPEC_OWNERS names, at most three, and built for a manual region's view only in REGION_SPECS
(`spec_constructions`). And the sizes a reader can take in: no module over 600 lines, no function over 100
(`oversized`)."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxseq")

# The layers, lowest first: the shared vocabulary at the base (jaxseq/*.py that are not commands), the
# model family, the parallel machinery, training, planning; Hugging Face interop beside the models; the
# commands users type on top. A module may import its own folder and any folder of a lower layer.
LAYERS = {"base": 0, "models": 1, "interop": 1, "parallel": 2, "training": 3, "planning": 4, "commands": 5}
COMMANDS = {"train", "plan", "generate", "convert", "data", "schedule"}  # python -m jaxseq.<name>

# Which jaxseq modules each module may import. A new module must be added here (and to the graph
# in docs/DESIGN.md); an edge that is not listed fails the test.
ALLOWED = {
    # base: configuration, the mesh and its sharding rules, the remat policies, the command-line edge, GPU specs
    "config": {"remat"},
    "remat": set(),
    "presets": {"config"},
    "offload": {"remat"},  # host memory as a tier for what a remat policy stores
    "mesh": {"config"},
    "sharding": {"deferred", "mesh"},
    "deferred": {"remat"},  # zb-h1's weights whose gradient waits: read by ops.matmul and column_parallel
    "cli": {"config"},
    "hardware": set(),
    # the models: the one door (model), the families behind it, their shared ops and parameter declarations,
    # the CPU matmul form an edge may choose, and the paper's formulas
    "models.model": {"config", "mesh", "models.documents", "models.fp8", "models.gpt", "models.llama", "models.moe",
                     "models.ops", "models.params", "offload", "remat", "sharding"},
    "models.gpt": {"config", "models.ops", "models.params", "remat", "sharding"},
    "models.llama": {"config", "models.ops", "models.params", "remat", "sharding"},
    "models.moe": {"config", "models.experts", "models.llama", "models.ops", "models.params", "remat", "sharding"},
    "models.experts": {"config", "models.ops", "remat", "sharding"},
    "models.ops": {"config", "deferred", "models.cpu_matmul", "models.cudnn_attention", "models.documents",
                   "models.fp8", "remat",
                   "sharding"},
    "models.documents": set(),
    "models.cudnn_attention": {"remat", "sharding"},
    "models.params": {"config"},
    "models.cpu_matmul": {"remat"},
    "models.fp8": {"models.cpu_matmul", "remat"},  # FP8 GEMMs (ModelConfig.fp8), in either matmul form
    "models.formulas": {"config", "models.experts", "models.model", "remat"},  # a mixture's capacity: experts.py's
    # formats from the outside world
    "interop.hf": {"config"},
    "interop.hf_llama": {"config", "interop.hf"},
    "interop.hf_mixtral": {"config", "interop.hf", "interop.hf_llama"},
    "interop.hf_qwen3_moe": {"config", "interop.hf", "interop.hf_llama", "interop.hf_mixtral"},
    # the parallel machinery beyond sharding rules: schedules, data-parallel gradient accumulation, the
    # pipeline executor, multi-process
    "parallel.schedule": {"config"},
    "parallel.ticks": {"config", "parallel.schedule"},
    "parallel.data_parallel": {"config", "mesh", "models.model", "parallel.context", "parallel.layout", "sharding"},
    "parallel.context": {"config", "models.documents", "models.ops", "parallel.region", "remat", "sharding"},
    "parallel.stage": {"config", "deferred", "models.documents", "models.model", "parallel.data_parallel",
                       "parallel.region", "parallel.schedule"},
    "parallel.tick_programs": {"deferred", "models.model", "parallel.context", "parallel.stage", "parallel.ticks"},
    "parallel.pipeline": {"config", "mesh", "models.model", "parallel.context", "parallel.data_parallel",
                          "parallel.layout", "parallel.region", "parallel.schedule", "parallel.stage",
                          "parallel.tick_programs", "parallel.ticks", "sharding"},
    "parallel.distributed": {"config"},
    "parallel.layout": {"config", "mesh", "models.model", "sharding"},
    "parallel.region": {"deferred", "mesh", "parallel.fsdp", "sharding"},
    "parallel.fsdp": {"mesh"},
    # training: the step, the loop and what it reads and writes
    "training.train_step": {"config", "models.model", "parallel.context", "parallel.data_parallel", "parallel.layout",
                            "parallel.pipeline"},
    "training.aot": {"config", "models.model", "parallel.context", "parallel.layout", "training.train_step"},
    "training.checkpoint": {"config", "models.model", "parallel.layout"},
    "training.rundir": {"config", "mesh", "models.model", "parallel.layout", "training.checkpoint", "training.sampling",
                        "training.train_step"},
    "training.conversion": {"config", "interop.hf", "interop.hf_llama", "interop.hf_mixtral", "interop.hf_qwen3_moe",
                            "mesh", "models.model", "parallel.layout", "sharding", "training.checkpoint",
                            "training.rundir"},
    "training.data": {"config"},
    "training.resume": {"config", "mesh", "training.rundir"},
    "training.metrics": {"config", "hardware", "models.formulas"},
    "training.sampling": {"config", "mesh", "models.model", "parallel.layout", "sharding", "training.checkpoint",
                          "training.data"},
    "training.loop": {"config", "mesh", "models.model", "offload", "parallel.data_parallel", "parallel.distributed",
                      "parallel.layout", "parallel.pipeline", "parallel.schedule", "training.aot",
                      "training.checkpoint", "training.data", "training.goodput", "training.metrics",
                      "training.profile", "training.rundir", "training.sampling", "training.train_step"},
    "training.goodput": set(),
    "training.profile": {"config", "training.goodput"},
    # planning: XLA's compiled programs read back (the HLO parser, then its loops, collectives, FLOPs and GPU
    # kernels), the memory model, the plan and its report, the configurator (its costs and candidates' kernels at the
    # base, the memory and time models on them, the search, its output)
    "planning.hlo": set(),
    "planning.hlo_loops": {"planning.hlo"},
    "planning.hlo_collectives": {"planning.hlo", "planning.hlo_loops"},
    "planning.hlo_flops": {"planning.hlo", "planning.hlo_loops"},
    "planning.hlo_kernels": {"planning.hlo", "planning.hlo_loops"},
    "planning.memory": {"config", "models.model", "parallel.layout", "sharding"},
    "planning.document_mask": {"config", "parallel.context", "planning.kernel_time"},
    "planning.cost": set(),
    "planning.moe": {"config", "hardware", "models.experts", "models.model", "planning.memory"},
    "planning.measure": {"config", "mesh", "models.model", "planning.hlo_collectives", "planning.hlo_flops",
                         "planning.hlo_kernels", "planning.hlo_loops", "planning.memory", "training.aot"},
    "planning.in_flight": {"config", "mesh", "parallel.layout", "parallel.pipeline", "parallel.schedule",
                           "parallel.ticks", "planning.hlo", "planning.hlo_flops", "planning.hlo_loops",
                           "planning.measure", "planning.stash", "training.aot"},
    "planning.stash": {"models.model", "parallel.layout", "parallel.pipeline"},
    "planning.recommend": {"planning.blocks", "planning.gpu_target", "planning.memory", "planning.plan", "remat"},
    "planning.plan": {"config", "models.formulas", "models.model", "offload", "parallel.schedule", "planning.autotune",
                      "planning.blocks", "planning.gpu_target", "planning.host_tier", "planning.in_flight",
                      "planning.measure", "planning.memory", "remat", "training.aot"},
    "planning.host_tier": {"config", "models.formulas", "offload", "remat"},
    "planning.hlo_host": {"planning.hlo", "planning.hlo_loops"},
    "planning.gpu_target": {"config", "mesh", "models.model", "planning.hlo_flops", "planning.hlo_kernels",
                            "planning.hlo_loops", "planning.measure", "training.aot"},
    "planning.autotune": {"config", "planning.gpu_target", "planning.hlo", "training.aot"},
    "planning.report": {"models.experts", "models.model", "parallel.schedule", "planning.host_tier",
                        "planning.memory", "planning.plan", "planning.recommend", "remat"},
    "planning.kernel_time": {"config", "hardware", "models.experts", "models.model", "remat"},
    "planning.progress": set(),
    "planning.blocks": set(),
    "planning.costs": {"config", "models.formulas", "parallel.schedule", "planning.memory", "planning.search_space"},
    "planning.search_memory": {"config", "models.formulas", "planning.blocks", "planning.costs", "planning.memory",
                               "planning.search_space"},
    "planning.search_time": {"config", "hardware", "models.formulas", "planning.blocks", "planning.costs",
                             "planning.kernel_time", "planning.moe", "planning.search_space", "remat"},
    "planning.search": {"config", "models.formulas", "planning.blocks", "planning.costs", "planning.search_memory",
                        "planning.search_offload", "planning.search_space", "planning.search_time", "remat"},
    "planning.search_offload": {"config", "models.model", "offload", "planning.costs", "planning.host_tier",
                                "planning.search_space", "remat"},
    "planning.search_report": {"models.formulas", "models.model", "planning.cost", "planning.costs",
                               "planning.host_tier", "planning.kernel_time", "planning.search",
                               "planning.search_memory", "planning.search_space"},
    "planning.calibration": {"config", "models.formulas", "models.model", "planning.costs", "planning.search_space",
                             "planning.search_time"},
    "planning.search_space": {"config", "hardware", "remat"},
    "planning.search_costs": {"config", "models.formulas", "planning.costs", "planning.measure", "planning.memory"},
    # the commands
    "train": {"cli", "config", "mesh", "models.model", "offload", "parallel.distributed", "presets", "remat",
              "training.data",
              "training.goodput", "training.loop", "training.profile", "training.resume", "training.rundir"},
    "plan": {"cli", "config", "hardware", "planning.autotune", "presets", "planning.cost", "planning.document_mask",
             "planning.gpu_target", "planning.memory", "planning.moe", "planning.plan", "planning.progress",
             "planning.recommend", "planning.report", "planning.search", "planning.search_costs",
             "planning.search_report", "planning.search_space", "remat"},
    "generate": {"cli", "config", "mesh", "training.data", "training.rundir", "training.sampling"},
    "convert": {"cli", "config", "mesh", "models.model", "training.conversion"},
    "data": {"cli", "config", "training.data"},
    "schedule": {"cli", "config", "parallel.schedule"},
}


def _is_package(dotted: str, package: str) -> bool:
    return os.path.isdir(os.path.join(package, *dotted.split(".")))


def jaxseq_imports(path: str, package: str = PACKAGE) -> set[str]:
    """The jaxseq modules a source file imports, anywhere in it, as dotted names below `jaxseq`."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found |= {a.name[len("jaxseq."):] for a in node.names if a.name.startswith("jaxseq.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jaxseq":
                found |= {a.name for a in node.names}
            elif node.module.startswith("jaxseq."):
                below = node.module[len("jaxseq."):]
                if _is_package(below, package):  # from jaxseq.training import loop
                    found |= {f"{below}.{a.name}" for a in node.names}
                else:  # from jaxseq.training.loop import train
                    found.add(below)
    return found


def module_graph(package: str = PACKAGE) -> dict[str, set[str]]:
    graph = {}
    for folder, _, files in os.walk(package):
        for name in sorted(files):
            if name.endswith(".py") and name != "__init__.py":
                path = os.path.join(folder, name)
                graph[os.path.relpath(path, package)[:-3].replace(os.sep, ".")] = jaxseq_imports(path, package)
    return graph


def layer(module: str) -> str:
    if "." in module:
        return module.split(".")[0]
    return "commands" if module in COMMANDS else "base"


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
    problems = [f"{m} is not in the module graph (add it to ALLOWED and docs/DESIGN.md)" for m in graph
                if m not in ALLOWED]
    problems += [f"{m} imports {d}" for m in sorted(graph) if m in ALLOWED for d in sorted(graph[m] - ALLOWED[m])]
    return problems


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module in another folder of the same or a higher layer."""
    return [f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m in sorted(graph) for d in sorted(graph[m])
            if layer(d) != layer(m) and LAYERS[layer(d)] >= LAYERS[layer(m)]]


def test_every_import_is_an_allowed_edge():
    assert forbidden_edges(module_graph()) == []


def test_every_module_is_in_a_known_layer():
    assert {layer(m) for m in module_graph()} <= set(LAYERS)
    assert COMMANDS <= set(module_graph())


def test_folders_import_only_from_layers_below():
    assert layering_violations(module_graph()) == []
    assert layering_violations(ALLOWED) == []


def test_the_allowed_graph_itself_has_no_cycle():
    assert find_cycle(ALLOWED) is None


def test_no_import_cycle():
    assert find_cycle(module_graph()) is None


@pytest.mark.parametrize("graph, cycle", [
    # The cycle this test was written against: loop.setup_devices imported train.parse_mesh.
    ({"train": {"training.loop", "config"}, "training.loop": {"train", "config"}, "config": set()},
     ["train", "training.loop", "train"]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_the_checks_catch_a_cycle_and_a_forbidden_edge(graph, cycle):
    assert find_cycle(graph) == cycle
    if cycle and "training.loop" in graph:
        assert "training.loop imports train" in forbidden_edges(graph)
        assert layering_violations(graph) == ["training.loop (training) imports train (commands)"]


def test_a_lower_layer_importing_a_higher_one_is_caught():
    graph = {"models.model": {"training.train_step"}, "training.train_step": {"models.model"},
             "interop.hf": {"models.model"}}
    assert layering_violations(graph) == ["interop.hf (interop) imports models.model (models)",
                                          "models.model (models) imports training.train_step (training)"]


def test_local_imports_count(tmp_path):
    (tmp_path / "training").mkdir()
    (tmp_path / "m.py").write_text("def f():\n    from jaxseq.train import parse_mesh\n    import jaxseq.data\n"
                                   "from jaxseq import config as C, mesh\nfrom jaxseq.training import loop\n"
                                   "from jaxseq.training.data import Batches\n")
    assert jaxseq_imports(str(tmp_path / "m.py"), str(tmp_path)) == {
        "train", "data", "config", "mesh", "training.loop", "training.data"}


# ---------------------------------------------------------------------------------------------
# The family seam: what differs between model families is said in models/ (each family's file, behind
# models/model.py) and, for the outside world's formats, in interop/; elsewhere a family is never told by its name.

FAMILY_FOLDERS = {"models", "interop"}


def family_branches(path: str, families) -> list[str]:
    """Where a source file tells model families apart by name ("line N: …"): a comparison with a family's name (or
    of a `.family` with any string), or a table with an entry for every family, as config.py's
    `if model.family == "gpt"` and conversion.py's `{"gpt": "gpt2", "llama": "llama"}` did. A family looked up in
    a registry (`model.family in FAMILY_CHECKS`) names none."""
    named = lambda node: isinstance(node, ast.Constant) and node.value in families
    text = lambda node: isinstance(node, ast.Constant) and isinstance(node.value, str)
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            operands += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
            of_family = any(isinstance(o, ast.Attribute) and o.attr == "family" for o in operands)
            if any(named(o) or (of_family and text(o)) for o in operands):
                found.append(f"line {node.lineno}: a comparison with a family")
        elif isinstance(node, ast.Dict) and set(families) <= {k.value for k in node.keys if named(k)}:
            found.append(f"line {node.lineno}: a table by family name")
    return found


def package_files(package: str = PACKAGE) -> dict[str, str]:
    """Every module of the package, by its dotted name below `jaxseq`: its path."""
    return {os.path.relpath(os.path.join(folder, name), package)[:-3].replace(os.sep, "."): os.path.join(folder, name)
            for folder, _, files in os.walk(package) for name in sorted(files)
            if name.endswith(".py") and name != "__init__.py"}


def test_no_family_branch_outside_the_models_and_interop():
    from jaxseq.models.model import FAMILIES
    branches = {module: found for module, path in package_files().items() if layer(module) not in FAMILY_FOLDERS
                if (found := family_branches(path, set(FAMILIES)))}
    assert branches == {}


def test_the_family_check_catches_a_branch_and_a_table(tmp_path):
    (tmp_path / "m.py").write_text('if cfg.family == "gpt":\n    pass\nFORMAT = {"gpt": "gpt2", "llama": "llama"}\n'
                                   'x = kind in ("llama", "mamba")\nFORMATS = {"gpt2": 1, "llama": 2}\n'
                                   'preset = make(family="llama")\nok = cfg.family in FAMILY_CHECKS\n'
                                   'y = cfg.family != "mamba"\n')
    assert family_branches(str(tmp_path / "m.py"), {"gpt", "llama"}) == [
        "line 1: a comparison with a family", "line 3: a table by family name", "line 4: a comparison with a family",
        "line 8: a comparison with a family"]


# ---------------------------------------------------------------------------------------------
# The sharding seam: the modules that construct a PartitionSpec or NamedSharding, and why each does.

# Where specs are derived from the configuration. At most three: the run's arrays take their shardings from
# the layout (`parallel.layout.Layout`), which reads the family's logical axes through the mesh's rules.
SPEC_OWNERS = {
    "mesh": "the one table from logical axes to mesh axes (`logical_to_spec`)",
    "sharding": "activation constraints by logical names (`Sharder`), the global batch (`batch_sharding`)",
    "parallel.layout": "every array a run holds or a program takes and returns: the weights, the master weights, "
                       "gradients and moments, the optimizer state, the batch, scalars, per-device flags, the "
                       "target of a restore onto another mesh",
}
# Where a manual region's own view is built from the owners' specs: its in_specs and out_specs (a replicated key or
# loss, the stack of micro-batches, a stage's slice of the layers), or a Sharder's constraint on the abstract mesh.
REGION_SPECS = {
    "parallel.region": "`StageSharder.named`: the Sharder's specs on the abstract mesh inside a region",
    "parallel.data_parallel": "the accumulation's region: the micro-batches, the key, the loss",
    "parallel.context": "the ring's nested region: the key",
    "parallel.pipeline": "the pipeline's region: each stage's layers, the micro-batches, the key and the loss",
    "models.cudnn_attention": "cuDNN's nested region over tensor: its stacked residuals",
}
SPEC_TYPES = {"PartitionSpec", "NamedSharding"}


def spec_constructions(path: str) -> list[int]:
    """The lines where a source file constructs a PartitionSpec or NamedSharding, whatever it imports them as
    (`from jax.sharding import PartitionSpec as P`, `jax.sharding.NamedSharding(…)`, `jax.P(…)`)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    local = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module in ("jax", "jax.sharding") for a in node.names if a.name in SPEC_TYPES | {"P"}}
    calls = lambda f: (isinstance(f, ast.Name) and f.id in local) or (isinstance(f, ast.Attribute) and (
        f.attr in SPEC_TYPES or (f.attr == "P" and isinstance(f.value, ast.Name) and f.value.id == "jax")))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and calls(node.func)]


def test_sharding_specs_are_derived_in_at_most_three_modules():
    constructing = {module for module, path in package_files().items() if spec_constructions(path)}
    assert len(SPEC_OWNERS) <= 3
    assert set(SPEC_OWNERS) <= constructing  # each owner still derives what the table says
    assert sorted(constructing - set(SPEC_OWNERS) - set(REGION_SPECS)) == []


def test_the_spec_check_finds_every_way_to_construct_one(tmp_path):
    (tmp_path / "m.py").write_text(
        "import jax\nfrom jax.sharding import NamedSharding, PartitionSpec as P\n"
        "a = P()\nb = NamedSharding(mesh, a)\nc = jax.sharding.PartitionSpec(None)\nd = jax.P('data')\n"
        "ok = isinstance(a, P)\n\ndef f(spec: P) -> NamedSharding:\n    return spec\n")
    assert spec_constructions(str(tmp_path / "m.py")) == [3, 4, 5, 6]


# ---------------------------------------------------------------------------------------------
# Sizes a reader can take in: a module ≤ 600 lines, a function ≤ 100 (nested functions counted in their own right).

MODULE_LINES, FUNCTION_LINES = 600, 100


def oversized(path: str) -> list[str]:
    """A module over MODULE_LINES lines, and each function over FUNCTION_LINES, by name and length."""
    source = open(path, encoding="utf-8").read()
    found = [f"module: {n} lines"] if (n := len(source.splitlines())) > MODULE_LINES else []
    return found + [f"{node.name} (line {node.lineno}): {length} lines" for node in ast.walk(ast.parse(source, path))
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and (length := node.end_lineno - node.lineno + 1) > FUNCTION_LINES]


def test_no_module_over_600_lines_and_no_function_over_100():
    assert {module: found for module, path in package_files().items() if (found := oversized(path))} == {}


def test_the_size_check_catches_a_long_module_and_a_long_function(tmp_path):
    body = "def long():\n" + "    x = 1\n" * 100 + "\n\ndef short():\n    pass\n" + "y = 2\n" * 500
    (tmp_path / "m.py").write_text(body)
    assert oversized(str(tmp_path / "m.py")) == ["module: 605 lines", "long (line 1): 101 lines"]
