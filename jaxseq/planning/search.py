"""`python -m jaxseq.plan --search`: choose the 3D configuration for a cluster before renting it.

Enumerates every valid (t, p, v, c, d, micro-batch b, remat policy, SP, distributed optimizer, and at c > 1
the context strategy) for G GPUs and a global batch B, predicts each one's memory per device (the first pipeline stage) and time per
step, drops those over the memory budget, and ranks the rest by predicted time.

FSDP (`--fsdp-sizes`, default 1): a mesh's G/(t·p·c) data-parallel ranks split d × f, f FSDP ranks (f dividing
the hidden size); the batch's rows over d·f, m = B/(d·f·b); the state of every weight split over f (with the
distributed optimizer further over d·c), one layer's gathered weights and float32 gradient in the working memory,
and per micro-batch each layer's weights gathered twice and gradients reduce-scattered once over f (`fsdp_bytes`).

Validity: t divides the GPUs of a node (tensor parallelism stays on NVLink) and the heads, and divides the
K/V heads or is a multiple of them (grouped-query attention: split, or each repeated t/kv_heads times);
t·p·c·d = G with c from `--context-sizes` (context parallelism: c divides the sequence into 2c chunks; either
strategy, under a pipeline too);
p·v divides the layers; d·b divides B, m = B/(d·b) micro-batches per step; with p > 1, m ≥ p, and the
interleaved schedule (v > 1) needs m % p == 0 (`config.validate_pipeline`). SP needs t > 1, the
distributed optimizer d > 1. v > 1 means Megatron's interleaved 1F1B, v = 1 plain 1F1B (GPipe holds
m micro-batches for the same bubble, so it never wins and is not enumerated).

Memory per device: jaxseq's compiled train step's own accounting (held to `memory_analysis()` of the
compiled step, pipelined or not, in tests/test_search.py), of the first stage (the most activations; every
stage of the SPMD program allocates the same buffers):
  state of L/p layers + embedding at the peak, in the backward layer loop (fp32 master weights, Adam moments, the
  compute copy and its gradients in the compute dtype — fp32 under FSDP and a pipeline, its accumulators —:
  `memory.State.at_peak`; with the distributed optimizer master weights and moments split d ways;
  with a pipeline the embedding group's (embedding, final norm, an untied head) split p ways too, its compute copy
  gathered whole, in float32 as well: `memory.state_bytes(pipe=p)`), from shapes
  + stored bytes per layer (compiled) × layers' worth in flight (the schedule's own count:
    `Schedule.in_flight_layers`, its stash of chunks of k = L/(p·v) layers; L layers without a pipeline)
  + the embedding/logits activations (shapes) + the step's working memory (compiled step: float32 on XLA:CPU)
  + with gradient accumulation and no pipeline (m > 1, p = 1): the fp32 accumulator of jaxseq's step (each
    data rank sums its own gradients before the step's one reduction, so it is whole even with the
    distributed optimizer, as Megatron's gradient buffer).
  or, where that is more, the state after the backward layer loop (`memory.State.after_loop`: the float32
    gradients made, beside their shards where the distributed optimizer reduce-scatters them).
  + with a pipeline, the executor's own buffers (`ExecutorBuffers`, one term per buffer of
    `parallel.pipeline`): receive buffers, the switch's stash-slot output and a backward's copy of the slot
    it reads, a backward's copy of its chunk's weights (interleaved), the float32 embedding gradients a
    branch returns, the chunk gradient a backward tick makes, and the regrouped weights.
  A Megatron-LM stage keeps neither the copies nor the branch's gradients nor the extra slot (1.09–1.43× less at
  the tests' tiny shapes, ~9% less at 175B's), so the papers' configurations can be over budget here.

Time per step (a stated model; the slowest stage is the last, which also runs the logits):
  per micro-batch on a stage: compute = L/p × (each GEMM of a layer — forward, backward, the policy's
      replays — at the efficiency of its shape, + the layer's elementwise kernels at HBM bandwidth) + the
      same for the embedding, logits and loss (`planning.kernel_time`: tile and wave quantization on the
      GPU's SMs, a roofline for the memory-bound ones; the attention on the kernel `train` gives the candidate:
      `run_kernels`); + TP/SP collectives = L/p · ring traffic of the
      layer's collectives (compiled HLO) / (link_efficiency · intra-node bandwidth); + pipeline p2p = 2·v
      sends of s·b·h/t activations (Megatron's scatter/gather over the t ranks) / (link_efficiency · p2p
      bandwidth); + at c > 1 the K/V all-gathers or ring sends of each layer (`formulas.context_kv_bytes`) /
      (link_efficiency · the context group's bandwidth).
  pipeline = m · per micro-batch · (1 + bubble), bubble = idle/busy ticks of the schedule
      ((p − 1)/m, interleaved (p − 1)/(v·m)); ZB-H1 (`--schedules 1f1b,zb-h1`): (p − 1)(F + B − W)/(m(F + B + W))
      at the layer's split kernel times (`kernel_time.split_layer_seconds`), its W stash in the memory, and under
      SP the two all-gathers per layer its W adds (`zero_bubble_gather_bytes`).
  data-parallel gradient reduction after the flush: fp32 gradients of the stage's parameters, ring
      all-reduce 2(d − 1)/d · 4N bytes, or with the distributed optimizer a reduce-scatter (d − 1)/d · 4N
      plus the all-gather of the compute copy (d − 1)/d · 2N, / (link_efficiency · d's bandwidth); under FSDP
      N is the device's fsdp shards.
  Nothing overlaps (as in Megatron-LM 2021–22): TP collectives sit between the matmuls that need them,
  p2p blocks the 1F1B step, the gradient reduction follows the pipeline flush.
  Links: a group inside one node uses the intra-node bandwidth, otherwise the inter-node one (ranks
  ordered tensor fastest, then data, then pipe, as Megatron-LM).
  optimizer step after the reduction: AdamW and the global-norm clip read and write 32 bytes per fp32 master
      element the device updates, and the next compute copy 4 + e bytes per parameter, at the elementwise
      kernels' fraction of HBM bandwidth (`optimizer_seconds`).
  Ignored: the tied-embedding gradient reduction between the first and last stage, kernel launch and host
  overheads.
  Constants: the compute efficiency (calibrated on one published row), the memory and link efficiencies
  (stated).

Per-layer programs are compiled once per (t, SP, remat) and shape (at c > 1 per (t, SP, remat, c, strategy), on
a c × t mesh where the simulated devices hold it, else the c = 1 layer scaled: `at_context`), at micro-batch 1 (and the float32
step also at 2): stored bytes and activation collectives are proportional to b, the working memory
affine in b (tests/test_search.py holds both to programs compiled at larger b). The measuring
itself lives in `planning.search_costs` (`SearchCosts`); this module is arithmetic on what it returns,
the memory added up as the plan's (`planning.memory`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Protocol

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig, on_platform, replace
from jaxseq.hardware import Hardware
from jaxseq.models import formulas as F
from jaxseq.models import model as M
from jaxseq.models.formulas import paper_hardware_flops, train_flops
from jaxseq.parallel.schedule import Schedule
from jaxseq.planning import kernel_time as K
from jaxseq.planning.memory import activation_bytes, non_layer_activation_bytes, peak_bytes
from jaxseq.planning import search_space as space
from jaxseq.planning.search_space import (GIB, Candidate, FamilyReason, Request, TimeModel, enumerate_candidates,
                                          families, family_reason)
from jaxseq.remat import block_spec

# ---------------------------------------------------------------------------------------------
# What the compiled programs say (supplied by planning.search_costs.SearchCosts, or by hand in tests)


@dataclass(frozen=True)
class LayerCost:
    """Per device, one micro-batch of b sequences, for one (t, SP, remat)."""

    stored_bytes: float  # per layer, kept for backward
    collective_bytes: dict  # kind → bytes of the buffers per layer (forward + backward), activation dtype
    working_bytes: float  # the step's transients beyond state and stored activations
    non_layer_activation_bytes: float  # embedding/logits activations
    context: int = 1  # the context size it was compiled at (1 at a candidate's c > 1: `at_context` scales it)
    # what the memory-bound kernels of its GPU program's layer loops move (`measure.Compiler.moved_bytes`), None where
    # XLA:CPU compiled it: the time model then counts Megatron's kernels (`kernel_time.layer_elementwise_bytes`)
    moved_bytes: float | None = None


@dataclass(frozen=True)
class StateCost:
    """Per device, for one stage's layers (+ embedding)."""

    total_bytes: float  # at the step's peak: master weights, moments, compute copy and its gradients (State.at_peak)
    parameters: int  # parameter elements on the device
    master_bytes: float  # fp32 master weights (split d ways with the distributed optimizer)
    layer_parameters: int  # those of the stage's layers (the rest: the embedding group)
    weight_copy_bytes: float  # the compute copy a step makes (float32 without the distributed optimizer: of the
    #                           embedding group only, gathered from its `pipe` split under a pipeline, else none)
    layer_copy_bytes: float  # of that, the stage's layers' (none: float32 without the distributed optimizer)
    gradient_bytes: float | None = None  # fp32 gradients on the device (None: 4 bytes a parameter; under FSDP shards)
    fsdp_gathered_bytes: float = 0.0  # FSDP: the gathered weights alive at once (`memory.fsdp_gathered_bytes`)
    after_loop_bytes: float = 0.0  # after the backward layer loop: the float32 gradients made (State.after_loop)

    @property
    def gradients(self) -> float:
        return 4.0 * self.parameters if self.gradient_bytes is None else self.gradient_bytes


