"""`CharGPT`: a small character-level GPT trained on the Python standard library's own source code.

The corpus is on every machine that has Python: the standard library's ``*.py`` files, read in sorted
path order until `max_chars` characters are collected. Its first part is the training set, its last
`val_fraction` the validation set, so validation measures text from modules the model has not seen.

The model follows GPT-2 (and nanoGPT): token and position embeddings, `n_layer` pre-norm blocks of
causal self-attention and an MLP, a final LayerNorm, and an output layer that shares the embedding's
weights.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

from syncline.rank_zero import rank_zero_only
from syncline.trainer.task import Task

__all__ = ["CharGPT", "CharWindows", "load_stdlib_text"]

#: Parts of the standard library that are not representative Python (test data, vendored packages).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})


def load_stdlib_text(max_chars: int) -> str:
    """Return up to `max_chars` characters of the standard library's ``*.py`` files, in sorted path order.

    Raises:
        RuntimeError: no readable source file was found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in _source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        # ASCII only keeps the vocabulary near 100 characters; the few other files add rare symbols.
        if not text.isascii():
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise RuntimeError(f"No readable Python source under {root}; CharGPT needs the standard library's files.")
    return "".join(parts)[:max_chars]


def _source_files(directory: Path) -> Iterator[Path]:
    """Yield the ``*.py`` files under `directory` in sorted path order, lazily, so reading can stop early."""
    for entry in sorted(directory.iterdir()):
        if entry.is_dir():
            if entry.name not in _SKIPPED_DIRS:
                yield from _source_files(entry)
        elif entry.suffix == ".py":
            yield entry


