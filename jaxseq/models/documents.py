"""Documents packed into one sequence (`ModelConfig.document_mask`): which document each token is in and where in
it, read from the end-of-document tokens the data puts between documents (training/data.py).

A token attends only to the tokens of its own document before it, and its position (learned or RoPE) counts from
its document's first token, so a packed sequence computes what its documents would one by one. An end-of-document
token is the last token of the document it ends (as Megatron-LM's `--reset-attention-mask --reset-position-ids`
count it): the next token starts the next document. A row that starts inside a document holds that document's tail
as its first document, positions from 0.

Why segment ids and not a mask: they are 4 bytes a token, travel with the tokens (split over `context` as the
tokens are, with the micro-batches through a pipeline), and every attention makes its mask from them where it needs
it: a dense [b, s_q, s_k] one for explicit and XLA's fused attention, a block's for the ring, which skips a block
where no document spans it (`spans`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Documents(NamedTuple):
    """The packed documents of a batch's tokens, [..., s] int32 each, in the order the tokens are stored."""

    segments: jax.Array  # which document of its row each token is in: 0, 1, … (non-decreasing in natural order)
    positions: jax.Array  # each token's position in its document: 0 at its first token


def of_tokens(tokens, eod: int) -> Documents:
    """The documents of `tokens` [..., s] (natural order), each ended by the token `eod`."""
    ends = tokens == eod
    segments = jnp.cumsum(ends, axis=-1, dtype=jnp.int32) - ends.astype(jnp.int32)  # an end is its document's
    index = jax.lax.broadcasted_iota(jnp.int32, tokens.shape, tokens.ndim - 1)
    follows_end = jnp.concatenate([jnp.ones_like(ends[..., :1]), ends[..., :-1]], axis=-1)  # a document's first token
    first = jax.lax.cummax(jnp.where(follows_end, index, 0), axis=tokens.ndim - 1)
    return Documents(segments, index - first)


def split(docs: Documents | None, split_sequence) -> Documents | None:
    """`docs` in the tokens' stored order, as `split_sequence` (a Sharder's) stores tokens [b, s]."""
    return None if docs is None else Documents(*(split_sequence(a) for a in docs))


def same_document(q_segments, k_segments):
    """[b, s_q, s_k] bool: query i and key j are in the same document (q_segments [b, s_q], k_segments [b, s_k])."""
    return q_segments[:, :, None] == k_segments[:, None, :]


def spans(q_segments, k_segments):
    """Whether some query of a block sees some key of it by document, for a key chunk that wholly precedes the query
    chunk in natural order (the ring's full blocks): segments never decrease along a row, so only the last key and the
    first query can share a document. One bool for the block's rows (q_segments [b, n], k_segments [b, n], each in
    natural order within its chunk)."""
    return jnp.any(k_segments[:, -1] == q_segments[:, 0])
