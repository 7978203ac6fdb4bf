"""Everything that touches process groups and gradient synchronization."""

from syncline.strategies.bucketed_ddp import BucketedDDP
from syncline.strategies.native_ddp import NativeDDP
from syncline.strategies.registry import STRATEGIES, register_strategy, resolve_strategy
from syncline.strategies.single_device import SingleDevice
from syncline.strategies.strategy import Strategy

__all__ = [
    "STRATEGIES",
    "BucketedDDP",
    "NativeDDP",
    "SingleDevice",
    "Strategy",
    "register_strategy",
    "resolve_strategy",
]
