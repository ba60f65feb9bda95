"""Bytes per device of a training step: the state from shapes and shardings, the activations, the peak.

What is counted here comes from the model's parameter shapes and the train step's own specs (nothing
is compiled): the fp32 master weights, gradients, Adam moments and the compute-dtype weight copy, and
the activations outside the layers. The bytes one layer stores and the step's working memory are
read from compiled programs (`planning.measure`); the peak adds them up the same way for the plan's
rows and for `--search` (`peak_bytes`), and `tests/test_plan.py` holds it to `memory_analysis()` of
the compiled train step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.models import model
from jaxseq.parallel.layout import Layout
from jaxseq.sharding import entry_axes

MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class _Leaf:
    part: str  # "layers", or "embedding group" (the embedding, the final norm, an untied head)
    elements: int  # on one device, split by tensor
    master_elements: int  # of its master weights and of each Adam moment on one device
    cast: bool  # copied to the compute dtype (all but LayerNorm parameters)
    sharded: bool  # over data or pipe (master_specs): the step gathers a full copy of it
    fsdp: int = 1  # the fsdp ranks it is split over (FSDP: each layer gathers it as it goes; its gradient is a shard)
    fsdp_run: bool = False  # the run has fsdp ranks: the weights enter the step float32, each layer casts its own
    pipelined: bool = False  # the run has a pipeline: its executor accumulates float32 gradients tick by tick

    @property
    def gradient_elements(self) -> int:
        """Its float32 gradient on one device: whole (reduced once a step), or under FSDP its shard."""
        return self.elements // self.fsdp

    def loop_gradient_bytes(self, cfg: ModelConfig) -> int:
        """Its gradient while the backward layer loop runs, where the step peaks: the gradient of the compute copy
        the step differentiates (a cast leaf's in the compute dtype, carried by the loop), cast to float32 after
        the loop, when the stored activations are freed (read from the step compiled for an H100). Float32 under
        FSDP (each layer's reduce-scattered shard) and under a pipeline (its executor's accumulators)."""
        if self.fsdp_run or self.pipelined or not self.cast:
            return 4 * self.gradient_elements
        return self.elements * cfg.itemsize

    def copy_bytes(self, cfg: ModelConfig) -> int:
        """The compute-dtype copy a step makes: a gathered one of a data-sharded leaf (LayerNorm
        parameters in f32), a cast one of a replicated leaf, none of a replicated f32 leaf. Under FSDP none
        (each layer casts and gathers its weights as it runs: `fsdp_gathered_bytes`) but where the distributed
        optimizer or a pipeline splits the master further: that is gathered over data or pipe in the compute dtype
        and held float32, its fsdp shard (`train_step.fsdp_weights`)."""
        e = cfg.itemsize
        if self.fsdp_run:
            return 4 * self.elements // self.fsdp if self.sharded else 0
        if self.sharded:
            return self.elements * (e if self.cast else 4)
        return self.elements * e if self.cast and cfg.dtype != "float32" else 0


# the embedding, the final norm and an untied head: every pipeline stage computes with them
EMBEDDING_GROUP = "embedding group"


def _leaves(cfg: ModelConfig, tensor: int, data: int, distributed_optimizer: bool, pipe: int = 1,
            fsdp: int = 1, expert: int = 1) -> list[_Leaf]:
    """Every parameter's per-device elements under the train step's own specs (`Layout.master_specs`). With
    pipe > 1, `cfg` is one stage's (its layers), and the embedding group's master weights and moments are
    split over `pipe` as the pipelined step's are. With fsdp > 1, every leaf with a hidden dimension is split
    over `fsdp` (master weights, moments and gradient). With expert > 1, a mixture's routed experts are split over
    `expert` (each rank holds and updates its own: weights, gradients and moments)."""
    parallel = ParallelConfig(data=data, tensor=tensor, sequence_parallel=False, pipe=pipe,
                              distributed_optimizer=distributed_optimizer, fsdp=fsdp, expert=expert)
    sizes = {"tensor": tensor, "data": data, "pipe": pipe, "fsdp": fsdp}
    out = []
    layout = Layout(cfg, parallel)
    for part, specs in layout.master_specs.items():
        is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
        shapes = jax.tree.leaves(layout.param_shapes[part], is_leaf=lambda x: isinstance(x, tuple))
        for shape, spec, cast in zip(shapes, jax.tree.leaves(specs, is_leaf=is_spec),
                                     jax.tree.leaves(model.cast_mask(cfg)[part])):
            # a layer's dimension 0 is split over `pipe` into the stages' layers, which `cfg` already holds (at
            # pipe = 1 the distributed optimizer may put `data` there: that split counts)
            axes = [a for i, entry in enumerate(spec) for a in entry_axes(entry)
                    if not (part == "layers" and i == 0 and a == "pipe")]
            n = int(np.prod(shape, dtype=np.int64)) // tensor ** axes.count("tensor") // expert ** axes.count("expert")
            split = int(np.prod([sizes[a] for a in axes if a in ("data", "pipe", "fsdp")]))
            out.append(_Leaf("layers" if part == "layers" else EMBEDDING_GROUP, n, n // split, cast,
                             any(a in ("data", "pipe") for a in axes), fsdp if "fsdp" in axes else 1, fsdp > 1,
                             pipe > 1))
    return out


def parameter_elements_per_device(cfg: ModelConfig, tensor: int, expert: int = 1) -> tuple[int, int]:
    """(all parameter elements, those cast to the compute dtype) on one device, from the shapes and
    the tensor-parallel specs (LayerNorm parameters stay float32: no copy); a mixture's routed experts / `expert`."""
    total = cast = 0
    for leaf in _leaves(cfg, tensor, 1, False, expert=expert):
        total += leaf.elements
        cast += leaf.elements if leaf.cast else 0
    return total, cast


@dataclass(frozen=True)
class State:
    """Per-device bytes of the training state: the fp32 master weights (the parameters the optimizer
    updates), fp32 gradients, Adam's two fp32 moments, and the compute-dtype copy of the weights a
    step makes. Without the distributed optimizer a float32 step reads the master weights directly
    (no copy); with it every step gathers a full copy, LayerNorm parameters included (in f32)."""

    params: int  # fp32 master weights
    gradients: int  # float32, what clipping and AdamW read
    optimizer: int  # Adam moments
    weight_copy: int
    loop_gradients: int  # those alive in the backward layer loop instead (`_Leaf.loop_gradient_bytes`)
    gradient_shards: int  # the distributed optimizer's: the float32 gradients reduce-scattered onto the master shards

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.weight_copy

    @property
    def at_peak(self) -> int:
        """The state's share of the step's peak, in the backward layer loop: the float32 gradients are not made
        yet, the compute copy's gradients (`loop_gradients`) are; in a bfloat16 step 2 bytes a parameter less."""
        return self.params + self.loop_gradients + self.optimizer + self.weight_copy

    @property
    def after_loop(self) -> int:
        """The state after the backward layer loop, the activations freed: master weights, moments, the float32
        gradients, and where the distributed optimizer reduce-scatters them their shards beside them (the
        collective's input and output): the peak of a step that keeps few activations."""
        return self.params + self.optimizer + self.gradients + self.gradient_shards


def state_bytes(cfg: ModelConfig, tensor: int, data: int = 1, distributed_optimizer: bool = False,
                pipe: int = 1, fsdp: int = 1, expert: int = 1) -> State:
    """Per-device state bytes; the distributed optimizer divides master weights and moments by
    `data` for every parameter with a dimension `data` divides (the others are counted whole). With
    pipe = p > 1, `cfg` holds one stage's layers (the first stage's: L/p), and the embedding group's
    master weights and moments are divided by p too, as the pipelined step splits them over `pipe`
    (`state_bytes_by_part` tells the two apart). FSDP (fsdp = F > 1) divides every weight's master, moments and
    gradient by F and makes no compute copy of it (16 bytes a parameter over F; biases and norm scales whole).
    expert = E > 1 divides a mixture's routed experts by E (planning/moe.py)."""
    return _state(_leaves(cfg, tensor, data, distributed_optimizer, pipe, fsdp, expert), cfg)


def state_bytes_by_part(cfg: ModelConfig, tensor: int, data: int = 1, distributed_optimizer: bool = False,
                        pipe: int = 1, fsdp: int = 1, expert: int = 1) -> dict[str, State]:
    """`state_bytes` of the layers and of the embedding group (`EMBEDDING_GROUP`), which sum to it."""
    leaves = _leaves(cfg, tensor, data, distributed_optimizer, pipe, fsdp, expert)
    return {part: _state([l for l in leaves if l.part == part], cfg) for part in ("layers", EMBEDDING_GROUP)}


def fsdp_gathered_bytes(cfg: ModelConfig, tensor: int, fsdp: int) -> int:
    """FSDP's working memory per device beyond the state: the largest gathered weights alive at once — one layer's
    weights in the compute dtype with their float32 gradient before its reduce-scatter (backward), or one
    embedding-group weight's (the token table at the lookup, the logits' weight at the head), whichever is larger
    (`cfg` whole; 0 without FSDP)."""
    if fsdp == 1:
        return 0
    leaves = [l for l in _leaves(cfg, tensor, 1, False, 1, fsdp) if l.fsdp > 1]
    layer = sum(l.elements for l in leaves if l.part == "layers") // cfg.layers
    embedding = max((l.elements for l in leaves if l.part == EMBEDDING_GROUP), default=0)
    return (cfg.itemsize + 4) * max(layer, embedding)


def _state(leaves: list[_Leaf], cfg: ModelConfig) -> State:
    gradients = sum(l.gradient_elements for l in leaves)
    master = sum(l.master_elements for l in leaves)
    shards = sum(l.master_elements for l in leaves if l.sharded and not (l.pipelined or l.fsdp_run))  # over data
    return State(4 * master, 4 * gradients, 8 * master, sum(l.copy_bytes(cfg) for l in leaves),
                 sum(l.loop_gradient_bytes(cfg) for l in leaves), 4 * shards)


def non_layer_activation_bytes(cfg: ModelConfig, b: int, tensor: int, sp: bool, context: int = 1) -> int:
    """Activations outside the layers, from shapes (the paper's §4.3 terms): the embedding dropout
    mask (1 byte), the final norm's input and its f32 statistics (LayerNorm's mean and 1/std, RMSNorm's 1/rms),
    the logits matmul's input (sequence-sharded under SP), and the float32 logits the cross-entropy keeps,
    4·s·b·V/t; per token, so divided by the context size."""
    s, h, e = cfg.seq_len // context, cfg.hidden, cfg.itemsize
    stats = model.traits(cfg).norm_stat_bytes
    per_token = (1 if cfg.dropout > 0 else 0) * h + e * h + stats + e * h
    return s * b * per_token // (tensor if sp else 1) + 4 * s * b * cfg.padded_vocab(tensor) // tensor


def activation_bytes(stored_bytes_per_layer: float, in_flight_layers: float, non_layer_bytes: float) -> float:
    """Activations a device keeps for backward: the bytes one layer stores × the layers' worth in
    flight (L without a pipeline; the first stage's count under one) + the part outside the layers."""
    return stored_bytes_per_layer * in_flight_layers + non_layer_bytes


def peak_bytes(state: float, activations: float, working: float, accumulator: float = 0,
               after_loop: float = 0) -> float:
    """The train step's peak per device (the first pipeline stage): in the backward layer loop, the state's share of
    it (`State.at_peak`) + stored activations + the step's working memory, + the fp32 gradient accumulator of an
    unpipelined step over m > 1 micro-batches (the search's; the plan compiles one micro-batch per step); or after
    that loop, the state alone (`State.after_loop`: the accumulator is its float32 gradients), where that is more."""
    return max(state + activations + working + accumulator, after_loop)
