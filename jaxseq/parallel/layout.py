"""A run's layout, owned in one place: the parallel configuration, the mesh, and every PartitionSpec and
sharding the run's arrays take — the compute copy of the weights, the float32 master weights (and so their
gradients, Adam moments and the optimizer state), the batch, replicated scalars, per-device flags, a restore's
target on another mesh — derived once from the family's parameter table (`model.param_specs`: its logical axes
through the mesh's rules, `mesh.logical_rules`).

Every spec of an array the run holds, or a program takes and returns, is derived here; the activations' are
`sharding.Sharder`'s, from the same rules, and a manual region's own view (its in and out specs) is built from
these by the executor that opens it (tests/test_architecture.py holds both). A Layout is made once at the edge,
where the model, the parallel configuration and the mesh first meet — the training loop's `Session.layout`, the
planner (`aot.compile_*`, `in_flight`), sampling, conversion and `rundir.restore`, the tests and experiments — and
the entry points take it whole: the train step's and loss's builders and the state's initialisation
(`train_step`), gradient accumulation, the pipeline, the evaluation, the stop flag, aot's abstract inputs,
`rundir.init_state`. A new way to split the state (the distributed optimizer's axes, the embedding group over
`pipe`) is a change here, not at every place a sharding is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.mesh import axis_sizes
from jaxseq.models import model
from jaxseq.sharding import batch_sharding, entry_axes


def gradient_axes(parallel: ParallelConfig) -> tuple[str, ...]:
    """The axes a replicated weight's gradient is summed over: `data`, `fsdp` and `expert` (their ranks hold other
    rows of the batch) and `context` (its ranks hold other tokens of the same sequences: to the weights they are
    data ranks, as in Megatron-LM), each where the mesh has it. (A weight split over `expert`, an expert's, is
    summed over the rest: the all-to-all's transpose brings every rank's tokens' gradient to its rank.)"""
    return (("data",) + (("fsdp",) if parallel.fsdp > 1 else ()) + (("expert",) if parallel.expert > 1 else ())
            + (("context",) if parallel.context > 1 else ()))


def optimizer_axes(parallel: ParallelConfig) -> tuple[str, ...]:
    """The axes the distributed optimizer splits the state over: `data`, and `context` under context
    parallelism. Not `fsdp`: FSDP splits the state itself (`models.model.param_specs`), the distributed
    optimizer splits it further over the replicas."""
    return ("data", "context") if parallel.context > 1 else ("data",)


def sharded_spec(shape: tuple[int, ...], spec: P, axis: str | tuple[str, ...], axis_sizes: dict[str, int],
                 join: str | None = None) -> P:
    """`spec` plus `axis` (a mesh axis, or several split over as one) on the largest dimension that no mesh
    axis of size > 1 splits yet and that |axis| divides (the first such if several are equally large); failing
    that, with `join`, after `join` on the dimension `join` splits, if |join|·|axis| divides it; `spec`
    unchanged when there is none."""
    names = entry_axes(axis)
    size = math.prod(axis_sizes[a] for a in names)
    axes = list(spec) + [None] * (len(shape) - len(spec))
    split = lambda i: [a for a in entry_axes(axes[i]) if axis_sizes.get(a, 1) > 1]
    free = [i for i, n in enumerate(shape) if not split(i) and n % size == 0]
    if size == 1:
        return spec
    if free:
        axes[max(free, key=lambda i: shape[i])] = axis
    elif join is not None:
        joined = [i for i, n in enumerate(shape) if split(i) == [join] and n % (axis_sizes[join] * size) == 0]
        if not joined:
            return spec
        axes[joined[0]] = (join, *names)
    else:
        return spec
    return P(*axes)


@dataclass(frozen=True)
class Layout:
    """The model, how it is split, and (where arrays are placed) the mesh; every spec is derived once, on
    first use. Without a mesh (`mesh=None`) it holds the specs alone: what the planner counts bytes from."""

    model: ModelConfig
    parallel: ParallelConfig
    mesh: Mesh | None = None

    @cached_property
    def param_shapes(self) -> dict:
        """Global shapes of every parameter (the vocabulary padded for `tensor`)."""
        return model.param_shapes(self.model, self.parallel.tensor)

    @cached_property
    def param_specs(self) -> dict:
        """The weights as the step holds them: split over `tensor` (the stacked layers over `pipe`), replicated
        over `data` and `context`; under FSDP each weight's hidden dimension split over `fsdp` (the layers
        gather it as they use it)."""
        return model.param_specs(self.model, self.parallel)

    @cached_property
    def gradient_axes(self) -> tuple[str, ...]:
        return gradient_axes(self.parallel)

    @cached_property
    def master_specs(self) -> dict:
        """The float32 master weights (the TrainState's params), their gradients and each Adam moment.

        Without the distributed optimizer and without a pipeline these are `param_specs`. With a pipeline the
        embedding group's (the parameters every stage holds for its compute: the embedding, the final norm, an
        untied head) are split over `pipe` (`sharded_spec`): each stage keeps and updates 1/p of their master
        weights and moments, Megatron's embedding group holding its optimizer state once. With the distributed
        optimizer every leaf is also split over `data` (over data × context under context parallelism, the axes
        its gradients reduce over; joined to `pipe` on one dimension where no other is free): each of those
        ranks keeps and updates 1/(d·c) of the master weights and moments. A leaf with no dimension that the
        size divides (e.g. a [layers, mlp/t] bias when neither is a multiple of d) stays replicated over that
        axis: `jaxseq.plan` counts it at full size. Under FSDP `param_specs` already split every weight's hidden
        dimension over `fsdp`: the master weights, gradients and moments are split so too (biases and norm
        scales, which have none, are replicated over `fsdp`)."""
        parallel = self.parallel
        sizes = axis_sizes(parallel)
        over = optimizer_axes(parallel)
        optimizer_axis = over if len(over) > 1 else over[0]

        def master(part: str, shape, spec):
            embedding_group = part != "layers"
            if embedding_group:
                spec = sharded_spec(shape, spec, "pipe", sizes)
            if parallel.distributed_optimizer:
                spec = sharded_spec(shape, spec, optimizer_axis, sizes, join="pipe" if embedding_group else None)
            return spec

        return {part: jax.tree.map(lambda shape, spec, part=part: master(part, shape, spec), self.param_shapes[part],
                                   self.param_specs[part], is_leaf=lambda x: isinstance(x, tuple))
                for part in self.param_specs}

    def shardings(self, specs):
        """NamedShardings on the mesh of a tree of PartitionSpecs."""
        if self.mesh is None:
            raise ValueError("this Layout has no mesh: it holds specs, not shardings")
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))

    @cached_property
    def param_shardings(self) -> dict:
        return self.shardings(self.param_specs)

    @cached_property
    def master_shardings(self) -> dict:
        return self.shardings(self.master_specs)

    def optimizer_shardings(self, optimizer: optax.GradientTransformation):
        """The shardings of `optimizer`'s state (its own tree): each moment as its master weight (`master_specs`),
        what is not a moment (a step count) replicated."""
        abstract_params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), self.param_shapes,
                                       is_leaf=lambda x: isinstance(x, tuple))
        abstract_state = jax.eval_shape(optimizer.init, abstract_params)
        specs = optax.tree_map_params(optimizer, lambda _, spec: spec, abstract_state, self.master_specs,
                                      transform_non_params=lambda _: P())
        return self.shardings(specs)

    @cached_property
    def batch(self) -> dict:
        """A batch's {"inputs", "targets"} shardings (`sharding.batch_sharding`: rows over `data`, × `fsdp`)."""
        return {"inputs": batch_sharding(self.mesh), "targets": batch_sharding(self.mesh)}

    @cached_property
    def replicated(self) -> NamedSharding:
        """A scalar or any array every device holds whole (a key, a loss, the step count)."""
        return NamedSharding(self.mesh, P())

    @cached_property
    def per_device(self) -> NamedSharding:
        """A vector of one element per device (mesh.size long), split over every mesh axis: each device its own."""
        return NamedSharding(self.mesh, P(self.mesh.axis_names))


