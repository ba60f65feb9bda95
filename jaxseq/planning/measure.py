"""One layer's bytes, FLOPs and collectives, and the step's working memory, read from compiled programs.

Every per-layer number is XLA's own accounting of the compiled training computation (forward +
backward of one micro-batch), compiled ahead of time on abstract inputs for simulated host devices:
nothing is allocated, so a 1T-parameter layer compiles on a laptop. Why compile rather than count:
what a remat policy really keeps is decided by autodiff and XLA, and a policy that silently saves the
wrong tensor is the most common surprise in practice.

How the per-layer numbers are read (layers under `lax.scan`, so depth does not matter):
- stored bytes: the stacked buffers the forward layer loop writes, / L (`hlo_loops.stored_bytes_per_layer`);
- FLOPs: `cost_analysis()` counts a loop body once, so flops(L=2) − flops(L=0) is one layer's forward
  and backward (plus the casts of that layer's weights outside the loop, < 0.1%), + the dots of the iterations
  it leaves out of a loop inside the layer (the ring's query tiles: `hlo_flops.inner_loop_dot_flops`);
- collectives: those of one forward and one backward iteration of the layer loop;
- working memory (transients: one layer's recomputation and gradients in flight, the logits' gradient,
  RNG bits): the compiled train step's temporaries at L=2 (float32 on XLA:CPU, the model's dtype for a GPU:
  `Compiler.step_dtype`) minus the state's share of them at the peak and the stored activations
  (`planning.memory`); that remainder does not depend on depth;
- moved bytes (a layer compiled for a GPU only): what the memory-bound kernels of that train step's layer
  loops read and write, / L (`hlo_kernels.layer_loop_bytes`): XLA:GPU's fusions, which the search's time model prices
  in place of Megatron's kernel count (`search_time.compute_seconds`). XLA:CPU's fusions are not a GPU's: None.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jaxseq.config import ModelConfig, ParallelConfig, cudnn_compiles, replace
from jaxseq.mesh import make_mesh
from jaxseq.models import model
from jaxseq.planning import hlo_collectives, hlo_flops, hlo_kernels, hlo_loops
from jaxseq.planning.memory import activation_bytes, non_layer_activation_bytes, state_bytes
from jaxseq.training import aot

MEASURE_LAYERS = 2  # a scan of 2 keeps the layer loop (1 would be inlined); depth does not matter


@dataclass(frozen=True)
class RowSpec:
    """One row to compile: a paper configuration or another registered policy, with or without SP."""

    name: str
    remat: str
    sequence_parallel: bool
    tensor: int
    paper: str | None  # the Table-2 row it is compared with


@dataclass(frozen=True)
class Measured:
    stored_bytes_per_layer: int
    flops_per_layer: float  # per device, forward + backward of one layer
    collective_bytes_per_layer: dict  # kind → bytes of the buffers, forward + backward, activation dtype
    working_bytes: int  # the train step's transients beyond state and stored activations (float32 step)
    moved_bytes_per_layer: float | None = None  # its layer loops' memory-bound kernels (a GPU's program only)


def _flops(compiled) -> float:
    """XLA's FLOP count of a compiled program; NaN for one compiled for GPU target devices, which has none."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) if cost else float("nan")


def _mesh(tensor: int, sequence_parallel: bool, devices, context: int = 1, strategy: str = "all-gather"):
    parallel = ParallelConfig(data=1, context=context, tensor=tensor, sequence_parallel=sequence_parallel,
                              context_strategy=strategy)
    return parallel, make_mesh(parallel, devices[:context * tensor])


