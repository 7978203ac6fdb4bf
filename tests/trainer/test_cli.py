"""`python -m syncline`: a short run writes its outputs, resumes, and bad input fails in a few lines."""

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import get_object
from omegaconf import OmegaConf

from syncline.strategies import STRATEGIES
from syncline.trainer import Trainer
from syncline.trainer.cli import check_overrides
from syncline.trainer.config import TrainerConf, strategy_configs

#: A run of a few seconds: a one-layer model on a little text, validated (and checkpointed) every 3 steps.
SMALL = [
    "task.n_layer=1",
    "task.n_embd=32",
    "task.n_head=2",
    "task.max_chars=40000",
    "task.sample_chars=20",
    "trainer.limit_val_batches=2",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=1",
]


def _cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "syncline", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_short_run_writes_logs_checkpoints_and_resolved_config(tmp_path):
    out = tmp_path / "run"
    result = _cli(f"hydra.run.dir={out}", "trainer.max_steps=3", *SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sample after 3 steps" in result.stdout

    config = OmegaConf.load(out / "config.yaml")
    assert config.trainer.max_steps == 3
    assert config.trainer.seed == config.seed == 1234  # resolved, not "${seed}"
    assert config.task._target_ == "syncline.examples.char_gpt.CharGPT"
    log_dir = out / "lightning_logs" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert (log_dir / "checkpoints" / "last.ckpt").is_file()

    # Resuming from it, bit-exactly and in the same log version: tests/trainer/test_cli_resume.py.


def test_two_devices_share_one_output_directory_and_config(tmp_path):
    """`trainer.devices=2` launches two workers from the one Hydra job: one run dir, one config, one log dir.

    With a relaxed strategy and its options from the command line, whose replicas differ between averagings.
    """
    out = tmp_path / "run"
    strategy = ["strategy=local_sgd", "strategy.period=2", "strategy.warmup_steps=1"]
    result = _cli(
        f"hydra.run.dir={out}",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "trainer.max_steps=3",
        *strategy,
        *SMALL,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("sample after 3 steps") == 1  # rank 0 alone prints
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert len(list(out.rglob("config.yaml"))) == 2  # ours, and Hydra's own under .hydra/
    assert [p.name for p in (out / "lightning_logs").iterdir()] == ["version_0"]
    checkpoint = torch.load(out / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["progress"]["global_step"] == 3
    assert len(checkpoint["rng"]) == 2  # both ranks' random streams
    assert checkpoint["strategy"]["name"] == "local_sgd"
    assert len(checkpoint["replicas_by_rank"]) == 2  # step 3 is inside a period: both replicas kept


def _assert_short_error(result: subprocess.CompletedProcess, code: int, *expected: str) -> None:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 4, result.stderr
    for text in expected:
        assert text in result.stderr


def test_misspelled_key_names_it_and_suggests_the_right_one(tmp_path):
    result = _cli("trainer.max_epochz=1", cwd=tmp_path, timeout=60)
    _assert_short_error(result, 2, "max_epochz", "Did you mean 'max_epochs'?")
    assert not (tmp_path / "outputs").exists()


def test_unknown_strategy_lists_the_valid_ones(tmp_path):
    result = _cli("strategy=does_not_exist", cwd=tmp_path, timeout=60)
    _assert_short_error(result, 2, "does_not_exist", *sorted(STRATEGIES))


def test_the_documented_list_of_strategy_options_is_the_registry():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    line = next(line for line in docs.splitlines() if line.startswith("Valid strategy options: "))
    assert line.removeprefix("Valid strategy options: ").split(", ") == sorted({*STRATEGIES, "auto"})


def test_value_of_the_wrong_type_names_the_key(tmp_path):
    result = _cli("trainer.max_epochs=abc", cwd=tmp_path, timeout=60)
    _assert_short_error(result, 2, "trainer.max_epochs=abc", "Integer")


def test_value_the_trainer_rejects_is_one_line(tmp_path):
    result = _cli(f"hydra.run.dir={tmp_path / 'run'}", "trainer.devices=two", *SMALL, cwd=tmp_path, timeout=60)
    _assert_short_error(result, 2, "trainer.devices=two", "devices must be an int >= 1")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.devices=two", "bad value for trainer.devices=two: Trainer(devices='two'): devices must be an int"),
        ("trainer.precision=64", "bad value for trainer.precision=64: Unknown precision 64. Valid values: 32,"),
        ("trainer.max_steps=-7", "bad value for trainer.max_steps=-7: Trainer(max_steps=-7)"),
        ("trainer.val_check_interval=1.5", "bad value for trainer.val_check_interval=1.5:"),
        ("trainer.gradient_clip_algorithm=l2", "bad value for trainer.gradient_clip_algorithm=l2:"),
    ],
)
def test_trainer_values_are_checked_as_task_arguments_are(override, expected):
    """In-process: the same check `main` runs before Hydra starts (the command line's exit 2 is tested above)."""
    problem = check_overrides([override])
    assert problem is not None and problem.startswith("error: ") and expected in problem, problem
    assert check_overrides(["trainer.devices=2", "trainer.precision=bf16-mixed", "trainer.max_steps=5"]) is None


def test_missing_checkpoint_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.ckpt"
    result = _cli(f"hydra.run.dir={tmp_path / 'run'}", f"ckpt_path={missing}", *SMALL, cwd=tmp_path, timeout=60)
    _assert_short_error(result, 1, str(missing), "CheckpointNotFoundError", "Checkpoint file not found")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["task.n_layr=2"], ["'task.n_layr'", "Did you mean 'n_layer'?"]),
        (["sed=3"], ["Did you mean 'seed'?", "Config groups"]),
        (["strategy=bucketed_ddp", "strategy.bucket_cap=5"], ["Did you mean 'bucket_cap_mb'?"]),
        (["callbacks=[checkpoint,early_stoping]"], ["Did you mean 'early_stopping'?", "lr_monitor"]),
        (["trainer.val_check_interval=often"], ["trainer.val_check_interval=often"]),
        (["a=b=c"], ["cannot parse 'a=b=c'"]),
    ],
)
def test_check_overrides_explains_what_is_wrong(overrides, expected):
    message = check_overrides(overrides)
    assert message is not None
    for text in expected:
        assert text in message


