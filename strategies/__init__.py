"""Everything that touches process groups and gradient synchronization."""

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
from syncline.strategies.reducer_strategy import ReducerStrategy
from syncline.strategies.registry import STRATEGIES, register_strategy, resolve_strategy
from syncline.strategies.sharded_parameter_server import ShardedParameterServer
from syncline.strategies.single_device import SingleDevice
from syncline.strategies.strategy import Strategy
from syncline.strategies.tensor_fusion import TensorFusion

__all__ = [
    "STRATEGIES",
    "AsyncModelAverage",
    "BucketedDDP",
    "ByteGrad",
    "Decentralized",
    "DiLoCo",
    "LocalSGD",
    "NativeDDP",
    "ParameterServer",
    "PowerSGD",
    "QAdam",
    "ReducerStrategy",
    "ShardedParameterServer",
    "SingleDevice",
    "Strategy",
    "TensorFusion",
    "register_strategy",
    "resolve_strategy",
]
