"""experiments/gpu.py, the GPU validation command: its CPU dry run in-process (structure and internal consistency of
what it reports, never its timings), and its readers of compiled HLO."""

import importlib.util
import json
import math
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "experiments" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def test_custom_calls_and_the_cudnn_verdict():
    text = ('  %a = bf16[2,4]{1,0} custom-call(%x, %y), custom_call_target="__cublas$lt$matmul", backend_config={}\n'
            '  %b = (bf16[2,4], u8[0]) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"\n'
            '  %c = (bf16[2,4], u8[0]) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward"\n'
            '  %d = bf16[2,4]{1,0} custom-call(%x, %y), custom_call_target="__cublas$lt$matmul"\n')
    calls = gpu.custom_calls(text)
    assert calls == {"__cublas$lt$matmul": 2, "__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1}
    used = gpu.cudnn_verdict(True, {"none": {"custom_calls": calls}, "full": {"custom_calls": calls}})
    assert used["used"] is True and used["fmha_targets"]["none"] == ["__cudnn$fmhaSoftmax",
                                                                     "__cudnn$fmhaSoftmaxBackward"]
    # One policy without the fused attention is a failed check, not a pass.
    gemms = {"__cublas$lt$matmul": 2}
    assert gpu.cudnn_verdict(True, {"none": {"custom_calls": calls}, "full": {"custom_calls": gemms}})["used"] is False
    assert gpu.cudnn_verdict(False, {})["used"] is None


class _Plane:  # the parts of jax.profiler.ProfileData that gpu.trace_summary reads
    def __init__(self, name, lines):
        self.name, self.lines = name, [SimpleNamespace(name=n, events=events) for n, events in lines.items()]


def _event(name, start_ns, duration_ns, **stats):
    return SimpleNamespace(name=name, start_ns=start_ns, duration_ns=duration_ns, stats=list(stats.items()))


def test_a_gpu_trace_is_summed_by_what_each_kernel_does():
    """gpu.trace_summary on a GPU's plane (a stand-in: no GPU here): kernels that name their HLO op take its kind
    (`hlo_kernels.op_kinds`), others their own name's (cuBLAS, NCCL); another program's kernels are left out, and so is
    a line derived from the streams' (not counted twice); busy time merges the streams' overlapping intervals; ms per
    step over the traced steps."""
    text = ("HloModule jit_step, is_scheduled=true\n\n"
            "%fused_dot (p0: bf16[4,4], p1: bf16[4,4]) -> bf16[4,4] {\n"
            "  %p0 = bf16[4,4]{1,0} parameter(0)\n  %p1 = bf16[4,4]{1,0} parameter(1)\n"
            "  ROOT %d = bf16[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}\n\n"
            "ENTRY %main (x: bf16[4,4]) -> bf16[4,4] {\n  %x = bf16[4,4]{1,0} parameter(0)\n"
            "  %gemm_fusion.1 = bf16[4,4]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused_dot\n"
            '  %fmha.2 = (bf16[4,4], u8[0]) custom-call(%x, %x, %x), custom_call_target="__cudnn$fmhaSoftmax"\n'
            "  ROOT %add.3 = bf16[4,4]{1,0} add(%x, %x)\n}\n")
    streams = {"Stream #1(Compute)": [_event("gemm_fusion_1", 0, 4000, hlo_op="gemm_fusion.1", hlo_module="jit_step"),
                                      _event("cudnn_kernel", 5000, 3000, hlo_op="fmha.2", hlo_module="jit_step"),
                                      _event("loop_add", 9000, 1000, hlo_op="add.3", hlo_module="jit_step"),
                                      _event("sm90_xmma_gemm_bf16", 10000, 2000),
                                      _event("other_program", 20000, 9000, hlo_op="add.1", hlo_module="jit_init")],
               "Stream #2(Comm)": [_event("ncclDevKernel_AllReduce_Sum_bf16", 11000, 3000)],
               "XLA Ops": [_event("gemm_fusion.1", 0, 4000, hlo_op="gemm_fusion.1", hlo_module="jit_step")]}
    data = SimpleNamespace(find_plane_with_name=lambda name: _Plane(name, streams) if name == "/device:GPU:0" else None)
    t = gpu.trace_summary(data, text, steps=2, wall_s=0.000016)
    assert t["ms_per_step_by_kind"] == pytest.approx({"matmul": 0.003, "attention": 0.0015, "other": 0.0005,
                                                      "collective": 0.0015})
    assert t["busy_ms_per_step"] == pytest.approx(0.012 / 2)  # [0, 4) [5, 8) [9, 14) µs: the two streams overlap
    assert t["wall_ms_per_step"] == pytest.approx(0.008) and t["source"].endswith("/device:GPU:0")
    assert t["lines"] == {"Stream #1(Compute)": 5, "Stream #2(Comm)": 1, "XLA Ops": 1}
    assert "add.1" not in t["top_ops_ms_per_step"]


def test_each_configuration_on_a_gpu_records_its_autotuners_gemm_choices(tmp_path):
    """On a GPU every configuration's compile writes what its autotuner chose (cuBLAS or Triton per GEMM) to a file of
    its own under --out's autotune/ (`xla_gpu_dump_autotune_results_to`): an offline compile can load it. On CPU, or
    without --out, nothing is asked."""
    from dataclasses import asdict

    from jaxseq.config import replace
    from jaxseq.presets import preset

    assert gpu.autotune_dir(False, tmp_path) is None and gpu.autotune_dir(True, None) is None
    where = gpu.autotune_dir(True, tmp_path)
    assert where == tmp_path / "autotune" and where.is_dir()
    spec = {"micro_batch": 4, "microbatches": 1, "steps": 6, "warmup": 2, "autotune_dir": str(where),
            "model": asdict(preset("gpt3-1.3b")), "parallel": {"tensor": 1}, "remat": "full"}
    path = gpu.autotune_path(spec)
    assert path.startswith(str(where) + "/gpt_h2048_L24_s2048_full_b4x1_scan_") and path.endswith(".textproto")
    assert gpu.autotune_path({**spec, "steps": 10, "profile_steps": 2}) == path  # the same program
    others = [{**spec, "remat": "none"}, {**spec, "micro_batch": 8}, {**spec, "xla_flags": "--x"},
              {**spec, "model": asdict(replace(preset("gpt3-1.3b"), layer_loop="unrolled"))}]
    assert len({path, *map(gpu.autotune_path, others)}) == 5
    assert gpu.autotune_path({**spec, "autotune_dir": None}) is None


def test_each_configuration_is_on_disk_as_soon_as_it_has_run(tmp_path, monkeypatch):
    """A run cut off anywhere (2026-11-27: an H200 run in its largest micro-batch, which had written nothing) still
    leaves every configuration it measured: each result is appended to --out's gpu_<device>_<date>_runs.jsonl as it
    comes, with its spec less the paths; a new run empties the file, and none is written without --out."""
    monkeypatch.setattr(gpu, "measure", lambda spec, devices: {"median_step_s": 0.1 * spec["micro_batch"]})
    log = gpu.runs_log(tmp_path, "NVIDIA H200")
    assert log.parent == tmp_path and re.fullmatch(r"gpu_nvidia-h200_\d{4}-\d\d-\d\d_runs\.jsonl", log.name)
    assert gpu.runs_log(None, "NVIDIA H200") is None
    spec = {"micro_batch": 4, "remat": "none", "autotune_dir": str(tmp_path), "runs_log": str(log)}
    for b in (4, 16):
        gpu.run_spec({**spec, "micro_batch": b}, [None], isolate=False)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [{"spec": {"micro_batch": b, "remat": "none"}, "result": {"median_step_s": 0.1 * b}}
                     for b in (4, 16)]
    assert gpu.runs_log(tmp_path, "NVIDIA H200").read_text() == ""


def test_past_the_budget_the_largest_micro_batches_do_not_start(monkeypatch):
    """--budget-minutes holds the configurations beyond the models' rows: the largest micro-batches too (an H200's
    `full` at 64 ran past a call's limit)."""
    monkeypatch.setattr(gpu, "run_spec", lambda *a, **k: pytest.fail("a configuration started past the budget"))
    past = gpu.time.monotonic() - 1
    out = gpu.batch_bought(None, 1, False, 80 * 2**30, [None], {"micro_batch": 4}, {"tensor": 1}, False, 989.0, past)
    assert out == {p: {"skipped": gpu.BUDGET_SKIP} for p in gpu.LARGEST_MICRO_BATCH_POLICIES}
    assert not gpu.in_budget(past) and gpu.in_budget(None)


@pytest.fixture(scope="module")
def dry():
    before = sorted(p.name for p in (ROOT / "experiments" / "results").iterdir())
    # a stated peak: MFU is computed on CPU too; the two ends of the remat trade (every policy runs the same code)
    result = gpu.run(["--models", "tiny", "--peak-tflops", "0.5", "--policies", "full"])
    after = sorted(p.name for p in (ROOT / "experiments" / "results").iterdir())
    return result, before, after


# the plan's compiles for 2 policies, 10 train steps (2 policies, traced, parity, the sweep, 2 context, 3 offload)
# and 3 pipelined
@pytest.mark.slow
def test_dry_run_reports_consistent_measurements(dry, tmp_path):
    result, before, after = dry
    assert before == after, "the dry run wrote under experiments/results without --out"
    assert result["dry_run"] and result["platform"] == "cpu" and result["devices"] == 2
    assert result["attention"] == "explicit" and "cuDNN is absent" in result["attention_note"]
    assert result["peak_tflops_per_device"] == 0.5 and result["peak_source"] == "--peak-tflops"
    (name, model), = result["models"].items()
    assert name == "tiny" and model["plan_error"] is None
    rows = model["policies"]
    assert list(rows) == ["none", "full"]  # `none`, every row's reference, runs whether asked or not
    seq, b, steps = model["config"]["seq_len"], model["micro_batch"], result["steps"]
    for policy, r in rows.items():
        assert len(r["step_s"]) == steps and r["median_step_s"] == statistics.median(r["step_s"])
        assert len(r["losses"]) == result["warmup_steps"] + steps and all(math.isfinite(x) for x in r["losses"])
        assert r["tokens_per_sec"] == pytest.approx(b * seq / r["median_step_s"])
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)
        assert r["peak_bytes_in_use"] is None and r["measured_over_predicted_peak"] is None  # no count on CPU
        assert r["autotune_results"] is None  # no autotuner on CPU
        assert r["step_time_vs_none"] == pytest.approx(r["median_step_s"] / rows["none"]["median_step_s"])
        # Where its time goes: device 0's ops in a trace of 2 more steps, by kind (tensor = 2 + SP: collectives).
        t = r["device_time"]
        kinds = t["ms_per_step_by_kind"]
        assert 0 < t["busy_ms_per_step"] <= t["wall_ms_per_step"], t
        assert t["busy_ms_per_step"] <= sum(kinds.values()) + 1e-9 and kinds["matmul"] > 0 and kinds["collective"] > 0
        # The plan's prediction beside it: its parts add up to the total it predicts.
        plan = r["plan"]
        assert r["predicted_peak_bytes"] == plan["total_bytes"] > 0
        assert plan["total_bytes"] == plan["state_bytes"] + plan["activation_bytes"] + plan["working_bytes"]
    # Remat changes what is stored, not the state: the plan predicts less activation memory for `full`.
    assert rows["full"]["plan"]["activation_bytes"] < rows["none"]["plan"]["activation_bytes"]
    assert rows["full"]["plan"]["state_bytes"] == rows["none"]["plan"]["state_bytes"]
    assert model["cudnn_attention"]["used"] is None and "not applicable on CPU" in model["cudnn_attention"]["note"]
    assert model["unrolled"] == {"skipped": "a GPU only: XLA:CPU does not keep a remat policy for unrolled layers"}
    assert {p: r.get("skipped", "").startswith("no GPU target") for p, r in model["largest_micro_batch"].items()} == {
        "none": True, "full": True}  # a CPU has no target description
    parity = model["parity"]
    # on the default corpus (real text), not the timing runs' uniform random tokens
    assert parity["data"] == "default corpus" and parity["losses_bf16"] != rows["full"]["losses"]
    assert len(parity["losses_f32"]) == len(parity["losses_bf16"]) == len(rows["full"]["losses"])
    worst = max(abs(a - f) / abs(f) for a, f in zip(parity["losses_bf16"], parity["losses_f32"]))
    assert parity["max_relative_difference"] == pytest.approx(worst)
    assert parity["ok"] == (worst <= parity["tolerance"])

    sweep = result["sequence_sweep"]  # lean at other lengths, the micro-batch's tokens held
    assert sweep["remat"] == "lean" and sweep["tokens_per_micro_batch"] == b * seq
    assert [(r["seq_len"], r["micro_batch"]) for r in sweep["runs"]] == [(128, b * seq // 128)]
    context = result["context"]
    assert context["mesh"] == "context=2 × tensor=1" and list(context["runs"]) == ["ring", "all-gather"]
    for r in (*sweep["runs"], *context["runs"].values()):
        assert r["tokens_per_sec"] == pytest.approx(r["micro_batch"] * r["seq_len"] / r["median_step_s"])
        assert len(r["step_s"]) == steps and r["target_peak_bytes"] is None  # no target description on a CPU
    # the same model, the same tokens, the same init: the strategies' first losses agree
    assert context["runs"]["ring"]["losses"][0] == pytest.approx(context["runs"]["all-gather"]["losses"][0], rel=1e-2)

    pl = result["pipeline"]
    assert pl["mesh"].startswith("pipe=2") and pl["micro_batch"] == b
    assert [(r["schedule"], r["microbatches"]) for r in pl["runs"]] == [("1f1b", 2), ("1f1b", 4), ("zb-h1", 4)]
    a, c, zb = pl["runs"]
    for r in (a, c):
        assert r["ticks"] == 2 * r["microbatches"] + 2 and r["busy_ticks"] == 2 * r["microbatches"]
        assert r["schedule_bubble"] == pytest.approx(1 / r["microbatches"])  # (p − 1)/m for 1F1B, p = 2
    assert zb["ticks"] == 3 * 4 + 1 and zb["busy_ticks"] == 12 and zb["schedule_bubble"] == pytest.approx(1 / 12)
    assert pl["tick_s"] == pytest.approx((c["median_step_s"] - a["median_step_s"]) / (c["ticks"] - a["ticks"]))
    assert pl["fixed_s"] == pytest.approx(a["median_step_s"] - a["ticks"] * pl["tick_s"])
    for r in (a, c):
        busy = r["busy_ticks"] * pl["tick_s"]
        assert r["measured_bubble"] == (pytest.approx((r["median_step_s"] - busy) / busy) if busy > 0 else None)
    assert pl["zb_h1_over_1f1b"] == pytest.approx(zb["median_step_s"] / c["median_step_s"])

    off = result["offload"]  # lean with everything it stores offloaded, and with the optimizer state: same numbers
    assert list(off["runs"]) == ["without", "--offload all", "--offload-optimizer"] and off["offloaded"]
    first = off["runs"]["without"]["losses"][0]
    assert all(r["losses"][0] == pytest.approx(first, rel=1e-3) and r["target_host_bytes"] is None
               for r in off["runs"].values())

    text = gpu.table(result)
    assert "## Host offload: tiny, lean" in text
    assert text.startswith("# jaxseq on 2 × cpu") and "DRY RUN" in text and "not applicable on CPU" in text
    assert "Where a step's time goes, ms per step (jax.profiler trace of 2 steps, /host:CPU" in text
    json_path, md_path = gpu.write(result, tmp_path)
    assert json_path.name.startswith("gpu_cpu_") and json_path.suffix == ".json" and md_path.read_text() == text


@pytest.mark.slow  # the dry run's result, for the table
def test_unrolled_rows_are_set_against_their_scanned_rows(dry, monkeypatch):
    """On a GPU, `lean`, `none` and `full` run again with the layers unrolled (here a stand-in run): each row's step
    time and peak over its scanned row's, in the table; a policy the models' rows did not run is not repeated."""
    import copy

    from jaxseq.presets import preset

    monkeypatch.setattr(gpu, "run_spec", lambda spec, devices, isolate: {
        "median_step_s": 0.17, "peak_bytes_in_use": 30 * 2**30, "layer_loop": spec["model"]["layer_loop"]})
    scanned = {"none": {"median_step_s": 0.2, "peak_bytes_in_use": 32 * 2**30}, "lean": {"median_step_s": 0.19}}
    base = {"micro_batch": 2, "microbatches": 1, "steps": 1, "warmup": 0}
    rows = gpu.unrolled_rows(True, preset("tiny"), ("none", "lean", "full"), scanned, base, {"tensor": 1}, [None],
                             False, 989.0, None)
    assert list(rows) == ["none", "lean"] and rows["none"]["layer_loop"] == "unrolled"
    assert (rows["none"]["step_vs_scan"] == pytest.approx(0.85)
            and rows["none"]["peak_vs_scan"] == pytest.approx(30 / 32))
    result = copy.deepcopy(dry[0])
    (model,) = result["models"].values()
    model["unrolled"] = rows
    assert "| none | 0.1700 | 0.850 |" in gpu.table(result)


def test_a_mesh_no_model_fits_is_reported_not_raised(devices):
    # tensor = 3 divides neither tiny model's 8 heads: both are skipped with the reason, nothing is compiled.
    result = gpu.check(False, devices[:3], steps=1, warmup=0, micro_batches=(2,), isolate=False)
    assert set(result["models"]) == {"tiny", "tiny-llama"}
    assert result["peak_tflops_per_device"] is None  # hardware.py has no peak for a CPU: MFU would be None
    assert all("tensor=3 does not divide heads=8" in m["skipped"] for m in result["models"].values())
    assert result["pipeline"] == result["context"] == {"skipped": "no model runs on this mesh"}
    assert "## tiny: skipped (tensor=3 does not divide heads=8)" in gpu.table(result)


def test_past_its_budget_a_run_starts_no_further_configuration(devices):
    """The sweep and the context check (and the pipeline, by the same test) skip what would start past the deadline,
    and say why, without compiling anything."""
    import time

    from jaxseq.presets import preset

    assert gpu.in_budget(None) and not gpu.in_budget(time.monotonic() + gpu.RUN_ESTIMATE_S - 1)
    spec = {"micro_batch": 2, "microbatches": 1, "steps": 1, "warmup": 0}
    sweep = gpu.sequence_sweep(False, "tiny", preset("tiny"), devices[:2], spec, {"tensor": 2}, False, None,
                               deadline=time.monotonic())
    context = gpu.context_check(False, "tiny", preset("tiny"), devices[:2], spec, False, None,
                                deadline=time.monotonic())
    skipped = [*sweep["runs"], *context["runs"].values()]
    assert len(skipped) == 3 and all(r["skipped"].startswith("the run's time budget") for r in skipped)


def test_a_run_cut_off_after_a_model_leaves_what_it_measured(tmp_path, monkeypatch):
    """`check` hands each model's results to `save` as they come (then the parity run's); `run` writes them to --out
    marked partial, so a GPU session that runs out of time still leaves its measurements."""
    import json

    measured = {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu", "date_utc": "2026-11-26T00:00:00+00:00",
                "dry_run": False, "devices": 1, "attention_note": "fused", "mesh": "tensor=1", "steps": 6,
                "warmup_steps": 2, "peak_tflops_per_device": 989.0, "peak_source": "jaxseq/hardware.py", "models": {}}

    def check(*args, save=None, **kwargs):
        save(measured)
        raise KeyboardInterrupt  # the session's time is up

    monkeypatch.setattr(gpu, "check", check)
    with pytest.raises(KeyboardInterrupt):
        gpu.run(["--out", str(tmp_path)])
    (written,) = tmp_path.glob("gpu_nvidia-h100-80gb-hbm3_2026-11-26.json")
    assert json.loads(written.read_text())["partial"] is True
    assert "## Pipeline: skipped (not run yet)" in written.with_suffix(".md").read_text()
