"""What `--search` (`planning.search`) reads from compiled programs and from shapes: its `Costs`."""

from __future__ import annotations

from dataclasses import asdict

from jaxseq.config import ModelConfig, ParallelConfig, replace, validate
from jaxseq.planning import search as S
from jaxseq.planning.measure import MEASURE_LAYERS, Compiler, RowSpec
from jaxseq.planning.memory import (non_layer_activation_bytes, parameter_elements_per_device, state_bytes,
                                    state_bytes_by_part)


class SearchCosts:
    """jaxseq.planning.search's costs, measured once per (t, SP, remat) for one layer shape (any depth): the
    training computation at micro-batch 1 (stored bytes, FLOPs, activation collectives, the
    embedding/logits FLOPs: proportional to b) and the float32 train step at micro-batch 1 and 2 (the
    working memory: affine in b). `measured` (JSON-ready) can be saved and passed back to skip compiling."""

    def __init__(self, cfg: ModelConfig, devices, workers: int = 2, measured: dict | None = None):
        self.cfg = cfg
        self.one, self.two = Compiler(cfg, 1, devices, workers), Compiler(cfg, 2, devices, workers)
        self.measured = dict(measured or {})
        self._states: dict = {}

    @staticmethod
    def key(tensor: int, sequence_parallel: bool, remat: str) -> str:
        return f"t={tensor} sp={int(sequence_parallel)} {remat}"

    def prepare(self, keys, micro_batches=(1, 2)) -> None:
        rows = [RowSpec("search", remat, sp, t, None) for t, sp, remat in keys]
        for c in rows:
            validate(self.cfg, ParallelConfig(data=1, tensor=c.tensor, sequence_parallel=c.sequence_parallel), c.remat)
        name = lambda c: self.key(c.tensor, c.sequence_parallel, c.remat)
        todo = [c for c in rows if name(c) not in self.measured]
        # The working memory at b = 2 too, unless b = 1 is all that is asked for.
        affine = [c for c in rows if max(micro_batches) > 1 and self.measured.get(name(c), {}).get("working_bytes_b2") is None]
        self.one.compile_all([k for c in todo for k in self.one.programs(c)])  # grad at L=2 and 0, the step
        self.two.compile_all([("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel) for c in affine])
        for c in todo:
            self.measured[name(c)] = {**asdict(self.one.measure(c)), "working_bytes_b2": None,
                                      "head_flops": self.one.head_flops(c)}
        for c in affine:
            self.measured[name(c)]["working_bytes_b2"] = self.two.working_bytes(c)
        # The numbers are read: free the executables' memory.
        self.one.clear()
        self.two.clear()

    def layer(self, tensor: int, sequence_parallel: bool, remat: str, micro_batch: int) -> S.LayerCost:
        m, b = self.measured[self.key(tensor, sequence_parallel, remat)], micro_batch
        if b > 1 and m["working_bytes_b2"] is None:
            self.prepare([(tensor, sequence_parallel, remat)], (b,))  # measured at b = 1 only so far
            m = self.measured[self.key(tensor, sequence_parallel, remat)]
        return S.LayerCost(
            b * m["stored_bytes_per_layer"], {k: b * v for k, v in m["collective_bytes_per_layer"].items()},
            m["working_bytes"] + (b - 1) * (m["working_bytes_b2"] - m["working_bytes"] if b > 1 else 0),
            non_layer_activation_bytes(self.cfg, b, tensor, sequence_parallel))

    def state(self, stage: ModelConfig, tensor: int, data: int, distributed_optimizer: bool, pipe: int) -> S.StateCost:
        key = (stage, tensor, data, distributed_optimizer, pipe)
        if key not in self._states:
            parts = state_bytes_by_part(stage, tensor, data, distributed_optimizer, pipe)
            state = state_bytes(stage, tensor, data, distributed_optimizer, pipe)
            parameters = parameter_elements_per_device(stage, tensor)[0]
            outside_layers = parameter_elements_per_device(replace(stage, layers=0), tensor)[0]
            self._states[key] = S.StateCost(state.total, parameters, state.params, parameters - outside_layers,
                                            state.weight_copy, parts["layers"].weight_copy)
        return self._states[key]
