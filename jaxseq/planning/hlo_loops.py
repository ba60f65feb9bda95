"""The loops of a compiled program, read from its HLO text: the layer loops (`lax.scan` over the layers, the
forward one and its transpose), what the forward one stores for backward, a pipeline's tick loop and its carry, and
how many times each computation runs.

With the layers under `lax.scan`, every tensor a layer keeps for backward is a stacked [L, …] buffer that the
forward loop writes; its per-device size / L is the per-layer stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxseq.planning.hlo import (FUSIONS, Instr, array_bytes, called_computations, entry_name, op_name, parse_hlo,
                                 tuple_elements)


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
    inside = {name for _, loop in loops for name in called_computations(comps, loop.attr("body"))}
    return [ins for comp, ins in loops if comp not in inside]


def layer_loops(comps: dict[str, list[Instr]], num_layers: int) -> list[ScanLoop]:
    loops = []
    for ins in outer_loops(comps, num_layers):
        body = ins.attr("body")
        loop = ScanLoop(ins.name, body, "transpose(" in op_name(ins.rest))
        root = comps[body][-1]
        by_name = {i.name: i for i in comps[body]}
        for elem, operand in zip(tuple_elements(ins.shape), root.operands()):
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
    callee = producer.attr("calls") if producer.opcode in FUSIONS else None
    return bool(callee) and any(i.opcode == "dynamic-update-slice" for i in comps.get(callee, []))


def stored_bytes_per_layer(hlo_text: str, num_layers: int) -> int:
    """Per-device bytes one layer keeps for backward: the stacked buffers the forward scan writes, / L."""
    loops = [l for l in layer_loops(parse_hlo(hlo_text), num_layers) if not l.backward]
    if len(loops) != 1:
        raise RuntimeError(f"expected one forward layer loop with trip count {num_layers}, found {len(loops)}")
    return sum(array_bytes(dt, dims) for dt, dims in loops[0].written) // num_layers


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


def loop_bodies(comps) -> set[str]:
    """Every computation a while loop's body runs (its callees and conditional branches included)."""
    return {c for instrs in comps.values() for ins in instrs if ins.opcode == "while"
            for c in called_computations(comps, ins.attr("body"))}