class CharWindows(Dataset):
    """Non-overlapping windows of `block_size` characters, each with its next-character targets."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        if len(data) <= block_size:
            raise ValueError(f"{len(data)} characters are too few for windows of block_size={block_size}.")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier positions."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend over `x` of shape (batch, time, channels)."""
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    """A transformer block: attention then an MLP, each on a LayerNorm of a residual stream."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        """Transform the residual stream `x`."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharGPT(Task):
    """Predict the next character of Python source code.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads per block; must divide `n_embd`.
        n_embd: width of the residual stream.
        block_size: characters of context, and the length of each training window.
        batch_size: windows per batch (per process).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay, applied to matrices only (not to biases and norms).
        warmup_steps: optimizer steps of linear warmup; then the rate follows a cosine down to
            `min_lr_ratio * lr` at the trainer's last step (constant when the trainer has no step budget).
        min_lr_ratio: final learning rate as a fraction of `lr`.
        dropout: dropout probability in attention and MLP outputs.
        max_chars: characters of standard-library source to read.
        val_fraction: the last fraction of those characters, held out for validation.
        num_workers: DataLoader worker processes.
        sample_chars: characters generated and printed when fit ends (0 for none).
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 64,
        batch_size: int = 32,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
        min_lr_ratio: float = 0.1,
        dropout: float = 0.0,
        max_chars: int = 1_000_000,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        sample_chars: int = 400,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers

        text = load_stdlib_text(max_chars)
        self.vocab = "".join(sorted(set(text)))
        data = self.encode(text)
        split = int(len(data) * (1.0 - val_fraction))
        self.train_data, self.val_data = data[:split], data[split:]

        vocab_size = len(self.vocab)
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(_init_weights)
        # Weight tying (Press & Wolf, 2017): fewer parameters and a faster start for a small model.
        self.lm_head.weight = self.token_embedding.weight
        self.val_ppl = Perplexity()

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> Tensor:
        """Return the vocabulary indices of the characters of `text` (ASCII only)."""
        lookup = torch.zeros(128, dtype=torch.long)
        lookup[torch.tensor([ord(c) for c in self.vocab])] = torch.arange(len(self.vocab))
        codes = torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()
        return lookup[codes]

    def decode(self, indices: Tensor) -> str:
        """Return the text of vocabulary `indices`."""
        return "".join(self.vocab[i] for i in indices.tolist())

    # ----------------------------------------------------------------- model
    def forward(self, idx: Tensor) -> Tensor:
        """Return next-character logits of shape (batch, time, vocab) for indices of shape (batch, time)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.token_embedding(idx) + self.position_embedding(positions))
        return self.lm_head(self.ln_f(self.blocks(x)))

    @torch.no_grad()
    def generate(self, prompt: str, num_chars: int, temperature: float = 0.8, seed: int = 0) -> str:
        """Continue `prompt` by sampling `num_chars` characters, with a generator of its own.

        The task's global RNG streams are left untouched, so sampling never changes a training run.
        """
        was_training = self.training
        self.eval()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        idx = self.encode(prompt).to(self.device)[None]
        for _ in range(num_chars):
            logits = self(idx[:, -self.block_size :])[:, -1] / temperature
            next_idx = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, next_idx], dim=1)
        self.train(was_training)
        return prompt + self.decode(idx[0, len(prompt) :])

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # ----------------------------------------------------------------- steps
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Return the mean next-character cross-entropy of a batch of windows."""
        inputs, targets = batch
        loss = self._loss(self(inputs), targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Log the validation loss and perplexity (per character) of a batch."""
        inputs, targets = batch
        logits = self(inputs)
        self.log("val_loss", self._loss(logits, targets), prog_bar=True, sync_dist=True)
        self.val_ppl.update(logits.float(), targets)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        """Return AdamW with warmup and cosine decay, stepped every optimizer step."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams["lr"],
            betas=(0.9, 0.99),
        )
        schedule = _warmup_cosine(self.hparams["warmup_steps"], self._total_steps(), self.hparams["min_lr_ratio"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int | None:
        """Return the optimizer steps this fit will take, or None when the trainer has no step budget."""
        trainer = self.trainer
        if trainer.max_steps != -1:
            return trainer.max_steps
        if trainer.max_epochs is None or trainer.num_training_batches == math.inf:
            return None
        return trainer.max_epochs * math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ data
    def train_dataloader(self) -> DataLoader:
        """Return shuffled windows of the training text."""
        return DataLoader(
            CharWindows(self.train_data, self.block_size),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Return the windows of the validation text, in order."""
        return DataLoader(
            CharWindows(self.val_data, self.block_size), batch_size=self.batch_size, num_workers=self.num_workers
        )

    # ----------------------------------------------------------------- hooks
    def on_fit_start(self) -> None:
        """Print what is being trained and the loss a model without context would reach."""
        _print(
            f"CharGPT: {len(self.train_data):,} training and {len(self.val_data):,} validation characters of "
            f"Python stdlib source, vocabulary {len(self.vocab)}, {sum(p.numel() for p in self.parameters()):,} "
            f"parameters. Baselines: uniform val_loss {math.log(len(self.vocab)):.2f}, "
            f"unigram val_loss {self.unigram_loss():.2f}."
        )

    def on_fit_end(self) -> None:
        """Print a sample of generated Python."""
        if self.hparams["sample_chars"] > 0 and self.trainer.is_global_zero:
            sample = self.generate("def ", self.hparams["sample_chars"])
            _print(f"\n---- sample after {self.trainer.global_step} steps ----\n{sample}\n----")

    def unigram_loss(self) -> float:
        """Return the validation cross-entropy of predicting training-set character frequencies."""
        counts = torch.bincount(self.train_data, minlength=len(self.vocab)).double() + 1.0
        log_probs = (counts / counts.sum()).log()
        return float(-log_probs[self.val_data].mean())


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialization: small normal weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _warmup_cosine(warmup_steps: int, total_steps: int | None, min_ratio: float) -> Any:
    """Return a LambdaLR factor: linear warmup, then cosine decay to `min_ratio` at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


@rank_zero_only
def _print(message: str) -> None:
    print(message, flush=True)
