"""BucketedDDP(bucket_cap_mb="auto") in real gloo processes: same cap everywhere, same math as a fixed cap."""

from __future__ import annotations

import pytest
import torch
from _averaging import flat_params, straight_and_resumed

from syncline.callbacks import Callback
from syncline.options import OptionError
from syncline.strategies import BucketedDDP, ByteGrad, LocalSGD, PowerSGD, QAdam
from syncline.strategies.comm.bucket_autotune import BucketAutotune, distinct_caps
from syncline.strategies.parameter_server import ParameterServer
from syncline.strategies.sharded_parameter_server import ShardedParameterServer
from syncline.testing import run_distributed
from syncline.trainer import Trainer
from tests.trainer._tasks import Regressor, loader, quiet, regression_data

# The regressor's 644 bytes of gradients, with a first bucket of one parameter: cap 0 gives 4 buckets,
# 0.0003 MiB (314 bytes) 3 and 1 MiB 2, so every trial lays out other buckets.
CAPS = (0.0, 0.0003, 1.0)
BUCKETS = {0.0: 4, 0.0003: 3, 1.0: 2}
TUNING_STEPS = len(CAPS) * 2  # one warm-up and one timed step per cap


def _auto() -> BucketedDDP:
    return BucketedDDP(bucket_cap_mb="auto", first_bucket_mb=0, autotune_caps_mb=CAPS, autotune_steps=1)


class _PerStep(Callback):
    """The cap and the number of buckets of every synchronized step, as the strategy reports them."""

    def __init__(self) -> None:
        self.steps = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        # Every micro-batch takes a step here (no accumulation); Lightning's on_before_zero_grad would come
        # before the next step's backward instead.
        stats = trainer.strategy.communication_stats()
        self.steps.append((stats["comm/bucket_cap_mb"], int(stats["comm/buckets"])))


def _fit(strategy, callbacks=()):
    torch.manual_seed(0)
    task = Regressor(lr=0.05)
    data = regression_data(64)
    trainer = Trainer(strategy=strategy, callbacks=list(callbacks), **quiet(max_steps=10, num_sanity_val_steps=0))
    trainer.fit(task, loader(data, 4, shuffle=True))
    return trainer, task


def _autotune_runs(rank, world_size, tmp):
    per_step = _PerStep()
    auto, auto_task = _fit(_auto(), [per_step])
    _, fixed_task = _fit(BucketedDDP(first_bucket_mb=0))
    runs = straight_and_resumed(rank, world_size, tmp, _auto, 7, 10)
    # Equal trial times on every rank: the tie goes to the larger cap.
    tie = BucketAutotune([0.5, 2.0], steps=1)
    for seconds in (1.0, 0.01, 1.0, 0.01):
        tie.observe(seconds, torch.device("cpu"))
    return {
        "auto": flat_params(auto_task),
        "fixed": flat_params(fixed_task),
        "tuner": auto.strategy.autotune.state_dict(),
        "per_step": per_step.steps,
        "runs": runs,
        "tie": tie.chosen_mb,
    }


def test_autotune_agrees_on_one_cap_keeps_the_math_and_resumes_without_tuning(tmp_path):
    ranks = run_distributed(_autotune_runs, world_size=2, args=(str(tmp_path),), timeout=120)
    chosen = ranks[0]["tuner"]["chosen_mb"]
    assert chosen in CAPS
    for result in ranks:
        tuner = result["tuner"]
        # Every rank compared the same (slowest-rank) medians and so chose the same cap.
        assert tuner["chosen_mb"] == chosen and tuner["agreed_ms"] == ranks[0]["tuner"]["agreed_ms"]
        assert [cap for cap, _ in tuner["agreed_ms"]] == list(CAPS)
        # Each cap ran its warm-up and timed step with its own layout, then training went on with the choice.
        expected_caps = [cap for cap in CAPS for _ in range(2)] + [chosen] * (10 - TUNING_STEPS)
        assert result["per_step"] == [(cap, BUCKETS[cap]) for cap in expected_caps]
        # Regrouping gradients never changes their average.
        torch.testing.assert_close(result["auto"], result["fixed"], rtol=0, atol=1e-6)
        # A run resumed after tuning takes the saved cap and does not tune again (it would need 6 more steps).
        resumed = result["runs"]["resumed"]
        assert resumed["state"]["autotune"]["observed"] == TUNING_STEPS
        assert resumed["state"]["autotune"]["chosen_mb"] in CAPS
        assert torch.equal(resumed["weights"], result["runs"]["straight"]["weights"])
        assert result["tie"] == 2.0
    torch.testing.assert_close(ranks[0]["auto"], ranks[1]["auto"], rtol=0, atol=0)


def test_caps_that_cannot_change_the_layout_are_tried_once():
    # 10 MiB of gradients: 25 and 100 both give one bucket after the first, so only 25 is tried.
    assert distinct_caps([100, 1, 25, 5], [10 * 2**20]) == [1, 5, 25]
    assert distinct_caps([1, 5], [512]) == [1]
    assert BucketAutotune([1.0], steps=2).chosen_mb == 1.0  # nothing to compare: no trial at all


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ByteGrad(bucket_cap_mb="auto"), "ByteGrad(bucket_cap_mb='auto'): its hook compresses"),
        (lambda: PowerSGD(bucket_cap_mb="auto"), "PowerSGD(bucket_cap_mb='auto'): its hook compresses"),
        (lambda: QAdam(bucket_cap_mb="auto"), "QAdam(bucket_cap_mb='auto'): its buckets all-reduce"),
        (lambda: LocalSGD(bucket_cap_mb="auto"), "LocalSGD(bucket_cap_mb='auto'): its buckets all-reduce"),
        (lambda: ParameterServer(bucket_cap_mb="auto"), "ParameterServer(bucket_cap_mb='auto'): the time"),
        (lambda: ShardedParameterServer(bucket_cap_mb="auto"), "ShardedParameterServer(bucket_cap_mb='auto'): each"),
        (lambda: BucketedDDP(bucket_cap_mb="fast"), "BucketedDDP(bucket_cap_mb='fast'): bucket_cap_mb must be"),
        (lambda: BucketedDDP(bucket_cap_mb="auto", autotune_caps_mb=[]), "give a non-empty list"),
        (lambda: BucketedDDP(bucket_cap_mb="auto", autotune_steps=0), "autotune_steps must be an int >= 1"),
    ],
)
def test_auto_is_refused_at_construction_where_it_cannot_work(make, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()
