"""Sizes past 2³² elements: the dropout masks' 64-bit counter is JAX's own, every mesh's manual path draws its
entries of one global mask at such sizes (the ring, a data rank's rows, the stored context order), the layer
compiles there with the formulas' stored bytes, and a token file past 2³² bytes is read at the right offsets.
The masks are evaluated only at a few selected entries: JAX's counter (`iota_2x32_shape`) sliced under jit
costs no memory, so the reference is JAX's own numbering of the global array."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.random import prng  # JAX's own 64-bit element counter: the outside reference
from jax.sharding import PartitionSpec as P

from jaxseq.config import ParallelConfig, replace
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import formulas as F
from jaxseq.models import ops as O
from jaxseq.parallel import context as C
from jaxseq.parallel.region import StageSharder
from jaxseq.planning import hlo_loops
from jaxseq.sharding import context_chunks
from jaxseq.training import aot
from jaxseq.training.data import Batches

KEY, RATE = jax.random.key(7), 0.1
S = 2**17  # a 128k-token sequence: one head's attention mask alone has 2³⁴ elements


def jax_counter(global_shape, index):
    """JAX's (high, low) element counter of an array of `global_shape` at the basic slice `index`."""
    return jax.jit(lambda: tuple(c[index] for c in prng.iota_2x32_shape(global_shape)))()


def jax_mask(global_shape, index):
    """The entries at `index` of jax.random.bernoulli(KEY, 1 − RATE, global_shape), from JAX's counter."""
    return np.asarray(O._uniform_below(jax.random.key_data(KEY), 1.0 - RATE, *jax_counter(global_shape, index)))


def test_the_counter_is_jaxs_past_2_32_elements():
    """element_index at a [2, 24, s, s] attention mask (s = 128k, 2³⁹ elements; the heads' and rows' strides
    are past 2³²) equals JAX's own counter and the 64-bit integer arithmetic, at entries near every end."""
    shape = (2, 24, S, S)
    for b, h, row, col in ((1, 23, S - 3, S - 8), (0, 5, 70_000, 0), (1, 0, 0, 2**16)):
        index = (b, slice(h, h + 1), slice(row, row + 3), slice(col, col + 8))
        coords = {0: np.asarray([b]), 1: np.asarray([h]), 2: row + np.arange(3), 3: col + np.arange(8)}
        hi, lo = jax.jit(partial(O.element_index, (1, 1, 3, 8), global_shape=shape))(coords)
        ref_hi, ref_lo = jax_counter(shape, index)
        np.testing.assert_array_equal(hi[0], ref_hi)
        np.testing.assert_array_equal(lo[0], ref_lo)
        flat = np.ravel_multi_index(np.ix_([b], [h], row + np.arange(3), col + np.arange(8)), shape).astype(np.uint64)
        np.testing.assert_array_equal(hi, flat >> 32)
        np.testing.assert_array_equal(lo, flat & 0xFFFFFFFF)
        assert int(flat.max()) >= 2**32


def test_the_counter_sums_inner_axes_in_one_word_up_to_2_32():
    """Axes 1 and 2 of [5, 2¹⁶, 2¹⁶ − 1] span 2³² − 2¹⁶ indices: summed in the low word alone, exactly; axis 0 (whose
    rows may lie past the global shape's: `bernoulli_rows`) adds past 2³² with its carry: numpy's 64-bit index."""
    shape = (5, 2**16, 2**16 - 1)
    for rows, mid, cols in (([4], [2**16 - 1], [2**16 - 2]), ([0, 1, 7], [0, 2**15, 2**16 - 1], [0, 1, 2**16 - 2])):
        coords = {0: np.asarray(rows), 1: np.asarray(mid), 2: np.asarray(cols)}
        size = tuple(len(c) for c in coords.values())
        hi, lo = jax.jit(partial(O.element_index, size, global_shape=shape))(coords)
        flat = (np.asarray(rows, np.uint64)[:, None, None] * np.uint64(shape[1] * shape[2])
                + np.asarray(mid, np.uint64)[None, :, None] * np.uint64(shape[2])
                + np.asarray(cols, np.uint64)[None, None, :])
        np.testing.assert_array_equal(hi, flat >> np.uint64(32))
        np.testing.assert_array_equal(lo, flat & np.uint64(0xFFFFFFFF))


def test_bernoulli_rows_past_2_32_elements():
    """Rows 2²⁰ and 2²⁰ + 1 of a [R, 64, 1024] mask (element indices past 2³⁶): JAX's entries."""
    first, shape = 2**20, (2, 64, 1024)
    rows = jax.jit(O.bernoulli_rows, static_argnums=(1, 2))(KEY, 1.0 - RATE, shape, first)
    np.testing.assert_array_equal(rows, jax_mask((first + 2, 64, 1024), slice(first, first + 2)))


def test_old_limit_is_gone():
    """The mask of one 16k-token micro-batch with 24 heads (6.4·10⁹ elements) is drawn (it raised before)."""
    keep = jax.eval_shape(lambda: O.bernoulli_at(KEY, 0.9, (1, 1, 2, 2), {}, (1, 24, 16384, 16384)))
    assert keep.shape == (1, 1, 2, 2)


MESH = ParallelConfig(data=2, context=2, tensor=2)


