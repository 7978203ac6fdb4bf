"""Options are checked when they are given: one message naming the option, the value and what is allowed."""

from __future__ import annotations

import inspect
import math

import pytest

from syncline.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint, ProgressBar, TensorBoardLogger
from syncline.options import OptionError, check_int, check_number
from syncline.strategies import STRATEGIES, AsyncModelAverage, BucketedDDP, ByteGrad, LocalSGD, NativeDDP
from syncline.trainer import Trainer
from tests.trainer.test_cli import SMALL, _assert_short_error, _cli

BAD = [
    (
        lambda: BucketedDDP(bucket_cap_mb=-1),
        "BucketedDDP(bucket_cap_mb=-1): bucket_cap_mb must be a finite number >= 0",
    ),
    (lambda: BucketedDDP(bucket_cap_mb=math.inf), "BucketedDDP(bucket_cap_mb=inf): bucket_cap_mb must be"),
    (lambda: BucketedDDP(first_bucket_mb=-2), "BucketedDDP(first_bucket_mb=-2): first_bucket_mb must be"),
    (lambda: BucketedDDP(bucket_cap_mb=math.nan), "BucketedDDP(bucket_cap_mb=nan)"),
    (lambda: BucketedDDP(timeout=0), "BucketedDDP(timeout=0): timeout must be a finite number > 0 (seconds"),
    (lambda: NativeDDP(timeout=-1.0), "NativeDDP(timeout=-1.0): timeout must be"),
    (lambda: NativeDDP(bucket_cap_mb=-3), "NativeDDP(bucket_cap_mb=-3): bucket_cap_mb must be"),
    (
        lambda: ByteGrad(error_feedback="no"),
        "ByteGrad(error_feedback='no'): error_feedback must be a bool (True or False), not a str.",
    ),
    (lambda: BucketedDDP(backend="bogus"), "BucketedDDP(backend='bogus'): backend must be None (gloo on CPU, NCCL"),
    (lambda: AsyncModelAverage(backend="bogus"), "AsyncModelAverage(backend='bogus'): backend must be None"),
    (lambda: LocalSGD(period=2, backend="glo"), "LocalSGD(backend='glo'): backend must be None"),
    (
        lambda: NativeDDP(gradient_as_bucket_view="maybe"),
        "NativeDDP(gradient_as_bucket_view='maybe'): gradient_as_bucket_view must be a bool (True or False) (as "
        "in torch's DistributedDataParallel), not a str.",
    ),
    (
        lambda: NativeDDP(find_unused_parameter=True),
        "NativeDDP(find_unused_parameter=True): torch's DistributedDataParallel takes no argument "
        "'find_unused_parameter'; it takes module, device_ids",
    ),
    (lambda: NativeDDP(dim="0"), "NativeDDP(dim='0'): dim must be an int (as in torch's DistributedDataParallel)"),
    (lambda: Trainer(enable_checkpointing="no"), "Trainer(enable_checkpointing='no'): enable_checkpointing must be"),
    (
        lambda: Trainer(num_sanity_val_steps=-5),
        "Trainer(num_sanity_val_steps=-5): num_sanity_val_steps must be an int >= -1",
    ),
    (
        lambda: Trainer(limit_val_batches=-1),
        "Trainer(limit_val_batches=-1): limit_val_batches must be None or an int >= 0",
    ),
    (lambda: Trainer(limit_train_batches=-0.5), "Trainer(limit_train_batches=-0.5): limit_train_batches must be"),
    (lambda: Trainer(seed=-3), "Trainer(seed=-3): seed must be None or an int >= 0"),
    (lambda: Trainer(log_every_n_steps=0), "Trainer(log_every_n_steps=0): log_every_n_steps must be an int >= 1"),
    (lambda: Trainer(gradient_clip_val="1"), "Trainer(gradient_clip_val='1'): gradient_clip_val must be None or"),
    (lambda: Trainer(val_check_interval=0), "Trainer(val_check_interval=0): val_check_interval must be an int >= 1"),
    (lambda: Trainer(val_check_interval=True), "Trainer(val_check_interval=True)"),
    (lambda: Trainer(ckpt_read="rank0"), "Trainer(ckpt_read='rank0'): ckpt_read must be one of every_rank, rank_zero"),
    (lambda: ModelCheckpoint(save_top_k=-2), "ModelCheckpoint(save_top_k=-2): save_top_k must be an int >= -1"),
    (lambda: ModelCheckpoint(every_n_train_steps=-1), "ModelCheckpoint(every_n_train_steps=-1)"),
    (lambda: EarlyStopping("loss", patience=-1), "EarlyStopping(patience=-1): patience must be an int >= 0"),
    (lambda: EarlyStopping("loss", min_delta=-0.1), "EarlyStopping(min_delta=-0.1): min_delta must be"),
    (lambda: ProgressBar(refresh_rate=-1), "ProgressBar(refresh_rate=-1): refresh_rate must be an int >= 0"),
    (lambda: CSVLogger(".", version=-1), "CSVLogger(version=-1): version must be None or an int >= 0"),
    (lambda: TensorBoardLogger(".", version=1.5), "TensorBoardLogger(version=1.5)"),
]


