"""Host memory as a planned tier (jaxseq/offload.py): the bytes a configuration keeps in host memory per device, what
crosses PCIe each step, and its seconds at the node's PCIe bandwidth (`hardware.Hardware.pcie_gb_per_s`).

Activations: one layer's offloaded tensors are the formulas' per-tensor counts, by checkpoint name (`name_bytes`,
`models.formulas.layer_tensor_bytes`: the same terms whose sum the compiled programs hold `activation_bytes` to), so
a row keeps `bytes_per_layer` × the layers it holds in flight in host memory, and each micro-batch moves them out in
its forward and back in its backward: 2 × bytes per layer × the device's layers × micro-batches per step.
Optimizer state (`--offload-optimizer`): the float32 master weights and both Adam moments, copied to the device for
the update and back: 2 × their bytes per step.

The overlap assumption (`OVERLAP`): XLA issues an activation's copies asynchronously beside the layers' kernels
(the GPU program's copy-start/copy-done and asynchronous slices, planning/hlo_host.py), so a step is charged only
the PCIe time beyond its compute; the optimizer state's copies bracket the update (nothing runs beside them) and are
charged whole. Neither is measured yet (experiments/gpu.py measures them where a GPU is lent).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxseq.config import ModelConfig
from jaxseq.models.formulas import layer_tensor_bytes, moe_tensor_bytes
from jaxseq.offload import for_policy
from jaxseq.remat import (ATTN_DROPOUT_MASK, ATTN_OUT_DROPOUT_MASK, ATTN_PROBS, ATTN_PROBS_DROPOUT,
                          ATTN_SOFTMAX_STATS, CONTEXT, DECODER_LAYER_INPUT, KEY, MID_LAYER_RESIDUAL, MLP_ACTIVATION,
                          MLP_DROPOUT_MASK, MLPWI, MLPWI_INPUT, MOE_DISPATCHED, MOE_EXPERT_HIDDEN, MOE_EXPERT_OUTPUT,
                          MOE_LOADS, MOE_ROUTER_LOGITS, MOE_ROUTING, NORM_STATS, OUT_PROJ, QKV_INPUT, QUERY, VALUE,
                          layer_counts)

# Achieved fraction of PCIe's data-sheet bandwidth (stated, not fitted: the time model's link efficiency,
# search_space.LINK_EFFICIENCY); experiments/gpu.py measures the copy bandwidth where a GPU is lent.
PCIE_EFFICIENCY = 0.8
OVERLAP = ("activation copies overlap compute (XLA's asynchronous copies): a step is charged only the PCIe time "
           "beyond its compute; optimizer-state copies bracket the update and are charged whole")

# Each checkpoint name as `layer_tensor_bytes` terms (term, share): the per-layer bytes of the tensor it tags.
_TERMS: dict[str, tuple[tuple[str, float], ...]] = {
    DECODER_LAYER_INPUT: (("residual", 1),), QKV_INPUT: (("residual", 1),), MID_LAYER_RESIDUAL: (("residual", 1),),
    MLPWI_INPUT: (("residual", 1),), NORM_STATS: (("norm_stats", 2),),  # two norms
    QUERY: (("q", 1),), KEY: (("kv", 0.5),), VALUE: (("kv", 0.5),), ATTN_PROBS: (("probs", 1),),
    ATTN_OUT_DROPOUT_MASK: (("mask", 1),), MLP_DROPOUT_MASK: (("mask", 1),),
    MLPWI: (("mlp_in", 1),), MLP_ACTIVATION: (("mlp_mid", 1),),
    ATTN_SOFTMAX_STATS: (("ring_lse", 1),),  # cuDNN's float32 log-sum-exp: 4 bytes per local query head and token
}


# A mixture's MLP names as `moe_tensor_bytes` terms; its MLP input, gate/up and activation are its own there too.
_MOE_TERMS = {MOE_ROUTER_LOGITS: ("router_logits",), MOE_ROUTING: ("routing",), MOE_LOADS: ("loads",),
              MOE_DISPATCHED: ("dispatched",), MOE_EXPERT_HIDDEN: ("expert_hidden",),
              MOE_EXPERT_OUTPUT: ("expert_output",), MLPWI: ("shared_in",),
              MLP_ACTIVATION: ("expert_mid", "shared_mid")}


def name_bytes(cfg: ModelConfig, name: str, b: int, t: int, sequence_parallel: bool, context: int = 1,
               strategy: str = "all-gather") -> float:
    """Per-device bytes of the tensor one layer tags `name`, micro-batch b (`layer_tensor_bytes`' terms; a mixture's
    MLP `moe_tensor_bytes`', as `formulas.moe_activation_bytes` counts them)."""
    if cfg.moe_experts and (name in _MOE_TERMS or name == MLPWI_INPUT):
        moe = moe_tensor_bytes(cfg, b, t, context)
        if name == MLPWI_INPUT:  # kept whole but beside shared experts (`formulas.MOE_INPUT_KEPT`)
            return (layer_tensor_bytes(cfg, b, t, sequence_parallel, context)["residual"] if cfg.moe_shared_experts
                    else moe["moe_input"])
        return sum(moe[term] for term in _MOE_TERMS[name])
    tensors = layer_tensor_bytes(cfg, b, t, sequence_parallel, context)
    e = cfg.itemsize
    if name == ATTN_DROPOUT_MASK:  # 1 byte of the softmax's dropout, its output the other e
        return tensors["probs_dropout"] / (1 + e)
    if name == ATTN_PROBS_DROPOUT:
        return tensors["probs_dropout"] * e / (1 + e)
    if name == CONTEXT:  # the ring's log-sum-exp is tagged with its output
        return tensors["context"] + (tensors["ring_lse"] if context > 1 and strategy == "ring" else 0.0)
    if name == OUT_PROJ:  # the row-parallel projection's partial sums, before their reduction: [b, s/c, h]
        return e * cfg.seq_len * b * cfg.hidden / context
    return sum(tensors[term] * share for term, share in _TERMS[name])


def bytes_per_layer(cfg: ModelConfig, remat: str, names: tuple[str, ...], b: int, t: int, sequence_parallel: bool,
                    context: int = 1, strategy: str = "all-gather", chunk_layers: int | None = None) -> float:
    """Per-device bytes one layer keeps in host memory under remat spec `remat` with `names` offloaded: the names
    its policy stores; a block spec's layers each their own policy's, averaged over a chunk of `chunk_layers`."""
    chunk = chunk_layers or 1
    counts = layer_counts(remat, chunk) if chunk_layers else {remat: 1}
    return sum(n * sum(name_bytes(cfg, name, b, t, sequence_parallel, context, strategy)
                       for name in for_policy(policy, names)) for policy, n in counts.items()) / chunk


@dataclass(frozen=True)
class HostTier:
    """A configuration's host memory and PCIe traffic, per device."""

    host_bytes: float  # held in host memory at the step's peak: offloaded activations + optimizer state
    activation_pcie_bytes: float  # per step, both directions
    optimizer_pcie_bytes: float  # per step, both directions
    pcie_gb_per_s: float  # the node's, per direction (data sheet)

    @property
    def pcie_bytes(self) -> float:
        return self.activation_pcie_bytes + self.optimizer_pcie_bytes

    def seconds(self, efficiency: float = PCIE_EFFICIENCY) -> float:
        """Every byte at the per-direction bandwidth: the forward's copies out and the backward's copies in run at
        different times, the optimizer's in before its update and out after it."""
        return self.pcie_bytes / (self.pcie_gb_per_s * 1e9 * efficiency)

    def charged_seconds(self, compute_seconds: float, efficiency: float = PCIE_EFFICIENCY) -> float:
        """The seconds a step is charged under `OVERLAP`: activation copies beyond the step's compute, the
        optimizer's whole."""
        rate = self.pcie_gb_per_s * 1e9 * efficiency
        return max(0.0, self.activation_pcie_bytes / rate - compute_seconds) + self.optimizer_pcie_bytes / rate

    def to_json(self) -> dict:
        return {"host_bytes_per_device": self.host_bytes, "pcie_bytes_per_step": self.pcie_bytes,
                "pcie_seconds_per_step": self.seconds(), "pcie_gb_per_s": self.pcie_gb_per_s,
                "pcie_efficiency": PCIE_EFFICIENCY, "overlap": OVERLAP}


def host_tier(per_layer: float, in_flight_layers: float, device_layers: int, microbatches: int,
              optimizer_state_bytes: float, pcie_gb_per_s: float) -> HostTier:
    """The tier of a configuration: `per_layer` offloaded bytes (`bytes_per_layer`) × `in_flight_layers` held, moved
    out and back for each of the device's `device_layers` layers in each of `microbatches` micro-batches; and
    `optimizer_state_bytes` (0 without --offload-optimizer: the masters and moments per device), held and moved in
    and out once per step; PCIe at `pcie_gb_per_s` per direction (`hardware.Hardware.pcie_gb_per_s`)."""
    return HostTier(host_bytes=per_layer * in_flight_layers + optimizer_state_bytes,
                    activation_pcie_bytes=2 * per_layer * device_layers * microbatches,
                    optimizer_pcie_bytes=2 * optimizer_state_bytes, pcie_gb_per_s=pcie_gb_per_s)
