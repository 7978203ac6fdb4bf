"""The benchmarks' models: a ResNet-style CNN, a BERT-style encoder, the tiny MLP of `bench_trainer.py` and a
stack of linear layers.

The paper measures ResNet50 and BERT on GPUs. At CPU scale we keep their character, not their size:
the CNN is a ResNet-18 layout (BasicBlocks with BatchNorm, so buffers are broadcast every step) at
reduced width on 32x32 images; the encoder is a post-LayerNorm BERT (token and position embeddings,
self-attention blocks, a masked-language-model head tied to the embedding) with a larger parameter
count than the CNN, as BERT is larger than ResNet50. Every model has a `training_step(batch, batch_idx)`
returning the loss, which is what the strategies call.

`build(name, size, **config)` returns a `Workload`: the model factory, a function that makes one rank's
batch, its description and the momentum of the SGD that trains it. `size` is "full" (a step of 50-300 ms
per rank on one thread) or "tiny" (for the smoke test); `config` overrides the size's settings (the
layer stack's width, depth and batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["SIZES", "WORKLOADS", "LayerStack", "MLPSteps", "Workload", "build", "make_mlp", "mlp_loader"]


# ------------------------------------------------------------------ CNN
class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (ResNet-18/34's block)."""

    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = nn.Sequential()
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNetCNN(nn.Module):
    """ResNet-18 layout (four stages of two blocks) with base width `width`, for 32x32 images."""

    def __init__(self, width: int, classes: int = 10, blocks: tuple[int, ...] = (2, 2, 2, 2)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, inp = [], width
        for stage, count in enumerate(blocks):
            out = width * 2**stage
            for i in range(count):
                layers.append(BasicBlock(inp, out, 2 if (i == 0 and stage > 0) else 1))
                inp = out
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(inp, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self(images), labels)


# ----------------------------------------------------------------- BERT
class BertEncoder(nn.Module):
    """BERT-style encoder with a masked-language-model head whose decoder shares the token embedding."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.encoder(self.drop(self.norm(self.tokens(ids) + self.positions(positions))))

    def training_step(self, batch, batch_idx):
        ids, mask, targets = batch
        hidden = self.transform(self(ids)[mask])
        # The decoder is the token embedding, transposed (weight tying, as in BERT).
        logits = hidden @ self.tokens.weight.t() + self.decoder_bias
        return F.cross_entropy(logits, targets)


# ------------------------------------------------------------ layer stack
class LayerStack(nn.Module):
    """`depth` x (Linear(width, width) + LayerNorm(width)): four parameter tensors per block, loss the mean square.

    The model of the reducer benchmarks (`ddp`, `bench_autotune`, `bench_many_params`): its width sets the
    bytes per parameter tensor, its depth the number of tensors.
    """

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(depth))
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layers(batch).square().mean()


# ------------------------------------------------------------------ MLP
def make_mlp() -> nn.Module:
    """bench_trainer.py's MLP: 32 features, two hidden layers of 64, one output."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def mlp_loader(steps: int) -> DataLoader:
    """Return `steps` shuffled batches of 32 random (features, target) pairs, the same on every call."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 32, 32, generator=generator)
    y = torch.randn(steps * 32, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


class MLPSteps:
    """bench_trainer.py's task: the MLP, MSE logged every step to the progress bar, Adam.

    A mixin, so that the Trainer's `Task` and Lightning's `LightningModule` train the same code
    (`class MLPTask(MLPSteps, Task)`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.model = make_mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _MLPStep(nn.Module):
    """bench_trainer.py's MLP with a `training_step` (MSE on a 32-feature batch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)


# ------------------------------------------------------------- registry
#: Sizes per workload: "full" for measurements, "tiny" for the smoke test.
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "cnn": {"full": {"width": 32, "batch": 8}, "tiny": {"width": 4, "batch": 2}},
    "bert": {
        "full": {"vocab": 8192, "seq": 128, "dim": 256, "layers": 4, "heads": 4, "batch": 2},
        "tiny": {"vocab": 64, "seq": 16, "dim": 16, "layers": 1, "heads": 2, "batch": 2},
    },
    "mlp": {"full": {"batch": 32}, "tiny": {"batch": 32}},
    "layers": {"full": {"width": 512, "depth": 12, "batch": 64}, "tiny": {"width": 16, "depth": 2, "batch": 8}},
}


@dataclass
class Workload:
    """A model to train and a batch to train it on."""

    name: str
    size: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Any]
    description: str
    config: dict[str, int]
    #: The momentum of the SGD (lr 1e-3) that trains it in the DDP jobs.
    momentum: float = 0.9

    def describe(self) -> dict[str, Any]:
        """Return the JSON description: name, config, parameters and gradient megabytes."""
        model = self.make_model()
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {
            "name": self.name,
            "size": self.size,
            "description": self.description,
            "config": self.config,
            "parameters": params,
            "parameter_tensors": sum(1 for p in model.parameters() if p.requires_grad),
            "gradient_mb": round(params * 4 / 2**20, 2),
        }


def build(name: str, size: str = "full", **config: int) -> Workload:
    """Return workload `name` ("cnn", "bert", "mlp" or "layers") at `size` ("full" or "tiny"), `config` overriding
    the size's settings."""
    cfg = {**SIZES[name][size], **config}
    batch = cfg["batch"]
    if name == "cnn":

        def make_batch(g: torch.Generator):
            return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)

        return Workload(
            name,
            size,
            lambda: ResNetCNN(cfg["width"]),
            make_batch,
            f"ResNet-18 layout, base width {cfg['width']}, BatchNorm, 32x32 images, batch {batch} per rank",
            cfg,
        )
    if name == "bert":
        vocab, seq = cfg["vocab"], cfg["seq"]

        def make_batch(g: torch.Generator):
            ids = torch.randint(0, vocab, (batch, seq), generator=g)
            mask = torch.rand(batch, seq, generator=g) < 0.15
            mask[:, 0] = True  # at least one masked position per sequence
            targets = ids[mask]
            return ids.masked_fill(mask, 0), mask, targets

        return Workload(
            name,
            size,
            lambda: BertEncoder(vocab, seq, cfg["dim"], cfg["layers"], cfg["heads"]),
            make_batch,
            f"BERT-style post-LN encoder, {cfg['layers']} layers, width {cfg['dim']}, {cfg['heads']} heads, "
            f"vocabulary {vocab}, sequence {seq}, 15% masked-LM, batch {batch} per rank",
            cfg,
        )
    if name == "mlp":

        def make_batch(g: torch.Generator):
            return torch.randn(batch, 32, generator=g), torch.randn(batch, 1, generator=g)

        return Workload(
            name,
            size,
            lambda: _MLPStep(make_mlp()),
            make_batch,
            f"bench_trainer.py's MLP 32-64-64-1, batch {batch}",
            cfg,
        )
    if name == "layers":
        width, depth = cfg["width"], cfg["depth"]
        return Workload(
            name,
            size,
            partial(LayerStack, width, depth),
            lambda g: torch.randn(batch, width, generator=g),
            f"{depth} x (Linear({width}, {width}) + LayerNorm({width})), mean square, batch {batch} per rank",
            cfg,
            momentum=0.0,
        )
    raise ValueError(f"Unknown workload {name!r}. Valid: {', '.join(WORKLOADS)}.")


WORKLOADS = ("cnn", "bert", "mlp", "layers")
