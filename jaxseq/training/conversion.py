"""Hugging Face weights in and out (GPT-2, Llama, Mixtral and Qwen3-MoE), the Python API behind
`python -m jaxseq.convert`: `from_hf`, `to_hf`, and `load_hf`, `load`, `logits` to compute logits on any mesh.

config.json's model_type picks the format module (interop/hf.py for gpt2, interop/hf_llama.py for llama,
interop/hf_mixtral.py for mixtral, interop/hf_qwen3_moe.py for qwen3_moe);
a jaxseq model's family picks it back (the model_type each family declares for it, `hf_model_type`).

Why the converted checkpoint is a jaxseq run directory (config.json + an orbax checkpoint at step 0,
written by `jaxseq.training.checkpoint`): then one reader serves converted weights and trained runs alike,
restoring onto any mesh re-pads the vocabulary (`checkpoint.resize_vocab`), and `to-hf` of a trained
run is the same code path as the round trip; the directory's format belongs to `jaxseq.training.rundir`. OUT also
keeps `hf/` (the original config, tokenizer files, tensor names/dtypes and buffers) so that from-hf → to-hf
reproduces every tensor exactly.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import (ARCHITECTURE_FIELDS, ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, RunConfig,
                           TrainConfig, replace, validate_model)
from jaxseq.interop import hf, hf_llama, hf_mixtral, hf_qwen3_moe
from jaxseq.mesh import available_devices, make_mesh, mesh_parallel
from jaxseq.models import model
from jaxseq.parallel.layout import Layout
from jaxseq.sharding import Sharder, batch_sharding
from jaxseq.training import checkpoint
from jaxseq.training import rundir

HF_SUBDIR = "hf"  # inside a converted directory: what travels back out with to-hf

# ---------------------------------------------------------------------------------------------
# Python API


# config.json's model_type → the module that reads and writes it
FORMATS = {"gpt2": hf, "llama": hf_llama, "mixtral": hf_mixtral, "qwen3_moe": hf_qwen3_moe}


def hf_format(cfg: ModelConfig) -> str:
    """The model_type a jaxseq model's weights convert to, as its family declares it (`hf_model_type`)."""
    return model.FAMILIES[cfg.family].hf_model_type(cfg)


def read_hf(hf_dir: str, dtype: str = "float32"):
    """(config.json, cfg, params as hf.Leaf read on demand, record, buffers) of a local HF directory; every
    refusal (an unknown model_type, a feature jaxseq lacks, a tensor that disagrees) before any weight is read."""
    config = hf.read_config(hf_dir)
    if config.get("model_type") not in FORMATS:
        raise ConfigError(f"config.json: model_type={config.get('model_type')!r} is not supported by jaxseq "
                          f"(only {' / '.join(repr(t) for t in FORMATS)})")
    fmt = FORMATS[config["model_type"]]
    cfg = fmt.model_config(config, dtype)
    validate_model(cfg)
    weights = hf.open_weights(hf_dir)
    leaves, record, buffers = fmt.to_params(cfg, weights)
    record = {**record, "metadata": weights.metadata}
    return config, cfg, leaves, record, buffers


