"""What `plan --search`'s memory and time models read about a candidate: its costs and what it runs.

The costs are what the compiled programs say, per device: a layer's (`LayerCost`) and a stage's state
(`StateCost`), supplied by a `Costs` (`planning.search_costs.SearchCosts` measures them; tests supply them by hand),
and the layer at the candidate's context size (`at_context`). What a candidate runs: its pipeline schedule and the
layers of each of its chunks, and the attention kernel a GPU runs it with (`run_kernels`). The memory model
(`planning.search_memory`), the time model (`planning.search_time`) and the search (`planning.search`) all read
these, so they sit below all three.

Per-layer programs are compiled once per (t, SP, remat) and shape (at c > 1 per (t, SP, remat, c, strategy), on a
c × t mesh where the simulated devices hold it, else the c = 1 layer scaled: `at_context`), at micro-batch 1 (and
the float32 step also at 2): stored bytes and activation collectives are proportional to b, the working memory
affine in b (tests/test_search.py holds both to programs compiled at larger b).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from jaxseq.config import ModelConfig, ParallelConfig, on_platform, replace
from jaxseq.models import formulas
from jaxseq.parallel.schedule import Schedule
from jaxseq.planning.memory import non_layer_activation_bytes
from jaxseq.planning.search_space import Candidate


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
    # keys: (t, SP, remat, c, context strategy), or with fp8 as a sixth where True; compile all at once
    def prepare(self, keys: list[tuple], micro_batches: tuple[int, ...]) -> None: ...
    def layer(self, tensor: int, sequence_parallel: bool, remat: str, micro_batch: int, context: int = 1,
              strategy: str = "all-gather", fp8: bool = False) -> LayerCost: ...
    def state(self, stage: ModelConfig, tensor: int, data: int, distributed_optimizer: bool, pipe: int,
              fsdp: int = 1, expert: int = 1) -> StateCost: ...


def costs_of(cfg: ModelConfig, c: Candidate, costs: Costs) -> tuple[LayerCost, StateCost]:
    """Candidate c's layer (at its micro-batch; an FP8 candidate's FP8 layer) and its stage's state."""
    fp8 = {"fp8": True} if c.fp8 else {}  # asked of a Costs only where a candidate has FP8 GEMMs
    layer = costs.layer(c.tensor, c.sequence_parallel, c.remat, c.micro_batch, c.context, c.context_strategy, **fp8)
    # the distributed optimizer splits over data × context: d·c ranks to the state's arithmetic
    expert = {"expert": c.expert} if c.expert > 1 else {}  # asked only where a mixture's experts are split
    state = costs.state(replace(cfg, layers=cfg.layers // c.pipe), c.tensor, c.data * c.context,
                        c.distributed_optimizer, c.pipe, c.fsdp, **expert)
    return layer, state


def at_context(cfg: ModelConfig, c: Candidate, layer: LayerCost) -> LayerCost:
    """The layer's costs at context c: the layer compiled at c as it is (`LayerCost.context`: where the simulated
    devices hold c·t); else from the measured context-1 layer (a stated model, nothing compiled at c):
    stored bytes / c, exact for all-gather (tests/test_plan.py holds the compiled layer to the formula), plus the
    ring's own change (`formulas.activation_bytes` at c − at 1 / c: no scores, its log-sum-exp);
    TP collectives / c (per token); working memory / c (per token) + the K/V transient at backward's peak
    (`formulas.context_kv_bytes`: not divided by c); the embedding/logits activations of s/c tokens; the bytes its
    kernels move / c (per token: the weights' share, not divided in truth, is a few percent of a long sequence's).
    Both models read it: the memory its stored and working bytes, the time its collectives and moved bytes."""
    if layer.context == c.context:
        return layer
    if layer.context != 1:
        raise ValueError(f"a layer compiled at context {layer.context} for a candidate at context {c.context}")
    b, t, sp = c.micro_batch, c.tensor, c.sequence_parallel
    ring = (formulas.activation_bytes(cfg, c.remat, b, t, sp, c.context, c.context_strategy)
            - formulas.activation_bytes(cfg, c.remat, b, t, sp) / c.context) if c.context_strategy == "ring" else 0.0
    kv = formulas.context_kv_bytes(cfg, b, t, c.context, c.context_strategy)
    return LayerCost(layer.stored_bytes / c.context + ring,
                     {k: v / c.context for k, v in layer.collective_bytes.items()},
                     layer.working_bytes / c.context + kv["transient_backward"],
                     non_layer_activation_bytes(cfg, b, t, sp, c.context), 1,
                     None if layer.moved_bytes is None else layer.moved_bytes / c.context)


# ---------------------------------------------------------------------------------------------
# What a candidate runs: its schedule, its chunks, its attention kernel


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
    (`layer_attention`); its weight GEMMs FP8 GEMMs where c's are (`Candidate.fp8`)."""
    cfg = replace(cfg, attention=layer_attention(cfg, c.context, c.context_strategy), fp8=c.fp8)
    return on_platform(cfg, "gpu", ParallelConfig(context=c.context, context_strategy=c.context_strategy))