def test_ring_masks_are_the_global_masks_entries_past_2_32(devices):
    """The ring's attention-probs dropout (`_Blocks.kept`) on data=2 × context=2 × tensor=2 at s = 128k: each
    rank's block (its data rows, tensor rank's heads, a query half of its own chunk against a key block of
    another) equals those entries of jax.random.bernoulli over the global [b, heads, s, s]."""
    b, kv, n, c = 1, 2, 4, 2  # per rank: 1 row, 2 heads (g = 1), blocks of 4 × 4 positions
    chunk = S // (2 * c)
    q_first = jnp.asarray([[chunks[1] * chunk + chunk - n for chunks in context_chunks(c)]])  # [1, c]
    k_first = jnp.asarray([[chunks[0] * chunk + 3 for chunks in context_chunks(c)]])

    def rank(q, k, q_first, k_first):
        blk = C._Blocks(q, k, context_chunks(c), 1.0, RATE, S, 2, ("data",), jax.random.key_data(KEY))
        kept = blk.kept(q_first[0, 0] + jnp.arange(n), k_first[0, 0] + jnp.arange(n))
        return kept[:, :, :, None] > 0  # [b, kv, g, 1 (context), n, n]

    spec = P("data", "context", "tensor", None)
    mesh = make_mesh(MESH, devices)
    local = jax.ShapeDtypeStruct((2 * b, c * 2 * n, 2 * kv, 2), jnp.float32)  # q and k: [b, 2n, kv, d] a rank
    qk = jnp.zeros(local.shape, local.dtype)
    kept = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=(spec, spec, P(None, "context"), P(None, "context")),
                                 out_specs=P("data", "tensor", None, "context")))(qk, qk, q_first, k_first)
    shape = (2 * b, 2 * kv, 1, S, S)
    for d in range(2):
        for r in range(c):
            q0, k0 = int(q_first[0, r]), int(k_first[0, r])
            ref = jax_mask(shape, (slice(d, d + 1), slice(None), slice(None), slice(q0, q0 + n), slice(k0, k0 + n)))
            np.testing.assert_array_equal(kept[d:d + 1, :, :, r], ref)


def test_a_data_ranks_hidden_dropout_is_the_global_masks_rows_past_2_32(devices):
    """ops.dropout inside a region manual over data (a pipeline's or accumulation's), on a context-ordered
    sequence of 128k tokens with h = 32768 (a row of 2³² elements): each rank's entries are the global mask's."""
    h, n = 2**15, 4
    mesh = make_mesh(MESH, devices)

    def rank(x, positions):
        return O.dropout(x, RATE, KEY, "mask", order=positions[0], seq_len=S, shard=StageSharder(mesh)) != 0

    x = jnp.ones((2, n, h), jnp.float32)
    positions = jnp.asarray([S - n + np.arange(n), 2**16 + np.arange(n)])  # data rank 1: the last 4 tokens
    kept = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))(x, positions)
    for d in range(2):
        p0 = int(positions[d, 0])
        np.testing.assert_array_equal(kept[d], jax_mask((2, S, h), (d, slice(p0, p0 + n))))


# The layer compiled where one micro-batch's attention mask passes 2³² elements (b·a·s² = 16 · 2²⁸): a small
# model at s = 16384, compile only.
LONG_CFG = replace(preset("tiny"), seq_len=16384, heads=16, dtype="bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all-gather", "ring"])
def test_a_layer_past_2_32_mask_elements_stores_the_formula(strategy, devices):
    """At context 2 × tensor 2 + SP with dropout, both strategies compile (they raised before) and store the
    context-parallel formula's bytes, to the byte."""
    assert LONG_CFG.dropout > 0 and LONG_CFG.heads * LONG_CFG.seq_len**2 >= 2**32
    parallel = ParallelConfig(data=1, context=2, tensor=2, sequence_parallel=True, context_strategy=strategy)
    text = aot.compile_loss_and_grad(LONG_CFG, parallel, "selective", make_mesh(parallel, devices[:4]), 1).as_text()
    assert hlo_loops.stored_bytes_per_layer(text, LONG_CFG.layers) == F.activation_bytes(
        LONG_CFG, "selective", 1, 2, True, 2, strategy)


def test_a_token_file_past_2_32_bytes_is_indexed_whole(tmp_path):
    """A sparse uint16 token file of 3·2³¹ tokens (12 GiB, past 2³² tokens and 2³³ bytes): every window the
    sampler picks is read from its own offset (each window written there first), and starts fall past 2³²."""
    seq_len, path = 8, tmp_path / "big.train.bin"
    with open(path, "wb") as f:
        f.truncate(3 * 2**31 * 2)
    batches = Batches(np.memmap(path, dtype=np.uint16, mode="r"), seq_len, batch_size=64, seed=5)
    starts = np.concatenate([batches.starts(i) for i in range(3)])
    assert starts.dtype == np.int64 and starts.max() >= 2**32 and starts.max() <= 3 * 2**31 - seq_len - 1
    window = lambda s: (np.arange(seq_len + 1) + s) % 65_521
    with open(path, "r+b") as f:
        for s in starts:
            f.seek(int(s) * 2)
            f.write(window(s).astype(np.uint16).tobytes())
    batches = Batches(np.memmap(path, dtype=np.uint16, mode="r"), seq_len, batch_size=64, seed=5)
    for i in range(3):
        rows = batches.rows(i)
        for s, inputs, targets in zip(batches.starts(i), rows["inputs"], rows["targets"]):
            np.testing.assert_array_equal(inputs, window(s)[:-1])
            np.testing.assert_array_equal(targets, window(s)[1:])


def test_the_last_window_is_sampled():
    """Windows start anywhere from 0 to len − seq_len − 1, the last included (it was never drawn), and data of
    exactly seq_len + 1 tokens is one window."""
    tokens = np.arange(12, dtype=np.uint16)
    starts = np.concatenate([Batches(tokens, 10, 16, 0).starts(i) for i in range(4)])
    assert set(starts.tolist()) == {0, 1}
    one = Batches(tokens[:11], 10, 2, 0).rows(0)
    np.testing.assert_array_equal(one["inputs"], [np.arange(10)] * 2)
    assert math.prod(one["targets"].shape) == 20
