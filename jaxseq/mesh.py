"""The device mesh and the one table that maps logical axis names to mesh axes.

The model names its axes logically (`batch`, `seq`, `heads`, `mlp`, `vocab`, `seq_sp`, …); only this module
knows that `heads` lives on the mesh axis `tensor`. Sequence parallelism is a change of one rule:
`seq_sp` (the sequence axis of the LayerNorm/dropout regions) maps to `tensor` instead of nothing. Context
parallelism is another: `seq` (the sequence everywhere) maps to `context`, and `seq_sp` to (`context`, `tensor`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from jaxseq.config import ConfigError, ParallelConfig

MESH_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
FSDP_AXIS = "fsdp"  # the weights' `embed` (hidden) dimension splits over it (`models.model.param_specs`)
EXPERT_AXIS = "expert"  # a mixture of experts' experts split over it; to the rest a data axis (models/experts.py)


def available_devices() -> list:
    """The accelerators, or the (simulated) CPU devices where there are none."""
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    return accelerators or jax.devices("cpu")


def use_host_devices(count: int | None) -> None:
    """Simulate `count` CPU devices where there is no accelerator (None: leave it as configured). Call it
    before anything asks for a device."""
    if count is None:
        return
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"--host-devices {count!r} must be a positive integer")
    jax.config.update("jax_num_cpu_devices", count)


def parse_mesh(text: str, num_devices: int) -> dict[str, int]:
    """'pipe=2,data=2,tensor=2', 'context=4,tensor=2', 'data=2,fsdp=4' or 'expert=4,data=2' (pipe, fsdp, expert and
    context default to 1; data or tensor left out takes the remaining devices) → {axis: size} for every axis of
    MESH_AXES."""
    axes = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in MESH_AXES or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh {text!r} is not valid; expected e.g. data=2,tensor=4, pipe=2,data=2,tensor=2, "
                              "context=4,tensor=2 or fsdp=8 (axes: " + ", ".join(MESH_AXES) + ")")
        axes[name.strip()] = int(value)
    fixed = axes.get("pipe", 1) * axes.get("fsdp", 1) * axes.get("expert", 1) * axes.get("context", 1)
    if "data" not in axes:
        axes["data"] = max(num_devices // (fixed * axes.get("tensor", 1)), 1)
    if "tensor" not in axes:
        axes["tensor"] = max(num_devices // (fixed * axes["data"]), 1)
    return {name: axes.get(name, 1) for name in MESH_AXES}


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A pipe × data × fsdp × expert × context × tensor mesh with Auto axes, so sharding constraints steer XLA's
    partitioner.

    Tensor ranks are the fastest-varying axis: consecutive devices (one host's GPUs) form a tensor
    group, data parallelism spans hosts, pipeline stages are the slowest axis, as the Megatron-LM
    papers recommend (PTD-P: t within a node, then d, then p). Context ranks sit between data and tensor
    (Megatron-LM's order, tp-cp-dp-pp from fastest): their K/V traffic every layer is the heavier. FSDP ranks
    sit between data and context: each layer gathers its weights over them, so they come before the replicas
    (HSDP: shard within a node, replicate across nodes; MaxText's data, fsdp, …, tensor order). Expert ranks sit
    between fsdp and context (Megatron-LM's tp-cp-ep-dp-pp): every MoE layer sends its tokens over them twice each
    pass (all-to-all), so they come inside the data and FSDP ranks.
    """
    devices = jax.devices() if devices is None else list(devices)
    if parallel.num_devices != len(devices):
        raise ConfigError(f"{parallel.mesh_text()} = {parallel.num_devices} devices does not equal the device count "
                          f"{len(devices)}")
    # Without context parallelism the mesh has no `context` axis at all: XLA:CPU (jax 0.10.2) fails to compile
    # a bf16 step with gradient accumulation on a mesh holding a size-1 `context` axis ("Invalid binary
    # instruction opcode copy"), and nothing names the axis then (`logical_rules`, the regions of
    # `parallel.data_parallel.region_axes`).
    # The same for a size-1 `fsdp` and `expert`: a mesh holds them only where they split something.
    sizes = axis_sizes(parallel)
    names = tuple(name for name in MESH_AXES if name not in ("fsdp", "expert", "context") or sizes[name] > 1)
    grid = np.asarray(devices, dtype=object).reshape([sizes[name] for name in names])
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def axis_sizes(parallel: ParallelConfig) -> dict[str, int]:
    """{mesh axis: size} of every axis of MESH_AXES, 1 where the mesh has none."""
    return {name: getattr(parallel, name) for name in MESH_AXES}


def mesh_parallel(mesh: Mesh, sequence_parallel: bool = False) -> ParallelConfig:
    """The ParallelConfig a pipe × data × fsdp × expert × context × tensor mesh describes."""
    return ParallelConfig(**{name: mesh.shape.get(name, 1) for name in MESH_AXES},
                          sequence_parallel=sequence_parallel)


def batch_axes(fsdp: bool, expert: bool = False) -> str | tuple[str, ...]:
    """The mesh axes a batch's rows split over: `data`, and `fsdp` and `expert` (whose ranks are data ranks to the
    activations) inside each data rank's rows, where the mesh has them."""
    axes = ("data",) + (("fsdp",) if fsdp else ()) + ((EXPERT_AXIS,) if expert else ())
    return axes if len(axes) > 1 else "data"


def logical_rules(sequence_parallel: bool, pipeline: bool = False, context: bool = False, fsdp: bool = False,
                  expert: bool = False) -> dict:
    """Logical axis → mesh axis (or axes). Axes not listed are replicated. With a pipeline the stacked layers
    split over `pipe` in natural order (stage s holds the s-th block of L/p layers). With context parallelism
    the sequence splits over `context` everywhere, and under SP each context rank's part further over `tensor`.
    With FSDP the batch's rows split over data × fsdp; the weights' `embed` axis (their hidden dimension) maps
    to `fsdp` in their stored specs alone (`models.model.param_specs`): the layers compute with them gathered.
    With expert parallelism the batch's rows split over `expert` too, and a mixture of experts' experts over it."""
    seq_sp = "tensor" if sequence_parallel else None
    if context:
        seq_sp = ("context", "tensor") if sequence_parallel else "context"
    return {
        "layers": "pipe" if pipeline else None,
        "batch": batch_axes(fsdp, expert),
        "experts": EXPERT_AXIS if expert else None,
        "heads": "tensor",
        "kv_heads": "tensor",  # where kv_heads divides by t; a family replicates them otherwise
        "mlp": "tensor",
        "vocab": "tensor",
        "seq": "context" if context else None,
        "seq_sp": seq_sp,
    }


def logical_to_spec(axes: tuple[str | None, ...], rules: dict[str, str | None]) -> P:
    return P(*(rules.get(a) if a is not None else None for a in axes))
