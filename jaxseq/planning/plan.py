"""`python -m jaxseq.plan`: memory, FLOPs and collectives per configuration, before renting GPUs.

Every per-layer number is XLA's own accounting of the compiled training computation (forward +
backward of one micro-batch), compiled ahead of time on abstract inputs for simulated host devices:
nothing is allocated, so a 1T-parameter layer compiles on a laptop. Why compile rather than count:
what a remat policy really keeps is decided by autodiff and XLA, and a policy that silently saves the
wrong tensor is the most common surprise in practice.

How the per-layer numbers are read (layers under `lax.scan`, so depth does not matter):
- stored bytes: the stacked buffers the forward layer loop writes, / L (`hlo.stored_bytes_per_layer`);
- FLOPs: `cost_analysis()` counts a loop body once, so flops(L=2) − flops(L=0) is one layer's forward
  and backward (plus the casts of that layer's weights outside the loop, < 0.1%);
- collectives: those of one forward and one backward iteration of the layer loop.
Whole-model bytes per device: parameter state from shapes and shardings, activations = per-layer × L
plus the non-layer part from shapes (`non_layer_activation_bytes`), and the step's working memory
(transients: one layer's recomputation and gradients in flight, the logits' gradient, RNG bits),
read from the compiled float32 train step at L=2 as its temporaries minus everything above; that
remainder does not depend on depth, so the sum is the compiled step's peak at any L
(`tests/test_plan.py` holds it to `memory_analysis()` at another depth).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import jax
import numpy as np

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, replace, validate
from jaxseq.mesh import make_mesh
from jaxseq.models.formulas import PAPER_CONFIGURATIONS, paper_activation_bytes, paper_hardware_flops
from jaxseq.models import gpt as M
from jaxseq.parallel import pipeline as PL
from jaxseq.parallel.schedule import Schedule
from jaxseq.planning import hlo
from jaxseq.planning import search as S
from jaxseq.remat import POLICIES
from jaxseq.training import aot
from jaxseq.training import train_step as T

MIB, GIB = 2**20, 2**30
MEASURE_LAYERS = 2  # a scan of 2 keeps the layer loop (1 would be inlined); depth does not matter

@dataclass(frozen=True)
class RowSpec:
    """One row to compile: a paper configuration or another registered policy, with or without SP."""

    name: str
    remat: str
    sequence_parallel: bool
    tensor: int
    paper: str | None  # the Table-2 row it is compared with


def configurations(tensor: int, policies=None) -> list[RowSpec]:
    """The paper's seven rows, then every other registered policy (or those in `policies`) with and
    without SP. With tensor = 1 there is no parallelism to compare: one row per policy."""
    policies = list(POLICIES) if policies is None else list(policies)
    if tensor == 1:
        paper = {"none": "none", "selective": "tp+selective", "full": "full"}
        return [RowSpec(p, p, False, 1, paper.get(p)) for p in dict.fromkeys(["none", *policies])]
    rows = [RowSpec(n, c.remat, c.sequence_parallel, tensor if c.tensor_parallel else 1, n)
            for n, c in PAPER_CONFIGURATIONS.items()]
    for policy in policies:
        if policy not in ("none", "selective", "full"):
            rows += [RowSpec(f"tp+{policy}", policy, False, tensor, None),
                     RowSpec(f"tp+sp+{policy}", policy, True, tensor, None)]
    return rows


# ---------------------------------------------------------------------------------------------
# Measuring one configuration


@dataclass(frozen=True)
class Measured:
    stored_bytes_per_layer: int
    flops_per_layer: float  # per device, forward + backward of one layer
    collective_bytes_per_layer: dict  # kind → bytes of the buffers, forward + backward, activation dtype
    working_bytes: int  # the train step's transients beyond state and stored activations (float32 step)


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def _mesh(tensor: int, sequence_parallel: bool, devices):
    parallel = ParallelConfig(1, tensor, sequence_parallel)
    return parallel, make_mesh(parallel, devices[:tensor])


class Compiler:
    """Compiles each distinct program once, two at a time (XLA compiles with the GIL released, and a
    plan reuses the L=0 and forward programs across rows)."""

    def __init__(self, cfg: ModelConfig, micro_batch: int, devices, workers: int = 2):
        self.cfg, self.b, self.devices, self.workers = cfg, micro_batch, devices, workers
        self._cache: dict = {}

    @staticmethod
    def programs(c: RowSpec) -> list[tuple]:
        """(kind, layers, remat, tensor, sp) of the programs a row reads."""
        return [("grad", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel),
                ("grad", 0, "none", c.tensor, c.sequence_parallel),
                ("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel)]

    def compile_all(self, keys) -> None:
        from concurrent.futures import ThreadPoolExecutor

        todo = list(dict.fromkeys(k for k in keys if k not in self._cache))
        with ThreadPoolExecutor(self.workers) as pool:
            for key, compiled in zip(todo, pool.map(self._build, todo)):
                self._cache[key] = compiled

    def _build(self, key: tuple):
        kind, layers, remat, tensor, sp = key
        parallel, mesh = _mesh(tensor, sp, self.devices)
        if kind == "step":  # float32: XLA:CPU's bf16 temporaries are not what a GPU allocates
            return aot.compile_train_step(replace(self.cfg, layers=layers, dtype="float32"), parallel, remat, mesh, self.b)
        fn = aot.compile_loss_and_grad if kind == "grad" else aot.compile_forward
        return fn(replace(self.cfg, layers=layers), parallel, remat, mesh, self.b)

    def _compile(self, *key):
        if key not in self._cache:
            self._cache[key] = self._build(key)
        return self._cache[key]

    def measure(self, c: RowSpec) -> Measured:
        L = MEASURE_LAYERS
        compiled = self._compile("grad", L, c.remat, c.tensor, c.sequence_parallel)
        text = compiled.as_text()
        stored = hlo.stored_bytes_per_layer(text, L)
        flops = _flops(compiled) - _flops(self._compile("grad", 0, "none", c.tensor, c.sequence_parallel))
        return Measured(stored, flops, self._collectives(text, c.tensor), self.working_bytes(c))

    def working_bytes(self, c: RowSpec) -> int:
        """The float32 train step's temporaries at L=2 minus its gradients and stored activations."""
        step = self._compile("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel)
        cfg = replace(self.cfg, layers=MEASURE_LAYERS, dtype="float32")
        accounted = (state_bytes(cfg, c.tensor).gradients + MEASURE_LAYERS * hlo.stored_bytes_per_layer(step.as_text(), MEASURE_LAYERS)
                     + non_layer_activation_bytes(cfg, self.b, c.tensor, c.sequence_parallel))
        return step.memory_analysis().temp_size_in_bytes - accounted

    @staticmethod
    def forward_programs(tensor: int) -> list[tuple]:
        return [("forward", L, "none", tensor, False) for L in (MEASURE_LAYERS, 0)]

    def forward_flops_per_layer(self, tensor: int) -> float:
        fwd, zero = (_flops(self._compile(*k)) for k in self.forward_programs(tensor))
        return fwd - zero

    def _collectives(self, text: str, tensor: int) -> dict:
        """Bytes of the activation collectives of one layer (forward + backward), at the model's
        activation dtype: XLA:CPU computes bf16 collectives in f32, so HLO byte counts would be
        doubled; elements × itemsize is what a GPU moves. Parameter-gradient reductions (LayerNorm
        weights under SP, a few h elements) are left out: smaller than one activation shard."""
        itemsize = self.cfg.itemsize
        shard = self.b * self.cfg.seq_len * self.cfg.hidden // tensor
        out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
        if tensor == 1:
            return out
        for backward in (False, True):
            for c in hlo.loop_collectives(text, MEASURE_LAYERS, backward):
                if c.group_size > 1 and c.elements >= shard:
                    out[c.kind] = out.get(c.kind, 0) + c.elements * itemsize
        return out


# ---------------------------------------------------------------------------------------------
# The first pipeline stage's in-flight activations, from the compiled pipelined step

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
    return {"1f1b": ("L", float(layers)), "interleaved": ("L·(1 + (p−1)/(p·v))", layers * (1 + (p - 1) / (p * v))),
            "gpipe": ("L·m/p", layers * m / p)}[schedule]


def compiled_in_flight(cfg: ModelConfig, c: RowSpec, micro_batch: int, devices, schedule: str, p: int, v: int,
                       m: int) -> InFlight:
    """Compile the pipelined step for row `c` at p stages × c.tensor and read stage 0's stash (see InFlight)."""
    k_c, k = PIPELINE_LAYERS_PER_CHUNK, cfg.layers // (p * v)
    small = replace(cfg, layers=p * v * k_c)
    parallel = ParallelConfig(1, c.tensor, c.sequence_parallel, pipe=p, schedule=schedule, virtual_stages=v)
    n = parallel.num_devices
    if len(devices) < n:
        raise ConfigError(f"the pipelined step at pipeline={p} × tensor={c.tensor} compiles on {n} simulated "
                          f"devices; {len(devices)} available")
    mesh = make_mesh(parallel, devices[:n])
    sched = PL.schedule_of(parallel, m, small.layers)
    params, batch = aot.abstract_inputs(small, parallel, mesh, micro_batch * m)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    compiled = PL.make_loss_and_grad(small, parallel, c.remat, mesh, m).lower(params, batch, key).compile()
    carry = hlo.loop_carry(compiled.as_text(), sched.ticks)
    slot_avals, _ = PL.stash_layout(small, parallel, c.remat, mesh, m, micro_batch)

    depth = sched.depths["stash"]

    def is_stash_of(dt, dims, aval):  # [depth, k_c, b, …] per device; the aval is one global slot [k_c, b, …]
        return (len(dims) == aval.ndim + 1 and dims[:3] == (depth, k_c, micro_batch) and hlo.array_bytes(dt, ()) ==
                aval.dtype.itemsize and all(g % d == 0 for g, d in zip(aval.shape, dims[1:])))

    stash = [(dt, dims) for dt, dims in carry if any(is_stash_of(dt, dims, a) for a in slot_avals)]
    if len(stash) != len(slot_avals):
        raise RuntimeError(f"the compiled tick loop's stash ({stash}) does not match one slot's residuals "
                           f"({[(a.dtype, a.shape) for a in slot_avals]}) × {sched.depths['stash']} slots")
    depths = {sched.depths["x"] + 1, sched.depths["g"] + 1}
    receive = [(dt, dims) for dt, dims in carry if len(dims) == 4 and dims[0] in depths
               and dims[1] == micro_batch and dims[3] == cfg.hidden]
    compiled_bytes = sum(hlo.array_bytes(dt, dims) for dt, dims in stash)
    formula, formula_layers = paper_in_flight_layers(sched.name, cfg.layers, p, v, m)
    source = (f"compiled: the pipelined {sched.name} step ({c.name}, pipe={p} × tensor={c.tensor} = {n} simulated "
              f"devices, {k_c} layers per chunk), stash read from its tick loop; scaled ×{k}/{k_c} to {k} layers "
              "per chunk")
    return InFlight(source, c.name, sched.depths["stash"], k_c, k, compiled_bytes, compiled_bytes * k // k_c,
                    sum(hlo.array_bytes(dt, dims) for dt, dims in receive), formula, formula_layers)


def pipeline_row(rows: list[RowSpec]) -> RowSpec:
    """The row the pipelined step is compiled for: Megatron's recommendation (TP+SP+selective), else the first."""
    names = {c.name: c for c in rows}
    return names.get("tp+sp+selective") or names.get("selective") or rows[0]


# ---------------------------------------------------------------------------------------------
# Whole-model bytes per device


def parameter_elements_per_device(cfg: ModelConfig, tensor: int) -> tuple[int, int]:
    """(all parameter elements, those cast to the compute dtype) on one device, from the shapes and
    the tensor-parallel specs (LayerNorm parameters stay float32: no copy)."""
    total = cast = 0
    for leaf in _leaves(cfg, tensor, 1, False):
        total += leaf.elements
        cast += leaf.elements if leaf.cast else 0
    return total, cast


@dataclass(frozen=True)
class _Leaf:
    elements: int  # on one device, split by tensor
    master_elements: int  # of its master weights and of each Adam moment on one device
    cast: bool  # copied to the compute dtype (all but LayerNorm parameters)
    sharded: bool  # over data (distributed optimizer): the step gathers a full copy of it

    def copy_bytes(self, cfg: ModelConfig) -> int:
        """The compute-dtype copy a step makes: a gathered one of a data-sharded leaf (LayerNorm
        parameters in f32), a cast one of a replicated leaf, none of a replicated f32 leaf."""
        e = cfg.itemsize
        if self.sharded:
            return self.elements * (e if self.cast else 4)
        return self.elements * e if self.cast and cfg.dtype != "float32" else 0


def _leaves(cfg: ModelConfig, tensor: int, data: int, distributed_optimizer: bool) -> list[_Leaf]:
    """Every parameter's per-device elements under the train step's own specs (`T.master_specs`)."""
    parallel = ParallelConfig(data, tensor, False, distributed_optimizer)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    shapes = jax.tree.leaves(M.param_shapes(cfg, tensor), is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.leaves(T.master_specs(cfg, parallel), is_leaf=is_spec)
    out = []
    for shape, spec, cast in zip(shapes, specs, jax.tree.leaves(M.cast_mask())):
        n = int(np.prod(shape, dtype=np.int64)) // tensor ** sum(1 for axis in spec if axis == "tensor")
        sharded = "data" in spec
        out.append(_Leaf(n, n // data if sharded else n, cast, sharded))
    return out


def non_layer_activation_bytes(cfg: ModelConfig, b: int, tensor: int, sp: bool) -> int:
    """Activations outside the layers, from shapes (the paper's §4.3 terms): the embedding dropout
    mask (1 byte), the final LayerNorm's input and its f32 mean/rstd, the logits matmul's input
    (sequence-sharded under SP), and the float32 logits the cross-entropy keeps, 4·s·b·V/t."""
    s, h, e = cfg.seq_len, cfg.hidden, cfg.itemsize
    per_token = (1 if cfg.dropout > 0 else 0) * h + e * h + 8 + e * h
    return s * b * per_token // (tensor if sp else 1) + 4 * s * b * cfg.padded_vocab(tensor) // tensor


@dataclass(frozen=True)
class State:
    """Per-device bytes of the training state: the fp32 master weights (the parameters the optimizer
    updates), fp32 gradients, Adam's two fp32 moments, and the compute-dtype copy of the weights a
    step makes. Without the distributed optimizer a float32 step reads the master weights directly
    (no copy); with it every step gathers a full copy, LayerNorm parameters included (in f32)."""

    params: int  # fp32 master weights
    gradients: int
    optimizer: int  # Adam moments
    weight_copy: int

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.weight_copy


def state_bytes(cfg: ModelConfig, tensor: int, data: int = 1, distributed_optimizer: bool = False) -> State:
    """Per-device state bytes; the distributed optimizer divides master weights and moments by
    `data` for every parameter with a dimension `data` divides (the others are counted whole)."""
    leaves = _leaves(cfg, tensor, data, distributed_optimizer)
    total = sum(l.elements for l in leaves)
    master = sum(l.master_elements for l in leaves)
    return State(4 * master, 4 * total, 8 * master, sum(l.copy_bytes(cfg) for l in leaves))


def activation_bytes(cfg: ModelConfig, c: RowSpec, m: Measured, micro_batch: int) -> int:
    """Stored activations of the whole model per device: per layer × L plus the non-layer part."""
    return m.stored_bytes_per_layer * cfg.layers + non_layer_activation_bytes(cfg, micro_batch, c.tensor, c.sequence_parallel)


def peak_bytes(cfg: ModelConfig, c: RowSpec, m: Measured, micro_batch: int) -> int:
    """The train step's peak per device (one pipeline stage): state + activations + working memory."""
    return state_bytes(cfg, c.tensor).total + activation_bytes(cfg, c, m, micro_batch) + m.working_bytes


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Row:
    config: str
    remat: str
    sequence_parallel: bool
    tensor: int
    measured_bytes_per_layer: int
    formula_bytes_per_layer: float | None
    ratio: float | None
    flops_per_layer: float
    recompute_overhead_pct: float
    collective_bytes_per_layer: int
    collectives: dict  # kind → bytes per layer
    params_bytes_per_device: int
    gradient_bytes_per_device: int
    optimizer_bytes_per_device: int
    weight_copy_bytes_per_device: int
    activation_bytes_per_device: int
    working_bytes_per_device: int
    total_bytes_per_device: int


@dataclass(frozen=True)
class Plan:
    model: str
    config: ModelConfig
    tensor: int
    micro_batch: int
    rows: list[Row]
    formula_flops_per_layer: dict  # per device at `tensor`: model, hardware_selective, hardware_full
    forward_flops_per_layer: float  # measured, per device at `tensor`, no SP
    last_matmul_flops_per_layer: float  # the second MLP matmul's forward, per device
    pipeline: int = 1  # whole-model figures: the first of this many pipeline stages
    data: int = 1  # data-parallel size d: divides master weights and moments with the distributed optimizer
    distributed_optimizer: bool = False  # whether the rows' totals (and the budget) assume it
    parameters_per_device: int = 0  # of the first stage, split by tensor
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    in_flight_layers: float = 0  # layers' worth of activations the first stage holds (compiled pipelined step)
    bubble: float = 0.0  # idle / busy ticks of the lock-step schedule
    paper_bubble: float = 0.0  # (p − 1)/m, or (p − 1)/(v·m) interleaved
    in_flight: InFlight | None = None  # pipeline > 1: stage 0's stash, from the compiled pipelined step

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.config == name)

    def to_json(self) -> dict:
        cfg = self.config
        return {
            "model": self.model, "tensor": self.tensor, "seq_len": cfg.seq_len, "micro_batch": self.micro_batch,
            "pipeline": self.pipeline, "data": self.data, "distributed_optimizer": self.distributed_optimizer,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches, "in_flight_layers": self.in_flight_layers,
            "bubble": self.bubble, "paper_bubble": self.paper_bubble,
            "in_flight": self.in_flight and self.in_flight.to_json(),
            "hidden": cfg.hidden, "heads": cfg.heads, "layers": cfg.layers, "vocab_size": cfg.vocab_size,
            "dtype": cfg.dtype, "attention": cfg.attention,
            "formula_flops_per_layer": self.formula_flops_per_layer,
            "forward_flops_per_layer": self.forward_flops_per_layer,
            "last_matmul_flops_per_layer": self.last_matmul_flops_per_layer,
            "units": "bytes and FLOPs per device; *_per_layer: one transformer layer, forward + backward",
            "rows": [asdict(r) for r in self.rows],
            "optimizer_state": self.optimizer_state(),
        }

    def optimizer_state(self) -> dict:
        """Per-device state bytes and bytes per parameter without and with the distributed optimizer."""
        stage = replace(self.config, layers=-(-self.config.layers // self.pipeline))
        out = {}
        for key, distributed in (("without_distributed_optimizer", False), ("with_distributed_optimizer", True)):
            state = state_bytes(stage, self.tensor, self.data, distributed)
            parts = {"weight_copy": state.weight_copy, "gradients": state.gradients, "master_weights": state.params,
                     "adam_moments": state.optimizer, "total": state.total}
            out[key] = {"bytes_per_device": parts,
                        "bytes_per_parameter": {k: v / self.parameters_per_device for k, v in parts.items()}}
        return out


def formula_flops_per_layer(cfg: ModelConfig, b: int, tensor: int) -> dict:
    """The paper's per-iteration FLOPs for one layer of one micro-batch, per device (V = 0: the
    logits are not part of a layer)."""
    s, h = cfg.seq_len, cfg.hidden
    per = lambda remat: paper_hardware_flops(b, s, 1, h, 0, remat) / tensor
    return {"model": per("none"), "hardware_selective": per("selective"), "hardware_full": per("full")}


def plan(cfg: ModelConfig, tensor: int, micro_batch: int, devices, model_name: str = "custom",
         pipeline: int = 1, policies=None, schedule: str = "1f1b", virtual_stages: int = 1,
         microbatches: int | None = None, data: int = 1, distributed_optimizer: bool = False) -> Plan:
    """Compile every configuration and assemble the rows. `devices`: at least `tensor` devices.

    pipeline = p: the whole-model figures are those of the first pipeline stage, which holds the
    state of L/p layers (and the embedding) and, under 1F1B, activations of p micro-batches in
    flight, i.e. L layers' worth whatever p is (the paper's §4.2.3); under the interleaved schedule
    p·v + p − 1 chunks of L/(p·v) layers, under GPipe m micro-batches of L/p layers. That count is read
    from the compiled pipelined step (`compiled_in_flight`: p × t simulated devices, `devices` must hold
    them), the bytes per layer of each row from its compiled layer. `policies`: which
    registered policies beyond the paper's rows (default all). microbatches: m (default p).
    data = d, distributed_optimizer: the state bytes of each row (and so the budget) with the fp32
    master weights and Adam moments split d ways; the table reports both ways whatever is chosen."""
    for c in configurations(tensor, policies):
        validate(cfg, ParallelConfig(1, c.tensor, c.sequence_parallel), c.remat)
    if not isinstance(micro_batch, int) or micro_batch <= 0:
        raise ConfigError(f"micro_batch={micro_batch!r} must be a positive integer")
    if not isinstance(data, int) or data <= 0:
        raise ConfigError(f"data={data!r} must be a positive integer")
    if not isinstance(pipeline, int) or not 0 < pipeline <= cfg.layers:
        raise ConfigError(f"pipeline={pipeline!r} must be a positive integer at most layers={cfg.layers}")
    stage = replace(cfg, layers=-(-cfg.layers // pipeline))
    n_micro = pipeline if microbatches is None else microbatches
    in_flight_layers, bubble, paper_bubble = float(cfg.layers), 0.0, 0.0
    if pipeline > 1 or virtual_stages > 1 or schedule != "1f1b":
        sched = Schedule.make(schedule, pipeline, n_micro, virtual_stages, cfg.layers)
        schedule = sched.name
        in_flight_layers = float(sched.in_flight_layers(cfg.layers))
        bubble, paper_bubble = sched.bubble, sched.paper_bubble
    if len(devices) < tensor:
        raise ConfigError(f"tensor={tensor} needs {tensor} devices; {len(devices)} available")
    if pipeline > 1 and len(devices) < pipeline * tensor:
        raise ConfigError(f"pipeline={pipeline} × tensor={tensor}: compiling the pipelined step needs "
                          f"{pipeline * tensor} simulated devices; {len(devices)} available")
    compiler = Compiler(cfg, micro_batch, devices)
    s, h, a, b = cfg.seq_len, cfg.hidden, cfg.heads, micro_batch
    configs = configurations(tensor, policies)
    compiler.compile_all([k for c in configs for k in compiler.programs(c)] + compiler.forward_programs(tensor))
    measured = {c: compiler.measure(c) for c in configs}
    in_flight = None
    if pipeline > 1:
        in_flight = compiled_in_flight(cfg, pipeline_row(configs), b, devices, schedule, pipeline, virtual_stages,
                                       n_micro)
        in_flight_layers = float(in_flight.layers)
    baseline = {(c.tensor, c.sequence_parallel): m.flops_per_layer for c, m in measured.items() if c.remat == "none"}
    rows = []
    for c, m in measured.items():
        formula = paper_activation_bytes(c.paper, s, b, h, a, c.tensor) if c.paper else None
        state = state_bytes(stage, c.tensor)  # with_optimizer below sets d and the distributed optimizer
        activations = (int(m.stored_bytes_per_layer * in_flight_layers)
                       + non_layer_activation_bytes(cfg, b, c.tensor, c.sequence_parallel))
        base = baseline[(c.tensor, c.sequence_parallel)]
        rows.append(Row(
            config=c.name, remat=c.remat, sequence_parallel=c.sequence_parallel, tensor=c.tensor,
            measured_bytes_per_layer=m.stored_bytes_per_layer, formula_bytes_per_layer=formula,
            ratio=m.stored_bytes_per_layer / formula if formula else None,
            flops_per_layer=m.flops_per_layer, recompute_overhead_pct=100 * (m.flops_per_layer / base - 1),
            collective_bytes_per_layer=sum(m.collective_bytes_per_layer.values()),
            collectives=m.collective_bytes_per_layer,
            params_bytes_per_device=state.params, gradient_bytes_per_device=state.gradients,
            optimizer_bytes_per_device=state.optimizer, weight_copy_bytes_per_device=state.weight_copy,
            activation_bytes_per_device=activations, working_bytes_per_device=m.working_bytes,
            total_bytes_per_device=state.total + activations + m.working_bytes,
        ))
    p = Plan(model_name, cfg, tensor, micro_batch, rows, formula_flops_per_layer(cfg, b, tensor),
             compiler.forward_flops_per_layer(tensor), 2 * b * s * cfg.mlp_hidden * h / tensor, pipeline,
             schedule=schedule, virtual_stages=virtual_stages, microbatches=n_micro,
             in_flight_layers=in_flight_layers, bubble=bubble, paper_bubble=paper_bubble, in_flight=in_flight,
             parameters_per_device=parameter_elements_per_device(stage, tensor)[0])
    return with_optimizer(p, data, distributed_optimizer)


def with_optimizer(p: Plan, data: int, distributed_optimizer: bool) -> Plan:
    """The same plan with every row's state bytes (and totals) for data size `data`, with or without
    the distributed optimizer; activations are unchanged, nothing is recompiled."""
    if not isinstance(data, int) or data <= 0:
        raise ConfigError(f"data={data!r} must be a positive integer")
    stage = replace(p.config, layers=-(-p.config.layers // p.pipeline))
    rows = []
    for r in p.rows:
        state = state_bytes(stage, r.tensor, data, distributed_optimizer)
        rows.append(dataclasses.replace(
            r, params_bytes_per_device=state.params, gradient_bytes_per_device=state.gradients,
            optimizer_bytes_per_device=state.optimizer, weight_copy_bytes_per_device=state.weight_copy,
            total_bytes_per_device=state.total + r.activation_bytes_per_device + r.working_bytes_per_device))
    return dataclasses.replace(p, rows=rows, data=data, distributed_optimizer=distributed_optimizer)


# ---------------------------------------------------------------------------------------------
# What `--search` (jaxseq.planning.search) reads from the compiled programs


class SearchCosts:
    """jaxseq.planning.search's costs, measured once per (t, SP, remat) for one layer shape (any depth): the
    training computation at micro-batch 1 (stored bytes, FLOPs, activation collectives, the
    embedding/logits FLOPs: proportional to b) and the float32 train step at micro-batch 1 and 2 (the
    working memory: affine in b). `measured` (JSON-ready) can be saved and passed back to skip compiling."""

    def __init__(self, cfg: ModelConfig, devices, workers: int = 2, measured: dict | None = None):
        self.cfg = cfg
        self.one, self.two = Compiler(cfg, 1, devices, workers), Compiler(cfg, 2, devices, workers)
        self.measured = dict(measured or {})
        self._states: dict = {}

    @staticmethod
    def key(tensor: int, sequence_parallel: bool, remat: str) -> str:
        return f"t={tensor} sp={int(sequence_parallel)} {remat}"

    def prepare(self, keys, micro_batches=(1, 2)) -> None:
        rows = [RowSpec("search", remat, sp, t, None) for t, sp, remat in keys]
        for c in rows:
            validate(self.cfg, ParallelConfig(1, c.tensor, c.sequence_parallel), c.remat)
        name = lambda c: self.key(c.tensor, c.sequence_parallel, c.remat)
        todo = [c for c in rows if name(c) not in self.measured]
        # The working memory at b = 2 too, unless b = 1 is all that is asked for.
        affine = [c for c in rows if max(micro_batches) > 1 and self.measured.get(name(c), {}).get("working_bytes_b2") is None]
        self.one.compile_all([k for c in todo for k in self.one.programs(c)])  # grad at L=2 and 0, the step
        self.two.compile_all([("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel) for c in affine])
        for c in todo:
            self.measured[name(c)] = {
                **asdict(self.one.measure(c)), "working_bytes_b2": None,
                "head_flops": _flops(self.one._compile("grad", 0, "none", c.tensor, c.sequence_parallel))}
        for c in affine:
            self.measured[name(c)]["working_bytes_b2"] = self.two.working_bytes(c)
        # The numbers are read: free the executables' memory.
        self.one._cache.clear()
        self.two._cache.clear()

    def layer(self, tensor: int, sequence_parallel: bool, remat: str, micro_batch: int) -> S.LayerCost:
        m, b = self.measured[self.key(tensor, sequence_parallel, remat)], micro_batch
        if b > 1 and m["working_bytes_b2"] is None:
            self.prepare([(tensor, sequence_parallel, remat)], (b,))  # measured at b = 1 only so far
            m = self.measured[self.key(tensor, sequence_parallel, remat)]
        return S.LayerCost(
            b * m["stored_bytes_per_layer"], b * m["flops_per_layer"], b * m["head_flops"],
            {k: b * v for k, v in m["collective_bytes_per_layer"].items()},
            m["working_bytes"] + (b - 1) * (m["working_bytes_b2"] - m["working_bytes"] if b > 1 else 0),
            non_layer_activation_bytes(self.cfg, b, tensor, sequence_parallel))

    def state(self, stage: ModelConfig, tensor: int, data: int, distributed_optimizer: bool) -> S.StateCost:
        key = (stage, tensor, data, distributed_optimizer)
        if key not in self._states:
            state = state_bytes(stage, tensor, data, distributed_optimizer)
            self._states[key] = S.StateCost(state.total, parameter_elements_per_device(stage, tensor)[0], state.params)
        return self._states[key]


# ---------------------------------------------------------------------------------------------
# Recommending under a memory budget


def recommend(p: Plan, budget_bytes: float) -> tuple[Row | None, list[tuple[Row, str]]]:
    """The configuration on `p.tensor` devices with the least recompute that fits, and why each
    cheaper one does not. Order: measured recompute overhead, then collective bytes (SP's extra
    backward all-gathers), then memory."""
    candidates = sorted((r for r in p.rows if r.tensor == p.tensor),
                        key=lambda r: (round(r.recompute_overhead_pct, 2), r.collective_bytes_per_layer,
                                       r.total_bytes_per_device))
    rejected = []
    for r in candidates:
        if r.total_bytes_per_device <= budget_bytes:
            return r, rejected
        rejected.append((r, f"{r.total_bytes_per_device / GIB:.1f} GiB > budget {budget_bytes / GIB:.1f} GiB"))
    return None, rejected


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def _unit(largest: float, units: list[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit in which `largest` is at least 1 (small test shapes print in KiB, not 0.0 MiB)."""
    return next(((n, u) for n, u in units if largest >= u), units[-1])


BYTES_LAYER = [("MiB", MIB), ("KiB", 2**10)]
BYTES_MODEL = [("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)]
FLOP_UNITS = [("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)]


def format_table(p: Plan) -> str:
    cfg, t, b = p.config, p.tensor, p.micro_batch
    lines = [
        f"{p.model}: h={cfg.hidden} a={cfg.heads} L={cfg.layers} s={cfg.seq_len} V={cfg.vocab_size} "
        f"micro-batch={b} tensor={t} {cfg.dtype} {cfg.attention} attention "
        f"(5as/h = {5 * cfg.heads * cfg.seq_len / cfg.hidden:g})",
        "per layer per device; stored = bytes kept for backward, read from the compiled program; "
        "collectives at the activation dtype, forward + backward",
        "",
    ]
    bl, bu = _unit(max(r.measured_bytes_per_layer for r in p.rows), BYTES_LAYER)
    cl, cu = _unit(max(r.collective_bytes_per_layer for r in p.rows), BYTES_LAYER)
    fl, fu = _unit(max(r.flops_per_layer for r in p.rows), FLOP_UNITS)
    al, au = _unit(max(r.activation_bytes_per_device for r in p.rows), BYTES_MODEL)
    wl, wu = _unit(max(r.working_bytes_per_device for r in p.rows), BYTES_MODEL)
    tl, tu = _unit(max(r.total_bytes_per_device for r in p.rows), BYTES_MODEL)
    lines.append(f"{'config':<22}{'remat':<14}{'SP':<4}{'t':>3}{'stored ' + bl:>12}{'formula ' + bl:>13}{'ratio':>8}"
                 f"{fl:>9}{'recompute':>11}{'coll. ' + cl:>11}{'activ. ' + al:>12}{'work. ' + wl:>11}{'total ' + tl:>11}")
    for r in p.rows:
        formula = None if r.formula_bytes_per_layer is None else r.formula_bytes_per_layer / bu
        lines.append(
            f"{r.config:<22}{r.remat:<14}{'yes' if r.sequence_parallel else 'no':<4}{r.tensor:>3}"
            f"{r.measured_bytes_per_layer / bu:>12.1f}{_fmt(formula, '.1f'):>13}"
            f"{_fmt(r.ratio, '.4f'):>8}{r.flops_per_layer / fu:>9.4f}{r.recompute_overhead_pct:>10.2f}%"
            f"{r.collective_bytes_per_layer / cu:>11.1f}{r.activation_bytes_per_device / au:>12.2f}"
            f"{r.working_bytes_per_device / wu:>11.2f}{r.total_bytes_per_device / tu:>11.1f}")
    f = p.formula_flops_per_layer
    selective_pct = 100 * (f["hardware_selective"] / f["model"] - 1)
    full_pct = 100 * (f["hardware_full"] / f["model"] - 1)
    attention_share_pct = 100 * cfg.seq_len / (6 * cfg.hidden)  # the paper's s/(6h)
    lines += ["", f"FLOPs per layer per device (t={t}): paper model {f['model'] / 1e12:.4f} TFLOP; hardware with "
                  f"selective {f['hardware_selective'] / 1e12:.4f} (+{selective_pct:.2f}%, s/(6h) = "
                  f"{attention_share_pct:.2f}%); with full {f['hardware_full'] / 1e12:.4f} (+{full_pct:.2f}%)"]
    if t > 1:
        full, tp, sp_sel = p.row("full"), p.row("tp"), p.row("tp+sp+selective")
        extra = full.flops_per_layer - tp.flops_per_layer  # what full recompute adds
        expected = p.forward_flops_per_layer - p.last_matmul_flops_per_layer  # forward but its last matmul
        difference = extra - expected
        lines.append(
            f"measured: forward {p.forward_flops_per_layer / 1e12:.4f} TFLOP per layer; full recompute adds "
            f"{extra / 1e12:.4f} TFLOP = forward − last matmul ({p.last_matmul_flops_per_layer / 1e12:.4f}) "
            f"{'+' if difference >= 0 else '−'} {abs(difference) / 1e9:.1f} GFLOP")
        stored_ratio = sp_sel.measured_bytes_per_layer / tp.measured_bytes_per_layer
        lines.append(f"TP+SP+selective stores {stored_ratio:.3f} × TP ({1 / stored_ratio:.1f}× less); "
                     f"full+sp / (2sbh/t) = {p.row('full+sp').ratio:.4f}; selective recompute overhead "
                     f"{sp_sel.recompute_overhead_pct:.2f}%"
                     + (" (JAX recomputes QKᵀ and softmax, not scores×V)" if cfg.attention == "explicit" else ""))
        if cfg.attention == "fused":
            none = p.row("tp+sp")
            saved = none.measured_bytes_per_layer - sp_sel.measured_bytes_per_layer
            saved_pct = 100 * saved / none.measured_bytes_per_layer
            lines.append(f"fused attention stores no scores: selective saves only {saved / MIB:.1f} MiB per layer "
                         f"over none with SP ({saved_pct:.1f}%); "
                         "the paper's formulas assume the explicit scores. Even `none` recomputes the attention "
                         "internals here (untagged), and no attention-probs dropout is applied")
    state = next(r for r in p.rows if r.tensor == t)
    stage = "" if p.pipeline == 1 else (f", first of {p.pipeline} pipeline stages: {-(-cfg.layers // p.pipeline)} "
                                        f"layers' state, {p.in_flight_layers:g} layers' activations ({p.schedule}, compiled)")
    lines.append(
        f"whole model per device (t={t}, d={p.data}{stage}"
        f"{', distributed optimizer' if p.distributed_optimizer else ''}): fp32 master weights "
        f"{state.params_bytes_per_device / GIB:.1f} GiB, gradients {state.gradient_bytes_per_device / GIB:.1f} GiB, "
        f"Adam moments {state.optimizer_bytes_per_device / GIB:.1f} GiB, {cfg.dtype} weight copy "
        f"{state.weight_copy_bytes_per_device / GIB:.1f} GiB (from shapes); activations = "
        f"stored/layer × in-flight layers + embedding/logits part from shapes (4·s·b·V/t f32 logits, LN input, masks); working = "
        f"the compiled float32 step's other temporaries (one layer's backward, the logits' gradient, RNG bits)"
        + ("; for bfloat16 an upper bound (only its float32 transients keep their size on a GPU)"
           if cfg.dtype != "float32" else ""))
    if p.in_flight is not None:
        lines += format_in_flight(p)
    lines += ["", *format_optimizer_state(p)]
    return "\n".join(lines)


def format_in_flight(p: Plan) -> list[str]:
    """The first stage's in-flight activations: compiled, scaled, and the paper's formula; and the bubble."""
    f, pp, v, m = p.in_flight, p.pipeline, p.virtual_stages, p.microbatches
    row = p.row(f.config)
    unit, u = _unit(f.compiled_stash_bytes, BYTES_MODEL)
    big, bu = _unit(f.stash_bytes, BYTES_MODEL)
    layer, lu = _unit(row.measured_bytes_per_layer, BYTES_LAYER)
    formula = "(p−1)/(v·m)" if p.schedule == "interleaved" else "(p−1)/m"
    return [
        f"pipeline {p.schedule}: p={pp} v={v} m={m}, first stage's in-flight activations ({f.config}):",
        f"  compiled  {f.slots} stash slots × {f.compiled_layers_per_chunk} layers = "
        f"{f.compiled_stash_bytes / u:.2f} {unit} ({f.per_layer_bytes / lu:.2f} {layer} per layer; the unpipelined "
        f"layer stores {row.measured_bytes_per_layer / lu:.2f} {layer}); received-activation/gradient buffers "
        f"{f.receive_bytes / u:.2f} {unit}",
        f"  scaled    to {f.layers_per_chunk} layers per chunk: {f.slots} × {f.layers_per_chunk} = {f.layers} layers' "
        f"worth = {f.stash_bytes / bu:.2f} {big} (the activ. column: each row's stored/layer × {f.layers})",
        f"  formula   the paper's {f.formula} = {f.formula_layers:g} layers",
        f"  source    {f.source}",
        f"  bubble    {p.bubble:.4f} (idle/busy ticks of the lock-step tick table) vs {formula} = {p.paper_bubble:.4f}",
    ]


def format_optimizer_state(p: Plan) -> list[str]:
    """The state per device without and with the distributed optimizer, in bytes per parameter
    (of the parameters on one device) and in total."""
    both = p.optimizer_state()
    without, with_it = both["without_distributed_optimizer"], both["with_distributed_optimizer"]
    unit, scale = _unit(without["bytes_per_device"]["total"], BYTES_MODEL)
    used = "with" if p.distributed_optimizer else "without"
    lines = [f"training state per device (t={p.tensor}, d={p.data}, {p.parameters_per_device / 1e6:,.1f}M parameters "
             f"per device; the totals above use: {used}):",
             f"  {'':<22}{'without B/param':>16}{'with B/param':>14}{'without ' + unit:>14}{'with ' + unit:>11}"]
    names = {"weight_copy": f"{p.config.dtype} weight copy", "gradients": "fp32 gradients",
             "master_weights": "fp32 master weights", "adam_moments": "Adam moments (2 × fp32)", "total": "total"}
    for key, label in names.items():
        lines.append(f"  {label:<22}{without['bytes_per_parameter'][key]:>16.2f}{with_it['bytes_per_parameter'][key]:>14.2f}"
                     f"{without['bytes_per_device'][key] / scale:>14.2f}{with_it['bytes_per_device'][key] / scale:>11.2f}")
    lines.append("  with: master weights and moments split over data (--distributed-optimizer); the weight copy is "
                 "gathered over data once per step; gradients are full during backward, then reduce-scattered")
    return lines


def format_recommendation(p: Plan, budget_gib: float) -> str:
    chosen, rejected = recommend(p, budget_gib * GIB)
    lines = [f"budget {budget_gib:g} GiB per device, tensor={p.tensor}, pipeline={p.pipeline}, data={p.data} "
             f"{'with' if p.distributed_optimizer else 'without'} the distributed optimizer, "
             f"micro-batch={p.micro_batch}; least recompute first:"]
    for r, why in rejected:
        lines.append(f"  {r.config:<22} does not fit: {why} (recompute +{r.recompute_overhead_pct:.2f}%)")
    if chosen is None:
        hint = "" if p.distributed_optimizer or p.data == 1 else ", or --distributed-optimizer"
        lines.append(f"  nothing fits: more tensor/pipeline parallelism or a smaller micro-batch is needed{hint}")
    else:
        lines.append(f"  recommended: {chosen.config} (remat={chosen.remat}, sequence_parallel="
                     f"{chosen.sequence_parallel}): {chosen.total_bytes_per_device / GIB:.1f} GiB, recompute "
                     f"+{chosen.recompute_overhead_pct:.2f}% FLOPs")
    return "\n".join(lines)
