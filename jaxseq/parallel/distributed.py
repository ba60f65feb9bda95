"""Multi-process runs through `jax.distributed`: one process per host (or per GPU), one global mesh.

Only the command-line edge calls this module (it reads the launcher's environment to detect SLURM
and Open MPI); everything below it sees a plain global mesh.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxseq.config import ConfigError, DistributedConfig

# What JAX's cluster detection requires of the environment (jax/_src/clusters: SlurmCluster and
# OmpiCluster.is_env_present), and JAX's name for each. SLURM: an srun step, not only an allocation
# (an salloc shell or a batch script has SLURM_JOB_ID but no step variables). Open MPI: mpirun's ORTE
# URI, which Open MPI 5 (PRRTE) no longer sets; JAX 0.12 also reads Open MPI 5's environment
# (`open_mpi_5`), and then finds the coordinator through mpi4py.
LAUNCHERS = {
    "SLURM": ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")),
    "Open MPI": ("ompi", ("OMPI_MCA_orte_hnp_uri",)),
}
# Variables that say a launcher is around even when JAX could not use it.
HINTS = {"SLURM": "SLURM_JOB_ID", "Open MPI": "OMPI_COMM_WORLD_SIZE"}
OPEN_MPI_5_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def _jax_reads_open_mpi_5() -> bool:
    """Whether this JAX's Open MPI detection accepts Open MPI 5 (JAX 0.12 does; 0.10.2 does not)."""
    try:
        from jax._src.clusters import ompi_cluster

        return hasattr(ompi_cluster.OmpiCluster, "_is_ompi_5")
    except Exception:  # a private API: where it moved, assume the older rule
        return False


def open_mpi_5(environ) -> bool:
    """Open MPI 5's environment as JAX 0.12 recognises it: the process variables, and OMPI_VERSION ≥ 5 or,
    without a readable OMPI_VERSION, no ORTE URI (Open MPI 4's mpirun always sets one)."""
    if not all(var in environ for var in OPEN_MPI_5_VARIABLES):
        return False
    try:
        return int(environ.get("OMPI_VERSION", "").split(".", 1)[0]) >= 5
    except ValueError:
        return "OMPI_MCA_orte_hnp_uri" not in environ


def _launched_by(name: str, required: tuple[str, ...], environ) -> bool:
    """LAUNCHERS' conditions, with Open MPI 5 where this JAX reads it."""
    if all(var in environ for var in required):
        return True
    return name == "Open MPI" and _jax_reads_open_mpi_5() and open_mpi_5(environ)


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


def _jax_detects(method: str) -> bool | None:
    """JAX's own verdict on os.environ; None where its private cluster API has moved."""
    try:
        from jax._src import clusters

        env = next(c for c in clusters.ClusterEnv._cluster_types if c.name == method)
        return bool(env.is_env_present())
    except Exception:  # a private API: any change falls back to the mirrored conditions
        return None


def detected_launcher(environ=None) -> str | None:
    """The launcher whose environment JAX's cluster detection accepts, else None.

    On the process's own environment JAX itself is asked; for another mapping (tests) or where JAX's
    private API has changed, its conditions as mirrored in LAUNCHERS decide."""
    for name, (method, required) in LAUNCHERS.items():
        verdict = _jax_detects(method) if environ is None else None
        if verdict is None:
            verdict = _launched_by(name, required, os.environ if environ is None else environ)
        if verdict:
            return name
    return None


def incomplete_launcher(environ=None) -> str | None:
    """One line for a launcher environment JAX cannot use, else None. Several processes started that
    way would each train alone into the same run directory: a ConfigError. One process (an salloc
    shell, a batch script without srun): a note, and the run goes on in one process."""
    environ = os.environ if environ is None else environ
    name = next((n for n, var in HINTS.items() if var in environ), None)
    if name is None:
        return None
    missing = ", ".join(var for var in LAUNCHERS[name][1] if var not in environ)
    if name == "Open MPI":
        size = environ["OMPI_COMM_WORLD_SIZE"]
        if size != "1":
            raise ConfigError(
                f"Open MPI started {size} processes without {missing} (Open MPI 5 no longer sets it, and this JAX "
                "reads only Open MPI 4's environment), so JAX cannot find the coordinator; pass --coordinator "
                "HOST:PORT --num-processes N --process-id I")
        return f"Open MPI without {missing}: running as one process"
    return (f"SLURM job without {missing} (an allocation, not an srun step): running as one process; "
            "start one process per host with srun")


