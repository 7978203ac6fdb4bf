"""`Trainer(recovery="live")` with real processes: one of 3 workers (of 4 in one test) is SIGKILLed mid-epoch.

Each run trains `LiveProbe` (tests/trainer/_live.py) for 2 epochs of 96 samples on 3 local workers, the
worker holding rank 1 killing itself at step 2. The probe logs every step's samples per process, so the
tests read from the logs alone: who trained which samples at which step and world size, and each
process's final step and weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from syncline.options import OptionError
from syncline.trainer import Trainer
from tests.trainer._faults import run_script

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="SIGKILLs a worker")

_SCRIPT = """
import os
import sys
from syncline.strategies import BucketedDDP
from syncline.strategies.diloco import DiLoCo
from syncline.trainer import Trainer
from tests.trainer._live import LiveProbe

if __name__ == "__main__":
    task = LiveProbe(
        {logs!r}, victim=1, at_step=2, step_s={step_s}, second={second}, fault={fault!r}, preempt_at={preempt_at},
        caller=os.getpid(), replaced={restarts} > 0,
    )
    trainer = Trainer(
        max_epochs={epochs}, devices={devices}, strategy={strategy}, accelerator="cpu", recovery="live",
        max_restarts={restarts}, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        num_sanity_val_steps=0, default_root_dir={root!r}, limit_train_batches={limit},
    )
    try:
        trainer.fit(task)
    except Exception as error:
        print(f"{{type(error).__name__}}: {{error}}")
        sys.exit(1)
    print("finished at step", trainer.global_step)
"""


def _run(
    tmp_path: Path,
    strategy: str,
    second: bool = False,
    restarts: int = 1,
    fault: str = "kill",
    preempt_at: int = -1,
    limit: int | None = None,
    devices: int = 3,
    epochs: int = 2,
):
    """Run the script with `strategy`, a registered name or a constructor call (Python source)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    source = strategy if "(" in strategy else repr(strategy)
    body = _SCRIPT.format(
        logs=str(logs), root=str(tmp_path), strategy=source, step_s=0.6, second=second, restarts=restarts,
        fault=fault, preempt_at=preempt_at, limit=limit, devices=devices, epochs=epochs,
    )  # fmt: skip
    result, _ = run_script(tmp_path, body, timeout=420)
    steps = {}
    for path in logs.glob("*.log"):
        steps[int(path.stem)] = [line.split() for line in path.read_text().splitlines()]
    ends = {int(p.stem): p.read_text().split() for p in logs.glob("*.end")}
    return result, steps, ends


def _check_recovered(result, steps, ends, exact: bool) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    original = {pid for pid, lines in steps.items() if lines and lines[0][:2] == ["0", "0"]}
    assert len(original) == 3
    survivors = original & set(ends)
    assert len(survivors) == 2, (sorted(original), sorted(ends))
    replacements = set(ends) - original
    assert len(replacements) == 1, "a replacement finishes the run"
    for pid in survivors:
        numbers = [(int(epoch), int(step)) for epoch, step, *_ in steps[pid]]
        assert all(later[1] >= earlier[1] - 1 for earlier, later in zip(numbers, numbers[1:])), numbers
        # At 2 until the replacement came in (or at 3 at once, when it was up before the survivors' new round).
        assert int(steps[pid][-1][2]) == 3, "the survivors took in the replacement"
    _check_every_sample(steps)
    final = {tuple(end) for end in ends.values()}
    if exact:
        assert len(final) == 1, f"replicas disagree at the end: {final}"
    assert not list(result.args and Path(result.args[-1]).parent.rglob("*.ckpt"))


def _check_every_sample(steps, epochs: tuple[str, ...] = ("0", "1")) -> None:
    for epoch in epochs:
        trained = {
            int(i) for lines in steps.values() for e, _, _, ids, *_ in lines if e == epoch for i in ids.split(",")
        }
        assert trained == set(range(96)), f"epoch {epoch} missed {sorted(set(range(96)) - trained)}"