def load_hf(hf_dir: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(cfg, params) of a local Hugging Face GPT-2, Llama, Mixtral or Qwen3-MoE directory; params are NumPy float32
    (dropout 0), the vocabulary leaves unpadded."""
    _, cfg, leaves, _, _ = read_hf(hf_dir, dtype)
    return replace(cfg, dropout=0.0), jax.tree.map(lambda leaf: leaf.whole(), leaves,
                                                   is_leaf=lambda x: isinstance(x, hf.Leaf))



def load(path: str, dtype: str = "float32", mesh=None) -> tuple[ModelConfig, dict]:
    """(cfg, params) of a converted directory, a run directory (newest checkpoint) or one checkpoint
    step directory (RUN/checkpoints/N), dropout 0; params on `mesh` (default: every device, tensor-parallel
    as far as the heads split), read shard by shard."""
    cfg = rundir.saved_model(path)
    mesh = rundir.resolve_mesh(cfg, None, available_devices())[1] if mesh is None else mesh
    restored = rundir.restore(path, mesh_parallel(mesh), mesh)
    return replace(restored.model, dtype=dtype, dropout=0.0), restored.params


def logits(params: dict, tokens, cfg: ModelConfig, mesh=None, sequence_parallel: bool = False) -> np.ndarray:
    """Next-token logits [b, s, vocab_size] (float32, NumPy) for token ids [b, s], s ≤ cfg.seq_len.

    mesh=None runs on one device; with a data × tensor mesh (`jaxseq.mesh.make_mesh`) the batch is
    split over `data` and the model over `tensor` (sequence parallel if asked: s divisible by tensor).
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] > cfg.seq_len:
        raise ConfigError(f"tokens of shape {tokens.shape}: expected [batch, ≤{cfg.seq_len}]")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        raise ConfigError(f"token ids must lie in [0, {cfg.vocab_size}); got {tokens.min()}..{tokens.max()}")
    if mesh is None:
        mesh = make_mesh(ParallelConfig(), jax.local_devices()[:1])
    params = rundir.place(params, cfg, mesh, sequence_parallel)
    tokens = jax.make_array_from_callback(tokens.shape, batch_sharding(mesh), lambda idx: tokens[idx])
    return np.asarray(_logits_fn(cfg, mesh, sequence_parallel)(params, tokens))[..., : cfg.vocab_size]


@lru_cache(maxsize=8)
def _logits_fn(cfg: ModelConfig, mesh, sequence_parallel: bool):
    shard = Sharder(mesh, sequence_parallel)
    return jax.jit(lambda p, t: model.logits_fn(p, model.hidden_states(p, t, cfg, shard, "none"), cfg, shard))


def from_hf(hf_dir: str, out: str, mesh_text: str | None = None) -> ModelConfig:
    """Convert a local HF GPT-2, Llama, Mixtral or Qwen3-MoE directory into a jaxseq checkpoint directory (step 0,
    the weights alone), reading each HF tensor only for the device shards that need it, straight into the shards of
    the mesh."""
    _, cfg, leaves, record, buffers = read_hf(hf_dir)
    ckpt = rundir.checkpoint_dir(out)
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        raise ConfigError(f"{out!r} already holds checkpoints; choose an empty OUT")
    parallel, mesh = _layout(cfg, mesh_text)
    side = os.path.join(out, HF_SUBDIR)
    hf.copy_side_files(hf_dir, side)
    if os.path.isfile(os.path.join(side, "tokenizer.json")):
        hf.copy_side_files(side, out, ["tokenizer.json"])
    tokenizer = os.path.abspath(os.path.join(out, "tokenizer.json")) if os.path.isfile(
        os.path.join(out, "tokenizer.json")) else None
    with open(os.path.join(side, "record.json"), "w") as f:
        json.dump(record, f, indent=1)
    if buffers:
        hf.safetensors_numpy().save_file(buffers, os.path.join(side, "buffers.safetensors"))
    run = RunConfig(model=cfg, parallel=ParallelConfig(), optimizer=OptimizerConfig(),
                    train=TrainConfig(steps=0, run_dir=out, tokenizer=tokenizer))
    rundir.write_config(out, run)
    # The weights alone, as Megatron's converters write them (a run starts from them with fresh optimizer
    # moments: --init-from): zero moments would triple what the devices and the checkpoint hold.
    weights_only = {"step": jnp.zeros((), jnp.int32), "params": _on_mesh(leaves, cfg, parallel, mesh)}
    mgr = checkpoint.manager(ckpt, async_save=False)
    checkpoint.save(mgr, 0, weights_only, rundir.checkpoint_meta(run, 0, source=os.path.abspath(hf_dir)), force=True)
    mgr.wait_until_finished()
    return cfg


def _layout(cfg: ModelConfig, mesh_text: str | None):
    """The conversion's mesh (--mesh; by default every device) with the float32 weights split over `data`
    too (the distributed optimizer's layout): each device holds the least it can."""
    parallel, mesh = rundir.resolve_mesh(cfg, mesh_text, available_devices())
    return replace(parallel, distributed_optimizer=parallel.data > 1), mesh


