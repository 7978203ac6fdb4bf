"""`SyntheticMNIST`: MNIST's shapes and interface without a download, for the ports of Lightning's examples.

Lightning's introductory examples read MNIST through torchvision. syncline neither depends on torchvision nor
downloads anything, so the ports import this class in its place (``from syncline.examples.digits import
SyntheticMNIST as MNIST``), with the few transforms they use: the rest of each program is Lightning's.

Each image is a 28x28 grey-scale picture of its class: one of ten fixed random strokes, shifted by up to two
pixels and speckled with noise, so an autoencoder has structure to learn and a classifier can tell the ten
classes apart. Sample `i` is the same in every process and every run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["Compose", "Normalize", "SyntheticMNIST", "ToTensor", "transforms"]

_SIZE = 28


def _prototypes() -> Tensor:
    """Ten fixed strokes, one per class: random walks of a 3-pixel brush, values in [0, 255]."""
    generator = torch.Generator().manual_seed(1998)
    images = torch.zeros(10, _SIZE, _SIZE)
    for digit in range(10):
        row, col = torch.randint(8, 20, (2,), generator=generator).tolist()
        for _ in range(60):
            images[digit, row - 1 : row + 2, col - 1 : col + 2] = 255.0
            step = torch.randint(-1, 2, (2,), generator=generator).tolist()
            row, col = min(max(row + step[0], 4), 23), min(max(col + step[1], 4), 23)
    return images


class SyntheticMNIST(Dataset[tuple[Any, int]]):
    """A stand-in for ``torchvision.datasets.MNIST``: 60,000 training or 10,000 test samples ``(image, label)``.

    Args:
        root: accepted for MNIST's signature; nothing is read or written there.
        train: the training split (60,000 samples) or the test split (10,000).
        transform: applied to each image (a uint8 tensor of shape 28x28, where MNIST gives a PIL image).
        target_transform: applied to each label.
        download: accepted for MNIST's signature; nothing is downloaded.
    """

    def __init__(
        self,
        root: str = ".",
        train: bool = True,
        transform: Callable[[Tensor], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        download: bool = False,
    ) -> None:
        self.root, self.train = root, train
        self.transform, self.target_transform = transform, target_transform
        self._prototypes = _prototypes()

    def __len__(self) -> int:
        return 60_000 if self.train else 10_000

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"SyntheticMNIST index {index} is out of range 0..{len(self) - 1}.")
        # One generator per sample: sample i does not depend on which samples were read before it.
        generator = torch.Generator().manual_seed(index * 2 + int(self.train))
        label = int(torch.randint(0, 10, (1,), generator=generator))
        shift = torch.randint(-2, 3, (2,), generator=generator).tolist()
        image = torch.roll(self._prototypes[label], shifts=shift, dims=(0, 1))
        image = (image + 40.0 * torch.randn(_SIZE, _SIZE, generator=generator)).clamp(0, 255).to(torch.uint8)
        image = self.transform(image) if self.transform is not None else image
        return image, (self.target_transform(label) if self.target_transform is not None else label)


class ToTensor:
    """torchvision's ``ToTensor`` for these images: a float tensor of shape 1x28x28 with values in [0, 1]."""

    def __call__(self, image: Tensor) -> Tensor:
        return image.to(torch.float32).div(255.0).unsqueeze(0)


class Normalize:
    """torchvision's ``Normalize``: subtract `mean` and divide by `std`, per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: Tensor) -> Tensor:
        return (image - self.mean) / self.std


class Compose:
    """torchvision's ``Compose``: apply `steps` in order."""

    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = list(steps)

    def __call__(self, image: Any) -> Any:
        for step in self.steps:
            image = step(image)
        return image


#: The transforms above under torchvision's module name, so ``transforms.Compose([...])`` reads as in Lightning.
transforms = SimpleNamespace(Compose=Compose, Normalize=Normalize, ToTensor=ToTensor)