_DILOCO = "DiLoCo(period=4)"
#: Streaming: fragment 1's exchange (launched after step 2, overlapped with step 3) is on the wire when the victim
#: dies in step 3; 8-bit outer gradients with error feedback.
_STREAMING = 'DiLoCo(period=4, fragments=2, compression="uint8")'


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "local_sgd", _DILOCO, _STREAMING])
def test_a_killed_worker_costs_one_step_and_is_replaced_live(tmp_path: Path, strategy: str) -> None:
    result, steps, ends = _run(tmp_path, strategy)
    _check_recovered(result, steps, ends, exact=strategy == "bucketed_ddp")
    if strategy.startswith("DiLoCo"):
        # The outer state (θ̃, outer momentum, step count) is the group's: bit for bit the same on the two
        # survivors and the replacement, after the outer steps that followed the death and the admission.
        assert len({end[2] for end in ends.values()}) == 1, ends
        healed = [path.read_text() for path in (tmp_path / "logs").glob("*.healed")]
        assert healed == ["1"], "the replacement's replica starts at the global copies θ̃"
    if strategy == _DILOCO:
        # One fragment, no overlap: right after each outer step every replica is θ̃. The steps that start there
        # with all three members (the replacement among them) start from the same weights, bit for bit.
        starts: dict[int, dict[int, str]] = {}
        for pid, lines in steps.items():
            for _, _, world, _, inner, digest in lines:
                if world == "3" and int(inner) > 0 and int(inner) % 4 == 0:
                    starts.setdefault(int(inner), {})[pid] = digest
        together = [by_pid for by_pid in starts.values() if len(by_pid) == 3]
        assert together and all(len(set(by_pid.values())) == 1 for by_pid in together), starts


def test_a_second_death_right_after_healing_is_a_second_recovery(tmp_path: Path) -> None:
    result, steps, ends = _run(tmp_path, "bucketed_ddp", second=True, restarts=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert len(list((tmp_path / "logs").glob("*.killed"))) == 2, "two members died"
    original = {pid for pid, lines in steps.items() if lines and lines[0][:2] == ["0", "0"]}
    assert len(original & set(ends)) == 1, "one of the first three lived through both deaths"
    assert len(ends) == 3 and len({tuple(end) for end in ends.values()}) == 1, ends
    _check_every_sample(steps)


def _seconds_to_first_step_at(tmp_path: Path, steps, world: str, since: str) -> dict[int, float]:
    """Per survivor (a process whose last step ran at `world`), seconds from the time in ``*.<since>`` to its first
    step at that world size (one line per step in both its logs)."""
    start = float(next((tmp_path / "logs").glob(f"*.{since}")).read_text())
    lost = {}
    for pid, lines in steps.items():
        if lines[-1][2] != world:
            continue
        times = (tmp_path / "logs" / f"{pid}.times").read_text().splitlines()
        first = next(i for i, line in enumerate(lines) if line[2] == world)
        lost[pid] = float(times[first].split()[1]) - start
    return lost


def test_with_four_members_no_survivor_waits_out_its_collective_timeout(tmp_path: Path) -> None:
    # gloo's ring: rank 3 is not next to the dead rank 1, and its all-reduce sees no closed connection. The first
    # member whose collective fails posts the loss; every member's watch aborts its group, so rank 3's blocked
    # all-reduce fails at once too instead of after the 60 s timeout.
    result, steps, _ = _run(tmp_path, "BucketedDDP(timeout=60)", restarts=0, devices=4, epochs=1, limit=4)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lost = _seconds_to_first_step_at(tmp_path, steps, "3", since="killed")
    assert len(lost) == 3, steps
    assert max(lost.values()) < 30, f"seconds from the death to each survivor's first step after it: {lost}"


def test_a_frozen_member_is_dropped_by_its_keep_alives_not_the_collective_timeout(tmp_path: Path) -> None:
    # SIGSTOP: its connections stay open (as a node's whose link is cut), so no survivor's collective fails; the
    # survivors' watches see its keep-alives stop and post the loss.
    result, steps, _ = _run(tmp_path, "BucketedDDP(timeout=120)", restarts=0, epochs=1, fault="stop")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lost = _seconds_to_first_step_at(tmp_path, steps, "2", since="stopped")
    assert len(lost) == 2, steps
    # Measured 7.5 s (6 s without keep-alives, then the new round); the collective timeout is 120 s.
    assert max(lost.values()) < 40, f"seconds from the freeze to each survivor's first step after it: {lost}"
    _check_every_sample(steps, epochs=("0",))


def test_a_raise_still_ends_the_run_naming_the_rank(tmp_path: Path) -> None:
    result, steps, ends = _run(tmp_path, "bucketed_ddp", fault="raise")
    assert result.returncode == 1
    assert "WorkerFailedError: Worker rank 1 failed during fit: ValueError" in result.stdout, result.stdout[-3000:]
    assert "boom on rank 1" in result.stdout
    assert not ends, "nobody trained on after the raise"


def test_after_a_loss_the_limited_epoch_keeps_its_samples_and_sigterm_to_the_caller_saves_and_exits_75(
    tmp_path: Path,
) -> None:
    # No replacement: the two survivors finish the epoch. limit_train_batches=5 on 3 ranks is 60 samples an epoch
    # (of 96); after the loss at step 2 (24 trained), the other 36 take 5 steps on 2 ranks. Then SIGTERM to the
    # script that launched the workers, in the second epoch: every rank saves last.ckpt and the script exits 75.
    from syncline.trainer.live import LiveShardSampler

    result, steps, ends = _run(tmp_path, "bucketed_ddp", restarts=0, preempt_at=9, limit=5)
    assert result.returncode == 75, result.stdout[-2000:] + result.stderr[-4000:]
    assert "preempted: Stopped by SIGTERM" in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "last.ckpt").is_file()
    survivors = [lines for lines in steps.values() if lines[-1][2] == "2"]
    assert len(survivors) == 2 and len(steps) == 3
    first_epoch = [(int(step), ids) for lines in survivors for epoch, step, _, ids, *_ in lines if epoch == "0"]
    assert sorted({step for step, _ in first_epoch}) == list(range(7)), "2 steps on 3 ranks, then 5 on 2"
    trained = {int(i) for lines in steps.values() for e, _, _, ids, *_ in lines if e == "0" for i in ids.split(",")}
    assert trained == set(LiveShardSampler(96, 4, True, 0, 0, 0, 0, 1, 0).order()[:60])
    assert {lines[-1][1] for lines in survivors} == {lines[-1][1] for lines in survivors[:1]}, "one last step"
    assert 9 <= int(survivors[0][-1][1]) <= 11 and not ends


