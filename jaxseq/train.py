"""`python -m jaxseq.train`: the training job (flags → frozen configs → the loop, metrics, checkpoints).

With no arguments it trains a small byte-level GPT on the Python standard library's own source; on a
machine without an accelerator it simulates 8 devices and runs data=2 × tensor=4 with sequence
parallelism and selective recompute.
"""

from __future__ import annotations

import os
import signal
import sys


def _stopped_while_importing(signum, frame):
    print(f"error: {signal.Signals(signum).name}: stopped before the first step; nothing to save", file=sys.stderr,
          flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":  # Ctrl-C or SIGTERM while the modules below import (seconds): one line, not a traceback
    for _signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signal, _stopped_while_importing)

import argparse  # noqa: E402 (after the handlers above)
import ctypes.util  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import tempfile  # noqa: E402

import jax
import yaml

from jaxseq import cli
from jaxseq.config import (ARCHITECTURE_FIELDS, COMPUTE_DTYPES, SECTIONS, GPU_FUSED_REMAT, LAYER_LOOPS, cudnn_compiles,
                           default_layer_loop, default_remat, on_platform, SCHEDULES, ConfigError, DistributedConfig,
                           ModelConfig, OptimizerConfig, ParallelConfig, RunConfig, TrainConfig, replace, validate,
                           validate_optimizer)
from jaxseq.presets import PRESETS, preset
from jaxseq.mesh import MESH_AXES, available_devices, axis_sizes, parse_mesh
from jaxseq.parallel.distributed import initialize, is_main_process
from jaxseq import offload as host_offload
from jaxseq.models.model import tagged_names
from jaxseq.remat import POLICIES
from jaxseq.training import goodput, loop, profile, rundir
from jaxseq.training.resume import check_architecture, drop_unusable, resume_line, resumed_configs
from jaxseq.training.data import Corpus, load_corpus

DEFAULT_PRESET = "stdlib-bytes"


# ---------------------------------------------------------------------------------------------
# Command line → RunConfig (the only place that reads argv)

# The mesh and the pipeline schedule are set by --mesh / --sequence-parallel / --schedule /
# --virtual-stages once the devices are known, not as config fields.
MESH_FIELDS = {*MESH_AXES, "sequence_parallel", "schedule", "virtual_stages"}


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


def _fields(section: str) -> set[str]:
    names = {f.name for f in dataclasses.fields(SECTIONS[section])}
    return names - MESH_FIELDS if section == "parallel" else names


def _field_section(key: str) -> str:
    if "." in key:
        section, key = key.split(".", 1)
        if section == "parallel" and key in MESH_FIELDS:
            raise ConfigError(f"parallel.{key} is set with --mesh / --sequence-parallel, not as a config field")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r} (in {section}.{key}); valid: {', '.join(SECTIONS)}")
        if key not in _fields(section):
            raise ConfigError(f"unknown config field {section}.{key}; valid {section} fields: "
                              f"{', '.join(sorted(_fields(section)))}")
        return section
    owners = [s for s in SECTIONS if key in _fields(s)]
    if not owners:
        valid = sorted(name for s in SECTIONS for name in _fields(s))
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


