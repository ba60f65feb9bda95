"""Context parallelism: the whole sequence split over the mesh axis `context`, attention included.

Every token-wise part of a layer runs unchanged on a rank's s/c tokens (the logical axis `seq` maps to
`context`, `mesh.logical_rules`); attention needs the keys and values of the whole causal prefix. Two
strategies, equal in result (`ParallelConfig.context_strategy`):

- "all-gather": K and V gathered over `context` before attention (`gather_over_context`), then the model's
  own attention over the whole sequence (`models.ops.causal_attention`), queries split over `context`. The
  gathered K/V are a custom_vjp's output that no remat policy names: never stored, gathered again in backward;
  dK/dV go back to their owners as a reduce-scatter. Both attention implementations (explicit; fused with a
  dense mask of global positions).
- "ring": K/V blocks passed rank to rank with `ppermute` in c steps, each step's partial output merged with a
  running log-sum-exp, under a custom_vjp whose backward sends dK/dV around the ring with their blocks and
  recomputes each block against the global log-sum-exp (`jax.nn.dot_product_attention`'s log-sum-exp is not
  differentiable, so merging its blocks under autodiff would give wrong gradients). It computes its blocks
  itself (flash-style: no scores stored; a block's query rows `QUERY_TILE` at a time, so that one tile's scores
  are alive, not the block's), whatever `ModelConfig.attention` says, at FlashAttention-2's
  precision: every block product takes the model's dtype and accumulates in float32 (the probabilities and their
  gradient cast before their products, as explicit attention casts its probabilities); the scores, the running
  output and the log-sum-exp are float32. In bf16, float32 operands would run as TF32 on a GPU, at half the rate.

Load balance (`sharding.context_chunks`): the sequence in 2c chunks, rank r holding chunks r and 2c−1−r, so a
ring step is a diagonal block or half a block on every rank (`ring_plan`, `attention_work`). The families only
call `models.ops.attention`; the Sharder a run builds here (`sharder`) carries the strategy to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq import remat
from jaxseq.models import documents, ops
from jaxseq.parallel.region import StageSharder
from jaxseq.sharding import Sharder, context_chunks, entry_axes, spec_axes

FULL, DIAG, EMPTY = "full", "diag", "empty"  # a query chunk against a key chunk: all visible, causal, none
# Query rows of a ring block computed at once (the largest power of two dividing s/2c, up to this): a block's float32
# scores and their gradients are [b, kv, g, rows, s/2c], not (s/2c)², at s = 128k and c = 8 an eighth.
QUERY_TILE = 1024


def sharder(mesh, parallel: ParallelConfig, stage: bool = False) -> Sharder:
    """The run's Sharder (a `StageSharder` inside a region manual over `data`), carrying the context strategy."""
    cls = StageSharder if stage else Sharder
    attend = partial(attention, strategy=parallel.context_strategy) if parallel.context > 1 else None
    return cls(mesh, parallel.sequence_parallel, attend)


def attention(q, k, v, cfg: ModelConfig, key, shard: Sharder, strategy: str):
    """Causal attention of q [b, s, a, d] (s split over `context`, stored in `shard.reorder` order) over the
    whole causal prefix in k, v [b, s, kv, d] (split the same way; a rank's local K/V heads only)."""
    if strategy == "ring":
        return ring_attention(q, k, v, cfg, key, shard)
    k, v = gather_over_context(k, shard), gather_over_context(v, shard)
    order = shard.reorder(q.shape[1])
    if shard.context_manual:  # one rank's queries against the gathered whole sequence's keys
        order = (order, shard.whole_order(k.shape[1]))
    return ops.tagged_context(ops.causal_attention(q, k, v, cfg, key, shard, order, _segments(shard)), shard)


def _segments(shard: Sharder):
    """(the queries' segment ids, the gathered keys') of packed documents (`shard.documents`), or None. Inside a
    region manual over `context` the keys' are every rank's, gathered as K and V are (4 bytes a token)."""
    if shard.documents is None:
        return None
    mine = shard.documents.segments
    if not shard.context_manual:
        return mine, mine
    return mine, jax.lax.all_gather(mine, "context", axis=1, tiled=True)


