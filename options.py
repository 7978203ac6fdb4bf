"""Checks of numeric options, shared by the Trainer, the callbacks and the strategies.

Every constructor checks its numbers when they are given, with one message that names the owner, the
option, the value and what is allowed, e.g.
``BucketedDDP(bucket_cap_mb=-1): bucket_cap_mb must be a number > 0 (MiB per bucket).``
A bad value must never surface later as an error about something else (an islice, a socket timeout).
"""

from __future__ import annotations

import inspect
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "MisconfigurationException",
    "OptionError",
    "check_arguments",
    "check_backend",
    "check_int",
    "check_number",
    "check_passthrough",
    "type_hints",
]


class MisconfigurationException(ValueError):
    """A Trainer, task or callback is used in a way it does not allow (Lightning's exception of this name).

    A Lightning program's ``except MisconfigurationException`` catches syncline's errors in the situations
    where Lightning raises it; it is a `ValueError` too, as the value or the combination is what is wrong.
    """


class OptionError(MisconfigurationException):
    """An option of the Trainer, a callback or a strategy has a value it does not allow."""


def _fail(owner: str, name: str, value: Any, allowed: str) -> OptionError:
    return OptionError(f"{owner}({name}={value!r}): {name} must be {allowed}.")


def check_int(owner: str, name: str, value: Any, minimum: int, *, none_ok: bool = False, meaning: str = "") -> None:
    """Require an int >= `minimum` (or None when `none_ok`); `meaning` is added to the message.

    Raises:
        OptionError: naming `owner`, `name`, `value` and the allowed values.
    """
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"{'None or ' if none_ok else ''}an int >= {minimum}{f' ({meaning})' if meaning else ''}"
        raise _fail(owner, name, value, allowed)


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    above: float | None = None,
    minimum: float | None = None,
    none_ok: bool = False,
    meaning: str = "",
) -> None:
    """Require a finite int or float, > `above` and/or >= `minimum` (or None when `none_ok`).

    Raises:
        OptionError: naming `owner`, `name`, `value` and the allowed values.
    """
    if value is None and none_ok:
        return
    bounds = [f"> {above:g}" if above is not None else "", f">= {minimum:g}" if minimum is not None else ""]
    allowed = " and ".join(b for b in bounds if b)
    allowed = f"{'None or ' if none_ok else ''}a finite number{f' {allowed}' if allowed else ''}"
    allowed += f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(owner, name, value, allowed)
    if (above is not None and value <= above) or (minimum is not None and value < minimum):
        raise _fail(owner, name, value, allowed)


def check_arguments(owner: str, function: Callable[..., Any], arguments: Mapping[str, Any]) -> None:
    """Check each argument against the type its parameter of `function` is annotated with.

    ``bool`` takes only True or False (never a truthy string such as ``"no"``), ``str`` a string,
    ``Literal[...]`` one of its values, and a union any of its members. Annotations with a number in them
    are left to `check_int` and `check_number`, which also say the range; other annotations (classes from a
    TYPE_CHECKING import, generics, Any) are not checked.

    Raises:
        OptionError: naming `owner`, the argument, its value and the type it must have.
    """
    hints = type_hints(function)
    for name, value in arguments.items():
        hint = hints.get(name)
        if hint is not None and not _mentions_a_number(hint) and not _matches(value, hint):
            raise _fail(owner, name, value, f"{_describe(hint)}, not {_a(type(value).__name__)}")


def check_passthrough(owner: str, target: Callable[..., Any], kwargs: Mapping[str, Any], what: str) -> None:
    """Check keyword arguments that `owner` passes on to `target` (a torch class or function) by its signature.

    A name `target` does not take is refused, and so is a value whose type differs from the default's
    (a bool, an int or a float), before any process starts instead of inside every worker.

    Raises:
        OptionError: naming the argument and the names `target` takes, or the type its default has.
    """
    parameters = inspect.signature(target).parameters
    for name, value in kwargs.items():
        parameter = parameters.get(name)
        if parameter is None or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            valid = [n for n, p in parameters.items() if n != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
            raise OptionError(
                f"{owner}({name}={value!r}): {what} takes no argument {name!r}; it takes {', '.join(valid)}."
            )
        kind = next((k for k in (bool, int, float) if type(parameter.default) is k), None)
        if kind is not None and not _matches(value, float if kind is float else kind):
            raise _fail(owner, name, value, f"{_describe(kind)} (as in {what}), not {_a(type(value).__name__)}")


def check_backend(owner: str, backend: Any) -> None:
    """Require None or a torch.distributed backend name ("gloo", "nccl", ... or "cpu:gloo,cuda:nccl").

    Raises:
        OptionError: naming the backends torch knows.
    """
    if backend is None:
        return
    import torch.distributed as dist

    known = [str(name).lower() for name in dist.Backend.backend_list if name not in ("undefined", "fake")]
    names = [part.split(":", 1)[-1].strip().lower() for part in backend.split(",")] if isinstance(backend, str) else []
    if not names or any(name not in known for name in names):
        raise _fail(owner, "backend", backend, f"None (gloo on CPU, NCCL on GPUs) or one of {', '.join(known)}")


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    """The parameters' annotations of `function`, evaluated; one that cannot be (a TYPE_CHECKING name) is left out."""
    try:
        return typing.get_type_hints(function)
    except Exception:
        hints = {}
        namespace = getattr(function, "__globals__", {})
        for name, annotation in getattr(function, "__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
            except Exception:
                continue
        return hints


def _mentions_a_number(hint: Any) -> bool:
    return hint in (int, float) or any(_mentions_a_number(member) for member in typing.get_args(hint))


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, member) for member in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a class, a protocol, a generic: its owner checks what it needs


def _describe(hint: Any) -> str:
    if hint is None or hint is type(None):
        return "None"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    names = {bool: "a bool (True or False)", int: "an int", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
