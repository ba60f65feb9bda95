"""The device mesh and the one table that maps logical axis names to mesh axes.

The model names its axes logically (`batch`, `heads`, `mlp`, `vocab`, `seq_sp`, …); only this module
knows that `heads` lives on the mesh axis `tensor`. Sequence parallelism is a change of one rule:
`seq_sp` (the sequence axis of the LayerNorm/dropout regions) maps to `tensor` instead of nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxseq.config import ConfigError, ParallelConfig

MESH_AXES = ("pipe", "data", "tensor")


def available_devices() -> list:
    """The accelerators, or the (simulated) CPU devices where there are none."""
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    return accelerators or jax.devices("cpu")


def parse_mesh(text: str, num_devices: int) -> tuple[int, int, int]:
    """'pipe=2,data=2,tensor=2' (pipe defaults to 1; data or tensor left out takes the remaining
    devices) → (pipe, data, tensor)."""
    axes = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in MESH_AXES or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh {text!r} is not valid; expected e.g. data=2,tensor=4 or pipe=2,data=2,tensor=2")
        axes[name.strip()] = int(value)
    pipe = axes.get("pipe", 1)
    if "data" not in axes:
        axes["data"] = max(num_devices // (pipe * axes.get("tensor", 1)), 1)
    if "tensor" not in axes:
        axes["tensor"] = max(num_devices // (pipe * axes["data"]), 1)
    return pipe, axes["data"], axes["tensor"]


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A pipe × data × tensor mesh with Auto axes, so sharding constraints steer XLA's partitioner.

    Tensor ranks are the fastest-varying axis: consecutive devices (one host's GPUs) form a tensor
    group, data parallelism spans hosts, pipeline stages are the slowest axis, as the Megatron-LM
    papers recommend (PTD-P: t within a node, then d, then p).
    """
    devices = jax.devices() if devices is None else list(devices)
    if parallel.num_devices != len(devices):
        raise ConfigError(
            f"pipe×data×tensor = {parallel.pipe}×{parallel.data}×{parallel.tensor} = {parallel.num_devices} "
            f"does not equal the device count {len(devices)}"
        )
    grid = np.asarray(devices, dtype=object).reshape(parallel.pipe, parallel.data, parallel.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_rules(sequence_parallel: bool, pipeline: bool = False) -> dict[str, str | None]:
    """Logical axis → mesh axis. Axes not listed are replicated. With a pipeline the stacked layers
    split over `pipe` in natural order (stage s holds the s-th block of L/p layers)."""
    return {
        "layers": "pipe" if pipeline else None,
        "batch": "data",
        "heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "seq_sp": "tensor" if sequence_parallel else None,
    }


def logical_to_spec(axes: tuple[str | None, ...], rules: dict[str, str | None]) -> P:
    return P(*(rules.get(a) if a is not None else None for a in axes))


@dataclass(frozen=True)
class Sharder:
    """Applies activation sharding constraints by logical axis names; a no-op without a mesh."""

    mesh: Mesh | None
    sequence_parallel: bool = False

    @property
    def rules(self) -> dict[str, str | None]:
        return logical_rules(self.sequence_parallel)

    @property
    def platform(self) -> str:
        """Where the program runs ("cpu", "gpu", "tpu"): the mesh's devices, the default backend without
        a mesh. The model writes its bf16 matmuls for it (`model.matmul`)."""
        return self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()

    def spec(self, *axes: str | None) -> P:
        return logical_to_spec(axes, self.rules)

    def named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*axes))

    def __call__(self, x: jax.Array, *axes: str | None) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(*axes))

    def column_parallel(self, fn, x: jax.Array, params, param_axes, out_axes: tuple):
        """fn(x, params) for a column-parallel linear whose input x is [b, s(/t), h].

        With sequence parallelism this is Megatron's exit from the sequence-parallel region, written
        as an explicit all-gather inside `shard_map` (its transpose is a reduce-scatter). Why not a
        sharding constraint: then XLA stores the *gathered* input for backward, and its backward
        all-reduces before scattering. Here the stored tensor is the sequence-sharded input, backward
        all-gathers it again and reduce-scatters the gradient, exactly as Megatron-LM does.
        """
        if self.mesh is None:
            return fn(x, params)
        if not self.sequence_parallel:
            return self(fn(self(x, "batch", None, None), params), *out_axes)
        local = lambda y, p: fn(jax.lax.all_gather(y, "tensor", axis=1, tiled=True), p)
        specs = jax.tree.map(lambda axes: self.spec(*axes), param_axes, is_leaf=lambda a: isinstance(a, tuple))
        return jax.shard_map(
            local, mesh=self.mesh, in_specs=(self.spec("batch", "seq_sp", None), specs), out_specs=self.spec(*out_axes)
        )(x, params)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """Vocab-parallel lookup of tokens [b, s] in table [V, h] (rows split over `tensor`) → [b, s(/t), h].

        Megatron's: each rank looks up the tokens that fall in its rows (zeros elsewhere) and the
        partial embeddings are all-reduced, or reduce-scattered along the sequence under sequence
        parallelism. Left to the partitioner, XLA all-gathers the whole table instead (V·h per step,
        and an all-reduce of its gradient)."""
        if self.mesh is None:
            return jnp.take(table, tokens, axis=0)
        return jax.shard_map(
            partial(vocab_parallel_lookup, sequence_parallel=self.sequence_parallel), mesh=self.mesh,
            in_specs=(self.spec("vocab", None), self.spec("batch", None)), out_specs=self.spec("batch", "seq_sp", None),
        )(table, tokens)


def vocab_parallel_lookup(table, tokens, sequence_parallel: bool):
    """One tensor rank's part of the vocab-parallel lookup (inside shard_map, manual over `tensor`): its
    rows' embeddings (zeros for other ids), all-reduced, or reduce-scattered along the sequence under SP."""
    rows = table.shape[0]
    ids = tokens - jax.lax.axis_index("tensor") * rows
    mine = (ids >= 0) & (ids < rows)
    x = jnp.where(mine[..., None], jnp.take(table, jnp.clip(ids, 0, rows - 1), axis=0), jnp.zeros((), table.dtype))
    if sequence_parallel:
        return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)
    return jax.lax.psum(x, "tensor")
