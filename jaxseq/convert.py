"""GPT-2 weights in and out: `python -m jaxseq.convert from-hf HF_DIR OUT` / `to-hf RUN_DIR_OR_CKPT OUT`,
and a small Python API (`load_hf_gpt2`, `load`, `logits`) to compute logits on any mesh.

Why the converted checkpoint is a jaxseq run directory (config.json + an orbax checkpoint at step 0,
written by `jaxseq.checkpoint`): then one reader serves converted weights and trained runs alike,
restoring onto any mesh re-pads the vocabulary (`checkpoint.restore`), and `to-hf` of a trained run is
the same code path as the round trip. OUT also keeps `hf/` (the original config, tokenizer files,
tensor names/dtypes and buffers) so that from-hf → to-hf reproduces every tensor exactly.
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxseq import checkpoint as C
from jaxseq import cli
from jaxseq import hf
from jaxseq import model as M
from jaxseq import train_step as T
from jaxseq.config import (ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, RunConfig, TrainConfig,
                           replace, validate_model)
from jaxseq.mesh import Sharder, make_mesh

HF_SUBDIR = "hf"  # inside a converted directory: what travels back out with to-hf
ARCHITECTURE = ("vocab_size", "hidden", "heads", "layers", "mlp_ratio", "ln_eps", "kv_channels")

# ---------------------------------------------------------------------------------------------
# Python API


def load_hf_gpt2(hf_dir: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(cfg, params) of a local Hugging Face GPT-2 directory; params are NumPy float32 (dropout 0)."""
    config, tensors, _ = hf.read_dir(hf_dir)
    cfg = replace(hf.model_config(config, dtype), dropout=0.0)
    params, _, _ = hf.to_params(cfg, tensors, cfg.padded_vocab(1))
    return cfg, params


def load(path: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(cfg, params) of a converted directory, a run directory (newest checkpoint) or one checkpoint
    step directory (RUN/checkpoints/N); params on one device, dropout 0."""
    cfg, params, _, _ = _restore(path)
    return replace(cfg, dtype=dtype, dropout=0.0), params


def place(params: dict, cfg: ModelConfig, mesh, sequence_parallel: bool = False) -> dict:
    """Params padded for the mesh's tensor size and sharded as the train step shards them."""
    tensor = mesh.shape["tensor"]
    params = resize_vocab(params, cfg.padded_vocab(tensor))
    specs = T.param_specs(cfg, ParallelConfig(mesh.shape["data"], tensor, sequence_parallel))
    return jax.tree.map(lambda x, s: _put(x, NamedSharding(mesh, s)), params, specs)


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
    params = place(params, cfg, mesh, sequence_parallel)
    tokens = _put(tokens, T.batch_sharding(mesh))
    return np.asarray(_logits_fn(cfg, mesh, sequence_parallel)(params, tokens))[..., : cfg.vocab_size]


@lru_cache(maxsize=8)
def _logits_fn(cfg: ModelConfig, mesh, sequence_parallel: bool):
    shard = Sharder(mesh, sequence_parallel)
    return jax.jit(lambda p, t: M.logits_fn(p, M.hidden_states(p, t, cfg, shard, "none"), cfg, shard))


def resize_vocab(params: dict, rows: int) -> dict:
    """Pad (zeros) or cut the token embedding to `rows`; rows past the vocabulary are never used."""
    token = np.asarray(params["embed"]["token"])
    if token.shape[0] != rows:
        new = np.zeros((rows, token.shape[1]), token.dtype)
        new[: min(rows, token.shape[0])] = token[:rows]
        params = {**params, "embed": {**params["embed"], "token": new}}
    return params


def _put(x, sharding: NamedSharding):
    """Host array → global array; every process holds the whole host copy (multi-process safe)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


# ---------------------------------------------------------------------------------------------
# Starting a training run from converted (or trained) weights: what `train --init-from DIR` calls


def init_model(path: str, model: ModelConfig, seq_len: int | None = None) -> ModelConfig:
    """The run's model: the architecture saved in `path`, the rest (dropout, dtype, attention) from
    `model`; seq_len from the checkpoint unless a shorter one is asked for (positions are cut)."""
    saved = _saved_model(path)
    if seq_len is not None and seq_len > saved.seq_len:
        raise ConfigError(f"seq_len={seq_len} exceeds the {saved.seq_len} positions of --init-from {path}")
    return replace(model, **{k: getattr(saved, k) for k in ARCHITECTURE}, seq_len=seq_len or saved.seq_len)


def init_tokenizer(path: str) -> str | None:
    """The tokenizer.json that came with the weights (the run's default tokenizer), if any."""
    tok = os.path.join(path, "tokenizer.json")
    return tok if os.path.isfile(tok) else _saved_run(path)["train"].get("tokenizer")


def data_vocab(path: str, corpus_vocab: int) -> int:
    """The run's vocabulary: the weights' (a smaller tokenizer uses a subset of it), never fewer."""
    saved = _saved_model(path).vocab_size
    if corpus_vocab > saved:
        raise ConfigError(f"the data's vocabulary of {corpus_vocab} exceeds the {saved} tokens of --init-from {path}")
    return saved


def init_state(path: str, model: ModelConfig, parallel: ParallelConfig, optimizer, mesh) -> T.TrainState:
    """A fresh TrainState (step 0, new optimizer moments) whose params are the weights saved in `path`,
    placed on `mesh`."""
    saved, params, _, _ = _restore(path)
    diffs = [f"{k}={getattr(saved, k)!r} (saved) vs {getattr(model, k)!r}" for k in ARCHITECTURE
             if getattr(saved, k) != getattr(model, k)]
    if model.seq_len > saved.seq_len:
        diffs.append(f"seq_len={saved.seq_len} (saved) < {model.seq_len}")
    if diffs:
        raise ConfigError(f"--init-from {path}: the model differs: " + ", ".join(diffs))
    params = jax.tree.map(np.asarray, params)
    params["embed"]["position"] = params["embed"]["position"][: model.seq_len]
    params = place(params, model, mesh, parallel.sequence_parallel)
    shardings = T.state_shardings(model, parallel, optimizer, mesh)
    fresh = lambda p: T.TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p))
    return jax.jit(fresh, out_shardings=shardings)(params)


