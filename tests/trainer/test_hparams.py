"""`save_hyperparameters` and `load_from_checkpoint` as Lightning's (its `utilities/parsing.py`, `core/saving.py`
and `tests_pytorch/models/test_hparams.py`)."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from syncline.callbacks import ModelCheckpoint
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data


class Base(Regressor):
    def __init__(self, features: int = 8, lr: float = 0.1, **kwargs) -> None:
        super().__init__(features=features, lr=lr)
        self.save_hyperparameters(ignore="ignored")


class Child(Base):
    def __init__(self, width: int = 3, ignored: str = "x", lr: float = 0.2, **kwargs) -> None:
        super().__init__(lr=lr, **kwargs)


def test_the_whole_init_chain_is_collected_and_ignore_drops_names():
    """Called in a parent's `__init__`, Lightning collects every `__init__` of the subclass chain; the subclass's
    values win, `**kwargs` are unpacked, `ignore` leaves names out."""
    task = Child(width=5, extra=7)
    assert dict(task.hparams) == {"features": 8, "lr": 0.2, "width": 5, "extra": 7}


def test_named_arguments_or_one_object_become_the_hparams():
    class Named(Regressor):
        def __init__(self, lr: float = 0.1, dropout: float = 0.0) -> None:
            super().__init__(lr=lr, dropout=dropout)
            self.save_hyperparameters("lr")

    assert dict(Named(lr=0.3).hparams) == {"lr": 0.3}

    class FromConfig(Regressor):
        def __init__(self, config) -> None:
            super().__init__(lr=config.lr)
            self.save_hyperparameters(config)

    config = OmegaConf.create({"lr": 0.4, "nested": {"depth": 2}})
    task = FromConfig(config)
    assert isinstance(task.hparams, DictConfig) and task.hparams.nested.depth == 2  # a DictConfig stays one
    assert dict(FromConfig(Namespace(lr=0.5)).hparams) == {"lr": 0.5}


def test_modules_are_kept_with_lightnings_warning_or_ignored():
    class WithEncoder(Regressor):
        def __init__(self, encoder: nn.Module, lr: float = 0.1, ignore: bool = False) -> None:
            super().__init__(lr=lr)
            self.encoder = encoder
            self.save_hyperparameters(ignore=["encoder"] if ignore else None)

    encoder = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="'encoder' is an instance of `nn.Module`.*ignore=\\['encoder'\\]"):
        kept = WithEncoder(encoder)
    assert kept.hparams.encoder is encoder
    assert "encoder" not in WithEncoder(encoder, ignore=True).hparams


def _checkpoint_of(task, tmp_path) -> str:
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    trainer = Trainer(**{**quiet(max_epochs=1), "enable_checkpointing": True}, callbacks=[checkpoint])
    trainer.fit(task, loader(regression_data(16), 8))
    return checkpoint.best_model_path


def test_load_from_checkpoint_drops_arguments_the_task_does_not_take(tmp_path):
    """Lightning filters the saved hyperparameters and the keywords by the constructor's signature."""

    class Plain(Regressor):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

    path = _checkpoint_of(Plain(lr=0.3), tmp_path / "plain")
    loaded = Plain.load_from_checkpoint(path, not_an_argument=1)
    assert dict(loaded.hparams) == {"lr": 0.3}
    assert Plain.load_from_checkpoint(path, lr=0.7).hparams.lr == 0.7
    # A constructor taking **kwargs receives them all, as in Lightning.
    assert Base.load_from_checkpoint(_checkpoint_of(Base(), tmp_path / "base"), other=2).hparams["other"] == 2


def test_a_dictconfig_survives_the_checkpoint(tmp_path):
    class FromConfig(Regressor):
        def __init__(self, config) -> None:
            super().__init__(lr=config.lr)
            self.save_hyperparameters(config)

    original = FromConfig(OmegaConf.create({"lr": 0.25, "nested": {"depth": 2}}))
    loaded = FromConfig.load_from_checkpoint(_checkpoint_of(original, tmp_path))
    assert isinstance(loaded.hparams, DictConfig) and loaded.hparams.nested.depth == 2
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)


