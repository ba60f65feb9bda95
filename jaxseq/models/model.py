"""The model, whatever its family: the one door through which the train step, the pipeline executor, the
sampler, the planner and the converters reach it.

A family (models/gpt.py, models/llama.py) is one file: its parameter table, `embed`, `block`, `final_norm`,
`logits`, its KV-cache forms for sampling, its `TRAITS` (what the cost side reads) and `validate` (its own
configuration fields). Everything else is the same for every family and lives here:
the trees derived from the table (models/params.py), the layer stack under `lax.scan` and
`jax.checkpoint`, the loss. Adding a family is one file plus its entry in FAMILIES and a preset.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache, partial
from types import ModuleType

import jax
import jax.numpy as jnp

from jaxseq.config import ModelConfig, ParallelConfig, register_family
from jaxseq.mesh import FSDP_AXIS, logical_rules, logical_to_spec
from jaxseq import offload as host_offload
from jaxseq.remat import ATTN_SOFTMAX_STATS, remat_policy, segments
from jaxseq.models import documents, fp8, gpt, llama, moe
from jaxseq.models import params as decl
from jaxseq.models.ops import cross_entropy
from jaxseq.sharding import Sharder

FAMILIES: dict[str, ModuleType] = {"gpt": gpt, "llama": llama, "moe": moe}


def _register_families() -> None:
    """Each family here a valid `ModelConfig.family` whose own fields its `validate` checks, where config.validate
    checks the rest at the edge (`config.validate_family`: the base layer cannot import the families)."""
    for name, module in FAMILIES.items():
        register_family(name, module.validate)


_register_families()


def family(cfg: ModelConfig) -> ModuleType:
    return FAMILIES[cfg.family]


def traits(cfg: ModelConfig) -> decl.Traits:
    """What the cost side reads of `cfg`'s family (models/params.py, `Traits`)."""
    return family(cfg).TRAITS


def compile_options(cfg: ModelConfig, platform: str) -> dict:
    """The XLA options `cfg`'s programs compile with on `platform` ("cpu", "gpu"): an FP8 model's on a GPU, under which
    its FP8 GEMMs become cuBLASLt's FP8 GEMMs (`fp8.GPU_OPTIONS`); else none."""
    return dict(fp8.GPU_OPTIONS) if cfg.fp8 and platform == "gpu" else {}


def shape_label(cfg: ModelConfig) -> str:
    """The family's shape fields beyond GPT's (" kv_heads=8 f=14336" for a Llama), for a plan's header."""
    return "".join(f" {label}={getattr(cfg, name)}" for label, name in traits(cfg).shape_fields)


# ---------------------------------------------------------------------------------------------
# Parameters, from the family's table


def param_table(cfg: ModelConfig, tensor: int = 1) -> dict:
    return family(cfg).table(cfg, tensor)


def param_axes(cfg: ModelConfig, tensor: int = 1) -> dict:
    """Logical axes of every parameter."""
    return decl.derive(param_table(cfg, tensor), lambda p: p.axes)


def param_specs(cfg: ModelConfig, parallel: ParallelConfig) -> dict:
    """PartitionSpecs of the weights as the step holds them (`mesh.logical_rules` of `param_axes`): split over
    `tensor` (and the stacked layers over `pipe`, a mixture's experts over `expert`), replicated over `data`; under
    FSDP each weight's hidden dimension (logical axis `embed`) split over `fsdp`, gathered as a layer uses it
    (`Sharder.gather_weights`)."""
    rules = {**logical_rules(parallel.sequence_parallel, parallel.pipe > 1, expert=parallel.expert > 1),
             "embed": FSDP_AXIS if parallel.fsdp > 1 else None}
    return decl.derive(param_table(cfg, parallel.tensor), lambda p: logical_to_spec(p.axes, rules))


def num_params(cfg: ModelConfig) -> int:
    """Trainable parameters, counted from the family's table, the vocabulary unpadded (GPT: positions and the
    tied embedding included; Llama: the embedding and the lm_head)."""
    return decl.count(param_table(cfg), cfg)


def param_shapes(cfg: ModelConfig, tensor: int) -> dict:
    return decl.shapes(param_table(cfg, tensor), cfg, tensor)


def init_params(key: jax.Array, cfg: ModelConfig, tensor: int = 1) -> dict:
    return decl.init(param_table(cfg, tensor), key, cfg, tensor)