class Costs(Protocol):
    # keys: (t, SP, remat, c, context strategy) each; compile all at once
    def prepare(self, keys: list[tuple[int, bool, str, int, str]], micro_batches: tuple[int, ...]) -> None: ...
    def layer(self, tensor: int, sequence_parallel: bool, remat: str, micro_batch: int, context: int = 1,
              strategy: str = "all-gather") -> LayerCost: ...
    def state(self, stage: ModelConfig, tensor: int, data: int, distributed_optimizer: bool, pipe: int,
              fsdp: int = 1) -> StateCost: ...


# ---------------------------------------------------------------------------------------------
# Memory and time of one candidate


def pipeline_schedule(c: Candidate) -> Schedule | None:
    """The schedule the executor runs for candidate c; None without a pipeline."""
    return _schedule(c.schedule, c.pipe, c.microbatches, c.virtual) if c.pipe > 1 else None


@lru_cache(maxsize=None)
def _schedule(name: str, pipe: int, microbatches: int, virtual: int) -> Schedule:
    """One Schedule per (schedule, p, m, v), whatever else the candidates sharing it differ in: its tick table,
    timeline and slot depths (cached on it) are then computed once, not once per candidate."""
    return Schedule.make(name, pipe, microbatches, virtual)


def schedule_figures(c: Candidate, layers: int) -> tuple[int, float]:
    """(layers' worth of activations stage 0 holds at once, bubble = idle/busy ticks) from the schedule's
    own tables; without a pipeline all layers and no bubble."""
    sched = pipeline_schedule(c)
    return (layers, 0.0) if sched is None else (sched.in_flight_layers(layers), sched.bubble)


def chunk_layers(cfg: ModelConfig, c: Candidate) -> int:
    """Layers in each of candidate c's pipeline chunks, L/(p·v) (the stack without a pipeline)."""
    return cfg.layers // (c.pipe * c.virtual)


def deferred_stash_bytes(cfg: ModelConfig, c: Candidate) -> float:
    """ZB-H1's W stash on every stage: its slots × L/(p·v) layers × `formulas.deferred_stash_bytes`; 0 otherwise."""
    if not c.zero_bubble:
        return 0.0
    slots = pipeline_schedule(c).depths["w"]
    return (slots * chunk_layers(cfg, c)
            * F.deferred_stash_bytes(cfg, c.micro_batch, c.tensor, c.sequence_parallel, c.context))


def zero_bubble_gather_bytes(cfg: ModelConfig, c: Candidate) -> float:
    """The TP traffic ZB-H1 adds per layer and micro-batch: under SP its W stash keeps the row-parallel matmuls'
    output gradients sequence-split, so W all-gathers them again ([b, s, h] each, two per layer; the compiled
    step's W branch holds four all-gathers per layer where 1F1B's backward has two fewer); a context rank's s/c
    tokens."""
    if not (c.zero_bubble and c.sequence_parallel and c.tensor > 1):
        return 0.0
    tokens = c.micro_batch * cfg.seq_len // c.context
    return 2 * ring_traffic("all-gather", tokens * cfg.hidden * cfg.itemsize, c.tensor)


def zero_bubble_bubble(cfg: ModelConfig, c: Candidate, hw: Hardware, tm: TimeModel) -> float:
    """ZB-H1's bubble in time, Qi et al.'s (p − 1)(T_F + T_B − T_W) over m(T_F + T_B + T_W), at a layer's split
    kernel times (`kernel_time.split_layer_seconds`): the same asynchronous model as 1F1B's (p − 1)/m; with v
    chunks per stage each op is a chunk's, 1/v of a stage's layers, and the bubble 1/v of it, as interleaving's."""
    f, b, w = K.split_layer_seconds(cfg, c.micro_batch, c.tensor, c.sequence_parallel, c.remat, hw,
                                    tm.compute_efficiency, tm.memory_efficiency, ring_size(c))
    return (c.pipe - 1) * (f + b - w) / (c.virtual * c.microbatches * (f + b + w))


@dataclass(frozen=True)
class ExecutorBuffers:
    """Per device, what jaxseq's pipeline executor (`parallel.pipeline`) keeps beyond a Megatron stage, each
    term one buffer of its compiled step; all are alive at its peak, the first chunk's backward tick (as XLA's
    buffer assignment of the compiled step shows; tests/test_search.py holds the total to `memory_analysis()`).
    Its stash is the activations' term, its float32 accumulators (`Buffers.grads`) the state's gradients, its
    compute copy (the embedding group's gathered from its `pipe` split, f32 included) the state's weight copy.
    A backward runs its chunk's k layers as a scan, whose inputs XLA copies out of the buffers they are sliced
    from at the tick's dynamic slot and chunk; with k = 1 XLA drops the one-iteration loop and the layer reads
    them in place (no copies)."""

    receive_bytes: float  # Buffers.x, Buffers.g: (depth + 1 trash slot) activations [b, s, h] each, /t under SP
    tick_slot_bytes: float  # BranchOut.slot, the switch's stash-slot output (zeros from a backward), + with k > 1 a
    #                         backward's copy of the slot it reads: 1 or 2 chunks' residuals
    chunk_weight_bytes: float  # with v > 1 and k > 1, a backward's copy of its chunk's weights out of the [v, k, …]
    #                            stage weights (compute dtype); with v = 1 the chunk is the whole block (no copy)
    others_gradient_bytes: float  # BranchOut.d_others: the f32 embedding/final norm gradients a branch returns (the
    #                               first chunk's backward's; zeros from the others, made in the branch)
    chunk_gradient_bytes: float  # BranchOut.dw: the f32 weight gradients of the chunk a backward tick runs
    stage_copy_bytes: float  # the layers regrouped [v, k, …] (`to_stages`) where the state has no compute copy
    #                          of them to regroup: float32, v > 1, no distributed optimizer
    w_slot_bytes: float = 0.0  # ZB-H1: BranchOut.w_slot, the switch's W stash slot output (a B's; zeros from the rest)

    @property
    def total_bytes(self) -> float:
        return (self.receive_bytes + self.tick_slot_bytes + self.chunk_weight_bytes + self.others_gradient_bytes
                + self.chunk_gradient_bytes + self.stage_copy_bytes + self.w_slot_bytes)


