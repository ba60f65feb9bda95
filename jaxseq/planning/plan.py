"""The plan: per configuration (remat policy, SP, t), one layer's stored bytes, FLOPs and collectives from
its compiled program (`planning.measure`), and the whole model's bytes per device (`planning.memory`):
state + activations (per layer × the layers' worth in flight: L, or the first pipeline stage's count,
read from the compiled pipelined step by `planning.in_flight`) + the step's working memory. The configuration with
the least recompute that fits a budget is `planning.recommend`'s; the text is `planning.report`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, on_platform, replace, validate, validate_fsdp
from jaxseq.models import formulas
from jaxseq.models.model import tagged_names, traits
from jaxseq.offload import ALL, parse, resolve, stored_names
from jaxseq.models.formulas import PAPER_CONFIGURATIONS, paper_activation_bytes, paper_hardware_flops, train_flops
from jaxseq.parallel.schedule import Schedule
from jaxseq.planning import autotune, gpu_target, host_tier
from jaxseq.planning.in_flight import InFlight, compiled_in_flight
from jaxseq.planning.measure import Compiler, Measured, RowSpec
from jaxseq.planning.memory import (EMBEDDING_GROUP, State, activation_bytes, fsdp_gathered_bytes,
                                    non_layer_activation_bytes, parameter_elements_per_device, peak_bytes,
                                    state_bytes, state_bytes_by_part)
from jaxseq.remat import POLICIES


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


CPU_SOURCE = "XLA:CPU, simulated devices (total = state + stored × layers in flight + a float32 step's working memory)"
# Every row's FLOPs and recompute, with --target too: a program compiled for a GPU without one counts no FLOPs
FLOPS_SOURCE = "XLA:CPU's cost_analysis() of each row's layer compiled on simulated CPU devices"


def target_source(target: str, recorded: str | None = None) -> str:
    gemms = (f"its GEMMs as a GPU run's autotuner chose them, recorded in {recorded}; eight H100 peaks within 0.13%"
             if recorded else "the larger of its programs with Triton's and cuBLAS's GEMMs; within 1.7% of the peaks "
                              "an H100 measured, scanned layers")
    return (f"XLA:GPU {target}, compiled without a GPU (total = the whole donated train step's argument + output + "
            f"temp − alias, {gemms})")


def pipeline_row(rows: list[RowSpec]) -> RowSpec:
    """The row the pipelined step is compiled for: Megatron's recommendation (TP+SP+selective), else the first."""
    names = {c.name: c for c in rows}
    return names.get("tp+sp+selective") or names.get("selective") or rows[0]


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
    memory_source: str = CPU_SOURCE  # what stored and total were read from
    # of the working memory: FSDP's gathered weights (`memory.fsdp_gathered_bytes`)
    fsdp_gathered_bytes_per_device: int = 0
    # of the activations: zb-h1's W stash, the deferred weight gradients' inputs the first stage's slots hold
    # (`formulas.deferred_stash_bytes` × slots × layers per chunk; tests hold the formula to the compiled carry)
    deferred_stash_bytes_per_device: float = 0
    # Host memory as a tier (`plan --offload`, `--offload-optimizer`; planning/host_tier.py): the stored tensors this
    # row keeps in host memory, what it holds there per device, what crosses PCIe per step and its seconds
    offload: tuple[str, ...] = ()
    offload_optimizer: bool = False
    host_bytes_per_device: float = 0
    pcie_bytes_per_step: float = 0
    pcie_seconds_per_step: float = 0
    # with a target: the GEMMs the whole step's GPU program runs per step, and of them FP8 GEMMs
    # (`hlo_flops.gemm_count`)
    gemms_per_step: int | None = None
    fp8_gemms_per_step: int | None = None
    gemm_flops_per_step: float | None = None  # their FLOPs per device, all and the FP8 GEMMs'
    fp8_gemm_flops_per_step: float | None = None
    # FP8 (--fp8, with a target): the whole step's peak above the same step's in bf16, and the FP8 copies one layer's
    # loops make per micro-batch, by kind (`hlo_kernels.fp8_copy_bytes`: none is kept from forward to backward)
    fp8_extra_bytes_per_device: int | None = None
    fp8_copy_bytes_per_layer: dict | None = None


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
    data: int = 1  # data-parallel size d: d × context divides master weights and moments with the distributed optimizer
    distributed_optimizer: bool = False  # whether the rows' totals (and the budget) assume it
    parameters_per_device: int = 0  # of the first stage, split by tensor
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    in_flight_layers: float = 0  # layers' worth of activations the first stage holds (compiled pipelined step)
    bubble: float = 0.0  # idle / busy ticks of the lock-step schedule
    paper_bubble: float = 0.0  # (p − 1)/m, or (p − 1)/(v·m) interleaved
    in_flight: InFlight | None = None  # pipeline > 1: stage 0's stash, from the compiled pipelined step
    context: int = 1  # every row compiled on a context × t mesh (the sequence split c ways, attention included)
    context_strategy: str = "all-gather"
    context_kv: dict | None = None  # formulas.context_kv_bytes: transient K/V and K/V traffic per layer per device
    fsdp: int = 1  # FSDP: every weight's state split over this many ranks (each layer gathers its weights)
    target: str | None = None  # the GPU whose programs the rows' stored bytes and totals are (not their FLOPs)
    pcie_gb_per_s: float | None = None  # with --offload / --offload-optimizer: the node's PCIe, per direction

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.config == name)

    def to_json(self) -> dict:
        cfg = self.config
        return {
            "model": self.model, "tensor": self.tensor, "seq_len": cfg.seq_len, "micro_batch": self.micro_batch,
            "pipeline": self.pipeline, "data": self.data, "fsdp": self.fsdp,
            "distributed_optimizer": self.distributed_optimizer,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "microbatches": self.microbatches, "in_flight_layers": self.in_flight_layers,
            "bubble": self.bubble, "paper_bubble": self.paper_bubble,
            "in_flight": self.in_flight and self.in_flight.to_json(),
            "family": cfg.family, "hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.num_kv_heads,
            "mlp_hidden": cfg.mlp_hidden, "layers": cfg.layers, "vocab_size": cfg.vocab_size,
            "dtype": cfg.dtype, "attention": cfg.attention,
            "formula_flops_per_layer": self.formula_flops_per_layer,
            "forward_flops_per_layer": self.forward_flops_per_layer,
            "last_matmul_flops_per_layer": self.last_matmul_flops_per_layer,
            "units": "bytes and FLOPs per device; *_per_layer: one transformer layer, forward + backward",
            "rows": [asdict(r) for r in self.rows],
            "optimizer_state": self.optimizer_state(),
            "stage_state": self.stage_state() if self.pipeline > 1 else None,
            "context": self.context, "context_strategy": self.context_strategy,
            "context_kv_bytes_per_layer": self.context_kv,
            "target": self.target, "flops_source": FLOPS_SOURCE,
            "host_tier": self.pcie_gb_per_s and {"pcie_gb_per_s": self.pcie_gb_per_s,
                                                 "pcie_efficiency": host_tier.PCIE_EFFICIENCY,
                                                 "overlap": host_tier.OVERLAP},
        }

    def state(self, tensor: int | None = None, distributed_optimizer: bool | None = None,
              by_part: bool = False):
        """The one count of this plan's state per device (rows, totals, the state tables): `plan_state` at its
        configuration (tensor, distributed optimizer: the plan's unless given)."""
        return plan_state(self.config, self.tensor if tensor is None else tensor, self.data, self.context,
                          self.distributed_optimizer if distributed_optimizer is None else distributed_optimizer,
                          self.pipeline, by_part, fsdp=self.fsdp)

    def optimizer_state(self) -> dict:
        """Per-device state bytes and bytes per parameter without and with the distributed optimizer (with it,
        split over data × context, as the rows count it)."""
        out = {}
        for key, distributed in (("without_distributed_optimizer", False), ("with_distributed_optimizer", True)):
            parts = _parts(self.state(distributed_optimizer=distributed))
            out[key] = {"bytes_per_device": parts,
                        "bytes_per_parameter": {k: v / self.parameters_per_device for k, v in parts.items()}}
        return out

    def stage_state(self) -> dict:
        """With a pipeline: each device's state by part, as the rows count it (the plan's data × context size and
        distributed-optimizer choice). In jaxseq's one SPMD program every stage holds the same: its L/p layers,
        and the embedding group (embedding, final norm, an untied head) whole for compute, its master weights and
        moments split over `pipe`; Megatron-LM's first and last stages hold that group's state whole (its
        optimizer state unsplit), its middle stages none of it."""
        parts = self.state(by_part=True)
        megatron = plan_state(self.config, self.tensor, self.data, self.context, self.distributed_optimizer,
                              self.pipeline, by_part=True, embedding_over_pipe=False, fsdp=self.fsdp)[EMBEDDING_GROUP]
        return {"layers": _parts(parts["layers"]), "embedding_group": _parts(parts[EMBEDDING_GROUP]),
                "megatron_first_stage_embedding_group": _parts(megatron)}


