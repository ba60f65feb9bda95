"""Pipeline schedules as data: each stage's op order, the lock-step tick table, buffer depths, the bubble.

p stages, v chunks (virtual stages) per stage, m micro-batches. An op is F(mb, chunk) or B(mb, chunk); under
zb-h1 the backward is split into B (the input gradient, which the previous stage waits for) and W (the weight
gradients, which nobody waits for), and an op may also be W(mb, chunk).
Stage s, chunk c holds layers (c·p + s)·k … (c·p + s)·k + k − 1 with k = L/(p·v) (Megatron's interleaved
assignment; with v = 1 stage s holds the s-th block of L/p layers).

- `stage_order`: the op order per stage. GPipe: all forwards, then all backwards. 1F1B: p − s − 1
  warm-up forwards, then alternate F and B, then the cool-down backwards (Narayanan et al. 2021, §2.2).
  Interleaved 1F1B: Megatron-LM's `forward_backward_pipelining_with_interleaving` op order. ZB-H1 (Qi et al.,
  Zero Bubble Pipeline Parallelism, 2024): 1F1B's order with each B followed by its W, except that stage s
  defers its first s W's to the end, where 1F1B's cool-down would idle; stage s then holds at most p − s
  micro-batches' activations, as 1F1B, plus at most s + 1 deferred W's inputs (`deferred`). Over v chunks per
  stage, the same rule in the interleaved numbering (PyTorch's `ScheduleInterleavedZeroBubble`).
- `tick_table`: the lock-step timeline the executor runs, one op (or idle) per stage per tick. Each stage
  runs its next op as soon as what it depends on ran at an earlier tick (an activation or gradient
  computed at tick t is sent between ticks t and t + 1). For 1F1B and interleaved that takes
  2mv + 2(p − 1) ticks, so the idle share equals the paper's bubble (p − 1)/m, (p − 1)/(v·m); ZB-H1 takes
  3mv + p − 1 ticks, a bubble of (p − 1)/(3·v·m) at F = B = W ((p − 1)/(3m) with one chunk, the paper's).
  `lockstep_time` weighs the ticks by what each op costs: a tick takes its slowest stage's op, so 1F1B's
  ticks, where some stage runs a whole backward, cost B + W, while ZB-H1's cost one of F, B, W.
- Buffer slots: the executor keeps each F's residuals in a stash slot until its B, and each received
  activation / gradient in a receive slot until it is consumed; slots are assigned here, lowest free first,
  so the buffers' depths are the schedule's true in-flight counts.
- Forward only (evaluation): each stage runs its forwards in the same order and nothing else, so stage 0
  never waits: mv + p − 1 ticks, no stash, no gradient slots (Megatron's `forward_only` runs every
  micro-batch as warm-up the same way).

`python -m jaxseq.schedule --pipe 4 --microbatches 8 [--virtual-stages 2] [--schedule 1f1b]` prints one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from jaxseq.config import validate_pipeline

# Op kinds: the tick table's `kind` field. (The executor's lax.switch branches are not these: it splits
# FORWARD and BACKWARD by the first and last chunk, `pipeline.Branch`.)
IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3

SPLIT_BACKWARD = ("zb-h1",)  # the schedules whose backward is B and W ops


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B" or "W" (a weight gradient, split from its B: zb-h1)
    mb: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def stage_order(schedule: str, p: int, m: int, v: int, s: int) -> list[Op]:
    """Stage s's ops in execution order."""
    if schedule == "gpipe":
        return [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(p - s - 1, m)
        ops = [Op("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Op("F", warmup + i, 0), Op("B", i, 0)]
        return ops + [Op("B", i, 0) for i in range(m - warmup, m)]
    if schedule == "zb-h1":
        return _zb_h1_order(p, m, v, s)
    # Megatron-LM's interleaved order: after its warm-up forwards, a stage alternates F and B.
    total = m * v
    warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
    forward, backward = _interleaved_ops(p, v)
    ops = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [forward(warmup + k), backward(k)]
    return ops + [backward(k) for k in range(total - warmup, total)]


def _interleaved_ops(p: int, v: int):
    """Megatron-LM's interleaved numbering: virtual micro-batch k runs chunk (k mod pv) // p of micro-batch
    (k // pv)·p + k mod p going forward; backward visits the chunks in reverse. With v = 1, micro-batch k."""
    forward = lambda k: Op("F", (k // (p * v)) * p + k % p, (k % (p * v)) // p)
    backward = lambda k: Op("B", (k // (p * v)) * p + k % p, v - 1 - (k % (p * v)) // p)
    return forward, backward


def _zb_h1_order(p: int, m: int, v: int, s: int) -> list[Op]:
    """ZB-H1: 1F1B's F and B order, each B followed by its W, but stage s's first s W's wait until after its
    last B (the last stages' B's then reach stage 0 one tick apart, and the W's fill 1F1B's cool-down).
    With v chunks per stage, the same over the interleaved numbering after (p − s − 1) + (v − 1)·p warm-up
    forwards (interleaved 1F1B warms up with 2(p − s − 1) + (v − 1)·p: there a B follows each F at once, here
    a W between them gives the gradients time to return): PyTorch's `ScheduleInterleavedZeroBubble` (ZB1P)."""
    total = m * v
    warmup = min(p - s - 1 + (v - 1) * p, total)
    forward, backward = _interleaved_ops(p, v)
    ops, deferred = [forward(k) for k in range(warmup)], []
    for k in range(total):
        b = backward(k)
        ops += ([forward(warmup + k)] if warmup + k < total else []) + [b]
        deferred.append(Op("W", b.mb, b.chunk))
        if len(deferred) > s:
            ops.append(deferred.pop(0))
    return ops + deferred


def lockstep_ticks(p: int, m: int, v: int) -> int:
    """Ticks of a lock-step 1F1B / interleaved / GPipe run: 2mv busy ticks per stage + 2(p − 1) fill and drain."""
    return 2 * m * v + 2 * (p - 1)


def paper_bubble_formula(schedule: str, v: int) -> str:
    """`paper_bubble` as printed: the formula of the schedule the executor runs at v chunks per stage."""
    if schedule == "zb-h1":
        return "(p−1)/(3·v·m)" if v > 1 else "(p−1)/(3m)"
    return "(p−1)/(v·m)" if schedule == "interleaved" else "(p−1)/m"


def paper_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Narayanan et al.: bubble time relative to the ideal time, (p − 1)/m; (p − 1)/(v·m) interleaved. Qi et al.:
    (p − 1)/(3m) for ZB-H1 at F = B = W; with v chunks, (p − 1)/(3·v·m) (its 3mv + p − 1 ticks)."""
    if schedule == "zb-h1":
        return (p - 1) / (3 * v * m)
    return (p - 1) / (v * m) if schedule == "interleaved" else (p - 1) / m


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule resolved into the tick table the executor runs."""

    name: str  # gpipe | 1f1b | interleaved | zb-h1
    pipe: int
    microbatches: int
    virtual_stages: int = 1
    forward_only: bool = False  # evaluation: the forwards in the schedule's order, no backward

    @staticmethod
    def make(schedule: str, pipe: int, microbatches: int, virtual_stages: int = 1, layers: int | None = None,
             forward_only: bool = False):
        name = validate_pipeline(pipe, microbatches, virtual_stages, schedule, layers)
        return Schedule(name, pipe, microbatches, virtual_stages, forward_only)

    @property
    def p(self) -> int:
        return self.pipe

    @property
    def m(self) -> int:
        return self.microbatches

    @property
    def v(self) -> int:
        return self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """Whether the backward runs as B and W ops (zb-h1; forward only: no backward at all)."""
        return self.name in SPLIT_BACKWARD and not self.forward_only

    def order(self, s: int) -> list[Op]:
        ops = stage_order(self.name, self.p, self.m, self.v, s)
        return [op for op in ops if op.kind == "F"] if self.forward_only else ops

    def layers_of(self, s: int, c: int, layers: int) -> list[int]:
        """The model layers stage s runs as chunk c (Megatron's interleaved assignment)."""
        k = layers // (self.p * self.v)
        return list(range((c * self.p + s) * k, (c * self.p + s + 1) * k))

    # -----------------------------------------------------------------------------------------
    # The lock-step timeline

    def _dependency(self, s: int, op: Op):
        """(stage, op) that must have run at an earlier tick, or None."""
        p, v = self.p, self.v
        if op.kind == "W":
            return s, Op("B", op.mb, op.chunk)  # the weight gradient needs its own B's output gradients
        if op.kind == "F":
            if s > 0:
                return s - 1, Op("F", op.mb, op.chunk)
            return (p - 1, Op("F", op.mb, op.chunk - 1)) if op.chunk > 0 else None
        if s < p - 1:
            return s + 1, Op("B", op.mb, op.chunk)
        if op.chunk < v - 1:
            return 0, Op("B", op.mb, op.chunk + 1)
        return s, Op("F", op.mb, op.chunk)  # the loss: the last chunk's own forward

    @cached_property
    def timeline(self) -> list[list[Op | None]]:
        """timeline[t][s]: the op stage s runs at tick t (None: idle)."""
        orders = [self.order(s) for s in range(self.p)]
        position = [0] * self.p
        done: dict[tuple[int, Op], int] = {}  # (stage, op) → tick
        ticks = []
        while any(position[s] < len(orders[s]) for s in range(self.p)):
            t = len(ticks)
            row = []
            for s in range(self.p):
                op = orders[s][position[s]] if position[s] < len(orders[s]) else None
                if op is not None:
                    dep = self._dependency(s, op)
                    if dep is not None and done.get(dep, t) >= t:
                        op = None
                row.append(op)
            for s, op in enumerate(row):
                if op is not None:
                    done[(s, op)] = t
                    position[s] += 1
            ticks.append(row)
            if t > 4 * len(orders[0]) + 4 * self.p:  # a schedule whose order deadlocks
                raise RuntimeError(f"{self.name} p={self.p} m={self.m} v={self.v}: the op order deadlocks")
        return ticks

    @property
    def ticks(self) -> int:
        return len(self.timeline)

    @property
    def busy_ticks(self) -> int:
        """Ops per stage: a forward and a backward (zb-h1: a B and a W) of each micro-batch through each of its
        v chunks (forward only: the forwards)."""
        return (1 if self.forward_only else 3 if self.split_backward else 2) * self.m * self.v

    @property
    def idle_ticks(self) -> int:
        """Idle slots per stage (every stage idles the same number of ticks)."""
        return self.ticks - self.busy_ticks

    @property
    def bubble(self) -> float:
        """Idle over busy ticks: the bubble relative to the ideal time, in units where F = B = one tick."""
        return self.idle_ticks / self.busy_ticks

    @property
    def paper_bubble(self) -> float:
        return paper_bubble(self.name, self.p, self.m, self.v)

    def in_flight(self, s: int) -> int:
        """Most chunk inputs stage s holds at once (forwards whose backward has not run yet; forward only:
        none, nothing is kept for a backward)."""
        if self.forward_only:
            return 0
        held = most = 0
        for op in self.order(s):
            held += 1 if op.kind == "F" else -1
            most = max(most, held)
        return most

    def deferred(self, s: int) -> int:
        """Most deferred weight gradients stage s holds at once (B's whose W has not run: each keeps its weight
        matmuls' inputs and output gradients, the W stash); 0 unless the backward is split."""
        held = most = 0
        for op in self.order(s) if self.split_backward else ():
            held += {"B": 1, "W": -1}.get(op.kind, 0)
            most = max(most, held)
        return most

    def lockstep_time(self, forward: float, backward: float, weight: float) -> float:
        """The step's time when each op takes its cost and every tick waits for its slowest stage (the
        executor's ppermutes after each tick): Σ over ticks of the largest op cost. `backward` is the input
        gradient's cost and `weight` the weight gradients'; an unsplit schedule's B costs both."""
        cost = {"F": forward, "B": backward if self.split_backward else backward + weight, "W": weight}
        return sum(max((cost[op.kind] for op in row if op is not None), default=0.0) for row in self.timeline)

    def lockstep_bubble(self, forward: float, backward: float, weight: float) -> float:
        """`lockstep_time` over the ideal m·v·(F + B + W) per stage, minus one: the bubble in time, not ticks."""
        ideal = self.m * self.v * (forward + (0.0 if self.forward_only else backward + weight))
        return self.lockstep_time(forward, backward, weight) / ideal - 1

    def in_flight_layers(self, layers: int) -> int:
        """Layers' worth of activations stage 0 keeps at once: its chunks in flight × L/(p·v) layers per
        chunk (the first stage's memory in the plan and the search)."""
        return self.in_flight(0) * (layers // (self.p * self.v))

    # -----------------------------------------------------------------------------------------
    # Buffer slots: what the executor reads and writes at each tick

    @property
    def tables(self) -> dict[str, np.ndarray]:
        """int32 [ticks, p] arrays, one per field; −1 where a field does not apply.

        kind: IDLE / FORWARD / BACKWARD; mb, chunk: the op's micro-batch and chunk;
        stash: the residual slot an F writes and its B reads;
        w_slot: the deferred-gradient slot a B writes and its W reads (zb-h1);
        first / last: the op runs the model's first chunk (embedding) / last chunk (loss);
        x_slot: the receive slot an F reads its input from (−1: the embedding);
        g_slot: the receive slot a B reads its output gradient from (for the last chunk: the loss gradient
          its F put there);
        recv_x / recv_g: the slot the activation / gradient arriving after this tick is written to.
        """
        return self._slots[0]

    @cached_property
    def _slots(self):
        p, T = self.p, self.ticks
        fields = ("kind", "mb", "chunk", "stash", "w_slot", "first", "last", "x_slot", "g_slot", "recv_x", "recv_g")
        tab = {f: np.full((T, p), -1, np.int32) for f in fields}
        tab["kind"][:] = IDLE
        stash = [_Slots() for _ in range(p)]
        xbuf = [_Slots() for _ in range(p)]
        gbuf = [_Slots() for _ in range(p)]
        wbuf = [_Slots() for _ in range(p)]
        for t, row in enumerate(self.timeline):
            for s, op in enumerate(row):
                if op is None:
                    continue
                first = s == 0 and op.chunk == 0
                last = s == p - 1 and op.chunk == self.v - 1
                tab["mb"][t, s], tab["chunk"][t, s] = op.mb, op.chunk
                tab["first"][t, s], tab["last"][t, s] = int(first), int(last)
                key = (op.mb, op.chunk)
                if op.kind == "F":
                    tab["kind"][t, s] = FORWARD
                    if not self.forward_only:
                        tab["stash"][t, s] = stash[s].take(key)
                    if not first:
                        tab["x_slot"][t, s] = xbuf[s].release(key)
                    if last and not self.forward_only:  # the loss gradient waits in a gradient slot for this chunk's B
                        tab["g_slot"][t, s] = gbuf[s].take(key)
                elif op.kind == "B":
                    tab["kind"][t, s] = BACKWARD
                    tab["stash"][t, s] = stash[s].release(key)
                    tab["g_slot"][t, s] = gbuf[s].release(key)
                    if self.split_backward:
                        tab["w_slot"][t, s] = wbuf[s].take(key)
                else:
                    tab["kind"][t, s] = WEIGHT
                    tab["w_slot"][t, s] = wbuf[s].release(key)
            # Sends happen after the tick's ops: forward outputs to the next stage (the last stage's
            # non-final chunks wrap to stage 0, next chunk), input gradients to the previous one.
            for s, op in enumerate(row):
                if op is None:
                    continue
                if op.kind == "F" and not (s == p - 1 and op.chunk == self.v - 1):
                    to, chunk = ((s + 1, op.chunk) if s < p - 1 else (0, op.chunk + 1))
                    tab["recv_x"][t, to] = xbuf[to].take((op.mb, chunk))
                if op.kind == "B" and not (s == 0 and op.chunk == 0):
                    to, chunk = ((s - 1, op.chunk) if s > 0 else (p - 1, op.chunk - 1))
                    tab["recv_g"][t, to] = gbuf[to].take((op.mb, chunk))
        depths = {"stash": max(b.depth for b in stash), "x": max(b.depth for b in xbuf),
                  "g": max(b.depth for b in gbuf), "w": max(b.depth for b in wbuf)}
        return tab, depths

    @property
    def depths(self) -> dict[str, int]:
        """Slots per stage the executor allocates (the maximum over stages): stash, x (received
        activations), g (received gradients and the last chunk's loss gradient) and w (deferred weight
        gradients' inputs, zb-h1)."""
        return self._slots[1]

    # -----------------------------------------------------------------------------------------

    def render(self) -> str:
        width = 1 + max(len(str(op)) for row in self.timeline for op in row if op is not None)
        lines = []
        for s in range(self.p):
            cells = [str(row[s]) if row[s] is not None else "." for row in self.timeline]
            lines.append(f"stage {s}: " + "".join(c.rjust(width) for c in cells))
        return "\n".join(lines)

    def summary(self) -> str:
        formula = paper_bubble_formula(self.name, self.v)
        ticks = ("3mv + p − 1" if self.v > 1 else "3m + p − 1") if self.split_backward else "2mv + 2(p−1)"
        expected = 3 * self.m * self.v + self.p - 1 if self.split_backward else lockstep_ticks(self.p, self.m, self.v)
        lines = [f"{self.name}: p={self.p} stages, v={self.v} chunk(s) per stage, m={self.m} micro-batches",
                 f"ticks {self.ticks} (lock-step {ticks} = {expected}), busy {self.busy_ticks} and idle "
                 f"{self.idle_ticks} per stage",
                 f"bubble idle/busy = {self.bubble:.4f} vs the paper's {formula} = {self.paper_bubble:.4f}",
                 "in flight (chunk inputs held) per stage: " + ", ".join(str(self.in_flight(s)) for s in range(self.p))
                 + f"; buffer slots: stash {self.depths['stash']}, received activations {self.depths['x']}, "
                   f"gradients {self.depths['g']}"]
        if self.split_backward:
            lines.append("deferred weight gradients held per stage: "
                         + ", ".join(str(self.deferred(s)) for s in range(self.p))
                         + f"; W stash slots {self.depths['w']}")
        return "\n".join(lines)


class _Slots:
    """Lowest-free-first slot allocation for one buffer of one stage."""

    def __init__(self):
        self.used: dict = {}
        self.depth = 0

    def take(self, key) -> int:
        free = set(range(self.depth + 1)) - set(self.used.values())
        slot = min(free)
        self.used[key] = slot
        self.depth = max(self.depth, slot + 1)
        return slot

    def release(self, key) -> int:
        return self.used.pop(key)