def test_check_overrides_accepts_valid_overrides():
    assert check_overrides([]) is None
    assert check_overrides(["strategy=bucketed_ddp", "strategy.bucket_cap_mb=5", "trainer.max_epochs=3"]) is None
    assert check_overrides(["callbacks=[checkpoint,early_stopping]", "callbacks.early_stopping.patience=5"]) is None
    assert check_overrides(["hydra.run.dir=somewhere", "seed=null", "trainer.limit_val_batches=0.5"]) is None


def test_trainer_conf_has_every_trainer_argument_with_its_default():
    objects = {"self", "strategy", "callbacks"}
    parameters = {
        name: p.default for name, p in inspect.signature(Trainer.__init__).parameters.items() if name not in objects
    }
    fields = {f.name: f.default for f in dataclasses.fields(TrainerConf)}
    assert fields.keys() == parameters.keys()
    for name, default in parameters.items():
        # The config spells precision as a string; the Trainer takes either.
        assert fields[name] == default or str(fields[name]) == str(default), name


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_registered_strategy_has_a_config_matching_its_constructor(name):
    conf = strategy_configs()[name]
    options = {f.name: f.default for f in dataclasses.fields(conf) if f.name != "_target_"}
    assert get_object(conf._target_) is STRATEGIES[name]
    signature = inspect.signature(STRATEGIES[name].__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    for option, default in options.items():
        if option in signature:
            assert signature[option].default == default, option
        else:
            assert takes_any, f"{name} has no argument {option!r}"
