"""XLA's own accounting, read from a compiled program's optimized HLO text: the bytes a layer stores
for backward, the collectives each layer loop performs (with their device groups), and the dots a
program runs. The ring traffic those collectives cost is the configurator's (planning/search.py).

With the layers under `lax.scan`, every tensor a layer keeps for backward is a stacked [L, …]
buffer that the forward loop writes; its per-device size / L is the per-layer stored bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

# ---------------------------------------------------------------------------------------------
# Reading optimized HLO text

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclass
class Instr:
    name: str
    shape: str  # the result type as printed: "bf16[4,1,128,64]{…}" or a tuple "(…)"
    opcode: str
    rest: str  # operands and attributes

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return _tuple_elements(self.shape)

    def results(self) -> list[tuple[str, tuple[int, ...]]]:
        """The arrays an instruction produces. XLA:GPU's asynchronous all-gather-start and reduce-scatter-start
        carry (operands, results) as their tuple shape: their results are its last element."""
        if self.opcode in ("all-gather-start", "reduce-scatter-start") and self.shape.startswith("("):
            return _tuple_elements(_top_level(self.shape[1:-1])[-1])
        return self.arrays()

    def operands(self) -> list[str]:
        depth, cur = 0, ""
        for ch in self.rest:
            if ch == "(":
                depth += 1
            elif ch == ")":
                if depth == 0:
                    break
                depth -= 1
            cur += ch
        return re.findall(r"%([\w.\-]+)", cur)

    def attr(self, key: str) -> str | None:
        m = re.search(key + r"=%?([\w.\-]+)", self.rest)
        return m.group(1) if m else None

    def trip_count(self) -> int | None:
        """A `while`'s known trip count (XLA's backend_config), None when XLA does not know it."""
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.rest)
        return int(m.group(1)) if m else None

    def branches(self) -> list[str]:
        """The computations a `conditional` (lax.switch / lax.cond) chooses between, in branch order."""
        m = re.search(r"branch_computations=\{([^}]*)\}", self.rest)
        return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


def array_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    return _DTYPE_BYTES[dtype] * int(np.prod(dims, dtype=np.int64))


def parse_hlo(text: str) -> dict[str, list[Instr]]:
    """Computation name → its instructions, in order."""
    comps: dict[str, list[Instr]] = {}
    current = None
    for line in text.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            current = _computation_name(line)
            comps[current] = []
        elif current is not None and line.startswith("  "):
            m = _INSTR.match(line)
            if m:
                comps[current].append(Instr(*m.groups()))
    return comps


def _computation_name(header: str) -> str:
    head = header.split()
    return (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")


def entry_name(text: str) -> str:
    """The name (parse_hlo's key) of the program's ENTRY computation, where it starts running."""
    return _computation_name(next(line for line in text.splitlines() if line.startswith("ENTRY")))


def _top_level(items: str) -> list[str]:
    """The comma-separated items of a tuple's inside, split at depth 0 only."""
    out, depth, cur = [], 0, ""
    for ch in items:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out, cur = out + [cur.strip()], ""
        else:
            cur += ch
    return out + [cur.strip()]


def _tuple_elements(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


@dataclass
class ScanLoop:
    """A `while` op whose trip count is the number of layers."""

    name: str
    body: str
    backward: bool  # the transpose (backward) loop of the layer scan
    written: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # stacked buffers it writes


def outer_loops(comps: dict[str, list[Instr]], trip_count: int) -> list[Instr]:
    """The `while` ops of this known trip count that no other such loop runs: a loop of the same count nested in
    one (a ring's scan over 2 query tiles in a layer loop of 2) is part of its body, not one of them."""
    loops = [(comp, ins) for comp, instrs in comps.items() for ins in instrs
             if ins.opcode == "while" and ins.trip_count() == trip_count]
    inside = {name for _, loop in loops for name in _called(comps, loop.attr("body"))}
    return [ins for comp, ins in loops if comp not in inside]


def layer_loops(comps: dict[str, list[Instr]], num_layers: int) -> list[ScanLoop]:
    loops = []
    for ins in outer_loops(comps, num_layers):
        body = ins.attr("body")
        loop = ScanLoop(ins.name, body, "transpose(" in _op_name(ins.rest))
        root = comps[body][-1]
        by_name = {i.name: i for i in comps[body]}
        for elem, operand in zip(_tuple_elements(ins.shape), root.operands()):
            dims = elem[1]
            if not dims or dims[0] != num_layers:
                continue
            producer = by_name.get(operand)
            if producer is not None and producer.opcode == "fusion-done":  # an asynchronous fusion: its start
                producer = by_name.get(producer.operands()[0])
            if _writes_slice(comps, producer):
                loop.written.append(elem)
        loops.append(loop)
    return loops


def _writes_slice(comps, producer: Instr | None) -> bool:
    """Whether a loop output is a stacked buffer updated in place (a scan `ys`), not the carry."""
    if producer is None:
        return False
    if producer.opcode == "dynamic-update-slice":
        return True
    callee = producer.attr("calls") if producer.opcode in _FUSIONS else None
    return bool(callee) and any(i.opcode == "dynamic-update-slice" for i in comps.get(callee, []))


def stored_bytes_per_layer(hlo_text: str, num_layers: int) -> int:
    """Per-device bytes one layer keeps for backward: the stacked buffers the forward scan writes, / L."""
    loops = [l for l in layer_loops(parse_hlo(hlo_text), num_layers) if not l.backward]
    if len(loops) != 1:
        raise RuntimeError(f"expected one forward layer loop with trip count {num_layers}, found {len(loops)}")
    return sum(array_bytes(dt, dims) for dt, dims in loops[0].written) // num_layers


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _called(comps, name, seen=None) -> list[str]:
    """A computation and every computation it calls (fusions, nested loops), transitively."""
    seen = set() if seen is None else seen
    if name in seen or name not in comps:
        return []
    seen.add(name)
    out = [name]
    for ins in comps[name]:
        for key in ("calls", "body", "condition", "to_apply"):
            callee = ins.attr(key)
            if callee:
                out += _called(comps, callee, seen)
        for callee in ins.branches():
            out += _called(comps, callee, seen)
    return out


def runs_per_call(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry: a while body × its known trip count
    (1 when XLA does not know it), fusions and calls once per run of their caller, each branch of a
    conditional as if it ran (an upper bound)."""
    comps, runs = parse_hlo(hlo_text), {}

    def visit(comp: str, n: int):
        runs[comp] = runs.get(comp, 0) + n
        for ins in comps.get(comp, []):
            if ins.opcode == "while":
                visit(ins.attr("body"), n * (ins.trip_count() or 1))
            else:
                for callee in filter(None, (ins.attr("calls"), ins.attr("to_apply"))):
                    visit(callee, n)
            for branch in ins.branches():
                visit(branch, n)

    visit(entry_name(hlo_text), 1)
    return runs


@dataclass(frozen=True)
class Collective:
    kind: str  # all-gather | all-reduce | reduce-scatter | … ; an all-reduce whose value is only ever
    #            dynamic-sliced is reported as reduce-scatter (XLA:CPU 0.10 forms no reduce-scatter from
    #            automatic partitioning; GPU/TPU compilers fuse the pair into one)
    elements: int  # elements of the full (unscattered) buffer, per device
    group_size: int
    source: str = ""  # the jaxpr op it came from (HLO metadata op_name), e.g. ".../bsf,fh->bsh/dot_general"
    groups: tuple | None = None  # its device groups (`replica_groups`), None where they are not read


_PASS_THROUGH = {"convert", "bitcast", "copy", "reshape", "get-tuple-element"}


def _users(instrs: list[Instr]) -> dict[str, list[Instr]]:
    users: dict[str, list[Instr]] = {}
    for ins in instrs:
        for op in ins.operands():
            users.setdefault(op, []).append(ins)
    return users


def _slices_only(comps, comp: str, name: str, users=None, outer=None) -> bool:
    """Whether every use of the value `name` in computation `comp` ends in a dynamic-slice *of that
    value*, looking through converts and bitcasts (XLA:CPU computes bf16 collectives in f32 and
    converts back) and through the fusions it is passed to (into them, and out of them when it is
    their result). A fusion that consumes the value whole and slices something else (a layer's bias,
    say: newer XLA fuses both into one kernel) does not count. `outer`: (computation, fusion) that
    called `comp`, when `comp` is a fused computation."""
    users = _users(comps[comp]) if users is None else users
    uses = users.get(name, [])
    if not uses:
        # The fusion's result: follow it in the computation that called the fusion.
        return outer is not None and comps[comp][-1].name == name and _slices_only(comps, *outer)
    for u in uses:
        operands = u.operands()
        if u.opcode == "dynamic-slice" and operands[0] == name:
            continue
        if u.opcode in _PASS_THROUGH and _slices_only(comps, comp, u.name, users, outer):
            continue
        if u.opcode == "fusion" and u.attr("calls") in comps:
            callee = u.attr("calls")
            params = {int(i.rest.split(")")[0]): i.name for i in comps[callee] if i.opcode == "parameter"}
            inner = _users(comps[callee])
            if all(_slices_only(comps, callee, params[k], inner, (comp, u.name)) for k, op in enumerate(operands)
                   if op == name):
                continue
        return False
    return True


def _op_name(rest: str) -> str:
    m = re.search(r'op_name="([^"]*)"', rest)
    return m.group(1) if m else ""


def loop_collectives(hlo_text: str, num_layers: int, backward: bool) -> list[Collective]:
    """The collectives one iteration of the forward (or backward) layer loop performs."""
    comps = parse_hlo(hlo_text)
    loops = [l for l in layer_loops(comps, num_layers) if l.backward == backward]
    if len(loops) != 1:
        raise RuntimeError(f"expected one {'backward' if backward else 'forward'} layer loop, found {len(loops)}")
    out = []
    for comp in _called(comps, loops[0].body):
        users = _users(comps[comp])
        for ins in comps[comp]:
            base = ins.opcode.removesuffix("-start")
            if base not in COLLECTIVES:
                continue
            size = _group_size(ins.rest)
            for index, (dt, dims) in enumerate(ins.results()):
                kind = base
                if base == "all-reduce":
                    # A tuple all-reduce is read through its get-tuple-elements.
                    value = ins.name if len(ins.arrays()) == 1 else next(
                        (u.name for u in users.get(ins.name, []) if u.opcode == "get-tuple-element"
                         and f"index={index}" in u.rest), None)
                    if value and _slices_only(comps, comp, value, users):
                        kind = "reduce-scatter"
                elements = int(np.prod(dims, dtype=np.int64))
                if base == "reduce-scatter":
                    elements *= size  # report the full buffer, like the others
                groups = replica_groups(ins.rest)
                out.append(Collective(kind, elements, size, _op_name(ins.rest),
                                      None if groups is None else tuple(map(tuple, groups))))
    return out


@dataclass(frozen=True)
class Gather:
    """One floating-point all-gather result of a compiled program."""

    dtype: str
    dims: tuple[int, ...]
    in_loop: bool  # inside a while loop's body (a scan), i.e. run once per iteration
    op_name: str  # the JAX op it came from, "?" when the HLO does not say


def _loop_bodies(comps) -> set[str]:
    """Every computation a while loop's body runs (its callees and conditional branches included)."""
    return {c for instrs in comps.values() for ins in instrs if ins.opcode == "while"
            for c in _called(comps, ins.attr("body"))}


def all_gathers(hlo_text: str, group_size: int) -> list[Gather]:
    """Every floating-point all-gather over groups of `group_size` devices, and whether it runs in a loop."""
    comps = parse_hlo(hlo_text)
    in_loops = _loop_bodies(comps)
    out = []
    for comp, instrs in comps.items():
        for ins in instrs:
            if ins.opcode.removesuffix("-start") != "all-gather" or _group_size(ins.rest) != group_size:
                continue
            op = re.search(r'op_name="([^"]*)"', ins.rest)
            out += [Gather(dt, dims, comp in in_loops, op.group(1) if op else "?")
                    for dt, dims in ins.arrays() if dt.startswith(("f", "bf"))]
    return out


def replica_groups(rest: str) -> list[tuple[int, ...]] | None:
    """The device groups of a collective, from its explicit ({{0,2},{1,3}}), iota ([4,2]<=[2,2,2]T(0,2,1))
    or mesh (mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, optionally with device_ids=([2,2]T(1,0))) replica_groups;
    None for another form, or none (a collective-permute names source-target pairs)."""
    for read in (_mesh_groups, _explicit_groups, _iota_groups):
        groups = read(rest)
        if groups is not None:
            return groups
    return None


def _group_size(rest: str) -> int:
    """Devices per group of a collective; 1 where replica_groups reads no groups."""
    groups = replica_groups(rest)
    return len(groups[0]) if groups else 1


def _mesh_groups(rest: str) -> list[tuple[int, ...]] | None:
    """The mesh's devices (device_ids, if given, in iota form) grouped along the axes in braces: a whole axis
    ('tensor') or a sub-axis of one ('tensor':(2)2, XLA 0.12: pre-size 2, size 2 of the axis, the minor pair of 4)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))? \{([^}]*)\}",
                  rest)
    if not m:
        return None
    names, sizes = zip(*[(k.strip("'"), int(v)) for k, v in re.findall(r"('[^']+')=(\d+)", m.group(1))])
    ids = _iota_ids(m.group(2), m.group(3)) if m.group(2) else np.arange(int(np.prod(sizes)))
    specs = [re.fullmatch(r"'([^']+)'(?::\((\d+)\)(\d+))?", a.strip()) for a in m.group(4).split(",") if a.strip()]
    spans = [(g[1], int(g[2] or 1), int(g[3] or sizes[names.index(g[1])])) for g in specs]  # (axis, pre, size)
    dims, where = [], {}  # the mesh's axes cut at every sub-axis boundary, major first; a grouped span → its dims
    for name, size in zip(names, sizes):
        cuts = sorted({1, size, *(b for n, pre, k in spans if n == name for b in (pre, pre * k))})
        first = len(dims)
        dims += [cuts[j + 1] // cuts[j] for j in range(len(cuts) - 1)]
        for n, pre, k in spans:
            if n == name:
                where[n, pre, k] = list(range(first + cuts.index(pre), first + cuts.index(pre * k)))
    grouped = [d for span in spans for d in where[span]]
    ids = ids.reshape(dims).transpose([d for d in range(len(dims)) if d not in grouped] + grouped)
    return [tuple(int(i) for i in g) for g in ids.reshape(-1, int(np.prod([dims[d] for d in grouped])))]


def _explicit_groups(rest: str) -> list[tuple[int, ...]] | None:
    m = re.search(r"replica_groups=\{(\{[0-9,{}]*\})\}", rest)
    if not m:
        return None
    return [tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]


def _iota_groups(rest: str) -> list[tuple[int, ...]] | None:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", rest)
    if not m:
        return None
    ids = _iota_ids(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2)))
    return [tuple(int(i) for i in g) for g in ids]


def _iota_ids(dims: str, perm: str | None) -> np.ndarray:
    """Device ids as XLA's iota form writes them: 0 … n-1 laid out as `dims`, transposed by `perm` (T(…))."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(d) for d in perm.split(",")]) if perm else ids


@dataclass(frozen=True)
class Reduction:
    """One floating-point all-reduce or reduce-scatter of a compiled program."""

    kind: str  # all-reduce | reduce-scatter (as the HLO names it)
    elements: int  # of its result, per device
    shapes: tuple[tuple[int, ...], ...]  # of its floating-point results (a tuple all-reduce has several)
    groups: tuple[tuple[int, ...], ...] | None  # device groups (mesh device ids); None: not read
    in_loop: bool  # inside a while loop's body, a conditional's branch in it included
    op_name: str
    dtypes: tuple[str, ...] = ()  # element types of its floating-point results, as `shapes`


def reductions(hlo_text: str) -> list[Reduction]:
    """Every floating-point all-reduce and reduce-scatter, with its device groups and whether it runs in a
    loop (so that a caller can tell, say, the `data`-axis gradient reductions inside a pipeline's tick loop
    from those after it)."""
    comps = parse_hlo(hlo_text)
    in_loops = _loop_bodies(comps)
    out = []
    for comp, instrs in comps.items():
        for ins in instrs:
            kind = ins.opcode.removesuffix("-start")
            if kind not in ("all-reduce", "reduce-scatter"):
                continue
            groups = replica_groups(ins.rest)
            floats = [(dt, dims) for dt, dims in ins.arrays() if dt.startswith(("f", "bf"))]
            shapes = tuple(dims for _, dims in floats)
            if shapes:
                out.append(Reduction(kind, sum(int(np.prod(d, dtype=np.int64)) for d in shapes), shapes,
                                     tuple(groups) if groups else None, comp in in_loops, _op_name(ins.rest),
                                     tuple(dt for dt, _ in floats)))
    return out


@dataclass(frozen=True)
class Dot:
    """One dot of a compiled program (a fused one included), with the element types it computes in."""

    operands: tuple[str, str]  # element types of its two operands, as the dot itself takes them
    result: str
    batched: bool  # has batch dimensions (attention's QKᵀ and scores × V)
    op_name: str


def dots(hlo_text: str) -> list[Dot]:
    """Every dot of a compiled program. Why the operands' types: a bf16 matmul that XLA runs by first
    converting its operands to float32 (XLA:CPU's plain bf16 dots) shows f32 operands here."""
    out = []
    for instrs in parse_hlo(hlo_text).values():
        types = {ins.name: ins.arrays()[0][0] for ins in instrs if not ins.shape.startswith("(") and ins.arrays()}
        for ins in instrs:
            if ins.opcode == "dot":
                a, b = ins.operands()[:2]
                out.append(Dot((types.get(a), types.get(b)), ins.arrays()[0][0], "lhs_batch_dims" in ins.rest,
                               _op_name(ins.rest)))
    return out


CUDNN_ATTENTION = "__cudnn$fmha"  # the prefix of cuDNN's fused attention custom calls (jax/_src/cudnn)
CUBLAS = "__cublas$"  # cuBLAS's GEMM custom calls (__cublas$gemm, __cublas$lt$matmul)


def op_kinds(hlo_text: str) -> dict[str, str | None]:
    """HLO op name → what its kernel does, for a profile's time per kind: "matmul" (a dot, a fusion holding one,
    cuBLAS's custom call), "attention" (cuDNN's fused attention), "collective", "convert", "copy/transpose", or
    "other" (the elementwise fusions); None for a container (while, call, conditional), whose ops are counted
    themselves."""
    comps = parse_hlo(hlo_text)
    kinds = {}
    for instrs in comps.values():
        for ins in instrs:
            inner = {i.opcode for i in comps.get(ins.attr("calls") or "", [])} - {"parameter", "bitcast", "constant"}
            target = re.search(r'custom_call_target="([^"]*)"', ins.rest) if ins.opcode == "custom-call" else None
            if ins.opcode in ("while", "call", "conditional"):
                kinds[ins.name] = None
            elif ins.opcode.removesuffix("-start") in COLLECTIVES:
                kinds[ins.name] = "collective"
            elif target and target.group(1).startswith(CUDNN_ATTENTION):
                kinds[ins.name] = "attention"
            elif ins.opcode == "dot" or "dot" in inner or (target and target.group(1).startswith(CUBLAS)):
                kinds[ins.name] = "matmul"
            elif (ins.opcode == "convert" or inner == {"convert"}) and ins.opcode != "copy":
                kinds[ins.name] = "convert"
            elif ins.opcode in ("copy", "transpose") or (inner and inner <= {"copy", "transpose", "convert", "broadcast"}):
                kinds[ins.name] = "copy/transpose"
            else:
                kinds[ins.name] = "other"
    return kinds


_MOVES_NOTHING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                  "fusion-done"}  # an asynchronous fusion's bytes are its fusion-start's
_FUSIONS = ("fusion", "fusion-start")  # XLA:GPU (jax 0.12) runs some fusions, stack updates among them, asynchronously


def kernel_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """Computation → kind of op (`op_kinds`) → the bytes its ops read and write per call of the program (× the
    computation's runs per call): what a GPU's memory moves for them, before caches. A fusion reads each of its
    parameters whole, but one it only dynamic-slices (the slices) or only updates in place (operand 0 of a
    dynamic-update-slice: nothing), and writes its result, but a dynamic-update-slice root (its update); another op
    reads its operands and writes its results. Containers (while, call, conditional) move nothing themselves; an
    asynchronous fusion (fusion-start, fusion-done) moves what the fusion does, once."""
    comps, runs, kinds = parse_hlo(hlo_text), runs_per_call(hlo_text), op_kinds(hlo_text)
    inside = {ins.attr("calls") if ins.opcode in _FUSIONS else ins.attr("to_apply")  # a kernel's own code (a
              for instrs in comps.values() for ins in instrs if ins.opcode != "call"}  # reduction's lambda too)
    out: dict[str, dict[str, int]] = {}
    for comp, instrs in comps.items():
        if comp in inside or comp not in runs:
            continue
        shapes = {ins.name: ins.results() for ins in instrs}
        for ins in instrs:
            kind = kinds.get(ins.name)
            if kind is None or ins.opcode in _MOVES_NOTHING:
                continue
            if ins.opcode in _FUSIONS:
                moved = _fusion_bytes(comps[ins.attr("calls")])
            else:
                moved = (sum(array_bytes(*a) for name in ins.operands() for a in shapes.get(name, []))
                         + sum(array_bytes(*a) for a in ins.results()))
            per_kind = out.setdefault(comp, {})
            per_kind[kind] = per_kind.get(kind, 0) + moved * runs[comp]
    return out


MEMORY_BOUND_KINDS = ("other", "convert", "copy/transpose")  # `op_kinds` neither GEMMs, attention nor collectives


def memory_bound_bytes(hlo_text: str) -> int:
    """The bytes the program's memory-bound kernels (`MEMORY_BOUND_KINDS`) read and write per call (`kernel_bytes`)."""
    return sum(moved for kinds in kernel_bytes(hlo_text).values() for kind, moved in kinds.items()
               if kind in MEMORY_BOUND_KINDS)


def layer_loop_bytes(hlo_text: str, num_layers: int) -> float:
    """The bytes the memory-bound kernels of the layer loops (the forward scan and the backward one, with what
    they call: replays, the stacked buffers' slices and updates) move per layer: `kernel_bytes` / L."""
    comps, moved = parse_hlo(hlo_text), kernel_bytes(hlo_text)
    loops = layer_loops(comps, num_layers)
    if not loops:
        raise RuntimeError(f"expected layer loops with trip count {num_layers}, found none")
    inside = {comp for loop in loops for comp in _called(comps, loop.body)}
    return sum(b for comp in inside for kind, b in moved.get(comp, {}).items() if kind in MEMORY_BOUND_KINDS) / num_layers


def _fusion_bytes(instrs: list[Instr]) -> int:
    """The bytes a fusion reads and writes (`kernel_bytes`' rules), from its computation."""
    by_name = {ins.name: ins for ins in instrs}
    users: dict[str, list[Instr]] = {}
    for ins in instrs:
        for name in ins.operands():
            users.setdefault(name, []).append(ins)
    read = 0
    for p in (ins for ins in instrs if ins.opcode == "parameter"):
        uses = users.get(p.name, [])
        first = [u for u in uses if u.operands()[0] == p.name]
        if uses and len(first) == len(uses) and all(u.opcode == "dynamic-slice" for u in uses):
            read += sum(array_bytes(*a) for u in uses for a in u.arrays())
        elif not (uses and len(first) == len(uses) and all(u.opcode == "dynamic-update-slice" for u in uses)):
            read += sum(array_bytes(*a) for a in p.arrays())
    root = instrs[-1]
    outputs = [by_name[name] for name in root.operands()] if root.opcode == "tuple" else [root]
    written = sum(array_bytes(*a) for o in outputs
                  for a in (by_name[o.operands()[1]].arrays() if o.opcode == "dynamic-update-slice" else o.arrays()))
    return read + written


def while_loop(comps: dict[str, list[Instr]], trip_count: int) -> Instr:
    """The one `while` whose known trip count is `trip_count` (a pipeline's tick loop; `outer_loops`); ValueError
    otherwise."""
    loops = outer_loops(comps, trip_count)
    if len(loops) != 1:
        raise ValueError(f"{len(loops)} while loops with trip count {trip_count} (expected exactly one)")
    return loops[0]


def loop_carry(hlo_text: str, trip_count: int) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, per-device dims) of every array in the carry of the one `while` whose known trip count is
    `trip_count` (the pipeline's tick loop: its stash and receive buffers are carry elements)."""
    return while_loop(parse_hlo(hlo_text), trip_count).arrays()


def dot_flops(comps: dict[str, list[Instr]], comp: str, memo: dict | None = None, loops_once: bool = False) -> float:
    """FLOPs of the dots computation `comp` runs (2 × output elements × contracted size), following fusions
    and calls, a `while` × its known trip count (NaN if unknown; once with `loops_once`, as cost_analysis() counts
    it), a `conditional` at its dearest branch. Why: cost_analysis() counts a loop body once; dots are the matmuls,
    the FLOPs that matter on a GPU."""
    memo = {} if memo is None else memo
    if comp in memo:
        return memo[comp]
    by_name = {ins.name: ins for ins in comps[comp]}
    total = 0.0
    for ins in comps[comp]:
        cublas = ins.opcode == "custom-call" and f'custom_call_target="{CUBLAS}' in ins.rest
        if ins.opcode == "dot" or cublas:  # cuBLAS's GEMM: its result first, then its workspace
            out = ins.arrays()[0][1]
            lhs = by_name[ins.operands()[0]].arrays()[0][1]
            contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}|"lhs_contracting_dimensions":\[([0-9",]*)\]',
                                    ins.rest)
            dims = (contracting.group(1) or contracting.group(2) or "").replace('"', "")
            total += 2.0 * float(np.prod(out)) * float(np.prod([lhs[int(i)] for i in dims.split(",") if i]))
        elif ins.opcode in (*_FUSIONS, "call"):
            total += dot_flops(comps, ins.attr("calls") or ins.attr("to_apply"), memo, loops_once)
        elif ins.opcode == "while":
            n = 1 if loops_once else ins.trip_count()
            total += n * dot_flops(comps, ins.attr("body"), memo, loops_once) if n is not None else float("nan")
        elif ins.opcode == "conditional":
            total += max(dot_flops(comps, b, memo, loops_once) for b in ins.branches())
    memo[comp] = total
    return total


def inner_loop_dot_flops(hlo_text: str, num_layers: int) -> float:
    """The dot FLOPs of one layer that `cost_analysis()` leaves out: it counts a loop's body once, so of a loop
    inside a layer (the ring's scan over a block's query tiles) one iteration; the others' dots, over the forward
    and backward layer loops' bodies."""
    comps = parse_hlo(hlo_text)
    return sum(dot_flops(comps, loop.body) - dot_flops(comps, loop.body, loops_once=True)
               for loop in layer_loops(comps, num_layers))


def program_dot_flops(hlo_text: str) -> float:
    """`dot_flops` of a whole program: its entry computation's, loops at their trip counts."""
    return dot_flops(parse_hlo(hlo_text), entry_name(hlo_text))

