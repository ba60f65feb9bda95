"""What `--search` (`planning.search`) reads from compiled programs and from shapes: its `costs.Costs`."""

from __future__ import annotations

from dataclasses import asdict

from jaxseq.config import ModelConfig, ParallelConfig, replace, validate
from jaxseq.models.formulas import moe_nonlinear_bytes
from jaxseq.planning.costs import LayerCost, StateCost, layer_attention
from jaxseq.planning.measure import Compiler, RowSpec
from jaxseq.planning.memory import (fsdp_gathered_bytes, non_layer_activation_bytes, parameter_elements_per_device,
                                    state_bytes, state_bytes_by_part)


class SearchCosts:
    """jaxseq.planning.search's costs, measured once per (t, SP, remat, c, context strategy) for one layer shape
    (any depth): the training computation at micro-batch 1 (stored bytes, activation collectives: proportional
    to b; at c = 1 also FLOPs and the embedding/logits FLOPs) and the float32 train step at micro-batch 1 and 2
    (the working memory, and for a GPU's layer, in its dtype, the bytes its loops move: affine in b, the
    weights' share not growing with b). A c > 1 layer is compiled on a c × t mesh where `devices` hold c·t;
    where they do not, its c = 1 layer is measured and `costs.at_context` scales it (`LayerCost.context` says
    which). A ring layer is explicit attention's whatever the model's (`_program`). A mixture's stored bytes are not
    quite proportional to b (the capacity's ceiling, the loads): `formulas.moe_nonlinear_bytes` adds the difference.
    `measured` (JSON-ready) can be saved and passed back to skip compiling."""

    def __init__(self, cfg: ModelConfig, devices, workers: int = 2, measured: dict | None = None, progress=None):
        self.cfg, self.devices, self.workers = cfg, devices, workers
        self.progress = progress  # a `planning.progress.Progress`: a line as each program starts compiling
        self.measured = dict(measured or {})
        self._compilers: dict = {}
        self._states: dict = {}

    @staticmethod
    def key(tensor: int, sequence_parallel: bool, remat: str, context: int = 1, strategy: str = "all-gather",
            fp8: bool = False) -> str:
        return (f"t={tensor} sp={int(sequence_parallel)} {remat}" + (f" c={context} {strategy}" if context > 1 else "")
                + (" fp8" if fp8 else ""))

    def compiled_at(self, tensor: int, context: int) -> int:
        """The context size a layer of (t, c) is compiled at: c where the devices hold c·t, else 1 (scaled)."""
        return context if context * tensor <= len(self.devices) else 1

    def _program(self, tensor: int, sequence_parallel: bool, remat: str, context: int, strategy: str,
                 fp8: bool = False) -> tuple:
        """(t, SP, remat, c compiled at, strategy, attention, fp8) of a layer's program: the ring's layer is explicit
        attention's whatever the model's (`costs.layer_attention`), so a fused model's ring is measured on it, at c
        or, scaled, from the explicit c = 1 layer; an FP8 candidate's layer is the FP8 model's."""
        attention = layer_attention(self.cfg, context, strategy)
        c = self.compiled_at(tensor, context)
        return tensor, sequence_parallel, remat, c, strategy if c > 1 else "all-gather", attention, fp8

    def _name(self, t: int, sp: bool, remat: str, c: int, strategy: str, attention: str, fp8: bool = False) -> str:
        return self.key(t, sp, remat, c, strategy, fp8) + ("" if attention == self.cfg.attention else f" {attention}")

    def _compiler(self, micro_batch: int, context: int, strategy: str, attention: str, fp8: bool = False) -> Compiler:
        key = (micro_batch, context, strategy if context > 1 else "all-gather", attention, fp8)
        if key not in self._compilers:
            self._compilers[key] = Compiler(replace(self.cfg, attention=attention, fp8=fp8), micro_batch, self.devices,
                                            self.workers, context, key[2], self.progress)
        return self._compilers[key]

    def prepare(self, keys, micro_batches=(1, 2)) -> None:
        """Compile what `keys` need: (t, SP, remat), (t, SP, remat, c, strategy) or (t, SP, remat, c, strategy, fp8)
        each."""
        todo = {}
        for key in keys:
            program = self._program(*key, *(1, "all-gather", False)[len(key) - 3:])
            t, sp, remat, c, strategy, attention, fp8 = program
            validate(replace(self.cfg, attention=attention, fp8=fp8), ParallelConfig(
                data=1, context=c, tensor=t, sequence_parallel=sp, context_strategy=strategy), remat)
            todo[program] = RowSpec("search", remat, sp, t, None)
        affine = max(micro_batches) > 1
        meshes = []  # per mesh: (c, strategy, attention, its rows, the programs at b = 1 and at b = 2 to compile)
        for mesh in dict.fromkeys(k[3:] for k in todo):
            rows = {self._name(*k): row for k, row in todo.items() if k[3:] == mesh}
            one = self._compiler(1, *mesh)
            new = {name: row for name, row in rows.items() if name not in self.measured}
            b2 = {name: row for name, row in rows.items()
                  if affine and self.measured.get(name, {}).get("working_bytes_b2") is None}
            meshes.append((mesh, new, b2,
                           [k for row in new.values()
                            for k in (one.programs(row) if mesh[0] == 1 else one.layer_programs(row))],
                           [one.layer_programs(row)[1] for row in b2.values()]))  # the float32 step at b = 2
        if self.progress is not None:
            self.progress.expect(sum(len(self._compiler(1, *m).todo(k1)) + len(self._compiler(2, *m).todo(k2))
                                     for m, _, _, k1, k2 in meshes))
        for mesh, new, b2, keys_one, keys_two in meshes:  # one mesh at a time
            c = mesh[0]
            one, two = self._compiler(1, *mesh), self._compiler(2, *mesh)
            one.compile_all(keys_one)
            two.compile_all(keys_two)
            for name, row in new.items():
                self.measured[name] = ({**asdict(one.measure(row)), "head_flops": one.head_flops(row)} if c == 1
                                       else one.layer_costs(row)) | {"working_bytes_b2": None}
            for name, row in b2.items():
                self.measured[name] |= {"working_bytes_b2": two.working_bytes(row),
                                        "moved_bytes_per_layer_b2": two.moved_bytes(row)}
            one.clear()  # the numbers are read: free the executables' memory
            two.clear()

    def layer(self, tensor: int, sequence_parallel: bool, remat: str, micro_batch: int, context: int = 1,
              strategy: str = "all-gather", fp8: bool = False) -> LayerCost:
        """Per device at micro-batch b (the FP8 model's layer with `fp8`); `LayerCost.context` is the context size it
        was compiled at."""
        program = self._program(tensor, sequence_parallel, remat, context, strategy, fp8)
        name, b, c = self._name(*program), micro_batch, program[3]
        if name not in self.measured or (b > 1 and self.measured[name]["working_bytes_b2"] is None):
            self.prepare([(tensor, sequence_parallel, remat, context, strategy, fp8)], (b,))
        m = self.measured[name]
        affine = lambda key: m[key] + (b - 1) * (m[f"{key}_b2"] - m[key] if b > 1 else 0)  # b = 1 and 2 compiled
        moved = m.get("moved_bytes_per_layer")  # a GPU's layer only (and not in `measured` saved before it)
        stored = b * m["stored_bytes_per_layer"] + moe_nonlinear_bytes(self.cfg, remat, b, tensor, c)
        return LayerCost(
            stored, {k: b * v for k, v in m["collective_bytes_per_layer"].items()},
            affine("working_bytes"), non_layer_activation_bytes(self.cfg, b, tensor, sequence_parallel, c), c,
            None if moved is None or (b > 1 and m.get("moved_bytes_per_layer_b2") is None)
            else affine("moved_bytes_per_layer"))

    def state(self, stage: ModelConfig, tensor: int, data: int, distributed_optimizer: bool, pipe: int,
              fsdp: int = 1, expert: int = 1) -> StateCost:
        """The stage's state per device; expert = e > 1: a mixture's routed experts split over e (their weights,
        gradients and moments, `memory.state_bytes(expert=e)`), and so the parameters the device computes with."""
        key = (stage, tensor, data, distributed_optimizer, pipe, fsdp, expert)
        if key not in self._states:
            parts = state_bytes_by_part(stage, tensor, data, distributed_optimizer, pipe, fsdp, expert)
            state = state_bytes(stage, tensor, data, distributed_optimizer, pipe, fsdp, expert)
            parameters = parameter_elements_per_device(stage, tensor, expert)[0]
            outside_layers = parameter_elements_per_device(replace(stage, layers=0), tensor)[0]
            self._states[key] = StateCost(state.at_peak, parameters, state.params, parameters - outside_layers,
                                          state.weight_copy, parts["layers"].weight_copy, state.gradients,
                                          fsdp_gathered_bytes(stage, tensor, fsdp), state.after_loop)
        return self._states[key]
