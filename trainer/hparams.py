"""`HyperparametersMixin`: `save_hyperparameters` for the Task and the DataModule, as Lightning's mixin."""

from __future__ import annotations

import inspect
import os
from argparse import Namespace
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any, TypeVar

from torch import nn

from syncline.rank_zero import rank_zero_warn

T = TypeVar("T")

__all__ = ["AttributeDict", "HyperparametersMixin", "build_from_hparams", "read_for_loading"]


class AttributeDict(dict):
    """A dict whose keys read as attributes too: ``hparams.lr`` is ``hparams["lr"]``, as in Lightning."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no hyperparameter {key!r}; saved: {', '.join(map(str, self)) or 'none'}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


class HyperparametersMixin:
    """`save_hyperparameters` and what it records; the class's `__init__` calls `_init_hparams` first."""

    hparams: Any
    hparams_name: str | None
    hparams_logged: bool

    def _init_hparams(self) -> None:
        """Start with no hyperparameters."""
        self.hparams = AttributeDict()
        #: The `__init__` argument `save_hyperparameters` took as the whole hyperparameters (Lightning's
        #: ``hparams_name``), so `load_from_checkpoint` passes them back under that name.
        self.hparams_name = None
        #: Whether the loggers record the hyperparameters (`save_hyperparameters(logger=...)`).
        self.hparams_logged = True

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Sequence[str] | str | None = None,
        frame: FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Record the arguments of `__init__` in `self.hparams`, as Lightning does.

        Without `args`, every argument of every `__init__` of the subclass chain running now is recorded
        (a subclass's value wins over its parent's); names in `args` record only those; one non-string
        argument (a dict, a Namespace, an OmegaConf DictConfig) becomes `hparams` itself (a DictConfig stays
        one). Modules and other objects are kept (a module with Lightning's warning to `ignore` it). They are
        logged by the loggers (unless `logger` is False) and stored in checkpoints.

        Args:
            args: names of arguments to record, or one object to use as the hyperparameters.
            ignore: names of arguments to leave out.
            frame: the frame of the `__init__` to read (default: the caller's).
            logger: send the hyperparameters to the loggers.
        """
        if frame is None:
            current = inspect.currentframe()
            frame = current.f_back if current is not None else None
        init_args = _init_arguments(self, frame)
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        init_args = {name: value for name, value in init_args.items() if name not in ignored}
        objects = [arg for arg in args if not isinstance(arg, str)]
        if len(objects) == 1:
            hparams: Any = objects[0]
            self.hparams_name = next((name for name, value in init_args.items() if value is hparams), None)
        else:
            hparams = {name: init_args[name] for name in args if isinstance(name, str)} if args else init_args
            self.hparams_name = "kwargs" if hparams else None
        if isinstance(hparams, Namespace):
            hparams = vars(hparams)
        if isinstance(hparams, dict) and isinstance(self.hparams, dict):
            self.hparams.update(hparams)
        elif isinstance(hparams, Mapping):
            self.hparams = hparams  # an OmegaConf DictConfig stays one, as in Lightning
        else:
            raise ValueError(
                f"{type(self).__name__}.save_hyperparameters got {type(hparams).__name__}; pass argument names, "
                "or one dict, Namespace or DictConfig."
            )
        if isinstance(self.hparams, dict):
            for name in ignored:  # a subclass drops what its parent's call saved, as in Lightning
                self.hparams.pop(name, None)
        self.hparams_logged = logger
        for name, value in self.hparams.items():
            if isinstance(value, nn.Module):
                rank_zero_warn(
                    f"Attribute {name!r} is an instance of `nn.Module` and is already saved during checkpointing. "
                    f"It is recommended to ignore them using `self.save_hyperparameters(ignore=[{name!r}])`."
                )

    @property
    def hparams_type(self) -> str | None:
        """ "DictConfig" when `hparams` is an OmegaConf DictConfig (checkpoints rebuild it as one), else None."""
        return "DictConfig" if type(self.hparams).__name__ == "DictConfig" else None


def _init_arguments(owner: object, frame: FrameType | None) -> dict[str, Any]:
    """Return the arguments of every `__init__` of `owner` on the stack from `frame` outwards.

    The innermost frame is the parent class's `__init__` (called through ``super().__init__``); the outer ones
    are its subclasses', whose values win, as in Lightning.
    """
    chain: list[dict[str, Any]] = []
    while frame is not None:
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code.co_name == "__init__" and names and frame.f_locals.get(names[0]) is owner:
            arguments = {name: frame.f_locals[name] for name in names[1:] if name in frame.f_locals}
            if code.co_flags & inspect.CO_VARKEYWORDS:
                varargs = 1 if code.co_flags & inspect.CO_VARARGS else 0
                arguments.update(frame.f_locals.get(code.co_varnames[len(names) + varargs], {}))
            chain.append(arguments)
        elif chain:
            break
        frame = frame.f_back
    merged: dict[str, Any] = {}
    for arguments in chain:
        merged.update(arguments)
    return merged


def read_for_loading(path: str | os.PathLike[str], map_location: Any) -> dict[str, Any]:
    """Read the checkpoint a ``load_from_checkpoint`` builds from (tensors on the CPU unless `map_location`)."""
    from syncline.checkpoint_file import load_checkpoint

    return load_checkpoint(path, map_location=map_location or "cpu")


def build_from_hparams(
    cls: type[T],
    checkpoint: dict[str, Any],
    prefix: str,
    path: str | os.PathLike[str],
    hparams_file: str | os.PathLike[str] | None,
    overrides: dict[str, Any],
) -> T:
    """Call `cls` with the hyperparameters a checkpoint saved under ``<prefix>hyper_parameters``.

    `hparams_file` (YAML) updates them and `overrides` win, as in Lightning; arguments the constructor does
    not take are dropped unless it takes ``**kwargs``.

    Raises:
        TypeError: the arguments do not fit the constructor; names the saved ones.
        ValueError: `hparams_file` is not a ``.yaml``/``.yml`` file.
    """
    saved: Any = checkpoint.get(f"{prefix}hyper_parameters", {} if prefix else checkpoint.get("hparams", {}))
    if checkpoint.get(f"{prefix}hparams_type") == "DictConfig" or hparams_file is not None:
        from omegaconf import OmegaConf

        saved = OmegaConf.create(saved)
        if hparams_file is not None:
            if not str(hparams_file).endswith((".yaml", ".yml")):
                raise ValueError(
                    f"hparams_file={str(hparams_file)!r}: pass a .yaml or .yml file (a logger's hparams.yaml)."
                )
            saved = OmegaConf.merge(saved, OmegaConf.load(hparams_file))
        if checkpoint.get(f"{prefix}hparams_type") != "DictConfig":
            saved = OmegaConf.to_container(saved)
    parameters = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    name = checkpoint.get(f"{prefix}hparams_name")
    if name and name != "kwargs" and name in parameters:
        # The one object it was saved from (a dict or a Namespace) comes back as an AttributeDict, as in Lightning.
        arguments = {name: AttributeDict(saved) if isinstance(saved, dict) else saved}
    else:
        arguments = dict(saved)
    arguments.update(overrides)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        arguments = {key: value for key, value in arguments.items() if key in parameters}
    try:
        return cls(**arguments)
    except TypeError as error:
        raise TypeError(
            f"{cls.__name__}.load_from_checkpoint({str(path)!r}): {error}. The checkpoint's "
            f"hyperparameters are {sorted(saved)}; pass missing ones as keywords."
        ) from error
