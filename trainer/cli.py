"""`python -m syncline` / `syncline`: compose the Hydra config, build the task and the Trainer, and fit.

The overrides are checked by composing the config once before Hydra runs, so that a misspelled key, an
unknown option or a value of the wrong type ends in a few lines naming what is wrong and what is valid,
with exit code 2, instead of a traceback. Errors while building or training end the same way (exit
code 2 for bad arguments, 1 for failures at run time); ``HYDRA_FULL_ERROR=1`` shows the full traceback.

Everything here runs once, in the process the user started: with ``trainer.devices=N`` the Trainer
launches the worker processes itself, so there is one output directory and one resolved config.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException, MissingConfigException, OverrideParseException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

import syncline.trainer.config  # noqa: F401  (registers the structured configs in Hydra's ConfigStore)
from syncline.trainer.checkpoint import CheckpointError
from syncline.trainer.rank_zero import rank_zero_only
from syncline.trainer.seed import seed_everything
from syncline.trainer.trainer import Trainer

__all__ = ["RUNTIME_ERROR", "USAGE_ERROR", "check_overrides", "main", "run"]

#: Exit code of a bad command line or bad argument values.
USAGE_ERROR = 2
#: Exit code of a failure while training.
RUNTIME_ERROR = 1

_CONFIG_MODULE = "syncline.trainer.conf"
_CONFIG_NAME = "config"
#: Command-line keys that select an option of a config group rather than set a value.
_GROUPS = ("task", "strategy", "callbacks")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line: check the overrides in `argv` (default: ``sys.argv[1:]``), then train."""
    args = list(sys.argv[1:] if argv is None else argv)
    problem = check_overrides(args)
    if problem is not None:
        _exit(problem, USAGE_ERROR)
    # hydra.main parses sys.argv itself.
    sys.argv = [sys.argv[0], *args]
    _hydra_main()


def check_overrides(args: Sequence[str]) -> str | None:
    """Compose the config with `args` and return what is wrong with them, or None if nothing is.

    Arguments with Hydra flags (``--help``, ``--cfg``, ``-m``, ...) are left for Hydra to interpret.
    """
    if any(arg.startswith("-") for arg in args):
        return None
    try:
        _compose(args)
    except Exception as error:
        return _describe(error, args)
    return None


@hydra.main(version_base="1.3", config_path="conf", config_name=_CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig, output_dir: str) -> None:
    """Save the resolved `cfg` under `output_dir`, build everything it describes, and fit."""
    _save_config(cfg, Path(output_dir) / "config.yaml")
    try:
        task, fit_trainer = _build(cfg, output_dir)
    except (InstantiationException, ValueError, TypeError) as error:
        _fail(error, USAGE_ERROR)
    try:
        fit_trainer.fit(task, ckpt_path=cfg.ckpt_path)
    except KeyboardInterrupt:
        _exit("interrupted.", 130)
    except CheckpointError as error:
        _fail(error, RUNTIME_ERROR, where=False)
    except Exception as error:
        _fail(error, RUNTIME_ERROR)


def _build(cfg: DictConfig, output_dir: str) -> tuple[Any, Trainer]:
    """Seed, then instantiate the task, the strategy, the callbacks and the Trainer."""
    trainer_kwargs: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    if trainer_kwargs["seed"] is not None:
        # Before the task is built, so that its initial weights follow from the seed.
        seed_everything(trainer_kwargs["seed"])
    task = instantiate(cfg.task)
    strategy = instantiate(cfg.strategy)
    callbacks = [instantiate(callback) for callback in cfg.callbacks.values()]
    if trainer_kwargs["default_root_dir"] is None:
        trainer_kwargs["default_root_dir"] = output_dir
    return task, Trainer(**trainer_kwargs, strategy=strategy, callbacks=callbacks)


@rank_zero_only
def _save_config(cfg: DictConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path, resolve=True)


# ------------------------------------------------------------------ composing
def _compose(args: Sequence[str]) -> DictConfig:
    with _hydra_context():
        # With the hydra node, so `hydra.run.dir=...` and friends are checked too.
        return compose(_CONFIG_NAME, overrides=list(args), return_hydra_config=True)


def _group_options(group: str) -> list[str]:
    """Return the options of config group `group` (YAML files and ConfigStore entries)."""
    with _hydra_context():
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


