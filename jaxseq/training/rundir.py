"""The run directory, read and written in one place: train, generate and convert all go through here.

    RUN/config.json        the resolved RunConfig (model, parallel, optimizer, train, distributed)
    RUN/checkpoints/N/     orbax checkpoints of the TrainState, with a JSON item (data position, config)
    RUN/metrics.jsonl, RUN/tensorboard/   the metrics log (`metrics.MetricsLog`)

A converted directory (`python -m jaxseq.convert from-hf`) is a run directory at step 0 (plus `hf/`),
so one reader serves converted weights and trained runs alike, and `--init-from` accepts either.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxseq.config import (ARCHITECTURE_FIELDS, ConfigError, ModelConfig, OptimizerConfig, ParallelConfig, RunConfig,
                           TrainConfig, replace, validate_parallel)
from jaxseq.mesh import make_mesh, mesh_parallel, parse_mesh
from jaxseq.models.model import cast_mask, saved_model_fields, vocab_mask
from jaxseq.parallel.layout import Layout
from jaxseq.training import checkpoint
from jaxseq.training import train_step
from jaxseq.training.sampling import sampling_parallel

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def has_checkpoints(run_dir: str) -> bool:
    """Whether RUN/checkpoints holds a step (a directory named by its number; orbax renames a step's temporary
    directory to that when it is complete). Reads only: a resume checks before it creates anything."""
    directory = checkpoint_dir(run_dir)
    return os.path.isdir(directory) and any(name.isdigit() and os.path.isdir(os.path.join(directory, name))
                                            for name in os.listdir(directory))


def write_config(run_dir: str, run: RunConfig) -> None:
    """RUN/config.json, replaced whole or not at all: written to a file beside it (with the permissions a new file
    gets), then renamed over it; a signal or a full disk mid-write would otherwise leave a torn file that `--resume`
    cannot read."""
    path = os.path.join(run_dir, CONFIG)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            json.dump(run.to_dict(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):  # not renamed: the write failed
            os.unlink(partial)


def resume_command(run: RunConfig) -> str:
    """The command that continues `run`: config.json restores the rest; of what a resume does not restore (this
    launch's machine), the settings this launch gave are added."""
    words = ["python -m jaxseq.train --run-dir", shlex.quote(run.train.run_dir), "--resume"]
    if run.train.host_devices != TrainConfig().host_devices and jax.devices()[0].platform == "cpu":
        words.append(f"--host-devices {run.train.host_devices}")
    if run.train.peak_tflops is not None:
        words.append(f"--peak-tflops {run.train.peak_tflops:g}")
    d = run.distributed
    if d.explicit:
        words.append(f"--coordinator {d.coordinator} --num-processes {d.num_processes} --process-id I "
                     f"(I = each process's own)")
    return " ".join(words)


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
    return ModelConfig(**saved_model_fields(read_config(path)["model"]))


def saved_configs(path: str) -> dict:
    """The configs a run was saved with: {"model", "optimizer", "train", "parallel"} (fields this version
    does not know are left out, fields it added take their defaults)."""
    saved = read_config(path)
    configs = {}
    for section, kind in (("model", ModelConfig), ("optimizer", OptimizerConfig), ("train", TrainConfig),
                          ("parallel", ParallelConfig)):
        names = {f.name for f in dataclasses.fields(kind)}
        fields = saved.get(section, {})
        fields = saved_model_fields(fields) if section == "model" else fields
        configs[section] = kind(**{k: v for k, v in fields.items() if k in names})
    return configs


# ---------------------------------------------------------------------------------------------
# Restoring onto a mesh (generate, convert, --init-from): the params alone, shard by shard


@dataclass(frozen=True, kw_only=True)
class Restored:
    model: ModelConfig
    params: dict  # on the mesh asked for, in its shardings; vocabulary padded for its tensor size
    tokenizer: str | None  # tokenizer.json path; None: bytes
    step: int


def restore(path: str, parallel: ParallelConfig, mesh, *, dtype: str = "float32",
            seq_len: int | None = None) -> Restored:
    """The params of the newest checkpoint of a run or converted directory (or of the step RUN/checkpoints/N),
    read onto `mesh` in the train step's master shardings for `parallel` (layers over `pipe`, heads over
    `tensor`, split over `data` too with the distributed optimizer): every device reads only its own slices,
    and the optimizer moments are not read at all. Weights the compute dtype copies (`cast_mask`) arrive in
    `dtype`; `seq_len` cuts the position table."""
    saved = read_config(path)
    model = ModelConfig(**saved_model_fields(saved["model"]))
    model = replace(model, seq_len=seq_len or model.seq_len)
    dtypes = jax.tree.map(lambda cast: jnp.dtype(dtype) if cast else jnp.float32, cast_mask(model))
    layout = Layout(model, parallel, mesh)
    abstract = jax.tree.map(lambda shape, sharding, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding),
                            layout.param_shapes, layout.master_shardings, dtypes,
                            is_leaf=lambda x: isinstance(x, tuple))
    step, params = _read_params(path, abstract)
    return Restored(model=model, params=params, tokenizer=saved["train"].get("tokenizer"), step=step)