def _alone_on_host(launcher: str, environ) -> bool:
    """Whether the launcher started one process on this host. JAX's detection then still makes each
    process drive only its local-rank device (one process per GPU), so a process per host would use
    one of its GPUs."""
    if launcher == "SLURM":
        tasks = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
        nodes = environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES"))
        return tasks is not None and tasks == nodes  # every node has a task, so exactly one each
    return environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"


def initialize(cfg: DistributedConfig, environ=None) -> bool:
    """Start the distributed runtime when asked or launched by SLURM/Open MPI; False: one process.

    Must run before anything touches JAX's devices.
    """
    validate_distributed(cfg)
    launcher = None if cfg.explicit else detected_launcher(environ)
    if not cfg.explicit and launcher is None:
        note = incomplete_launcher(environ)
        if note:
            print(f"note: {note}", file=sys.stderr, flush=True)
        return False
    environ = os.environ if environ is None else environ
    if launcher == "Open MPI" and open_mpi_5(environ) and importlib.util.find_spec("mpi4py") is None:
        raise ConfigError(
            f"Open MPI 5 started {environ['OMPI_COMM_WORLD_SIZE']} processes; JAX finds their coordinator through "
            "mpi4py, which is not installed: pip install mpi4py, or pass --coordinator HOST:PORT --num-processes N "
            "--process-id I")
    if jax.config.jax_platforms in (None, "", "cpu"):
        # Cross-process collectives on CPU (tests, CPU clusters) go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**initialize_kwargs(cfg, launcher, environ))
    return True


def initialize_kwargs(cfg: DistributedConfig, launcher: str | None, environ) -> dict:
    """jax.distributed.initialize's arguments: the explicit coordinates, or JAX's own detection of
    `launcher` (coordinator, process count and index from its environment)."""
    kwargs = dict(heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
                  initialization_timeout=cfg.initialization_timeout_s)
    if cfg.explicit:
        return dict(kwargs, coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                    process_id=cfg.process_id)
    kwargs["cluster_detection_method"] = LAUNCHERS[launcher][0]
    if _alone_on_host(launcher, environ):
        # An empty list: every local device. None would let JAX pick the local-rank device alone.
        kwargs["local_device_ids"] = []
    return kwargs


def is_main_process() -> bool:
    """Only process 0 prints, logs metrics and writes the resolved config."""
    return jax.process_index() == 0


def local_batch_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> slice:
    """The rows of the global batch that this process's devices hold, which it alone reads from its data source.

    A process's share is whatever its devices' shards cover: 1/P of the rows when processes split `data`, every
    row when they split an axis the batch is replicated over (pipeline stages, context or tensor ranks across
    hosts: each stage needs every micro-batch, each context rank every row), and anything between. Processes
    that hold the same rows read the same rows (the stream is a function of the step), so
    `make_array_from_process_local_data` places identical replicas. The rows must be one contiguous run."""
    index_map = sharding.addressable_devices_indices_map((global_batch, seq_len))
    held = set()
    for idx in index_map.values():
        held.update(range(*idx[0].indices(global_batch)))
    rows = slice(min(held), max(held) + 1)
    if len(held) != rows.stop - rows.start:
        raise ConfigError(f"the batch rows of process {jax.process_index()} are not one contiguous run "
                          f"({sorted(held)} of batch_size={global_batch}): order the mesh so that one host's "
                          "devices hold neighbouring data ranks")
    return rows


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding, global_batch_size: int) -> dict:
    """Assemble the global batch from each process's rows (no process holds another's data)."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_batch_size, *v.shape[1:]))
        for k, v in local.items()
    }
