"""`python -m syncline` / `syncline`: compose the Hydra config, build the task and the Trainer, and fit.

The overrides are checked by composing the config once before Hydra runs, so that a misspelled key, an
unknown option or a value of the wrong type ends in a few lines naming what is wrong and what is valid,
with exit code 2, instead of a traceback. Errors while building or training end the same way (exit
code 2 for bad arguments, 1 for failures at run time, 75 for a run stopped by a preemption signal or
Ctrl-C after writing ``last.ckpt``); ``HYDRA_FULL_ERROR=1`` shows the full traceback.

Everything here runs once, in the process the user started: with ``trainer.devices=N`` the Trainer
launches the worker processes itself, so there is one output directory and one resolved config.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
import inspect
import io
import os
import re
import sys
import traceback
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra import compose, initialize_config_module
from hydra._internal.utils import _locate, get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException, MissingConfigException, OverrideParseException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from syncline.checkpoint_file import CheckpointError
from syncline.options import OptionError
from syncline.rank_zero import rank_zero_only
from syncline.trainer.arguments import check_options, resolve_devices
from syncline.trainer.config import TrainerConf  # importing it registers the structured configs in Hydra
from syncline.trainer.launcher import WorkerFailedError
from syncline.trainer.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from syncline.trainer.seed import seed_everything
from syncline.trainer.trainer import Trainer

__all__ = [
    "RUNTIME_ERROR",
    "USAGE_ERROR",
    "check_overrides",
    "constructor_keys",
    "main",
    "run",
    "task_by_target",
]

#: Exit code of a bad command line or bad argument values.
USAGE_ERROR = 2
#: Exit code of a failure while training.
RUNTIME_ERROR = 1

_CONFIG_MODULE = "syncline.trainer.conf"
_CONFIG_NAME = "config"
#: Command-line keys that select an option of a config group rather than set a value.
_GROUPS = ("task", "data", "strategy", "callbacks")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line: check the overrides in `argv` (default: ``sys.argv[1:]``), then train."""
    # As `python -m` does: a task or DataModule module in the working directory imports from the
    # `syncline` console script too (its sys.path[0] is the script's folder, not the working directory).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = constructor_keys(task_by_target(list(sys.argv[1:] if argv is None else argv)))
    problem = check_overrides(args)
    if problem is not None:
        _exit(problem, USAGE_ERROR)
    # hydra.main parses sys.argv itself.
    sys.argv = [sys.argv[0], *args]
    _hydra_main()


def task_by_target(args: Sequence[str]) -> list[str]:
    """Let ``task._target_=module.Class`` replace the default task, arguments and all.

    Without a ``task=<option>`` choice, the default task's YAML would stay merged in and its arguments
    (``n_layer``, ...) would reach the user's class. The default group is dropped (Hydra's ``~task``, put
    before the first ``task.`` override), so the class's own defaults apply to whatever is not given;
    `constructor_keys` then adds the new node's keys. ``data._target_=...`` needs nothing: the `data`
    group has no default.
    """
    keys = [arg.partition("=")[0].lstrip("+") for arg in args]
    if "task._target_" not in keys or "task" in (key.lstrip("~") for key in keys):
        return list(args)
    first = next(i for i, key in enumerate(keys) if key.startswith("task."))
    return [*args[:first], "~task", *args[first:]]


def constructor_keys(args: Sequence[str]) -> list[str]:
    """Let ``task.<key>=<value>`` (and ``data.<key>=...``) set any argument of the class's constructor.

    A task option's YAML lists only some of the arguments; Hydra would refuse the others as keys not in
    the config. They are rewritten to ``++task.<key>=<value>`` (add or override), and `check_overrides`
    checks every key and value against the constructor's signature instead.
    """
    rewritten = []
    for arg in args:
        key, sep, _ = arg.partition("=")
        plain = sep and not key.startswith(("+", "~")) and key.split(".", 1)[0] in ("task", "data") and "." in key
        rewritten.append("++" + arg if plain else arg)
    return rewritten


