"""The benchmark suite's ddp and device sections in their smallest configuration run end to end, so that they
cannot rot unnoticed (the sections that train through the Trainer: `test_benchmarks_smoke_*.py`).

Timings are not checked (speed is never asserted by a test); what is checked is that every experiment of
the DDP section ran on real processes and produced the numbers the report and the figures are made of.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.report import tables
from benchmarks.run import run_suite

EXPECTED = {
    "local",
    "native default",
    "bucketed default",
    "bucketed default no-overlap",
    "native cap=0",
    "bucketed cap=0",
    "bucketed cap=0 no-overlap",
    "native cap=1024",
    "bucketed cap=1024",
    "native sync-every=2",
    "bucketed sync-every=2",
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    results = run_suite("smoke", ("ddp",), out, log=lambda message: None)
    return results, out


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_ddp_section_measures_every_variant_on_every_workload(smoke):
    results, out = smoke
    written = json.loads(out.read_text())
    assert written["headline"] == results["headline"]
    assert written["machine"]["cores"] >= 1
    assert len(written["machine"]["load_average_start"]) == len(written["machine"]["load_average_end"]) == 3
    ddp = written["sections"]["ddp"]
    assert set(ddp) == {"cnn", "bert", "mlp", "_timing"}
    for name in ("cnn", "bert"):
        variants = ddp[name]["variants"]
        assert set(variants) == EXPECTED
        # Each variant ran with the configuration its name states.
        for label, variant in variants.items():
            assert variant["overlap"] == ("no-overlap" not in label)
            assert variant["sync_every"] == (2 if "sync-every=2" in label else 1)
            assert variant["cap_mb"] == (None if "cap=" not in label else float(label.split("cap=")[1].split()[0]))
        for variant in variants.values():
            assert _positive(variant["step"]["median_ms"])
            assert _positive(variant["per_sample"]["median_ms"])
            # One block per repeat, of `steps` micro-batches (skip-sync: `skip_microbatches`).
            assert len(variant["block_medians_ms"]) == 1 and variant["step"]["n"] == 2
            phases = variant["phases_ms"]
            assert phases["forward"] > 0 and phases["backward"] > 0
        # BucketedDDP reports its own wait for every synchronized backward; torch's DDP does not.
        assert all(("reducer_exposed_wait_ms" in v) == (v["reducer"] == "bucketed") for v in variants.values())
        headline = written["headline"]["ddp"][name]
        assert _positive(headline["bucketed_over_native_default"])
        assert headline["native_sweep"]["worst_over_best"] >= 1.0
        assert headline["bucketed_sweep"]["worst_over_best"] >= 1.0
        assert set(headline["overlap_speedup_by_cap"]) == {"0"}
        assert set(headline["skip_sync_time_per_sample_vs_every_step"]["bucketed"]) == {"1", "2"}
    assert set(ddp["mlp"]["variants"]) == {"local", "native default", "bucketed default", "bucketed default no-overlap"}


def test_report_tables_come_from_the_json(smoke):
    results, _ = smoke
    text = tables(results)
    for row in ("| CNN | BucketedDDP |", "| BERT | NativeDDP |", "| MLP | local |", "| CNN | per parameter (0) |"):
        assert row in text


def test_figures_are_drawn_from_the_json(smoke, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional bench extra")
    from benchmarks.plot import plot_all

    results, _ = smoke
    written = plot_all(results, tmp_path)
    assert {p.name for p in written} == {"bucket_sweep.png", "breakdown.png", "skip_sync.png"}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_device_section_times_each_reducer_alone_at_every_precision():
    """World size 1 on this machine's device; bf16-mixed runs here on the CPU, as it would on CUDA."""
    from benchmarks.ddp import run_device_workload
    from benchmarks.plans import Plan
    from benchmarks.report import device_table

    plan = Plan(caps_mb=(), sync_every=(1,), repeats=2, steps=2)
    workload = run_device_workload("cnn", "tiny", plan, ("32", "bf16-mixed"), "cpu", timeout=120)
    variants = workload["variants"]
    assert set(variants) == {
        f"{name}{suffix}" for name in ("local", "native default", "bucketed default") for suffix in ("", " bf16-mixed")
    }
    for label, variant in variants.items():
        assert variant["precision"] == ("bf16-mixed" if "bf16" in label else "32")
        assert _positive(variant["step"]["median_ms"]) and variant["step"]["n"] == 4
        assert len(variant["block_medians_ms"]) == 2
    # Exposed communication is measured against the local variant of the same precision.
    bucketed = variants["bucketed default bf16-mixed"]
    local = variants["local bf16-mixed"]
    assert bucketed["exposed_comm_ms"] == pytest.approx(
        bucketed["phases_ms"]["backward"] - local["phases_ms"]["backward"], abs=1e-3
    )
    section = {"device": "cpu", "precisions": ["32", "bf16-mixed"], "workloads": {"cnn": workload}}
    table = device_table(section)
    assert "| CNN | bf16-mixed | BucketedDDP |" in table and "| CNN | 32 | local |" in table


def test_device_section_in_the_suite(tmp_path):
    results = run_suite("smoke", ("device",), tmp_path / "device.json", log=lambda message: None)
    device = results["sections"]["device"]
    assert device["world_size"] == 1 and device["precisions"][0] == "32"
    # Without a GPU only the MLP runs: a CNN or BERT step's spread hides a reducer's own cost on the CPU.
    assert set(device["workloads"]) == ({"cnn", "bert", "mlp"} if device["device"] == "cuda" else {"mlp"})
    headline = results["headline"]["device"]["mlp"]["32"]
    assert _positive(headline["bucketed_over_local"]) and _positive(headline["native_over_local"])
    assert "one device" in tables(results)
