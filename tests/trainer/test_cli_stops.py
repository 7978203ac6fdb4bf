"""The CLI's stops: SIGTERM exits 75 naming last.ckpt; a bad option never launches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from syncline.trainer.preemption import PREEMPTED_EXIT_CODE
from tests.trainer.test_cli import SMALL, _assert_short_error, _cli


def test_an_option_that_cannot_work_on_the_devices_is_refused_before_launch(tmp_path):
    start = time.monotonic()
    result = _cli(
        "strategy=parameter_server",
        "strategy.server_rank=5",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        *SMALL,
        cwd=tmp_path,
    )
    _assert_short_error(result, 2, "server_rank=5) needs at least 6 processes, but the job has 2")
    assert time.monotonic() - start < 60


def _has_checkpoint(out):
    try:
        return bool(list(out.rglob("*.ckpt")))
    except FileNotFoundError:  # a folder that ModelCheckpoint's write check made and removed while it was listed
        return False


def test_sigterm_to_the_cli_stops_every_rank_with_last_ckpt_and_status_75(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "syncline",
            f"hydra.run.dir={out}",
            "trainer.devices=2",
            "trainer.accelerator=cpu",
            "trainer.max_epochs=99",
        ]
        + SMALL,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        # Training has begun once the first periodic checkpoint (every 3 steps) is there.
        while not _has_checkpoint(out) and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)  # docker stop, Kubernetes, a batch scheduler
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    (last,) = out.rglob("last.ckpt")
    assert f"saved {last}" in stderr
    assert "interrupted" not in stderr