NO_EXECUTOR = ExecutorBuffers(receive_bytes=0.0, tick_slot_bytes=0.0, chunk_weight_bytes=0.0,
                              others_gradient_bytes=0.0, chunk_gradient_bytes=0.0, stage_copy_bytes=0.0)


def executor_buffers(cfg: ModelConfig, c: Candidate, layer: LayerCost, state: StateCost) -> ExecutorBuffers:
    """The executor's own buffers for candidate c (a pipeline), from shapes and the schedule's depths."""
    depth = pipeline_schedule(c).depths
    k = chunk_layers(cfg, c)
    activation = (c.micro_batch * cfg.seq_len * cfg.hidden * cfg.itemsize / (c.tensor if c.sequence_parallel else 1)
                  / c.context)  # one context rank's tokens
    chunk_parameters = state.layer_parameters / c.virtual
    regroup = c.virtual > 1 and state.layer_copy_bytes == 0
    return ExecutorBuffers(receive_bytes=(depth["x"] + 1 + depth["g"] + 1) * activation,
                           tick_slot_bytes=(2 if k > 1 else 1) * k * layer.stored_bytes,
                           chunk_weight_bytes=cfg.itemsize * chunk_parameters if c.virtual > 1 and k > 1 else 0.0,
                           others_gradient_bytes=4 * (state.parameters - state.layer_parameters),
                           chunk_gradient_bytes=4 * chunk_parameters,
                           stage_copy_bytes=cfg.itemsize * state.layer_parameters if regroup else 0.0,
                           w_slot_bytes=deferred_stash_bytes(cfg, c) / depth["w"] if c.zero_bubble else 0.0)


MEMORY_ACCOUNTING = ("jaxseq's compiled train step, per device (the first pipeline stage); with a pipeline, "
                     "jaxseq's executor's buffers too (receive buffers, tick slots, a chunk's weights, float32 "
                     "embedding and chunk gradients, regrouped weights), more than the Megatron-LM stage the papers "
                     "count")


@dataclass(frozen=True)
class Memory:
    """Per device, jaxseq's compiled train step (the first pipeline stage's; every stage of its SPMD program
    allocates the same buffers)."""

    state_bytes: float  # master weights, moments, the compute copy and its gradients (a pipeline's: its accumulators)
    activation_bytes: float  # stored per layer × layers in flight (the stash) + the embedding/logits part
    working_bytes: float
    accumulator_bytes: float  # the fp32 accumulator of gradient accumulation without a pipeline
    in_flight_layers: float
    executor: ExecutorBuffers  # the pipeline executor's own buffers (none without a pipeline)
    fsdp_gathered_bytes: float = 0.0  # FSDP: one layer's (or embedding table's) gathered weights and gradient
    deferred_stash_bytes: float = 0.0  # ZB-H1: of the activations, the W stash (`deferred_stash_bytes`)
    after_loop_bytes: float = 0.0  # the state after the backward layer loop (`StateCost.after_loop_bytes`)
    held_copy_bytes: float = 0.0  # accumulating: the tables' compute copy beside their gradients (`accumulation_held_copy_bytes`)

    @property
    def total_bytes(self) -> float:
        return peak_bytes(self.state_bytes, self.activation_bytes, self.working_bytes + self.fsdp_gathered_bytes,
                          self.accumulator_bytes + self.held_copy_bytes, self.after_loop_bytes) + self.executor.total_bytes


def at_context(cfg: ModelConfig, c: Candidate, layer: LayerCost) -> LayerCost:
    """The layer's costs at context c: the layer compiled at c as it is (`LayerCost.context`: where the simulated
    devices hold c·t); else from the measured context-1 layer (a stated model, nothing compiled at c):
    stored bytes / c, exact for all-gather (tests/test_plan.py holds the compiled layer to the formula), plus the
    ring's own change (`formulas.activation_bytes` at c − at 1 / c: no scores, its log-sum-exp);
    TP collectives / c (per token); working memory / c (per token) + the K/V transient at backward's peak
    (`formulas.context_kv_bytes`: not divided by c); the embedding/logits activations of s/c tokens; the bytes its
    kernels move / c (per token: the weights' share, not divided in truth, is a few percent of a long sequence's)."""
    if layer.context == c.context:
        return layer
    if layer.context != 1:
        raise ValueError(f"a layer compiled at context {layer.context} for a candidate at context {c.context}")
    b, t, sp = c.micro_batch, c.tensor, c.sequence_parallel
    ring = (F.activation_bytes(cfg, c.remat, b, t, sp, c.context, c.context_strategy)
            - F.activation_bytes(cfg, c.remat, b, t, sp) / c.context) if c.context_strategy == "ring" else 0.0
    kv = F.context_kv_bytes(cfg, b, t, c.context, c.context_strategy)
    return LayerCost(layer.stored_bytes / c.context + ring,
                     {k: v / c.context for k, v in layer.collective_bytes.items()},
                     layer.working_bytes / c.context + kv["transient_backward"],
                     non_layer_activation_bytes(cfg, b, t, sp, c.context), 1,
                     None if layer.moved_bytes is None else layer.moved_bytes / c.context)


def memory(cfg: ModelConfig, c: Candidate, layer: LayerCost, state: StateCost) -> Memory:
    cfg = run_kernels(cfg, c)
    layer = at_context(cfg, c, layer)
    in_flight_layers, _ = schedule_figures(c, cfg.layers)
    activations = activation_bytes(layer.stored_bytes, in_flight_layers, layer.non_layer_activation_bytes)
    w_stash = deferred_stash_bytes(cfg, c)  # ZB-H1's
    activations += w_stash
    # each data rank's own float32 sum over the micro-batches, reduced once after them: never split over data (under
    # FSDP each micro-batch's gradients are reduce-scattered over fsdp at once: the sum is of the shards)
    accumulating = c.pipe == 1 and c.microbatches > 1
    accumulator = state.gradients if accumulating else 0.0
    held_copy = accumulation_held_copy_bytes(cfg, c, state) if accumulating else 0.0
    executor = executor_buffers(cfg, c, layer, state) if c.pipe > 1 else NO_EXECUTOR
    return Memory(state.total_bytes, activations, layer.working_bytes, accumulator, in_flight_layers, executor,
                  state.fsdp_gathered_bytes, w_stash, state.after_loop_bytes, held_copy)


def accumulation_held_copy_bytes(cfg: ModelConfig, c: Candidate, state: StateCost) -> float:
    """What a step over m > 1 micro-batches holds that the one-micro-batch layer program's working memory gives back:
    the compute copy of the weights outside the layers (the embedding and LM head tables). In one micro-batch's step
    XLA frees that copy at its last use and makes the tables' gradients in its place; accumulating, the copy is made
    once before the micro-batch loop and lives beside every micro-batch's gradients (read from the H100 programs'
    buffer assignments: gpt3-1.3b's bf16 table, 196 MiB, beside its gradient at 2, 4 and 8 layers;
    experiments/search_memory.py). Where the step peaks at the head instead (one rank's logits of a large vocabulary
    over a long sequence: Llama 3 8B at t = 1, s = 8192), the copy was live there already and this counts it twice
    (the parts then 4.8% above the compiled step). How much of it a step holds is XLA's choice: jax 0.12's XLA:GPU
    holds about half (docs/planning.md). The cast copy only: a float32 step computes on its masters (on
    their gathered copy under the distributed optimizer, which XLA:CPU's programs free as before). Under FSDP the
    tables are gathered at each use: none."""
    if c.fsdp > 1 or cfg.dtype == "float32":
        return 0.0
    return state.weight_copy_bytes - state.layer_copy_bytes


def ring_traffic(kind: str, nbytes: float, group: int) -> float:
    """Bytes each device sends in a ring collective over `group` devices on a buffer of `nbytes`: all-reduce
    2N(t-1)/t, the others N(t-1)/t (tests/test_collectives.py applies it to the compiled layer's collectives)."""
    if group <= 1:
        return 0.0
    return (2 if kind == "all-reduce" else 1) * nbytes * (group - 1) / group


