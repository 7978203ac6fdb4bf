"""Structured configs for Hydra: the Trainer's arguments and one dataclass per registered strategy.

The packaged YAML in ``trainer/conf`` picks the defaults (task, strategy, callbacks) and the values of
the default run; the dataclasses here give every key a type, so that a misspelled key or a value of the
wrong type is an error before anything runs.

A strategy's config is generated from its constructor (`strategy_config`: its options, their types and
defaults, and their help from its docstring), for every class in `strategies.STRATEGIES` when the CLI
starts: registering a strategy is all it takes to make it selectable as ``strategy=<name>``.
"""

import dataclasses
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

from syncline.options import type_hints
from syncline.strategies.registry import STRATEGIES
from syncline.trainer.trainer import Trainer

__all__ = [
    "VARIANTS",
    "AutoStrategyConf",
    "SynclineConf",
    "TrainerConf",
    "config_of",
    "register_configs",
    "strategy_config",
    "strategy_configs",
]


@dataclass
class AutoStrategyConf:
    """``strategy=auto``: one device for one process, `BucketedDDP` for several (the Trainer's default)."""

    _target_: str = "syncline.strategies.registry.resolve_strategy"
    strategy: str = "auto"
    devices: int = II("trainer.devices")


#: Configs that are a registered strategy with other defaults, not strategies of their own.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "native_ddp_powersgd": ("native_ddp", {"comm_hook": "powersgd"}),
    "native_ddp_post_local_sgd": ("native_ddp", {"comm_hook": "post_local_sgd"}),
}


def strategy_config(cls: type, defaults: dict[str, Any] | None = None, name: str | None = None) -> type:
    """Return the Hydra config of strategy class `cls` (`config_of`), named for ``strategy=<name>``."""
    conf = config_of(cls, f"{name or cls.__name__}Conf", defaults)
    conf.__doc__ = f"``strategy={name or getattr(cls, 'name', cls.__name__)}``: `{cls.__qualname__}`, generated."
    return conf


def config_of(
    cls: type,
    conf_name: str,
    defaults: dict[str, Any] | None = None,
    exclude: tuple[str, ...] = (),
    target: bool = True,
) -> type:
    """Return a config dataclass of `cls`'s constructor options (``_target_`` first, when `target`).

    Every argument of ``cls.__init__`` but `exclude` becomes a field with its default and, for `int`, `float`,
    `bool` and `str` (or a union of them, or None), its type, so a wrong value is an error before anything runs;
    other types (a hook function, a tuple, a logger object) are `Any` and checked by the constructor. An
    argument's help is its line under "Args:" in the class docstring (the field's ``metadata["help"]``).
    Keyword arguments passed on (``**kwargs``) are followed to the base class that takes them; a strategy that
    passes them to another library lists them with their defaults in `passthrough_options`. `defaults`
    overrides some defaults (a variant).
    """
    fields: list[tuple[str, Any, Any]] = [("_target_", str, f"{cls.__module__}.{cls.__qualname__}")] if target else []
    help_of = _args_help(cls)
    for option, (hint, default) in _options(cls).items():
        if option in exclude:
            continue
        if defaults and option in defaults:
            default = defaults[option]
        metadata = {"help": help_of.get(option, "")}
        fields.append((option, _config_type(hint), dataclasses.field(default=default, metadata=metadata)))
    return dataclasses.make_dataclass(conf_name, fields)


def _options(cls: type) -> dict[str, tuple[Any, Any]]:
    """Every option of `cls`'s constructor (name -> (type hint, default)), following ``**kwargs`` up the bases."""
    options: dict[str, tuple[Any, Any]] = {}
    for base in cls.__mro__:
        init = base.__dict__.get("__init__")
        if init is None:
            continue
        hints = type_hints(init)
        takes_more = False
        for option, parameter in inspect.signature(init).parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                takes_more = True
            elif option != "self" and parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
                default = None if parameter.default is inspect.Parameter.empty else parameter.default
                options.setdefault(option, (hints.get(option, Any), default))
        if not takes_more:
            break
    for option, default in getattr(cls, "passthrough_options", {}).items():
        options.setdefault(option, (type(default), default))
    return options


_PLAIN = (int, float, bool, str)


def _config_type(hint: Any) -> Any:
    """The type OmegaConf checks for `hint`: a plain type, or a union of them and None; anything else is Any.

    A union with `float` but not `int` is Any too: OmegaConf's unions do not turn ``5`` into ``5.0``.
    """
    if hint in _PLAIN:
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = typing.get_args(hint)
        plain = [kind for kind in kinds if kind is not type(None)]
        if all(kind in _PLAIN for kind in plain) and (float not in plain or len(plain) == 1 or int in plain):
            return typing.Union[kinds]  # noqa: UP007 (built from a tuple of types)
    return Any


def _args_help(cls: type) -> dict[str, str]:
    """Each argument's help from the "Args:" section of `cls`'s docstring (and its bases', for ``**kwargs``)."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        doc = inspect.getdoc(base) or ""
        if "Args:" not in doc:
            continue
        current = None
        for line in doc.split("Args:", 1)[1].splitlines()[1:]:
            if not line.strip():
                continue
            if not line.startswith(" "):
                break  # the next section (Raises:, ...)
            match = re.match(r"    (\w+)(?: \(.*?\))?: (.*)", line)
            if match:
                current = match.group(1)
                found[current] = match.group(2).strip()
            elif current is not None:
                found[current] += " " + line.strip()
    return found


def strategy_configs() -> dict[str, type]:
    """The config of every registered strategy and variant, by name, generated from `strategies.STRATEGIES`."""
    confs: dict[str, type] = {"auto": AutoStrategyConf}
    confs.update({name: strategy_config(cls, name=_camel(name)) for name, cls in STRATEGIES.items()})
    for name, (base, defaults) in VARIANTS.items():
        confs[name] = strategy_config(STRATEGIES[base], defaults, name=_camel(name))
    return confs


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


#: Every argument of `Trainer` but the objects (`strategy`, `callbacks`), with its default. `default_root_dir` None
#: means the run's Hydra output directory; `logger` True is a TensorBoardLogger under it.
TrainerConf = config_of(Trainer, "TrainerConf", exclude=("strategy", "callbacks"), target=False)


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
    """Store the run's schema and the config of every strategy registered now in Hydra's ConfigStore."""
    store = ConfigStore.instance()
    store.store(name="syncline_schema", node=SynclineConf)
    for name, conf in strategy_configs().items():
        store.store(group="strategy", name=name, node=conf)


register_configs()
