"""Sampling from a model's parameters with a KV cache, on one device or on a mesh (the end-of-run sample;
`python -m jaxseq.generate` is the command).

The prompt is processed once (`_prefill`: the whole window, writing every layer's keys and values into the
cache), then each new token is one step against the cache (`_decode`); both are compiled once per shape.
The cache is [layers, batch, seq_len, K/V heads, head_dim] per K and V, heads split over `tensor` like the
attention's. Positions are absolute (learned, or rotary from 0), so when the window is full (seq_len tokens)
it slides by recomputing the last seq_len tokens for every further token, as sampling without a cache did.

On a mesh the weights are in the sampling layout (`sampling_parallel`): the devices of pipe × tensor split
the heads, the MLP and the vocabulary, data ranks hold copies and compute the same tokens. Why not sample
through the pipeline: one sequence has no micro-batches to overlap, so p − 1 stages would idle at every
token while each token still crosses every stage; split over p·t devices instead, every device works on
every token and holds the same share of the layer weights as in training (`resharding` moves them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import ConfigError, ModelConfig, ParallelConfig
from jaxseq.mesh import logical_rules, make_mesh, mesh_parallel
from jaxseq.models import model
from jaxseq.parallel.layout import Layout, on_device
from jaxseq.sharding import Sharder
from jaxseq.training import checkpoint
from jaxseq.training.data import BYTE_EOD, Corpus, decode_tokens, encode_text, load_tokenizer

# ---------------------------------------------------------------------------------------------
# The sampling layout


@dataclass(frozen=True)
class OneSequence(Sharder):
    """The model's sharding rules with the batch (one sequence) replicated: every data rank computes it."""

    @property
    def rules(self) -> dict[str, str | None]:
        return {**logical_rules(False), "batch": None}


def sampling_parallel(cfg: ModelConfig, parallel: ParallelConfig) -> ParallelConfig:
    """The layout sampling runs in on the same devices: tensor = the largest divisor of pipe × tensor that
    divides the heads and the MLP width (a multiple of `tensor`), no pipeline, data = the rest."""
    group = parallel.pipe * parallel.tensor
    fits = lambda t: (cfg.heads % t == 0 and cfg.mlp_hidden % t == 0
                      and (cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0))
    tensor = max(t for t in range(1, group + 1) if group % t == 0 and fits(t))
    return ParallelConfig(data=parallel.num_devices // tensor, tensor=tensor)


def sampling_mesh(cfg: ModelConfig, mesh) -> jax.sharding.Mesh:
    """The sampling layout's mesh over `mesh`'s devices in the same order (one program can then move the
    weights from one to the other): each tensor group is consecutive devices, i.e. within a host."""
    return make_mesh(sampling_parallel(cfg, mesh_parallel(mesh)), list(mesh.devices.flat))


def resharding(cfg: ModelConfig, mesh):
    """(jit: params as the train state holds them on `mesh` → params in the sampling layout and compute dtype,
    the sampling mesh). One program moves every weight from its training shards (any pipe, tensor and
    distributed-optimizer split) to its sampling shards; nothing is gathered whole."""
    target = sampling_mesh(cfg, mesh)
    shardings = Layout(cfg, mesh_parallel(target), target).param_shardings
    rows = cfg.padded_vocab(target.shape["tensor"])
    move = lambda params: checkpoint.resize_vocab(model.cast_params(on_device(params), cfg), rows, shardings)
    return jax.jit(move, out_shardings=shardings), target


# ---------------------------------------------------------------------------------------------
# Prefill and decode against the cache


def _attend(q, k, v, start, cfg: ModelConfig):
    """q [b, n, a, d] at positions start … start + n − 1 against the cached k, v [b, S, kv, d] (causal; each
    group of a/kv query heads shares one K/V head)."""
    b, n, a, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, n, kv, a // kv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / math.sqrt(cfg.head_dim)
    visible = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(n)[:, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, n, a, d)


def _forward(params, tokens, cache, start, cfg: ModelConfig, shard: Sharder):
    """Final-norm hidden states of tokens [b, n] at positions start …, and the cache with their keys and values."""
    family = model.family(cfg)
    x = family.decode_embed(params, tokens, start, cfg, shard)
    attend = lambda q, k, v: _attend(q, k, v, start, cfg)

    def step(carry, layer):
        (x, cache), (p, i) = carry, layer
        return family.decode_layer(x, p, cache, i, start, cfg, shard, attend), None

    (x, cache), _ = jax.lax.scan(step, (x, cache), (params["layers"], jnp.arange(cfg.layers)))
    return model.final_norm(params, x, cfg), cache


def _choose(params, x, key, temperature, cfg: ModelConfig, shard: Sharder, top_k: int):
    """A token drawn from the logits of x [b, 1, h] (top-k, temperature), [b] int32."""
    logits = model.logits_fn(params, x, cfg, shard)[:, 0, : cfg.vocab_size]
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return shard(jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1), "batch")