def check_overrides(args: Sequence[str]) -> str | None:
    """Compose the config with `args` and return what is wrong with them, or None if nothing is.

    Hydra's own flags are understood: ``--config-dir`` adds the user's config folder to the search path,
    ``--config-name`` picks the primary config, ``--cfg``/``--resolve``/``--package`` are checked like a run.
    Help, shell completion and multirun sweeps (whose values are lists to expand) are left to Hydra.
    """
    try:
        line = _CommandLine.parse(args)
    except SystemExit:
        return None  # argparse has printed its own usage error; hydra.main will print it again and exit.
    if line is None:
        return None
    try:
        cfg = line.compose()
        problem = _check_target_keys(cfg, "task") or _check_target_keys(cfg, "data") or _check_trainer_values(cfg)
    except Exception as error:
        return _describe(error, line)
    return problem


@hydra.main(version_base="1.3", config_path="conf", config_name=_CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig, output_dir: str) -> None:
    """Save the resolved `cfg` under `output_dir`, build everything it describes, and fit."""
    _save_config(cfg, Path(output_dir) / "config.yaml")
    _announce_settings(cfg)
    try:
        task, datamodule, fit_trainer = _build(cfg, output_dir)
    except (InstantiationException, ValueError, TypeError) as error:
        _fail(error, USAGE_ERROR)
    try:
        fit_trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except KeyboardInterrupt:
        _exit("interrupted.", 130)
    except TrainingPreempted as stop:
        if stop.announced:  # rank 0 has said what it saved and where
            raise SystemExit(PREEMPTED_EXIT_CODE) from None
        _exit(f"preempted: {stop}", PREEMPTED_EXIT_CODE)
    except WorkerFailedError as error:
        # Its message is already the one report: the rank, its exception and its traceback.
        _exit(f"error: {error}\n{_HINT}", RUNTIME_ERROR)
    except CheckpointError as error:
        _fail(error, RUNTIME_ERROR, where=False)
    except Exception as error:
        _fail(error, RUNTIME_ERROR)


def _build(cfg: DictConfig, output_dir: str) -> tuple[Any, Any, Trainer]:
    """Seed, then instantiate the task, the DataModule (if any), the strategy, the callbacks and the Trainer."""
    trainer_kwargs: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    if trainer_kwargs["seed"] is not None:
        # Before the task is built, so that its initial weights follow from the seed.
        seed_everything(trainer_kwargs["seed"])
    task = instantiate(cfg.task)
    datamodule = instantiate(cfg.data) if cfg.get("data") is not None else None
    strategy = instantiate(cfg.strategy)
    callbacks = [instantiate(callback) for callback in cfg.callbacks.values()]
    if trainer_kwargs["default_root_dir"] is None:
        trainer_kwargs["default_root_dir"] = output_dir
    trainer = Trainer(**trainer_kwargs, strategy=strategy, callbacks=callbacks)
    # Options that cannot work on this many processes fail here, in one line, before any worker starts.
    trainer.strategy.check_world_size(int(os.environ.get("WORLD_SIZE", trainer.devices)))
    return task, datamodule, trainer


@rank_zero_only
def _announce_settings(cfg: DictConfig) -> None:
    """Print the `trainer` settings that differ from the Trainer's defaults (the task's config may set some)."""
    given: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    defaults = dataclasses.asdict(TrainerConf())
    changed = [f"{key}={value}" for key, value in given.items() if key in defaults and value != defaults[key]]
    if changed:
        print(f"syncline: trainer settings other than the Trainer's defaults: {', '.join(changed)}", flush=True)


@rank_zero_only
def _save_config(cfg: DictConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path, resolve=True)


