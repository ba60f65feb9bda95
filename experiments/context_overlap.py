"""Where the ring's K/V and dK/dV sends could overlap its block computations, read from the compiled program.

    python experiments/context_overlap.py   # 4 compiles: 1 min 42 s wall on a shared 2-core machine (76 s CPU);
                                            # prints the table (saved as experiments/results/context_overlap.txt)

The tiny model's loss-and-gradient program (selective recompute, micro-batch 2, float32 weights, the preset's
bf16 compute) is compiled for `ParallelConfig(context=c, tensor=t, context_strategy="ring")` on simulated CPU
devices, c ∈ {2, 4}, t ∈ {1, 2} (+ SP at t = 2). In each layer loop's body (forward, backward) every
collective-permute is placed in the body's dependence graph: the ring's block computations (a dot inside the
ring's shard_map, or a `lax.switch` conditional of it) it depends on, those that depend on it, and those that
are neither, which an asynchronous send could run beside. XLA:CPU lowers a collective-permute as one
synchronous op (no -start/-done pair), so the CPU order says nothing about overlap; the dependences come from
the program JAX emits (a send's operand, a switch's operands), not from the CPU backend, and they bound what a
GPU schedule can hide.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxseq.config import ParallelConfig  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.planning import hlo, hlo_loops  # noqa: E402
from jaxseq.training import aot  # noqa: E402

CONFIGS = ((2, 1), (2, 2), (4, 1), (4, 2))  # (context, tensor)
MODEL, REMAT, MICRO_BATCH = "tiny", "selective", 2


@dataclass(frozen=True, kw_only=True)
class Send:
    """One collective-permute of a layer loop's body and its place in the body's dependence graph."""

    name: str
    backward: bool
    carries: str  # "K/V" (a block as received) or "dK/dV" (an accumulator a block computation wrote)
    hop: int  # its place in its chain: 1 for the first send of a block or accumulator, 2 for the next …
    bytes: int  # per device, as the compiled program sends it
    blocks_before: int  # ring block computations it depends on (must finish before it can start)
    blocks_after: int  # ring block computations that depend on it (cannot start before it is done)
    blocks_free: int  # neither: what an asynchronous send could overlap
    other_dots_free: int  # the layer's other dots (projections, MLP) neither before nor after it
    into_switch: bool  # a `lax.switch` conditional (a whole ring step) consumes it directly
    position: int  # its index in the body's scheduled (CPU) order
    blocks_between: int  # block computations the CPU order puts between it and its first use


def compile_ring(context: int, tensor: int) -> str:
    """The scheduled HLO text of the tiny model's loss and gradient on the ring."""
    parallel = ParallelConfig(context=context, tensor=tensor, sequence_parallel=tensor > 1, context_strategy="ring")
    mesh = make_mesh(parallel, jax.devices()[:parallel.num_devices])
    return aot.compile_loss_and_grad(preset(MODEL), parallel, REMAT, mesh, MICRO_BATCH).as_text()


def _op_name(ins: hlo.Instr) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.rest)
    return m.group(1) if m else ""


# The ring's einsums (parallel/context.py: scores, probs·V, and backward's dS·K, dSᵀ·Q, Pᵀ·dO); the layer's
# projections are dots in a shard_map too (at t > 1), so the ring's are told apart by their [b, kv, g, q, s] scores.
RING_EINSUMS = ("bqkgd,bskd->bkgqs/", "bkgqs,bskd->bqkgd/", "bkgqs,bqkgd->bskd/")


def is_block(ins: hlo.Instr) -> bool:
    """A ring block computation: one of the ring's dots, or a step's `lax.switch` (a conditional whose branches
    hold them), inside the ring's shard_map."""
    name = _op_name(ins)
    if "shard_map/" not in name:
        return False
    return ins.opcode == "conditional" or any(e + "dot_general" in name for e in RING_EINSUMS)


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), []):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _first_blocks(start: str, users: dict[str, list[str]], blocks: set[str]) -> set[str]:
    """The block computations reached from `start` through non-block ops only: the ones waiting on it first."""
    seen, todo, found = set(), [start], set()
    while todo:
        for nxt in users.get(todo.pop(), []):
            if nxt in blocks:
                found.add(nxt)
            elif nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return found


