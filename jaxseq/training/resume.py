"""A resumed run: the saved configuration, with only what this launch set explicitly replaced (`resumed_configs`),
the saved parallel settings a new mesh cannot use set back to their defaults (`drop_unusable`), the architecture
held fixed (`check_architecture`), and the one line that says what changed (`resume_line`)."""

from __future__ import annotations

import dataclasses
import os

from jaxseq.config import ARCHITECTURE_FIELDS, SECTIONS, ConfigError, ModelConfig, ParallelConfig, RunConfig, replace
from jaxseq.mesh import MESH_AXES
from jaxseq.training import rundir


# What a resume neither restores nor reports: how this launch finds the run, what the platform decides, and the
# settings of one launch on one machine (its simulated devices, its device's peak, a GPU's autotuner record).
NOT_RESTORED = {"train": {"resume", "run_dir", "host_devices", "peak_tflops", "record_autotune", "profile"},
                "model": {"matmul", "fused_kernel"}}


def resumed_configs(saved: dict, configs: dict) -> dict:
    """The configs of a resumed run: the saved ones (`rundir.saved_configs`: data, steps, batch sizes, mesh,
    tokenizer, the optimizer and its schedule, `decay_steps` of the original run included, so extending a
    finished run stays at the final learning rate), with only the fields in configs["explicit"] replaced by
    their configured values."""
    explicit, resumed = configs["explicit"], dict(configs)
    for section in SECTIONS:
        keep = NOT_RESTORED.get(section, set())
        given = {f.name: getattr(configs[section], f.name) for f in dataclasses.fields(SECTIONS[section])
                 if f"{section}.{f.name}" in explicit or f.name in keep}
        resumed[section] = replace(saved[section], **given)
    return resumed


def resume_changes(saved: dict, run: RunConfig, dropped: frozenset[str] = frozenset()) -> list[str]:
    """What a resumed run changes of the saved one ("steps 200 → 400", "mesh data=2 × tensor=4 → …"), but the
    parallel settings in `dropped` (`drop_unusable`), which the resume line reports apart."""
    changes = []
    if saved["parallel"].mesh_text() != run.parallel.mesh_text():
        changes.append(f"mesh {saved['parallel'].mesh_text()} → {run.parallel.mesh_text()}")
    for section in SECTIONS:
        skip = NOT_RESTORED.get(section, set()) | (set(MESH_AXES) | dropped if section == "parallel" else set())
        for f in dataclasses.fields(SECTIONS[section]):
            before, after = getattr(saved[section], f.name), getattr(getattr(run, section), f.name)
            if f.name not in skip and before != after:
                changes.append(f"{f.name} {before!r} → {after!r}")
    return changes


def drop_unusable(model: ModelConfig, parallel: ParallelConfig, given: set[str]) -> tuple[ParallelConfig, dict]:
    """A resumed run's parallel settings that came back from config.json and that its mesh (a new one, --mesh) cannot
    use, set to their defaults: (the parallel config, {field: what was dropped and why, e.g. "schedule 'zb-h1' (no
    pipeline)"}). A setting given on this launch is the user's and is kept: `validate` refuses it in one line."""
    p, default, dropped = parallel, ParallelConfig(), {}

    def drop(name: str, why: str) -> None:
        if name not in given and getattr(p, name) != getattr(default, name):
            dropped[name] = f"{name} {getattr(p, name)!r} ({why})"

    if p.pipe == 1:
        if not {"schedule", "virtual_stages"} & given:  # one given: the pair is the user's
            drop("schedule", "no pipeline")
            drop("virtual_stages", "no pipeline")
    else:
        if model.layers % (p.pipe * p.virtual_stages):
            drop("virtual_stages", f"layers={model.layers} is not divisible by pipe × virtual_stages = "
                                   f"{p.pipe}×{p.virtual_stages}")
        if p.schedule == "interleaved" and "virtual_stages" in dropped:
            drop("schedule", "interleaving needs virtual_stages ≥ 2")
        if p.schedule == "zb-h1" and (p.fsdp > 1 or p.tensor > model.num_kv_heads):
            drop("schedule", f"zb-h1 takes neither fsdp > 1 nor tensor > kv_heads={model.num_kv_heads}")
    if p.sequence_parallel and (p.tensor == 1 or model.seq_len % p.tensor):
        drop("sequence_parallel", "tensor=1" if p.tensor == 1 else f"tensor={p.tensor} does not divide "
                                                                   f"seq_len={model.seq_len}")
    if p.distributed_optimizer and p.fsdp > 1 and p.data * p.context == 1:
        drop("distributed_optimizer", f"fsdp={p.fsdp} with data=1 already splits the optimizer state")
    return replace(p, **{name: getattr(default, name) for name in dropped}), dropped


def check_architecture(saved: ModelConfig, model: ModelConfig) -> None:
    """A resume trains the saved model: what cannot change is refused in one line."""
    diffs = [f"{k}={getattr(saved, k)!r} (saved) vs {getattr(model, k)!r}" for k in ARCHITECTURE_FIELDS
             if getattr(saved, k) != getattr(model, k)]
    if diffs:
        raise ConfigError("cannot resume: the checkpoint's model differs: " + ", ".join(diffs) +
                          " (a run's architecture is fixed; --init-from RUN starts a new run from its weights)")


def resume_line(saved: dict, run: RunConfig, dropped: dict) -> str:
    """`resume: the run as saved in RUN/config.json`, what this launch asked to change, and what the resume
    dropped (`drop_unusable`)."""
    changes = resume_changes(saved, run, frozenset(dropped))
    line = f"resume: the run as saved in {os.path.join(run.train.run_dir, rundir.CONFIG)}"
    if changes:
        line += ", changed as asked: " + ", ".join(changes)
    if dropped:
        line += f"; dropped, as the mesh {run.parallel.mesh_text()} cannot use them: " + ", ".join(dropped.values())
    return line + ("" if changes or dropped else " (nothing changed)")
