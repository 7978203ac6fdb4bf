"""The GPT-2 study's smallest plan runs end to end and yields every figure its table is made of.

Timings are not checked (speed is never asserted by a test). One two-step run of the single process and
one of the sharded parameter server under bf16-mixed on two gloo ranks, a tiny CharGPT.
"""

from __future__ import annotations

import json
import math

from benchmarks.common import ROOT
from benchmarks.gpt2_study import RESULTS, fill_page, gpt2_table
from benchmarks.run import run_suite


def test_gpt2_study_smoke_plan_measures_every_field(tmp_path):
    results = run_suite("smoke", ("gpt2",), tmp_path / "gpt2.json", log=lambda message: None)
    study = results["sections"]["gpt2"]
    plan = study["plan"]
    assert set(study["results"]) == {"single", "sharded_ps bf16"}
    for label, r in study["results"].items():
        assert r["processes"] == (1 if label == "single" else 2)
        assert r["precision"] == ("bf16-mixed" if "bf16" in label else "32")
        assert r["samples_per_s"]["median"] > 0 and r["step_ms_median"] > 0
        assert r["samples_per_s_fast_quartile"]["median"] >= r["samples_per_s"]["median"]
        assert len(r["memory_per_rank"]) == r["processes"]
        for rank in r["memory_per_rank"]:
            assert rank["params"] == 4 * r["parameters"] and rank["optimizer_state"] > 0
            assert rank["total"] == rank["params"] + rank["grads"] + rank["optimizer_state"]
            assert rank["peak_rss_bytes"] > 2**20
        # A validation every step, each once (the Trainer's repeated one at max_steps is dropped).
        assert [step for step, _ in r["val_curve"]] == list(range(1, plan["steps"] + 1))
        assert math.isfinite(r["final_val_loss"])
        assert r["steps_to_target"] == 1 and r["train_s_to_target"]["median"] > 0
    # Bytes per step: none for one process; the sharded server sends (W-1)/W of the gradients in its
    # reduce-scatter and as much in its all-gather, plus a 4-byte finiteness flag.
    assert study["results"]["single"]["comm_bytes_per_step"] == 0
    sharded = study["results"]["sharded_ps bf16"]
    assert sharded["comm_bytes_per_step"] == 2 * (2 - 1) / 2 * sharded["memory_per_rank"][0]["grads"] + 4
    check = study["sharded_state_check"]
    assert check["passed"] and all(0.4 < x <= 0.6 for x in check["configs"]["sharded_ps bf16"]["per_rank"])
    assert results["headline"]["gpt2"]["sharded_state_check_passed"] is True
    assert json.loads((tmp_path / "gpt2.json").read_text())["sections"]["gpt2"]["results"] == study["results"]
    assert "| sharded_ps bf16 | 2 | bf16-mixed |" in gpt2_table(study)


def test_performance_page_quotes_the_committed_gpt2_study():
    page = (ROOT / "docs" / "performance.md").read_text()
    suite = json.loads(RESULTS.read_text())
    assert fill_page(page, suite) == page, "run `python -m benchmarks gpt2 --write docs/performance.md`"
    assert suite["mode"] == "full" and suite["sections"]["gpt2"]["sharded_state_check"]["passed"]