class Compiler:
    """Compiles each distinct program once, two at a time (XLA compiles with the GIL released, and a
    plan reuses the L=0 and forward programs across rows)."""

    def __init__(self, cfg: ModelConfig, micro_batch: int, devices, workers: int = 2, context: int = 1,
                 strategy: str = "all-gather", progress=None):
        # the readers find a layer in the scan's loop: an unrolled model's layers are measured as scanned ones
        self.cfg, self.b, self.devices, self.workers = replace(cfg, layer_loop="scan"), micro_batch, devices, workers
        if cfg.fused_kernel == "cudnn" and not cudnn_compiles(ParallelConfig(context=context,
                                                                             context_strategy=strategy)):
            self.cfg = replace(self.cfg, fused_kernel="xla")  # XLA's attention, as `train` runs this context strategy
        self.context, self.strategy = context, strategy  # every program on a context × tensor mesh
        self.progress = progress  # a `planning.progress.Progress`: a line as each program starts compiling
        self._cache: dict = {}

    def todo(self, keys) -> list[tuple]:
        """The distinct programs of `keys` not compiled yet."""
        return list(dict.fromkeys(k for k in keys if k not in self._cache))

    def describe(self, key: tuple) -> str:
        kind, layers, remat, tensor, sp = key
        what = {"grad": "loss and gradients", "step": f"{self.step_dtype} train step", "forward": "forward"}[kind]
        return (f"{what}, {layers} layers, {remat}, t={tensor}{' + SP' if sp else ''}, b={self.b}"
                + (f", c={self.context} {self.strategy}" if self.context > 1 else ""))

    @staticmethod
    def programs(c: RowSpec) -> list[tuple]:
        """(kind, layers, remat, tensor, sp) of the programs a row reads."""
        return [("grad", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel),
                ("grad", 0, "none", c.tensor, c.sequence_parallel),
                ("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel)]

    def compile_all(self, keys) -> None:
        todo = self.todo(keys)
        with ThreadPoolExecutor(self.workers) as pool:
            for key, compiled in zip(todo, pool.map(self._build, todo)):
                self._cache[key] = compiled

    def clear(self) -> None:
        """Free the compiled programs (their numbers are read)."""
        self._cache.clear()

    def _build(self, key: tuple):
        kind, layers, remat, tensor, sp = key
        if self.progress is not None:
            self.progress.compiling(self.describe(key))
        parallel, mesh = _mesh(tensor, sp, self.devices, self.context, self.strategy)
        if kind == "step":  # with the options its run compiles with (an FP8 run's on a GPU: `model.compile_options`)
            options = model.compile_options(self.cfg, self.devices[0].platform)
            return aot.compile_train_step(replace(self.cfg, layers=layers, dtype=self.step_dtype), parallel, remat,
                                          mesh, self.b, options=options)
        fn = aot.compile_loss_and_grad if kind == "grad" else aot.compile_forward
        return fn(replace(self.cfg, layers=layers), parallel, remat, mesh, self.b)

    @property
    def step_dtype(self) -> str:
        """The working memory's train step compiles in the model's dtype for a GPU, in float32 for XLA:CPU, whose
        bf16 temporaries (float32 copies around each bf16 op) are not what a GPU allocates."""
        return "float32" if self.devices[0].platform == "cpu" else self.cfg.dtype

    def _compile(self, *key):
        if key not in self._cache:
            self._cache[key] = self._build(key)
        return self._cache[key]

    def measure(self, c: RowSpec) -> Measured:
        L = MEASURE_LAYERS
        compiled = self._compile("grad", L, c.remat, c.tensor, c.sequence_parallel)
        text = compiled.as_text()
        stored = hlo_loops.stored_bytes_per_layer(text, L)
        flops = _flops(compiled) - self.head_flops(c) + hlo_flops.inner_loop_dot_flops(text, L)  # a ring's tile loops
        return Measured(stored, flops, self._collectives(text, c.tensor), self.working_bytes(c), self.moved_bytes(c))

    @staticmethod
    def layer_programs(c: RowSpec) -> list[tuple]:
        """The programs `layer_costs` reads (no L=0 program: the search's FLOPs come from shapes)."""
        return [("grad", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel),
                ("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel)]

    def layer_costs(self, c: RowSpec) -> dict:
        """What `--search` reads of a row: stored bytes and activation collectives per layer, working bytes."""
        text = self._compile(*self.layer_programs(c)[0]).as_text()
        return {"stored_bytes_per_layer": hlo_loops.stored_bytes_per_layer(text, MEASURE_LAYERS),
                "collective_bytes_per_layer": self._collectives(text, c.tensor), "working_bytes": self.working_bytes(c),
                "moved_bytes_per_layer": self.moved_bytes(c)}

    def head_flops(self, c: RowSpec) -> float:
        """The training computation's FLOPs without layers (L=0): embedding, final norm, logits, loss."""
        return _flops(self._compile("grad", 0, "none", c.tensor, c.sequence_parallel))

    def working_bytes(self, c: RowSpec) -> int:
        """The train step's temporaries at L=2 minus the state's share of them at the peak (the compute copy and
        its gradients: `State.at_peak`) and the stored activations."""
        step = self._compile("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel)
        cfg = replace(self.cfg, layers=MEASURE_LAYERS, dtype=self.step_dtype)
        stored = hlo_loops.stored_bytes_per_layer(step.as_text(), MEASURE_LAYERS)
        state = state_bytes(cfg, c.tensor)
        accounted = state.weight_copy + state.loop_gradients + activation_bytes(
            stored, MEASURE_LAYERS,
            non_layer_activation_bytes(cfg, self.b, c.tensor, c.sequence_parallel, self.context))
        return step.memory_analysis().temp_size_in_bytes - accounted

    def moved_bytes(self, c: RowSpec) -> float | None:
        """What the memory-bound kernels of the train step's layer loops move per layer
        (`hlo_kernels.layer_loop_bytes`), where the step is compiled for a GPU; None for XLA:CPU's step, whose kernels
        (float32, its own fusions) are not a GPU's."""
        if self.devices[0].platform == "cpu":
            return None
        step = self._compile("step", MEASURE_LAYERS, c.remat, c.tensor, c.sequence_parallel)
        return hlo_kernels.layer_loop_bytes(step.as_text(), MEASURE_LAYERS)

    @staticmethod
    def forward_programs(tensor: int) -> list[tuple]:
        return [("forward", L, "none", tensor, False) for L in (MEASURE_LAYERS, 0)]

    def forward_flops_per_layer(self, tensor: int) -> float:
        fwd, zero = (self._compile(*k) for k in self.forward_programs(tensor))
        ring_tiles = hlo_flops.inner_loop_dot_flops(fwd.as_text(), MEASURE_LAYERS)  # a ring's tile loops
        return _flops(fwd) - _flops(zero) + ring_tiles

    def _collectives(self, text: str, tensor: int) -> dict:
        """Bytes of the activation collectives of one layer (forward + backward), at the model's
        activation dtype: XLA:CPU computes bf16 collectives in f32, so HLO byte counts would be
        doubled; elements × itemsize is what a GPU moves. Parameter-gradient reductions (LayerNorm
        weights under SP, a few h elements) are left out: smaller than one activation shard."""
        itemsize = self.cfg.itemsize
        shard = self.b * self.cfg.seq_len * self.cfg.hidden // (tensor * self.context)
        out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
        if tensor == 1:
            return out
        for backward in (False, True):
            for c in hlo_collectives.loop_collectives(text, MEASURE_LAYERS, backward):
                if c.group_size > 1 and c.elements >= shard and self._over_tensor(c, tensor):
                    out[c.kind] = out.get(c.kind, 0) + c.elements * itemsize
        return out

    def _over_tensor(self, c: hlo_collectives.Collective, tensor: int) -> bool:
        """Whether a collective runs over the `tensor` axis: every one at context 1; at context c, those whose
        groups are runs of t consecutive devices (the mesh is context × tensor, tensor fastest), not the K/V
        gathers and ring sends over `context` (`formulas.context_kv_bytes` counts those)."""
        if self.context == 1:
            return True
        return c.groups is not None and all(tuple(sorted(g)) == tuple(range(min(g), min(g) + tensor)) for g in c.groups)