EPILOG = ("Trailing key=value pairs override any config field (model, optimizer, train or parallel), e.g. "
          "hidden=256 layers=8 optimizer.b2=0.99. Precedence: preset < --config < flags < key=value. "
          "Where the printed figures come from: tokens_per_sec is measured (wall clock, compilation and "
          "evaluation excluded); tflops_per_device, hardware_tflops_per_device and mfu are formulas of "
          "the shapes (the paper's model FLOPs, plus the forward matmuls the remat policy replays; "
          "tests hold them to XLA's cost analysis) divided by that time; memory_gib is the backend's "
          "own count of device memory in use; a figure not known (mfu without a peak, memory_gib on CPU) is left "
          "out. A step refused as too large for the device is measured by the compiled step's memory_analysis().")


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m jaxseq.train",
        description="Train a GPT or Llama model with tensor, sequence, pipeline, data and context parallelism and "
                    "named remat policies.", epilog=EPILOG)
    a = p.add_argument
    a("--preset", default=None, help=f"model preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}")
    a("--config", help="YAML file with sections model/optimizer/train (or flat field names)")
    a("--mesh", help="e.g. data=2,tensor=4, pipe=2,data=2,tensor=2, context=2,tensor=2,data=2, or fsdp=8 / "
                     "data=2,fsdp=4 (FSDP: weights, gradients and optimizer state split over fsdp; with data, HSDP) "
                     "(default: data=2,tensor=4 on simulated CPU devices, data=N on GPUs)")
    a("--context-strategy", help="with context > 1 in --mesh: all-gather (K/V gathered, the default) or ring "
                                 "(K/V blocks passed rank to rank)")
    # Defaults of None: a flag not given keeps a resumed run's saved value (`resumed_configs`).
    a("--schedule", choices=SCHEDULES,
      help=f"pipeline schedule when the mesh has pipe > 1 (default {ParallelConfig().schedule}; with "
           "--virtual-stages > 1: interleaved; zb-h1 then runs over the chunks)")
    a("--virtual-stages", type=int,
      help="chunks per pipeline stage (Megatron's interleaved schedule, or zb-h1 over them; layers must divide "
           "by pipe × this; default 1)")
    a("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
      help="split LayerNorm/dropout regions along the sequence (default on for the CPU demo)")
    a("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
      help="shard the fp32 master weights and Adam moments over data (ZeRO-1): 12/d bytes per parameter "
           "instead of 12")
    a("--remat", help=f"remat policy: {', '.join(POLICIES)} (default {TrainConfig().remat}; on GPUs with "
                      f"--attention fused {GPU_FUSED_REMAT['unrolled']} with unrolled layers and "
                      f"{GPU_FUSED_REMAT['scan']} scanned, measured there to run fastest); or "
                      "full:N[+POLICY], Megatron's block recompute: the first N layers of each pipeline chunk under "
                      "full, the rest under POLICY (default none)")
    a("--offload", help="the stored tensors the remat policy keeps in host memory between forward and backward: "
                        "checkpoint names, comma-separated (e.g. context,mlpwi), or all (everything it stores); one "
                        "line lists the valid names (docs/parallelism.md, \"Host offload\")")
    a("--offload-optimizer", action=argparse.BooleanOptionalAction, default=None,
      help="keep the float32 master weights and Adam moments in host memory between steps (copied to the device "
           "for the update and back: 24 bytes a parameter over PCIe per step, over the shards)")
    a("--attention", help="explicit (scores materialised) or fused (jax.nn.dot_product_attention)")
    a("--dtype", help=f"compute dtype: {' or '.join(COMPUTE_DTYPES)} (parameters are float32)")
    a("--document-mask", action=argparse.BooleanOptionalAction, default=None,
      help="packed documents: attention never crosses the data's end-of-document token and positions restart at "
           "each document (default off: a token attends to the documents packed before it)")
    a("--layer-loop", help=f"how the layers run: {' or '.join(LAYER_LOOPS)} (default unrolled on GPUs without a "
                           "pipeline, scan elsewhere; unrolled avoids the scan's stacked buffers: on an H100, "
                           "gpt3-1.3b's step 14%% faster under none, 4%% under full, with 5–9%% less memory; GPUs "
                           "only; its compile time grows with depth: 20–26 s there against 8–9 s)")
    a("--fp8", action=argparse.BooleanOptionalAction, default=None,
      help="the layers' weight matmuls (QKV, attention output, MLP in and out; forward and both backward GEMMs) as "
           "FP8 GEMMs: e4m3 activations and weights, e5m2 gradients, each tensor scaled by its amax (models/fp8.py); "
           "bf16 only; on GPUs cuBLASLt's FP8 GEMMs, on CPUs emulated")
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
    a("--resume", action="store_true",
      help="continue the run in --run-dir from its newest checkpoint, with its saved configuration (RUN/config.json); "
           "flags and key=value change only the fields they name")
    a("--init-from", help="start from the weights (and architecture) of a run or converted directory, at step 0")
    a("--peak-tflops", type=float, help="device peak TFLOP/s for MFU (auto on A100/H100/H200)")
    a("--profile", metavar="START:STOP",
      help="a jax.profiler trace of steps START to STOP into RUN_DIR/tensorboard (TensorBoard's profile plugin, or "
           "its .trace.json.gz in ui.perfetto.dev) and a device-memory profile as step STOP runs (RUN_DIR/profile)")
    a("--record-autotune", metavar="FILE",
      help="on GPUs: write the train step's GEMM choices (cuBLAS or Triton, XLA's autotuner) to FILE, for "
           "`python -m jaxseq.plan --target … --autotune-results FILE` to compile this step offline as the device did")
    a("--coordinator", help="multi-process: HOST:PORT of process 0 (auto under SLURM / Open MPI)")
    a("--num-processes", type=int, help="multi-process: number of processes")
    a("--process-id", type=int, help="multi-process: this process's index")
    a("--heartbeat-timeout", type=int, default=DistributedConfig().heartbeat_timeout_s,
      help="multi-process: seconds without a peer's heartbeat after which every process stops (default "
           f"{DistributedConfig().heartbeat_timeout_s}; bounded time, no hang, when a host dies)")
    a("overrides", nargs="*", help="key=value overrides of config fields")
    return p