def gather_over_context(x, shard: Sharder):
    """x [b, s, heads, d] split over `context` → the same, whole on every context rank (its tensor rank's heads).

    A custom_vjp so that the gathered tensor is a value of its own: remat policies never name it, so backward
    gathers again instead of storing it (Megatron-LM's choice: s·d·heads bytes per layer is what context
    parallelism is there to avoid), and its backward hands each rank its part of the summed gradient (the
    partitioner's all-reduce + slice, a reduce-scatter on GPU). The forward is a shard_map of its own, so this
    also works inside a region already manual over `data`. Inside a region manual over `context` too
    (`StageSharder`), the gather and the reduce-scatter are written there directly."""
    if shard.context_manual:
        return _gather_in_region(x, shard)
    split, whole = shard.spec("batch", "seq", "heads", None), shard.spec("batch", None, "heads", None)
    gather = jax.shard_map(lambda y: jax.lax.all_gather(y, "context", axis=1, tiled=True), mesh=shard.map_mesh,
                           in_specs=split, out_specs=whole, axis_names=_axes(split),
                           check_vma=False)  # an all_gather's result is typed varying, though equal on every rank

    outer = jax.typeof(x).mat.varying - _axes(split)  # manual axes of an enclosing region (`data`) x varies over

    @jax.custom_vjp
    def gathered(x):
        return _vary(gather(x), outer)

    gathered.defvjp(lambda x: (gathered(x), None),
                    lambda _, g: (_vary(shard(g, "batch", "seq", "heads", None), outer),))
    return gathered(x)


def _gather_in_region(x, shard: Sharder):
    """`gather_over_context` inside a region manual over `context`: x [b, s/c, heads, d] → [b, s, heads, d]. The
    gather and its backward's reduce-scatter run in nested shard_maps manual over `tensor` too (over every
    axis, then): left with `tensor` automatic, XLA:CPU aborted compiling the bfloat16 reduce-scatter ("Invalid
    binary instruction opcode copy", its all-reduce promotion)."""
    spec = shard.spec("batch", None, "heads", None)
    nested = partial(jax.shard_map, mesh=shard.map_mesh, in_specs=spec, out_specs=spec,
                     axis_names=set(shard.manual_axes))
    gather = nested(lambda y: jax.lax.all_gather(y, "context", axis=1, tiled=True))
    scatter = nested(lambda g: jax.lax.psum_scatter(g, "context", scatter_dimension=1, tiled=True))

    @jax.custom_vjp
    def gathered(x):
        return gather(x)

    gathered.defvjp(lambda x: (gather(x), None), lambda _, g: (scatter(g),))
    return gathered(x)


