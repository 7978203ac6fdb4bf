"""The headline ratios of a suite run, computed from its JSON (so the report and the run agree).

- BucketedDDP / NativeDDP median step time at the default bucket size, per workload, with the paired
  per-repeat ratio (the two blocks of one repeat ran seconds apart, so a slow spell cancels out);
- best / worst bucket size per reducer and workload: slowest median step over the sweep / fastest;
- overlap speedup of BucketedDDP: median step without overlap / with overlap, at the default and at
  every swept size;
- skip-sync: time per sample relative to synchronizing every micro-batch, and the final validation loss;
- one device (world size 1): each reducer's step / local step, BucketedDDP / NativeDDP, and each mixed
  precision's local step / the fp32 one;
- Trainer / raw loop and Lightning / raw loop, per step and to the first step;
- strategies: epoch time and validation loss of CharGPT per strategy;
- the GPT-2 study: samples per second per config and over the single process's, training seconds to the
  target loss, and whether the sharded server's optimizer state per rank stays within its limit.
"""

from __future__ import annotations

import statistics
from typing import Any

from .ddp import variant_name

__all__ = ["headlines", "paired_ratio", "sweep"]


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Per-repeat ratio of two variants' block medians (a / b): median, min and max."""
    ratios = [x / y for x, y in zip(a["block_medians_ms"], b["block_medians_ms"])]
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def sweep(variants: dict[str, Any], reducer: str, overlap: bool = True) -> list[tuple[float, dict[str, Any]]]:
    """Return (cap, variant) of one reducer's bucket-size sweep, by cap."""
    found = [
        (v["cap_mb"], v)
        for v in variants.values()
        if v["reducer"] == reducer and v["cap_mb"] is not None and v["overlap"] == overlap and v["sync_every"] == 1
    ]
    return sorted(found, key=lambda item: item[0])


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3)


def _ddp(workload: dict[str, Any]) -> dict[str, Any]:
    variants = workload["variants"]
    native, bucketed = variants["native default"], variants["bucketed default"]
    no_overlap = variants["bucketed default no-overlap"]
    local = variants["local"]
    out: dict[str, Any] = {
        "bucketed_over_native_default": _ratio(bucketed["step"]["median_ms"], native["step"]["median_ms"]),
        "bucketed_over_native_default_paired": paired_ratio(bucketed, native),
        "native_over_local_default": _ratio(native["step"]["median_ms"], local["step"]["median_ms"]),
        "bucketed_over_local_default": _ratio(bucketed["step"]["median_ms"], local["step"]["median_ms"]),
        "overlap_speedup_default": _ratio(no_overlap["step"]["median_ms"], bucketed["step"]["median_ms"]),
        "overlap_speedup_default_paired": paired_ratio(no_overlap, bucketed),
    }
    for reducer in ("native", "bucketed"):
        points = sweep(variants, reducer)
        if len(points) < 2:
            continue
        medians = [(cap, v["step"]["median_ms"]) for cap, v in points]
        best = min(medians, key=lambda item: item[1])
        worst = max(medians, key=lambda item: item[1])
        out[f"{reducer}_sweep"] = {
            "best_cap_mb": best[0],
            "best_ms": best[1],
            "worst_cap_mb": worst[0],
            "worst_ms": worst[1],
            "worst_over_best": _ratio(worst[1], best[1]),
        }
    overlap_by_cap = {}
    with_overlap = dict(sweep(variants, "bucketed"))
    for cap, off in sweep(variants, "bucketed", overlap=False):
        overlap_by_cap[f"{cap:g}"] = _ratio(off["step"]["median_ms"], with_overlap[cap]["step"]["median_ms"])
    if overlap_by_cap:
        out["overlap_speedup_by_cap"] = overlap_by_cap
    skip = {}
    for reducer, base in (("native", native), ("bucketed", bucketed)):
        per_k = {"1": 1.0}
        for v in variants.values():
            if v["reducer"] == reducer and v["sync_every"] > 1:
                per_k[str(v["sync_every"])] = _ratio(v["per_sample"]["median_ms"], base["per_sample"]["median_ms"])
        if len(per_k) > 1:
            skip[reducer] = per_k
    if skip:
        out["skip_sync_time_per_sample_vs_every_step"] = skip
    return out