# The flags that set the config field of their own name (the flag's dest).
FLAG_FIELDS = ("remat", "attention", "dtype", "steps", "batch_size", "micro_batch_size", "seq_len", "lr",
               "warmup_steps", "weight_decay", "clip_norm", "seed", "host_devices", "data", "tokenizer", "run_dir",
               "log_every", "eval_every", "checkpoint_every", "peak_tflops", "init_from", "distributed_optimizer",
               "context_strategy", "layer_loop", "record_autotune", "document_mask", "profile", "offload",
               "offload_optimizer", "fp8")


def configs_from_args(args) -> tuple[dict, str | None, bool | None]:
    """Everything but the mesh (which needs the device count): preset < YAML < flags < key=value.

    configs: "model", "optimizer", "train", "parallel", and "explicit": the fields ("optimizer.lr", …) the user
    set in the YAML file, a flag or a key=value, and the architecture of a preset named (a resume keeps the
    saved value of every other one)."""
    yaml_preset, fields = yaml_fields(args.config) if args.config else (None, {})
    # `--preset X` and `preset: X` in the YAML file name the same run (the flag wins if both are given).
    configs = preset_configs(args.preset or yaml_preset or DEFAULT_PRESET)
    # A preset named is its architecture asked for (a resume refuses another); the vocabulary is the data's.
    explicit = {f"model.{name}" for name in ARCHITECTURE_FIELDS if name != "vocab_size"} \
        if args.preset or yaml_preset else set()

    def override(configs, overrides):
        explicit.update(f"{_field_section(key)}.{key.split('.')[-1]}" for key in overrides)
        return apply_overrides(configs, overrides)

    configs = override(configs, fields)
    flags = {name: getattr(args, name) for name in FLAG_FIELDS if getattr(args, name) is not None}
    if args.resume:
        flags["resume"] = True
    configs = override(configs, flags)
    pairs = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value" + _expanded_glob_hint(item, args.data))
        pairs[key] = value
    configs = override(configs, pairs)
    if configs["train"].init_from:
        configs = _init_from(configs, configs["train"].init_from, args.seq_len or pairs.get("seq_len"))
    # The cosine decays over the whole run unless configured otherwise (a resume keeps the saved one).
    if "optimizer.decay_steps" not in explicit:
        configs["optimizer"] = replace(configs["optimizer"], decay_steps=configs["train"].steps)
    configs["explicit"] = frozenset(explicit)
    return configs, args.mesh, args.sequence_parallel


