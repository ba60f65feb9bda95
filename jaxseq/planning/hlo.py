"""XLA's compiled programs read as text: the parser of optimized HLO (`parse_hlo`, `Instr`) and the vocabulary the
readers share (array sizes, the call graph, op names, the collective and custom-call names). Why read the text:
XLA's own accounting (the buffers a layer stores, the collectives it runs, its dots, its kernels' bytes) is the
program's, not a model of it.

The readers, one job each: `hlo_loops` (the layer and tick loops, what a layer stores), `hlo_collectives`
(collectives and their device groups), `hlo_flops` (the dots and their FLOPs), `hlo_kernels` (what each op's GPU
kernel does and the bytes it moves).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


# ---------------------------------------------------------------------------------------------
# Reading optimized HLO text

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")  # f8e4m3fn[…] too
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclass
class Instr:
    name: str
    shape: str  # the result type as printed: "bf16[4,1,128,64]{…}" or a tuple "(…)"
    opcode: str
    rest: str  # operands and attributes

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return tuple_elements(self.shape)

    def results(self) -> list[tuple[str, tuple[int, ...]]]:
        """The arrays an instruction produces. XLA:GPU's asynchronous all-gather-start and reduce-scatter-start
        carry (operands, results) as their tuple shape: their results are its last element."""
        if self.opcode in ("all-gather-start", "reduce-scatter-start") and self.shape.startswith("("):
            return tuple_elements(_top_level(self.shape[1:-1])[-1])
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


def tuple_elements(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a printed type, a tuple's elements in order."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


# ---------------------------------------------------------------------------------------------
# The vocabulary the readers share: the call graph, who uses a value, where an op came from, op names

def called_computations(comps, name, seen=None) -> list[str]:
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
                out += called_computations(comps, callee, seen)
        for callee in ins.branches():
            out += called_computations(comps, callee, seen)
    return out


def users(instrs: list[Instr]) -> dict[str, list[Instr]]:
    """A computation's value name → the instructions that take it as an operand."""
    out: dict[str, list[Instr]] = {}
    for ins in instrs:
        for operand in ins.operands():
            out.setdefault(operand, []).append(ins)
    return out


def op_name(rest: str) -> str:
    """The JAX op an instruction came from (its metadata's op_name, e.g. ".../bsf,fh->bsh/dot_general"); "" if none."""
    m = re.search(r'op_name="([^"]*)"', rest)
    return m.group(1) if m else ""


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
FUSIONS = ("fusion", "fusion-start")  # XLA:GPU (jax 0.12) runs some fusions, stack updates among them, asynchronously
CUDNN_ATTENTION = "__cudnn$fmha"  # the prefix of cuDNN's fused attention custom calls (jax/_src/cudnn)
CUBLAS = "__cublas$"  # cuBLAS's GEMM custom calls (__cublas$gemm, __cublas$lt$matmul)
