"""A task of one's own from the command line: a user's config folder, or a class by its import path."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from syncline.lab.cluster import namespaces_unavailable
from syncline.trainer.cli import check_overrides, constructor_keys, task_by_target

MYTASK = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from syncline import Task


    class Classifier(Task):
        def __init__(self, lr: float = 0.1, hidden: int = 8) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))
            g = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=16, shuffle=True)

        def val_dataloader(self):
            return DataLoader(self.data, batch_size=32)
    """
)


MYDATA = textwrap.dedent(
    """
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from syncline import DataModule


    class Blobs(DataModule):
        def __init__(self, batch_size: int = 16, n: int = 48) -> None:
            super().__init__()
            self.save_hyperparameters()

        def prepare_data(self):
            Path("prepared.txt").write_text("yes")

        def setup(self, stage):
            g = torch.Generator().manual_seed(1)
            n = self.hparams.n
            self.data = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))

        def train_dataloader(self):
            with open("loaders.txt", "a") as file:
                file.write(f"train {len(self.data)} {self.hparams.batch_size}\\n")
            return DataLoader(self.data, batch_size=self.hparams.batch_size, shuffle=True)
    """
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's folder: mytask.py, mydata.py, conf/task/mytask.yaml and conf/data/blobs.yaml; importable, as
    from the working directory."""
    (tmp_path / "mytask.py").write_text(MYTASK)
    (tmp_path / "mydata.py").write_text(MYDATA)
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "task" / "mytask.yaml").write_text("_target_: mytask.Classifier\nlr: 0.05\nhidden: 16\n")
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "blobs.yaml").write_text("_target_: mydata.Blobs\nbatch_size: 12\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "syncline", *args, "trainer.max_steps=2", "callbacks=[]", "trainer.limit_val_batches=1"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    ("args", "task"),
    [
        (["--config-dir", "conf", "task=mytask"], {"_target_": "mytask.Classifier", "lr": 0.05, "hidden": 16}),
        # The class's own defaults apply; the default task's arguments (n_layer, ...) are not merged in.
        (["task._target_=mytask.Classifier", "task.hidden=4"], {"_target_": "mytask.Classifier", "hidden": 4}),
    ],
    ids=["config-dir", "class-path"],
)
def test_own_task_trains_from_the_command_line(project, args, task):
    out = project / "run"
    result = _cli(*args, f"hydra.run.dir={out}", cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    assert OmegaConf.to_container(OmegaConf.load(out / "config.yaml").task) == task
    hparams = OmegaConf.load(out / "lightning_logs" / "version_0" / "hparams.yaml")
    assert hparams.hidden == task["hidden"]


def test_task_by_target_replaces_the_default_task_only_without_a_task_choice():
    def rewritten(args):
        return constructor_keys(task_by_target(args))

    assert rewritten(["task._target_=m.C", "task.lr=1", "trainer.max_epochs=2"]) == [
        "~task",
        "++task._target_=m.C",
        "++task.lr=1",
        "trainer.max_epochs=2",
    ]
    assert rewritten(["+task.lr=1", "task._target_=m.C"]) == ["~task", "+task.lr=1", "++task._target_=m.C"]
    # With a task=<option> choice the user overrides that option's target and keeps its arguments.
    assert task_by_target(["task=mine", "task._target_=m.C"]) == ["task=mine", "task._target_=m.C"]
    assert task_by_target(["trainer.max_epochs=2"]) == ["trainer.max_epochs=2"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # Hydra's flags no longer switch the check off (it printed Hydra's raw error with rc 1).
        (["--config-dir", "conf", "task=mytask", "trainer.max_epoch=2"], "Did you mean 'max_epochs'?"),
        (["-cd", "conf", "task=mytsk"], "unknown task option 'mytsk'. Did you mean 'mytask'?"),
        (["task=mytask"], "with --config-dir <folder>"),
        (["task=mytask"], "task._target_=<module>.<Class>"),
        (["task._target_=mytask.Classifier", "task.lrr=0.1"], "takes no argument 'lrr'. Did you mean 'lr'?"),
        (["--config-dir", "conf", "task=mytask", "task.hiden=3"], "Did you mean 'hidden'?"),
        (["task._target_=mytask.Clasifier"], "cannot import task._target_=mytask.Clasifier"),
        (["--cfg", "job", "trainer.max_epochz=2"], "Did you mean 'max_epochs'?"),
    ],
)
def test_check_overrides_understands_hydra_flags_and_own_tasks(project, args, expected):
    message = check_overrides(constructor_keys(task_by_target(args)))
    assert message is not None and expected in message, message
    assert len(message.splitlines()) <= 3


def test_check_overrides_accepts_own_tasks_and_leaves_help_and_sweeps_to_hydra(project):
    assert check_overrides(["--config-dir", "conf", "task=mytask", "task.lr=0.5"]) is None
    assert check_overrides(constructor_keys(task_by_target(["task._target_=mytask.Classifier", "task.lr=0.5"]))) is None
    assert check_overrides(["--help"]) is None
    assert check_overrides(["-m", "trainer.max_epochs=1,2"]) is None


def test_cli_exits_2_with_the_suggestion_when_a_flag_is_given(project):
    result = _cli("--config-dir", "conf", "task=mytask", "trainer.max_epoch=2", cwd=project)
    assert result.returncode == 2
    assert "Did you mean 'max_epochs'?" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr


@pytest.mark.parametrize(
    ("args", "data"),
    [
        (["--config-dir", "conf", "data=blobs"], {"_target_": "mydata.Blobs", "batch_size": 12}),
        (["data._target_=mydata.Blobs", "data.n=40"], {"_target_": "mydata.Blobs", "n": 40}),
    ],
    ids=["config-dir", "class-path"],
)
def test_a_datamodule_gives_the_data_from_the_command_line(project, args, data):
    out = project / "run"
    result = _cli(*args, "task._target_=mytask.Classifier", f"hydra.run.dir={out}", cwd=project)
    assert result.returncode == 0, result.stderr[-3000:]
    assert OmegaConf.to_container(OmegaConf.load(out / "config.yaml").data) == data
    assert (project / "prepared.txt").read_text() == "yes"
    n, batch_size = data.get("n", 48), data.get("batch_size", 16)
    # The DataModule's loader, not the task's own (64 samples in batches of 16), fed the training.
    assert (project / "loaders.txt").read_text() == f"train {n} {batch_size}\n"
    hparams = OmegaConf.load(out / "lightning_logs" / "version_0" / "hparams.yaml")
    assert hparams.batch_size == batch_size and hparams.lr == 0.1  # the task's and the DataModule's


def test_task_by_target_lets_data_target_add_a_datamodule():
    assert constructor_keys(task_by_target(["data._target_=m.D", "data.n=3"])) == ["++data._target_=m.D", "++data.n=3"]
    assert task_by_target(["data=mine", "data.n=3"]) == ["data=mine", "data.n=3"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["data._target_=mydata.Blobs", "data.batch_sise=8"], "takes no argument 'batch_sise'. Did you mean"),
        (["-cd", "conf", "data=blob"], "unknown data option 'blob'. Did you mean 'blobs'?"),
        (["data._target_=mydata.Blops"], "cannot import data._target_=mydata.Blops"),
    ],
)
def test_check_overrides_names_a_bad_datamodule(project, args, expected):
    message = check_overrides(constructor_keys(task_by_target(args)))
    assert message is not None and expected in message, message


# ------------------------------------------------ as a user installs it
@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with syncline installed from this checkout, not editable, as a user installs it; its
    dependencies (torch, hydra, ...) come from the test run's own environment through a .pth file."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    repo = Path(__file__).resolve().parents[2]
    # The build takes setuptools from the index or the wheel cache, like a user's `pip install <checkout>`.
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(repo)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    deps = [path for path in sys.path if path.endswith("site-packages")]
    (_site(python) / "test_deps.pth").write_text("\n".join(deps) + "\n")
    return venv


def _site(python: Path) -> Path:
    return python.parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _user(venv: Path, cwd: Path, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / command[0]), *command[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )


def test_the_installed_package_is_not_the_checkout(installed, project):
    result = _user(installed, project, "python", "-c", "import syncline; print(syncline.__file__)")
    assert result.returncode == 0, result.stderr
    assert str(installed) in result.stdout and "site-packages" in result.stdout


def test_a_users_task_gets_the_trainers_defaults_not_the_examples(installed, project):
    out = project / "run"
    result = _user(
        installed, project, "python", "-m", "syncline", "task._target_=mytask.Classifier", "trainer.max_steps=2",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={out}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    trainer = OmegaConf.load(out / "config.yaml").trainer
    # Lightning's Trainer defaults: every validation batch, validation once an epoch, no seed.
    assert trainer.limit_val_batches is None and trainer.val_check_interval == 1.0 and trainer.seed is None
    assert trainer.max_epochs is None and trainer.log_every_n_steps == 50
    assert "settings other than the Trainer's defaults: max_steps=2, enable_progress_bar=False" in result.stdout


def test_the_example_keeps_its_own_run_settings(installed, project):
    result = _user(installed, project, "python", "-m", "syncline", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    cfg = OmegaConf.create(result.stdout)
    assert cfg.trainer.limit_val_batches == 20 and cfg.trainer.val_check_interval == 0.25 and cfg.seed == 1234


def test_the_console_script_imports_a_task_from_the_working_directory(installed, project):
    out = project / "run"
    result = _user(
        installed, project, "syncline", "--config-dir", "conf", "task=mytask", "task.hidden=32",
        "trainer.max_steps=2", "trainer.enable_progress_bar=false", f"hydra.run.dir={out}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # A constructor argument that the option's YAML does not list is set without Hydra's "+".
    assert OmegaConf.load(out / "lightning_logs" / "version_0" / "hparams.yaml").hidden == 32


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["task._target_=mytask.Classifier", "task.hidden=abc"],
            "task.hidden=abc: mytask.Classifier takes hidden: int",
        ),
        (["--config-dir", "conf", "task=mytask", "task.lr=fast"], "task.lr=fast: mytask.Classifier takes lr: float"),
        (["--config-dir", "conf", "task=mytask", "data=blobs", "data.n=1.5"], "data.n=1.5: mydata.Blobs takes n: int"),
    ],
)
def test_task_and_data_arguments_are_checked_against_their_annotations(installed, project, args, expected):
    result = _user(installed, project, "syncline", *args)
    assert result.returncode == 2
    assert expected in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (project / "outputs").exists()  # refused before Hydra made a run folder


def test_constructor_keys_lets_task_and_data_keys_be_added():
    assert constructor_keys(["task.hidden=3", "+task.a=1", "data.n=2", "trainer.max_steps=1", "task=mine"]) == [
        "++task.hidden=3",
        "+task.a=1",
        "++data.n=2",
        "trainer.max_steps=1",
        "task=mine",
    ]


def test_the_installed_lab_answers_from_the_users_folder_without_the_paper_scripts(installed, project):
    result = _user(installed, project, "python", "-m", "syncline.lab", "--help")
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("cluster", "strategies", "tradeoff", "faults"))
    result = _user(installed, project, "python", "-c", "import syncline.benchmarks")
    assert "No module named 'syncline.benchmarks'" in result.stderr


@pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))
def test_the_lab_runs_a_users_cli_task_from_their_folder(installed, project):
    """The installed lab, from the user's folder: 2 nodes at 100 Mbit/s, one output folder, a step report."""
    result = _user(
        installed, project, "python", "-m", "syncline.lab", "cluster", "--nodes", "2", "--rate",
        "100mbit", "--timeout", "100", "--log-dir", str(project / "lab"), "--json", str(project / "lab.json"), "--",
        "-m", "syncline", "--config-dir", "conf", "task=mytask", "trainer.max_steps=6", "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((project / "lab.json").read_text())
    assert report["lab"]["nodes"] == 2 and all(node["returncode"] == 0 for node in report["lab"]["node_results"])
    steps = report["steps"]
    assert steps["steps"] == 6 and steps["seconds_per_step"] > 0 and min(steps["bytes_per_step"]) > 0
    assert 0 < steps["wire_seconds"] < steps["seconds_per_step"]
    assert "6 steps:" in result.stdout and "s per step" in result.stdout
    (run,) = (project / "outputs").iterdir()  # one folder for both nodes, in the user's folder
    assert (run / "config.yaml").is_file()
    assert (run / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_the_documented_lab_example_trains(tmp_path):
    """docs/strategies.md's worked example (snippets.py) trains from its own folder, as the lab runs it."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "strategies.md").read_text()
    code = docs.split("```python\n# snippets.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "snippets.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "syncline", "task._target_=snippets.Snippets", "trainer.max_steps=3",
         "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 3
    assert checkpoint["state_dict"]["net.2.weight"].shape == (1024, 32 * 64)  # the 2.1 M parameters the docs name


def test_the_documented_lab_table_is_the_committed_measurement():
    root = Path(__file__).resolve().parents[2]
    docs = (root / "docs" / "strategies.md").read_text().split("<!-- lab-user-task -->")[1].split("<!-- /lab")[0]
    measured = json.loads((root / "benchmarks" / "results" / "lab_user_task.json").read_text())["strategies"]
    rows = {line.split(" | ")[0].strip("| "): line for line in docs.splitlines() if line.startswith("| ")}
    for name, runs in measured.items():
        seconds = ", ".join(f"{run['seconds_per_step']:.3f}" for run in runs if "seconds_per_step" in run)
        assert (seconds or "refused") in rows[name], (name, rows[name])