def body_sends(instrs: list[hlo.Instr], backward: bool) -> list[Send]:
    """Every collective-permute of one computation (a layer loop's body), in scheduled order."""
    operands = {i.name: i.operands() for i in instrs}
    users: dict[str, list[str]] = {}
    for i in instrs:
        for op in operands[i.name]:
            users.setdefault(op, []).append(i.name)
    position = {i.name: k for k, i in enumerate(instrs)}
    blocks = {i.name for i in instrs if is_block(i)}
    dots = {i.name for i in instrs if _op_name(i).endswith("dot_general")} - blocks
    switches = {i.name for i in instrs if i.opcode == "conditional" and i.name in blocks}
    permutes = [i for i in instrs if i.opcode.removesuffix("-start") == "collective-permute"]
    before = {p.name: _closure(p.name, operands) for p in permutes}
    sends, hops = [], {}
    for p in permutes:
        after = _closure(p.name, users)
        carries = "dK/dV" if before[p.name] & blocks else "K/V"
        same = [q for q in before[p.name] if q in hops and hops[q][0] == carries]
        hops[p.name] = (carries, 1 + max((hops[q][1] for q in same), default=0))
        first_use = min(position[u] for u in users[p.name])
        between = sum(1 for i in instrs[position[p.name] + 1:first_use] if i.name in blocks)
        (dtype, dims), = p.arrays()[:1]
        sends.append(Send(name=p.name, backward=backward, carries=carries, hop=hops[p.name][1],
                          bytes=hlo.array_bytes(dtype, dims), blocks_before=len(before[p.name] & blocks),
                          blocks_after=len(after & blocks), blocks_free=len(blocks - before[p.name] - after),
                          other_dots_free=len(dots - before[p.name] - after),
                          into_switch=bool(_first_blocks(p.name, users, blocks) & switches),
                          position=position[p.name], blocks_between=between))
    return sends


def ring_sends(hlo_text: str, layers: int) -> list[Send]:
    """The collective-permutes of the forward and the backward layer loop's bodies."""
    comps = hlo.parse_hlo(hlo_text)
    out = []
    for loop in sorted(hlo_loops.layer_loops(comps, layers), key=lambda l: l.backward):
        out += body_sends(comps[loop.body], loop.backward)
    return out


def block_count(hlo_text: str, layers: int, backward: bool) -> tuple[int, int]:
    """(block computations, of which `lax.switch` conditionals) in a layer loop's body."""
    comps = hlo.parse_hlo(hlo_text)
    (loop,) = [l for l in hlo_loops.layer_loops(comps, layers) if l.backward == backward]
    instrs = [i for i in comps[loop.body] if is_block(i)]
    return len(instrs), sum(i.opcode == "conditional" for i in instrs)


def async_pairs(hlo_text: str) -> int:
    """collective-permute-start ops in the program (0 on XLA:CPU: its permutes are synchronous)."""
    return hlo_text.count("collective-permute-start(")


HEADER = (f"{'c':>2} {'t':>2} {'loop':<8} {'#':>2} {'carries':<6} {'hop':>3} {'KiB':>6} {'waits for':>9} "
          f"{'waited on by':>12} {'free':>5} {'into switch':>11} {'other dots free':>15} "
          f"{'CPU: blocks between send and use':>33}")


def row(c: int, t: int, k: int, s: Send) -> str:
    return (f"{c:>2} {t:>2} {'backward' if s.backward else 'forward':<8} {k:>2} {s.carries:<6} {s.hop:>3} "
            f"{s.bytes / 1024:>6.1f} {s.blocks_before:>9} {s.blocks_after:>12} {s.blocks_free:>5} "
            f"{'yes' if s.into_switch else 'no':>11} {s.other_dots_free:>15} {s.blocks_between:>33}")


def main() -> None:
    cfg = preset(MODEL)
    print(f"{MODEL} (h {cfg.hidden}, {cfg.heads} heads, s {cfg.seq_len}, L {cfg.layers}), {REMAT}, micro-batch "
          f"{MICRO_BATCH}; compiled by XLA:CPU (jax {jax.__version__}) on simulated devices.")
    print("Per collective-permute of a layer loop's body (source: the compiled, scheduled HLO). 'waits for' / "
          "'waited on by' / 'free':\nring block computations (a dot in the ring's shard_map, or a step's "
          "lax.switch conditional, counted as one) it depends on / that depend on it / neither.\n"
          "into switch: a step's lax.switch is among the first block computations that consume it (that whole step "
          "waits for it).\nother dots free: the layer's other dots (projections, MLP) neither before nor after it. "
          "CPU: ring block computations the CPU's\nsequential order runs between the (synchronous) send and its first "
          "use. KiB: bytes sent per device (XLA:CPU sends the bf16 K/V as f32).\n")
    print(HEADER)
    for c, t in CONFIGS:
        text = compile_ring(c, t)
        sends = ring_sends(text, cfg.layers)
        for backward in (False, True):
            for k, s in enumerate([s for s in sends if s.backward == backward]):
                print(row(c, t, k, s))
        fwd, bwd = block_count(text, cfg.layers, False), block_count(text, cfg.layers, True)
        print(f"   c={c} t={t}: collective-permute-start ops: {async_pairs(text)}; block computations (of which "
              f"switches) forward {fwd[0]} ({fwd[1]}), backward {bwd[0]} ({bwd[1]})", flush=True)


if __name__ == "__main__":
    main()
