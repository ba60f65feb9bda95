"""Compiled programs shared by the HLO tests (cached: each compile takes seconds)."""

from functools import lru_cache

import jax

from jaxseq.config import ModelConfig, ParallelConfig
from jaxseq.mesh import make_mesh
from jaxseq.training import aot

# The paper's attention-score term 5as/h = 5·8·128/64 = 80 (GPT-3 175B has 5·96·2048/12288 = 80).
S, B, H, A_HEADS, T, L = 128, 2, 64, 8, 4, 2
MEMORY_CFG = ModelConfig(vocab_size=1500, seq_len=S, hidden=H, heads=A_HEADS, layers=L, dtype="bfloat16", dropout=0.1)


@lru_cache(maxsize=None)
def hlo(remat: str, sequence_parallel: bool, tensor: int = T, cfg: ModelConfig = MEMORY_CFG) -> str:
    parallel = ParallelConfig(data=1, tensor=tensor, sequence_parallel=sequence_parallel)
    mesh = make_mesh(parallel, jax.devices()[:tensor])
    return aot.compile_loss_and_grad(cfg, parallel, remat, mesh, B).as_text()