def _expanded_glob_hint(item: str, data: str | None) -> str:
    """Where a stray argument is a file after --data: the shell expanded an unquoted glob (`--data notes/*.md`
    reached argparse as `--data notes/a.md notes/b.md`), so say how to pass the glob itself."""
    if data is None or not os.path.exists(item):
        return ""
    glob = os.path.join(os.path.dirname(data), "*" + os.path.splitext(data)[1])
    return (f": it is a file, as when the shell expands an unquoted --data glob into {data} {item} …; quote the glob "
            f"(--data '{glob}')")


def preset_configs(name: str) -> dict:
    """The configs a preset starts from: its model, and for the default run its own optimizer and length."""
    configs = {"model": preset(name), "optimizer": OptimizerConfig(), "train": TrainConfig(),
               "parallel": ParallelConfig()}
    if name == DEFAULT_PRESET:
        # The default run's small byte-level model learns fastest at a higher rate than GPT-2's 6e-4.
        configs["optimizer"] = OptimizerConfig(lr=2e-3, warmup_steps=50)
        # float32 compute: the reference run (README). bfloat16 is 1.3x faster on a 2-core CPU with
        # native bf16 dots (models/cpu_matmul.py) and ends 0.024 nats/byte higher at step 800 (README).
        configs["model"] = replace(configs["model"], dtype="float32")
        # 800 steps reach ≈1.7 nats/byte (≤ 1.8 asked) in under 10 minutes on a loaded 2-core CPU.
        configs["train"] = replace(configs["train"], steps=800)
    return configs


def yaml_fields(path: str) -> tuple[str | None, dict]:
    """A --config file as (the name of its preset or None, {field or section.field: value})."""
    loaded = read_yaml(path)
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path!r} must hold a mapping")
    name = loaded.pop("preset", None)
    fields = {}
    for key, value in loaded.items():
        if key in SECTIONS and isinstance(value, dict):
            fields.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, dict):
            raise ConfigError(f"--config {path!r}: unknown section {key!r}; valid: {', '.join(SECTIONS)} (or flat "
                              "field names)")
        else:
            fields[key] = value
    return (None if name is None else str(name)), fields


