"""`python -m benchmarks --sections lab`: the network lab's experiments in one run (docs/performance.md, §9).

Three jobs on lab clusters (`benchmarks/lab/cluster.py`), each also a command of its own:

- `strategies` (`benchmarks/lab/strategies.py`): every strategy's seconds per step and bytes per node
  against its link's bound, per node count and rate;
- `ddp` (`benchmarks/lab/ddp.py`): the DDP paper's overlap on/off and bucket-size sweep on BERT, per rate;
- `tradeoff` (`benchmarks/lab/tradeoff.py`): BAGUA's trade-off, every strategy's training seconds to a
  fixed validation loss of the default example, per node count and rate.

Where the machine does not permit private network namespaces the section says why in one line and
records only that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cluster import namespaces_unavailable

__all__ = ["LAB_PLANS", "LabPlan", "run_lab_section"]


@dataclass(frozen=True)
class LabPlan:
    """Node counts, link rates and lengths of the lab's three jobs (a rate of None: unshaped links)."""

    strategy_nodes: tuple[int, ...] = (2, 4)
    strategy_rates: tuple[str | None, ...] = ("1gbit", "100mbit")
    strategy_steps: int = 12
    #: Labels of `lab_strategies.DEFAULT_STRATEGIES` to run (empty: all).
    strategy_labels: tuple[str, ...] = ()
    ddp_rates: tuple[str | None, ...] = ("1gbit", "100mbit")
    ddp_repeats: int = 5
    tradeoff_nodes: tuple[int, ...] = (2, 4)
    tradeoff_rates: tuple[str | None, ...] = (None, "1gbit", "100mbit")
    #: Labels of `lab_tradeoff.STRATEGIES` to run (empty: all).
    tradeoff_labels: tuple[str, ...] = ()
    #: Where the tradeoff job stops: the default example's full epoch.
    tradeoff_max_steps: int = 439


LAB_PLANS = {
    # About two hours on 2 cores.
    "full": LabPlan(),
    # About ten minutes: 2 nodes at 100 Mbit/s, a few strategies, short jobs.
    "quick": LabPlan(
        strategy_nodes=(2,),
        strategy_rates=("100mbit",),
        strategy_steps=4,
        strategy_labels=("bucketed_ddp", "powersgd", "local_sgd"),
        ddp_rates=("100mbit",),
        ddp_repeats=1,
        tradeoff_nodes=(2,),
        tradeoff_rates=("100mbit",),
        tradeoff_labels=("bucketed_ddp", "powersgd", "local_sgd"),
    ),
    # A minute or two: that every job runs end to end.
    "smoke": LabPlan(
        strategy_nodes=(2,),
        strategy_rates=("1gbit",),
        strategy_steps=2,
        strategy_labels=("bucketed_ddp",),
        ddp_rates=(),
        tradeoff_nodes=(2,),
        tradeoff_rates=("1gbit",),
        tradeoff_labels=("bucketed_ddp",),
        tradeoff_max_steps=10,
    ),
}


def run_lab_section(plan: LabPlan, log: Callable[[str], None]) -> dict[str, Any]:
    """Run the lab's three jobs as `plan` says; or, where namespaces are not permitted, say so and skip."""
    reason = namespaces_unavailable()
    if reason is not None:
        log(f"lab: skipped: {reason}")
        return {"skipped": reason}
    from ..ddp_suite import DDPPlan
    from . import ddp as lab_ddp
    from . import strategies as lab_strategies
    from . import tradeoff as lab_tradeoff

    chosen = lab_strategies.select_strategies(plan.strategy_labels)  # with `local`, the bound's compute
    strategies: list[dict[str, Any]] = []
    for nodes in plan.strategy_nodes:
        for rate in plan.strategy_rates:
            log(f"lab: strategies on {nodes} nodes, {rate or 'unshaped'}")
            strategies += lab_strategies.run_strategies(nodes, rate, chosen, plan.strategy_steps)
    ddp = []
    ddp_plan = DDPPlan(caps_mb=lab_ddp.CAPS_MB, sync_every=(1,), repeats=plan.ddp_repeats, steps=2)
    for rate in plan.ddp_rates:
        log(f"lab: overlap and bucket sweep on BERT, {rate or 'unshaped'}")
        ddp.append(lab_ddp.run_lab_ddp(rate, "bert", ddp_plan, lab_ddp.lab_variants()))
    picked = [s for s in lab_tradeoff.STRATEGIES if not plan.tradeoff_labels or s[0] in plan.tradeoff_labels]
    tradeoff: list[dict[str, Any]] = []
    for nodes in plan.tradeoff_nodes:
        for rate in plan.tradeoff_rates:
            log(f"lab: seconds to loss {lab_tradeoff.TARGET_LOSS} on {nodes} nodes, {rate or 'unshaped'}")
            tradeoff += lab_tradeoff.run_cell(nodes, rate, picked, max_steps=plan.tradeoff_max_steps)
    return {
        "strategies": strategies,
        "ddp": ddp,
        "tradeoff": {"target": lab_tradeoff.TARGET_LOSS, "rows": tradeoff},
    }
