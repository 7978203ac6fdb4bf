"""docs/from_lightning.md's port of Lightning's GAN runs as written, for a few steps on tiny random images."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "from_lightning.md"


def port_source(name: str) -> str:
    """Return the python block that follows ``<!-- port: name -->`` in docs/from_lightning.md."""
    found = re.search(rf"<!-- port: {name} -->\n```python\n(.*?)\n```", DOC.read_text(), re.DOTALL)
    assert found, f"no port named {name!r} in {DOC}"
    return found.group(1)


def test_the_gan_port_trains_with_two_optimizers(tmp_path, monkeypatch):
    """Two batches of 8 images, two epochs: 2 optimizer steps per batch (Lightning's count), both networks move,
    both losses are logged and finite, and the generator makes images of MNIST's shape."""
    monkeypatch.chdir(tmp_path)  # the default logger and checkpoint write under the working directory
    source = port_source("gan")
    assert "import syncline as L  # was: import lightning as L" in source
    namespace: dict = {"__name__": "gan_port"}
    exec(compile(source, str(DOC), "exec"), namespace)
    torch.manual_seed(0)
    initial = namespace["GAN"](latent_dim=16).state_dict()
    torch.manual_seed(0)
    model, trainer = namespace["main"](num_images=16, batch_size=8, max_epochs=2, latent_dim=16)
    assert trainer.global_step == 2 * 2 * 2
    for part in ("generator.model.0.weight", "discriminator.model.0.weight"):
        assert not torch.equal(model.state_dict()[part], initial[part]), part
    assert {"d_loss", "g_loss"} <= set(trainer.callback_metrics)
    assert all(torch.isfinite(trainer.callback_metrics[key]) for key in ("d_loss", "g_loss"))
    assert model(torch.randn(3, 16)).shape == (3, 1, 28, 28)
    assert (tmp_path / "lightning_logs").exists()