def decay_mask(cfg: ModelConfig) -> dict:
    """True where AdamW applies weight decay (kernels, token embedding); not biases, norms, positions."""
    return decl.derive(param_table(cfg), lambda p: p.decay)


def cast_mask(cfg: ModelConfig) -> dict:
    """True where a parameter is copied to the compute dtype; norm parameters stay float32."""
    return decl.derive(param_table(cfg), lambda p: p.cast)


def sign_update_mask(cfg: ModelConfig) -> dict:
    """True where the optimizer moves a parameter by −rate·sign(gradient) rather than AdamW (`Param.update`)."""
    return decl.derive(param_table(cfg), lambda p: p.update == "sign")


def vocab_mask(cfg: ModelConfig) -> dict:
    """True where a parameter's rows are the padded vocabulary V (re-padded when the tensor size changes)."""
    return decl.derive(param_table(cfg), lambda p: p.dims[0] == "V")


@lru_cache(maxsize=None)
def _paths(first_dim: str) -> frozenset[tuple[str, ...]]:
    """The paths (key names) of every family's parameters whose rows are `first_dim`."""
    paths = set()
    for name in FAMILIES:
        leaves = jax.tree_util.tree_leaves_with_path(param_table(ModelConfig(family=name)), is_leaf=decl.is_param)
        paths |= {tuple(k.key for k in path) for path, p in leaves if p.dims[0] == first_dim}
    return frozenset(paths)


def vocab_paths() -> frozenset[tuple[str, ...]]:
    """Where a parameter tree of any family holds vocabulary rows ("embed"/"token", "lm_head"/"kernel"): a
    checkpoint's are re-padded when the tensor size changes, whatever model wrote it."""
    return _paths("V")


def position_paths() -> frozenset[tuple[str, ...]]:
    """Where a parameter tree holds position rows (a shorter seq_len may cut them)."""
    return _paths("s")


def saved_model_fields(model: dict) -> dict:
    """A saved model config's fields, with what a field added since means for a run saved before it: GPT's Q, K
    and V were one weight until `fused_qkv` (2026-12-04), so a GPT run saved without the field keeps them so."""
    if model.get("family", "gpt") == "gpt" and "fused_qkv" not in model:
        return {**model, "fused_qkv": True}
    return model


def layer_axes(cfg: ModelConfig, tensor: int) -> dict:
    return family(cfg).layer_axes(cfg, tensor)


def cast_params(params, cfg: ModelConfig, shard: Sharder | None = None):
    """Compute-dtype copy of the weights, made once per step *outside* the scan (a cast inside a
    layer would be stored for backward as if it were an activation). Where `shard` gathers the weights over
    `fsdp` itself (`Sharder.casts_at_gather`) they stay float32 here: each is cast as it is gathered, so its
    gradient is reduce-scattered in float32 into its float32 master shard."""
    if shard is not None and shard.casts_at_gather:
        return params
    dtype = jnp.dtype(cfg.dtype)
    return jax.tree.map(lambda p, cast: p.astype(dtype) if cast else p, params, cast_mask(cfg))


# ---------------------------------------------------------------------------------------------
# The forward pass


def embed(group, tokens, key, cfg: ModelConfig, shard: Sharder):
    """tokens [b, s] → the first block's input, from the embedding group params["embed"]."""
    group = shard.gather_weights(group, axes=param_axes(cfg, shard.tensor)["embed"], cast=cast_mask(cfg)["embed"],
                                 dtype=cfg.dtype)
    return family(cfg).embed(group, tokens, key, cfg, shard)



def block(x, p, key, cfg: ModelConfig, shard: Sharder):
    return family(cfg).block(x, p, key, cfg, shard)