# ---------------------------------------------------------------------------------------------
# Directories


def _step_dir(path: str) -> tuple[str, int | None]:
    """RUN/checkpoints/N → (RUN, N); anything else → (path, None)."""
    path = os.path.normpath(path)
    parent, name = os.path.split(path)
    if name.isdigit() and os.path.basename(parent) == "checkpoints":
        return os.path.dirname(parent), int(name)
    return path, None


def _saved_run(path: str) -> dict:
    run_dir, _ = _step_dir(path)
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{path!r} has no config.json (not a jaxseq run or converted directory)")
    saved = json.load(open(cfg_path))
    if "model" not in saved:
        raise ConfigError(f"{path!r} looks like a Hugging Face directory; convert it first with from-hf")
    return saved


def _saved_model(path: str) -> ModelConfig:
    return ModelConfig(**_saved_run(path)["model"])


class _OneStep:
    """A checkpoint manager that offers only one step to `checkpoint.restore`."""

    def __init__(self, mgr, step: int):
        self._mgr, self._step = mgr, step

    def all_steps(self):
        return [self._step] if self._step in self._mgr.all_steps() else []

    def __getattr__(self, name):
        return getattr(self._mgr, name)


def _restore(path: str):
    """(cfg, params on one device, tokenizer, step) of a run/converted directory or one step of it."""
    saved = _saved_run(path)
    run_dir, step = _step_dir(path)
    cfg = ModelConfig(**saved["model"])
    parallel = ParallelConfig()
    mesh = make_mesh(parallel, jax.local_devices()[:1])
    optimizer = T.make_optimizer(OptimizerConfig(**saved["optimizer"]))
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), cfg, parallel, optimizer, mesh))
    mgr = C.manager(os.path.join(run_dir, "checkpoints"), async_save=False)
    restored = C.restore(mgr if step is None else _OneStep(mgr, step), abstract,
                         T.state_shardings(cfg, parallel, optimizer, mesh), mesh)
    if restored is None:
        raise ConfigError(f"{path!r} holds no checkpoint" + (f" at step {step}" if step is not None else ""))
    state, _ = restored
    return cfg, state.params, saved["train"].get("tokenizer"), int(state.step)