def _read_params(path: str, abstract) -> tuple[int, dict]:
    """(step, params) of the checkpoint `path` names; a damaged one is one line naming an earlier step."""
    run_dir, step = split_step(path)
    directory = checkpoint_dir(run_dir)
    mgr = checkpoint.reader(directory) if os.path.isdir(directory) else None
    steps = mgr.all_steps() if mgr is not None else []
    step = max(steps, default=None) if step is None else step
    if step not in steps:
        raise ConfigError(f"{path!r} holds no checkpoint" + (f" at step {step}" if step is not None else ""))
    try:
        return step, checkpoint.restore_params(mgr, step, abstract)
    except checkpoint.UnreadableStep as e:  # a damaged checkpoint: say which, and what else there is
        earlier = [s for s in steps if s < step]
        raise ConfigError(f"checkpoint step {step} of {run_dir!r} is unreadable ({e.detail})"
                          + (f"; an earlier one: {os.path.join(directory, str(max(earlier)))}" if earlier else "")
                          ) from None


def resolve_mesh(cfg: ModelConfig, mesh_text: str | None, devices) -> tuple[ParallelConfig, jax.sharding.Mesh]:
    """The --mesh of generate and convert (train's syntax, `mesh.parse_mesh`), validated for the model; by
    default every device, tensor-parallel as far as the heads and the MLP split (`sampling_parallel`), the
    rest data-parallel."""
    if mesh_text is None:
        parallel = sampling_parallel(cfg, ParallelConfig(tensor=len(devices)))
    else:
        axes = parse_mesh(mesh_text, len(devices))
        if axes["context"] > 1:
            raise ConfigError(f"--mesh {mesh_text!r}: context parallelism is for training; generate and convert run "
                              "on a mesh without context (the weights do not depend on it)")
        parallel = ParallelConfig(**axes)
    validate_parallel(cfg, parallel, len(devices))
    return parallel, make_mesh(parallel, devices)


def place(params: dict, cfg: ModelConfig, mesh, sequence_parallel: bool = False) -> dict:
    """Params held on the host (NumPy; device arrays are fetched) padded for the mesh's tensor size and put
    into the train step's shards: each device receives only its own slice (multi-process safe)."""
    parallel = mesh_parallel(mesh, sequence_parallel)
    rows = cfg.padded_vocab(parallel.tensor)

    def put(is_vocab, x, sharding):
        x = np.asarray(x)
        if is_vocab:
            x = np.concatenate([x[:rows], np.zeros((max(rows - len(x), 0), *x.shape[1:]), x.dtype)])
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, vocab_mask(cfg), params, Layout(cfg, parallel, mesh).param_shardings)


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


def init_state(path: str, layout: Layout, optimizer) -> train_step.TrainState:
    """A fresh TrainState (step 0, new optimizer moments) whose params are the weights saved in `path`, read
    straight onto the layout's mesh in the train step's shardings (no whole copy anywhere)."""
    model, saved = layout.model, saved_model(path)
    diffs = [f"{k}={getattr(saved, k)!r} (saved) vs {getattr(model, k)!r}" for k in ARCHITECTURE_FIELDS
             if k != "seq_len" and getattr(saved, k) != getattr(model, k)]
    if model.seq_len > saved.seq_len:
        diffs.append(f"seq_len={saved.seq_len} (saved) < {model.seq_len}")
    if diffs:
        raise ConfigError(f"--init-from {path}: the model differs: " + ", ".join(diffs))
    params = restore(path, layout.parallel, layout.mesh, seq_len=model.seq_len).params
    return train_step.state_from_params(params, layout, optimizer)