def _on_mesh(leaves: dict, cfg: ModelConfig, parallel: ParallelConfig, mesh) -> dict:
    """hf.Leaf params as arrays in the train step's master shards: each device's block is read (one HF
    tensor at a time) by the callback for that device; vocabulary rows past the real ones are zeros."""
    def array(leaf, shape, sharding):
        def block(idx):
            rows = range(shape[0])[idx[0]]
            inside = slice(min(rows.start, leaf.shape[0]), min(rows.stop, leaf.shape[0]))
            part = leaf.read((inside, *idx[1:]))
            return np.concatenate([part, np.zeros((len(rows) - len(part), *part.shape[1:]), part.dtype)])

        return jax.make_array_from_callback(shape, sharding, block)

    layout = Layout(cfg, parallel, mesh)
    return jax.tree.map(array, leaves, layout.param_shapes, layout.master_shardings,
                        is_leaf=lambda x: isinstance(x, (hf.Leaf, tuple)))


class _OnHost:
    """A restored (sharded) parameter as `hf.from_params` reads it: `[i]` brings layer i of a stacked leaf
    to the host, `np.asarray` the whole of an unstacked one: one tensor on the host at a time."""

    def __init__(self, x: jax.Array):
        self.x, self.shape = x, x.shape

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(_layer(self.x, i))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.x, dtype)


@jax.jit
def _layer(x: jax.Array, i) -> jax.Array:
    """Layer i of a stacked leaf [L, ...] however its layers are split (pipe; data with the distributed
    optimizer), compiled once per leaf shape. A masked sum over the layers, which XLA partitions into a local
    sum and one layer's all-reduce: a dynamic index over a split dimension gathers the whole leaf onto every
    device. Summed as the bits (unsigned integers, one non-zero term) so −0.0 and NaNs come back exactly."""
    chosen = (jnp.arange(x.shape[0]) == i).reshape((-1,) + (1,) * (x.ndim - 1))
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    return jax.lax.bitcast_convert_type(jnp.sum(jnp.where(chosen, bits, 0), axis=0, dtype=bits.dtype), x.dtype)


def to_hf(path: str, out: str, mesh_text: str | None = None, max_shard_bytes: int = 5 * 10**9) -> ModelConfig:
    """Write a checkpoint as an HF directory that `transformers` loads (GPT2LMHeadModel, LlamaForCausalLM):
    restored onto the mesh shard by shard, written one tensor at a time (sharded files over max_shard_bytes).

    A converted directory gives back its original names, dtypes, buffers and config.json (byte for
    byte, while the architecture is unchanged); a run trained in jaxseq gets a generated config."""
    parallel, mesh = _layout(rundir.saved_model(path), mesh_text)
    restored = rundir.restore(path, parallel, mesh)
    cfg, tokenizer = restored.model, restored.tokenizer
    side = os.path.join(rundir.split_step(path)[0], HF_SUBDIR)
    fmt = FORMATS[hf_format(cfg)]
    record, buffers, metadata, original = None, None, None, None
    if os.path.isfile(os.path.join(side, "record.json")):
        record = json.load(open(os.path.join(side, "record.json")))
        metadata = record.pop("metadata", None)
        if os.path.isfile(os.path.join(side, "buffers.safetensors")):
            buffers = hf.safetensors_numpy().load_file(os.path.join(side, "buffers.safetensors"))
        if not record.get("tied"):  # a Llama converted tied (before they were refused): its config.json says tied
            original = fmt.model_config(json.load(open(os.path.join(side, "config.json"))))
    params = jax.tree.map(_OnHost, restored.params)
    tensors, config = fmt.from_params(cfg, params, record, buffers), fmt.hf_config(cfg)
    keep_config = original is not None and all(
        getattr(original, k) == getattr(cfg, k) for k in ARCHITECTURE_FIELDS)
    hf.write_dir(out, config, tensors, metadata, max_shard_bytes)
    if os.path.isdir(side):
        hf.copy_side_files(side, out, [n for n in hf.SIDE_FILES if n != "config.json" or keep_config])
    elif tokenizer and os.path.isfile(tokenizer):
        hf.copy_side_files(os.path.dirname(tokenizer), out, [os.path.basename(tokenizer)])
    return cfg