# ------------------------------------------------------------------ composing
@dataclass(frozen=True)
class _CommandLine:
    """The parts of a command line that decide what is composed: the overrides and Hydra's config flags."""

    overrides: tuple[str, ...]
    config_name: str = _CONFIG_NAME
    #: Extra overrides that stand for flags, e.g. ``hydra.searchpath=[file://<abs dir>]`` for --config-dir.
    flags: tuple[str, ...] = ()
    config_dir: str | None = None

    @classmethod
    def parse(cls, args: Sequence[str]) -> _CommandLine | None:
        """Read `args` as hydra.main would; None where nothing can be checked before Hydra runs."""
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = get_args_parser().parse_args(list(args))
        if parsed.help or parsed.hydra_help or parsed.shell_completion or parsed.info or parsed.multirun:
            return None
        if parsed.config_path is not None or parsed.experimental_rerun is not None:
            return None  # a primary config somewhere else entirely: Hydra reports its own errors
        flags: tuple[str, ...] = ()
        searchpath_given = any(o.partition("=")[0].lstrip("+") == "hydra.searchpath" for o in parsed.overrides)
        if parsed.config_dir is not None and not searchpath_given:
            flags = (f"hydra.searchpath=[file://{Path(parsed.config_dir).resolve()}]",)
        return cls(tuple(parsed.overrides), parsed.config_name or _CONFIG_NAME, flags, parsed.config_dir)

    def compose(self, overrides: Sequence[str] | None = None) -> DictConfig:
        """Compose the config with `overrides` (default: this command line's) and the flags' overrides."""
        with _hydra_context():
            # With the hydra node, so `hydra.run.dir=...` and friends are checked too.
            chosen = self.overrides if overrides is None else overrides
            return compose(self.config_name, overrides=[*self.flags, *chosen], return_hydra_config=True)

    def group_options(self, group: str) -> list[str]:
        """Return the options of config group `group` (YAML files, the user's folder, ConfigStore entries)."""
        with _hydra_context():
            options = set(GlobalHydra.instance().config_loader().get_group_options(group))
        if self.config_dir is not None:
            options.update(path.stem for path in Path(self.config_dir, group).glob("*.yaml"))
        return sorted(options)


@contextlib.contextmanager
def _hydra_context() -> Iterator[None]:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=_CONFIG_MODULE, version_base="1.3"):
            yield
    finally:
        GlobalHydra.instance().clear()


