"""The one byte counter every strategy holds: steps close at the optimizer step, totals accumulate."""

from __future__ import annotations

import torch

from syncline.strategies.comm.counter import CommCounter
from syncline.strategies.single_device import SingleDevice


def test_a_step_reports_what_was_counted_since_the_last_step_and_the_total_keeps_growing():
    counter = CommCounter()
    counter.add(10)
    counter.add_tensors(torch.zeros(3), torch.zeros(2, dtype=torch.float16))  # 12 + 4 bytes
    assert counter.as_dict() == {"comm/bytes": 0.0, "comm/total_bytes": 26.0}  # the step is still open
    counter.close_step()
    assert counter.as_dict() == {"comm/bytes": 26.0, "comm/total_bytes": 26.0}
    counter.close_step()  # a step without communication (e.g. local SGD between averagings)
    assert counter.as_dict() == {"comm/bytes": 0.0, "comm/total_bytes": 26.0}


def test_one_process_communicates_nothing():
    strategy = SingleDevice()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    strategy.optimizer_step(optimizer, optimizer.step)
    assert strategy.communication_stats() == {"comm/bytes": 0.0, "comm/total_bytes": 0.0}
