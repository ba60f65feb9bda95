"""The dots of a compiled program and their FLOPs, read from its HLO text. Why not `cost_analysis()`: it counts a
loop's body once, and its FLOPs are every op's; the dots (XLA's own, or cuBLAS's GEMM calls in a program autotuned
on a GPU) are the matmuls, the FLOPs that matter on a GPU, and the element types they compute in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from jaxseq.planning.hlo import CUBLAS, FUSIONS, Instr, entry_name, op_name, parse_hlo
from jaxseq.planning.hlo_loops import layer_loops


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
                               op_name(ins.rest)))
    return out


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
        if ins.opcode == "dot" or cublas:
            total += _gemm_flops(ins, by_name)
        elif ins.opcode in (*FUSIONS, "call"):
            total += dot_flops(comps, ins.attr("calls") or ins.attr("to_apply"), memo, loops_once)
        elif ins.opcode == "while":
            n = 1 if loops_once else ins.trip_count()
            total += n * dot_flops(comps, ins.attr("body"), memo, loops_once) if n is not None else float("nan")
        elif ins.opcode == "conditional":
            total += max(dot_flops(comps, b, memo, loops_once) for b in ins.branches())
    memo[comp] = total
    return total


def _gemm_flops(ins: Instr, by_name: dict[str, Instr]) -> float:
    """2 × output elements × contracted size of a dot or a cuBLAS GEMM call (its result first, then its workspace)."""
    out = ins.arrays()[0][1]
    lhs = by_name[ins.operands()[0]].arrays()[0][1]
    contracting = re.search(r'lhs_contracting_dims=\{([0-9,]*)\}|"lhs_contracting_dimensions":\[([0-9",]*)\]', ins.rest)
    dims = (contracting.group(1) or contracting.group(2) or "").replace('"', "")
    return 2.0 * float(np.prod(out)) * float(np.prod([lhs[int(i)] for i in dims.split(",") if i]))


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


FP8_TYPES = ("f8e4m3fn", "f8e5m2")  # XLA's names of the FP8 formats models/fp8.py quantizes to


@dataclass(frozen=True)
class GemmCount:
    """The GEMMs a program runs per call (a loop's × its trip count, a conditional's dearest branch) and how many of
    them are FP8 GEMMs: cuBLASLt's FP8 matmul (`__cublas$lt$matmul$f8`), or a dot (XLA's, or inside a fusion: a Triton
    GEMM) whose operands are both FP8 as it takes them; and their FLOPs, all and FP8 (`dot_flops`' count)."""

    gemms: int
    fp8_gemms: int
    flops: float = 0.0
    fp8_flops: float = 0.0


def gemm_count(hlo_text: str) -> GemmCount:
    """`GemmCount` of a whole program (its entry computation's, loops at their trip counts)."""
    return GemmCount(*_gemms(parse_hlo(hlo_text), entry_name(hlo_text), {}))


def _gemms(comps: dict[str, list[Instr]], comp: str, memo: dict) -> tuple[int, int, float, float]:
    """(GEMMs, FP8 GEMMs, their FLOPs, the FP8 ones' FLOPs) that computation `comp` runs per call."""
    if comp in memo:
        return memo[comp]
    by_name = {ins.name: ins for ins in comps[comp]}
    types = {ins.name: ins.arrays()[0][0] for ins in comps[comp] if not ins.shape.startswith("(") and ins.arrays()}
    total = np.zeros(4)
    for ins in comps[comp]:
        target = re.search(r'custom_call_target="([^"]*)"', ins.rest) if ins.opcode == "custom-call" else None
        if target and target.group(1).startswith(CUBLAS) or ins.opcode == "dot":
            fp8 = (target.group(1).endswith("$f8") if target else
                   all(types.get(a) in FP8_TYPES for a in ins.operands()[:2]))
            flops = _gemm_flops(ins, by_name)
            total += (1, fp8, flops, flops * fp8)
        elif ins.opcode in (*FUSIONS, "call"):
            total += _gemms(comps, ins.attr("calls") or ins.attr("to_apply"), memo)
        elif ins.opcode == "while":
            total += (ins.trip_count() or 0) * np.array(_gemms(comps, ins.attr("body"), memo))
        elif ins.opcode == "conditional":
            total += max(_gemms(comps, b, memo) for b in ins.branches())
    memo[comp] = (int(total[0]), int(total[1]), float(total[2]), float(total[3]))
    return memo[comp]
