"""The ports of Lightning's introductory examples in docs/from_lightning.md: the documented code is the program
in examples/, byte for byte, and that program runs (on SyntheticMNIST, without a download)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import torch

from syncline.examples.digits import SyntheticMNIST, ToTensor

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "from_lightning.md"


def _documented(program: str) -> str:
    """The code block that follows ``<!-- port: <program> -->`` in docs/from_lightning.md."""
    found = re.search(rf"<!-- port: {re.escape(program)} -->\n```python\n(.*?)```\n", DOC.read_text(), re.DOTALL)
    assert found, f"docs/from_lightning.md shows no port of {program}"
    return found.group(1)


@pytest.mark.parametrize("program", ["examples/lit_autoencoder.py", "examples/mnist_datamodule.py"])
def test_the_documented_port_is_the_program(program):
    assert _documented(program) == (ROOT / program).read_text()


def _run(program: str, directory: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(directory)
    torch.manual_seed(0)
    return runpy.run_path(str(ROOT / program), run_name="__main__")


def test_lit_autoencoder_trains_saves_and_loads_its_checkpoint(tmp_path, monkeypatch):
    ran = _run("examples/lit_autoencoder.py", tmp_path, monkeypatch)
    assert ran["trainer"].global_step == 100  # limit_train_batches=100 of batch size 1, one epoch
    # The checkpoint the program loads is the default ModelCheckpoint's, where Lightning's would be.
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=100.ckpt").is_file()
    assert ran["embeddings"].shape == (4, 3)
    assert not ran["encoder"].training  # the program put it in eval mode


def test_mnist_datamodule_fits_tests_validates_and_predicts(tmp_path, monkeypatch):
    ran = _run("examples/mnist_datamodule.py", tmp_path, monkeypatch)
    trainer, dm = ran["trainer"], ran["dm"]
    assert trainer.global_step == 60 and trainer.datamodule is dm
    assert (len(dm.mnist_train), len(dm.mnist_val), len(dm.mnist_predict)) == (55000, 5000, 10000)
    # The classifier learned from the DataModule's data: well above chance on the validation batches.
    assert trainer.validate(ran["model"], datamodule=dm)[0]["val_acc"] > 0.5


def test_synthetic_mnist_has_mnists_shapes_and_is_the_same_everywhere():
    train, test = SyntheticMNIST(train=True, transform=ToTensor()), SyntheticMNIST(train=False)
    assert (len(train), len(test)) == (60_000, 10_000)
    image, label = train[123]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    assert 0 <= label < 10
    assert torch.equal(SyntheticMNIST(transform=ToTensor())[123][0], image)  # no hidden state between reads
    assert test[0][0].dtype == torch.uint8 and test[0][0].shape == (28, 28)