def _vary(x, axes):
    """x typed as varying over `axes` too (pcast of an axis it already varies over raises)."""
    missing = tuple(sorted(set(axes) - set(jax.typeof(x).mat.varying)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _axes(spec: P) -> set[str]:
    """The mesh axes a spec splits over: a shard_map manual over exactly these sees each device's block (left
    Auto, XLA was seen replicating the block over them first)."""
    return set(spec_axes(spec))


# ---------------------------------------------------------------------------------------------
# The ring


def _relation(q_chunk: int, k_chunk: int) -> str:
    return FULL if k_chunk < q_chunk else DIAG if k_chunk == q_chunk else EMPTY


def ring_plan(chunks) -> tuple:
    """plan[r][i][a][b]: how rank r's query half a sees key half b of the K/V block it holds at ring step i
    (rank (r − i) mod c's), for ranks holding `chunks[r]` (two chunk ids of 2c each)."""
    c = len(chunks)
    return tuple(tuple(tuple(tuple(_relation(qc, kc) for kc in chunks[(r - i) % c]) for qc in chunks[r])
                       for i in range(c)) for r in range(c))


def attention_work(chunks) -> list[int]:
    """Query-chunk × key-chunk blocks (s/2c × s/2c each) each rank computes over the ring: 2c + 1 on every rank
    with Megatron's chunks, 4r + 3 on rank r of a contiguous split."""
    return [sum(rel != EMPTY for step in rank for row in step for rel in row) for rank in ring_plan(chunks)]


def ring_attention(q, k, v, cfg: ModelConfig, key, shard: Sharder):
    """The ring strategy of `attention` (see the module's docstring)."""
    c, s = shard.context, shard.seq_length(q.shape[1])
    rate = cfg.dropout if key is not None else 0.0
    key_data = jax.random.key_data(key) if rate else jnp.zeros((2,), jnp.uint32)
    # The first batch row this rank holds (inside a region manual over `data`): read out here, since an outer
    # axis's index inside the nested shard_map does not lower.
    row0 = shard.first_row(q.shape[0]) if shard.rows_manual else 0
    key_data = jnp.concatenate([key_data, jnp.asarray(row0, jnp.uint32)[None]])
    static = dict(chunks=context_chunks(c), scale=1.0 / math.sqrt(cfg.head_dim), rate=rate, s=s)
    # With packed documents, this rank's segment ids [b, s/c] (stored order) ride along: the blocks' masks, and
    # the full blocks no document spans skipped.
    segments = () if shard.documents is None else (shard.documents.segments,)
    if shard.context_manual:
        # Already one context rank's tokens: the ring runs here, its heads left to the partitioner (global over
        # `tensor`). A nested shard_map over `tensor` failed to lower in this region (a value it closed over
        # was given a `context` sharding).
        forward = partial(_ring_forward, **static, tensor=1, data=())
        backward = partial(_ring_backward, **static, tensor=1, data=())
    else:
        seq, lse_spec = shard.spec("batch", "seq", "heads", None), shard.spec("batch", "heads", None, "seq")
        tokens = (shard.spec("batch", "seq"),) * len(segments)
        static.update(tensor=shard.tensor, data=tuple(a for a in ("data", "fsdp") if a in _axes(seq)))
        nested = partial(jax.shard_map, mesh=shard.map_mesh, axis_names=_axes(seq))
        forward = nested(partial(_ring_forward, **static), in_specs=(seq, seq, seq, P(), *tokens),
                         out_specs=(seq, lse_spec))
        backward = nested(partial(_ring_backward, **static), in_specs=(seq, seq, seq, seq, lse_spec, seq, P(), *tokens),
                          out_specs=(seq, seq, seq))

    @jax.custom_vjp
    def ring(q, k, v, key_data, *segments):
        return shard(forward(q, k, v, key_data, *segments)[0], "batch", "seq", "heads", None)

    def ring_fwd(q, k, v, key_data, *segments):
        out, lse = forward(q, k, v, key_data, *segments)
        # Tagged inside the forward rule, so the policies that keep the attention context keep these too; the
        # output the model goes on with is the one backward keeps (`ops.tagged_context`: one tensor, not two).
        out, lse = ops.tagged_context(out, shard), checkpoint_name(lse, remat.CONTEXT)
        return out, (q, k, v, key_data, out, lse, segments)

    def ring_bwd(res, g):
        q, k, v, key_data, out, lse, segments = res
        return (*backward(q, k, v, out, lse, g, key_data, *segments), None, *(None for _ in segments))

    ring.defvjp(ring_fwd, ring_bwd)
    return ring(q, k, v, key_data, *segments)


def _pass_on(x, c: int):
    return jax.lax.ppermute(x, "context", [(j, (j + 1) % c) for j in range(c)])


def _varying(x, *like):
    """x typed as varying over `context` and every manual axis the arrays `like` vary over (the ring's
    accumulators: they take values computed from those)."""
    return _vary(x, {"context"}.union(*(jax.typeof(a).mat.varying for a in like)))


def _by_pattern(plan, step: int, make_branch, *operands):
    """The step's branch for this rank's pattern (one traced branch per distinct pattern of the step)."""
    column = [plan[r][step] for r in range(len(plan))]
    patterns = sorted(set(column))
    if len(patterns) == 1:
        return make_branch(patterns[0])(*operands)
    index = jnp.asarray([patterns.index(p) for p in column], jnp.int32)[jax.lax.axis_index("context")]
    return jax.lax.switch(index, [make_branch(p) for p in patterns], *operands)


class _Blocks:
    """One rank's view inside the ring's shard_map: its query halves and the geometry of a block."""

    def __init__(self, q, k, chunks, scale, rate, s, tensor, data, key_data, segments=None):
        self.b, two_n, self.a, self.d = q.shape
        self.n, self.kv = two_n // 2, k.shape[2]
        self.g = self.a // self.kv
        self.rows = math.gcd(self.n, QUERY_TILE)  # query rows of a block computed at once
        self.tiles = self.n // self.rows
        self.chunks, self.scale, self.rate, self.s, self.tensor = chunks, scale, rate, s, tensor
        self.key = jax.random.wrap_key_data(key_data[:2]) if rate else None
        # the first batch row here: this map's own data (× fsdp) rank's, or the enclosing manual region's
        self.row0 = jax.lax.axis_index(data).astype(jnp.uint32) * self.b if data else key_data[2]
        self.rank = jax.lax.axis_index("context")
        # Packed documents: this rank's segment ids as halves [b, 2, n], and every rank's [c, b, 2, n] (4 bytes a
        # token, gathered once: the key halves' ids as their K/V blocks come round).
        self.documents = segments is not None
        if self.documents:
            self.segments = segments.reshape(self.b, 2, self.n)
            self.all_segments = jax.lax.all_gather(self.segments, "context")

    def key_segments(self, rank, half):
        """[b, n]: the segment ids of key half `half` of the K/V block rank `rank` holds (None without documents)."""
        if not self.documents:
            return None
        return jax.lax.dynamic_index_in_dim(self.all_segments, rank, 0, keepdims=False)[:, half]

    def query_segments(self, half):
        """[b, n]: the segment ids of this rank's query half `half` (None without documents)."""
        return self.segments[:, half] if self.documents else None

    def spanned(self, rel, q_segments, k_segments):
        """Whether a block of relation `rel` has a query that sees a key of it: always without documents or on a
        diagonal (each token sees itself); a full block (keys wholly before the queries) only where a document
        spans the two chunks (`documents.spans`). None: always, statically."""
        if not self.documents or rel != FULL:
            return None
        return documents.spans(q_segments, k_segments)

    def halves(self, x, heads):  # [b, 2n, heads…, d] → [b, 2, n, heads…, d]
        return x.reshape(self.b, 2, self.n, *heads, self.d)

    def positions(self, rank, half):
        return jnp.asarray(self.chunks, jnp.int32)[rank, half] * self.n + jnp.arange(self.n)

    def scores(self, qh, kh, rel, row0=0, q_segments=None, k_segments=None):
        """float32 scale·q·kᵀ [b, kv, g, rows, n] of query rows row0… of a half against one key half, causal on a
        diagonal; with packed documents (the rows' and the keys' segment ids [b, rows], [b, n]) within each
        document."""
        scores = jnp.einsum("bqkgd,bskd->bkgqs", qh, kh, preferred_element_type=jnp.float32) * self.scale
        # The rows (and segment ids) pass an optimization barrier with the queries: the mask is the same in every
        # layer, and JAX's partial evaluation of the layer scan moved it out of the loop, made for every query tile
        # of the block at once.
        if q_segments is not None:
            (q_segments, k_segments), _ = jax.lax.optimization_barrier(((q_segments, k_segments), qh))
            same = q_segments[:, None, None, :, None] == k_segments[:, None, None, None, :]
            scores = jnp.where(same, scores, -jnp.inf)
        if rel != DIAG:
            return scores
        rows, _ = jax.lax.optimization_barrier((row0 + jnp.arange(qh.shape[1]), qh))
        return jnp.where(rows[:, None] >= jnp.arange(self.n)[None, :], scores, -jnp.inf)

    def by_tiles(self, x, axis: int = 1):
        """x's query axis (n rows, at `axis`) split into the block's tiles, leading: [tiles, …, rows, …]."""
        shape = (*x.shape[:axis], self.tiles, self.rows, *x.shape[axis + 1:])
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    def from_tiles(self, x, axis: int = 1):
        """The inverse of `by_tiles`: [tiles, …, rows, …] → the query axis of n rows at `axis`."""
        x = jnp.moveaxis(x, 0, axis)
        return x.reshape(*x.shape[:axis], self.n, *x.shape[axis + 2:])

    def kept(self, q_pos, k_pos):
        """The attention-probs dropout's kept/scaled factor for these positions: the elements of the mask the
        whole-sequence attention draws ([b, kv, g, s, s], `ops.bernoulli_at`), so the ring equals it."""
        shape = (self.b, self.kv, self.g, q_pos.shape[0], self.n)
        heads = jnp.arange(self.kv) + (jax.lax.axis_index("tensor") * self.kv if self.tensor > 1 else 0)
        coords = {1: heads, 3: q_pos, 4: k_pos}
        coords[0] = jnp.arange(self.b) + self.row0
        global_shape = (self.b, self.kv * self.tensor, self.g, self.s, self.s)
        keep = ops.bernoulli_at(self.key, 1.0 - self.rate, shape, coords, global_shape)
        return keep.astype(jnp.float32) / (1.0 - self.rate)


def _to_rows(x):  # [b, kv, g, n] → [b, n, kv, g, 1], to scale an output block row by row
    return jnp.moveaxis(x, -1, 1)[..., None]


def _over_tiles(blk: _Blocks, tile, carry, xs):
    """`tile(carry, xs)` over the block's query tiles (xs split by `_Blocks.by_tiles` beforehand): a scan, so that
    one tile's [b, kv, g, rows, n] scores are alive at a time. One or two tiles run as straight-line code: the
    plan measures a layer from a scan of 2 layers (`planning.measure.MEASURE_LAYERS`), and a loop of 2 tiles
    inside it was taken for a layer loop (XLA:CPU rewrote the program's layer loops around it)."""
    if blk.tiles > 2:
        return jax.lax.scan(tile, carry, xs)
    outs = []
    for i in range(blk.tiles):
        carry, out = tile(carry, jax.tree.map(lambda x: x[i], xs))
        outs.append(out)
    return carry, jax.tree.map(lambda *x: jnp.stack(x), *outs)


def _finite(lse):
    """lse with −∞ (a row no key of the block is visible to: packed documents) as 0, to subtract: exp(−∞ − 0) = 0."""
    return jnp.where(jnp.isneginf(lse), 0.0, lse)


def _forward_block(blk: _Blocks, qh, kh, vh, rel, q_pos, k_pos, q_segments=None, k_segments=None):
    """One block: its output [b, n, kv, g, d] and log-sum-exp [b, kv, g, n] (float32), its query rows a tile at a
    time; with packed documents (segment ids [b, n]) a row may see none of the block's keys: its output 0, its
    log-sum-exp −∞."""
    def tile(_, xs):
        q, row0, pos, segs = xs
        scores = blk.scores(q, kh, rel, row0, segs, k_segments)
        lse = jax.nn.logsumexp(scores, axis=-1)
        probs = jnp.exp(scores - (_finite(lse) if blk.documents else lse)[..., None])
        if blk.rate:
            probs = probs * blk.kept(pos, k_pos)
        return None, (jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(vh.dtype), vh,
                                 preferred_element_type=jnp.float32), lse)

    rows0 = jnp.arange(blk.tiles) * blk.rows
    segs = None if q_segments is None else blk.by_tiles(q_segments)
    _, (out, lse) = _over_tiles(blk, tile, None, (blk.by_tiles(qh), rows0, q_pos.reshape(blk.tiles, blk.rows), segs))
    return blk.from_tiles(out), blk.from_tiles(lse, 3)


def _backward_block(blk: _Blocks, qh, kh, vh, gh, lse, delta, rel, q_pos, k_pos, zeros, q_segments=None,
                    k_segments=None):
    """One block's dQ [b, n, kv, g, d] and dK, dV [b, n, kv, d] (float32), recomputed against the global
    log-sum-exp, its query rows a tile at a time (dK and dV summed over them)."""
    f32 = partial(jnp.einsum, preferred_element_type=jnp.float32)  # the model's dtype in, float32 accumulated

    def tile(carry, xs):
        dk, dv = carry
        q, g, lse_rows, delta_rows, row0, pos, segs = xs
        probs = jnp.exp(blk.scores(q, kh, rel, row0, segs, k_segments) - lse_rows[..., None])
        dprobs = f32("bqkgd,bskd->bkgqs", g, vh)
        dropped = probs
        if blk.rate:
            kept = blk.kept(pos, k_pos)
            dropped, dprobs = probs * kept, dprobs * kept
        dscores = (probs * (dprobs - delta_rows[..., None]) * blk.scale).astype(q.dtype)
        dk = dk + f32("bkgqs,bqkgd->bskd", dscores, q)
        dv = dv + f32("bkgqs,bqkgd->bskd", dropped.astype(q.dtype), g)
        return (dk, dv), f32("bkgqs,bskd->bqkgd", dscores, kh)

    rows0 = jnp.arange(blk.tiles) * blk.rows
    xs = (blk.by_tiles(qh), blk.by_tiles(gh), blk.by_tiles(lse, 3), blk.by_tiles(delta, 3), rows0,
          q_pos.reshape(blk.tiles, blk.rows), None if q_segments is None else blk.by_tiles(q_segments))
    (dk, dv), dq = _over_tiles(blk, tile, (zeros, zeros), xs)
    return blk.from_tiles(dq), dk, dv


def _merged(blk: _Blocks, out, lse, qa, block_out, block_lse):
    """The running output and log-sum-exp of query half qa with one block's merged in (with packed documents a row
    may have seen no key yet: both −∞, its output left 0)."""
    merged = jnp.logaddexp(lse[:, qa], block_lse)
    base = _finite(merged) if blk.documents else merged
    out = out.at[:, qa].set(out[:, qa] * _to_rows(jnp.exp(lse[:, qa] - base))
                            + block_out * _to_rows(jnp.exp(block_lse - base)))
    return out, lse.at[:, qa].set(merged)


def _when(spanned, fn, *operands):
    """fn(*operands), or the operands unchanged where `spanned` (a traced bool) says the block has nothing to see;
    spanned None: always fn."""
    if spanned is None:
        return fn(*operands)
    return jax.lax.cond(spanned, fn, lambda *x: x, *operands)


def _ring_forward(q, k, v, key_data, segments=None, *, chunks, scale, rate, s, tensor, data):
    """One context rank's ring: out [b, 2n, a, d] and its log-sum-exp [b, kv, g, 2n] (float32)."""
    blk = _Blocks(q, k, chunks, scale, rate, s, tensor, data, key_data, segments)
    c, plan = len(chunks), ring_plan(chunks)
    qh = blk.halves(q, (blk.kv, blk.g))
    out = _varying(jnp.zeros((blk.b, 2, blk.n, blk.kv, blk.g, blk.d), jnp.float32), q, k)
    lse = _varying(jnp.full((blk.b, 2, blk.kv, blk.g, blk.n), -jnp.inf, jnp.float32), q, k)

    def branch(pattern, step):
        def run(out, lse, k, v):
            kh, vh = blk.halves(k, (blk.kv,)), blk.halves(v, (blk.kv,))
            src = (blk.rank - step) % c
            for qa in range(2):
                for kb in range(2):
                    rel = pattern[qa][kb]
                    if rel == EMPTY:
                        continue
                    q_segs, k_segs = blk.query_segments(qa), blk.key_segments(src, kb)

                    def add(out, lse, qa=qa, kb=kb, rel=rel, q_segs=q_segs, k_segs=k_segs):
                        block = _forward_block(blk, qh[:, qa], kh[:, kb], vh[:, kb], rel, blk.positions(blk.rank, qa),
                                               blk.positions(src, kb), q_segs, k_segs)
                        return _merged(blk, out, lse, qa, *block)

                    out, lse = _when(blk.spanned(rel, q_segs, k_segs), add, out, lse)
            return out, lse
        return run

    for step in range(c):
        out, lse = _by_pattern(plan, step, lambda p: branch(p, step), out, lse, k, v)
        if step < c - 1:
            k, v = _pass_on(k, c), _pass_on(v, c)
    lse = jnp.moveaxis(lse, 1, -2).reshape(blk.b, blk.kv, blk.g, 2 * blk.n)
    return out.reshape(q.shape).astype(q.dtype), lse


def _ring_backward(q, k, v, out, lse, g, key_data, segments=None, *, chunks, scale, rate, s, tensor, data):
    """The ring's backward on one context rank: each K/V block comes round again with its dK/dV accumulators,
    and every block is recomputed against the global log-sum-exp (P = exp(S − lse)); after c passes the
    accumulators are back with their owners. Returns dq, dk, dv."""
    blk = _Blocks(q, k, chunks, scale, rate, s, tensor, data, key_data, segments)
    c, plan = len(chunks), ring_plan(chunks)
    qh, gh = blk.halves(q, (blk.kv, blk.g)), blk.halves(g.astype(q.dtype), (blk.kv, blk.g))
    lse = jnp.moveaxis(lse.reshape(blk.b, blk.kv, blk.g, 2, blk.n), 3, 1)  # [b, 2, kv, g, n]
    delta = jnp.sum(gh.astype(jnp.float32) * blk.halves(out, (blk.kv, blk.g)).astype(jnp.float32),
                    axis=-1)  # rowsum(dO·O)
    delta = jnp.moveaxis(delta, 2, -1)  # [b, 2, kv, g, n]
    dq = _varying(jnp.zeros(qh.shape, jnp.float32), q, k, g)
    zeros = _varying(jnp.zeros((blk.b, 2, blk.n, blk.kv, blk.d), jnp.float32), q, k, g)
    dk = dv = zeros

    def branch(pattern, step):
        def run(dq, k, v):  # this step's dK/dV from zeros: the arriving accumulators stay out of the switch
            dk, dv = zeros, zeros
            kh, vh = blk.halves(k, (blk.kv,)), blk.halves(v, (blk.kv,))
            src = (blk.rank - step) % c
            for qa in range(2):
                for kb in range(2):
                    rel = pattern[qa][kb]
                    if rel == EMPTY:
                        continue
                    q_segs, k_segs = blk.query_segments(qa), blk.key_segments(src, kb)

                    def add(dq, dk, dv, qa=qa, kb=kb, rel=rel, q_segs=q_segs, k_segs=k_segs):
                        dq_block, dk_block, dv_block = _backward_block(
                            blk, qh[:, qa], kh[:, kb], vh[:, kb], gh[:, qa], lse[:, qa], delta[:, qa], rel,
                            blk.positions(blk.rank, qa), blk.positions(src, kb), zeros[:, 0], q_segs, k_segs)
                        return dq.at[:, qa].add(dq_block), dk.at[:, kb].add(dk_block), dv.at[:, kb].add(dv_block)

                    dq, dk, dv = _when(blk.spanned(rel, q_segs, k_segs), add, dq, dk, dv)
            return dq, dk, dv
        return run

    for step in range(c):
        dq, dk_step, dv_step = _by_pattern(plan, step, lambda p: branch(p, step), dq, k, v)
        if step < c - 1:
            k, v = _pass_on(k, c), _pass_on(v, c)
        # Added after the switch, so the send arriving here gates only this add, not the next step's blocks
        # (experiments/results/context.md, "Overlap on a GPU"; TransformerEngine's order).
        dk, dv = dk + dk_step, dv + dv_step
        dk, dv = _pass_on(dk, c), _pass_on(dv, c)
    return dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape).astype(v.dtype)