@dataclass(frozen=True)
class Time:
    """Seconds per step, and the parts (compute, tp, p2p include their share of the bubble)."""

    compute_s: float
    tp_s: float
    p2p_s: float
    bubble_s: float  # of compute + tp + p2p: the idle ticks
    dp_s: float
    bubble: float
    context_s: float = 0.0  # K/V traffic of context parallelism (its bubble share is in bubble_s)
    optimizer_s: float = 0.0  # the AdamW update after the gradient reduction (`optimizer_seconds`)
    fsdp_s: float = 0.0  # FSDP's weight gathers and gradient reduce-scatters (`fsdp_bytes`; bubble share in bubble_s)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_s + self.p2p_s + self.bubble_s + self.dp_s + self.context_s + self.optimizer_s
                + self.fsdp_s)


def links(c: Candidate, hw: Hardware) -> dict[str, float]:
    """Bandwidth (GB/s) each group's collectives see: inside a node if the group's ranks fit in one
    (tensor fastest, then context, fsdp, data, pipe: the mesh's order); "data" is data × context, the gradients'.
    An fsdp group that spans nodes with g of its ranks in each node sees g InfiniBand links (NCCL runs a channel
    over each NIC), up to NVLink's bandwidth: MaxText's FSDP=64 step on 8 nodes of 8 H100s moves its weights
    within the measured step only so (experiments/results/fsdp.md); the other groups keep one link per GPU."""
    intra, inter = hw.intra_node_gb_per_s, hw.inter_node_gb_per_s
    n, tc = hw.gpus_per_node, c.tensor * c.context
    per_node = max(1, min(c.fsdp, n // tc))  # the fsdp group's ranks in one node
    return {"tensor": intra if c.tensor <= n else inter,
            "context": intra if tc <= n else inter,
            "fsdp": intra if tc * c.fsdp <= n else min(intra, per_node * inter),
            "data": intra if tc * c.fsdp * c.data <= n else inter,
            "pipe": intra if tc * c.fsdp * c.data * c.pipe <= n else inter}


def layer_attention(cfg: ModelConfig, context: int, strategy: str) -> str:
    """The attention a layer at context c runs: the ring computes its blocks itself whatever `--attention` says
    (parallel/context.py), explicit attention's layer; any other layer the model's."""
    return "explicit" if context > 1 and strategy == "ring" else cfg.attention


def ring_size(c: Candidate) -> int:
    """The ring's c where the candidate runs one (its attention core the ring's blocks: `kernel_time.ring_gemms`),
    else 1."""
    return c.context if c.context > 1 and c.context_strategy == "ring" else 1


def run_kernels(cfg: ModelConfig, c: Candidate) -> ModelConfig:
    """`cfg` with the attention a GPU runs candidate c with, chosen as `train` chooses it (`config.on_platform` for
    c's context layout): cuDNN's flash kernel in bf16 where it compiles, XLA's elsewhere (the all-gather context
    strategy at c > 1, float32), whose scores go through HBM (`kernel_time.flash`); the ring's own blocks
    (`layer_attention`)."""
    cfg = replace(cfg, attention=layer_attention(cfg, c.context, c.context_strategy))
    return on_platform(cfg, "gpu", ParallelConfig(context=c.context, context_strategy=c.context_strategy))


def compute_seconds(cfg: ModelConfig, c: Candidate, hw: Hardware, tm: TimeModel, layer: LayerCost,
                    layer_parameters: float) -> float:
    """One micro-batch through the last stage (its L/p layers, the logits and the loss): each GEMM at its
    shape's efficiency, fused attention at its kernel's, and the memory-bound kernels at HBM bandwidth
    (`planning.kernel_time`); at context c a rank does 1/c of it (s/c tokens; the causal attention balanced by the
    2c-chunk order; a ring's attention core its blocks, `kernel_time.ring_gemms`; the GEMMs' smaller shapes' efficiency
    not modelled). The memory-bound bytes: where the layer
    was compiled for a GPU, what its program's layer loops move (`LayerCost.moved_bytes`, at c already: XLA:GPU's
    fusions, the scan's slices and updates among them) + the zero fill of its stored activations' stacks; less
    the stacks' traffic for unrolled layers (`TimeModel.scan_stacks` False). Else Megatron's kernels, counted
    (`kernel_time.layer_elementwise_bytes`), + with `scan_stacks` each layer's stored activations
    (`layer.stored_bytes`) and its parameters on the device (`layer_parameters`) through the scan's stacked
    buffers (`kernel_time.scan_stack_bytes`)."""
    efficiencies = (hw, tm.compute_efficiency, tm.memory_efficiency)
    b, t, sp, layers, ring = c.micro_batch, c.tensor, c.sequence_parallel, cfg.layers // c.pipe, ring_size(c)
    head = K.head_seconds(cfg, b, t, sp, *efficiencies)
    stacks = K.scan_stack_bytes(layer.stored_bytes, layer_parameters, cfg.itemsize)
    if layer.moved_bytes is None:
        return ((layers * K.layer_seconds(cfg, b, t, sp, c.remat, *efficiencies, ring) + head) / c.context
                + layers * (stacks if tm.scan_stacks else 0.0) / (tm.memory_efficiency * hw.hbm_gb_per_s * 1e9))
    fill = K.STACK_FILL_PASSES * layer.stored_bytes  # before the loops; the rest of the stacks' traffic is in them
    moved = layer.moved_bytes + (fill if tm.scan_stacks else fill - stacks)
    return ((layers * K.layer_matmul_seconds(cfg, b, t, c.remat, *efficiencies, ring) + head) / c.context
            + layers * moved / (tm.memory_efficiency * hw.hbm_gb_per_s * 1e9))


def program_compute_seconds(cfg: ModelConfig, c: Candidate, hw: Hardware, tm: TimeModel, moved_bytes: float) -> float:
    """A step's compute and optimizer update priced on its program compiled for the GPU, where there is no pipeline
    (p = 1): the m micro-batches' GEMMs and fused attention as `compute_seconds` prices them, + `moved_bytes`, what
    the program's other kernels read and write (`hlo.memory_bound_bytes`: elementwise, reductions, copies, the
    scan's stacks, the optimizer), at the elementwise kernels' fraction of HBM bandwidth."""
    if c.pipe != 1:
        raise ValueError(f"a pipeline's program (p = {c.pipe}) is not priced by its kernels: its ticks are the model's")
    cfg = run_kernels(cfg, c)
    efficiencies = (hw, tm.compute_efficiency, tm.memory_efficiency)
    b, t = c.micro_batch, c.tensor
    matmuls = (cfg.layers * K.layer_matmul_seconds(cfg, b, t, c.remat, *efficiencies, ring_size(c))
               + sum(K.gemm_seconds(g, hw, cfg.itemsize, *efficiencies[1:]) for g in K.head_gemms(cfg, b, t)))
    return c.microbatches * matmuls / c.context + moved_bytes / (tm.memory_efficiency * hw.hbm_gb_per_s * 1e9)


def program_step_time(cfg: ModelConfig, c: Candidate, layer: LayerCost, state: StateCost, hw: Hardware, tm: TimeModel,
                      moved_bytes: float) -> Time:
    """`step_time` with its compute and optimizer update priced on the step's GPU program (`program_compute_seconds`);
    its collectives as `step_time` prices them."""
    t = step_time(cfg, c, layer, state, hw, tm)
    return replace(t, compute_s=program_compute_seconds(cfg, c, hw, tm, moved_bytes), optimizer_s=0.0)


# HBM bytes of the optimizer step per fp32 master element a device updates: AdamW reads the weight, its gradient and
# both moments (16) and writes weight and moments (12); the global-norm clip reads the gradient once more (4).
UPDATE_BYTES_PER_ELEMENT = 32


def optimizer_seconds(state: StateCost, itemsize: int, hw: Hardware, tm: TimeModel, fsdp: int = 1) -> float:
    """The optimizer step, memory-bound: `UPDATE_BYTES_PER_ELEMENT` per master element the device updates (1/d of them
    with the distributed optimizer) and, per parameter it computes with, the next compute copy (read the fp32
    weight, write `itemsize`), at the elementwise kernels' fraction of HBM bandwidth. With one GPU and one
    micro-batch of gpt3-1.3b on an H100 it is about a tenth of the step. Under FSDP (fsdp > 1) there is no copy:
    each layer casts its shard as it gathers it."""
    moved = UPDATE_BYTES_PER_ELEMENT * state.master_bytes / 4 + (4 + itemsize) * state.parameters * (fsdp == 1)
    return moved / (tm.memory_efficiency * hw.hbm_gb_per_s * 1e9)


def fsdp_bytes(cfg: ModelConfig, c: Candidate, state: StateCost) -> float:
    """Bytes a device sends per micro-batch for FSDP (ring collectives over the f ranks): each of the stage's layers
    gathers its weights in the compute dtype in forward and again in backward and reduce-scatters their float32
    gradient; the embedding group is gathered and its gradient reduce-scattered once (its uses: the lookup, the
    logits)."""
    if c.fsdp == 1:
        return 0.0
    e, layers = cfg.itemsize, cfg.layers // c.pipe
    per_layer = state.layer_parameters / layers
    embedding = state.parameters - state.layer_parameters
    gathers = ring_traffic("all-gather", e * (2 * layers * per_layer + embedding), c.fsdp)
    return gathers + ring_traffic("reduce-scatter", 4.0 * (layers * per_layer + embedding), c.fsdp)


def step_time(cfg: ModelConfig, c: Candidate, layer: LayerCost, state: StateCost, hw: Hardware,
              tm: TimeModel) -> Time:
    cfg = run_kernels(cfg, c)
    layers = cfg.layers // c.pipe
    layer = at_context(cfg, c, layer)
    bw = {k: v * 1e9 * tm.link_efficiency for k, v in links(c, hw).items()}
    compute = compute_seconds(cfg, c, hw, tm, layer, state.layer_parameters / layers)
    kv = F.context_kv_bytes(cfg, c.micro_batch, c.tensor, c.context, c.context_strategy)["traffic"]
    context = layers * kv / bw["context"]
    tp = layers * (sum(ring_traffic(k, n, c.tensor) for k, n in layer.collective_bytes.items())
                   + zero_bubble_gather_bytes(cfg, c)) / bw["tensor"]
    itemsize = cfg.itemsize
    message = cfg.seq_len * c.micro_batch * cfg.hidden * itemsize / (c.tensor * c.context)
    p2p = 2 * c.virtual * message / bw["pipe"] if c.pipe > 1 else 0.0
    _, bubble = schedule_figures(c, cfg.layers)
    if c.pipe > 1 and tm.lockstep:
        bubble = pipeline_schedule(c).lockstep_bubble(*K.split_layer_seconds(
            cfg, c.micro_batch, c.tensor, c.sequence_parallel, c.remat, hw, tm.compute_efficiency, tm.memory_efficiency,
            ring_size(c)))
    elif c.zero_bubble:
        bubble = zero_bubble_bubble(cfg, c, hw, tm)
    m = c.microbatches
    fsdp = fsdp_bytes(cfg, c, state) / bw["fsdp"]
    if tm.fsdp_overlap:  # hidden behind the micro-batch's compute where it fits
        fsdp = max(0.0, fsdp - compute)
    grads = state.gradients  # under FSDP the shards: each rank reduces its own over data × context
    reduce = c.data * c.context  # gradients reduce over data × context (context ranks are data ranks to weights)
    if c.distributed_optimizer:  # the compute copy gathered back: under FSDP of the fsdp shards (grads' elements)
        copy = itemsize * (state.parameters if c.fsdp == 1 else grads / 4)
        dp_bytes = ring_traffic("reduce-scatter", grads, reduce) + ring_traffic("all-gather", copy, reduce)
    else:
        dp_bytes = ring_traffic("all-reduce", grads, reduce)
    return Time(m * compute, m * tp, m * p2p, m * (compute + tp + p2p + context + fsdp) * bubble, dp_bytes / bw["data"],
                bubble, m * context, optimizer_seconds(state, itemsize, hw, tm, c.fsdp), m * fsdp)


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    memory: Memory
    time: Time
    model_tflops_per_gpu: float  # model FLOPs per step (no recompute) / step time / GPUs
    mfu: float
    fits: bool
    layer_context: int = 1  # the context size its layer was compiled at (< c: scaled by `at_context`)
    compiled_bytes: int | None = None  # its whole train step's peak per device, compiled for the target (`verify`)
    compiled_step_s: float | None = None  # its step time priced on that program (`program_step_time`; p = 1 only)

    @property
    def layer_source(self) -> str:
        """Whether its layer's memory and TP collectives were compiled at its c or scaled from c = 1."""
        return "compiled" if self.layer_context == self.candidate.context else "scaled"

    def to_json(self) -> dict:
        c, mem, t = self.candidate, self.memory, self.time
        return {**asdict(c), "schedule": c.schedule,
                "memory_gib": {"total": mem.total_bytes / GIB, "state": mem.state_bytes / GIB,
                               "activations": mem.activation_bytes / GIB, "working": mem.working_bytes / GIB,
                               "w_stash": mem.deferred_stash_bytes / GIB,
                               "fsdp_gathered": mem.fsdp_gathered_bytes / GIB,
                               "accumulator": mem.accumulator_bytes / GIB,
                               "accumulation_held_copy": mem.held_copy_bytes / GIB, "in_flight_layers": mem.in_flight_layers,
                               "pipeline_executor": {k: v / GIB for k, v in asdict(mem.executor).items()}},
                "time_s": {"total": t.total_s, "compute": t.compute_s, "tensor_collectives": t.tp_s,
                           "pipeline_p2p": t.p2p_s, "bubble": t.bubble_s, "data_parallel": t.dp_s,
                           "context_kv": t.context_s, "optimizer_update": t.optimizer_s,
                           "fsdp_gather_scatter": t.fsdp_s},
                "bubble": t.bubble, "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu,
                "fits": self.fits, "layer": self.layer_source, "layer_compiled_at_context": self.layer_context,
                "compiled_step_gib": None if self.compiled_bytes is None else self.compiled_bytes / GIB,
                "compiled_step_s": self.compiled_step_s}


def costs_of(cfg: ModelConfig, c: Candidate, costs: Costs) -> tuple[LayerCost, StateCost]:
    """Candidate c's layer (at its micro-batch) and its stage's state."""
    layer = costs.layer(c.tensor, c.sequence_parallel, c.remat, c.micro_batch, c.context, c.context_strategy)
    # the distributed optimizer splits over data × context: d·c ranks to the state's arithmetic
    state = costs.state(replace(cfg, layers=cfg.layers // c.pipe), c.tensor, c.data * c.context, c.distributed_optimizer,
                        c.pipe, c.fsdp)
    return layer, state


def evaluate(cfg: ModelConfig, r: Request, c: Candidate, costs: Costs) -> Evaluated:
    layer, state = costs_of(cfg, c, costs)
    mem = memory(cfg, c, layer, state)
    t = step_time(cfg, c, layer, state, r.hardware, r.time_model)
    tflops = train_flops(cfg, r.global_batch) / t.total_s / r.gpus / 1e12
    return Evaluated(c, mem, t, tflops, tflops / r.hardware.peak_tflops, mem.total_bytes <= r.budget_bytes, layer.context)


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class Result:
    model: str
    config: ModelConfig
    request: Request
    ranked: list[Evaluated]  # those that fit, fastest first
    evaluated: int
    rejected_families: list[dict] = field(default_factory=list)  # {"tensor", "pipe", "data", "rule", "reason"}
    compiled: int = 0  # layers measured: distinct (t, SP, remat, attention, and where compiled at c > 1, c and strategy)
    target: str | None = None  # the GPU the layers were compiled for (`plan --search --target`), else XLA:CPU
    over_budget: list[Evaluated] = field(default_factory=list)  # fit by the parts, not by the compiled step (`verify`)

    def rank_of(self, match) -> int | None:
        """1-based rank of the first fitting configuration `match(candidate)` accepts, or None."""
        return next((i + 1 for i, e in enumerate(self.ranked) if match(e.candidate)), None)


def search(cfg: ModelConfig, r: Request, costs: Costs, model: str = "custom", target: str | None = None) -> Result:
    """Every valid configuration, evaluated; ConfigError (one line) when none fits."""
    space.validate_request(cfg, r)
    candidates = enumerate_candidates(cfg, r)
    reasons = {f: family_reason(cfg, r, *f) for f in families(cfg, r)}
    if not candidates:
        raise ConfigError(f"no valid configuration of {r.gpus} GPUs for {model}: "
                          + "; ".join(sorted({str(why) for why in reasons.values() if why})[:3]))
    keys = sorted({(c.tensor, c.sequence_parallel, c.remat, c.context, c.context_strategy) for c in candidates})
    costs.prepare(keys, r.micro_batches)
    evaluated = [evaluate(cfg, r, c, costs) for c in candidates]
    if r.block_recompute:
        evaluated += least_blocks(cfg, r, evaluated, costs)
    ranked = sorted((e for e in evaluated if e.fits), key=lambda e: (e.time.total_s, e.memory.total_bytes, e.candidate))
    rejected = []
    for f, reason in reasons.items():
        if reason is None:
            fam = [e for e in evaluated if e.candidate.mesh_family == f]
            if any(e.fits for e in fam):
                continue
            least = min(fam, key=lambda e: e.memory.total_bytes)
            reason = FamilyReason("memory", f"over memory: least {least.memory.total_bytes / GIB:.1f} GiB > "
                                            f"{r.hardware.memory_gib:g} GiB ({least.candidate.label()})")
        rejected.append({"tensor": f[0], "pipe": f[1], "data": r.gpus // (f[0] * f[1]), "rule": reason.rule,
                         "reason": reason.text})
    if not ranked:
        least = min(evaluated, key=lambda e: e.memory.total_bytes)
        raise ConfigError(f"no configuration of {model} fits in {r.hardware.memory_gib:g} GiB per GPU on {r.gpus} GPUs: "
                          f"the least memory is {least.memory.total_bytes / GIB:.1f} GiB ({least.candidate.label()})")
    measured = {(e.candidate.tensor, e.candidate.sequence_parallel, e.candidate.remat, e.layer_context,
                 e.candidate.context_strategy if e.layer_context > 1 else "", run_kernels(cfg, e.candidate).attention)
                for e in evaluated if block_spec(e.candidate.remat) is None}
    return Result(model, cfg, r, ranked, len(evaluated), rejected, len(measured), target)


def verify(res: Result, count: int, step_costs, costs: Costs) -> Result:
    """The ranking's first `count` configurations held to their whole train step compiled for the target
    (`step_costs(candidate)`: the GPU program's peak per device, where the ranking added parts up: the state's share
    of the peak + stored × layers + working, within 3.7% of the H100's measured peaks, following XLA's Triton program
    and scanned layers (experiments/results/gpu_target_vs_measured.md); and what its memory-bound kernels
    move, which prices its step time where there is no pipeline: `program_step_time`, within 4% of the H100's
    measured steps). One whose step does not fit the budget leaves the ranking (`over_budget`) and the next is
    verified in its place, until `count` fit or the ranking ends. A new Result: `res` is left as it was."""
    kept, over, verified = [], list(res.over_budget), 0
    r = res.request
    for e in res.ranked:
        if verified < count:
            compiled_bytes, moved = step_costs(e.candidate)
            seconds = None
            if e.candidate.pipe == 1 and moved is not None:
                seconds = sum(w * program_step_time(res.config, c, *costs_of(res.config, c, costs), r.hardware,
                                                    r.time_model, moved).total_s
                              for c, w in policy_weights(res.config, e.candidate))
            e = replace(e, compiled_bytes=compiled_bytes, compiled_step_s=seconds)
            if e.compiled_bytes > res.request.budget_bytes:
                over.append(replace(e, fits=False))
                continue
            verified += 1
        kept.append(e)
    if not kept:
        raise ConfigError(f"no configuration of {res.model} fits in {res.request.hardware.memory_gib:g} GiB per GPU by "
                          f"its train step compiled for the {res.target}: the least is "
                          f"{min(e.compiled_bytes for e in over) / GIB:.1f} GiB")
    return replace(res, ranked=kept, over_budget=over)


# ---------------------------------------------------------------------------------------------
# Block recompute (`Request.block_recompute`): Megatron-LM's --recompute-method block, between a policy and full


def policy_weights(cfg: ModelConfig, c: Candidate) -> list[tuple[Candidate, float]]:
    """Candidate c as its plain policies, each with its share of a chunk's layers: [(c, 1)] for a plain policy;
    for a block spec (`remat.block_spec`) its first policy's n/k and its rest's (k − n)/k."""
    block = block_spec(c.remat)
    if block is None:
        return [(c, 1.0)]
    first, n, rest = block
    k = chunk_layers(cfg, c)
    return [(replace(c, remat=first), n / k), (replace(c, remat=rest), 1 - n / k)]


def block_memory(rest: Memory, full: Memory, rest_stored: float, n: int, k: int) -> Memory:
    """The first n layers of each chunk of k under `full`, the rest under `rest`'s policy, as the plan composes it
    (`plan.block_row`): the activations and the executor's buffers n/k of the way from rest's to full's; the peak
    the larger of the two backward loops': the rest's (every stored activation held, its working memory), or the
    recomputed layers' (a chunk's k − n rest layers freed, `rest_stored` bytes each; full's working memory)."""
    mix = lambda a, b: b + n / k * (a - b)
    executor = ExecutorBuffers(**{f: mix(getattr(full.executor, f), getattr(rest.executor, f))
                                  for f in asdict(rest.executor)})
    activations = mix(full.activation_bytes, rest.activation_bytes)
    return max(replace(rest, activation_bytes=activations, executor=executor),
               replace(full, activation_bytes=activations - (k - n) * rest_stored, executor=executor),
               key=lambda m: m.total_bytes)


def block_time(rest: Time, full: Time, w: float) -> Time:
    """Each part of the step time a fraction w of the way from rest's to full's: exact for the per-layer sums
    (compute, TP collectives), the bubble's share (a product of two of them) approximate."""
    return Time(**{f: v + w * (getattr(full, f) - v) for f, v in asdict(rest).items()})


def least_blocks(cfg: ModelConfig, r: Request, evaluated: list[Evaluated], costs: Costs) -> list[Evaluated]:
    """For each configuration that does not fit under a policy that recomputes less than `full`, where the same
    configuration under `full` fits: Megatron's block recompute with the fewest `full` layers per chunk that fits."""
    by_candidate = {e.candidate: e for e in evaluated}
    out = []
    for e in evaluated:
        c = e.candidate
        full = by_candidate.get(replace(c, remat="full"))
        k = chunk_layers(cfg, c)
        if e.fits or c.remat == "full" or full is None or not full.fits or k < 2:
            continue
        stored = at_context(run_kernels(cfg, c), c, costs_of(cfg, c, costs)[0]).stored_bytes
        for n in range(1, k):
            mem = block_memory(e.memory, full.memory, stored, n, k)
            if mem.total_bytes <= r.budget_bytes:
                t = block_time(e.time, full.time, n / k)
                tflops = train_flops(cfg, r.global_batch) / t.total_s / r.gpus / 1e12
                out.append(Evaluated(replace(c, remat=f"full:{n}+{c.remat}"), mem, t, tflops,
                                     tflops / r.hardware.peak_tflops, True, e.layer_context))
                break
    return out


# ---------------------------------------------------------------------------------------------
# Output


FSDP_NOTE = ("f = FSDP ranks (d·f ranks split the batch's rows; every weight's state split over f); FSDP s = each "
             "layer's weights gathered in forward and again in backward and their float32 gradients reduce-scattered, "
             "per micro-batch, over the f ranks' links (NVLink where t·c·f fits a node, else one InfiniBand link per "
             "rank of the group in a node), not "
             "overlapped with compute (with --fsdp-overlap: only what the micro-batch's compute cannot hide); its "
             "memory: the state over f plus one layer's gathered weights and gradient (memory.fsdp_gathered_bytes)")


ZERO_BUBBLE_NOTE = ("v = zb: ZB-H1 (the backward split into B and W; v = 2z: over 2 chunks per stage, interleaved; "
                    "searched without FSDP or K/V heads repeated over t): bubble (p − 1)(T_F + T_B − T_W)/"
                    "(v·m(T_F + T_B + T_W)) at the layer's kernel times (Qi et al.; 1F1B's is (p − 1)/m), memory + "
                    "the W stash (p slots of L/(p·v) layers' weight-matmul inputs and output gradients: "
                    "formulas.deferred_stash_bytes; stage 0's activations L layers, 1F1B's), TP + the two "
                    "[b, s, h] all-gathers per layer W adds under SP; both "
                    "schedules priced as Megatron's asynchronous stages run them, where jaxseq's lock-step executor "
                    "gains more from ZB-H1 (docs/parallelism.md)")


BLOCK_NOTE = ("full:N+POLICY: Megatron-LM's block recompute (--recompute-method block --recompute-num-layers N where "
              "POLICY is none), added where a configuration does not fit under POLICY and fits under full: the first "
              "N layers of each chunk (L/(p·v)) under full, the fewest that fit; its memory the larger of the two "
              "backward loops' peaks (search.block_memory), its time N/(L/(p·v)) of the way from POLICY's to full's")


def _v_cell(c: Candidate) -> str:
    """The v column: chunks per stage; zb: ZB-H1, 2z: ZB-H1 over 2 chunks per stage."""
    return (f"{c.virtual}z" if c.virtual > 1 else "zb") if c.zero_bubble else str(c.virtual)


def format_result(res: Result, top: int = 10) -> str:
    cfg, r, hw, tm = res.config, res.request, res.request.hardware, res.request.time_model
    fsdp = any(f > 1 for f in r.fsdp_sizes)  # the f and FSDP s columns, where FSDP is searched
    f_head, fsdp_head = (f" {'f':>2}", f"{'FSDP s':>8}") if fsdp else ("", "")
    verified = any(e.compiled_bytes is not None for e in res.ranked[:top])  # the step GiB column (`verify`)
    step_head = f"{'step GiB':>9}{'GPU s':>9}" if verified else ""
    remat_width = max([10, *(len(e.candidate.remat) + 1 for e in res.ranked[:top])])  # block specs are longer
    lines = [
        f"{res.model}: h={cfg.hidden} a={cfg.heads}{M.shape_label(cfg)} L={cfg.layers} s={cfg.seq_len} V={cfg.vocab_size} {cfg.dtype}; "
        f"{r.gpus} GPUs ({hw.name}: {hw.gpus_per_node} per node, {hw.memory_gib:g} GiB, peak {hw.peak_tflops:g} TFLOP/s, "
        f"HBM {hw.hbm_gb_per_s:g} GB/s, {hw.sm_count} SMs, NVLink {hw.intra_node_gb_per_s:g} GB/s, "
        f"IB {hw.inter_node_gbit_per_s:g} Gb/s per GPU); global batch {r.global_batch}",
        f"time model: each GEMM in waves of {K.TILE[0]}×{K.TILE[1]} tiles at {tm.compute_efficiency:g} of peak or at "
        f"HBM speed if memory-bound, "
        + (f"fused attention at cuDNN's {K.FLASH_FORWARD_EFFICIENCY:.2f} (forward) and {K.FLASH_BACKWARD_EFFICIENCY:.2f} "
           "(backward) of peak (XLA's kernel in float32 and the all-gather context strategy: its GEMMs and softmax, "
           "QKᵀ replayed), " if cfg.attention == "fused" else "")
        + ("the ring's attention as its blocks (2c + 1 of (s/2c)² a rank, 7 GEMMs each, the backward recomputing "
           "every block), " if any(ring_size(e.candidate) > 1 for e in res.ranked) else "")
        + f"{memory_bound_source(res)} at {tm.memory_efficiency:g} of HBM bandwidth, links at {tm.link_efficiency:g} of bandwidth, "
        + ("nothing overlapped but FSDP's gathers and reduce-scatters (hidden behind each micro-batch's compute "
           "where they fit: --fsdp-overlap)" if tm.fsdp_overlap else "nothing overlapped")
        + ("; pipeline ticks lock-step (each waits for its slowest stage's F, B or W: --lockstep)" if tm.lockstep
           else "; pipeline stages asynchronous (Megatron's; jaxseq's executor runs lock-step: --lockstep)"),
        f"memory: {MEMORY_ACCOUNTING}; {memory_source(res)}",
        f"{res.evaluated} configurations evaluated, {len(res.ranked)} fit; {res.compiled} layers (t, SP, remat; c and "
        f"strategy where compiled at c > 1; the ring's on explicit attention) measured from compiled programs",
        "",
        f"{'#':>3} {'t':>2} {'p':>3} {'v':>2} {'c':>2} {'d':>4}{f_head} {'b':>2} {'m':>5} "
        f"{'remat':<{remat_width}}{'SP':<4}{'DO':<4}"
        f"{'mem GiB':>8}{step_head}{'step s':>9}{'TFLOP/s':>9}{'MFU':>7}{'bubble':>8}{'comp s':>9}{'TP s':>8}{'p2p s':>8}{'DP s':>8}"
        f"{'CP s':>8}{fsdp_head}{'opt s':>8}  CP strategy, layer",
    ]
    for i, e in enumerate(res.ranked[:top]):
        c, t = e.candidate, e.time
        step_cell = "" if not verified else "-".rjust(9) if e.compiled_bytes is None else f"{e.compiled_bytes / GIB:>9.1f}"
        step_cell += "" if not verified else "-".rjust(9) if e.compiled_step_s is None else f"{e.compiled_step_s:>9.3f}"
        lines.append(
            f"{i + 1:>3} {c.tensor:>2} {c.pipe:>3} {_v_cell(c):>2} {c.context:>2} {c.data:>4}{f' {c.fsdp:>2}' if fsdp else ''} "
            f"{c.micro_batch:>2} {c.microbatches:>5} "
            f"{c.remat:<{remat_width}}{'yes' if c.sequence_parallel else 'no':<4}{'yes' if c.distributed_optimizer else 'no':<4}"
            f"{e.memory.total_bytes / GIB:>8.1f}{step_cell}{t.total_s:>9.3f}{e.model_tflops_per_gpu:>9.1f}{100 * e.mfu:>6.1f}%"
            f"{100 * t.bubble:>7.1f}%{t.compute_s:>9.3f}{t.tp_s:>8.3f}{t.p2p_s:>8.3f}{t.dp_s:>8.3f}{t.context_s:>8.3f}"
            f"{f'{t.fsdp_s:>8.3f}' if fsdp else ''}{t.optimizer_s:>8.3f}"
            f"  {f'{c.context_strategy}, {e.layer_source}' if c.context > 1 else '-'}")
    flops = ("72·B·s·L·h²·(1 + s/(6h) + V/(12hL))" if M.traits(cfg).papers_formulas
             else "formulas.train_flops: K/V heads once, the MLP's gate, up and down, the logits")
    lines += ["", f"TFLOP/s: model FLOPs per GPU ({flops}, no recompute) / predicted step time; "
                  "MFU = that / peak; comp/TP/p2p exclude the bubble's share; c = context-parallel size, CP s = its "
                  "K/V traffic, opt s = the optimizer step (HBM traffic) "
                  "(formulas.context_kv_bytes); layer: at c > 1 the layer's stored and working memory and TP "
                  "collectives compiled on a c × t mesh (\"compiled\"), or, where c·t exceeds the simulated devices, "
                  "the compiled c = 1 layer's scaled (\"scaled\": search.at_context)"]
    if verified:
        lines += [f"step GiB: the whole train step compiled for the {res.target} (its peak per device: argument + output "
                  "+ temp − alias), where mem GiB adds the parts up; GPU s: its step time priced on that program "
                  "(its GEMMs and attention as step s prices them, the bytes its other kernels move at HBM speed: "
                  "search.program_step_time; - under a pipeline); a configuration whose step does not fit left the "
                  "ranking: " + ("; ".join(f"{e.candidate.label()} ({e.compiled_bytes / GIB:.1f} GiB)"
                                           for e in res.over_budget) or "none")]
    if fsdp:
        lines += [FSDP_NOTE]
    if "zb-h1" in r.schedules:
        lines += [ZERO_BUBBLE_NOTE]
    if r.block_recompute:
        lines += [BLOCK_NOTE]
    if caveat_applies(res):
        lines += ["", fused_attention_caveat(res)]
    if res.rejected_families:
        lines += ["", "mesh families (t, p) with no configuration that fits:"]
        lines += [f"  t={f['tensor']} p={f['pipe']} d={f['data']}: {f['reason']}" for f in res.rejected_families]
    return "\n".join(lines)


def memory_bound_source(res: Result) -> str:
    """Where the time model's memory-bound bytes come from: the layers' GPU programs (`plan --search --target`) or
    Megatron's kernels, counted (`compute_seconds`)."""
    stacks = res.request.time_model.scan_stacks
    if res.target is not None:
        return (f"the memory-bound kernels of each layer's {res.target} program (the bytes its loops move: XLA:GPU's "
                f"fusions, {'the stacks zero-filled' if stacks else 'the scan stacks taken out'})")
    return "Megatron's elementwise kernels (counted)" + (" and the scan's stacked activations and weights" if stacks else "")


def memory_source(res: Result) -> str:
    """Which compiler's programs the layers were measured from: a GPU's (`plan --search --target`) or XLA:CPU's."""
    if res.target is not None:
        return (f"layers compiled for the {res.target} (XLA:GPU, no GPU needed: planning/gpu_target.py); the "
                "parts added up: within 3.7% of the H100's measured peaks, scanned layers on XLA's Triton GEMMs")
    return "layers compiled by XLA:CPU on simulated devices (plan --search --target h100: the GPU's)"


def caveat_applies(res: Result) -> bool:
    """The fused-attention caveat is XLA:CPU's, where #1 runs cuDNN's flash kernel on a GPU (`run_kernels`): a layer
    compiled for a GPU runs that kernel, and a layout that runs XLA's holds the scores on a GPU too."""
    best = res.ranked[0].candidate if res.ranked else None
    return (res.config.attention == "fused" and res.target is None
            and (best is None or K.flash(run_kernels(res.config, best))))


def fused_attention_caveat(res: Result) -> str:
    """The working memory of `--attention fused` is XLA:CPU's, which materialises the scores a GPU's flash kernel
    never holds (`formulas.flash_attention_working_bytes`). Not subtracted: `memory_analysis()` gives one temp
    total, and how many score buffers are live at its peak is XLA's buffer assignment's choice, not readable from
    it (a second compile at another s would separate the s² part from the rest; the search does not)."""
    best = res.ranked[0].candidate if res.ranked else None
    line = ("caveat (--attention fused): working memory is the compiled XLA:CPU step's, which materialises the float32 "
            "[b, a/t, s/c, s] scores of a layer (no flash kernel on CPU); a GPU's flash kernel keeps a "
            f"{F.FLASH_TILE[0]}×{F.FLASH_TILE[1]} tile of them on chip and holds in HBM only the float32 dQ, "
            "log-sum-exp and rowsum(dO·O): 4·b·(a/t)·(s/c)·(d + 2) bytes per layer (formulas.flash_attention_working_bytes)")
    if best is None:
        return line
    f = F.flash_attention_working_bytes(res.config, best.micro_batch, best.tensor, best.context)
    return (line + f"; for #1 ({best.label()}): one score buffer {f['explicit_scores'] / 2**20:,.2f} MiB (formula) "
            f"counted in its working memory at least once, against the kernel's {f['hbm'] / 2**20:,.2f} MiB (formula): "
            "its memory is over-stated by at least the difference")


def to_json(res: Result, top: int = 10) -> dict:
    r = res.request
    return {
        "model": res.model, "family": res.config.family, "hidden": res.config.hidden, "heads": res.config.heads,
        "kv_heads": res.config.num_kv_heads, "mlp_hidden": res.config.mlp_hidden, "layers": res.config.layers,
        "seq_len": res.config.seq_len, "vocab_size": res.config.vocab_size, "dtype": res.config.dtype,
        "gpus": r.gpus, "global_batch": r.global_batch, "hardware": asdict(r.hardware),
        "time_model": asdict(r.time_model), "micro_batches": list(r.micro_batches), "remats": list(r.remats),
        "context_sizes": list(r.context_sizes), "fsdp_sizes": list(r.fsdp_sizes), "schedules": list(r.schedules),
        "context_strategies": list(r.context_strategies),
        "evaluated": res.evaluated, "fitting": len(res.ranked), "measured_layer_programs": res.compiled,
        "memory_accounting": MEMORY_ACCOUNTING,
        "units": "memory GiB per device (first pipeline stage), time seconds per step, TFLOP/s per GPU (model FLOPs)",
        "ranked": [e.to_json() for e in res.ranked[:top]],
        "over_budget_by_compiled_step": [e.to_json() for e in res.over_budget],
        "rejected_families": res.rejected_families,
        "fused_attention_caveat": fused_attention_caveat(res) if caveat_applies(res) else None,
        "memory_source": memory_source(res),
        "memory_bound_source": memory_bound_source(res),
    }


def paper_tflops_per_gpu(cfg: ModelConfig, batch: int, gpus: int, seconds: float, accounting: str) -> float:
    """TFLOP/s per GPU as a paper counts it: `model` (Korthikanti's MFU numerator) or `full`
    (Narayanan et al. 2021: 96·B·s·L·h²·(1 + s/(6h) + V/(16hL)), full recompute: GPT's shapes only)."""
    if accounting == "full" and not M.traits(cfg).papers_formulas:
        raise ConfigError(f"accounting={accounting!r} is the papers' GPT formula; family={cfg.family!r} has none")
    flops = (paper_hardware_flops(batch, cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size, "full")
             if accounting == "full" else train_flops(cfg, batch))
    return flops / seconds / gpus / 1e12


def calibrate_compute_efficiency(cfg: ModelConfig, r: Request, c: Candidate, costs: Costs, seconds: float) -> float:
    """The compute efficiency that makes candidate c's predicted step time equal `seconds`. The time falls
    as the efficiency rises (until every GEMM is memory-bound), so bisection finds it."""
    layer = costs.layer(c.tensor, c.sequence_parallel, c.remat, c.micro_batch, c.context, c.context_strategy)
    # the distributed optimizer splits over data × context: d·c ranks to the state's arithmetic
    state = costs.state(replace(cfg, layers=cfg.layers // c.pipe), c.tensor, c.data * c.context, c.distributed_optimizer,
                        c.pipe)
    at = lambda eff: step_time(cfg, c, layer, state, r.hardware, replace(r.time_model, compute_efficiency=eff)).total_s
    if seconds <= at(1.0):
        raise ConfigError(f"{seconds:g} s is less than the time at peak efficiency, {at(1.0):.3f} s: cannot calibrate")
    low, high = 1e-3, 1.0
    while high - low > 1e-7:
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid) > seconds else (low, mid)
    return (low + high) / 2


def parse_list(text: str, kind=int) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
