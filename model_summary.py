"""`ModelSummary`: the table of a task's layers and parameter counts that Lightning prints when fit starts.

A bottom module (Lightning's ``lightning.pytorch.utilities.model_summary``): the `ModelSummary` callback prints it,
and a user can build one from any `nn.Module`.
"""

from __future__ import annotations

import math

from torch import nn

from syncline.options import MisconfigurationException

__all__ = ["ModelSummary", "check_max_depth", "human_readable_count", "summarize"]

_UNITS = ("", "K", "M", "B", "T")


def human_readable_count(number: float) -> str:
    """Return `number` as Lightning's summary shows it: ``123``, ``1.2 K``, ``2.0 M``, ``3.0 B``, ``400 T``."""
    if number < 1000:
        return f"{int(number)}"
    power = min(int(math.log10(number) // 3), len(_UNITS) - 1)
    scaled = number / 1000**power
    return f"{scaled:,.1f} {_UNITS[power]}" if scaled < 100 else f"{scaled:,.0f} {_UNITS[power]}"


def check_max_depth(max_depth: int) -> None:
    """Refuse a `max_depth` that is not an int >= -1 (-1: every module, 0: none, n: n levels).

    Raises:
        MisconfigurationException: naming the value.
    """
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise MisconfigurationException(f"`max_depth` can be -1, 0 or > 0, got {max_depth!r}.")


class ModelSummary:
    """The layers of `model` down to `max_depth` (1: its direct children; -1: every module; 0: none) with
    their type, parameter count and mode, and the model's totals, as Lightning's ``ModelSummary`` reports them.

    Args:
        model: the task (any `nn.Module`).
        max_depth: nesting depth of the layers listed.

    Raises:
        MisconfigurationException: `max_depth` is not an int >= -1.
    """

    def __init__(self, model: nn.Module, max_depth: int = 1) -> None:
        check_max_depth(max_depth)
        self._model = model
        self._max_depth = max_depth
        named = [] if max_depth == 0 else list(model.named_modules())[1:]
        #: (name, module) of every layer listed.
        self.layers = [(name, module) for name, module in named if max_depth == -1 or name.count(".") < max_depth]

    @property
    def max_depth(self) -> int:
        """The nesting depth of the layers listed."""
        return self._max_depth

    @property
    def layer_names(self) -> list[str]:
        """The listed layers' names (``encoder``, ``encoder.0`` ...)."""
        return [name for name, _ in self.layers]

    @property
    def layer_types(self) -> list[str]:
        """The listed layers' class names."""
        return [type(module).__name__ for _, module in self.layers]

    @property
    def param_nums(self) -> list[int]:
        """The parameters in each listed layer, its children's included."""
        return [sum(p.numel() for p in module.parameters()) for _, module in self.layers]

    @property
    def training_modes(self) -> list[bool]:
        """Whether each listed layer is in training mode."""
        return [module.training for _, module in self.layers]

    @property
    def total_training_modes(self) -> dict[str, int]:
        """How many modules (the model itself not counted) are in train and in eval mode."""
        modes = [module.training for module in list(self._model.modules())[1:]]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        """Every parameter of the model."""
        return sum(p.numel() for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        """The parameters that require gradients."""
        return sum(p.numel() for p in self._model.parameters() if p.requires_grad)

    @property
    def total_layer_params(self) -> int:
        """The parameters of the listed layers, summed."""
        return sum(self.param_nums)

    @property
    def model_size(self) -> float:
        """The parameters' size in MB (10**6 bytes), at their own element sizes."""
        return sum(p.numel() * p.element_size() for p in self._model.parameters()) / 1e6

    def __str__(self) -> str:
        rows = [
            [str(i), name, kind, human_readable_count(count), "train" if mode else "eval"]
            for i, (name, kind, count, mode) in enumerate(
                zip(self.layer_names, self.layer_types, self.param_nums, self.training_modes)
            )
        ]
        header = [" ", "Name", "Type", "Params", "Mode"]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        line = lambda cells: " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()  # noqa: E731
        rule = "-" * max(len(line(header)), 40)
        table = [line(header), rule, *(line(row) for row in rows), rule] if rows else []
        modes = self.total_training_modes
        totals = [
            (human_readable_count(self.trainable_parameters), "Trainable params"),
            (human_readable_count(self.total_parameters - self.trainable_parameters), "Non-trainable params"),
            (human_readable_count(self.total_parameters), "Total params"),
            (f"{self.model_size:,.3f}", "Total estimated model params size (MB)"),
            (str(modes["train"]), "Modules in train mode"),
            (str(modes["eval"]), "Modules in eval mode"),
        ]
        return "\n".join([*table, *(f"{value:<10}{label}" for value, label in totals)])

    def __repr__(self) -> str:
        return str(self)


def summarize(model: nn.Module, max_depth: int = 1) -> ModelSummary:
    """Return the `ModelSummary` of `model` (Lightning's ``summarize``)."""
    return ModelSummary(model, max_depth=max_depth)
