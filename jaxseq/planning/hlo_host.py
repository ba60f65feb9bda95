"""Host memory in a compiled program, read from its HLO text: the arrays XLA placed in host memory (memory space
S(5), JAX's `pinned_host`), the layer loop's stacked buffers there (what `--offload` sends out of a scanned layer),
and the copies that move data between the device and the host.

How XLA:GPU spells a transfer (the programs compiled for an H100 here, JAX 0.10.2): a scanned layer's offloaded
residual is a stacked [L, …] buffer in S(5) that the forward loop fills by a `dynamic-update-slice` of the device's
value into it (device → host) and the backward loop reads by a `dynamic-slice` of it into device memory (host →
device), each wrapped as an asynchronous fusion; an unrolled layer's, a `copy-start` into S(5) and one out of it; a
pipeline stage's stash slot, the same slices of its buffer in S(5). An offload XLA dropped has none of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxseq.planning.hlo import Instr, array_bytes, parse_hlo
from jaxseq.planning.hlo_loops import outer_loops

HOST_SPACE = "S(5)"  # XLA's memory space of host memory (the layout's suffix: {3,2,1,0:S(5)})
_TYPED = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")


def typed_arrays(shape: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """(dtype, dims, in host memory) of every array in a printed type, a tuple's elements in order."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d), HOST_SPACE in (layout or ""))
            for dt, dims, layout in _TYPED.findall(shape)]


def host_stacks(hlo_text: str, num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The stacked [L, …] buffers in host memory that the forward layer loop carries: one per offloaded residual of
    a scanned layer (per device)."""
    comps = parse_hlo(hlo_text)
    loops = [ins for ins in outer_loops(comps, num_layers) if "transpose(" not in ins.rest.split("op_name=")[-1][:200]]
    if len(loops) != 1:
        raise RuntimeError(f"expected one forward layer loop with trip count {num_layers}, found {len(loops)}")
    return [(dt, dims) for dt, dims, host in typed_arrays(loops[0].shape) if host and dims and dims[0] == num_layers]


def host_bytes_per_layer(hlo_text: str, num_layers: int) -> int:
    """Per-device bytes one scanned layer keeps in host memory for its backward (`host_stacks` / L)."""
    return sum(array_bytes(dt, dims) for dt, dims in host_stacks(hlo_text, num_layers)) // num_layers


@dataclass(frozen=True)
class Transfer:
    """One copy between the device and the host: its direction, the op, and the host array's (dtype, dims)."""

    to_host: bool
    opcode: str
    host_array: tuple[str, tuple[int, ...]]


def transfers(hlo_text: str) -> list[Transfer]:
    """Every device → host and host → device copy of the program: a `dynamic-update-slice` of a device value into a
    host buffer and a `dynamic-slice` of a host buffer into device memory (a scanned layer's, a stash slot's), and a
    `copy` or `copy-start` between the two memories. The host array is the buffer written or read."""
    found = []
    for instrs in parse_hlo(hlo_text).values():
        types = {ins.name: ins.shape for ins in instrs}
        for ins in instrs:
            move = _transfer(ins, types)
            if move is not None:
                found.append(move)
    return found


def _transfer(ins: Instr, types: dict[str, str]) -> Transfer | None:
    operands = [typed_arrays(types.get(name, "")) for name in ins.operands()]
    result = typed_arrays(ins.shape)
    if not result or not operands or not operands[0]:
        return None
    if ins.opcode == "copy-start":  # (destination, source, context)
        result = result[:1]
    (dt, dims, out_host), (in_dt, in_dims, in_host) = result[0], operands[0][0]
    if (ins.opcode == "dynamic-update-slice" and out_host and len(operands) > 1 and operands[1]
            and not operands[1][0][2]):
        return Transfer(True, ins.opcode, (dt, dims))
    if ins.opcode == "dynamic-slice" and in_host and not out_host:
        return Transfer(False, ins.opcode, (in_dt, in_dims))
    if ins.opcode in ("copy", "copy-start") and in_host != out_host:
        return Transfer(out_host, ins.opcode, (dt, dims) if out_host else (in_dt, in_dims))
    return None


def host_arrays_moved(hlo_text: str) -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
    """Host array (dtype, dims) → (device → host copies, host → device copies) of it in the program's text."""
    counts: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    for t in transfers(hlo_text):
        out, back = counts.get(t.host_array, (0, 0))
        counts[t.host_array] = (out + t.to_host, back + (not t.to_host))
    return counts
