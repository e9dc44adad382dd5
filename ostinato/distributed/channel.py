"""Control messages between the driver and the workers: pickled objects over a gloo group.

Sends never block the sender (gloo's `send` waits for the receiver to post its `recv`, which
would stall the driver behind the slowest stage); each payload stays referenced until its
send is reaped. Receives block: a worker waits for its next step as long as the engine idles
(the group's timeout is long for that reason), and a receive from a process that died fails
at once with the connection closed.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections import deque

import torch
import torch.distributed as dist

_MAX_PENDING = 64  # sends kept before the oldest is waited on (long delivered by then)
_CHUNK = 1 << 14  # bytes per send: one carries a typical step; its length is in the first 8


class Channel:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(self, obj: object, dst: int) -> None:
        payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        message = bytearray(-(-(8 + len(payload)) // _CHUNK) * _CHUNK)
        message[:8] = len(payload).to_bytes(8, "little")
        message[8 : 8 + len(payload)] = payload
        data = torch.frombuffer(message, dtype=torch.uint8)
        for chunk in data.split(_CHUNK):
            self._pending.append((dist.isend(chunk, dst, group=self.group), data))
        while len(self._pending) > _MAX_PENDING:
            self._pending.popleft()[0].wait()

    def recv(self, src: int, timeout: float | None = None) -> object:
        """The next message from src; with a timeout (seconds), TimeoutError when none has
        arrived by then (the channel is then unusable: the caller stops the engine)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first = torch.empty(_CHUNK, dtype=torch.uint8)
        self._recv_into(first, src, deadline)
        size = int.from_bytes(first[:8].numpy().tobytes(), "little")
        chunks = [first]
        for _ in range((8 + size - 1) // _CHUNK):
            chunks.append(torch.empty(_CHUNK, dtype=torch.uint8))
            self._recv_into(chunks[-1], src, deadline)
        message = torch.cat(chunks) if len(chunks) > 1 else first
        return pickle.loads(message[8 : 8 + size].numpy().tobytes())

    def _recv_into(self, buffer: torch.Tensor, src: int, deadline: float | None) -> None:
        if deadline is None:
            dist.recv(buffer, src, group=self.group)
            return
        left = max(deadline - time.monotonic(), 0.001)
        try:
            dist.irecv(buffer, src, group=self.group).wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            if "Timed out" in str(e):
                raise TimeoutError(f"no message from rank {src} in time") from e
            raise

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every message sent so far was received: True. With a timeout (seconds,
        for all of them), False once it passed; what was not received is given up."""
        if timeout is None:
            while self._pending:
                self._pending.popleft()[0].wait()
            return True
        deadline = time.monotonic() + timeout
        try:
            while self._pending:
                left = max(deadline - time.monotonic(), 0.001)
                self._pending[0][0].wait(timeout=datetime.timedelta(seconds=left))
                self._pending.popleft()
        except RuntimeError:  # timed out (or the receiver is gone)
            self._pending.clear()
            return False
        return True
