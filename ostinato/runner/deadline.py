"""Host waits on the device with a deadline.

With several processes a step's kernels may wait on a peer (an all-reduce, a transfer) that
never comes; a plain `event.synchronize()` would then block the host for good, out of reach
of every timeout. With a deadline the wait polls the event and fails after it, so the engine
stops with an error instead of hanging.
"""

from __future__ import annotations

import time
from typing import Protocol


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceTimeout(TimeoutError):
    """The device did not reach an event in time: a peer it waits on is stuck or gone."""


_SPIN_S = 0.002  # poll without sleeping this long first: a decode step is about a millisecond


def wait_for(event: DeviceEvent, timeout: float | None, what: str) -> None:
    """Block until the device has passed `event`; with a timeout (seconds), raise
    DeviceTimeout naming `what` once it is over."""
    if timeout is None:
        event.synchronize()
        return
    start = time.monotonic()
    pause = 0.0
    while not event.query():
        waited = time.monotonic() - start
        if waited > timeout:
            raise DeviceTimeout(
                f"the device did not finish {what} within distributed_timeout={timeout:g} s: "
                "a collective or transfer of the step waits on a rank that is stuck or gone"
            )
        if waited > _SPIN_S:
            pause = min(max(pause * 2, 1e-5), 1e-3)
            time.sleep(pause)