@partial(jax.jit, static_argnames=("cfg", "shard", "top_k"))
def _prefill(params, window, length, key, i, temperature, cfg: ModelConfig, shard: Sharder, top_k: int):
    """Token i of a sample (drawn with fold_in(key, i)): the token after window[:, :length] ([b, seq_len],
    the rest padding), and a cache holding the window's keys and values (those past `length` are overwritten
    before any query can see them)."""
    params, key = model.cast_params(params, cfg), jax.random.fold_in(key, i)
    b, s = window.shape
    heads = model.family(cfg).cache_heads(cfg, shard.tensor)
    empty = shard(jnp.zeros((cfg.layers, b, s, heads, cfg.head_dim), jnp.dtype(cfg.dtype)),
                  "layers", "batch", None, "heads", None)
    x, cache = _forward(params, window, (empty, empty), 0, cfg, shard)
    last = jax.lax.dynamic_slice_in_dim(x, length - 1, 1, axis=1)
    return _choose(params, last, key, temperature, cfg, shard, top_k), cache


@partial(jax.jit, static_argnames=("cfg", "shard", "top_k"), donate_argnames=("cache",))
def _decode(params, cache, token, position, key, i, temperature, cfg: ModelConfig, shard: Sharder, top_k: int):
    """Token i of a sample (fold_in(key, i)): the token after `token` [b] (at `position`, the cache holding
    every earlier one), and the cache with it."""
    params, key = model.cast_params(params, cfg), jax.random.fold_in(key, i)
    x, cache = _forward(params, token[:, None], cache, position, cfg, shard)
    return _choose(params, x, key, temperature, cfg, shard, top_k), cache


def sample(params, cfg: ModelConfig, prompt: list[int], max_tokens: int, temperature: float = 0.8,
           top_k: int = 40, seed: int = 0, mesh=None, programs: Sampler | None = None,
           stop: Callable[[], bool] | None = None) -> list[int]:
    """max_tokens token ids after `prompt` (non-empty: `prompt_ids`). `params` on one device (mesh None) or in
    the sampling layout on `mesh` (`resharding`, `rundir.restore` with `sampling_parallel`), or with
    `programs` compiled ahead (`compile_sampler`, which fixed the layout and top_k) on its `reshard` output.
    `stop`, asked before each token: True ends the sample there, with the tokens drawn so far (a run's
    signal: the sample must not hold a preempted process)."""
    if not prompt:
        raise ConfigError("the prompt is empty: start it with the tokenizer's document start (prompt_ids)")
    if max(prompt) >= cfg.vocab_size or min(prompt) < 0:
        raise ConfigError(f"the prompt holds token id {max(prompt) if max(prompt) >= cfg.vocab_size else min(prompt)}, "
                          f"outside the model's vocabulary of {cfg.vocab_size} ids (0..{cfg.vocab_size - 1})")
    if programs is None:
        static = dict(cfg=cfg, shard=OneSequence(mesh), top_k=min(top_k, cfg.vocab_size))
        programs = Sampler(reshard=None, prefill=partial(_prefill, **static), decode=partial(_decode, **static))
    tokens, key, cache, filled = list(prompt), jax.random.key(seed), None, 0
    for i in range(max_tokens):
        if stop is not None and stop():
            break
        if filled in (0, cfg.seq_len):  # the first token, or a full window sliding by one: recompute it
            context = tokens[-cfg.seq_len:]
            window = np.zeros((1, cfg.seq_len), np.int32)
            window[0, : len(context)] = context
            token, cache = programs.prefill(params, window, len(context), key, i, temperature)
            filled = len(context)
        else:
            token, cache = programs.decode(params, cache, np.asarray([tokens[-1]], np.int32), filled, key, i,
                                           temperature)
            filled += 1
        tokens.append(int(np.asarray(token)[0]))
    return tokens[len(prompt):]