def layers(x, stacked, keys, cfg: ModelConfig, shard: Sharder, remat: str, offload: tuple[str, ...] = ()):
    """Layers [k, …], each under jax.checkpoint with the named policy; keys [k] or None (no dropout). The whole
    stack (`decoder`) and a pipeline chunk are this. `offload`: the stored tensors sent to host memory between the
    forward and the backward (jaxseq/offload.py; each segment's policy offloads those it stores).

    `cfg.layer_loop="scan"`: under lax.scan, which keeps compile time flat in depth. Its residuals become stacked
    [k, …] buffers of the loop, which a GPU fills with zeros, copies each residual into and slices again, and each
    layer's weights are copied out of their stack (what it costs a GPU: experiments/scan_stacks.py).
    "unrolled": a Python loop (static slices, no stacks), its checkpoints kept from CSE by `prevent_cse` (which
    scan does not need: without it, CSE undoes the checkpoint of unrolled layers); compile time grows with depth.

    Under FSDP each layer's weights are gathered over `fsdp` inside the checkpointed body, just before use: no
    policy names the gathered weights, so backward gathers them again rather than keeping every layer's.

    A block spec (`remat.block_spec`, Megatron's block recompute) runs these k layers as consecutive segments, each
    under its own policy: the first N, then the rest (one scan each)."""
    runs = segments(remat, jax.tree.leaves(stacked)[0].shape[0])  # [(policy, layers)]
    if len(runs) == 1:
        return _segment(x, stacked, keys, cfg, shard, remat, offload)
    starts = [sum(count for _, count in runs[:i]) for i in range(len(runs))]
    parts = split_layers(stacked, tuple(count for _, count in runs))
    for (policy, count), start, part in zip(runs, starts, parts):
        x = _segment(x, part, None if keys is None else keys[start:start + count], cfg, shard, policy, offload)
    return x


def split_layers(stacked, sizes: tuple[int, ...]) -> list:
    """[k, …] leaves → consecutive [size, …] parts, by `lax.split` (its gradient one concatenate, as `unstack`'s)."""
    leaves, tree = jax.tree.flatten(stacked)
    split = [jax.lax.split(a, sizes, axis=0) for a in leaves]
    return [tree.unflatten([parts[i] for parts in split]) for i in range(len(sizes))]


def _segment(x, stacked, keys, cfg: ModelConfig, shard: Sharder, policy: str, offload: tuple[str, ...] = ()):
    """Layers [k, …] under one registered remat policy. A scan of one layer is no loop to XLA (it removes a loop of
    one trip), so its checkpoint is kept from CSE as unrolled layers' are."""
    axes, cast = layer_axes(cfg, shard.tensor), cast_mask(cfg)["layers"]
    count = jax.tree.leaves(stacked)[0].shape[0]

    def layer(x, p, key):
        return block(x, shard.gather_weights(p, axes=axes, cast=cast, dtype=cfg.dtype), key, cfg, shard)

    unrolled = cfg.layer_loop == "unrolled"
    placed = host_offload.policy(remat_policy(policy).policy, host_offload.for_policy(policy, offload))
    body = jax.checkpoint(layer, policy=placed, prevent_cse=unrolled or count == 1)
    if unrolled:
        for i, p in enumerate(unstack(stacked)):
            x = body(x, p, None if keys is None else keys[i])
        return x
    x, _ = jax.lax.scan(lambda x, inputs: (body(x, *inputs), None), x, (stacked, keys))
    return x


def unstack(stacked) -> list:
    """[k, …] leaves → k trees of one layer's leaves, by `lax.split`, whose gradient is one concatenate of the
    layers' gradients. Indexing (`a[i]`) would make it k zero-pads summed, which XLA:GPU fuses into the clipping
    norm's reduction as one slow kernel per weight on an H100 (experiments/results/gpu_h100_2026-11-27/)."""
    leaves, tree = jax.tree.flatten(stacked)
    count = leaves[0].shape[0]
    split = [jax.lax.split(a, (1,) * count, axis=0) for a in leaves]
    return [tree.unflatten([parts[i].reshape(parts[i].shape[1:]) for parts in split]) for i in range(count)]


def decoder(x, stacked, key, cfg: ModelConfig, shard: Sharder, remat: str, offload: tuple[str, ...] = ()):
    """Every layer; key=None: no dropout."""
    return layers(x, stacked, None if key is None else jax.random.split(key, cfg.layers), cfg, shard, remat, offload)


@lru_cache(maxsize=None)
def tagged_names(cfg: ModelConfig) -> frozenset[str]:
    """The checkpoint names one layer of `cfg` tags (its family, attention kernel and dropout decide which), read
    from the layer traced once on abstract inputs: what an `--offload` request may name (`offload.resolve`).
    cuDNN's attention traces only where cuDNN is (a GPU, JAX's CUDA plugin), and a plan or search for a GPU asks
    anywhere: its layer tags what the layer with XLA's kernel tags and the statistics its VJP keeps
    (models/cudnn_attention.py; tests/test_gpu_offload.py holds them to the cuDNN layer's, traced under `jax.vjp`)."""
    if cfg.attention == "fused" and cfg.fused_kernel == "cudnn":
        return traced_names(dataclasses.replace(cfg, fused_kernel="xla")) | {ATTN_SOFTMAX_STATS}
    return traced_names(cfg)


