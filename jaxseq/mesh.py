"""The device mesh and the one table that maps logical axis names to mesh axes.

The model names its axes logically (`batch`, `heads`, `mlp`, `vocab`, `seq_sp`, …); only this module
knows that `heads` lives on the mesh axis `tensor`. Sequence parallelism is a change of one rule:
`seq_sp` (the sequence axis of the LayerNorm/dropout regions) maps to `tensor` instead of nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxseq.config import ConfigError, ParallelConfig

MESH_AXES = ("data", "tensor")


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A data × tensor mesh with Auto axes, so sharding constraints steer XLA's partitioner.

    Tensor ranks are the fastest-varying axis: consecutive devices (one host's GPUs) form a tensor
    group, data parallelism spans hosts, as the Megatron-LM papers recommend.
    """
    devices = jax.devices() if devices is None else list(devices)
    if parallel.num_devices != len(devices):
        raise ConfigError(
            f"data×tensor = {parallel.data}×{parallel.tensor} = {parallel.num_devices} "
            f"does not equal the device count {len(devices)}"
        )
    grid = np.asarray(devices, dtype=object).reshape(parallel.data, parallel.tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_rules(sequence_parallel: bool) -> dict[str, str | None]:
    """Logical axis → mesh axis. Axes not listed are replicated."""
    return {
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

    def spec(self, *axes: str | None) -> P:
        return logical_to_spec(axes, self.rules)

    def named(self, *axes: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*axes))

    def __call__(self, x: jax.Array, *axes: str | None) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(*axes))

    def gather_sequence(self, x: jax.Array) -> jax.Array:
        """[b, s/t, h] → [b, s, h]: Megatron's exit from the sequence-parallel region.

        An explicit all-gather (its transpose is a reduce-scatter). Why not a sharding constraint:
        then XLA stores the *gathered* tensor for backward; with the collective explicit, the stored
        tensor is the sequence-sharded input and backward all-gathers it again, as Megatron does.
        """
        if self.mesh is None or not self.sequence_parallel:
            return self(x, "batch", None, None)
        gather = jax.shard_map(
            lambda y: jax.lax.all_gather(y, "tensor", axis=1, tiled=True),
            mesh=self.mesh,
            in_specs=self.spec("batch", "seq_sp", None),
            out_specs=self.spec("batch", None, None),
            check_vma=False,  # all_gather's output is replicated over `tensor`; JAX cannot infer it
        )
        return gather(x)
