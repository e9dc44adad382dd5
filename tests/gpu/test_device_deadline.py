"""Host waits on the device with a deadline (issue 23), on a real CUDA event: a stream kept
busy past the deadline raises DeviceTimeout after it; a finished one returns at once."""

import time

import pytest
import torch

from ostinato.runner.deadline import DeviceTimeout, wait_for

pytestmark = pytest.mark.gpu


def test_a_busy_stream_times_out_and_a_done_one_returns():
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of spinning on the device
    busy = torch.cuda.Event()
    busy.record()
    start = time.monotonic()
    with pytest.raises(DeviceTimeout, match="the test's kernel within distributed_timeout"):
        wait_for(busy, 0.05, "the test's kernel")
    assert time.monotonic() - start < 0.5
    wait_for(busy, 30, "the test's kernel")  # it does end
    assert busy.query()
