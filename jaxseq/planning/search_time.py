"""`plan --search`'s time model: a candidate's seconds per step, a stated model (the slowest stage is the last,
which also runs the logits):
  per micro-batch on a stage: compute = L/p × (each GEMM of a layer — forward, backward, the policy's
      replays — at the efficiency of its shape, + the layer's elementwise kernels at HBM bandwidth) + the
      same for the embedding, logits and loss (`planning.kernel_time`: tile and wave quantization on the
      GPU's SMs, a roofline for the memory-bound ones; the attention on the kernel `train` gives the candidate:
      `costs.run_kernels`); + TP/SP collectives = L/p · ring traffic of the
      layer's collectives (compiled HLO) / (link_efficiency · intra-node bandwidth); + pipeline p2p = 2·v
      sends of s·b·h/t activations (Megatron's scatter/gather over the t ranks) / (link_efficiency · p2p
      bandwidth); + at c > 1 the K/V all-gathers or ring sends of each layer (`formulas.context_kv_bytes`) /
      (link_efficiency · the context group's bandwidth).
  pipeline = m · per micro-batch · (1 + bubble), bubble = idle/busy ticks of the schedule
      ((p − 1)/m, interleaved (p − 1)/(v·m)); ZB-H1 (`--schedules 1f1b,zb-h1`):
      (p − 1)(F + B − W)/(m(F + B + W)) at the layer's split kernel times (`kernel_time.split_layer_seconds`), its
      W stash in the memory, and under SP the two all-gathers per layer its W adds (`zero_bubble_gather_bytes`).
  data-parallel gradient reduction after the flush: fp32 gradients of the stage's parameters, ring
      all-reduce 2(d − 1)/d · 4N bytes, or with the distributed optimizer a reduce-scatter (d − 1)/d · 4N
      plus the all-gather of the compute copy (d − 1)/d · 2N, / (link_efficiency · d's bandwidth); under FSDP
      N is the device's fsdp shards, and per micro-batch each layer's weights are gathered twice and its gradients
      reduce-scattered once over f (`fsdp_bytes`).
  Nothing overlaps (as in Megatron-LM 2021–22): TP collectives sit between the matmuls that need them,
  p2p blocks the 1F1B step, the gradient reduction follows the pipeline flush.
  Links: a group inside one node uses the intra-node bandwidth, otherwise the inter-node one (ranks
  ordered tensor fastest, then data, then pipe, as Megatron-LM).
  optimizer step after the reduction: AdamW and the global-norm clip read and write 32 bytes per fp32 master
      element the device updates, and the next compute copy 4 + e bytes per parameter, at the elementwise
      kernels' fraction of HBM bandwidth (`optimizer_seconds`).
  Ignored: the tied-embedding gradient reduction between the first and last stage, kernel launch and host
  overheads.
  Constants: the compute efficiency (calibrated on one published row: `planning.calibration`), the memory and
  link efficiencies (stated: `search_space.TimeModel`).
Where a step was compiled for the GPU (`plan --search --target --verify`), its compute is priced on that program
instead (`program_step_time`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxseq.config import ModelConfig, replace
from jaxseq.hardware import Hardware
from jaxseq.models import formulas
from jaxseq.planning import kernel_time, moe
from jaxseq.planning.blocks import Block
from jaxseq.planning.costs import (LayerCost, StateCost, at_context, pipeline_schedule, ring_size, run_kernels,
                                   schedule_figures)
from jaxseq.planning.search_space import Candidate, TimeModel
from jaxseq.remat import MOE_EXCHANGE_REPLAYED


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
    pcie_s: float = 0.0  # host offload's copies the step is charged (`host_tier.HostTier.charged_seconds`)
    expert_s: float = 0.0  # a mixture's all-to-alls (`all_to_all_seconds`; its bubble share in bubble_s)

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_s + self.p2p_s + self.bubble_s + self.dp_s + self.context_s + self.optimizer_s
                + self.fsdp_s + self.pcie_s + self.expert_s)


def links(c: Candidate, hw: Hardware) -> dict[str, float]:
    """Bandwidth (GB/s) each group's collectives see: inside a node if the group's ranks fit in one
    (tensor fastest, then context, expert, fsdp, data, pipe: the mesh's order); "data" is data × context, the
    gradients' (a mixture's dense gradients reduce over the expert ranks too, inside it: `gradient_reduction_bytes`).
    An fsdp group that spans nodes with g of its ranks in each node sees g InfiniBand links (NCCL runs a channel
    over each NIC), up to NVLink's bandwidth: MaxText's FSDP=64 step on 8 nodes of 8 H100s moves its weights
    within the measured step only so (experiments/results/fsdp.md); the other groups keep one link per GPU."""
    intra, inter = hw.intra_node_gb_per_s, hw.inter_node_gb_per_s
    n, tc = hw.gpus_per_node, c.tensor * c.context * c.expert  # the ranks inside an fsdp rank (mesh.MESH_AXES)
    per_node = max(1, min(c.fsdp, n // tc))  # the fsdp group's ranks in one node
    return {"tensor": intra if c.tensor <= n else inter,
            "context": intra if c.tensor * c.context <= n else inter,
            "fsdp": intra if tc * c.fsdp <= n else min(intra, per_node * inter),
            "data": intra if tc * c.fsdp * c.data <= n else inter,
            "pipe": intra if tc * c.fsdp * c.data * c.pipe <= n else inter}


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
    f, b, w = kernel_time.split_layer_seconds(cfg, c.micro_batch, c.tensor, c.sequence_parallel, c.remat, hw,
                                              tm.compute_efficiency, tm.memory_efficiency, ring_size(c), c.context)
    return (c.pipe - 1) * (f + b - w) / (c.virtual * c.microbatches * (f + b + w))


def compute_seconds(cfg: ModelConfig, c: Candidate, hw: Hardware, tm: TimeModel, layer: LayerCost,
                    layer_parameters: float) -> float:
    """One micro-batch through the last stage (its L/p layers, the logits and the loss): each GEMM at its
    shape's efficiency, fused attention at its kernel's, and the memory-bound kernels at HBM bandwidth
    (`planning.kernel_time`); at context c a rank does 1/c of it (s/c tokens; the causal attention balanced by the
    2c-chunk order; a ring's attention core its blocks, `kernel_time.ring_gemms`; the GEMMs' smaller shapes'
    efficiency not modelled; FP8's quantization of the weights each rank's whole, `kernel_time.fp8_quantize_bytes`).
    The memory-bound bytes: where the layer was compiled for a GPU, what its program's layer loops move
    (`LayerCost.moved_bytes`, at c already: XLA:GPU's fusions, the scan's slices and updates among them) + the zero
    fill of its stored activations' stacks; less the stacks' traffic for unrolled layers (`TimeModel.scan_stacks`
    False). Else Megatron's kernels, counted (`kernel_time.layer_elementwise_bytes`), +
    with `scan_stacks` each layer's stored activations (`layer.stored_bytes`) and its parameters on the device
    (`layer_parameters`) through the scan's stacked buffers (`kernel_time.scan_stack_bytes`)."""
    efficiencies = (hw, tm.compute_efficiency, tm.memory_efficiency)
    b, t, sp, layers, ring = c.micro_batch, c.tensor, c.sequence_parallel, cfg.layers // c.pipe, ring_size(c)
    head = kernel_time.head_seconds(cfg, b, t, sp, *efficiencies)
    stacks = kernel_time.scan_stack_bytes(layer.stored_bytes, layer_parameters, cfg.itemsize)
    hbm = tm.memory_efficiency * hw.hbm_gb_per_s * 1e9
    if layer.moved_bytes is None:
        return ((layers * kernel_time.layer_seconds(cfg, b, t, sp, c.remat, *efficiencies, ring, c.context) + head)
                / c.context
                + layers * (stacks if tm.scan_stacks else 0.0) / hbm)
    fill = kernel_time.STACK_FILL_PASSES * layer.stored_bytes  # before the loops; the stacks' other traffic is in them
    moved = layer.moved_bytes + (fill if tm.scan_stacks else fill - stacks)
    return ((layers * kernel_time.layer_matmul_seconds(cfg, b, t, c.remat, *efficiencies, ring) + head) / c.context
            + layers * moved / hbm)


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
    matmuls = (cfg.layers * kernel_time.layer_matmul_seconds(cfg, b, t, c.remat, *efficiencies, ring_size(c))
               + sum(kernel_time.gemm_seconds(g, hw, cfg.itemsize, *efficiencies[1:])
                     for g in kernel_time.head_gemms(cfg, b, t)))
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
    weight, write `itemsize`), at the elementwise kernels' fraction of HBM bandwidth. Under FSDP (fsdp > 1) there is
    no copy: each layer casts its shard as it gathers it."""
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


def pipeline_bubble(cfg: ModelConfig, c: Candidate, hw: Hardware, tm: TimeModel) -> float:
    """The bubble, idle over busy: the schedule's ticks (no pipeline: none); lock-step (`TimeModel.lockstep`) each
    tick the slowest stage's op at a layer's split kernel times; ZB-H1 Qi et al.'s (`zero_bubble_bubble`)."""
    _, bubble = schedule_figures(c, cfg.layers)
    if c.pipe > 1 and tm.lockstep:
        return pipeline_schedule(c).lockstep_bubble(*kernel_time.split_layer_seconds(
            cfg, c.micro_batch, c.tensor, c.sequence_parallel, c.remat, hw, tm.compute_efficiency, tm.memory_efficiency,
            ring_size(c), c.context))
    if c.zero_bubble:
        return zero_bubble_bubble(cfg, c, hw, tm)
    return bubble


