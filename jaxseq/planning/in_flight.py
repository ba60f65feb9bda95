"""The first pipeline stage's in-flight activations: read from the compiled pipelined step (`InFlight`,
`compiled_in_flight`), beside the paper's count (`paper_in_flight_layers`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import jax

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace
from jaxseq.mesh import make_mesh
from jaxseq.parallel import pipeline
from jaxseq.parallel.schedule import Schedule
from jaxseq.parallel.ticks import Branch, schedule_of
from jaxseq.parallel.layout import Layout
from jaxseq.planning import hlo, hlo_flops, hlo_loops
from jaxseq.planning.stash import stash_layout, w_stash_layout
from jaxseq.planning.measure import RowSpec
from jaxseq.training import aot

PIPELINE_LAYERS_PER_CHUNK = 2  # k_c: layers per chunk the pipelined step is compiled with


@dataclass(frozen=True)
class InFlight:
    """Stage 0's in-flight activations under a pipeline schedule. Compiled: the real pipeline executor
    (`pipeline.make_loss_and_grad`) on p × t simulated devices at the plan's shapes, but with k_c layers per
    chunk; the stash slots and their bytes are read from its tick loop's carry. Scaled: a slot holds one
    chunk's residuals stacked [k, …], so the real k = L/(p·v) layers per chunk multiply its bytes by k/k_c."""

    source: str  # what was compiled, in words
    config: str  # the plan row whose remat policy and SP the pipelined step was compiled with
    slots: int  # stash slots in the compiled tick loop (compiled)
    compiled_layers_per_chunk: int  # k_c
    layers_per_chunk: int  # k = L/(p·v)
    compiled_stash_bytes: int  # every slot at k_c layers (compiled)
    stash_bytes: int  # scaled to k layers: compiled_stash_bytes · k / k_c
    receive_bytes: int  # received activation and gradient buffers (compiled; independent of k)
    formula: str  # the paper's in-flight layers, symbolic
    formula_layers: float
    # zb-h1: the W stash (each B's weight-matmul inputs and output gradients, kept until its W), compiled like the
    # stash: its slots, every slot's bytes at k_c layers, scaled to k; 0 for the schedules whose backward is whole
    w_slots: int = 0
    compiled_w_stash_bytes: int = 0
    w_stash_bytes: int = 0
    # the dot FLOPs per device of a middle chunk's F, B and W tick branches (compiled; W 0 where B is whole), and the
    # schedule's bubble in time at those costs: lock-step (`Schedule.lockstep_bubble`: each tick waits for its
    # slowest stage, as the executor runs) and, for comparison, 1F1B's at the same costs
    branch_dot_flops: dict | None = None
    lockstep_bubble: float = 0.0
    lockstep_bubble_1f1b: float = 0.0

    @property
    def layers(self) -> int:
        """Layers' worth of activations stage 0 holds: slots × k."""
        return self.slots * self.layers_per_chunk

    @property
    def per_layer_bytes(self) -> float:
        return self.compiled_stash_bytes / (self.slots * self.compiled_layers_per_chunk)

    def to_json(self) -> dict:
        return {**asdict(self), "layers": self.layers, "per_layer_bytes": self.per_layer_bytes}


def paper_in_flight_layers(schedule: str, layers: int, p: int, v: int, m: int) -> tuple[str, float]:
    """The paper's layers' worth of activations on the first stage (§4.2.3 and Narayanan et al.)."""
    return {"1f1b": ("L", float(layers)), "zb-h1": ("L", float(layers)),
            "interleaved": ("L·(1 + (p−1)/(p·v))", layers * (1 + (p - 1) / (p * v))),
            "gpipe": ("L·m/p", layers * m / p)}[schedule]


def _in_order(carry: list, avals: list, matches) -> tuple[list, list]:
    """(the carry's arrays that match `avals` one by one in order, the carry after the last of them): the tick
    loop's carry keeps the order of `tick_programs.Buffers`, the stash before the W stash, whose arrays can have the
    same leading dimensions."""
    found, i = [], 0
    for a in avals:
        while i < len(carry) and not matches(*carry[i], a):
            i += 1
        if i == len(carry):
            break
        found.append(carry[i])
        i += 1
    return found, carry[i:]


def branch_dot_flops(hlo_text: str, sched) -> dict[str, float]:
    """{"F", "B", "W"}: the dot FLOPs per device of the tick loop's forward, backward and (zb-h1) weight branches
    of a middle chunk (`ticks.Branch`: neither the embedding's nor the loss's); W 0 where the backward is whole."""
    comps = hlo.parse_hlo(hlo_text)
    body = hlo_loops.while_loop(comps, sched.ticks).attr("body")
    switch, = [i for i in comps[body] if i.opcode == "conditional" and len(i.branches()) > 2]
    flops = [hlo_flops.dot_flops(comps, b) for b in switch.branches()]
    return {"F": flops[Branch.FORWARD], "B": flops[Branch.BACKWARD],
            "W": flops[Branch.WEIGHT] if sched.split_backward else 0.0}


