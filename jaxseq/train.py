"""`python -m jaxseq.train`: the training job (flags → frozen configs → the loop, metrics, checkpoints).

With no arguments it trains a small byte-level GPT on the Python standard library's own source; on a
machine without an accelerator it simulates 8 devices and runs data=2 × tensor=4 with sequence
parallelism and selective recompute.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import yaml

from jaxseq import cli
from jaxseq.config import (PRESETS, ConfigError, DistributedConfig, ModelConfig, OptimizerConfig, TrainConfig,
                           preset, replace, validate)

DEFAULT_PRESET = "stdlib-bytes"


# ---------------------------------------------------------------------------------------------
# Command line → RunConfig (the only place that reads argv)

SECTIONS = {"model": ModelConfig, "optimizer": OptimizerConfig, "train": TrainConfig}


def _coerce(name: str, value, annotation: str):
    """A string from the command line or YAML into the field's declared type."""
    if not isinstance(value, str):
        return value
    kinds = [k.strip() for k in annotation.split("|")]
    if value.lower() in ("none", "null") and "None" in kinds:
        return None
    for kind in kinds:
        try:
            if kind == "bool":
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            if kind in ("int", "float"):
                return {"int": int, "float": float}[kind](value)
            if kind == "str":
                return value
        except ValueError:
            continue
    raise ConfigError(f"{name}={value!r} is not a valid {annotation}")


def _field_section(key: str) -> str:
    if "." in key:
        section, key = key.split(".", 1)
        if section not in SECTIONS or key not in {f.name for f in dataclasses.fields(SECTIONS[section])}:
            raise ConfigError(f"unknown config field {section}.{key!r}")
        return section
    owners = [s for s, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if not owners:
        valid = sorted(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls))
        raise ConfigError(f"unknown config field {key!r}; valid: {', '.join(valid)}")
    return owners[0]


def apply_overrides(configs: dict, overrides: dict) -> dict:
    """Set fields by name (`hidden=256`, `optimizer.lr=1e-3`), coerced to the declared types."""
    configs = dict(configs)
    for key, value in overrides.items():
        section = _field_section(key)
        name = key.split(".")[-1]
        annotation = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}[name]
        configs[section] = replace(configs[section], **{name: _coerce(name, value, str(annotation))})
    return configs


