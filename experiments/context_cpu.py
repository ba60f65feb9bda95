"""Context parallelism on 8 simulated CPU devices: per layer per device stored bytes (compiled HLO), the
compiled temporaries, and the CPU time of one loss-and-gradient step, for context 1, 2, 4 with both strategies,
at the same devices (data × context × tensor = 8, tensor = 2 + SP).

    python experiments/context_cpu.py [SEQ_LEN] [REPEATS]   # default 1024 3; prints one JSON object

The model is the tiny GPT (h 64, 8 heads, 2 layers) in float32 with selective recompute, batch 4 (so data ≤ 4);
a first step to a small shape, not the issue's 7–8B plan (which needs planning/).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxseq.config import ParallelConfig, replace  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import model as M  # noqa: E402
from jaxseq.parallel.layout import Layout  # noqa: E402
from jaxseq.planning import hlo_loops  # noqa: E402
from jaxseq.training import train_step as T  # noqa: E402


def measure(cfg, parallel: ParallelConfig, repeats: int, batch_size: int = 4) -> dict:
    mesh = make_mesh(parallel)
    params = M.init_params(jax.random.key(1), cfg, tensor=parallel.tensor)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    fn = T.make_loss_and_grad(Layout(cfg, parallel, mesh), "selective")
    compiled = fn.lower(params, batch, jax.random.key(2)).compile()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, batch, jax.random.key(2)))
        times.append(time.perf_counter() - start)
    return {"mesh": parallel.mesh_text(), "strategy": parallel.context_strategy if parallel.context > 1 else None,
            "stored_bytes_per_layer": hlo_loops.stored_bytes_per_layer(compiled.as_text(), cfg.layers),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "seconds_per_step_median": statistics.median(times[1:])}


def main(argv) -> None:
    seq_len = int(argv[0]) if argv else 1024
    repeats = int(argv[1]) if len(argv) > 1 else 3
    cfg = replace(preset("tiny"), dtype="float32", seq_len=seq_len)
    rows = [measure(cfg, ParallelConfig(data=4, tensor=2, sequence_parallel=True), repeats)]
    for c in (2, 4):
        for strategy in ("all-gather", "ring"):
            rows.append(measure(cfg, ParallelConfig(data=4 // c, context=c, tensor=2, sequence_parallel=True,
                                                    context_strategy=strategy), repeats))
    print(json.dumps({"seq_len": seq_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
