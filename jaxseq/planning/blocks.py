"""Megatron-LM's block recompute (`--recompute-method block --recompute-num-layers N`; jaxseq's remat spec
`first:N+rest`, `remat.block_spec`), composed from two policies' figures, nothing compiled for it. This is the one
composition the plan's rows (`recommend.block_row`) and the search's candidates (`search_memory.block_memory`,
`search_time.block_time`) both use.

The first n layers of each pipeline chunk of k (L/(p·v); the stack without a pipeline) run under `first`'s policy,
the other k − n under `rest`'s:
- a per-layer sum is n/k of the way from rest's figure to first's (`Block.mix`): stored bytes, FLOPs and
  collectives per layer, a step's compute and TP time, the executor's buffers; and the activations a stage
  holds, exact for every schedule (each chunk in flight holds n layers of each kind, and both policies the same
  embedding/logits part); the bubble's share of the time (a product of two sums) approximately;
- the peak is the larger of the two backward loops' (`Block.peak`): the rest's runs first, holding every stored
  activation, with rest's working memory; then the first layers', the chunk's k − n rest layers' activations
  freed, with first's working memory.
Held to the compiled steps (XLA:CPU's and the H100's) in tests/test_block_recompute.py and tests/test_gpu_target.py.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Callable, TypeVar

Figures = TypeVar("Figures")


@dataclass(frozen=True)
class Block:
    """The first n of a chunk's k layers under one policy, the rest under another."""

    n: int  # layers per chunk under the first policy (Megatron's --recompute-num-layers)
    k: int  # layers per chunk, L/(p·v)

    def spec(self, first: str, rest: str) -> str:
        """The remat spec `train --remat` takes for it (`remat.block_spec` reads it back)."""
        return f"{first}:{self.n}+{rest}"

    @property
    def weight(self) -> float:
        """The first policy's share of a chunk's layers."""
        return self.n / self.k

    def mix(self, first, rest):
        """A per-layer sum n/k of the way from rest's to first's: a number; a dict of numbers (rest's keys, a key
        first lacks counted 0); or a dataclass of numbers, field by field."""
        if isinstance(rest, dict):
            return {key: self.mix(first.get(key, 0), value) for key, value in rest.items()}
        if is_dataclass(rest):
            return type(rest)(**{f.name: self.mix(getattr(first, f.name), getattr(rest, f.name))
                                 for f in fields(rest)})
        return rest + self.weight * (first - rest)

    def peak(self, rest_loop: Callable[[float], Figures], first_loop: Callable[[float], Figures],
             activations: float, rest_stored: float, total: Callable[[Figures], float]) -> Figures:
        """The larger (by `total`) of the two backward loops' figures, each loop's at the activations it holds:
        the rest's loop all of them (`activations`, mixed), the first layers' loop those less the chunk's k − n
        rest layers' (`rest_stored` bytes each), freed before it runs."""
        return max(rest_loop(activations), first_loop(activations - (self.k - self.n) * rest_stored), key=total)


def fewest(k: int, compose: Callable[[int], Figures], fits: Callable[[Figures], bool]) -> Figures | None:
    """The composition (`compose(n)`) with the fewest first-policy layers per chunk of k that fits, short of all
    k (which is the first policy itself); None where none does."""
    return next((figures for figures in map(compose, range(1, k)) if fits(figures)), None)