def from_hf(hf_dir: str, out: str) -> ModelConfig:
    """Convert a local HF GPT-2 directory into a jaxseq checkpoint directory (step 0)."""
    config, tensors, metadata = hf.read_dir(hf_dir)
    cfg = hf.model_config(config)
    validate_model(cfg)
    params, record, buffers = hf.to_params(cfg, tensors, cfg.padded_vocab(1))
    ckpt = os.path.join(out, "checkpoints")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        raise ConfigError(f"{out!r} already holds checkpoints; choose an empty OUT")
    side = os.path.join(out, HF_SUBDIR)
    hf.copy_side_files(hf_dir, side)
    if os.path.isfile(os.path.join(side, "tokenizer.json")):
        hf.copy_side_files(side, out, ["tokenizer.json"])
    tokenizer = os.path.abspath(os.path.join(out, "tokenizer.json")) if os.path.isfile(
        os.path.join(out, "tokenizer.json")) else None
    with open(os.path.join(side, "record.json"), "w") as f:
        json.dump({**record, "metadata": metadata}, f, indent=1)
    if buffers:
        hf.safetensors_numpy().save_file(buffers, os.path.join(side, "buffers.safetensors"))
    run = RunConfig(cfg, ParallelConfig(), OptimizerConfig(), TrainConfig(steps=0, run_dir=out, tokenizer=tokenizer))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(run.to_dict(), f, indent=2)
    mesh = make_mesh(ParallelConfig(), jax.local_devices()[:1])
    optimizer = T.make_optimizer(run.optimizer)
    params = place(params, cfg, mesh)
    state = jax.jit(lambda p: T.TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)),
                    out_shardings=T.state_shardings(cfg, ParallelConfig(), optimizer, mesh))(params)
    mgr = C.manager(ckpt, async_save=False)
    C.save(mgr, 0, state, {"data_position": 0, "config": run.to_dict(), "source": os.path.abspath(hf_dir)}, force=True)
    mgr.wait_until_finished()
    return cfg


def to_hf(path: str, out: str) -> ModelConfig:
    """Write a checkpoint as an HF GPT-2 directory that `GPT2LMHeadModel.from_pretrained(out)` loads.

    A converted directory gives back its original names, dtypes, buffers and config.json (byte for
    byte, while the architecture is unchanged); a run trained in jaxseq gets a generated config."""
    cfg, params, tokenizer, _ = _restore(path)
    side = os.path.join(_step_dir(path)[0], HF_SUBDIR)
    record, buffers, metadata, keep_config = None, None, None, False
    if os.path.isfile(os.path.join(side, "record.json")):
        record = json.load(open(os.path.join(side, "record.json")))
        metadata = record.pop("metadata", None)
        if os.path.isfile(os.path.join(side, "buffers.safetensors")):
            buffers = hf.safetensors_numpy().load_file(os.path.join(side, "buffers.safetensors"))
        original = hf.model_config(json.load(open(os.path.join(side, "config.json"))))
        keep_config = all(getattr(original, k) == getattr(cfg, k) for k in ARCHITECTURE + ("seq_len",))
    tensors = hf.from_params(cfg, jax.tree.map(np.asarray, params), record, buffers)
    hf.write_dir(out, hf.hf_config(cfg), tensors, metadata)
    if os.path.isdir(side):
        hf.copy_side_files(side, out, [n for n in hf.SIDE_FILES if n != "config.json" or keep_config])
    elif tokenizer and os.path.isfile(tokenizer):
        hf.copy_side_files(os.path.dirname(tokenizer), out, [os.path.basename(tokenizer)])
    return cfg


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m jaxseq.convert",
                                description="Convert GPT-2 checkpoints between Hugging Face and jaxseq (offline).")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="HF GPT-2 directory (config.json + model.safetensors) → jaxseq checkpoint")
    a.add_argument("hf_dir")
    a.add_argument("out")
    b = sub.add_parser("to-hf", help="jaxseq run/converted directory (or RUN/checkpoints/N) → HF GPT-2 directory")
    b.add_argument("run_dir")
    b.add_argument("out")
    args = p.parse_args(argv)
    try:
        if args.command == "from-hf":
            cfg = from_hf(args.hf_dir, args.out)
        else:
            cfg = to_hf(args.run_dir, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: GPT-2 with {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
          f"vocab {cfg.vocab_size}, {cfg.seq_len} positions ({cfg.num_params() / 1e6:.2f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