@dataclass(frozen=True, kw_only=True)
class Sampler:
    """A sample's programs: compiled ahead by `compile_sampler` for a run's end-of-run sample (before its
    first step, so that the fit check covers them and nothing compiles after the last step), or the jitted
    functions `sample` uses by default."""

    reshard: Callable | None  # the train state's params → the sampling layout (`resharding`)
    prefill: Callable  # (params, window, length, key, i, temperature) → (token, cache)
    decode: Callable  # (params, cache, token, position, key, i, temperature) → (token, cache)


def compile_sampler(params, cfg: ModelConfig, mesh, top_k: int = 40, temperature: float = 0.8) -> Sampler:
    """The end-of-run sample's three programs compiled for `params` as the train state holds them on `mesh`
    (arrays or ShapeDtypeStructs with shardings)."""
    move, target = resharding(cfg, mesh)
    reshard = move.lower(params).compile()
    sampling = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            jax.eval_shape(move, params), reshard.output_shardings)
    static = dict(cfg=cfg, shard=OneSequence(target), top_k=min(top_k, cfg.vocab_size))
    key, window = jax.random.key(0), np.zeros((1, cfg.seq_len), np.int32)
    prefill = _prefill.lower(sampling, window, 1, key, 0, temperature, **static).compile()
    _, cache = prefill.output_shardings
    cache = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                         jax.eval_shape(partial(_prefill, **static), sampling, window, 1, key, 0, temperature)[1],
                         cache)
    decode = _decode.lower(sampling, cache, np.zeros((1,), np.int32), 1, key, 1, temperature, **static).compile()
    return Sampler(reshard=reshard, prefill=prefill, decode=decode)


# ---------------------------------------------------------------------------------------------
# Prompts

# Special tokens that start (or separate) documents, most common first.
DOCUMENT_TOKENS = ("<|endoftext|>", "<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "</s>", "<eos>")


def document_start(tokenizer_path: str | None, vocab_size: int) -> list[int]:
    """What an empty prompt stands for: the start of a document. The tokenizer's own end-of-text / beginning-
    of-sequence token where it has one (GPT-2's <|endoftext|>, <s>, …), else its only special token, else a
    newline as the tokenizer encodes it; for bytes the end-of-document id (BYTE_EOD) that ends every document
    of a byte-level corpus, or a newline for a model of the 256 byte values alone."""
    if tokenizer_path is None:
        return [BYTE_EOD] if vocab_size > BYTE_EOD else list(b"\n")
    tok = load_tokenizer(tokenizer_path)
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for name in DOCUMENT_TOKENS:
        if name in special:
            return [special[name]]
    if len(special) == 1:
        return list(special.values())
    return tok.encode("\n").ids


def prompt_ids(text: str, tokenizer_path: str | None, vocab_size: int) -> list[int]:
    """The prompt's token ids; an empty prompt is the start of a document (`document_start`)."""
    return encode_text(text, tokenizer_path) if text else document_start(tokenizer_path, vocab_size)


def validation_prompt(corpus: Corpus, max_tokens: int) -> str:
    """The end-of-run sample's prompt: the first line of the validation split (the start of a validation
    document), at most max_tokens tokens; text of the run's own corpus, whatever its language."""
    text = decode_tokens([int(t) for t in corpus.val[:max_tokens]], corpus.tokenizer).lstrip("\n")
    return text.split("\n", 1)[0] + "\n" if "\n" in text else text