def step_time(cfg: ModelConfig, c: Candidate, layer: LayerCost, state: StateCost, hw: Hardware,
              tm: TimeModel) -> Time:
    cfg = run_kernels(cfg, c)
    layers = cfg.layers // c.pipe
    layer = at_context(cfg, c, layer)
    bw = {k: v * 1e9 * tm.link_efficiency for k, v in links(c, hw).items()}
    compute = compute_seconds(cfg, c, hw, tm, layer, state.layer_parameters / layers)
    kv = formulas.context_kv_bytes(cfg, c.micro_batch, c.tensor, c.context, c.context_strategy)["traffic"]
    context = layers * kv / bw["context"]
    tp = layers * (sum(ring_traffic(k, n, c.tensor) for k, n in layer.collective_bytes.items())
                   + zero_bubble_gather_bytes(cfg, c)) / bw["tensor"]
    itemsize = cfg.itemsize
    message = cfg.seq_len * c.micro_batch * cfg.hidden * itemsize / (c.tensor * c.context)
    p2p = 2 * c.virtual * message / bw["pipe"] if c.pipe > 1 else 0.0
    bubble = pipeline_bubble(cfg, c, hw, tm)
    m = c.microbatches
    fsdp = fsdp_bytes(cfg, c, state) / bw["fsdp"]
    if tm.fsdp_overlap:  # hidden behind the micro-batch's compute where it fits
        fsdp = max(0.0, fsdp - compute)
    dp_bytes = gradient_reduction_bytes(cfg, c, state)
    a2a = all_to_all_seconds(cfg, c, hw, tm)
    return Time(m * compute, m * tp, m * p2p, m * (compute + tp + p2p + context + fsdp + a2a) * bubble,
                dp_bytes / bw["data"], bubble, m * context, optimizer_seconds(state, itemsize, hw, tm, c.fsdp),
                m * fsdp, expert_s=m * a2a)


