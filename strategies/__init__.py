"""Everything that touches process groups and gradient synchronization."""

from strategies.bucketed_ddp import BucketedDDP
from strategies.native_ddp import NativeDDP
from strategies.registry import STRATEGIES, register_strategy, resolve_strategy
from strategies.single_device import SingleDevice
from strategies.strategy import Strategy

__all__ = [
    "STRATEGIES",
    "BucketedDDP",
    "NativeDDP",
    "SingleDevice",
    "Strategy",
    "register_strategy",
    "resolve_strategy",
]
