"""`plan --search`'s memory model: a candidate's bytes per device, jaxseq's compiled train step's own accounting
(held to `memory_analysis()` of the compiled step, pipelined or not, in tests/test_search.py), of the first stage
(the most activations; every stage of the SPMD program allocates the same buffers):
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
  A Megatron-LM stage keeps neither the copies nor the branch's gradients nor the extra slot, so the papers'
  configurations can be over budget here (by how much: docs/planning.md).
Under FSDP the state of every weight is split over f (with the distributed optimizer further over d·c), and one
layer's gathered weights and float32 gradient sit in the working memory. The parts are added up as the plan's
(`planning.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jaxseq.config import ModelConfig
from jaxseq.models import formulas
from jaxseq.planning.blocks import Block
from jaxseq.planning.costs import (LayerCost, StateCost, at_context, chunk_layers, pipeline_schedule, run_kernels,
                                   schedule_figures)
from jaxseq.planning.memory import activation_bytes, peak_bytes
from jaxseq.planning.search_space import Candidate

MEMORY_ACCOUNTING = ("jaxseq's compiled train step, per device (the first pipeline stage); with a pipeline, "
                     "jaxseq's executor's buffers too (receive buffers, tick slots, a chunk's weights, float32 "
                     "embedding and chunk gradients, regrouped weights), more than the Megatron-LM stage the papers "
                     "count")


def deferred_stash_bytes(cfg: ModelConfig, c: Candidate) -> float:
    """ZB-H1's W stash on every stage: its slots × L/(p·v) layers × `formulas.deferred_stash_bytes`; 0 otherwise."""
    if not c.zero_bubble:
        return 0.0
    slots = pipeline_schedule(c).depths["w"]
    return (slots * chunk_layers(cfg, c)
            * formulas.deferred_stash_bytes(cfg, c.micro_batch, c.tensor, c.sequence_parallel, c.context))


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
    # accumulating: the tables' compute copy beside their gradients (`accumulation_held_copy_bytes`)
    held_copy_bytes: float = 0.0
    host_bytes: float = 0.0  # offloaded (planning/search_offload.py): held in host memory, not in `total_bytes`

    @property
    def total_bytes(self) -> float:
        return (peak_bytes(self.state_bytes, self.activation_bytes, self.working_bytes + self.fsdp_gathered_bytes,
                           self.accumulator_bytes + self.held_copy_bytes, self.after_loop_bytes)
                + self.executor.total_bytes)


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
    buffer assignments: experiments/search_memory.py). Where the step peaks at the head instead (one rank's logits of
    a large vocabulary over a long sequence), the copy was live there already and this counts it twice. How much of
    it a step holds is XLA's choice, which differs between JAX versions (docs/planning.md). The cast copy only: a
    float32 step computes on its masters (on their gathered copy under the distributed optimizer, which XLA:CPU's
    programs free as before). Under FSDP the tables are gathered at each use: none."""
    if c.fsdp > 1 or cfg.dtype == "float32":
        return 0.0
    return state.weight_copy_bytes - state.layer_copy_bytes


def block_memory(rest: Memory, full: Memory, rest_stored: float, n: int, k: int) -> Memory:
    """Block recompute's memory, the first n layers of each chunk of k under `full`, the rest under `rest`'s policy,
    composed as the plan's (`blocks.Block`): the activations and the executor's buffers n/k of the way from rest's
    to full's; the peak the larger of the two backward loops': the rest's (every stored activation held, its
    working memory), or the recomputed layers' (a chunk's k − n rest layers freed, `rest_stored` bytes each; full's
    working memory)."""
    block = Block(n, k)
    executor = block.mix(full.executor, rest.executor)
    return block.peak(lambda held: replace(rest, activation_bytes=held, executor=executor),
                      lambda held: replace(full, activation_bytes=held, executor=executor),
                      block.mix(full.activation_bytes, rest.activation_bytes), rest_stored,
                      lambda m: m.total_bytes)
