"""Checks of numeric options, shared by the Trainer, the callbacks and the strategies.

Every constructor checks its numbers when they are given, with one message that names the owner, the
option, the value and what is allowed, e.g.
``BucketedDDP(bucket_cap_mb=-1): bucket_cap_mb must be a number > 0 (MiB per bucket).``
A bad value must never surface later as an error about something else (an islice, a socket timeout).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MisconfigurationException", "OptionError", "check_int", "check_number"]


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
