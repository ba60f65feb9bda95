"""Packed documents (`ModelConfig.document_mask`, models/documents.py): a packed sequence's loss and every gradient
equal those of its documents run one by one, each at positions from 0 with nothing else to attend to (float32,
relative 2-norm error ≤ 1e-6), with explicit and fused attention, under context = 2 (both strategies, in the
partitioner's view and in the training regions manual over `context`) and in a 1F1B pipeline; the ring skips the
blocks no document spans; bad input in one line."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxseq.config import ConfigError, ParallelConfig, replace, validate_model
from jaxseq.presets import preset
from jaxseq.mesh import make_mesh
from jaxseq.models import documents
from jaxseq.models import model as M
from jaxseq.parallel import context as CTX
from jaxseq.parallel import data_parallel as DP
from jaxseq.parallel import pipeline as PL
from jaxseq.parallel.layout import Layout
from jaxseq.planning import document_mask, kernel_time
from jaxseq.sharding import Sharder
from jaxseq.training import train_step as T
from trees import comparable

EOD = 255  # the tiny presets' last id: the end-of-document token of these batches
FAMILIES = {"gpt": replace(preset("tiny"), dtype="float32", dropout=0.0),
            "llama": replace(preset("tiny-llama"), dtype="float32")}
RTOL = 1e-6


def test_documents_are_read_from_the_end_of_document_tokens():
    """An end token is the last of the document it ends; the next token starts the next one at position 0; a row's
    first tokens (a document's tail) are its first document."""
    tokens = jnp.asarray([[5, 9, EOD, 7, EOD, EOD, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
    docs = documents.of_tokens(tokens, EOD)
    assert docs.segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert docs.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_a_block_is_spanned_only_where_its_last_key_and_first_query_share_a_document():
    keys, queries = jnp.asarray([[0, 0, 1], [2, 2, 2]]), jnp.asarray([[1, 1, 2], [3, 3, 3]])
    assert bool(documents.spans(queries, keys))  # row 0: key 2 and query 0 in document 1
    assert not bool(documents.spans(queries[1:], keys[1:]))


def test_a_document_mask_without_an_end_of_document_id_is_one_line():
    cfg = replace(preset("tiny"), document_mask=True)
    for eod, valid in ((None, False), (256, False), (-1, False), (0, True), (255, True)):
        if valid:
            validate_model(replace(cfg, eod_token=eod))
            continue
        with pytest.raises(ConfigError, match=r"^document_mask needs eod_token, the end-of-document id, in 0 … 255"):
            validate_model(replace(cfg, eod_token=eod))


def packed_batch(cfg, rows: int = 8, seed: int = 0) -> dict:
    """Rows of random tokens, each with an end of document at position 40 and 0–3 more at random places (row 0
    none more): several documents a row, one across the context chunks' boundaries, the first a document's tail."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOD, (rows, cfg.seq_len + 1), dtype=np.int32)
    for r in range(rows):
        tokens[r, rng.choice(np.arange(1, cfg.seq_len), size=r % 4, replace=False)] = EOD
        tokens[r, 40] = EOD
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def one_by_one(cfg, params, batch):
    """(loss, grads) of the batch's documents run one by one: each document a row of its own from position 0 (padded
    after it, which causal attention keeps it from seeing), the model without a document mask on one device; the
    tokens' losses put back where they were packed and averaged as the packed loss averages them."""
    segments = np.asarray(documents.of_tokens(jnp.asarray(batch["inputs"]), EOD).segments)
    rows, s = segments.shape
    inputs, targets = [], []
    where = np.zeros((rows, s, 2), np.int32)  # each packed token's (document row, position) in the documents
    for r in range(rows):
        for d in np.unique(segments[r]):
            start, stop = np.flatnonzero(segments[r] == d)[[0, -1]] + (0, 1)
            doc = np.zeros((2, s), np.int32)
            doc[:, : stop - start] = batch["inputs"][r, start:stop], batch["targets"][r, start:stop]
            where[r, start:stop] = np.stack([np.full(stop - start, len(inputs)), np.arange(stop - start)], -1)
            inputs.append(doc[0])
            targets.append(doc[1])
    inputs, targets = np.stack(inputs), np.stack(targets)

    def loss(params):
        unsharded = Sharder(None)
        logits = M.logits_fn(params, M.hidden_states(params, inputs, cfg, unsharded, "none"), cfg, unsharded)
        token_loss = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return jnp.mean(token_loss[where[..., 0], where[..., 1]])

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    """Per family: its float32 weights (padded for tensor 8), a packed batch, and the documents run one by one."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cfg = FAMILIES[family]
            params = M.init_params(jax.random.key(1), cfg, tensor=8)
            batch = packed_batch(cfg)
            cache[family] = params, batch, one_by_one(cfg, params, batch)
        return cache[family]

    return get


def assert_equal(result, expected):
    """The loss and every gradient within RTOL, relative in the 2-norm (each leaf's error over its norm)."""
    loss, grads = result
    ref_loss, ref_grads = expected
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
    grads, ref_grads = comparable(jax.device_get(grads)), comparable(jax.device_get(ref_grads))
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        err = np.linalg.norm(np.asarray(g, np.float32) - r) / np.linalg.norm(r)
        assert err <= RTOL, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


def packed(cfg, parallel: ParallelConfig, params, batch, *, region: bool, remat: str = "selective"):
    """(loss, grads) of the packed batch with the document mask: `region` False, the partitioner's view
    (`train_step.make_loss_and_grad`, as the evaluation runs); True, the training step's regions manual over data
    and context (two micro-batches accumulated, or the pipeline's)."""
    cfg = replace(cfg, document_mask=True, eod_token=EOD)
    mesh = make_mesh(parallel, jax.devices()[: parallel.num_devices])
    layout = Layout(cfg, parallel, mesh)
    if not region:
        fn = T.make_loss_and_grad(layout, remat)
    elif parallel.pipe > 1:
        fn = PL.make_loss_and_grad(layout, remat, 2)
    else:
        fn = jax.jit(partial(DP.accumulate_loss_and_grad, layout=layout, remat=remat, microbatches=2,
                             grad_specs=layout.param_specs), out_shardings=(None, layout.param_shardings))
    with jax.set_mesh(mesh):
        loss, grads = fn(params, batch, jax.random.key(2))
    return float(loss), jax.device_get(grads)


CONTEXT = dict(data=2, context=2, tensor=2, sequence_parallel=True)
CASES = {  # name: (family, attention, parallel configuration, in the training regions)
    "one device, explicit": ("gpt", "explicit", ParallelConfig(), False),
    "one device, fused": ("llama", "fused", ParallelConfig(), False),
    "context 2 all-gather, fused": ("llama", "fused", ParallelConfig(**CONTEXT), False),
    "context 2 all-gather, region": ("gpt", "explicit", ParallelConfig(**CONTEXT), True),
    "context 2 ring": ("gpt", "explicit", ParallelConfig(**CONTEXT, context_strategy="ring"), False),
    "context 2 ring, region": ("llama", "explicit", ParallelConfig(**CONTEXT, context_strategy="ring"), True),
    "1f1b": ("gpt", "explicit", ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True), True),
}


@pytest.mark.slow  # 4–15 s of compiles each (the first case 20 s with its family's reference); the fast tier holds
# the documents read from the tokens and the ring's block test (above)
@pytest.mark.parametrize("case", list(CASES))
def test_a_packed_sequence_equals_its_documents_one_by_one(case, reference):
    """GPT's learned positions and Llama's RoPE from each document's first token, its attention within the document
    (explicit, XLA's fused with the dense mask; the ring's blocks, the full ones no document spans skipped), in every
    layout the mask travels through: the partitioner's view (the evaluation's), the accumulation's and the pipeline's
    regions manual over data and context (the segment ids split with the tokens, the keys' gathered, and under a
    pipeline carried with each micro-batch)."""
    family, attention, parallel, region = CASES[case]
    params, batch, expected = reference(family)
    cfg = replace(FAMILIES[family], attention=attention)
    assert_equal(packed(cfg, parallel, params, batch, region=region), expected)


@pytest.mark.slow
def test_the_ring_skips_the_blocks_no_document_spans(monkeypatch):
    """Where a document ends at every chunk boundary (s/2c tokens apart), no document spans two chunks: each rank's
    ring runs its 2 diagonal blocks and skips its 2c − 1 full ones (2 of 2c + 1 = 5 blocks at c = 2, counted as they
    run); with one document a row it runs all 5. The losses still equal the documents' one by one (above)."""
    ran = []
    forward_block = CTX._forward_block

    def counted(blk, *args, **kwargs):
        jax.debug.callback(lambda: ran.append(1))
        return forward_block(blk, *args, **kwargs)

    monkeypatch.setattr(CTX, "_forward_block", counted)
    cfg = replace(FAMILIES["gpt"], document_mask=True, eod_token=EOD)
    parallel = ParallelConfig(context=2, context_strategy="ring")
    layout = Layout(cfg, parallel, make_mesh(parallel, jax.devices()[:2]))
    loss = jax.jit(partial(M.loss_fn, cfg=cfg, shard=CTX.sharder(layout.mesh, parallel), remat="none"))
    params = M.init_params(jax.random.key(1), cfg)
    tokens = np.random.default_rng(0).integers(0, EOD, (2, cfg.seq_len), dtype=np.int32)
    counts = []
    for ends in ((), (15, 31, 47)):  # one document a row; a document per chunk of 16
        chunked = tokens.copy()
        chunked[:, list(ends)] = EOD
        ran.clear()
        jax.block_until_ready(loss(params, {"inputs": chunked, "targets": chunked}))
        jax.effects_barrier()
        counts.append(len(ran))
    assert counts[0] == 5 * cfg.layers * 2 and counts[1] == 2 * cfg.layers * 2, counts  # 2 ranks, 2 layers


def test_the_plans_note_counts_the_segment_ids_and_the_ring_blocks_the_mask_can_skip():
    """8 bytes a token of each micro-batch held (every micro-batch under a pipeline), split over context; under the
    ring the 2c − 1 full blocks of each rank's 2c + 1 (`kernel_time.ring_gemms`, per rank: 1/c of its count)."""
    cfg = replace(FAMILIES["gpt"], document_mask=True, eod_token=EOD)
    plain = document_mask.costs(cfg, micro_batch=2, tensor=1)
    assert plain["segment_ids_bytes"] == 8 * 2 * 64 and plain["mask_bytes_per_layer"] == 2 * 64 * 64
    assert plain["ring_skippable_flops_per_layer"] is None
    ring = document_mask.costs(cfg, micro_batch=2, tensor=2, context=2, strategy="ring", microbatches_held=4)
    assert ring["segment_ids_bytes"] == 8 * 2 * 32 * 4
    blocks = sum(g.flops for g in kernel_time.ring_gemms(cfg, 2, 2, 2, "selective")) / 2  # one rank's 2c + 1
    assert (ring["ring_skippable_blocks"], ring["ring_blocks_per_layer"]) == (3, 5)
    assert ring["ring_skippable_flops_per_layer"] == pytest.approx(blocks * 3 / 5, rel=1e-12)
    assert "the ring skips up to 3 of its 5 blocks a layer" in document_mask.format_note(ring)


@pytest.mark.slow  # two pipelined steps traced (no compile)
def test_a_pipeline_stash_keeps_no_segment_ids():
    """Each chunk's vjp reads its micro-batch's segment ids, which the stage holds for the whole step: its stash slot
    is the unmasked run's, the ids taken from the live arrays at backward time (`ResidualLayout`, by identity)."""
    parallel = ParallelConfig(pipe=2, data=2, tensor=2, sequence_parallel=True)
    mesh = make_mesh(parallel, jax.devices())
    tokens = np.zeros((8, 64), np.int32)
    found = {}
    for mask in (False, True):
        cfg = replace(FAMILIES["gpt"], document_mask=mask, eod_token=EOD)
        seen = []
        fn = partial(PL.pipeline_loss_and_grad, layout=Layout(cfg, parallel, mesh), remat="selective", microbatches=2,
                     inspect=lambda *avals: seen.append(avals))
        with jax.set_mesh(mesh):
            jax.eval_shape(fn, M.init_params(jax.random.key(1), cfg, tensor=8), {"inputs": tokens, "targets": tokens},
                           jax.random.key(2))
        found[mask] = seen[0][:2]  # (one stash slot, the leaves taken from the weights, keys and documents)
    assert found[True][0] == found[False][0]
    ids = found[True][1][-1]
    assert found[True][1][:-1] == found[False][1] and (ids.shape, ids.dtype) == ((2, 64), jnp.int32)
