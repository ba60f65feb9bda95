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
plus the non-layer part from shapes (`non_layer_activation_bytes`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import jax
import numpy as np

from jaxseq import aot
from jaxseq import cli
from jaxseq import hlo
from jaxseq import model as M
from jaxseq import train_step as T
from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, preset, replace, validate
from jaxseq.formulas import PAPER_CONFIGURATIONS, paper_activation_bytes, paper_hardware_flops
from jaxseq.mesh import make_mesh
from jaxseq.remat import POLICIES

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
                ("grad", 0, "none", c.tensor, c.sequence_parallel)]

    def compile_all(self, keys) -> None:
        from concurrent.futures import ThreadPoolExecutor

        todo = list(dict.fromkeys(k for k in keys if k not in self._cache))
        with ThreadPoolExecutor(self.workers) as pool:
            for key, compiled in zip(todo, pool.map(self._build, todo)):
                self._cache[key] = compiled

    def _build(self, key: tuple):
        kind, layers, remat, tensor, sp = key
        parallel, mesh = _mesh(tensor, sp, self.devices)
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
        return Measured(stored, flops, self._collectives(text, c.tensor))

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
        itemsize = _itemsize(self.cfg)
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
# Whole-model bytes per device


def _itemsize(cfg: ModelConfig) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.dtype]


def parameter_elements_per_device(cfg: ModelConfig, tensor: int) -> tuple[int, int]:
    """(all parameter elements, those cast to the compute dtype) on one device, from the shapes and
    the tensor-parallel specs (LayerNorm parameters stay float32: no copy)."""
    is_shape = lambda x: isinstance(x, tuple)
    shapes = jax.tree.leaves(M.param_shapes(cfg, tensor), is_leaf=is_shape)
    specs = jax.tree.leaves(T.param_specs(cfg, ParallelConfig(1, tensor, False)),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    total = cast = 0
    for shape, spec, is_cast in zip(shapes, specs, jax.tree.leaves(M.cast_mask())):
        split = tensor ** sum(1 for axis in spec if axis == "tensor")
        n = int(np.prod(shape, dtype=np.int64)) // split
        total += n
        cast += n if is_cast else 0
    return total, cast


def non_layer_activation_bytes(cfg: ModelConfig, b: int, tensor: int, sp: bool) -> int:
    """Activations outside the layers, from shapes (the paper's §4.3 terms): the embedding dropout
    mask (1 byte), the final LayerNorm's input and its f32 mean/rstd, the logits matmul's input
    (sequence-sharded under SP), and the float32 logits the cross-entropy keeps, 4·s·b·V/t."""
    s, h, e = cfg.seq_len, cfg.hidden, _itemsize(cfg)
    per_token = (1 if cfg.dropout > 0 else 0) * h + e * h + 8 + e * h
    return s * b * per_token // (tensor if sp else 1) + 4 * s * b * cfg.padded_vocab(tensor) // tensor


@dataclass(frozen=True)
class State:
    """Per-device bytes of the training state: fp32 parameters, fp32 gradients, Adam's two fp32
    moments, and the compute-dtype copy of the weights a step makes (none in float32)."""

    params: int
    gradients: int
    optimizer: int
    weight_copy: int

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.weight_copy


def state_bytes(cfg: ModelConfig, tensor: int) -> State:
    total, cast = parameter_elements_per_device(cfg, tensor)
    copy = 0 if cfg.dtype == "float32" else cast * _itemsize(cfg)
    return State(4 * total, 4 * total, 8 * total, copy)


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
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    in_flight_layers: float = 0  # layers' worth of activations the first stage holds (schedule tables)
    bubble: float = 0.0  # idle / busy ticks of the lock-step schedule
    paper_bubble: float = 0.0  # (p − 1)/m, or (p − 1)/(v·m) interleaved

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.config == name)

    def to_json(self) -> dict:
        cfg = self.config
        return {
            "model": self.model, "tensor": self.tensor, "seq_len": cfg.seq_len, "micro_batch": self.micro_batch,
            "pipeline": self.pipeline, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches, "in_flight_layers": self.in_flight_layers,
            "bubble": self.bubble, "paper_bubble": self.paper_bubble,
            "hidden": cfg.hidden, "heads": cfg.heads, "layers": cfg.layers, "vocab_size": cfg.vocab_size,
            "dtype": cfg.dtype, "attention": cfg.attention,
            "formula_flops_per_layer": self.formula_flops_per_layer,
            "forward_flops_per_layer": self.forward_flops_per_layer,
            "last_matmul_flops_per_layer": self.last_matmul_flops_per_layer,
            "units": "bytes and FLOPs per device; *_per_layer: one transformer layer, forward + backward",
            "rows": [asdict(r) for r in self.rows],
        }