HOST = "pinned_host"  # the memory kind of what a run holds in host memory (jaxseq/offload.py's too)


def held(shardings, host: bool):
    """`shardings` in host memory (`HOST`) where `host` (the train state under `offload_optimizer`), else as given."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings) if host else shardings


def on_device(tree):
    """Inside a jitted function: each array of `tree` that is in host memory (the train state's params under
    `offload_optimizer`) copied to the device; the rest as they are. For the programs that read the state between
    steps (evaluation, sampling)."""
    host = lambda a: jax.typeof(a).memory_space == jax.memory.Space.Host
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device) if host(a) else a, tree)


def restorable(sharding: NamedSharding, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """`sharding` on `mesh` for an array of `shape` saved under another layout, every dimension that its mesh axes
    do not divide replicated (a saved padding may not divide the new mesh). A spec entry names one mesh axis or
    several (the distributed optimizer's ("data", "context") under context parallelism, the embedding group's
    ("pipe", "data") under a pipeline): the dimension is split over their product."""
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for i, entry in enumerate(spec):
        if shape[i] % math.prod(mesh.shape[a] for a in entry_axes(entry)):
            spec[i] = None
    return NamedSharding(mesh, P(*spec), memory_kind=sharding.memory_kind)  # the state's memory (`held`) kept