def test_strategies_without_live_recovery_refuse_it_at_construction() -> None:
    with pytest.raises(OptionError, match=r'recovery="live".*PowerSGD'):
        Trainer(max_epochs=1, strategy="powersgd", devices=2, accelerator="cpu", recovery="live")
    with pytest.raises(OptionError, match="recovery="):
        Trainer(max_epochs=1, recovery="restart")
    with pytest.raises(OptionError, match=r"num_nodes=2\) launches the nodes itself under recovery=\"live\" only"):
        Trainer(max_epochs=1, num_nodes=2, strategy="bucketed_ddp", accelerator="cpu")


def test_several_nodes_need_node_0s_address_and_this_nodes_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.trainer._tasks import Regressor, loader, regression_data

    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    trainer = Trainer(max_epochs=1, num_nodes=2, recovery="live", strategy="bucketed_ddp", accelerator="cpu")
    with pytest.raises(OptionError, match="MASTER_ADDR and MASTER_PORT .* missing here: MASTER_PORT, NODE_RANK"):
        trainer.fit(Regressor(), loader(regression_data(8)))


def test_the_rest_of_an_epoch_is_split_over_the_new_members_without_losing_a_sample() -> None:
    from syncline.trainer.live import LiveShardSampler

    def shard(world: int, rank: int, consumed: int, skip: int) -> list[int]:
        return list(LiveShardSampler(97, 4, True, 7, 1, consumed, skip, world, rank))

    # 2 batches on 3 ranks (24 samples), then the rest on 2 ranks; every rank skips its 2 trained batches.
    first = [i for rank in range(3) for i in shard(3, rank, 0, 0)[:8]]
    rest = [shard(2, rank, 24, 2) for rank in range(2)]
    assert all(len(part) == len(rest[0]) for part in rest), "every rank has as many batches"
    later = [i for part in rest for i in part[8:]]
    order = LiveShardSampler(97, 4, True, 7, 1, 0, 0, 1, 0).order()
    assert sorted(first) == sorted(order[:24]), "the first segment is the epoch's first 24 samples"
    assert set(later) >= set(order[24:]) and set(first) | set(later) == set(range(97))
    assert len(later) - len(order[24:]) < 2 * 4, "padding fills the last global batch only"


def test_a_forked_worker_drops_the_handlers_its_agent_installed_and_keeps_what_the_agent_ignores() -> None:
    """A live worker is forked from its agent: it must start with the signal state a fresh interpreter would have
    (torch elastic's handler in the agent raises there; ignored signals stay ignored, as across exec)."""
    import signal

    from syncline.trainer.live_launch import _as_if_started_afresh

    names = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1)
    previous = {signum: signal.getsignal(signum) for signum in names}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        _as_if_started_afresh()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(wakeup)
