"""What each op of a compiled program runs as on a GPU, read from its HLO text: the kind of its kernel (`op_kinds`:
GEMM, attention, collective, convert, copy, elementwise) and the bytes the kernels read and write per call
(`kernel_bytes`), for a profile's time per kind and the search's price of the memory-bound kernels
(`memory_bound_bytes`, `layer_loop_bytes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxseq.planning.hlo import (COLLECTIVES, CUBLAS, CUDNN_ATTENTION, FUSIONS, Instr, array_bytes,
                                 called_computations, parse_hlo, users)
from jaxseq.planning.hlo_loops import layer_loops, runs_per_call


_COPY_OPCODES = {"copy", "transpose", "convert", "broadcast"}  # a fusion of only these is a copy's kernel


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
            elif ins.opcode in ("copy", "transpose") or (inner and inner <= _COPY_OPCODES):
                kinds[ins.name] = "copy/transpose"
            else:
                kinds[ins.name] = "other"
    return kinds


_MOVES_NOTHING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                  "fusion-done"}  # an asynchronous fusion's bytes are its fusion-start's


@dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program: its computation, kind (`op_kinds`), the bytes it reads and writes per call of
    the program (× its computation's runs per call) and its HLO instruction (for its op name and results)."""

    computation: str
    kind: str
    moved_bytes: int
    instr: Instr


def kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel of the program with what a GPU's memory moves for it, before caches. A fusion reads each of its
    parameters whole, but one it only slices, dynamically or not (the slices), or only updates in place (operand 0 of a
    dynamic-update-slice: nothing), and writes its result, but a dynamic-update-slice root (its update); another op
    reads its operands and writes its results. Containers (while, call, conditional) move nothing themselves; an
    asynchronous fusion (fusion-start, fusion-done) moves what the fusion does, once."""
    comps, runs, kinds = parse_hlo(hlo_text), runs_per_call(hlo_text), op_kinds(hlo_text)
    inside = {ins.attr("calls") if ins.opcode in FUSIONS else ins.attr("to_apply")  # a kernel's own code (a
              for instrs in comps.values() for ins in instrs if ins.opcode != "call"}  # reduction's lambda too)
    out = []
    for comp, instrs in comps.items():
        if comp in inside or comp not in runs:
            continue
        shapes = {ins.name: ins.results() for ins in instrs}
        for ins in instrs:
            kind = kinds.get(ins.name)
            if kind is None or ins.opcode in _MOVES_NOTHING:
                continue
            if ins.opcode in FUSIONS:
                moved = _fusion_bytes(comps[ins.attr("calls")])
            else:
                moved = (sum(array_bytes(*a) for name in ins.operands() for a in shapes.get(name, []))
                         + sum(array_bytes(*a) for a in ins.results()))
            out.append(Kernel(comp, kind, moved * runs[comp], ins))
    return out


def kernel_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """Computation → kind of op (`op_kinds`) → the bytes its kernels read and write per call of the program
    (`kernels`)."""
    out: dict[str, dict[str, int]] = {}
    for k in kernels(hlo_text):
        per_kind = out.setdefault(k.computation, {})
        per_kind[k.kind] = per_kind.get(k.kind, 0) + k.moved_bytes
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
    inside = {comp for loop in loops for comp in called_computations(comps, loop.body)}
    layer_bytes = sum(b for comp in inside for kind, b in moved.get(comp, {}).items() if kind in MEMORY_BOUND_KINDS)
    return layer_bytes / num_layers


FP8_FORMATS = {"f8e4m3fn": "e4m3", "f8e5m2": "e5m2"}  # XLA's names of the formats models/fp8.py quantizes to


def fp8_copy_bytes(hlo_text: str, num_layers: int) -> dict[str, float]:
    """The FP8 arrays the layer loops' kernels write per layer (per call of the program / L), by format and whether
    the kernel transposes ("e4m3", "e4m3 transposed", "e5m2", "e5m2 transposed"): the copies of a layer's GEMM operands
    an FP8 step makes (the transposed ones for the backward GEMMs, whose cuBLASLt FP8 form takes both operands with
    the contracted dimension innermost). {} where the program has no layer loop."""
    comps, runs = parse_hlo(hlo_text), runs_per_call(hlo_text)
    loops = layer_loops(comps, num_layers)
    out: dict[str, float] = {}
    for comp in {c for loop in loops for c in called_computations(comps, loop.body)}:
        for ins in comps[comp]:
            if ins.opcode not in (*FUSIONS, "copy", "transpose", "convert") or comp not in runs:
                continue
            body = comps.get(ins.attr("calls") or "", [])
            moves = "transpose" in {i.opcode for i in body} or ins.opcode in ("copy", "transpose")
            for dtype, dims in ins.results():
                if dtype in FP8_FORMATS:
                    key = FP8_FORMATS[dtype] + (" transposed" if moves else "")
                    out[key] = out.get(key, 0.0) + array_bytes(dtype, dims) * runs[comp] / num_layers
    return out


def _fusion_bytes(instrs: list[Instr]) -> int:
    """The bytes a fusion reads and writes (`kernel_bytes`' rules), from its computation."""
    by_name = {ins.name: ins for ins in instrs}
    users_of = users(instrs)
    read = 0
    for p in (ins for ins in instrs if ins.opcode == "parameter"):
        uses = users_of.get(p.name, [])
        first = [u for u in uses if u.operands()[0] == p.name]
        if uses and len(first) == len(uses) and all(u.opcode in ("dynamic-slice", "slice") for u in uses):
            read += sum(array_bytes(*a) for u in uses for a in u.arrays())
        elif not (uses and len(first) == len(uses) and all(u.opcode == "dynamic-update-slice" for u in uses)):
            read += sum(array_bytes(*a) for a in p.arrays())
    root = instrs[-1]
    outputs = [by_name[name] for name in root.operands()] if root.opcode == "tuple" else [root]
    written = sum(array_bytes(*a) for o in outputs
                  for a in (by_name[o.operands()[1]].arrays() if o.opcode == "dynamic-update-slice" else o.arrays()))
    return read + written
