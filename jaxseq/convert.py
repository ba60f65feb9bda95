"""GPT-2 weights in and out: `python -m jaxseq.convert from-hf HF_DIR OUT` / `to-hf RUN_DIR_OR_CKPT OUT`,
and a small Python API (`load_hf_gpt2`, `load`, `logits`) to compute logits on any mesh.

Why the converted checkpoint is a jaxseq run directory (config.json + an orbax checkpoint at step 0,
written by `jaxseq.training.checkpoint`): then one reader serves converted weights and trained runs alike,
restoring onto any mesh re-pads the vocabulary (`checkpoint.resize_vocab`), and `to-hf` of a trained
run is the same code path as the round trip; the directory's format belongs to `jaxseq.training.rundir`. OUT also keeps `hf/` (the original config, tokenizer files,
tensor names/dtypes and buffers) so that from-hf → to-hf reproduces every tensor exactly.
"""

from __future__ import annotations

import json
import os
import sys
from functools import lru_cache

import jax
import numpy as np

from jaxseq import cli
from jaxseq.config import (ARCHITECTURE_FIELDS, ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, RunConfig,
                           TrainConfig, replace, validate_model)
from jaxseq.interop import hf
from jaxseq.mesh import make_mesh
from jaxseq.models import gpt as M
from jaxseq.sharding import Sharder, batch_sharding
from jaxseq.training import checkpoint as C
from jaxseq.training import rundir
from jaxseq.training import train_step as T

HF_SUBDIR = "hf"  # inside a converted directory: what travels back out with to-hf

# ---------------------------------------------------------------------------------------------
# Python API


def load_hf_gpt2(hf_dir: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(cfg, params) of a local Hugging Face GPT-2 directory; params are NumPy float32 (dropout 0),
    the token embedding unpadded."""
    config, tensors, _ = hf.read_dir(hf_dir)
    cfg = replace(hf.model_config(config, dtype), dropout=0.0)
    params, _, _ = hf.to_params(cfg, tensors)
    return cfg, params


def load(path: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(cfg, params) of a converted directory, a run directory (newest checkpoint) or one checkpoint
    step directory (RUN/checkpoints/N); params on one device, dropout 0."""
    restored = rundir.restore(path)
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
    return jax.jit(lambda p, t: M.logits_fn(p, M.hidden_states(p, t, cfg, shard, "none"), cfg, shard))


def from_hf(hf_dir: str, out: str) -> ModelConfig:
    """Convert a local HF GPT-2 directory into a jaxseq checkpoint directory (step 0)."""
    config, tensors, metadata = hf.read_dir(hf_dir)
    cfg = hf.model_config(config)
    validate_model(cfg)
    params, record, buffers = hf.to_params(cfg, tensors)
    ckpt = rundir.checkpoint_dir(out)
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
    run = RunConfig(model=cfg, parallel=ParallelConfig(), optimizer=OptimizerConfig(), train=TrainConfig(steps=0,
                                                                                                         run_dir=out, tokenizer=tokenizer))
    rundir.write_config(out, run)
    mesh = make_mesh(run.parallel, jax.local_devices()[:1])
    optimizer = T.make_optimizer(run.optimizer)
    state = T.state_from_params(rundir.place(params, cfg, mesh), cfg, run.parallel, optimizer, mesh)
    mgr = C.manager(ckpt, async_save=False)
    C.save(mgr, 0, state, rundir.checkpoint_meta(run, 0, source=os.path.abspath(hf_dir)), force=True)
    mgr.wait_until_finished()
    return cfg


def to_hf(path: str, out: str) -> ModelConfig:
    """Write a checkpoint as an HF GPT-2 directory that `GPT2LMHeadModel.from_pretrained(out)` loads.

    A converted directory gives back its original names, dtypes, buffers and config.json (byte for
    byte, while the architecture is unchanged); a run trained in jaxseq gets a generated config."""
    restored = rundir.restore(path)
    cfg, params, tokenizer = restored.model, restored.params, restored.tokenizer
    side = os.path.join(rundir.split_step(path)[0], HF_SUBDIR)
    record, buffers, metadata, keep_config = None, None, None, False
    if os.path.isfile(os.path.join(side, "record.json")):
        record = json.load(open(os.path.join(side, "record.json")))
        metadata = record.pop("metadata", None)
        if os.path.isfile(os.path.join(side, "buffers.safetensors")):
            buffers = hf.safetensors_numpy().load_file(os.path.join(side, "buffers.safetensors"))
        original = hf.model_config(json.load(open(os.path.join(side, "config.json"))))
        keep_config = all(getattr(original, k) == getattr(cfg, k) for k in ARCHITECTURE_FIELDS)
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
    return cli.run(lambda: _convert(args))


def _convert(args) -> int:
    cfg = from_hf(args.hf_dir, args.out) if args.command == "from-hf" else to_hf(args.run_dir, args.out)
    print(f"wrote {args.out}: GPT-2 with {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
          f"vocab {cfg.vocab_size}, {cfg.seq_len} positions ({cfg.num_params() / 1e6:.2f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
