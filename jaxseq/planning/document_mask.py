"""What the document mask (`plan --document-mask`, `ModelConfig.document_mask`) costs a layout, per device, and the
ring's attention it can skip: the plan's note beside its rows, whose programs are compiled with the mask (their
stored bytes and working memory hold what it adds).

- the segment ids and in-document positions (int32 each: 8 bytes a token) of each micro-batch a device holds, split
  over `context` as the tokens are: 8·b·s/c bytes (the whole step's micro-batches under a pipeline, whose stages hold
  them all);
- the mask a layer makes of them, a transient: explicit and XLA's fused attention a dense [b, s/c, s] bool (every
  layer makes it again: it is in the compiled step's working memory, not stored); the ring a [b, rows, s/2c] bool per
  query tile of a block;
- the ring's blocks: each rank computes 2c + 1 of (s/2c)² a layer, two on the diagonal (every token sees itself) and
  2c − 1 full ones, which it skips where no document spans the two chunks (`documents.spans`, for every row it
  holds): at most (2c − 1)/(2c + 1) of its attention core, reached where documents are shorter than s/2c tokens.
  Seven GEMMs a block (QKᵀ and P·V; the backward's QKᵀ again, dP, dQ, dK, dV: `kernel_time.ring_block`).
"""

from __future__ import annotations

import math

from jaxseq.config import ModelConfig
from jaxseq.parallel.context import QUERY_TILE
from jaxseq.planning import kernel_time

SEGMENT_BYTES_PER_TOKEN = 8  # the segment id and the position in its document, int32 each


def costs(cfg: ModelConfig, micro_batch: int, tensor: int, context: int = 1, strategy: str = "all-gather",
          microbatches_held: int = 1) -> dict:
    """Per device: the segment ids' bytes held (`microbatches_held` micro-batches' worth), the layer's transient mask
    bytes, and under the ring its blocks and the attention FLOPs per layer (forward + backward) it can skip."""
    b, s, c = micro_batch, cfg.seq_len, context
    out = {"segment_ids_bytes": SEGMENT_BYTES_PER_TOKEN * b * s // c * microbatches_held,
           "mask_bytes_per_layer": b * (s // c) * s, "ring_blocks_per_layer": None, "ring_skippable_blocks": None,
           "ring_skippable_flops_per_layer": None}
    if c > 1 and strategy == "ring":
        n = s // (2 * c)
        forward, backward = kernel_time.ring_block(cfg, b, tensor, c)
        block_flops = sum(g.flops for g in forward + backward)
        out.update(mask_bytes_per_layer=b * math.gcd(n, QUERY_TILE) * n, ring_blocks_per_layer=2 * c + 1,
                   ring_skippable_blocks=2 * c - 1, ring_skippable_flops_per_layer=(2 * c - 1) * block_flops)
    return out


def _size(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.2f} KiB"


def format_note(cost: dict) -> str:
    """The plan's line on the document mask (every figure per device, its unit and source said)."""
    line = (f"document mask (planning/document_mask.py), per device: segment ids and positions "
            f"{_size(cost['segment_ids_bytes'])} held (8 bytes a token); each layer's mask "
            f"{_size(cost['mask_bytes_per_layer'])} transient (in the compiled working memory above)")
    if cost["ring_blocks_per_layer"] is None:
        return line + "; attention skips nothing (its FLOPs above are the unmasked kernel's)"
    return (line + f"; the ring skips up to {cost['ring_skippable_blocks']} of its {cost['ring_blocks_per_layer']} "
            f"blocks a layer ({cost['ring_skippable_flops_per_layer'] / 1e12:.4f} TFLOP per layer, forward + "
            "backward), each full block no document spans: all of them where documents are shorter than s/2c tokens "
            "(the compiled FLOPs above count every block)")
