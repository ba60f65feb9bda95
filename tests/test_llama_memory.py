"""Stored bytes per layer per device of every remat policy, read from the compiled program, against
`formulas.activation_bytes` (docs/DESIGN.md, "Stored bytes per layer, by family"): exactly, for Llama with its
K/V heads split over tensor and repeated, and for GPT with and without dropout."""

import jax
import pytest

from jaxseq.config import replace
from jaxseq.presets import preset
from jaxseq.models import formulas as F
from jaxseq.planning import hlo_loops
from jaxseq.planning import plan as P
from jaxseq.planning.measure import RowSpec
from jaxseq.planning.memory import parameter_elements_per_device
from jaxseq.planning.report import format_table
from jaxseq.remat import POLICIES

from compiled import B, MEMORY_CFG, hlo

TINY_LLAMA = replace(preset("tiny-llama"), dtype="bfloat16")  # s=64 h=64 a=8 kv=2 f=176
# (cfg, t): t > kv_heads repeats each K/V head to one per rank; t < kv_heads splits them.
CASES = {
    "llama-kv-repeated": (TINY_LLAMA, 4),  # 2 K/V heads, 4 ranks: each rank one copy
    "llama-kv-split": (replace(TINY_LLAMA, kv_heads=4), 2),  # 4 K/V heads, 2 per rank
    "gpt-dropout": (MEMORY_CFG, 4),
    "gpt-no-dropout": (replace(MEMORY_CFG, dropout=0.0), 4),
}


def measured(case: str, remat: str, sp: bool) -> int:
    cfg, t = CASES[case]
    return hlo_loops.stored_bytes_per_layer(hlo(remat, sp, t, cfg), cfg.layers)


def formula(case: str, remat: str, sp: bool) -> float:
    cfg, t = CASES[case]
    return F.activation_bytes(cfg, remat, B, t, sp)


def test_every_policy_has_a_formula():
    assert set(F.POLICY_TERMS) == set(POLICIES)


def test_formula_is_the_papers_table_2_plus_layernorm_statistics():
    cfg = replace(preset("gpt3-175b"), dtype="bfloat16", dropout=0.1)
    s, b, h, a, t = cfg.seq_len, 1, cfg.hidden, cfg.heads, 8
    for name, c in F.PAPER_CONFIGURATIONS.items():
        tt = t if c.tensor_parallel else 1
        stats = 0 if c.remat == "full" else 16 * s * b / (tt if c.sequence_parallel else 1)
        assert F.activation_bytes(cfg, c.remat, b, tt, c.sequence_parallel) == pytest.approx(
            F.paper_activation_bytes(name, s, b, h, a, tt) + stats, rel=1e-12), name


def test_llama_selective_with_sp_is_the_yardstick():
    """sb·[h·(12 + 4·max(g, t)/a) + 6F]/t bytes (bf16) plus the RMSNorm statistics, 8·sb/t."""
    cfg = preset("llama3-8b")
    s, h, a, g, f = cfg.seq_len, cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.mlp_hidden
    for t in (1, 4, 8, 16):
        yardstick = s * (h * (12 + 4 * max(g, t) / a) + 6 * f) / t + 8 * s / t
        assert F.activation_bytes(cfg, "selective", 1, t, True) == pytest.approx(yardstick, rel=1e-12)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_selective_matches_the_compiled_layer(sp):
    assert measured("llama-kv-repeated", "selective", sp) == formula("llama-kv-repeated", "selective", sp)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("remat", sorted(POLICIES))
@pytest.mark.parametrize("case", CASES)
def test_every_policy_matches_the_compiled_layer(case, remat, sp):
    assert measured(case, remat, sp) == formula(case, remat, sp)


def test_probabilities_are_stored_once_without_dropout():
    """Dropout 0 stores the softmax output once (the dropout-output tag would have stored it again)."""
    cfg, t = CASES["gpt-no-dropout"]
    probs = 2 * cfg.heads * cfg.seq_len ** 2 * B / t
    assert measured("gpt-no-dropout", "none", True) - measured("gpt-no-dropout", "selective", True) == probs


@pytest.mark.slow
@pytest.mark.parametrize("remat, sp", [("selective", True), ("none", False)], ids=["tp+sp+selective", "tp"])
def test_llama3_8b_layer_is_the_plans_formula(remat, sp):
    """At Llama 3 8B's layer (s = 8192, 8 K/V heads, one per rank at t = 8), compiled abstractly: the stored
    bytes are the formula the plan prints for the row (bf16: 136 MiB + 8 KiB of RMSNorm statistics per
    sequence with SP and selective)."""
    cfg = replace(preset("llama3-8b"), layers=2)
    row = RowSpec("row", remat, sp, 8, None)
    assert hlo_loops.stored_bytes_per_layer(hlo(remat, sp, 8, cfg), 2) == P.formula_bytes_per_layer(cfg, row, B)


@pytest.mark.parametrize("kv_heads, t", [(8, 8), (4, 8), (8, 4)], ids=["kv-one-per-rank", "kv-repeated", "kv-split"])
def test_parameters_per_device_follow_the_llama_table(kv_heads, t):
    """The plan's and the search's state (`memory.parameter_elements_per_device`, from the family's table): the
    K/V kernel is split over tensor where t divides kv_heads and whole on every rank where it repeats them;
    the norm scales are whole; the untied embedding and lm_head split over the vocabulary padded for t."""
    cfg = replace(preset("llama3-8b"), kv_heads=kv_heads)
    L, h, d, a, f, V = cfg.layers, cfg.hidden, cfg.head_dim, cfg.heads, cfg.mlp_hidden, cfg.padded_vocab(t)
    kv = L * h * 2 * kv_heads * d
    split = L * (h * a * d + a * d * h + 3 * h * f) + 2 * V * h + (kv if kv_heads % t == 0 else 0)
    whole = (2 * L + 1) * h + (0 if kv_heads % t == 0 else kv)
    assert parameter_elements_per_device(cfg, t)[0] == split // t + whole


@pytest.mark.slow
def test_plan_prints_the_llama_formula_beside_every_compiled_row():
    """The plan of tiny-llama at t = 4 (K/V repeated): every row's formula is the Llama formula, labelled so,
    and equals the compiled layer (ratio 1). The paper's rows and one more policy (`dots`: a row outside the
    paper's, which GPT's plan leaves without a formula) keep it to 9 rows' train steps, not 13; the other policies'
    layers, the same programs the plan compiles for their rows (t = 4, b = 2), are held to the same formula by
    test_every_policy_matches_the_compiled_layer[llama-kv-repeated-*]."""
    p = P.plan(TINY_LLAMA, 4, 2, jax.devices(), "tiny-llama", policies=["dots"])
    out = p.to_json()
    assert out["family"] == "llama" and out["kv_heads"] == 2 and len(out["rows"]) == 9
    assert [r["config"] for r in out["rows"]][7:] == ["tp+dots", "tp+sp+dots"]
    for r in out["rows"]:
        assert r["measured_bytes_per_layer"] == r["formula_bytes_per_layer"] == F.activation_bytes(
            TINY_LLAMA, r["remat"], 2, r["tensor"], r["sequence_parallel"]), r["config"]
    assert "formula = formulas.activation_bytes for the llama family" in format_table(p)
