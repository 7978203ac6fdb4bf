"""Map the names used in configs and errors to strategy classes, so all three list the same names."""

from __future__ import annotations

import difflib
import os
from typing import Any

from syncline.strategies.async_model_average import AsyncModelAverage
from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.bytegrad import ByteGrad
from syncline.strategies.decentralized import Decentralized
from syncline.strategies.diloco import DiLoCo
from syncline.strategies.local_sgd import LocalSGD
from syncline.strategies.native_ddp import NativeDDP
from syncline.strategies.parameter_server import ParameterServer
from syncline.strategies.powersgd import PowerSGD
from syncline.strategies.qadam import QAdam
from syncline.strategies.sharded_parameter_server import ShardedParameterServer
from syncline.strategies.single_device import SingleDevice
from syncline.strategies.strategy import Strategy
from syncline.strategies.tensor_fusion import TensorFusion

__all__ = ["LIGHTNING_STRATEGIES", "STRATEGIES", "register_strategy", "resolve_strategy"]

#: Every strategy by its config name (`strategy=<name>` in Hydra, `Trainer(strategy="<name>")`).
STRATEGIES: dict[str, type[Strategy]] = {}


#: Lightning's strategy names with a syncline equivalent, and that strategy with its options. Lightning's DDP is
#: torch's `DistributedDataParallel`, here `native_ddp`; its spawn, fork and notebook variants differ only in
#: how the processes start, and syncline starts them its own way (torch's elastic agent, spawned workers), so
#: they are `native_ddp` too. Names are matched case-insensitively, as Lightning does.
LIGHTNING_STRATEGIES: dict[str, dict[str, Any]] = {
    "single_device": {"name": "single"},
    **{
        f"{ddp}{unused}": {"name": "native_ddp", **options}
        for ddp in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")
        for unused, options in (
            ("", {}),
            ("_find_unused_parameters_true", {"find_unused_parameters": True}),
            ("_find_unused_parameters_false", {"find_unused_parameters": False}),
        )
    },
}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Add `cls` to the registry under `cls.name`; usable as a class decorator."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name` to be registered")
    STRATEGIES[cls.name] = cls
    return cls


register_strategy(SingleDevice)
register_strategy(BucketedDDP)
register_strategy(NativeDDP)
register_strategy(ByteGrad)
register_strategy(PowerSGD)
register_strategy(QAdam)
register_strategy(LocalSGD)
register_strategy(Decentralized)
register_strategy(AsyncModelAverage)
register_strategy(TensorFusion)
register_strategy(ParameterServer)
register_strategy(ShardedParameterServer)
register_strategy(DiLoCo)


def resolve_strategy(strategy: str | Strategy, devices: int = 1, **kwargs: Any) -> Strategy:
    """Turn the Trainer's `strategy` argument into a Strategy instance.

    `"auto"` picks `SingleDevice` for one process and the bucketed data-parallel strategy (when
    registered) for several. Lightning's names (`LIGHTNING_STRATEGIES`) give their syncline equivalent;
    names are matched case-insensitively.

    Raises:
        ValueError: `strategy` is neither a Strategy nor a registered or Lightning name; the message suggests
            the closest name.
    """
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}")
    name = strategy if strategy in STRATEGIES else strategy.strip().lower()
    # Under torchrun the environment says how many processes there are, whatever `devices` says.
    devices = max(devices, int(os.environ.get("WORLD_SIZE", "1")))
    if name == "auto":
        name = "single" if devices == 1 else "bucketed_ddp"
    if name in LIGHTNING_STRATEGIES and name not in STRATEGIES:
        spec = dict(LIGHTNING_STRATEGIES[name])
        name, kwargs = spec.pop("name"), {**spec, **kwargs}
    if name not in STRATEGIES:
        names = sorted(["auto", *STRATEGIES])
        close = difflib.get_close_matches(name, [*names, *LIGHTNING_STRATEGIES], n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown strategy {strategy!r}.{hint} Valid strategies: {', '.join(names)} "
            "(and Lightning's 'ddp', 'ddp_spawn', 'ddp_fork', 'ddp_notebook', which are 'native_ddp')."
        )
    return STRATEGIES[name](**kwargs)
