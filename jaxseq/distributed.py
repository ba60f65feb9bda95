"""Multi-process runs through `jax.distributed`: one process per host (or per GPU), one global mesh.

Only the command-line edge calls this module (it reads the launcher's environment to detect SLURM
and Open MPI); everything below it sees a plain global mesh.
"""

from __future__ import annotations

import os
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxseq.config import ConfigError, DistributedConfig

# Environment variables by which JAX's own cluster detection recognises a launcher.
LAUNCHERS = {"SLURM": "SLURM_JOB_ID", "Open MPI": "OMPI_COMM_WORLD_SIZE"}


def validate_distributed(cfg: DistributedConfig) -> None:
    given = [cfg.coordinator is not None, cfg.num_processes is not None, cfg.process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("--coordinator, --num-processes and --process-id must be given together")
    if cfg.explicit:
        host, _, port = cfg.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"coordinator={cfg.coordinator!r} is not HOST:PORT")
        if cfg.num_processes < 1 or not 0 <= cfg.process_id < cfg.num_processes:
            raise ConfigError(
                f"process_id={cfg.process_id} is not in [0, num_processes={cfg.num_processes})"
            )
    if cfg.heartbeat_timeout_s < 1:
        raise ConfigError(f"heartbeat_timeout_s={cfg.heartbeat_timeout_s} must be at least 1")


def detected_launcher(environ=None) -> str | None:
    environ = os.environ if environ is None else environ
    return next((name for name, var in LAUNCHERS.items() if var in environ), None)


def initialize(cfg: DistributedConfig, environ=None) -> bool:
    """Start the distributed runtime when asked or launched by SLURM/Open MPI; False: one process.

    Must run before anything touches JAX's devices.
    """
    validate_distributed(cfg)
    launcher = detected_launcher(environ)
    if not cfg.explicit and launcher is None:
        return False
    if jax.config.jax_platforms in (None, "", "cpu"):
        # Cross-process collectives on CPU (tests, CPU clusters) go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                  initialization_timeout=cfg.initialization_timeout_s)
    if cfg.explicit:
        kwargs.update(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                      process_id=cfg.process_id)
    jax.distributed.initialize(**kwargs)  # no coordinates: JAX's own SLURM / Open MPI detection
    return True


def is_main_process() -> bool:
    """Only process 0 prints, logs metrics and writes the resolved config."""
    return jax.process_index() == 0


def local_batch_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> slice:
    """The contiguous rows of the global batch whose shards live on this process's devices.

    Each process then reads only those rows from its data source.
    """
    index_map = sharding.addressable_devices_indices_map((global_batch, seq_len))
    starts = sorted({idx[0].start or 0 for idx in index_map.values()})
    stops = sorted({idx[0].stop if idx[0].stop is not None else global_batch for idx in index_map.values()})
    rows = slice(starts[0], stops[-1])
    if (rows.stop - rows.start) * jax.process_count() != global_batch:
        raise ConfigError(f"the batch rows of process {jax.process_index()} ({rows}) are not an even share "
                          f"of batch_size={global_batch} over {jax.process_count()} processes")
    return rows


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding, global_batch_size: int) -> dict:
    """Assemble the global batch from each process's rows (no process holds another's data)."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_batch_size, *v.shape[1:]))
        for k, v in local.items()
    }
