"""Map the names used in configs and errors to strategy classes, so all three list the same names."""

from __future__ import annotations

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

__all__ = ["STRATEGIES", "register_strategy", "resolve_strategy"]

#: Every strategy by its config name (`strategy=<name>` in Hydra, `Trainer(strategy="<name>")`).
STRATEGIES: dict[str, type[Strategy]] = {}


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
    registered) for several.

    Raises:
        ValueError: `strategy` is neither a Strategy nor a registered name.
    """
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}")
    name = strategy
    # Under torchrun the environment says how many processes there are, whatever `devices` says.
    devices = max(devices, int(os.environ.get("WORLD_SIZE", "1")))
    if name == "auto":
        name = "single" if devices == 1 else "bucketed_ddp"
    if name not in STRATEGIES:
        valid = ", ".join(sorted(["auto", *STRATEGIES]))
        raise ValueError(f"Unknown strategy {strategy!r}. Valid strategies: {valid}.")
    return STRATEGIES[name](**kwargs)