def formula_flops_per_layer(cfg: ModelConfig, b: int, tensor: int) -> dict:
    """The paper's per-iteration FLOPs for one layer of one micro-batch, per device (V = 0: the
    logits are not part of a layer)."""
    s, h = cfg.seq_len, cfg.hidden
    per = lambda remat: paper_hardware_flops(b, s, 1, h, 0, remat) / tensor
    return {"model": per("none"), "hardware_selective": per("selective"), "hardware_full": per("full")}


def plan(cfg: ModelConfig, tensor: int, micro_batch: int, devices, model_name: str = "custom",
         pipeline: int = 1, policies=None, schedule: str = "1f1b", virtual_stages: int = 1,
         microbatches: int | None = None) -> Plan:
    """Compile every configuration and assemble the rows. `devices`: at least `tensor` devices.

    pipeline = p: the whole-model figures are those of the first pipeline stage, which holds the
    state of L/p layers (and the embedding) and, under 1F1B, activations of p micro-batches in
    flight, i.e. L layers' worth whatever p is (the paper's §4.2.3); under the interleaved schedule
    p·v + p − 1 chunks of L/(p·v) layers, under GPipe m micro-batches of L/p layers. The count comes from
    the schedule's tables (`jaxseq.schedule`), the bytes per layer from the compiled layer; the pipeline
    executor's compiled stash equals their product (tests/test_pipeline.py). `policies`: which
    registered policies beyond the paper's rows (default all). microbatches: m (default p)."""
    for c in configurations(tensor, policies):
        validate(cfg, ParallelConfig(1, c.tensor, c.sequence_parallel), c.remat)
    if not isinstance(micro_batch, int) or micro_batch <= 0:
        raise ConfigError(f"micro_batch={micro_batch!r} must be a positive integer")
    if not isinstance(pipeline, int) or not 0 < pipeline <= cfg.layers:
        raise ConfigError(f"pipeline={pipeline!r} must be a positive integer at most layers={cfg.layers}")
    stage = replace(cfg, layers=-(-cfg.layers // pipeline))
    n_micro = pipeline if microbatches is None else microbatches
    in_flight_layers, bubble, paper_bubble = float(cfg.layers), 0.0, 0.0
    if pipeline > 1 or virtual_stages > 1 or schedule != "1f1b":
        from jaxseq.schedule import Schedule

        sched = Schedule.make(schedule, pipeline, n_micro, virtual_stages, cfg.layers)
        schedule = sched.name
        in_flight_layers = sched.in_flight(0) * cfg.layers / (pipeline * virtual_stages)
        bubble, paper_bubble = sched.bubble, sched.paper_bubble
    if len(devices) < tensor:
        raise ConfigError(f"tensor={tensor} needs {tensor} devices; {len(devices)} available")
    compiler = Compiler(cfg, micro_batch, devices)
    s, h, a, b = cfg.seq_len, cfg.hidden, cfg.heads, micro_batch
    configs = configurations(tensor, policies)
    compiler.compile_all([k for c in configs for k in compiler.programs(c)] + compiler.forward_programs(tensor))
    measured = {c: compiler.measure(c) for c in configs}
    baseline = {(c.tensor, c.sequence_parallel): m.flops_per_layer for c, m in measured.items() if c.remat == "none"}
    rows = []
    for c, m in measured.items():
        formula = paper_activation_bytes(c.paper, s, b, h, a, c.tensor) if c.paper else None
        state = state_bytes(stage, c.tensor)
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
            activation_bytes_per_device=activations, total_bytes_per_device=state.total + activations,
        ))
    return Plan(model_name, cfg, tensor, micro_batch, rows, formula_flops_per_layer(cfg, b, tensor),
                compiler.forward_flops_per_layer(tensor), 2 * b * s * cfg.mlp_hidden * h / tensor, pipeline,
                schedule, virtual_stages, n_micro, in_flight_layers, bubble, paper_bubble)


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
    tl, tu = _unit(max(r.total_bytes_per_device for r in p.rows), BYTES_MODEL)
    lines.append(f"{'config':<22}{'remat':<14}{'SP':<4}{'t':>3}{'stored ' + bl:>12}{'formula ' + bl:>13}{'ratio':>8}"
                 f"{fl:>9}{'recompute':>11}{'coll. ' + cl:>11}{'activ. ' + al:>12}{'total ' + tl:>11}")
    for r in p.rows:
        formula = None if r.formula_bytes_per_layer is None else r.formula_bytes_per_layer / bu
        lines.append(
            f"{r.config:<22}{r.remat:<14}{'yes' if r.sequence_parallel else 'no':<4}{r.tensor:>3}"
            f"{r.measured_bytes_per_layer / bu:>12.1f}{_fmt(formula, '.1f'):>13}"
            f"{_fmt(r.ratio, '.4f'):>8}{r.flops_per_layer / fu:>9.4f}{r.recompute_overhead_pct:>10.2f}%"
            f"{r.collective_bytes_per_layer / cu:>11.1f}{r.activation_bytes_per_device / au:>12.2f}"
            f"{r.total_bytes_per_device / tu:>11.1f}")
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
                                        f"layers' state, {p.in_flight_layers:g} layers' activations ({p.schedule})")
    lines.append(
        f"whole model per device (t={t}{stage}): parameters {state.params_bytes_per_device / GIB:.1f} GiB fp32, gradients "
        f"{state.gradient_bytes_per_device / GIB:.1f} GiB, Adam moments {state.optimizer_bytes_per_device / GIB:.1f} GiB, "
        f"{cfg.dtype} weight copy {state.weight_copy_bytes_per_device / GIB:.1f} GiB; activations = stored/layer × L "
        f"+ embedding/logits part from shapes (4·s·b·V/t f32 logits, LN input, masks)")
    if p.pipeline > 1:
        L, pp, v, m = cfg.layers, p.pipeline, p.virtual_stages, p.microbatches
        formula = {"1f1b": ("L", L), "interleaved": ("L·(1 + (p−1)/(p·v))", L * (1 + (pp - 1) / (pp * v))),
                   "gpipe": ("L·m/p", L * m / pp)}[p.schedule]
        lines.append(
            f"pipeline {p.schedule}: p={pp} v={v} m={m}; first stage holds {p.in_flight_layers:g} layers' activations "
            f"(schedule tables) vs the paper's {formula[0]} = {formula[1]:g}; bubble {p.bubble:.4f} "
            f"(idle/busy ticks) vs {'(p−1)/(v·m)' if p.schedule == 'interleaved' else '(p−1)/m'} = {p.paper_bubble:.4f}")
    return "\n".join(lines)


