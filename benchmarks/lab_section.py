"""`python -m benchmarks --sections lab`: the network lab's experiments in one run (docs/performance.md).

Three jobs on lab clusters (`syncline.lab.cluster`), each also a command of its own:

- `strategies` (`syncline.lab.strategies`): every strategy's seconds per step and bytes per node against its link's
  bound, per node count and rate;
- `ddp` (`benchmarks/lab_ddp.py`): the DDP paper's overlap on/off and bucket-size sweep on BERT, per rate;
- `tradeoff` (`syncline.lab.tradeoff`): BAGUA's trade-off, every strategy's training seconds to a fixed validation
  loss of the default example, per node count and rate.

Where the machine does not permit private network namespaces the section says why in one line and
records only that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from syncline.lab.cluster import namespaces_unavailable

from .plans import Plan

__all__ = ["run_lab_section"]


def run_lab_section(plans: Mapping[str, Plan], log: Callable[[str], None]) -> dict[str, Any]:
    """Run the lab's three jobs as `plans` (a mode of `benchmarks.plans.PLANS`) says: `lab_strategies`, `lab_ddp`,
    `lab_tradeoff`; or, where namespaces are not permitted, say so and skip."""
    reason = namespaces_unavailable()
    if reason is not None:
        log(f"lab: skipped: {reason}")
        return {"skipped": reason}
    from syncline.lab import strategies as lab_strategies
    from syncline.lab import tradeoff as lab_tradeoff

    from . import lab_ddp

    plan = plans["lab_strategies"]
    chosen = lab_strategies.select_strategies(plan.labels)  # with `local`, the bound's compute
    strategies: list[dict[str, Any]] = []
    for nodes in plan.nodes:
        for rate in plan.rates:
            log(f"lab: strategies on {nodes} nodes, {rate or 'unshaped'}")
            strategies += lab_strategies.run_strategies(nodes, rate, chosen, plan.steps)
    plan = plans["lab_ddp"]
    ddp = []
    for rate in plan.rates:
        log(f"lab: overlap and bucket sweep on BERT, {rate or 'unshaped'}")
        ddp.append(lab_ddp.run_lab_ddp(rate, "bert", plan, lab_ddp.lab_variants(plan.caps_mb)))
    plan = plans["lab_tradeoff"]
    picked = [s for s in lab_tradeoff.STRATEGIES if not plan.labels or s[0] in plan.labels]
    tradeoff: list[dict[str, Any]] = []
    for nodes in plan.nodes:
        for rate in plan.rates:
            log(f"lab: seconds to loss {lab_tradeoff.TARGET_LOSS} on {nodes} nodes, {rate or 'unshaped'}")
            tradeoff += lab_tradeoff.run_cell(nodes, rate, picked, max_steps=plan.steps)
    return {
        "strategies": strategies,
        "ddp": ddp,
        "tradeoff": {"target": lab_tradeoff.TARGET_LOSS, "rows": tradeoff},
    }
