"""The run directory, read and written in one place: train, generate and convert all go through here.

    RUN/config.json        the resolved RunConfig (model, parallel, optimizer, train, distributed)
    RUN/checkpoints/N/     orbax checkpoints of the TrainState, with a JSON item (data position, config)
    RUN/metrics.jsonl, RUN/tensorboard/   the metrics log (`metrics.MetricsLog`)

A converted directory (`python -m jaxseq.convert from-hf`) is a run directory at step 0 (plus `hf/`),
so one reader serves converted weights and trained runs alike, and `--init-from` accepts either.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxseq.config import ARCHITECTURE_FIELDS, ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, RunConfig, replace
from jaxseq.mesh import make_mesh
from jaxseq.models import gpt as M
from jaxseq.training import checkpoint as C
from jaxseq.training import train_step as T

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def write_config(run_dir: str, run: RunConfig) -> None:
    with open(os.path.join(run_dir, CONFIG), "w") as f:
        json.dump(run.to_dict(), f, indent=2)


def checkpoint_meta(run: RunConfig, data_position: int, **extra) -> dict:
    """The JSON item saved with each checkpoint: where the data stream resumes, and the run's config."""
    return {"data_position": data_position, "config": run.to_dict(), **extra}


def split_step(path: str) -> tuple[str, int | None]:
    """RUN/checkpoints/N → (RUN, N); anything else → (path, None)."""
    path = os.path.normpath(path)
    parent, name = os.path.split(path)
    if name.isdigit() and os.path.basename(parent) == CHECKPOINTS:
        return os.path.dirname(parent), int(name)
    return path, None


def read_config(path: str) -> dict:
    """The saved config.json of a run or converted directory (or of one checkpoint step of it)."""
    run_dir, _ = split_step(path)
    cfg_path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{path!r} has no {CONFIG} (not a jaxseq run or converted directory)")
    try:
        with open(cfg_path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_path!r} is not readable JSON ({e})") from None
    if not isinstance(saved, dict) or "model" not in saved:
        raise ConfigError(f"{path!r} looks like a Hugging Face directory; convert it first with from-hf")
    return saved


def saved_model(path: str) -> ModelConfig:
    return ModelConfig(**read_config(path)["model"])


def saved_optimizer(path: str) -> OptimizerConfig:
    return OptimizerConfig(**read_config(path)["optimizer"])


# ---------------------------------------------------------------------------------------------
# Restoring on one device (generate, convert, --init-from)


@dataclass(frozen=True)
class Restored:
    model: ModelConfig
    params: dict  # on one device, vocabulary padded for tensor = 1
    tokenizer: str | None  # tokenizer.json path; None: bytes
    step: int


class _OneStep:
    """A checkpoint manager that offers only one step to `checkpoint.restore`."""

    def __init__(self, mgr, step: int):
        self._mgr, self._step = mgr, step

    def all_steps(self):
        return [self._step] if self._step in self._mgr.all_steps() else []

    def __getattr__(self, name):
        return getattr(self._mgr, name)


def restore(path: str) -> Restored:
    """The newest checkpoint of a run or converted directory (or the step RUN/checkpoints/N) on one device."""
    saved = read_config(path)
    run_dir, step = split_step(path)
    cfg = ModelConfig(**saved["model"])
    parallel = ParallelConfig()
    mesh = make_mesh(parallel, jax.local_devices()[:1])
    optimizer = T.make_optimizer(OptimizerConfig(**saved["optimizer"]))
    abstract = jax.eval_shape(lambda: T.init_state(jax.random.key(0), cfg, parallel, optimizer, mesh))
    mgr = C.manager(checkpoint_dir(run_dir), async_save=False)
    restored = C.restore(mgr if step is None else _OneStep(mgr, step), abstract,
                         T.state_shardings(cfg, parallel, optimizer, mesh), mesh)
    if restored is None:
        raise ConfigError(f"{path!r} holds no checkpoint" + (f" at step {step}" if step is not None else ""))
    state, _ = restored
    return Restored(cfg, state.params, saved["train"].get("tokenizer"), int(state.step))


def place(params: dict, cfg: ModelConfig, mesh, sequence_parallel: bool = False) -> dict:
    """Params (host or one device) padded for the mesh's tensor size and sharded as the train step
    shards them; every process holds the whole host copy (multi-process safe)."""
    parallel = ParallelConfig(data=mesh.shape["data"], tensor=mesh.shape["tensor"],
                              sequence_parallel=sequence_parallel, pipe=mesh.shape["pipe"])
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda x: _put(np.asarray(x), replicated), params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), M.param_specs(parallel))
    return C.resize_vocab(params, cfg.padded_vocab(parallel.tensor), shardings)


def _put(x: np.ndarray, sharding: NamedSharding):
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


# ---------------------------------------------------------------------------------------------
# --init-from DIR: a run that starts from the weights of a run or converted directory


def init_model(path: str, model: ModelConfig, seq_len: int | None = None) -> ModelConfig:
    """The run's model: the architecture saved in `path`, the rest (dropout, dtype, attention) from
    `model`; seq_len from the checkpoint unless a shorter one is asked for (positions are cut)."""
    saved = saved_model(path)
    if seq_len is not None and seq_len > saved.seq_len:
        raise ConfigError(f"seq_len={seq_len} exceeds the {saved.seq_len} positions of --init-from {path}")
    architecture = {k: getattr(saved, k) for k in ARCHITECTURE_FIELDS if k != "seq_len"}
    return replace(model, **architecture, seq_len=seq_len or saved.seq_len)


def init_tokenizer(path: str) -> str | None:
    """The tokenizer.json that came with the weights (the run's default tokenizer), if any."""
    tok = os.path.join(split_step(path)[0], "tokenizer.json")
    return tok if os.path.isfile(tok) else read_config(path)["train"].get("tokenizer")


def init_vocab(path: str, corpus_vocab: int) -> int:
    """The run's vocabulary: the weights' (a smaller tokenizer uses a subset of it), never fewer."""
    saved = saved_model(path).vocab_size
    if corpus_vocab > saved:
        raise ConfigError(f"the data's vocabulary of {corpus_vocab} exceeds the {saved} tokens of --init-from {path}")
    return saved


def init_state(path: str, model: ModelConfig, parallel: ParallelConfig, optimizer, mesh) -> T.TrainState:
    """A fresh TrainState (step 0, new optimizer moments) whose params are the weights saved in `path`,
    placed on `mesh`."""
    restored = restore(path)
    saved = restored.model
    diffs = [f"{k}={getattr(saved, k)!r} (saved) vs {getattr(model, k)!r}" for k in ARCHITECTURE_FIELDS
             if k != "seq_len" and getattr(saved, k) != getattr(model, k)]
    if model.seq_len > saved.seq_len:
        diffs.append(f"seq_len={saved.seq_len} (saved) < {model.seq_len}")
    if diffs:
        raise ConfigError(f"--init-from {path}: the model differs: " + ", ".join(diffs))
    params = jax.tree.map(np.asarray, restored.params)
    params["embed"]["position"] = params["embed"]["position"][: model.seq_len]
    params = place(params, model, mesh, parallel.sequence_parallel)
    return T.state_from_params(params, model, parallel, optimizer, mesh)
