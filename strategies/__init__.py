"""Everything that touches process groups and gradient synchronization."""

from strategies.registry import STRATEGIES, register_strategy, resolve_strategy
from strategies.single_device import SingleDevice
from strategies.strategy import Strategy

__all__ = ["STRATEGIES", "SingleDevice", "Strategy", "register_strategy", "resolve_strategy"]