@contextlib.contextmanager
def _hydra_context() -> Iterator[None]:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=_CONFIG_MODULE, version_base="1.3"):
            yield
    finally:
        GlobalHydra.instance().clear()


def _describe(error: Exception, args: Sequence[str]) -> str:
    """Turn a composition error into a short message that names the problem and the valid choices."""
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    if isinstance(error, OverrideParseException):
        return f"error: cannot parse {error.override!r}: {error.message.splitlines()[0]}\n{_GRAMMAR}"
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        return _describe_missing_option(str(error.missing_cfg_file))
    if isinstance(cause, ValidationError):
        return _describe_bad_value(cause, args)
    if isinstance(cause, (ConfigKeyError, AttributeError)) and getattr(cause, "full_key", None):
        return _describe_unknown_key(cause.full_key, args)
    return "error: " + str(error).strip().splitlines()[0] + "\n" + _HINT


def _describe_missing_option(missing: str) -> str:
    group, _, option = missing.rpartition("/")
    options = _group_options(group) if group else []
    if not options:
        return f"error: no config {missing!r}.\n{_HINT}"
    return (
        f"error: unknown {group} option {option!r}.{_did_you_mean(option, options)}\n"
        f"Valid {group} options: {', '.join(options)}"
    )


def _describe_bad_value(error: ValidationError, args: Sequence[str]) -> str:
    key = str(error.full_key or "")
    given = _given_value(key, args)
    reason = str(error.msg or error).strip().splitlines()[0]
    return f"error: bad value for {key}{f'={given}' if given is not None else ''}: {reason}"


def _describe_unknown_key(full_key: str, args: Sequence[str]) -> str:
    parent, _, name = full_key.rpartition(".")
    valid = _valid_keys(parent, args)
    message = f"error: unknown key {full_key!r}."
    if valid:
        where = f"under '{parent}'" if parent else "at the top level"
        message += f"{_did_you_mean(name, valid)}\nValid keys {where}: {', '.join(valid)}"
    if not parent:
        message += f"\nConfig groups: {', '.join(_GROUPS)} (choose an option with e.g. strategy=single)"
    return message


def _valid_keys(parent: str, args: Sequence[str]) -> list[str]:
    """Return the keys of the config node `parent` under the group choices made in `args`."""
    choices = [arg for arg in args if arg.split("=", 1)[0].lstrip("+~") in _GROUPS]
    try:
        cfg = _compose(choices)
    except Exception:
        cfg = _compose([])
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return []
    return sorted(str(key) for key in node if key != "hydra" and not str(key).startswith("_"))


def _given_value(key: str, args: Sequence[str]) -> str | None:
    for arg in args:
        name, sep, value = arg.partition("=")
        if sep and name.lstrip("+~") == key:
            return value
    return None


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


# --------------------------------------------------------------------- errors
_HINT = "Set HYDRA_FULL_ERROR=1 for the full traceback."
_GRAMMAR = "Overrides look like key=value, +new_key=value or group=option; see docs/cli.md."


def _fail(error: BaseException, code: int, where: bool = True) -> NoReturn:
    """Exit with one line about `error` (its innermost source line too), or re-raise for HYDRA_FULL_ERROR."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    prefix = ""
    if isinstance(error, InstantiationException) and error.__cause__ is not None:
        # Hydra's message is "Error in call to target '<path>': ..."; report the constructor's own error.
        target = re.search(r"target '([^']+)'", str(error))
        prefix = f"cannot build {target.group(1) if target else 'an object of the config'}: "
        error = error.__cause__
    lines = [line.strip() for line in str(error).strip().splitlines()] or [""]
    # Some messages introduce their substance on the next line ("Error loading 'x':\nAttributeError(...)").
    summary = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    message = f"error: {prefix}{type(error).__name__}: {summary}"
    frames = traceback.extract_tb(error.__traceback__)
    if where and frames and code == RUNTIME_ERROR:
        frame = frames[-1]
        message += f"\n  (raised at {frame.filename}:{frame.lineno} in {frame.name})"
    _exit(f"{message}\n{_HINT}", code)


def _exit(message: str, code: int) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    # SystemExit is not an Exception, so Hydra's job runner lets it through with this exit code.
    raise SystemExit(code)
