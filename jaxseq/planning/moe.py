"""The plan's mixture-of-experts terms (`plan --expert E`): total against active parameters, the state per device with
the routed experts split over `expert`, and the all-to-all bytes and time of a MoE layer.

Parameters: counted from the family's table (`models.model.num_params`); a token computes with all but the routed
experts it is not sent to, so active = total − routed · (E − k)/E.

All-to-all, per MoE layer, per pass, per rank: one to dispatch and one to combine (models/experts.py), each
[E, C, h] in the compute dtype, C the capacity of a rank's group of T = b·s/c tokens (`experts.capacity`; dropless:
C = T); backward sends the same again (their transposes). Each tensor rank sends its own copy (the tokens are
whole over `tensor`). Of each buffer the share bound for the other ep − 1 expert ranks leaves the GPU: over NVLink
to those in its node, over InfiniBand to the rest (the expert group's devices are context·tensor apart, mesh.py),
the two links at once, the slower one the time. Data-sheet bandwidths (hardware.py), not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxseq.config import ModelConfig
from jaxseq.hardware import Hardware
from jaxseq.models import experts, model
from jaxseq.planning import memory

GB = 1e9


@dataclass(frozen=True)
class Parameters:
    total: int  # every trainable parameter (the vocabulary unpadded)
    routed: int  # the routed experts' (all layers)
    active: int  # those one token computes with: total − routed · (E − k)/E


def parameters(cfg: ModelConfig) -> Parameters:
    total = model.num_params(cfg)
    routed = cfg.layers * cfg.moe_experts * 3 * cfg.hidden * cfg.mlp_hidden  # gate, up [h, f]; down [f, h]
    return Parameters(total, routed, total - routed * (cfg.moe_experts - cfg.moe_top_k) // cfg.moe_experts)


def all_to_all_elements(cfg: ModelConfig, tokens: int) -> int:
    """Elements one rank's two all-to-alls of a MoE layer move in one pass, for a routing group of `tokens`."""
    return 2 * cfg.moe_experts * experts.capacity(tokens, cfg) * cfg.hidden


@dataclass(frozen=True)
class AllToAll:
    bytes_per_pass: int  # one rank's dispatch + combine buffers of one MoE layer, one pass
    nvlink_bytes: int  # of those, what goes to expert ranks in its node
    infiniband_bytes: int  # and to expert ranks in other nodes
    seconds_per_pass: float  # the slower of the two links

    def step_seconds(self, layers: int, microbatches: int) -> float:
        """Forward and backward, every MoE layer, every micro-batch (no overlap with compute assumed)."""
        return 2 * layers * microbatches * self.seconds_per_pass


def all_to_all(cfg: ModelConfig, tokens: int, expert: int, span: int, hw: Hardware) -> AllToAll:
    """One rank's all-to-all traffic for a group of `tokens`, over `expert` ranks `span` devices apart
    (context · tensor): a node holds max(1, gpus_per_node // span) of them."""
    total = all_to_all_elements(cfg, tokens) * cfg.itemsize
    in_node = min(expert, max(1, hw.gpus_per_node // span))
    nvlink = total * (in_node - 1) // expert
    infiniband = total * (expert - in_node) // expert
    seconds = max(nvlink / (hw.intra_node_gb_per_s * GB), infiniband / (hw.inter_node_gb_per_s * GB))
    return AllToAll(total, nvlink, infiniband, seconds)


def state_bytes(cfg: ModelConfig, tensor: int, expert: int) -> memory.State:
    """The whole model's state per device with the routed experts split over `expert` (`memory.state_bytes`)."""
    return memory.state_bytes(cfg, tensor, expert=expert)


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps them ≥ 1 (a tiny model's too)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def report(cfg: ModelConfig, *, tensor: int, expert: int, context: int, micro_batch: int, microbatches: int,
           hw: Hardware) -> str:
    """The plan's MoE lines: parameters, the state per device at E = 1 and E, the all-to-all per layer and step."""
    p = parameters(cfg)
    tokens = micro_batch * cfg.seq_len // context
    a2a = all_to_all(cfg, tokens, expert, context * tensor, hw)
    one, split = state_bytes(cfg, tensor, 1), state_bytes(cfg, tensor, expert)
    dropless = "dropless" if cfg.moe_capacity_factor is None else f"capacity factor {cfg.moe_capacity_factor}"
    return "\n".join([
        f"Mixture of experts: E = {cfg.moe_experts} experts, top-{cfg.moe_top_k}, {dropless}, over expert = {expert} "
        f"ranks (tensor = {tensor}, context = {context})",
        f"  parameters (the family's table): {p.total:,} total, {p.active:,} active per token, {p.routed:,} in "
        "routed experts",
        f"  state per device (fp32 master, gradients, Adam moments, {cfg.dtype} copy; planning/memory.py): "
        f"{_size(one.total)} at expert = 1, {_size(split.total)} at expert = {expert}",
        f"  all-to-all per MoE layer per pass per rank (dispatch + combine, T = {tokens} tokens, "
        f"C = {experts.capacity(tokens, cfg)} slots): {_size(a2a.bytes_per_pass)}, of which "
        f"{_size(a2a.nvlink_bytes)} over NVLink ({hw.intra_node_gb_per_s:.0f} GB/s) and "
        f"{_size(a2a.infiniband_bytes)} over InfiniBand ({hw.inter_node_gb_per_s:.0f} GB/s) on "
        f"{hw.name}s: {a2a.seconds_per_pass * 1e3:.3f} ms (data-sheet bandwidth)",
        f"  a step's all-to-alls (L = {cfg.layers} layers × forward and backward × m = {microbatches} "
        f"micro-batches, not overlapped with compute): {a2a.step_seconds(cfg.layers, microbatches) * 1e3:.2f} ms",
    ])