def compiled_in_flight(cfg: ModelConfig, c: RowSpec, micro_batch: int, devices, schedule: str, p: int, v: int,
                       m: int, context: int = 1, strategy: str = "all-gather") -> InFlight:
    """Compile the pipelined step for row `c` at p stages × context × c.tensor and read stage 0's stash (see
    InFlight)."""
    k_c, k = PIPELINE_LAYERS_PER_CHUNK, cfg.layers // (p * v)
    small = replace(cfg, layers=p * v * k_c, layer_loop="scan")  # the stash is read in the scan's loop
    parallel = ParallelConfig(data=1, tensor=c.tensor, sequence_parallel=c.sequence_parallel, pipe=p,
                              schedule=schedule, virtual_stages=v, context=context, context_strategy=strategy)
    n = parallel.num_devices
    if len(devices) < n:
        raise ConfigError(f"the pipelined step at pipeline={p} × context={context} × tensor={c.tensor} compiles on "
                          f"{n} simulated devices; {len(devices)} available")
    layout = Layout(small, parallel, make_mesh(parallel, devices[:n]))
    sched = schedule_of(parallel, m, small.layers)
    params, batch = aot.abstract_inputs(layout, micro_batch * m)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=layout.replicated)
    compiled = aot.compile_for_analysis(pipeline.make_loss_and_grad(layout, c.remat, m).lower(params, batch, key))
    carry = hlo_loops.loop_carry(compiled.as_text(), sched.ticks)
    slot_avals, _ = stash_layout(layout, c.remat, m, micro_batch)

    depth = sched.depths["stash"]

    def is_stash_of(dt, dims, aval):  # [depth, k_c, b, …] per device; the aval is one global slot [k_c, b, …]
        if aval.shape[:2] != (k_c, micro_batch):  # a constant the layers close over (Llama's RoPE tables): whole
            return dims == (depth, *aval.shape) and hlo.array_bytes(dt, ()) == aval.dtype.itemsize
        return (len(dims) == aval.ndim + 1 and dims[:3] == (depth, k_c, micro_batch) and hlo.array_bytes(dt, ()) ==
                aval.dtype.itemsize and all(g % d == 0 for g, d in zip(aval.shape, dims[1:])))

    stash, rest = _in_order(carry, slot_avals, is_stash_of)
    if len(stash) != len(slot_avals):
        raise RuntimeError(f"the compiled tick loop's stash ({stash}) does not match one slot's residuals "
                           f"({[(a.dtype, a.shape) for a in slot_avals]}) × {sched.depths['stash']} slots")
    w_slot_avals = w_stash_layout(layout, c.remat, m, micro_batch)

    def is_w_stash_of(dt, dims, aval):  # [depth w, k_c, …] per device; the aval is one global slot [k_c, …]
        return (len(dims) == aval.ndim + 1 and dims[:2] == (sched.depths["w"], k_c) and hlo.array_bytes(dt, ()) ==
                aval.dtype.itemsize and all(g % d == 0 for g, d in zip(aval.shape, dims[1:])))

    w_stash, _ = _in_order(rest, w_slot_avals, is_w_stash_of)
    if len(w_stash) != len(w_slot_avals):
        raise RuntimeError(f"the compiled tick loop's W stash ({w_stash}) does not match one slot's "
                           f"({[(a.dtype, a.shape) for a in w_slot_avals]}) × {sched.depths['w']} slots")
    compiled_w = sum(hlo.array_bytes(dt, dims) for dt, dims in w_stash)
    costs = branch_dot_flops(compiled.as_text(), sched)
    unsplit = Schedule.make("1f1b", p, m)
    depths = {sched.depths["x"] + 1, sched.depths["g"] + 1}
    receive = [(dt, dims) for dt, dims in carry if len(dims) == 4 and dims[0] in depths
               and dims[1] == micro_batch and dims[3] == cfg.hidden]
    compiled_bytes = sum(hlo.array_bytes(dt, dims) for dt, dims in stash)
    formula, formula_layers = paper_in_flight_layers(sched.name, cfg.layers, p, v, m)
    mesh_name = f"pipe={p} × " + (f"context={context} × " if context > 1 else "") + f"tensor={c.tensor}"
    source = (f"compiled: the pipelined {sched.name} step ({c.name}, {mesh_name} = {n} simulated "
              f"devices, {k_c} layers per chunk), stash read from its tick loop; scaled ×{k}/{k_c} to {k} layers "
              "per chunk")
    return InFlight(source, c.name, sched.depths["stash"], k_c, k, compiled_bytes, compiled_bytes * k // k_c,
                    sum(hlo.array_bytes(dt, dims) for dt, dims in receive), formula, formula_layers,
                    sched.depths["w"], compiled_w, compiled_w * k // k_c, costs, sched.lockstep_bubble(*costs.values()),
                    unsplit.lockstep_bubble(costs["F"], costs["B"] + costs["W"], 0.0))