def parse_mesh(text: str, num_devices: int) -> tuple[int, int]:
    """'data=2,tensor=4' (an axis left out takes the remaining devices) → (data, tensor)."""
    axes = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in ("data", "tensor") or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh {text!r} is not valid; expected e.g. data=2,tensor=4")
        axes[name.strip()] = int(value)
    if "data" not in axes:
        axes["data"] = max(num_devices // axes.get("tensor", 1), 1)
    if "tensor" not in axes:
        axes["tensor"] = max(num_devices // axes["data"], 1)
    return axes["data"], axes["tensor"]


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m jaxseq.train",
        description="Train a GPT with tensor, sequence and data parallelism and named remat policies.",
        epilog="Trailing key=value pairs override any config field (model, optimizer or train), e.g. "
               "hidden=256 layers=8 optimizer.b2=0.99. Precedence: preset < --config < flags < key=value.")
    a = p.add_argument
    a("--preset", default=None, help=f"model preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}")
    a("--config", help="YAML file with sections model/optimizer/train (or flat field names)")
    a("--mesh", help="e.g. data=2,tensor=4 (default: data=2,tensor=4 on simulated CPU devices, data=N on GPUs)")
    a("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
      help="split LayerNorm/dropout regions along the sequence (default on for the CPU demo)")
    a("--remat", help="remat policy: none, selective, lean, full, dots, dots_no_batch (default selective)")
    a("--attention", help="explicit (scores materialised) or fused (jax.nn.dot_product_attention)")
    a("--dtype", help="compute dtype: bfloat16 or float32 (parameters are float32)")
    a("--steps", type=int, help="optimizer steps")
    a("--batch-size", type=int, help="global batch size, sequences")
    a("--micro-batch-size", type=int, help="micro-batch size; smaller than --batch-size accumulates gradients")
    a("--seq-len", type=int, help="sequence length, tokens")
    a("--lr", type=float, help="peak learning rate (linear warmup, then cosine decay to 10%%)")
    a("--warmup-steps", type=int, help="learning-rate warmup steps")
    a("--weight-decay", type=float, help="AdamW weight decay")
    a("--clip-norm", type=float, help="global gradient-norm clipping threshold")
    a("--seed", type=int, help="seed for initialisation, data order and dropout")
    a("--host-devices", type=int, help="simulated CPU devices when there is no accelerator (default 8)")
    a("--data", help="text file, directory or glob; or PREFIX of token files from python -m jaxseq.data")
    a("--tokenizer", help="local tokenizer.json for text data (default: bytes)")
    a("--run-dir", help="where metrics, config and checkpoints go (default runs/default)")
    a("--log-every", type=int, help="steps between metric lines")
    a("--eval-every", type=int, help="steps between validation evaluations")
    a("--checkpoint-every", type=int, help="steps between checkpoints")
    a("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    a("--init-from", help="start from the weights (and architecture) of a run or converted directory, at step 0")
    a("--peak-tflops", type=float, help="device peak TFLOP/s for MFU (auto on A100/H100/H200)")
    a("--coordinator", help="multi-process: HOST:PORT of process 0 (auto under SLURM / Open MPI)")
    a("--num-processes", type=int, help="multi-process: number of processes")
    a("--process-id", type=int, help="multi-process: this process's index")
    a("overrides", nargs="*", help="key=value overrides of config fields")
    return p


FLAG_FIELDS = {  # flag dest → config field
    "remat": "remat", "attention": "attention", "dtype": "dtype", "steps": "steps", "batch_size": "batch_size",
    "micro_batch_size": "micro_batch_size", "seq_len": "seq_len", "lr": "lr", "warmup_steps": "warmup_steps",
    "weight_decay": "weight_decay", "clip_norm": "clip_norm", "seed": "seed", "host_devices": "host_devices",
    "data": "data", "tokenizer": "tokenizer", "run_dir": "run_dir", "log_every": "log_every",
    "eval_every": "eval_every", "checkpoint_every": "checkpoint_every", "peak_tflops": "peak_tflops",
}


def configs_from_args(args) -> tuple[dict, str | None, bool | None]:
    """Everything but the mesh (which needs the device count): preset < YAML < flags < key=value."""
    name = args.preset or DEFAULT_PRESET
    # The default run's small byte-level model learns fastest at a higher rate than GPT-2's 6e-4.
    optimizer = OptimizerConfig(lr=2e-3, warmup_steps=50) if name == DEFAULT_PRESET else OptimizerConfig()
    configs = {"model": preset(name), "optimizer": optimizer, "train": TrainConfig()}
    if name == DEFAULT_PRESET:
        # float32 compute: 1.5x the tokens/s of bfloat16 on a 2-core CPU (XLA:CPU converts bf16 dots
        # to f32 and back), and a 0.84M-parameter model gains nothing from bf16 on a GPU either.
        configs["model"] = replace(configs["model"], dtype="float32")
        # 800 steps reach ≈1.7 nats/byte (≤ 1.8 asked) in under 10 minutes on a loaded 2-core CPU.
        configs["train"] = replace(configs["train"], steps=800)
    if args.config:
        if not os.path.isfile(args.config):
            raise ConfigError(f"--config {args.config!r} does not exist")
        loaded = yaml.safe_load(open(args.config)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {args.config!r} must hold a mapping")
        if "preset" in loaded:
            configs["model"] = preset(loaded.pop("preset"))
        flat = {}
        for key, value in loaded.items():
            if key in SECTIONS and isinstance(value, dict):
                flat.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                flat[key] = value
        configs = apply_overrides(configs, flat)
    flags = {field: getattr(args, dest) for dest, field in FLAG_FIELDS.items() if getattr(args, dest) is not None}
    if args.resume:
        flags["resume"] = True
    configs = apply_overrides(configs, flags)
    pairs = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        pairs[key] = value
    configs = apply_overrides(configs, pairs)
    if args.init_from:
        configs = _init_from(configs, args.init_from, args.seq_len or pairs.get("seq_len"))
    # The cosine decays over the whole run unless configured otherwise.
    if configs["optimizer"].decay_steps == OptimizerConfig().decay_steps:
        configs["optimizer"] = replace(configs["optimizer"], decay_steps=configs["train"].steps)
    return configs, args.mesh, args.sequence_parallel


def _init_from(configs: dict, path: str, seq_len) -> dict:
    """The architecture (and the default tokenizer) of `path`; the rest stays as configured."""
    from jaxseq import convert

    configs = dict(configs)
    configs["model"] = convert.init_model(path, configs["model"], int(seq_len) if seq_len else None)
    if configs["train"].tokenizer is None:
        configs["train"] = replace(configs["train"], tokenizer=convert.init_tokenizer(path))
    return configs


def validate_train(t: TrainConfig) -> None:
    for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                 "keep_checkpoints", "host_devices"):
        if getattr(t, name) < 1:
            raise ConfigError(f"{name}={getattr(t, name)} must be at least 1")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        raise ConfigError(f"peak_tflops={t.peak_tflops} must be positive")


def check_run_dir(run_dir: str) -> None:
    # A uniquely named probe: every process of a multi-process run checks the same shared directory.
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir={run_dir!r} is not writable ({e.strerror})") from None


def main(argv=None) -> int:
    import jax

    from jaxseq import loop

    args = build_parser().parse_intermixed_args(argv)
    try:
        configs, mesh_text, sequence_parallel = configs_from_args(args)
        validate_train(configs["train"])
        distributed = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
        run = loop.setup_devices(configs, mesh_text, sequence_parallel, distributed)
        validate(run.model, run.parallel, run.train.remat, loop.num_devices(),
                 run.train.batch_size, run.train.micro_batch_size)
        check_run_dir(run.train.run_dir)
        return loop.train(run, init_from=args.init_from)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except loop.TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except jax.errors.JaxRuntimeError as e:
        print(f"error: {runtime_failure(e, jax.process_count())}", file=sys.stderr)
        return 1


def runtime_failure(e: Exception, processes: int) -> str:
    """One line for a failed execution (out of memory, a collective whose peer died): the runtime's
    first line says what; the Python stack below it is XLA's dispatch and says nothing to a user."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = ("; in a multi-process run this usually means another process died (see its log): "
            "restart with --resume" if processes > 1 else "")
    return f"the XLA runtime failed: {first}{hint}"


def load_run(run_dir: str):
    """(model config, params on one device, tokenizer path, step) of a run's newest checkpoint."""
    from jaxseq import loop

    return loop.load_run(run_dir)


if __name__ == "__main__":
    sys.exit(main())