def _check_target_keys(cfg: DictConfig, group: str) -> str | None:
    """Check the keys of `group` ("task" or "data") against its class's constructor, so a typo is caught
    before anything runs; the task is required, the DataModule is not."""
    target = OmegaConf.select(cfg, f"{group}._target_")
    if group == "data" and OmegaConf.select(cfg, "data") is None:
        return None
    if not isinstance(target, str):
        return f"error: the config has no {group}._target_. " + (_TASK_HINT if group == "task" else _DATA_HINT)
    try:
        task_class = _locate(target)
    except Exception as error:
        # _locate's message: "Error loading '<path>':", the import error, "Are you sure that ...?"
        reason = " ".join(line.strip() for line in str(error).strip().splitlines()[1:]) or str(error)
        return (
            f"error: cannot import {group}._target_={target}: {reason}\n"
            "The module must be importable from the working directory (or PYTHONPATH)."
        )
    try:
        parameters = inspect.signature(task_class).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    valid = sorted(name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
    for key in cfg[group]:
        if not str(key).startswith("_") and key not in valid:
            return (
                f"error: unknown key '{group}.{key}': {target} takes no argument {key!r}."
                f"{_did_you_mean(str(key), valid)}\nValid keys under '{group}': {', '.join(valid)}"
            )
    return _check_argument_types(cfg, group, target, task_class)


def _check_trainer_values(cfg: DictConfig) -> str | None:
    """Check the `trainer` values as the task's are (against `Trainer.__init__`'s annotations), then with the
    Trainer's own option checks, so a bad value is one line before anything is built or saved."""
    problem = _check_argument_types(cfg, "trainer", "Trainer", Trainer)
    if problem is not None:
        return problem
    parameters = inspect.signature(Trainer).parameters
    given = OmegaConf.to_container(cfg.trainer, resolve=True)
    options = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
    options.update((key, value) for key, value in given.items() if key in parameters)  # type: ignore[union-attr]
    try:
        check_options(options)
        resolve_devices(options["devices"], options["accelerator"])
    except OptionError as error:
        named = re.match(r"Trainer\((\w+)=", str(error))
        mentioned = [key for key in given if re.search(rf"\b{key}\b", str(error))]  # type: ignore[union-attr]
        key = named.group(1) if named else (mentioned[0] if mentioned else "")
        shown = f" for trainer.{key}={given[key]}" if key in given else ""  # type: ignore[operator,index]
        return f"error: bad value{shown}: {error}"
    return None


def _check_argument_types(cfg: DictConfig, group: str, target: str, task_class: Any) -> str | None:
    """Check each value of `group` against its constructor argument's annotation (where one can be read)."""
    try:
        hints = typing.get_type_hints(task_class.__init__)
        values = OmegaConf.to_container(cfg[group], resolve=True)
    except Exception:
        return None  # annotations that cannot be resolved here are left to the constructor
    for key, value in values.items():  # type: ignore[union-attr]
        if key in hints and _fits(value, hints[key]) is False:
            shown = getattr(hints[key], "__name__", None) or str(hints[key]).replace("typing.", "")
            return (
                f"error: bad value for {group}.{key}={value}: {target} takes {key}: {shown}, "
                f"not {type(value).__name__} {value!r}."
            )
    return None


def _fits(value: Any, annotation: Any) -> bool | None:
    """Whether a config `value` fits `annotation`: True, False, or None where it cannot be told."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    if isinstance(value, dict) and "_target_" in value:
        return None  # an object Hydra builds
    if origin in (typing.Union, types.UnionType):
        fits = [_fits(value, arg) for arg in args]
        return True if True in fits else (None if None in fits else False)
    if origin is typing.Literal:
        return value in args
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, collections.abc.Sequence) or annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin in (dict, collections.abc.Mapping) or annotation is dict:
        return isinstance(value, dict)
    return None


def _describe(error: Exception, line: _CommandLine) -> str:
    """Turn a composition error into a short message that names the problem and the valid choices."""
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    if isinstance(error, OverrideParseException):
        return f"error: cannot parse {error.override!r}: {error.message.splitlines()[0]}\n{_GRAMMAR}"
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        return _describe_missing_option(str(error.missing_cfg_file), line)
    if isinstance(cause, ValidationError):
        return _describe_bad_value(cause, line.overrides)
    if isinstance(cause, (ConfigKeyError, AttributeError)) and getattr(cause, "full_key", None):
        return _describe_unknown_key(cause.full_key, line)
    return "error: " + str(error).strip().splitlines()[0]


def _describe_missing_option(missing: str, line: _CommandLine) -> str:
    group, _, option = missing.rpartition("/")
    options = line.group_options(group) if group else []
    if not options:
        return f"error: no config {missing!r}."
    message = (
        f"error: unknown {group} option {option!r}.{_did_you_mean(option, options)}\n"
        f"Valid {group} options: {', '.join(options)}"
    )
    if group in ("task", "data", "callbacks"):
        if line.config_dir is None:
            message += f"\nAn option of your own: <folder>/{group}/{option}.yaml, with --config-dir <folder>"
        else:
            message += f"\nNo file {Path(line.config_dir, group, option + '.yaml')} (from --config-dir)"
        if group in ("task", "data"):
            message += f"; or name the class: {group}._target_=<module>.<Class>"
    return message


def _describe_bad_value(error: ValidationError, args: Sequence[str]) -> str:
    key = str(error.full_key or "")
    given = _given_value(key, args)
    reason = str(error.msg or error).strip().splitlines()[0]
    return f"error: bad value for {key}{f'={given}' if given is not None else ''}: {reason}"


def _describe_unknown_key(full_key: str, line: _CommandLine) -> str:
    parent, _, name = full_key.rpartition(".")
    valid = _valid_keys(parent, line)
    message = f"error: unknown key {full_key!r}."
    if valid:
        where = f"under '{parent}'" if parent else "at the top level"
        message += f"{_did_you_mean(name, valid)}\nValid keys {where}: {', '.join(valid)}"
    if not parent:
        message += f"\nConfig groups: {', '.join(_GROUPS)} (choose an option with e.g. strategy=single)"
    return message


def _valid_keys(parent: str, line: _CommandLine) -> list[str]:
    """Return the keys of the config node `parent` under the group choices made on the command line."""
    choices = [arg for arg in line.overrides if arg.split("=", 1)[0].lstrip("+~") in _GROUPS]
    try:
        cfg = line.compose(choices)
    except Exception:
        cfg = line.compose([])
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
_TASK_HINT = "Choose one with task=<option> (--config-dir <folder> for your own) or task._target_=<module>.<Class>."
_DATA_HINT = "Choose one with data=<option> (--config-dir <folder>) or data._target_=<module>.<Class>."
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
    _exit(message, code)  # one line (and where it was raised); docs/cli.md names HYDRA_FULL_ERROR=1


def _exit(message: str, code: int) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    # SystemExit is not an Exception, so Hydra's job runner lets it through with this exit code.
    raise SystemExit(code)
