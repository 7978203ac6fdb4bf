"""Structured configs for Hydra: the Trainer's arguments and one dataclass per registered strategy.

The packaged YAML in ``trainer/conf`` picks the defaults (task, strategy, callbacks) and the values of
the default run; the dataclasses here give every key a type, so that a misspelled key or a value of the
wrong type is an error before anything runs.

A new strategy needs one dataclass with its `_target_` and its constructor's options, added to
`STRATEGY_CONFS` under its registry name; it becomes selectable as ``strategy=<name>`` as soon as the
class is in `strategies.STRATEGIES`.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from syncline.strategies.registry import STRATEGIES

__all__ = [
    "STRATEGY_CONFS",
    "VARIANT_CONFS",
    "AsyncModelAverageConf",
    "AutoStrategyConf",
    "BucketedDDPConf",
    "ByteGradConf",
    "DecentralizedConf",
    "LocalSGDConf",
    "NativeDDPConf",
    "NativeDDPPostLocalSGDConf",
    "NativeDDPPowerSGDConf",
    "ParameterServerConf",
    "PowerSGDConf",
    "QAdamConf",
    "ShardedParameterServerConf",
    "SingleDeviceConf",
    "SynclineConf",
    "TensorFusionConf",
    "TrainerConf",
    "register_configs",
]


@dataclass
class TrainerConf:
    """Every argument of `trainer.Trainer` but the objects (`strategy`, `callbacks`), with its default.

    `default_root_dir` None means the run's Hydra output directory. `logger` True is a TensorBoardLogger
    under it.
    """

    max_epochs: int | None = None
    max_steps: int = -1
    min_epochs: int | None = None
    min_steps: int | None = None
    # An int, or Lightning's "auto" (OmegaConf 2.3 has no int-or-str type; the Trainer checks the value).
    devices: Any = 1
    accelerator: str = "auto"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    precision: str = "32"
    logger: bool = True
    default_root_dir: str | None = None
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    log_every_n_steps: int = 50
    val_check_interval: int | float = 1.0
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    check_val_every_n_epoch: int = 1
    num_sanity_val_steps: int = 2
    use_distributed_sampler: bool = True
    seed: int | None = None
    deterministic: bool = False
    ckpt_read: str = "every_rank"
    nonfinite_loss: str = "raise"
    uneven_inputs: str = "check"
    max_restarts: int = 0
    recovery: str = "checkpoint"
    preemption_signal: str | None = "SIGTERM"
    # A bool or a number of batches (Lightning's `fast_dev_run=True` or `=7`).
    fast_dev_run: bool | int = False
    overfit_batches: int | float = 0.0


@dataclass
class AutoStrategyConf:
    """``strategy=auto``: one device for one process, `BucketedDDP` for several (the Trainer's default)."""

    _target_: str = "syncline.strategies.registry.resolve_strategy"
    strategy: str = "auto"
    devices: int = II("trainer.devices")


@dataclass
class SingleDeviceConf:
    """``strategy=single``: `strategies.SingleDevice`."""

    _target_: str = "syncline.strategies.single_device.SingleDevice"
    device: str | None = None


@dataclass
class BucketedDDPConf:
    """``strategy=bucketed_ddp``: `strategies.BucketedDDP`, syncline's implementation of the DDP paper."""

    _target_: str = "syncline.strategies.bucketed_ddp.BucketedDDP"
    # A number of MiB, or "auto" (OmegaConf 2.3 has no float-or-str type; BucketedDDP checks the value).
    bucket_cap_mb: Any = 25.0
    first_bucket_mb: float = 1.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool = True
    comm_hook: str | None = None
    backend: str | None = None
    timeout: float = 300.0
    overlap: bool = True
    static_graph: bool = False
    # A list of MiB (the constructor's default is a tuple; BucketedDDP checks every value).
    autotune_caps_mb: Any = (1.0, 5.0, 25.0, 100.0)
    autotune_steps: int = 2
    deferred_update: bool = False
    deferred_hold: float = 0.5


@dataclass
class NativeDDPConf:
    """``strategy=native_ddp``: `strategies.NativeDDP`, torch's `DistributedDataParallel` as reference."""

    _target_: str = "syncline.strategies.native_ddp.NativeDDP"
    backend: str | None = None
    timeout: float = 300.0
    # torch's relaxations: None, "powersgd" or "post_local_sgd" (strategy=native_ddp_powersgd, ...).
    comm_hook: str | None = None
    powersgd_rank: int = 4
    start_iter: int | None = None
    averaging_period: int = 4
    # Passed through to DistributedDataParallel, with torch's defaults.
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    static_graph: bool = False


@dataclass
class ByteGradConf:
    """``strategy=bytegrad``: `strategies.ByteGrad`, BAGUA's 8-bit scatter-reduce of gradient buckets."""

    _target_: str = "syncline.strategies.bytegrad.ByteGrad"
    bucket_cap_mb: float = 25.0
    error_feedback: bool = True
    find_unused_parameters: bool = False
    comm_thread: bool = True
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class PowerSGDConf:
    """``strategy=powersgd``: `strategies.PowerSGD`, low-rank factors per matrix gradient."""

    _target_: str = "syncline.strategies.powersgd.PowerSGD"
    rank: int = 4
    start_iter: int = 10
    error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = 2.0
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class QAdamConf:
    """``strategy=qadam``: `strategies.QAdam`, Adam warm-up, then frozen variance and 8-bit momentum."""

    _target_: str = "syncline.strategies.qadam.QAdam"
    warmup_steps: int = 100
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class LocalSGDConf:
    """``strategy=local_sgd``: `strategies.LocalSGD`, post-local SGD (parameters averaged every `period` steps)."""

    _target_: str = "syncline.strategies.local_sgd.LocalSGD"
    period: int = 4
    warmup_steps: int = 0
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class DecentralizedConf:
    """``strategy=decentralized``: `strategies.Decentralized`, D-PSGD (averaging with peers only)."""

    _target_: str = "syncline.strategies.decentralized.Decentralized"
    peers: str = "shift_one"
    period: int = 1
    compression: str | None = None
    prefetch: bool = False
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class AsyncModelAverageConf:
    """``strategy=async_model_average``: `strategies.AsyncModelAverage`, BAGUA's asynchronous averaging."""

    _target_: str = "syncline.strategies.async_model_average.AsyncModelAverage"
    interval_ms: float = 100.0
    warmup_steps: int = 0
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class TensorFusionConf:
    """``strategy=tensor_fusion``: `strategies.TensorFusion`, Horovod's negotiated, dynamically fused all-reduce."""

    _target_: str = "syncline.strategies.tensor_fusion.TensorFusion"
    fusion_threshold_mb: float = 64.0
    cycle_time_ms: float = 5.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0


@dataclass
class ParameterServerConf:
    """``strategy=parameter_server``: `strategies.ParameterServer`, gradients reduced to one rank that steps."""

    _target_: str = "syncline.strategies.parameter_server.ParameterServer"
    server_rank: int = 0
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0
    prefetch: bool = False


@dataclass
class ShardedParameterServerConf:
    """``strategy=sharded_parameter_server``: `strategies.ShardedParameterServer`, each rank steps its slice."""

    _target_: str = "syncline.strategies.sharded_parameter_server.ShardedParameterServer"
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    backend: str | None = None
    timeout: float = 300.0
    prefetch: bool = False


@dataclass
class NativeDDPPowerSGDConf(NativeDDPConf):
    """``strategy=native_ddp_powersgd``: torch's DDP with torch's PowerSGD hook, at `powersgd`'s defaults."""

    comm_hook: str | None = "powersgd"


@dataclass
class NativeDDPPostLocalSGDConf(NativeDDPConf):
    """``strategy=native_ddp_post_local_sgd``: torch's post-local SGD hook and averager, at `local_sgd`'s defaults."""

    comm_hook: str | None = "post_local_sgd"


#: Registered configs that are options of a registered strategy, not strategies of their own.
VARIANT_CONFS: dict[str, type] = {
    "native_ddp_powersgd": NativeDDPPowerSGDConf,
    "native_ddp_post_local_sgd": NativeDDPPostLocalSGDConf,
}

#: The config of each strategy, by the name it has in `strategies.STRATEGIES` ("auto" is the Trainer's).
STRATEGY_CONFS: dict[str, type] = {
    "auto": AutoStrategyConf,
    "single": SingleDeviceConf,
    "bucketed_ddp": BucketedDDPConf,
    "native_ddp": NativeDDPConf,
    "bytegrad": ByteGradConf,
    "powersgd": PowerSGDConf,
    "qadam": QAdamConf,
    "local_sgd": LocalSGDConf,
    "decentralized": DecentralizedConf,
    "async_model_average": AsyncModelAverageConf,
    "tensor_fusion": TensorFusionConf,
    "parameter_server": ParameterServerConf,
    "sharded_parameter_server": ShardedParameterServerConf,
}


@dataclass
class SynclineConf:
    """The whole run: what to train (`task`), how (`trainer`, `strategy`), who watches (`callbacks`).

    `seed` seeds python, numpy and torch before the task is built; `trainer.seed` follows it unless set.
    `ckpt_path` resumes from a checkpoint ("last": the newest ``last*.ckpt`` under the run directory).
    """

    task: Any = MISSING
    #: The `DataModule` (``_target_`` and its arguments) that `fit` takes the data from; None: the task's own.
    data: Any = None
    strategy: Any = MISSING
    trainer: TrainerConf = field(default_factory=TrainerConf)
    callbacks: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    ckpt_path: str | None = None


def register_configs() -> None:
    """Store the run's schema and every registered strategy's config in Hydra's ConfigStore."""
    store = ConfigStore.instance()
    store.store(name="syncline_schema", node=SynclineConf)
    for name, conf in STRATEGY_CONFS.items():
        # A config whose class is not registered (yet) would only fail later, at instantiation.
        if name == "auto" or name in STRATEGIES:
            store.store(group="strategy", name=name, node=conf)
    for name, conf in VARIANT_CONFS.items():
        store.store(group="strategy", name=name, node=conf)


register_configs()
