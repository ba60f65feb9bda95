"""The time model's one fitted constant, and the papers' own FLOP accounting to compare with: the compute
efficiency that makes a candidate's predicted step time a published one (`calibrate_compute_efficiency`; the
default, `search_space.COMPUTE_EFFICIENCY`, is fitted so on one row of Korthikanti et al. 2022), and TFLOP/s per
GPU as a paper counts it (`paper_tflops_per_gpu`). Only experiments/autoconfig.py and the tests use them: the
search itself reads the constant from its `TimeModel`.
"""

from __future__ import annotations

from jaxseq.config import ConfigError, ModelConfig, replace
from jaxseq.models import model
from jaxseq.models.formulas import paper_hardware_flops, train_flops
from jaxseq.planning.costs import Costs
from jaxseq.planning.search_space import Candidate, Request
from jaxseq.planning.search_time import step_time


def paper_tflops_per_gpu(cfg: ModelConfig, batch: int, gpus: int, seconds: float, accounting: str) -> float:
    """TFLOP/s per GPU as a paper counts it: `model` (Korthikanti's MFU numerator) or `full`
    (Narayanan et al. 2021: 96·B·s·L·h²·(1 + s/(6h) + V/(16hL)), full recompute: GPT's shapes only)."""
    if accounting == "full" and not model.traits(cfg).papers_formulas:
        raise ConfigError(f"accounting={accounting!r} is the papers' GPT formula; family={cfg.family!r} has none")
    flops = (paper_hardware_flops(batch, cfg.seq_len, cfg.layers, cfg.hidden, cfg.vocab_size, "full")
             if accounting == "full" else train_flops(cfg, batch))
    return flops / seconds / gpus / 1e12


def calibrate_compute_efficiency(cfg: ModelConfig, r: Request, c: Candidate, costs: Costs, seconds: float) -> float:
    """The compute efficiency that makes candidate c's predicted step time equal `seconds`. The time falls
    as the efficiency rises (until every GEMM is memory-bound), so bisection finds it."""
    layer = costs.layer(c.tensor, c.sequence_parallel, c.remat, c.micro_batch, c.context, c.context_strategy)
    # the distributed optimizer splits over data × context: d·c ranks to the state's arithmetic
    state = costs.state(replace(cfg, layers=cfg.layers // c.pipe), c.tensor, c.data * c.context,
                        c.distributed_optimizer, c.pipe)
    at = lambda eff: step_time(cfg, c, layer, state, r.hardware, replace(r.time_model, compute_efficiency=eff)).total_s
    if seconds <= at(1.0):
        raise ConfigError(f"{seconds:g} s is less than the time at peak efficiency, {at(1.0):.3f} s: cannot calibrate")
    low, high = 1e-3, 1.0
    while high - low > 1e-7:
        mid = (low + high) / 2
        low, high = (mid, high) if at(mid) > seconds else (low, mid)
    return (low + high) / 2
