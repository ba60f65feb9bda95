"""The pipeline executor: loss and gradients of the whole model over a `pipe` mesh axis, one schedule tick
at a time, so that 1F1B really holds only the micro-batches its schedule keeps in flight.

Why not `jax.grad` of a forward pipeline: autodiff keeps every micro-batch's activations until the
backward loop (GPipe's memory, whatever the forward order). Here each micro-batch chunk gets its own
`jax.vjp`; its residuals wait in a stash slot until the schedule's backward of that chunk runs.

The program (inside `jax.shard_map`, manual over `pipe` and `data`, `tensor` left to XLA; each data rank
runs its rows of every micro-batch, dropout masks drawn as the rows of the global mask):
- one `lax.scan` over the ticks of `schedule.Schedule.tables`; at each tick every stage reads its row
  (op kind, micro-batch, chunk, buffer slots) and runs one `lax.switch` branch: idle, forward (first chunk:
  embedding first; last chunk: final LayerNorm, logits, loss and the loss gradient), backward (first chunk:
  the embedding gradient after);
- after the switch two `ppermute`s move the forward output to stage s + 1 and the input gradient to
  stage s − 1 (cyclic: the last stage feeds stage 0's next chunk under the interleaved schedule);
- the stash keeps only the residuals that are not the chunk's weights or dropout keys (those are the same
  arrays at backward time), so a slot costs what the remat policy stores for k layers;
- weights are cast to `pipe`- and `data`-varying before the loop, so each stage and data rank accumulates
  its own gradients over the micro-batches; after the loop they are summed over `data` once (Megatron's
  one data-parallel reduction per step), and the embedding's two gradients (first stage's lookup, last
  stage's logits) and the final LayerNorm's over `pipe` too (Megatron's embedding group).

Layers are stored in natural order, sharded over `pipe` in L/p blocks; stage s, chunk c runs layers
(c·p + s)·k … + k − 1 (k = L/(p·v)). For v = 1 that is the stored block (no data moves); for v > 1 the
step regroups the layers (an all-to-all over `pipe` of the weights and, after, of their gradients).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.models import gpt as M
from jaxseq.parallel import schedule as S
from jaxseq import remat as R
from jaxseq.sharding import Sharder, StageSharder, batch_sharding

# lax.switch branches
IDLE, FORWARD, FORWARD_FIRST, FORWARD_LAST, BACKWARD, BACKWARD_FIRST = range(6)
FIELDS = ("branch", "mb", "chunk", "stash", "x_slot", "g_slot", "recv_x", "recv_g")


def schedule_of(parallel: ParallelConfig, microbatches: int, layers: int) -> S.Schedule:
    return S.Schedule.make(parallel.schedule, parallel.pipe, microbatches, parallel.virtual_stages, layers)


def tick_rows(sched: S.Schedule) -> np.ndarray:
    """[ticks, p, len(FIELDS)] int32: the switch branch and the slots each stage uses at each tick.
    Receive slots of −1 become the trash slot (index = depth) so that every write has a target."""
    tab = sched.tables
    kind, first, last = tab["kind"], tab["first"] == 1, tab["last"] == 1
    branch = np.select(
        [kind == S.IDLE, (kind == S.FORWARD) & first, (kind == S.FORWARD) & last, kind == S.FORWARD,
         (kind == S.BACKWARD) & first],
        [IDLE, FORWARD_FIRST, FORWARD_LAST, FORWARD, BACKWARD_FIRST], BACKWARD)
    d = sched.depths
    cols = {
        "branch": branch, "mb": np.maximum(tab["mb"], 0), "chunk": np.maximum(tab["chunk"], 0),
        "stash": np.maximum(tab["stash"], 0), "x_slot": np.maximum(tab["x_slot"], 0),
        "g_slot": np.maximum(tab["g_slot"], 0),
        "recv_x": np.where(tab["recv_x"] < 0, d["x"], tab["recv_x"]),
        "recv_g": np.where(tab["recv_g"] < 0, d["g"], tab["recv_g"]),
    }
    return np.stack([cols[f] for f in FIELDS], axis=-1).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# What one stage computes for one micro-batch chunk


def embed(params, tokens, key, cfg: ModelConfig, shard: Sharder):
    """model.hidden_states up to the layers: lookup + positions, then the embedding dropout."""
    x = shard.embed(params["token"], tokens) + params["position"][: tokens.shape[1]]
    x = shard(x, "batch", "seq_sp", None)
    return M.dropout(x, cfg.dropout, key, R.EMBED_DROPOUT_MASK)


def chunk(x, layers, keys, cfg: ModelConfig, shard: Sharder, remat: str):
    """k layers under lax.scan, each under jax.checkpoint with the remat policy (as model.decoder)."""
    body = jax.checkpoint(partial(M.block, cfg=cfg, shard=shard), policy=R.remat_policy(remat).policy,
                          prevent_cse=False)
    x, _ = jax.lax.scan(lambda x, inp: (body(x, *inp), None), x, (layers, keys))
    return x


def head(x, params, targets, cfg: ModelConfig, shard: Sharder):
    """Final LayerNorm, tied-embedding logits and the mean cross-entropy (model.loss_fn's tail)."""
    x = M.layer_norm(x, params["final_ln"]["scale"], params["final_ln"]["bias"], cfg.ln_eps)
    return M.cross_entropy(M.logits_fn(params, x, cfg, shard), targets)


def micro_keys(key, mb, cfg: ModelConfig):
    """Micro-batch mb's dropout keys exactly as the gradient-accumulating train step derives them:
    fold_in(key, mb) → (embedding key, layers key) → one key per layer."""
    k_embed, k_layers = jax.random.split(jax.random.fold_in(key, mb))
    return k_embed, jax.random.split(k_layers, cfg.layers)


# ---------------------------------------------------------------------------------------------
# The executor


def to_stages(layers, p: int, v: int):
    """Natural-order [L, …] leaves → [p, v, k, …]: stage s, chunk c = layers (c·p + s)·k …"""
    return jax.tree.map(lambda a: a.reshape(v, p, -1, *a.shape[1:]).swapaxes(0, 1), layers)


def from_stages(layers):
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), layers)