def _device(workload: dict[str, Any], precisions: list[str]) -> dict[str, Any]:
    variants = workload["variants"]
    out: dict[str, Any] = {}
    for precision in precisions:
        local, native, bucketed = (
            variants[variant_name(name, precision)] for name in ("local", "native default", "bucketed default")
        )
        out[precision] = {
            "local_ms": local["step"]["median_ms"],
            "native_over_local": _ratio(native["step"]["median_ms"], local["step"]["median_ms"]),
            "bucketed_over_local": _ratio(bucketed["step"]["median_ms"], local["step"]["median_ms"]),
            "bucketed_over_native": _ratio(bucketed["step"]["median_ms"], native["step"]["median_ms"]),
            "bucketed_over_native_paired": paired_ratio(bucketed, native),
            "local_over_fp32_local": _ratio(local["step"]["median_ms"], variants["local"]["step"]["median_ms"]),
        }
    return out


def headlines(results: dict[str, Any]) -> dict[str, Any]:
    """Return the headline ratios of every section present in `results`."""
    sections = results["sections"]
    out: dict[str, Any] = {}
    if "ddp" in sections:
        out["ddp"] = {name: _ddp(w) for name, w in sections["ddp"].items() if not name.startswith("_")}
    if "device" in sections:
        device = sections["device"]
        out["device"] = {
            "device": device["device"],
            **{name: _device(w, device["precisions"]) for name, w in device["workloads"].items()},
        }
    if "overhead" in sections:
        loops = sections["overhead"]["loops"]
        others = [loop for loop in loops if loop != "raw"]
        out["overhead"] = (
            {f"{loop}_over_raw_step": loops[loop]["step_ratio_over_raw"] for loop in others}
            | {f"{loop}_over_raw_step_paired_median": loops[loop]["paired_step_ratio"]["median"] for loop in others}
            | {
                f"{loop}_over_raw_step_fresh_processes": loops[loop]["fresh_process_step_ratio_over_raw"]
                for loop in others
            }
            | {f"{loop}_first_step_s": loops[loop]["first_step_s"]["median"] for loop in loops}
        )
    if "gpt2" in sections:
        out["gpt2"] = _gpt2(sections["gpt2"])
    if "curves" in sections:
        runs = sections["curves"]["runs"]
        out["curves_val_loss_by_sync_every"] = {k: r["val_loss"]["median"] for k, r in runs.items()}
        best = {}
        for k, run in runs.items():
            tried = {"base": run, **sections["curves"].get("lr_scaled", {}).get(k, {})}
            scaling = min(tried, key=lambda name: tried[name]["val_loss"]["median"])
            best[k] = {"lr_scaling": scaling, "val_loss": tried[scaling]["val_loss"]["median"]}
        out["curves_best_val_loss_by_sync_every"] = best
        base = runs.get("1")
        if base is not None:
            out["curves_epoch_time_vs_every_step"] = {
                k: _ratio(r["steady_epoch_s"]["median"], base["steady_epoch_s"]["median"]) for k, r in runs.items()
            }
    if "strategies" in sections:
        strategies = sections["strategies"]["strategies"]
        single = strategies["single"]["steady_epoch_s"]["median"]
        out["strategies"] = {
            name: {
                "steady_epoch_s": s["steady_epoch_s"]["median"],
                "epoch_s": s["epoch_s"]["median"],
                "steady_epoch_vs_single": _ratio(s["steady_epoch_s"]["median"], single),
                "val_loss": s["val_loss"]["median"],
            }
            for name, s in strategies.items()
        }
    return out


def _gpt2(study: dict[str, Any]) -> dict[str, Any]:
    results = study["results"]
    single = results["single"]["samples_per_s"]["median"] if "single" in results else None
    check = study["sharded_state_check"]
    return {
        "samples_per_s": {label: r["samples_per_s"]["median"] for label, r in results.items()},
        "samples_per_s_vs_single": (
            {label: round(r["samples_per_s"]["median"] / single, 3) for label, r in results.items()} if single else None
        ),
        "samples_per_s_fast_quartile": {
            label: r["samples_per_s_fast_quartile"]["median"] for label, r in results.items()
        },
        "train_s_to_target": {
            label: r["train_s_to_target"]["median"] if r["train_s_to_target"] else None for label, r in results.items()
        },
        "sharded_optimizer_state_vs_full": (
            {label: max(c["per_rank"]) for label, c in check["configs"].items()} if check else None
        ),
        "sharded_state_check_passed": check["passed"] if check else None,
    }