# ---------------------------------------------------------------------------------------------
# The ring under a pipeline (parallel/pipeline.py): every branch of a tick runs as many context permutes


def context_permutes(jaxpr) -> int:
    """How many collective-permutes over `context` a jaxpr runs: a loop's times its trip count, a conditional's
    busiest branch's (the ring's K/V and dK/dV sends, each a `ppermute` over `context`)."""
    count = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "ppermute":
            count += "context" in entry_axes(eqn.params["axis_name"])
        elif name == "scan":
            count += eqn.params["length"] * context_permutes(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            count += max(context_permutes(b.jaxpr) for b in eqn.params["branches"])
        else:
            for sub in _inner_jaxprs(eqn.params):
                if name == "while" and context_permutes(sub):
                    raise ValueError("a context permute inside a while loop: its trip count is unknown when traced")
                count += context_permutes(sub)
    return count


def _inner_jaxprs(params: dict):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v



def same_context_permutes(branches: list[Callable], operands: tuple, with_zero: Callable) -> list[Callable]:
    """`branches` padded with scalar collective-permutes over `context` so that every branch runs the busiest
    one's count. Why: the ring's sends run inside one stage's branch of a tick while another stage runs another
    branch, and XLA:CPU pairs the stages' collective-permutes by the order they run in (docs/DESIGN.md, "Context
    parallelism"): with equal counts every stage's k-th permute is a context permute, paired with its own
    stage's. with_zero(out, z): the branch's output with the dummies' zero result added (so they are kept)."""
    counts = [context_permutes(jax.make_jaxpr(b)(*operands).jaxpr) for b in branches]
    most = max(counts)
    if most == 0 or len(set(counts)) == 1:
        return branches

    def padded(branch, n, *args):
        out = branch(*args)
        zero = jax.lax.pcast(jnp.zeros((), jnp.float32), ("context",), to="varying")
        c = jax.sharding.get_abstract_mesh().shape["context"]
        send = lambda z, _: (jax.lax.ppermute(z, "context", [(j, (j + 1) % c) for j in range(c)]), None)
        return with_zero(out, 0.0 * jax.lax.scan(send, zero, None, length=n)[0])

    return [b if n == most else partial(padded, b, most - n) for b, n in zip(branches, counts)]
