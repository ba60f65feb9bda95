"""The collectives of a compiled program, read from its HLO text: those one iteration of a layer loop performs
(`loop_collectives`, for the planner's communication time), every floating-point all-gather and gradient
reduction (`all_gathers`, `reductions`, for the tests and experiments), and the device groups each runs over in
every form XLA prints them (`replica_groups`). The ring traffic they cost is the search's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from jaxseq.planning.hlo import COLLECTIVES, called_computations, op_name, parse_hlo, users
from jaxseq.planning.hlo_loops import layer_loops, loop_bodies


@dataclass(frozen=True)
class Collective:
    kind: str  # all-gather | all-reduce | reduce-scatter | … ; an all-reduce whose value is only ever
    #            dynamic-sliced is reported as reduce-scatter (XLA:CPU 0.10 forms no reduce-scatter from
    #            automatic partitioning; GPU/TPU compilers fuse the pair into one)
    elements: int  # elements of the full (unscattered) buffer, per device
    group_size: int
    source: str = ""  # the jaxpr op it came from (HLO metadata op_name), e.g. ".../bsf,fh->bsh/dot_general"
    groups: tuple | None = None  # its device groups (`replica_groups`), None where they are not read
    instruction: str = ""  # the HLO instruction (a tuple collective, as XLA:CPU writes an all-to-all, has several)


_PASS_THROUGH = {"convert", "bitcast", "copy", "reshape", "get-tuple-element"}


def _slices_only(comps, comp: str, name: str, users_of=None, outer=None) -> bool:
    """Whether every use of the value `name` in computation `comp` ends in a dynamic-slice *of that
    value*, looking through converts and bitcasts (XLA:CPU computes bf16 collectives in f32 and
    converts back) and through the fusions it is passed to (into them, and out of them when it is
    their result). A fusion that consumes the value whole and slices something else (a layer's bias,
    say: newer XLA fuses both into one kernel) does not count. `outer`: (computation, fusion) that
    called `comp`, when `comp` is a fused computation."""
    users_of = users(comps[comp]) if users_of is None else users_of
    uses = users_of.get(name, [])
    if not uses:
        # The fusion's result: follow it in the computation that called the fusion.
        return outer is not None and comps[comp][-1].name == name and _slices_only(comps, *outer)
    for u in uses:
        operands = u.operands()
        if u.opcode == "dynamic-slice" and operands[0] == name:
            continue
        if u.opcode in _PASS_THROUGH and _slices_only(comps, comp, u.name, users_of, outer):
            continue
        if u.opcode == "fusion" and u.attr("calls") in comps:
            callee = u.attr("calls")
            params = {int(i.rest.split(")")[0]): i.name for i in comps[callee] if i.opcode == "parameter"}
            inner = users(comps[callee])
            if all(_slices_only(comps, callee, params[k], inner, (comp, u.name)) for k, op in enumerate(operands)
                   if op == name):
                continue
        return False
    return True


def loop_collectives(hlo_text: str, num_layers: int, backward: bool) -> list[Collective]:
    """The collectives one iteration of the forward (or backward) layer loop performs."""
    comps = parse_hlo(hlo_text)
    loops = [l for l in layer_loops(comps, num_layers) if l.backward == backward]
    if len(loops) != 1:
        raise RuntimeError(f"expected one {'backward' if backward else 'forward'} layer loop, found {len(loops)}")
    out = []
    for comp in called_computations(comps, loops[0].body):
        users_of = users(comps[comp])
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
                        (u.name for u in users_of.get(ins.name, []) if u.opcode == "get-tuple-element"
                         and f"index={index}" in u.rest), None)
                    if value and _slices_only(comps, comp, value, users_of):
                        kind = "reduce-scatter"
                elements = int(np.prod(dims, dtype=np.int64))
                if base == "reduce-scatter":
                    elements *= size  # report the full buffer, like the others
                groups = replica_groups(ins.rest)
                out.append(Collective(kind, elements, size, op_name(ins.rest),
                                      None if groups is None else tuple(map(tuple, groups)), ins.name))
    return out


@dataclass(frozen=True)
class Gather:
    """One floating-point all-gather result of a compiled program."""

    dtype: str
    dims: tuple[int, ...]
    in_loop: bool  # inside a while loop's body (a scan), i.e. run once per iteration
    op_name: str  # the JAX op it came from, "?" when the HLO does not say


def all_gathers(hlo_text: str, group_size: int) -> list[Gather]:
    """Every floating-point all-gather over groups of `group_size` devices, and whether it runs in a loop."""
    comps = parse_hlo(hlo_text)
    in_loops = loop_bodies(comps)
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
    in_loops = loop_bodies(comps)
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
                                     tuple(groups) if groups else None, comp in in_loops, op_name(ins.rest),
                                     tuple(dt for dt, _ in floats)))
    return out