def plan_state(cfg: ModelConfig, tensor: int, data: int, context: int, distributed_optimizer: bool,
               pipeline: int = 1, by_part: bool = False, embedding_over_pipe: bool = True, fsdp: int = 1):
    """Per-device state bytes of the first of `pipeline` stages (its L/p layers): `memory.state_bytes`, or by
    part (`state_bytes_by_part`). The distributed optimizer splits the fp32 master weights and Adam moments over
    data × context (a context rank holds the same weights as its data rank: `Layout.master_specs` shards them over
    both), so every figure of a plan, its rows as its state tables, counts d·c here and nowhere else.
    `embedding_over_pipe=False`: the embedding group's optimizer state unsplit over `pipe` (Megatron-LM's first
    stage). fsdp = F: every weight's master, moments and gradient split over F too, no compute copy (FSDP)."""
    stage = replace(cfg, layers=-(-cfg.layers // pipeline))
    pipe = pipeline if embedding_over_pipe else 1
    count = state_bytes_by_part if by_part else state_bytes
    return count(stage, tensor, data * context, distributed_optimizer, pipe, fsdp)


def _parts(state: State) -> dict:
    return {"weight_copy": state.weight_copy, "gradients": state.gradients, "master_weights": state.params,
            "adam_moments": state.optimizer, "total": state.total}


def formula_flops_per_layer(cfg: ModelConfig, b: int, tensor: int) -> dict:
    """The formulas' FLOPs for one layer of one micro-batch, per device: GPT's the paper's per-iteration
    formulas (V = 0: the logits are not part of a layer); another family's (which the paper's do not
    describe) `formulas.train_flops` of one layer, with the replays of `selective` and `full`."""
    if traits(cfg).papers_formulas:
        s, h = cfg.seq_len, cfg.hidden
        per = lambda remat: paper_hardware_flops(b, s, 1, h, 0, remat) / tensor
    else:
        per = lambda remat: (train_flops(replace(cfg, layers=1), b, None if remat == "none" else remat)
                             - train_flops(replace(cfg, layers=0), b)) / tensor
    return {"model": per("none"), "hardware_selective": per("selective"), "hardware_full": per("full")}


def formula_bytes_per_layer(cfg: ModelConfig, c: RowSpec, b: int, context: int = 1,
                            strategy: str = "all-gather") -> float | None:
    """What row c's layer should store: GPT's paper rows the paper's Table 2; every row of another family
    (explicit attention), and every row at context > 1 (the paper has no context axis), `formulas.activation_bytes`,
    the same count term by term for its tensors, a mixture of experts' layer's with its MoE MLP's
    (`formulas.moe_activation_bytes`); None where it has no formula (fused attention)."""
    if context > 1:
        if cfg.attention != "explicit":
            return None
        try:
            return formulas.activation_bytes(cfg, c.remat, b, c.tensor, c.sequence_parallel, context, strategy)
        except ConfigError:
            return None
    if traits(cfg).papers_formulas:
        return paper_activation_bytes(c.paper, cfg.seq_len, b, cfg.hidden, cfg.heads, c.tensor) if c.paper else None
    if cfg.attention != "explicit":
        return None
    return formulas.activation_bytes(cfg, c.remat, b, c.tensor, c.sequence_parallel)


def plan(cfg: ModelConfig, tensor: int, micro_batch: int, devices, model_name: str = "custom",
         pipeline: int = 1, policies=None, schedule: str = "1f1b", virtual_stages: int = 1,
         microbatches: int | None = None, data: int = 1, distributed_optimizer: bool = False, context: int = 1,
         context_strategy: str = "all-gather", progress=None, target: str | None = None, fsdp: int = 1,
         recorded: autotune.RecordedGemms | None = None, offload: str | None = None, offload_optimizer: bool = False,
         pcie_gb_per_s: float = 64.0) -> Plan:
    """Compile every configuration and assemble the rows. `devices`: at least `tensor` devices.

    pipeline = p: the whole-model figures are those of the first pipeline stage, which holds the
    state of L/p layers (and the embedding) and, under 1F1B, activations of p micro-batches in
    flight, i.e. L layers' worth whatever p is (the paper's §4.2.3); under the interleaved schedule
    p·v + p − 1 chunks of L/(p·v) layers, under GPipe m micro-batches of L/p layers. That count is read
    from the compiled pipelined step (`compiled_in_flight`: p × t simulated devices, `devices` must hold
    them), the bytes per layer of each row from its compiled layer. `policies`: which
    registered policies beyond the paper's rows (default all). microbatches: m (default p).
    data = d, distributed_optimizer: the state bytes of each row (and so the budget) with the fp32
    master weights and Adam moments split d ways; the table reports both ways whatever is chosen.
    context = c: every row compiled on a c × t mesh (`context_strategy`: all-gather or ring), `devices` holding
    c·t; with it the formula column is `formulas.activation_bytes` at context c, and the K/V context
    parallelism holds for a moment and moves per layer (`formulas.context_kv_bytes`) is reported.
    progress: a `planning.progress.Progress`, told of each program as it starts compiling.
    target: a GPU (`gpu_target.TARGETS`): each row's stored bytes and total are then XLA:GPU's, from that row's
    layer and its whole train step compiled for the GPU (`on_target`); FLOPs and collectives stay XLA:CPU's.
    recorded: with a target, the GEMM choices a GPU run recorded: each row's whole step compiles with them where the
    file holds a choice for each of its GEMMs (`autotune.step_bytes`), and the file must hold some row's.
    fsdp = F: the state of every weight split over F ranks (FSDP; with data, HSDP) and each row's working memory
    holding the gathered weights (`memory.fsdp_gathered_bytes`); the layers compile as before (an fsdp rank runs b
    sequences like a data rank: its stored activations are the same).
    offload, offload_optimizer: each row with the stored tensors `offload` names (or `all`) that its policy stores in
    host memory, and the master weights and moments with `offload_optimizer`: its device bytes as before and its host
    bytes, PCIe bytes and seconds at `pcie_gb_per_s` per direction (`offloaded_row`; with `target`, both byte counts
    the GPU program's own)."""
    configs = configurations(tensor, policies)
    _check_arguments(cfg, configs, micro_batch, data, pipeline, context, context_strategy, fsdp, distributed_optimizer)
    if target is not None:
        gpu_target.target_devices(target, 1)  # an unknown GPU or no CUDA plugin: one line before anything compiles
    n_micro = pipeline if microbatches is None else microbatches
    schedule, in_flight_layers, bubble, paper_bubble = _schedule_figures(cfg, pipeline, schedule, virtual_stages,
                                                                         n_micro)
    deferred_layers = _deferred_layers(cfg, pipeline, schedule, virtual_stages, n_micro)
    _check_devices(devices, tensor * context, pipeline)  # tensor here: context × tensor, the rows' mesh
    tagged = tagged_names(on_platform(cfg, "gpu") if target is not None else cfg) if offload else frozenset()
    _check_offload(offload, [c.remat for c in configs], tagged)
    compiler = Compiler(cfg, micro_batch, devices, context=context, strategy=context_strategy, progress=progress)
    keys = [k for c in configs for k in compiler.programs(c)] + compiler.forward_programs(tensor)
    if progress is not None:  # the whole job, before its first program: the CPU's, then each row's for the GPU
        on_gpu = 0 if target is None else len(configs) * (1 + (recorded is not None))
        progress.expect(len(compiler.todo(keys)) + (pipeline > 1) + on_gpu)
    compiler.compile_all(keys)
    measured = {c: compiler.measure(c) for c in configs}
    in_flight = None
    if pipeline > 1:
        if progress is not None:
            progress.compiling(f"the pipelined {schedule} step ({pipeline_row(configs).name}, pipe={pipeline} × "
                               f"tensor={tensor}{f' × context={context}' if context > 1 else ''})")
        in_flight = compiled_in_flight(cfg, pipeline_row(configs), micro_batch, devices, schedule, pipeline,
                                       virtual_stages, n_micro, context, context_strategy)
        in_flight_layers = in_flight.layers
    stage = replace(cfg, layers=-(-cfg.layers // pipeline))
    baseline = {(c.tensor, c.sequence_parallel): m.flops_per_layer for c, m in measured.items() if c.remat == "none"}
    rows = [make_row(cfg, c, m, micro_batch, in_flight_layers, baseline[(c.tensor, c.sequence_parallel)],
                     plan_state(cfg, c.tensor, data, context, distributed_optimizer, pipeline, fsdp=fsdp), context,
                     context_strategy, fsdp_gathered_bytes(cfg, c.tensor, fsdp), deferred_layers)
            for c, m in measured.items()]
    tier = dict(tagged=tagged, text=offload, optimizer=offload_optimizer, pcie=pcie_gb_per_s, microbatches=n_micro,
                device_layers=stage.layers, context=context, strategy=context_strategy, micro_batch=micro_batch,
                in_flight_layers=in_flight_layers,
                state=lambda c: plan_state(cfg, c.tensor, data, context, distributed_optimizer, pipeline, fsdp=fsdp))
    if offload or offload_optimizer:
        rows = [offloaded_row(cfg, r, c, **tier) for r, c in zip(rows, measured)]
    if target is not None:
        step = dict(data=data, distributed_optimizer=distributed_optimizer, pipeline=pipeline, schedule=schedule,
                    virtual_stages=virtual_stages, context=context, strategy=context_strategy, fsdp=fsdp,
                    offload_optimizer=offload_optimizer)
        found = recorded_totals(cfg, list(measured), micro_batch, n_micro, target, step, recorded, progress)
        rows = [on_target(cfg, r, c, micro_batch, n_micro, in_flight_layers, context, target, step, progress,
                          recorded and recorded.source, found.get(c)) for r, c in zip(rows, measured)]
        if offload or offload_optimizer:
            rows = [offloaded_on_target(cfg, r, c, micro_batch, n_micro, target, step, progress, **tier)
                    for r, c in zip(rows, measured)]
    s, h, b = cfg.seq_len, cfg.hidden, micro_batch
    per_device = {k: v / context for k, v in formula_flops_per_layer(cfg, b, tensor).items()}  # s/c tokens a rank
    return Plan(model_name, cfg, tensor, micro_batch, rows, per_device,
                compiler.forward_flops_per_layer(tensor), 2 * b * s * cfg.mlp_hidden * h / (tensor * context), pipeline,
                data=data, distributed_optimizer=distributed_optimizer,
                parameters_per_device=parameter_elements_per_device(stage, tensor)[0], schedule=schedule,
                virtual_stages=virtual_stages, microbatches=n_micro, in_flight_layers=float(in_flight_layers),
                bubble=bubble, paper_bubble=paper_bubble, in_flight=in_flight, context=context,
                context_strategy=context_strategy,
                context_kv=formulas.context_kv_bytes(cfg, micro_batch, tensor, context, context_strategy), fsdp=fsdp,
                target=target, pcie_gb_per_s=pcie_gb_per_s if offload or offload_optimizer else None)


def _check_offload(text: str | None, policies: list[str], tagged: frozenset[str]) -> None:
    """One line for an --offload name that no row's policy stores (or the model does not tag)."""
    names = [n for n in parse(text) if n != ALL]
    for name in names:
        if not any(name in stored_names(p) for p in policies) or name not in tagged:
            valid = sorted({n for p in policies for n in stored_names(p)} & set(tagged))
            raise ConfigError(f"offload={name!r} is no tensor these rows' policies store here; valid: {ALL}, or any of "
                              f"{', '.join(valid)}")


def row_offload(text: str | None, remat: str, tagged: frozenset[str]) -> tuple[str, ...]:
    """The names row policy `remat` offloads of `--offload text`: `all` its own, else those of the list it stores."""
    if not text:
        return ()
    if parse(text) == (ALL,):
        return resolve(ALL, remat, tagged)
    return tuple(n for n in stored_names(remat) if n in parse(text) and n in tagged)


def offloaded_row(cfg: ModelConfig, row: Row, c: RowSpec, *, tagged, text, optimizer, pcie, microbatches,
                  device_layers, context, strategy, micro_batch, in_flight_layers, state) -> Row:
    """Row `row` with host memory as a tier: its policy's share of the offloaded names (`row_offload`) out of its
    activations, `host_tier.bytes_per_layer` × the layers in flight; with `optimizer`, the master weights and moments
    out of the state during the layer loops (the update holds them on the device: `State.after_loop` stays). Its
    device total is the step's peak so (`memory.peak_bytes`); its host bytes and PCIe traffic
    `host_tier.host_tier`'s."""
    names = row_offload(text, c.remat, tagged)
    per_layer = host_tier.bytes_per_layer(cfg, c.remat, names, micro_batch, c.tensor, c.sequence_parallel, context,
                                          strategy)
    s = state(c)
    held = s.params + s.optimizer if optimizer else 0
    tier = host_tier.host_tier(per_layer, in_flight_layers, device_layers, microbatches, held, pcie)
    activations = row.activation_bytes_per_device - per_layer * in_flight_layers
    total = peak_bytes(s.at_peak - held, activations, row.working_bytes_per_device, after_loop=s.after_loop)
    return dataclasses.replace(row, offload=names, offload_optimizer=optimizer, activation_bytes_per_device=activations,
                               total_bytes_per_device=total, host_bytes_per_device=tier.host_bytes,
                               pcie_bytes_per_step=tier.pcie_bytes, pcie_seconds_per_step=tier.seconds())


def offloaded_on_target(cfg: ModelConfig, row: Row, c: RowSpec, micro_batch: int, microbatches: int, target: str,
                        step: dict, progress=None, *, tagged, text, **_) -> Row:
    """An offloaded row (`offloaded_row`) with the GPU program's own figures: its whole train step compiled for
    `target` with the row's names offloaded (and the optimizer state, where asked): the device peak and what the
    program holds in host memory (`gpu_target.step_memory`)."""
    whole = gpu_target.step_parallel(tensor=c.tensor, sequence_parallel=c.sequence_parallel, **step)
    if progress is not None:
        progress.compiling(f"{c.name} for {target}: the whole train step with its offload")
    device, host = gpu_target.step_memory(cfg, whole, c.remat, micro_batch, microbatches if step["pipeline"] > 1 else 1,
                                          target, row.offload)
    return dataclasses.replace(row, total_bytes_per_device=device, host_bytes_per_device=host,
                               memory_source=target_source(target) + "; host bytes: the same program's")


def recorded_totals(cfg: ModelConfig, configs: list[RowSpec], micro_batch: int, microbatches: int, target: str,
                    step: dict, recorded: autotune.RecordedGemms | None, progress=None) -> dict:
    """Row → its whole step's peak compiled with the `recorded` GEMM choices, for the rows whose every GEMM the file
    holds a choice for (`autotune.step_bytes`); one line, before any other GPU program compiles, where it holds
    none's."""
    if recorded is None:
        return {}
    found = {}
    for c in configs:
        whole = gpu_target.step_parallel(tensor=c.tensor, sequence_parallel=c.sequence_parallel, **step)
        if progress is not None:
            progress.compiling(f"{c.name} for {target}: the whole train step with the recorded GEMM choices")
        total = autotune.step_bytes(cfg, whole, c.remat, micro_batch, microbatches if step["pipeline"] > 1 else 1,
                                    target, recorded)
        if total is not None:
            found[c] = total
    if not found:
        raise ConfigError(f"--autotune-results {recorded.source}: holds the choices of none of these steps (each has a "
                          f"GEMM it holds no choice for); record it from this model, shape, micro-batch, policy and "
                          f"mesh on a {target}, and plan with the JAX that recorded it")
    return found


def on_target(cfg: ModelConfig, row: Row, c: RowSpec, micro_batch: int, microbatches: int, in_flight_layers: float,
              context: int, target: str, step: dict, progress=None, recorded: str | None = None,
              recorded_total: int | None = None) -> Row:
    """Row `row` with XLA:GPU's figures for `target`: one layer's stored bytes (its layer compiled for the GPU)
    and the total, the whole train step's peak per device compiled for the GPU at the model's depth and dtype
    on the full mesh (`gpu_target.step_parallel`); the working column is what that peak holds beyond state and
    stored activations. Where the step was compiled with the GEMM choices recorded in file `recorded`
    (`recorded_totals`), the total is that program's, `recorded_total`.
    """
    layer = ParallelConfig(data=1, context=context, tensor=c.tensor, sequence_parallel=c.sequence_parallel,
                           context_strategy=step["strategy"])
    whole = gpu_target.step_parallel(tensor=c.tensor, sequence_parallel=c.sequence_parallel, **step)
    if progress is not None:
        progress.compiling(f"{c.name} for {target}: one layer, and the whole train step on {whole.num_devices} "
                           f"target device(s)")
    stored = gpu_target.stored_bytes_per_layer(cfg, layer, c.remat, micro_batch, target, run=whole)
    m = microbatches if step["pipeline"] > 1 else 1
    program = gpu_target.step_program(cfg, whole, c.remat, micro_batch, m, target, priced=False)
    total = recorded_total or program.peak_bytes
    fp8 = fp8_columns(cfg, whole, c.remat, micro_batch, m, target, program) if cfg.fp8 else {}
    activations = row.deferred_stash_bytes_per_device + activation_bytes(
        stored, in_flight_layers, non_layer_activation_bytes(cfg, micro_batch, c.tensor, c.sequence_parallel, context))
    state = row.total_bytes_per_device - row.activation_bytes_per_device - row.working_bytes_per_device
    return dataclasses.replace(
        row, measured_bytes_per_layer=stored, ratio=stored / row.formula_bytes_per_layer if row.formula_bytes_per_layer
        else None, activation_bytes_per_device=activations, working_bytes_per_device=total - state - activations,
        total_bytes_per_device=total, memory_source=target_source(target, recorded if recorded_total else None),
        gemms_per_step=program.gemms.gemms, fp8_gemms_per_step=program.gemms.fp8_gemms,
        gemm_flops_per_step=program.gemms.flops, fp8_gemm_flops_per_step=program.gemms.fp8_flops, **fp8)


def fp8_columns(cfg: ModelConfig, whole: ParallelConfig, remat: str, micro_batch: int, microbatches: int, target: str,
                program: gpu_target.StepProgram) -> dict:
    """An FP8 row's memory columns: its step's peak above the same step's in bf16 (compiled for the target too), and
    the FP8 copies one layer makes (`gpu_target.fp8_copy_bytes`)."""
    bf16 = gpu_target.step_bytes(replace(cfg, fp8=False), whole, remat, micro_batch, microbatches, target)
    return {"fp8_extra_bytes_per_device": program.peak_bytes - bf16,
            "fp8_copy_bytes_per_layer": program.fp8_copy_bytes_per_layer}


def _check_arguments(cfg: ModelConfig, configs: list[RowSpec], micro_batch: int, data: int, pipeline: int,
                     context: int = 1, strategy: str = "all-gather", fsdp: int = 1,
                     distributed_optimizer: bool = False) -> None:
    """One-line ConfigErrors before anything is compiled."""
    if not isinstance(fsdp, int) or fsdp <= 0:
        raise ConfigError(f"fsdp={fsdp!r} must be a positive integer")
    validate_fsdp(cfg, ParallelConfig(data=data, fsdp=fsdp, context=context,
                                      distributed_optimizer=distributed_optimizer))
    if context > 1 and pipeline > 1:  # the pipelined step at context c (its whole-model figures): as `train` checks it
        validate(cfg, ParallelConfig(pipe=pipeline, context=context, context_strategy=strategy), "none")
    for c in configs:
        validate(cfg, ParallelConfig(data=1, context=context, tensor=c.tensor, sequence_parallel=c.sequence_parallel,
                                     context_strategy=strategy), c.remat)
    if not isinstance(micro_batch, int) or micro_batch <= 0:
        raise ConfigError(f"micro_batch={micro_batch!r} must be a positive integer")
    if not isinstance(data, int) or data <= 0:
        raise ConfigError(f"data={data!r} must be a positive integer")
    if not isinstance(pipeline, int) or not 0 < pipeline <= cfg.layers:
        raise ConfigError(f"pipeline={pipeline!r} must be a positive integer at most layers={cfg.layers}")


def _schedule_figures(cfg: ModelConfig, pipeline: int, schedule: str, virtual_stages: int,
                      microbatches: int) -> tuple[str, int, float, float]:
    """(schedule, layers' worth of activations the first stage holds, bubble, the paper's bubble) from the
    schedule's own tables; without a pipeline L layers and no bubble."""
    if not (pipeline > 1 or virtual_stages > 1 or schedule != "1f1b"):
        return schedule, cfg.layers, 0.0, 0.0
    sched = Schedule.make(schedule, pipeline, microbatches, virtual_stages, cfg.layers)
    return sched.name, sched.in_flight_layers(cfg.layers), sched.bubble, sched.paper_bubble


def _deferred_layers(cfg: ModelConfig, pipeline: int, schedule: str, virtual_stages: int, microbatches: int) -> int:
    """Layers' worth of W stash every stage allocates under zb-h1 (its slots × L/(p·v) layers); 0 otherwise."""
    if pipeline == 1 or schedule != "zb-h1":
        return 0
    sched = Schedule.make(schedule, pipeline, microbatches, virtual_stages, cfg.layers)
    return sched.depths["w"] * (cfg.layers // (pipeline * virtual_stages))


def _check_devices(devices, tensor: int, pipeline: int) -> None:
    if len(devices) < tensor:
        raise ConfigError(f"tensor={tensor} needs {tensor} devices; {len(devices)} available")
    if pipeline > 1 and len(devices) < pipeline * tensor:
        raise ConfigError(f"pipeline={pipeline} × tensor={tensor}: compiling the pipelined step needs "
                          f"{pipeline * tensor} simulated devices; {len(devices)} available")


def make_row(cfg: ModelConfig, c: RowSpec, m: Measured, micro_batch: int, in_flight_layers: int,
             baseline_flops: float, state: State, context: int = 1, strategy: str = "all-gather",
             fsdp_gathered: int = 0, deferred_layers: int = 0) -> Row:
    """Row c as the table prints it: its compiled layer beside the paper's formula and the no-recompute
    baseline, and its bytes per device with `in_flight_layers` layers' worth of activations; under FSDP the
    working memory holds the gathered weights too (`fsdp_gathered`); under zb-h1 the activations hold
    `deferred_layers` layers' W stash too."""
    b = micro_batch
    formula = formula_bytes_per_layer(cfg, c, b, context, strategy)
    deferred = deferred_layers * formulas.deferred_stash_bytes(cfg, b, c.tensor, c.sequence_parallel, context)
    activations = deferred + activation_bytes(
        m.stored_bytes_per_layer, in_flight_layers,
        non_layer_activation_bytes(cfg, b, c.tensor, c.sequence_parallel, context))
    return Row(
        config=c.name, remat=c.remat, sequence_parallel=c.sequence_parallel, tensor=c.tensor,
        measured_bytes_per_layer=m.stored_bytes_per_layer, formula_bytes_per_layer=formula,
        ratio=m.stored_bytes_per_layer / formula if formula else None,
        flops_per_layer=m.flops_per_layer, recompute_overhead_pct=100 * (m.flops_per_layer / baseline_flops - 1),
        collective_bytes_per_layer=sum(m.collective_bytes_per_layer.values()),
        collectives=m.collective_bytes_per_layer,
        activation_bytes_per_device=activations, working_bytes_per_device=m.working_bytes + fsdp_gathered,
        fsdp_gathered_bytes_per_device=fsdp_gathered, deferred_stash_bytes_per_device=deferred,
        **_state_columns(state, activations, m.working_bytes + fsdp_gathered))


def _state_columns(state: State, activations: int, working: int) -> dict:
    """A row's state bytes, and its total: the step's peak (`memory.peak_bytes`)."""
    return dict(params_bytes_per_device=state.params, gradient_bytes_per_device=state.gradients,
                optimizer_bytes_per_device=state.optimizer, weight_copy_bytes_per_device=state.weight_copy,
                total_bytes_per_device=peak_bytes(state.at_peak, activations, working, after_loop=state.after_loop))


def with_optimizer(p: Plan, data: int, distributed_optimizer: bool) -> Plan:
    """The same plan with every row's state bytes (and totals) for data size `data`, with or without
    the distributed optimizer (split over data × the plan's context size, as `plan` counts it); activations
    are unchanged, nothing is recompiled."""
    if not isinstance(data, int) or data <= 0:
        raise ConfigError(f"data={data!r} must be a positive integer")
    p = dataclasses.replace(p, data=data, distributed_optimizer=distributed_optimizer)
    rows = [dataclasses.replace(r, **_state_columns(p.state(r.tensor), r.activation_bytes_per_device,
                                                    r.working_bytes_per_device))
            for r in p.rows]
    return dataclasses.replace(p, rows=rows)
