"""The public validation set (issue 60, part 2): published step times of large runs, 8 to 11,616 GPUs.

tests/fixtures/published_runs.json holds each run with its source, hardware, model, layout and software stack
as the source states them, the published figure as a step time, and the planner overrides that describe it
(the fixture's "note" says how). benchmarks/plan_published.py prices every row and prints its error.

This test holds the table's shape: every row complete and sourced, every layout accepted and priced by the
planner, an error reported for each row and per GPU-count band, and the two fitted keys (cluster.
block_overhead_us, fitted to the Megatron-Core rows; cluster.peak_tflops, to torchtitan's rows on 500 W H100s)
each equal to the fit of its rows, each of them also reported left out of it. It does not hold the errors to
issue 60's target (every row within 12%, mean within 5%): the planner does not meet it yet. Measured on
2026-12-01 (predicted / published - 1, a fitting row by its leave-one-out error): mean |error| 5.7% over 45
rows; 8-256 GPUs 5.3%, 512-3,360 7.1%, 4,096+ 2.8%; from -23.8% (MT-NLG on 3,360 A100s) to +29.3% (the 8B
at 64K tokens, CP 2, out of the peak's sample).
docs/planner.md, "Published runs", has the table.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from shardwise.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_published as pp  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "published_runs.json"
# Kept aside as issue 60's independent check: none of these may be a row's source.
KEPT_ASIDE = ("2104.04473", "2205.05198", "2402.15627", "2407.21783", "MegaScale", "Narayanan", "Korthikanti",
              "Llama 3 Herd", "herd of models")


@pytest.fixture(scope="module")
def table() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def priced(table) -> tuple[list[dict], dict]:
    return pp.price_all(table)


@pytest.fixture(scope="module")
def results(priced) -> list[dict]:
    return priced[0]


def test_every_row_is_complete_and_sourced(table):
    assert "how" in table["note"] or "described" in table["note"]
    ids = [r["id"] for r in table["rows"]]
    assert len(ids) == len(set(ids))
    for row in table["rows"]:
        for key in ("title", "url", "where", "retrieved"):
            assert row["source"][key], (row["id"], key)
        for key in ("gpu", "gpus_per_node", "interconnect", "planner"):
            assert row["hardware"][key], (row["id"], key)
        assert row["model"]["as_stated"] and row["model"]["planner"], row["id"]
        assert row["layout"] and row["stack"]["as_stated"] and row["stack"]["described_as"], row["id"]
        published = row["published"]
        assert published["metric"] in ("step_time_s", "tokens_per_s_per_gpu") and published["value"] > 0, row["id"]
        assert published["as_stated"] and row["conversion"], row["id"]
        assert row["step_time_s"] > 0 and isinstance(row["assumptions"], list), row["id"]
        # a fitting row carries its key's fixture value, every other row no fitted key at all
        # ... or, on the same part but not fitted to (predicted_with), that value as a prediction out of sample
        fits = {f["key"]: f for f in table["fits"]}
        assert row["fitting_data"] is False or row["fitting_data"] in fits, row["id"]
        predicted_with = row.get("predicted_with")
        assert predicted_with is None or (row["fitting_data"] is False and predicted_with in fits), row["id"]
        for key, spec in fits.items():
            given = [o for o in row["overrides"] if o.startswith(f"--{key}=")]
            expected = [f"--{key}={spec['value']}"] if key in (row["fitting_data"], predicted_with) else []
            assert given == expected, row["id"]
        if predicted_with:
            parts = {r["hardware"]["gpu"] for r in table["rows"] if r["fitting_data"] == predicted_with}
            assert parts == {row["hardware"]["gpu"]}, row["id"]
        if row["fitting_data"] == "cluster.block_overhead_us":  # only NeMo's (Megatron-Core) rows
            assert "NeMo" in row["stack"]["as_stated"], row["id"]
        if row["fitting_data"] == "cluster.peak_tflops":  # only torchtitan's rows on the 500 W H100s
            assert "500 W" in row["hardware"]["gpu"] and row["id"].startswith("torchtitan"), row["id"]
        assert f"--cluster.num_gpus={row['gpus']}" in row["overrides"], row["id"]
        assert any(o.startswith("--cluster.gpu=") for o in row["overrides"]), row["id"]
        text = json.dumps(row["source"])
        assert not any(k.lower() in text.lower() for k in KEPT_ASIDE), f"{row['id']}: a kept-aside source"


def test_torchtitans_float8_tensor_parallel_rows_gather_in_fp8(table, results):
    """torchtitan 9dec370's apply_tp swaps in torchao's float8 TP styles whenever Float8 is on: its FP8 rows with TP
    are described with cluster.sp_gather = "fp8", and priced so (the stack line says it); no other row is."""
    for row, out in zip(table["rows"], results):
        float8_tp = (row["id"].startswith("torchtitan") and "--train.precision=fp8" in row["overrides"]
                     and any(o.startswith("--parallel.tp=") and o != "--parallel.tp=1" for o in row["overrides"]))
        assert ("--cluster.sp_gather=fp8" in row["overrides"]) == float8_tp, row["id"]
        assert ("SP all-gathers in FP8" in out["stack"]) == float8_tp, row["id"]
    assert sum("--cluster.sp_gather=fp8" in r["overrides"] for r in table["rows"]) == 7  # 3 fitted, 4 of Table 6


def test_deepspeeds_pipeline_rows_are_priced_with_its_engine(table, results):
    """A row whose stack ran DeepSpeed's pipeline (MT-NLG: Megatron TP + DeepSpeed PP) is described with
    cluster.pp_engine = "deepspeed", its blocking send / recv and boundaries split over TP; no other row is."""
    for row, out in zip(table["rows"], results):
        deepspeed = "DeepSpeed (pipeline" in row["stack"]["as_stated"]
        assert ("--cluster.pp_engine=deepspeed" in row["overrides"]) == deepspeed, row["id"]
        assert ("DeepSpeed's pipeline engine (blocking send / recv, sends split over TP)" in out["stack"]) == deepspeed
    assert sum("--cluster.pp_engine=deepspeed" in r["overrides"] for r in table["rows"]) == 3


def test_a_transformer_engine_row_prices_the_attention_its_launch_script_chose(table):
    """NVTE_FUSED_ATTN=0 leaves Transformer Engine FlashAttention-2; NVTE_FUSED_ATTN=1 with NVTE_FLASH_ATTN=0 its
    cuDNN attention (1.8x faster on an H100, as the planner prices them). The Llama 3.1 recipes were priced as
    FlashAttention until 2026-11-30: +2.1..+4.2% then, -0.9..-12.4% as they ran."""
    stated = 0
    for row in table["rows"]:
        text = row["stack"]["as_stated"]
        kernel = next((o.split("=", 1)[1] for o in row["overrides"] if o.startswith("--cluster.attention_kernel=")), None)
        if "NVTE_FUSED_ATTN=1" in text and "NVTE_FLASH_ATTN=0" in text:
            assert kernel == "cudnn", row["id"]
            stated += 1
        elif "NVTE_FUSED_ATTN=0" in text:
            assert kernel == "flash", row["id"]
            stated += 1
    assert stated == 15  # 8 Llama 3.1, 4 GPT-3 and 3 Nemotron-4 recipe rows of the DGX Cloud recipes


def test_published_throughputs_convert_to_the_step_time_recorded(table):
    """tokens/s/GPU rows: step = global batch x seq / (tokens/s/GPU x GPUs); step rows: as published."""
    for row in table["rows"]:
        published = row["published"]
        if published["metric"] == "step_time_s":
            assert row["step_time_s"] == pytest.approx(published["value"], rel=1e-3), row["id"]
            continue
        ov = dict(o.lstrip("-").split("=", 1) for o in row["overrides"])
        tokens = int(ov["train.global_batch"]) * int(ov["train.seq_len"])
        assert row["step_time_s"] == pytest.approx(tokens / (published["value"] * row["gpus"]), rel=1e-3), row["id"]


def test_the_set_spans_8_to_thousands_of_gpus(table):
    gpus = [r["gpus"] for r in table["rows"]]
    assert len(gpus) >= 10 and min(gpus) <= 8 and max(gpus) >= 10_000
    assert sum(g > 1000 for g in gpus) >= 5
    for name, _ in pp.BANDS:
        assert sum(pp.band(g) == name for g in gpus) >= 3, name


def test_every_published_layout_is_accepted_and_priced(results):
    """A layout the planner refuses is a finding to report, not a row to drop: none is refused today."""
    refused = {r["id"]: r["refused"] for r in results if r["refused"]}
    assert not refused, refused
    for r in results:
        assert r["predicted_s"] > 0 and math.isfinite(r["error"]), r["id"]
        assert 0 < r["mfu"] < 1 and r["breakdown_s"], r["id"]


def test_every_published_run_fits_the_memory_it_ran_on(results):
    """Every row is a run that happened. Until 2026-11-30 the planner held NVIDIA's 405B recipe at 94-100 GiB and
    its Nemotron-4 340B recipe at 77-101 GiB on 80 GB H100s: it kept SP's linear inputs gathered
    (cluster.sp_saved_input), AdamW's state in fp32 (cluster.optimizer_state_dtype) and priced Megatron's
    selective recomputation as the trainer's per-op policy (cluster.selective_recompute)."""
    assert [r["id"] for r in results if not r["fits"]] == []