@pytest.mark.parametrize(("make", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_option_fails_in_the_constructor(make, message):
    with pytest.raises(OptionError) as raised:
        make()
    assert str(raised.value).startswith(message), str(raised.value)


def test_every_flag_of_every_strategy_and_of_the_trainer_refuses_a_truthy_string():
    """A bool option given "no" (Hydra, a YAML file, a typo) is refused, never taken as True."""
    checked = []
    for owner in sorted({*STRATEGIES.values(), Trainer}, key=lambda cls: cls.__name__):
        for name, parameter in inspect.signature(owner.__init__).parameters.items():
            if parameter.annotation not in (bool, "bool"):
                continue
            with pytest.raises(OptionError, match=rf"^{owner.__name__}\({name}='no'\): {name} must be a bool"):
                owner(**{name: "no"})
            checked.append(f"{owner.__name__}.{name}")
    assert "ByteGrad.error_feedback" in checked and "Trainer.deterministic" in checked, checked
    assert len(checked) >= 20, checked


def test_option_error_is_a_value_error():
    """Code catching ValueError from these constructors keeps working."""
    assert issubclass(OptionError, ValueError)


def test_good_values_pass():
    check_int("X", "n", 0, 0)
    check_int("X", "n", None, 1, none_ok=True)
    check_number("X", "f", 1, above=0)
    check_number("X", "f", 0.0, minimum=0)
    BucketedDDP(bucket_cap_mb=0.5, first_bucket_mb=0.1, timeout=1)
    BucketedDDP(bucket_cap_mb=0, first_bucket_mb=0)  # as in torch's DDP: one parameter per bucket
    BucketedDDP(backend="cpu:gloo,cuda:nccl", find_unused_parameters=True)
    NativeDDP(static_graph=True, bucket_cap_mb=10, gradient_as_bucket_view=True)
    Trainer(num_sanity_val_steps=-1, limit_val_batches=0.5, limit_train_batches=3, seed=0, logger=False)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("strategy.bucket_cap_mb=-1", "BucketedDDP(bucket_cap_mb=-1): bucket_cap_mb must be a finite number >= 0"),
        ("strategy.timeout=0", "BucketedDDP(timeout=0.0): timeout must be a finite number > 0"),
    ],
)
def test_cli_bad_strategy_option_is_one_line_before_any_process_starts(tmp_path, override, expected):
    args = [
        f"hydra.run.dir={tmp_path / 'run'}",
        "strategy=bucketed_ddp",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        override,
        *SMALL,
    ]
    result = _cli(*args, cwd=tmp_path, timeout=60)
    _assert_short_error(result, 2, expected)


def test_cli_bad_trainer_option_is_one_line(tmp_path):
    result = _cli(
        f"hydra.run.dir={tmp_path / 'run'}", "trainer.num_sanity_val_steps=-5", *SMALL, cwd=tmp_path, timeout=60
    )
    _assert_short_error(result, 2, "Trainer(num_sanity_val_steps=-5): num_sanity_val_steps must be an int >= -1")