def format_recommendation(p: Plan, budget_gib: float) -> str:
    chosen, rejected = recommend(p, budget_gib * GIB)
    lines = [f"budget {budget_gib:g} GiB per device, tensor={p.tensor}, pipeline={p.pipeline}, "
             f"micro-batch={p.micro_batch}; least recompute first:"]
    for r, why in rejected:
        lines.append(f"  {r.config:<22} does not fit: {why} (recompute +{r.recompute_overhead_pct:.2f}%)")
    if chosen is None:
        lines.append("  nothing fits: more tensor/pipeline parallelism or a smaller micro-batch is needed")
    else:
        lines.append(f"  recommended: {chosen.config} (remat={chosen.remat}, sequence_parallel="
                     f"{chosen.sequence_parallel}): {chosen.total_bytes_per_device / GIB:.1f} GiB, recompute "
                     f"+{chosen.recompute_overhead_pct:.2f}% FLOPs")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m jaxseq.plan", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt3-175b", help="model preset (default gpt3-175b)")
    p.add_argument("--tensor", type=int, default=8, help="tensor-parallel size t (default 8)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch b (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length s (default: the preset's)")
    p.add_argument("--attention", default="explicit", help="explicit (the paper's) or fused")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype (default bfloat16)")
    p.add_argument("--pipeline", type=int, default=1,
                   help="pipeline stages p for the whole-model figures (first stage: L/p layers' state, "
                        "L layers' activations under 1F1B); default 1")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, default=1, help="chunks per stage v (interleaved); default 1")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step m (default p)")
    p.add_argument("--budget-gib", type=float, default=None, help="recommend the least recompute that fits")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    return p


def resolve(args) -> ModelConfig:
    cfg = replace(preset(args.preset), attention=args.attention, dtype=args.dtype)
    if args.seq_len is not None:
        cfg = replace(cfg, seq_len=args.seq_len)
    if args.budget_gib is not None and not args.budget_gib > 0:
        raise ConfigError(f"budget_gib={args.budget_gib:g} must be positive")
    return cfg


def host_devices(n: int):
    """n simulated CPU devices (the CLI edge only: must run before JAX's backend starts)."""
    jax.config.update("jax_num_cpu_devices", max(n, 1))
    return jax.devices("cpu")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return cli.run(lambda: _plan(args))


def _plan(args) -> int:
    cfg = resolve(args)
    validate(cfg, ParallelConfig(1, args.tensor, False), "none")
    try:
        p = plan(cfg, args.tensor, args.micro_batch, host_devices(args.tensor), args.preset, args.pipeline,
                 schedule=args.schedule, virtual_stages=args.virtual_stages, microbatches=args.microbatches)
    except ValueError as e:  # e.g. JAX refusing a device count: still one line
        raise ConfigError(str(e)) from None
    if args.json:
        out = p.to_json()
        if args.budget_gib is not None:
            chosen, rejected = recommend(p, args.budget_gib * GIB)
            out["budget"] = {"budget_gib": args.budget_gib, "recommended": chosen and chosen.config,
                             "rejected": [{"config": r.config, "reason": why} for r, why in rejected]}
        print(json.dumps(out, indent=1))
    else:
        print(format_table(p))
        if args.budget_gib is not None:
            print()
            print(format_recommendation(p, args.budget_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
