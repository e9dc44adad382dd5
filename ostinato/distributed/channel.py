"""Control messages between the driver and the workers: pickled objects over a gloo group.

Sends never block the sender (gloo's `send` waits for the receiver to post its `recv`, which
would stall the driver behind the slowest stage); each payload stays referenced until its
send is reaped. Receives block: a worker waits for its next step as long as the engine idles
(the group's timeout is long for that reason), and a receive from a process that died fails
at once with the connection closed.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch
import torch.distributed as dist

_MAX_PENDING = 64  # sends kept before the oldest is waited on (long delivered by then)


class Channel:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def send(self, obj: object, dst: int) -> None:
        data = torch.frombuffer(
            bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
        )
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for tensor in (size, data):
            self._pending.append((dist.isend(tensor, dst, group=self.group), tensor))
        while len(self._pending) > _MAX_PENDING:
            self._pending.popleft()[0].wait()

    def recv(self, src: int) -> object:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.group)
        return pickle.loads(data.numpy().tobytes())

    def flush(self) -> None:
        """Wait until every message sent so far was received."""
        while self._pending:
            self._pending.popleft()[0].wait()