def _varying(x, axes=("pipe", "data")):
    """pcast to varying over `axes` where not already so (pcast of a varying value raises). Weights cast
    to varying over `data` before the loop get per-rank gradients: autodiff then inserts no psum (the
    transpose of the implicit cast) in the ticks, and the step reduces over `data` once, after the loop."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _reduce_over_data(g, dim: int, tensor_spec: P):
    """A gradient summed over `data`: all-reduced (dim −1), or reduce-scattered onto dimension `dim`.
    The scatter runs manual over `tensor` too (`tensor_spec`: the gradient's split): left to the
    partitioner, XLA gathered a tensor-split gradient whole before scattering it over `data`."""
    if dim < 0:
        return jax.lax.psum(g, "data")
    scatter = lambda x: jax.lax.psum_scatter(x, "data", scatter_dimension=dim, tiled=True)
    if "tensor" not in tensor_spec:
        return scatter(g)
    return jax.shard_map(scatter, mesh=jax.sharding.get_abstract_mesh(), in_specs=tensor_spec, out_specs=tensor_spec,
                         axis_names={"tensor"})(g)


def pipeline_loss_and_grad(params, batch, key, *, cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh,
                           microbatches: int, grad_specs=None, inspect=None):
    """(loss, grads) of the mean loss over `microbatches` micro-batches of `batch` ({"inputs", "targets"}:
    [B, s] int32), equal to gradient accumulation with micro-batch i's dropout key fold_in(key, i).
    To be called under jit with the mesh's shardings. `grad_specs`: the gradients' PartitionSpecs (default:
    the parameters'); a leaf whose spec names `data` (the distributed optimizer's master shards) is
    reduce-scattered over `data` onto that dimension instead of all-reduced. `inspect`, if given, is called
    at trace time with the avals of one stash slot and of every residual leaf the stash leaves out (see
    `stash_layout`)."""
    sched = schedule_of(parallel, microbatches, cfg.layers)
    p, v, m = sched.p, sched.v, sched.m
    k = cfg.layers // (p * v)
    rows = jnp.asarray(tick_rows(sched))
    depth = sched.depths
    shard = Sharder(mesh, parallel.sequence_parallel)
    inner = StageSharder(mesh, parallel.sequence_parallel)

    cast = M.cast_params(params, jnp.dtype(cfg.dtype))
    stage_layers = jax.tree.map(
        lambda a, spec: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("pipe", None, None, *spec[1:]))),
        to_stages(cast["layers"], p, v), M.param_specs(parallel)["layers"])
    others = {"embed": cast["embed"], "final_ln": cast["final_ln"]}
    # Where each gradient is split over `data` (−1: all-reduced), as an index into the parameter's shape.
    data_dim = jax.tree.map(lambda spec: list(spec).index("data") if "data" in spec else -1,
                            grad_specs if grad_specs is not None else M.param_specs(parallel),
                            is_leaf=lambda x: isinstance(x, P))
    tensor_specs = M.param_specs(parallel)  # their split over `tensor` (a layer's dimension 0 aside)
    micro = jax.tree.map(lambda a: shard(a.reshape(m, -1, *a.shape[1:]), None, "batch", None), batch)
    key_data = jax.random.key_data(key)
    b = micro["inputs"].shape[1] // parallel.data  # one data rank's rows of a micro-batch
    act_shape = (b, cfg.seq_len, cfg.hidden)
    act_dtype = jnp.dtype(cfg.dtype)

    def stage_program(layers, others, micro, key_data, rows):
        s = jax.lax.axis_index("pipe")
        key = jax.random.wrap_key_data(key_data)
        layers = jax.tree.map(lambda a: _varying(a[0]), layers)  # this stage's [v, k, …]
        others = jax.tree.map(_varying, others)
        rows = rows[:, s]  # [ticks, fields]: this stage's column of the tick table

        def chunk_inputs(mb, c):
            w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False), layers)
            ids = (c * p + s) * k + jnp.arange(k)
            k_embed, layer_keys = micro_keys(key, mb, cfg)
            return w, layer_keys[ids], k_embed

        def chunk_vjp(x, w, keys):
            return jax.vjp(lambda x, w: chunk(x, w, keys, cfg, inner, remat), x, w)

        # The residual layout of one chunk's vjp: which leaves are the weights or keys (not stashed).
        probe = {}

        def trace_residuals(x, w, keys):
            _, f_vjp = chunk_vjp(x, w, keys)
            leaves, treedef = jax.tree.flatten(f_vjp)
            inputs = jax.tree.leaves((w, keys))
            probe["treedef"], probe["leaves"] = treedef, leaves
            probe["source"] = [next((i for i, a in enumerate(inputs) if a is leaf), -1) for leaf in leaves]
            return [leaf for leaf, src in zip(leaves, probe["source"]) if src < 0]

        w0, keys0, _ = chunk_inputs(0, 0)
        x0 = _varying(jnp.zeros(act_shape, act_dtype))
        stashed = jax.eval_shape(trace_residuals, x0, w0, keys0)
        if inspect is not None:
            inspect(stashed, [jax.typeof(a) for a, src in zip(probe["leaves"], probe["source"]) if src >= 0])

        def split_residuals(f_vjp):
            # The treedef carries the backward jaxpr (residuals are its inputs, not closed-over tracers),
            # so the one traced in a forward branch serves the backward branch.
            leaves, probe["treedef"] = jax.tree.flatten(f_vjp)
            assert [jax.typeof(a).shape for a in leaves] == [jax.typeof(a).shape for a in probe["leaves"]]
            return [leaf for leaf, src in zip(leaves, probe["source"]) if src < 0]

        def join_residuals(stashed, w, keys):
            inputs, it = jax.tree.leaves((w, keys)), iter(stashed)
            leaves = [inputs[src] if src >= 0 else next(it) for src in probe["source"]]
            return jax.tree.unflatten(probe["treedef"], leaves)

        zeros = lambda shape, dtype: _varying(jnp.zeros(shape, dtype))
        carry = {
            "x": zeros((depth["x"] + 1, *act_shape), act_dtype),  # received activations (+ a trash slot)
            "g": zeros((depth["g"] + 1, *act_shape), act_dtype),  # received gradients, loss gradients
            "stash": [zeros((depth["stash"], *a.shape), a.dtype) for a in stashed],
            "grads": {"layers": jax.tree.map(lambda a: zeros(a.shape, jnp.float32), layers),
                      "others": jax.tree.map(lambda a: zeros(a.shape, jnp.float32), others)},
            "loss": zeros((), jnp.float32),
        }
        no_act = zeros(act_shape, act_dtype)
        no_dw = jax.tree.map(lambda a: zeros(a.shape[1:], jnp.float32), layers)
        no_do = jax.tree.map(lambda a: zeros(a.shape, jnp.float32), others)
        no_loss = zeros((), jnp.float32)
        f32 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)

        # The branches see and return only slot-sized values (one stash slot, one activation, one chunk's
        # weight gradient); the big buffers are read and written around the switch, so XLA updates them in
        # place instead of copying them into and out of the conditional.
        # Branch (row, x, g, slot) → (send_x, send_g, slot, g_out, dw, d_others, loss).
        def idle(row, x, g, slot):
            return no_act, no_act, slot, g, no_dw, no_do, no_loss

        def forward(row, x, g, slot, first: bool, last: bool):
            mb, c = row[1], row[2]
            w, keys, k_embed = chunk_inputs(mb, c)
            if first:
                x = embed(others["embed"], micro["inputs"][mb], k_embed, cfg, inner)
            y, f_vjp = chunk_vjp(x, w, keys)
            slot = split_residuals(f_vjp)
            if not last:
                return y.astype(act_dtype), no_act, slot, g, no_dw, no_do, no_loss
            # The loss and its gradient right away: the B of this chunk needs only dL/dy (an
            # activation-sized slot), not the logits.
            loss, (gy, gh) = jax.value_and_grad(partial(head, cfg=cfg, shard=inner), argnums=(0, 1))(
                y, others, micro["targets"][mb])
            scale = 1.0 / (m * parallel.data)  # the mean over micro-batches and data ranks
            return (no_act, no_act, slot, (gy * scale).astype(act_dtype), no_dw,
                    jax.tree.map(lambda a: a.astype(jnp.float32) * scale, gh), loss * scale)

        def backward(row, x, g, slot, first: bool):
            mb, c = row[1], row[2]
            w, keys, k_embed = chunk_inputs(mb, c)
            dx, dw = join_residuals(slot, w, keys)(g)
            if not first:
                return no_act, dx.astype(act_dtype), slot, g, f32(dw), no_do, no_loss
            _, e_vjp = jax.vjp(lambda e: embed(e, micro["inputs"][mb], k_embed, cfg, inner), others["embed"])
            (de,) = e_vjp(dx)
            return no_act, no_act, slot, g, f32(dw), dict(no_do, embed=f32(de)), no_loss

        branches = [
            idle,
            partial(forward, first=False, last=False),
            partial(forward, first=True, last=False),
            partial(forward, first=False, last=True),
            partial(backward, first=False),
            partial(backward, first=True),
        ]

        def tick(carry, row):
            slot = [buf[row[3]] for buf in carry["stash"]]
            x, g = carry["x"][row[4]], carry["g"][row[5]]
            send_x, send_g, slot, g, dw, d_others, loss = jax.lax.switch(row[0], branches, row, x, g, slot)
            # Only the ticks whose branch has gradients touch the f32 accumulators (a read-add-write of
            # the chunk's weight gradients on every tick, idle and forward ones included, was the
            # executor's largest per-tick traffic: experiments/results/pipeline_overhead.md).
            grads = carry["grads"]
            grads = {"layers": jax.lax.cond(
                         (row[0] == BACKWARD) | (row[0] == BACKWARD_FIRST),
                         lambda acc: jax.tree.map(lambda a, u: a.at[row[2]].add(u), acc, dw),
                         lambda acc: acc, grads["layers"]),
                     "others": jax.lax.cond(
                         (row[0] == FORWARD_LAST) | (row[0] == BACKWARD_FIRST),
                         lambda acc: jax.tree.map(jnp.add, acc, d_others),
                         lambda acc: acc, grads["others"])}
            got_x = jax.lax.ppermute(send_x, "pipe", [(i, (i + 1) % p) for i in range(p)])
            got_g = jax.lax.ppermute(send_g, "pipe", [(i, (i - 1) % p) for i in range(p)])
            carry = {
                "stash": [buf.at[row[3]].set(r) for buf, r in zip(carry["stash"], slot)],
                "x": carry["x"].at[row[6]].set(got_x),
                "g": carry["g"].at[row[5]].set(g).at[row[7]].set(got_g),
                "grads": grads,
                "loss": carry["loss"] + loss,
            }
            return carry, None

        carry, _ = jax.lax.scan(tick, carry, rows)
        # The step's one data-parallel gradient reduction (Megatron's: a reduce-scatter onto the master
        # shards under the distributed optimizer), and the embedding group's over `pipe`.
        grads = carry["grads"]
        loss = jax.lax.psum(carry["loss"], ("pipe", "data"))
        others_grads = jax.tree.map(lambda g, dim, spec: jax.lax.psum(g, ("pipe", "data")) if dim < 0 else
                                    jax.lax.psum(_reduce_over_data(g, dim, spec), "pipe"),
                                    grads["others"], others_dim, {"embed": tensor_specs["embed"],
                                                                  "final_ln": tensor_specs["final_ln"]})
        layer_grads = jax.tree.map(  # local [v, k, …]: a parameter's dimension i ≥ 1 is dimension i + 1
            lambda g, dim, spec: _reduce_over_data(g, dim + 1 if dim >= 0 else -1, P(None, None, *spec[1:]))[None],
            grads["layers"], data_dim["layers"], tensor_specs["layers"])
        return loss, layer_grads, others_grads

    # layers' gradients in the stage layout [p, v, k, …]: a parameter's dimension i ≥ 1 is dimension i + 2
    assert all(d != 0 for d in jax.tree.leaves(data_dim["layers"])), "layers are split over pipe, not data"
    others_dim = {"embed": data_dim["embed"], "final_ln": data_dim["final_ln"]}
    layer_specs = jax.tree.map(lambda _: P("pipe"), stage_layers)
    layer_grad_specs = jax.tree.map(lambda dim: P("pipe", *[None] * (dim + 1), "data") if dim >= 0 else P("pipe"),
                                    data_dim["layers"])
    others_specs = jax.tree.map(lambda dim: P(*[None] * dim, "data") if dim >= 0 else P(), others_dim)
    fn = jax.shard_map(
        stage_program, mesh=mesh, axis_names={"pipe", "data"},
        in_specs=(layer_specs, P(), P(None, "data"), P(), P()),
        out_specs=(P(), layer_grad_specs, others_specs),
    )
    loss, layer_grads, other_grads = fn(stage_layers, others, micro, key_data, rows)
    grads = {"layers": from_stages(layer_grads), **other_grads}
    grads = jax.tree.map(lambda g, a: g.astype(a.dtype), grads, params)
    return loss, grads


def make_loss_and_grad(cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh, microbatches: int):
    """jit(params, batch, key) → (loss, grads), the pipelined counterpart of train_step.make_loss_and_grad."""
    param_sh = jax.tree.map(lambda spec: NamedSharding(mesh, spec), M.param_specs(parallel))
    replicated = NamedSharding(mesh, P())
    fn = partial(pipeline_loss_and_grad, cfg=cfg, parallel=parallel, remat=remat, mesh=mesh,
                 microbatches=microbatches)
    return jax.jit(
        fn,
        in_shardings=(param_sh, {"inputs": batch_sharding(mesh), "targets": batch_sharding(mesh)}, replicated),
        out_shardings=(replicated, param_sh),
    )


def stash_layout(cfg: ModelConfig, parallel: ParallelConfig, remat: str, mesh, microbatches: int,
                 micro_batch_size: int):
    """(avals of one stash slot, avals of the residuals taken from the weights and keys instead): what
    one micro-batch chunk keeps between its forward and its backward, per stage and data rank (global over
    tensor)."""
    seen = {}
    params = jax.eval_shape(lambda: M.init_params(jax.random.key(0), cfg, parallel.tensor))
    tokens = jax.ShapeDtypeStruct((micro_batch_size * microbatches, cfg.seq_len), jnp.int32)
    with jax.set_mesh(mesh):
        jax.eval_shape(partial(pipeline_loss_and_grad, cfg=cfg, parallel=parallel, remat=remat, mesh=mesh,
                               microbatches=microbatches, inspect=lambda a, b: seen.update(stash=a, reused=b)),
                       params, {"inputs": tokens, "targets": tokens}, jax.random.key(0))
    return seen["stash"], seen["reused"]