def gradient_reduction_bytes(cfg: ModelConfig, c: Candidate, state: StateCost) -> float:
    """Bytes a device sends to reduce its gradients after the flush: over data × context (context ranks are data
    ranks to weights), and a mixture's dense weights over the expert ranks too, its routed experts' (split over
    them: 4 bytes a device's element, `routed_gradient_bytes`) not. Ring all-reduce, or with the distributed optimizer
    a reduce-scatter and the all-gather of the compute copy (under FSDP of the fsdp shards: the gradients' elements)."""
    routed = routed_gradient_bytes(cfg, c)
    parts = ((state.gradients - routed, c.data * c.context * c.expert), (routed, c.data * c.context))
    total = 0.0
    for grads, reduce in parts:
        if c.distributed_optimizer:
            share = grads / state.gradients if state.gradients else 0.0
            copy = cfg.itemsize * (state.parameters * share if c.fsdp == 1 else grads / 4)
            total += ring_traffic("reduce-scatter", grads, reduce) + ring_traffic("all-gather", copy, reduce)
        else:
            total += ring_traffic("all-reduce", grads, reduce)
    return total


def routed_gradient_bytes(cfg: ModelConfig, c: Candidate) -> float:
    """A mixture's routed experts' float32 gradients on a device of candidate c: its stage's L/p layers' E/e experts,
    their width split over t (and their state over f under FSDP); 0 for a dense model."""
    if not cfg.moe_experts:
        return 0.0
    routed = moe.parameters(replace(cfg, layers=cfg.layers // c.pipe)).routed
    return 4.0 * routed / (c.tensor * c.expert * c.fsdp)


def all_to_all_seconds(cfg: ModelConfig, c: Candidate, hw: Hardware, tm: TimeModel) -> float:
    """One micro-batch's all-to-alls on the stage's L/p layers (`planning.moe.all_to_all`: dispatch and combine of
    [E, C, h] for a group of b·s/c tokens, the share for expert ranks in the node over NVLink, the rest over
    InfiniBand, the slower the time), at the links' efficiency: forward and backward, and a third pass where the
    policy keeps not the dispatched buffer (`full`, `dots`, `dots_no_batch`: backward replays the dispatch and the
    combine; the compiled layer has 6 all-to-alls where `none`, `selective` and `lean` have 4). 0 at e = 1."""
    if c.expert == 1:
        return 0.0
    tokens = c.micro_batch * cfg.seq_len // c.context
    per_pass = moe.all_to_all(cfg, tokens, c.expert, c.context * c.tensor, hw).seconds_per_pass
    passes = 3 if c.remat in MOE_EXCHANGE_REPLAYED else 2
    return passes * (cfg.layers // c.pipe) * per_pass / tm.link_efficiency


def block_time(rest: Time, full: Time, n: int, k: int) -> Time:
    """Block recompute's step time (`blocks.Block.mix`): each part n/k of the way from rest's to full's, exact for
    the per-layer sums (compute, TP collectives), the bubble's share (a product of two of them) approximate."""
    return Block(n, k).mix(full, rest)