@lru_cache(maxsize=None)
def traced_names(cfg: ModelConfig) -> frozenset[str]:
    """The checkpoint names in one layer of `cfg` traced on abstract inputs (`tagged_names`)."""
    shapes = param_shapes(cfg, 1)["layers"]
    cast = cast_mask(cfg)["layers"]
    p = jax.tree.map(lambda shape, c: jax.ShapeDtypeStruct(shape[1:], jnp.dtype(cfg.dtype) if c else jnp.float32),
                     shapes, cast, is_leaf=lambda x: isinstance(x, tuple))
    x = jax.ShapeDtypeStruct((1, cfg.seq_len, cfg.hidden), jnp.dtype(cfg.dtype))
    key = jax.random.key(0) if cfg.dropout > 0 else None
    jaxpr = jax.make_jaxpr(lambda x, p: block(x, p, key, cfg, Sharder(None)))(x, p)
    return frozenset(_names_in(jaxpr.jaxpr))


def _names_in(jaxpr) -> set[str]:
    """The `checkpoint_name`s in a jaxpr and every jaxpr its equations hold (custom VJPs, conds, scans)."""
    names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            names.add(eqn.params["name"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    names |= _names_in(inner)
    return names


def final_norm(params, x, cfg: ModelConfig):
    return family(cfg).final_norm(params, x, cfg)


def hidden_states(params, tokens, cfg: ModelConfig, shard: Sharder, remat: str, key=None,
                  offload: tuple[str, ...] = ()):
    """tokens [b, s] → final-norm output [b, s, h] (sequence-sharded under SP). key=None: no dropout."""
    params = cast_params(params, cfg, shard)
    k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
    x = embed(params["embed"], tokens, k_embed, cfg, shard)
    x = decoder(x, params["layers"], k_layers, cfg, shard, remat, offload)
    return final_norm(params, x, cfg)


def logits_fn(params, x, cfg: ModelConfig, shard: Sharder):
    """Logits [b, s, V] (float32) sharded over vocab; padded vocabulary entries are -inf. The family's logits
    weight (`LOGITS_WEIGHT`: its group and name) as they use it: gathered over `fsdp` under FSDP. (The final
    norm's scales need no gather: no weight of that size is split over `fsdp`.)"""
    group, name = family(cfg).LOGITS_WEIGHT
    gather = partial(shard.gather_weights, axes=param_axes(cfg, shard.tensor)[group][name],
                     cast=cast_mask(cfg)[group][name], dtype=cfg.dtype)
    return family(cfg).logits({**params, group: {**params[group], name: gather(params[group][name])}}, x, cfg, shard)


def head_loss(params, x, targets, cfg: ModelConfig, shard: Sharder):
    """The mean cross-entropy of the last layer's output x: final norm, logits, loss."""
    return cross_entropy(logits_fn(params, final_norm(params, x, cfg), cfg, shard), targets)


def packed_documents(tokens, cfg: ModelConfig) -> documents.Documents | None:
    """The packed documents of `tokens` [..., s] (natural order) where the model masks them, else None."""
    return documents.of_tokens(tokens, cfg.eod_token) if cfg.document_mask else None


def loss_fn(params, batch, cfg: ModelConfig, shard: Sharder, remat: str, key=None, offload: tuple[str, ...] = ()):
    """Next-token loss of batch = {"inputs": [b, s], "targets": [b, s]} (int32), in natural order.

    Where the sequence is split over `context`, the tokens are reordered here, once, into the stored order
    (`Sharder.split_sequence`: rank r keeps chunks r and 2c−1−r of 2c); the loss is a mean over tokens,
    unchanged. Inside a region manual over `context` (`StageSharder`) it is the mean over this rank's tokens.
    With `cfg.document_mask` the packed documents are read from the inputs, in natural order, and travel with the
    tokens in `shard` (`with_documents`)."""
    shard = shard.with_documents(documents.split(packed_documents(batch["inputs"], cfg), shard.split_sequence))
    batch = {name: shard.split_sequence(t) for name, t in batch.items()}
    x = hidden_states(params, batch["inputs"], cfg, shard, remat, key, offload)
    return cross_entropy(logits_fn(params, x, cfg, shard), batch["targets"])