def test_the_benchmark_reports_each_rows_error_and_the_bands(results, tmp_path, capsys):
    summ = pp.summary(results)
    assert summ["all"]["rows"] == len(results) and not summ["refused"]
    assert {name for name, _ in pp.BANDS} == set(summ["bands"])
    for s in summ["bands"].values():
        assert s["rows"] >= 3 and s["mean_abs_error"] >= 0 and s["worst_id"]
    text = pp.table_text(results, summ)
    for r in results:
        line = next(line for line in text.splitlines() if line.startswith(r["id"] + " "))
        assert f"{100 * r['error']:+.1f}%" in line, line
    assert "mean |error|" in text and "worst" in text
    out = tmp_path / "published.json"
    assert pp.main(["--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(results) and data["summary"]["all"]["rows"] == len(results)
    assert "mean |error|" in capsys.readouterr().out


def test_each_fitted_key_is_the_fit_of_its_rows_each_of_them_reported_left_out(table, priced):
    """Each of the fixture's fitted keys is what its fitting rows fit (within 1%: refit it when a row changes),
    and the summary counts each fitting row by the value fitted to the others, never by its own."""
    results, fitted = priced
    assert [f["key"] for f in fitted] == [s["key"] for s in table["fits"]] == ["cluster.block_overhead_us",
                                                                                 "cluster.peak_tflops"]
    for spec, f in zip(table["fits"], fitted):
        assert f["value"] == pytest.approx(spec["value"], rel=0.01), f["key"]
        rows = [r for r in results if r["fitting_data"] == f["key"]]
        assert len(rows) == len(f["held_out"]) and rows, f["key"]
        for r in rows:
            held = f["held_out"][r["id"]]
            assert held == pytest.approx(f["value"], rel=0.1), r["id"]
            assert r["leave_one_out_value"] == held and math.isfinite(r["leave_one_out_error"]), r["id"]
            assert pp.prediction_error(r) == r["leave_one_out_error"], r["id"]
    overhead, peak = fitted
    # Megatron-Core's time per block: 23 rows, none of them its own fit; each recipe (the same run at several GPU
    # counts) also fitted without any of its rows
    assert len(overhead["held_out"]) == 23 and overhead["value"] not in overhead["held_out"].values()
    assert overhead["recipes"] == 9 and set(overhead["recipe_held_out"]) == set(overhead["held_out"])
    assert pp.recipe("dgxc-gpt3-175b-tp4-pp8-fp8-2048") == "dgxc-gpt3-175b-tp4-pp8-fp8"
    assert overhead["recipe_held_out"]["dgxc-gpt3-175b-tp4-pp8-128"] == overhead["recipe_held_out"]["dgxc-gpt3-175b-tp4-pp8-2048"]
    assert 0 < overhead["recipe_held_out_mean_abs_error"] < 0.2
    # the value users are told to set (the key's help, docs/planner.md) is the fixture's
    doc = next(f.metadata["doc"] for f in dataclasses.fields(ClusterConfig) if f.name == "block_overhead_us")
    assert f"Megatron-Core / NeMo: {table['fits'][0]['value']}," in doc
    assert f"`block_overhead_us = {table['fits'][0]['value']}`" in (ROOT / "docs" / "planner.md").read_text()
    # the 500 W H100s' peak: the 9 torchtitan rows, kept within what their source states ("between SXM and NVL"):
    # the fit binds at the NVL's 835.5, where the rows alone would put it about 2% lower (docs/planner.md)
    assert len(peak["held_out"]) == 9 and peak["bounds"] == [835.5, 989.4]
    assert all(835.5 <= v <= 989.4 for v in [peak["value"], *peak["held_out"].values()])
    assert 0.95 * 835.5 < peak["unbounded_value"] <= peak["value"]
    assert f"`peak_tflops = {table['fits'][1]['value']}`" in (ROOT / "docs" / "planner.md").read_text()
    # ... and predicted out of sample on the same part: torchtitan's context-parallel Tables 2 and 6, never in a fit
    outside = [r for r in results if r["predicted_with"] == "cluster.peak_tflops"]
    assert len(outside) == 8 and all("leave_one_out_error" not in r and "-cp" in r["id"] for r in outside)
    doc = next(f.metadata["doc"] for f in dataclasses.fields(ClusterConfig) if f.name == "peak_tflops")
    assert f"published runs on them fit {table['fits'][1]['value']}," in doc
    others = [r for r in results if not r["fitting_data"]]
    assert others and all("leave_one_out_error" not in r and pp.prediction_error(r) == r["error"] for r in others)
    summ = pp.summary(results)
    assert summ["all"]["mean_abs_error"] == pytest.approx(sum(abs(pp.prediction_error(r)) for r in results) / len(results))
