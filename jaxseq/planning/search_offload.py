"""`plan --search --offload`: host memory as a choice beside recompute, block recompute, tensor and pipeline
parallelism (opt-in, as `--block-recompute` is). For each configuration that does not fit the budget as it is, its
offloaded variants (`offloaded`): everything its remat policy stores in host memory (`--offload all`), the optimizer
state (`--offload-optimizer`), and both where both are asked, composed from its evaluation without compiling anything:
the offloaded activations (`host_tier.bytes_per_layer` × the layers in flight) out of the device's memory, and the
masters and moments out of the state during the layer loops (the update holds them on the device: the state after
the loops stays); its step time plus the PCIe seconds `host_tier.OVERLAP` charges at the node's PCIe bandwidth
(`hardware.Hardware.pcie_gb_per_s` × the link efficiency). Ranked with the rest by that time.
"""

from __future__ import annotations

from dataclasses import replace

from jaxseq.config import ModelConfig
from jaxseq.models.model import tagged_names
from jaxseq.offload import ALL, resolve
from jaxseq.planning import host_tier
from jaxseq.planning.costs import Costs, costs_of, run_kernels
from jaxseq.planning.search_space import Request
from jaxseq.remat import block_spec


def variants(r: Request) -> list[tuple[bool, bool]]:
    """The variants a request tries, (activations, optimizer state): each alone, and both where both are asked."""
    out = [(True, False)] if r.offload else []
    out += [(False, True)] if r.offload_optimizer else []
    return out + ([(True, True)] if r.offload and r.offload_optimizer else [])


def offloaded(cfg: ModelConfig, r: Request, evaluated: list, costs: Costs, evaluate_at) -> list:
    """The offloaded variants (`variants`) of every evaluated configuration that does not fit under a plain policy
    that stores something, each evaluated at its memory and time (`evaluate_at`, the search's)."""
    out = []
    for e in evaluated:
        c = e.candidate
        if e.fits or block_spec(c.remat) is not None or c.offload or c.offload_optimizer:
            continue
        kernels = run_kernels(cfg, c)
        names = resolve(ALL, c.remat, tagged_names(kernels))
        per_layer = host_tier.bytes_per_layer(kernels, c.remat, names, c.micro_batch, c.tensor, c.sequence_parallel,
                                              c.context, c.context_strategy)
        state = costs_of(cfg, c, costs)[1]
        for activations, optimizer in variants(r):
            held = 3 * state.master_bytes if optimizer else 0.0  # the masters and both Adam moments
            moved = per_layer if activations else 0.0
            if not moved and not held:
                continue
            tier = host_tier.host_tier(moved, e.memory.in_flight_layers, cfg.layers // c.pipe, c.microbatches, held,
                                       r.hardware.pcie_gb_per_s)
            memory = replace(e.memory, state_bytes=e.memory.state_bytes - held,
                             activation_bytes=e.memory.activation_bytes - moved * e.memory.in_flight_layers,
                             host_bytes=tier.host_bytes)
            time = replace(e.time, pcie_s=tier.charged_seconds(e.time.compute_s, r.time_model.link_efficiency))
            variant = replace(c, offload=activations, offload_optimizer=optimizer)
            out.append(evaluate_at(cfg, r, variant, memory, time, e.layer_context))
    return out