def read_yaml(path: str):
    """A --config file's contents; anything unreadable is one line."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path!r} is not valid YAML: {problem}{where}") from None


def _saved_mesh(parallel: ParallelConfig) -> str:
    return ",".join(f"{name}={size}" for name, size in axis_sizes(parallel).items())


def _init_from(configs: dict, path: str, seq_len) -> dict:
    """The architecture (and the default tokenizer) of `path`; the rest stays as configured."""
    configs = dict(configs)
    configs["model"] = rundir.init_model(path, configs["model"], int(seq_len) if seq_len else None)
    if configs["train"].tokenizer is None:
        configs["train"] = replace(configs["train"], tokenizer=rundir.init_tokenizer(path))
    return configs


def validate_train(train: TrainConfig) -> None:
    for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches", "checkpoint_every",
                 "keep_checkpoints", "host_devices"):
        if getattr(train, name) < 1:
            raise ConfigError(f"{name}={getattr(train, name)} must be at least 1")
    if train.peak_tflops is not None and train.peak_tflops <= 0:
        raise ConfigError(f"peak_tflops={train.peak_tflops} must be positive")
    profile.parse_window(train.profile, train.steps)


def check_run_dir(run_dir: str) -> None:
    # A uniquely named probe: every process of a multi-process run checks the same shared directory.
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir={run_dir!r} is not writable ({e.strerror})") from None


def gpu_here() -> tuple[bool, bool]:
    """(JAX's CUDA plugin is installed, this machine has an NVIDIA driver), read without starting JAX's backends; the
    driver is looked for only where the plugin is."""
    plugin = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13))
    driver = plugin and (os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None)
    return plugin, driver


def cpu_without_a_gpu(platforms: str | None, plugin: bool, driver: bool) -> bool:
    """Whether the run asks JAX for the CPU alone before its backends start: the CUDA plugin is installed (`plan
    --target` needs it), the machine has no NVIDIA driver, and JAX_PLATFORMS chose nothing. The run is on the CPU
    either way; asked first, the plugin skips its check of the CUDA libraries, which without a GPU fails with a
    17-line "Jax plugin configuration error" traceback at every start (`plan` does the same: `gpu_target.cpu_only`).
    The "Could not find cuda drivers" lines the plugin's library prints as it loads remain (docs/training.md)."""
    return not platforms and plugin and not driver


def resolve_parallel(train: TrainConfig, distributed: DistributedConfig, mesh_text: str | None,
                     sequence_parallel: bool | None, configured: ParallelConfig,
                     pipeline: tuple[str | None, int | None], resumed: bool = False) -> ParallelConfig:
    """Start the devices (simulated CPU devices, the distributed runtime), then resolve the mesh;
    the other parallel fields (the distributed optimizer) come from `configured`, the pipeline
    schedule and virtual stages from `pipeline` where given. `resumed`: `configured` is the saved
    run's, whose mesh and sequence parallelism are kept unless given."""
    jax.config.update("jax_num_cpu_devices", train.host_devices)  # before any device query
    if cpu_without_a_gpu(jax.config.jax_platforms, *gpu_here()):
        jax.config.update("jax_platforms", "cpu")
    initialize(distributed)
    devices = available_devices()
    if mesh_text is None and resumed:  # the saved run's (`resumed_configs`), on this machine's devices
        mesh_text = _saved_mesh(configured)
        if configured.num_devices != len(devices):
            simulate = (f", or --host-devices {configured.num_devices} to simulate the run's"
                        if devices[0].platform == "cpu" else "")
            raise ConfigError(f"--resume: the run's mesh {configured.mesh_text()} needs {configured.num_devices} "
                              f"devices, and there are {len(devices)}: pass --mesh for these{simulate}")
    if mesh_text is None:
        on_cpu = devices[0].platform == "cpu"
        mesh_text = "data=2,tensor=4" if on_cpu and len(devices) == 8 else f"data={len(devices)},tensor=1"
    axes = parse_mesh(mesh_text, len(devices))
    if sequence_parallel is None:  # a resume keeps the saved one (`drop_unusable` drops it at tensor = 1)
        sequence_parallel = configured.sequence_parallel if resumed else axes["tensor"] > 1
    schedule, virtual_stages = pipeline
    return replace(configured, **axes, sequence_parallel=sequence_parallel,
                   schedule=configured.schedule if schedule is None else schedule,
                   virtual_stages=configured.virtual_stages if virtual_stages is None else virtual_stages)


def default_mesh_fits(run: RunConfig, devices) -> str | None:
    """--mesh text of the first data × tensor mesh of these devices (the largest tensor first) on which the run's
    configuration is valid, or None."""
    n = len(devices)
    for t in sorted((t for t in range(1, n + 1) if n % t == 0), reverse=True):
        parallel = replace(run.parallel, pipe=1, context=1, data=n // t, tensor=t,
                           sequence_parallel=run.parallel.sequence_parallel and t > 1)
        try:
            validate(run.model, parallel, run.train.remat, n, run.train.batch_size, run.train.micro_batch_size)
        except ConfigError:
            continue
        return f"data={n // t},tensor={t}"
    return None


def validate_run(run: RunConfig, default_mesh: bool) -> None:
    """`validate`. `default_mesh`: the user gave no --mesh; where the configuration fails on that default mesh
    and another mesh of the same devices would do, the one line says the mesh was the default and names one."""
    devices = available_devices()
    try:
        validate(run.model, run.parallel, run.train.remat, len(devices), run.train.batch_size,
                 run.train.micro_batch_size)
    except ConfigError as e:
        fits = default_mesh_fits(run, devices) if default_mesh else None
        if fits is None:
            raise
        p, kind = run.parallel, ("simulated CPU" if devices[0].platform == "cpu" else devices[0].platform.upper())
        raise ConfigError(f"{e}: the mesh data={p.data},tensor={p.tensor} is the default on {len(devices)} {kind} "
                          f"devices, not one you asked for; set one with --mesh (e.g. --mesh {fits})") from None


def resolve(args) -> tuple[RunConfig, Corpus]:
    """Everything the run needs (devices and mesh, the data and its vocabulary and tokenizer, the
    initial weights), resolved, then validated: the loop receives a final RunConfig. A resume starts
    from the run's saved configuration (`resumed_configs`) and says in one line what it changes."""
    configs, mesh_text, sequence_parallel = configs_from_args(args)
    run_dir = configs["train"].run_dir
    if configs["train"].resume and not rundir.has_checkpoints(run_dir):  # refused before anything is created
        raise ConfigError(f"--resume: no checkpoint in {rundir.checkpoint_dir(run_dir)}: nothing to resume (pass the "
                          f"--run-dir of a run that saved one, or leave --resume out to start a run there)")
    saved = None
    if configs["train"].resume and os.path.isfile(os.path.join(configs["train"].run_dir, rundir.CONFIG)):
        if "train.init_from" in configs["explicit"]:
            raise ConfigError("--init-from starts a new run from a run's weights; --resume continues the run in "
                              "--run-dir from its own checkpoint: pass one of them")
        saved = rundir.saved_configs(configs["train"].run_dir)
        configs = resumed_configs(saved, configs)
    model, optimizer, train = configs["model"], configs["optimizer"], configs["train"]
    validate_train(train)
    validate_optimizer(optimizer)
    distributed = DistributedConfig(coordinator=args.coordinator, num_processes=args.num_processes,
                                    process_id=args.process_id, heartbeat_timeout_s=args.heartbeat_timeout)
    parallel = resolve_parallel(train, distributed, mesh_text, sequence_parallel, configs["parallel"],
                                (args.schedule, args.virtual_stages), resumed=saved is not None)
    dropped = {}
    if saved is not None:
        given = {name for name, value in (("schedule", args.schedule), ("virtual_stages", args.virtual_stages),
                                          ("sequence_parallel", sequence_parallel)) if value is not None}
        given |= {key.split(".", 1)[1] for key in configs["explicit"] if key.startswith("parallel.")}
        parallel, dropped = drop_unusable(configs["model"], parallel, given)
    corpus = load_corpus(train.data, train.tokenizer)
    # The data defines the vocabulary (and, for token files, the tokenizer); initial weights may hold more,
    # and a resumed model keeps its own where the data's fits in it.
    if saved is not None:  # a larger vocabulary than the saved one is refused below
        vocab = max(corpus.vocab_size, saved["model"].vocab_size)
    elif train.init_from is not None:
        vocab = rundir.init_vocab(train.init_from, corpus.vocab_size)
    else:
        vocab = corpus.vocab_size
    platform = available_devices()[0].platform
    if "model.layer_loop" not in configs["explicit"]:  # the platform's, at every launch (a resume on another too)
        model = replace(model, layer_loop=default_layer_loop(platform, parallel))
    if train.record_autotune is not None and platform != "gpu":
        raise ConfigError(f"record_autotune={train.record_autotune!r}: XLA autotunes GEMMs on GPUs only; this run's "
                          f"devices are {platform} (leave --record-autotune out)")
    model = on_platform(replace(model, vocab_size=vocab, eod_token=document_end(model, corpus)), platform, parallel)
    if (platform == "gpu" and model.attention == "fused" and model.dtype == "bfloat16" and not cudnn_compiles(parallel)
            and is_main_process()):
        print("attention: XLA's fused attention (scores materialised), not cuDNN's: jaxseq's cuDNN attention does not "
              "take the all-gather context strategy's mask (--context-strategy ring does; config.cudnn_compiles)",
              flush=True)
    elif (platform == "gpu" and model.attention == "fused" and model.dtype == "bfloat16" and model.document_mask
          and parallel.context == 1 and is_main_process()):
        print("attention: XLA's fused attention with the documents' dense mask (scores materialised), not cuDNN's: "
              "jaxseq calls cuDNN through jax.nn.dot_product_attention, which gives it one sequence length a row, not "
              "segment ids (at context > 1 the ring strategy runs its own flash-style blocks, skipping those no "
              "document spans)",
              flush=True)
    if "train.remat" not in configs["explicit"] and saved is None:  # a resume keeps its saved policy
        train = replace(train, remat=default_remat(platform, model.attention, model.layer_loop))
    run = RunConfig(model=model, parallel=parallel, optimizer=optimizer,
                    train=replace(train, tokenizer=corpus.tokenizer),
                    distributed=distributed)
    if saved is not None:
        check_architecture(saved["model"], run.model)
    validate_run(run, default_mesh=mesh_text is None and not train.resume)  # a resume keeps the run's mesh
    run = dataclasses.replace(run, train=resolved_offload(run.train, run.model))
    check_run_dir(run.train.run_dir)
    if saved is not None and is_main_process():
        print(resume_line(saved, run, dropped), flush=True)
    return run, corpus


def document_end(model: ModelConfig, corpus: Corpus) -> int | None:
    """The end-of-document id a document-masked run splits its sequences at: the data's (one line where it has
    none); the model's own (None) without the mask."""
    if not model.document_mask:
        return model.eod_token
    if corpus.eod is None:
        raise ConfigError(f"--document-mask: the data {corpus.name!r} has no end-of-document token (its tokenizer has "
                          "none of <|endoftext|>, <|end_of_text|>, </s>, <eos>): python -m jaxseq.data adds one")
    return corpus.eod


def resolved_offload(train: TrainConfig, model: ModelConfig) -> TrainConfig:
    """`train` with its --offload resolved to the checkpoint names it sends to host memory (`offload.resolve`: `all`
    is every name the remat policy stores that the model tags); a name it does not store is one line."""
    if not train.offload:
        return replace(train, offload=None)
    try:
        names = host_offload.resolve(train.offload, train.remat, tagged_names(model))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return replace(train, offload=",".join(names) or None)


def main(argv=None) -> int:
    """The command: its exit status (0; 1 a failed run; 2 a bad configuration; 128 + N after signal N:
    130 for SIGINT, 143 for SIGTERM, docs/training.md)."""
    args = build_parser().parse_intermixed_args(argv)
    try:
        with cli.interruptible():
            return cli.run(lambda: _train(args))
    except cli.Interrupted as e:
        return cli.error(f"{e}: stopped before the first step; nothing to save", e.status)


def _train(args) -> int:
    clock = goodput.Clock()  # the run's wall time from here: the devices, the data and the configuration its set-up
    with clock.part("set_up"):
        run, corpus = resolve(args)
    try:
        return loop.train(run, corpus, clock)
    except loop.TrainingError as e:
        return cli.error(str(e), 1)
    except jax.errors.JaxRuntimeError as e:
        return cli.error(runtime_failure(e, jax.process_count()), 1)


def runtime_failure(e: Exception, processes: int) -> str:
    """One line for a failed execution (out of memory, a collective whose peer died): the runtime's
    first line says what; the Python stack below it is XLA's dispatch and says nothing to a user."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = ("; in a multi-process run this usually means another process died (see its log): "
            "restart with --resume" if processes > 1 else "")
    return f"the XLA runtime failed: {first}{hint}"


if __name__ == "__main__":
    cli.exit_process(main())