def test_load_from_checkpoint_calls_on_load_checkpoint(tmp_path):
    seen: list[int] = []

    class Hooked(Regressor):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

        def on_load_checkpoint(self, checkpoint):
            seen.append(checkpoint["global_step"])

    Hooked.load_from_checkpoint(_checkpoint_of(Hooked(), tmp_path))
    assert seen == [2]


class TwoNamed(Regressor):
    def __init__(self, lr: float = 0.1, dropout: float = 0.0, features: int = 8) -> None:
        super().__init__(lr=lr, dropout=dropout, features=features)
        self.save_hyperparameters("lr", "dropout")


class FromNamespace(Regressor):
    def __init__(self, args) -> None:
        super().__init__(lr=args.lr)
        self.save_hyperparameters(args)


class FromDict(Regressor):
    def __init__(self, config: dict) -> None:
        super().__init__(lr=config["lr"])
        self.save_hyperparameters(config)


def test_several_names_a_dict_or_a_namespace_are_saved_and_rebuilt_from_the_checkpoint(tmp_path):
    assert dict(TwoNamed(lr=0.3, features=4).hparams) == {"lr": 0.3, "dropout": 0.0}
    loaded = TwoNamed.load_from_checkpoint(_checkpoint_of(TwoNamed(lr=0.3), tmp_path / "two"))
    assert dict(loaded.hparams) == {"lr": 0.3, "dropout": 0.0}
    # One object: Lightning passes it back under its argument's name, as an AttributeDict (attribute access).
    task = FromNamespace(Namespace(lr=0.25))
    assert dict(task.hparams) == {"lr": 0.25}
    assert FromNamespace.load_from_checkpoint(_checkpoint_of(task, tmp_path / "ns")).hparams.lr == 0.25
    loaded = FromDict.load_from_checkpoint(_checkpoint_of(FromDict({"lr": 0.5}), tmp_path / "dict"))
    assert dict(loaded.hparams) == {"lr": 0.5}


class Wider(Regressor):
    """Regressor with one more layer than the checkpoint has."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.extra = nn.Linear(1, 1)
        self.save_hyperparameters()


def test_load_from_checkpoint_strict_false_keeps_what_is_missing_and_map_location_places_it(tmp_path):
    class Plain(Regressor):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

    original = Plain(lr=0.3)
    path = _checkpoint_of(original, tmp_path)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"extra.weight\""):
        Wider.load_from_checkpoint(path)
    loaded = Wider.load_from_checkpoint(path, map_location=lambda storage, location: storage, strict=False)
    torch.testing.assert_close(loaded.net[0].weight, original.net[0].weight, rtol=0, atol=0)
    loaded = Wider.load_from_checkpoint(path, map_location=torch.device("cpu"), strict=False, lr=0.9)
    assert loaded.device == torch.device("cpu") and loaded.hparams.lr == 0.9


def test_hparams_file_updates_the_saved_hyperparameters_and_keywords_win(tmp_path):
    class Plain(Regressor):
        def __init__(self, lr: float = 0.1, dropout: float = 0.0) -> None:
            super().__init__(lr=lr, dropout=dropout)
            self.save_hyperparameters()

    path = _checkpoint_of(Plain(lr=0.3), tmp_path)
    (tmp_path / "hparams.yaml").write_text("lr: 0.6\ndropout: 0.2\n")
    loaded = Plain.load_from_checkpoint(path, hparams_file=tmp_path / "hparams.yaml", dropout=0.1)
    assert dict(loaded.hparams) == {"lr": 0.6, "dropout": 0.1}
    with pytest.raises(ValueError, match=r"pass a \.yaml or \.yml file"):
        Plain.load_from_checkpoint(path, hparams_file=tmp_path / "hparams.json")
