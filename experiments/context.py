"""Context parallelism at a 7–8B shape (llama3-8b, bfloat16, explicit attention, t = 8 + SP, selective, b = 1):
stored bytes per layer per device compiled at context c beside `formulas.activation_bytes(context=c)`, then
memory per device against s for c ∈ {1, 2, 4, 8}, the longest sequence that fits a budget with and without
context parallelism, and the K/V traffic per layer per strategy.

    python experiments/context.py [COMPILE_SEQ] [BUDGET_GIB]   # default 8192 80; writes experiments/results/
                                                                # context.json and context.png, prints the table

Compiled: the loss-and-gradient program at L = 2 on c·t simulated devices at s = COMPILE_SEQ (both strategies),
its stored bytes per layer read from the HLO (`planning.hlo`). The curve against s is the formula, which
equals the compiled layer to the byte at every (c, strategy) compiled here (and at tiny shapes for every
policy, tests/test_plan.py). Memory per device = the state at the backward's peak (`memory.State.at_peak`: fp32
master weights, Adam moments, the bf16 copy and its gradients, not yet the float32 ones; data = 1, shapes only) +
stored bytes × L + the embedding/logits activations + the K/V transient at
backward's peak (`formulas.context_kv_bytes`); the step's other working memory (one layer's recompute, the
logits' gradient) is NOT included: a floor, not the peak.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.getcwd())
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxseq.config import ParallelConfig, replace  # noqa: E402
from jaxseq.presets import preset  # noqa: E402
from jaxseq.mesh import make_mesh  # noqa: E402
from jaxseq.models import formulas as F  # noqa: E402
from jaxseq.planning import hlo_loops  # noqa: E402
from jaxseq.planning.memory import GIB, non_layer_activation_bytes, state_bytes  # noqa: E402
from jaxseq.training import aot  # noqa: E402

MODEL, T, B, REMAT = "llama3-8b", 8, 1, "selective"
CONTEXTS = (1, 2, 4, 8)
STRATEGIES = ("all-gather", "ring")
SEQS = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def compiled_stored(cfg, c: int, strategy: str) -> int:
    parallel = ParallelConfig(data=1, context=c, tensor=T, sequence_parallel=True, context_strategy=strategy)
    mesh = make_mesh(parallel, jax.devices()[:c * T])
    text = aot.compile_loss_and_grad(replace(cfg, layers=2), parallel, REMAT, mesh, B).as_text()
    return hlo_loops.stored_bytes_per_layer(text, 2)


def memory_floor(cfg, c: int, strategy: str) -> dict:
    """Per device, bytes (see the module docstring: no working memory beyond the K/V transient)."""
    stored = F.activation_bytes(cfg, REMAT, B, T, True, c, strategy)
    kv = F.context_kv_bytes(cfg, B, T, c, strategy)
    state = state_bytes(cfg, T).at_peak
    activations = stored * cfg.layers + non_layer_activation_bytes(cfg, B, T, True, c)
    return {"stored_per_layer": stored, "state": state, "activations": activations,
            "kv_transient_backward": kv["transient_backward"], "kv_traffic_per_layer": kv["traffic"],
            "total": state + activations + kv["transient_backward"]}


def main(compile_seq: int = 8192, budget_gib: float = 80.0) -> dict:
    base = replace(preset(MODEL), dtype="bfloat16", attention="explicit")
    checked = []
    cfg = replace(base, seq_len=compile_seq)
    for c in CONTEXTS:
        for strategy in (STRATEGIES if c > 1 else STRATEGIES[:1]):
            compiled = compiled_stored(cfg, c, strategy)
            formula = F.activation_bytes(cfg, REMAT, B, T, True, c, strategy)
            checked.append({"seq_len": compile_seq, "context": c, "strategy": strategy, "compiled": compiled,
                            "formula": formula})
            print(f"compiled s={compile_seq} c={c} {strategy}: stored per layer per device {compiled / 2**20:.2f} MiB "
                  f"(compiled) vs {formula / 2**20:.2f} MiB (formula)", flush=True)
    curves = {f"c={c} {s}": [{"seq_len": n, **memory_floor(replace(base, seq_len=n), c, s)} for n in SEQS]
              for c in CONTEXTS for s in (STRATEGIES if c > 1 else STRATEGIES[:1])}
    longest = {k: max((p["seq_len"] for p in v if p["total"] <= budget_gib * GIB), default=None)
               for k, v in curves.items()}
    result = {"model": MODEL, "tensor": T, "sequence_parallel": True, "micro_batch": B, "remat": REMAT,
              "dtype": "bfloat16", "attention": "explicit", "budget_gib": budget_gib,
              "units": "bytes per device; kv_traffic_per_layer: bytes each device sends per layer, forward + backward",
              "memory": "state + stored × L + embedding/logits activations + K/V transient at backward's peak; "
                        "excludes the rest of the step's working memory (a floor)",
              "compiled_vs_formula": checked, "curves": curves, "longest_seq_that_fits": longest}
    return result


def write(result: dict) -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "context.json"), "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in result["curves"].items():
        ax.plot([p["seq_len"] for p in points], [p["total"] / GIB for p in points], marker="o",
                linestyle="--" if "ring" in name else "-", label=name)
    ax.axhline(result["budget_gib"], color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("GiB per device (state + activations + K/V transient)")
    ax.set_title(f"{result['model']}, t={result['tensor']} + SP, {result['remat']}, b={result['micro_batch']}, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "context.png"), dpi=120)


if __name__ == "__main__":
    args = sys.argv[1:]
    res = main(int(args[0]) if args else 8192, float(args[1]) if len(args) > 1 else 80.0)
    write(res)
    print(f"{'s':>8}" + "".join(f"{k:>16}" for k in res["curves"]) + "   (GiB per device, floor: see docstring)")
    for i, n in enumerate(SEQS):
        print(f"{n:>8}" + "".join(f"{v[i]['total'] / GIB:>16.1f}" for v in res["curves"].values()))
    print("longest s within", res["budget_gib"], "GiB:", res["longest_seq_that_fits"])
    print("K/V traffic per layer per device at s=131072 (MiB sent, fwd+bwd):",
          {k: round(v[SEQS.index(131072)]["kv_traffic_per_layer"] / 2**20, 1) for k, v in res["curves"].items()})
