"""Intermediates between pipeline stages: the previous stage's hidden states and residual
arrive in this stage's persistent buffers (whose addresses its graphs captured) and this
stage's output goes to the next one. Outside the graphs; NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ostinato.distributed.parallel import Rank
from ostinato.models.base import IntermediateTensors


class PipelineLink:
    def __init__(self, rank: Rank) -> None:
        self.prev = rank.peer(rank.pp_rank - 1) if not rank.is_first_stage else None
        self.next = rank.peer(rank.pp_rank + 1) if not rank.is_last_stage else None

    def recv(self, into: IntermediateTensors) -> None:
        dist.recv(into.hidden_states, self.prev)
        dist.recv(into.residual, self.prev)

    def send(self, out: IntermediateTensors) -> None:
        dist.send(out.hidden_states, self.next)
        dist.send(out.residual, self.next)


class SampleShare:
    """Async scheduling with several processes: each sampled step's tokens go from the sampling
    rank (the last stage's first tensor rank) to the first stage's ranks, whose next step may
    embed them (its placeholders). One broadcast per sampled step on a group of exactly those
    ranks, issued without waiting (async_op): on GPUs it runs on that group's own stream beside
    the next step's launch, and a rank waits for it only when a step needs its tokens."""

    KEEP = 8  # broadcasts held before the oldest is waited on (long done by then)

    def __init__(self, rank: Rank, group: dist.ProcessGroup, src: int) -> None:
        self.group, self.src, self.is_src = group, src, rank.rank == src
        self._sent: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def share(self, rows: int, tokens: torch.Tensor | None, device: torch.device) -> None:
        """Every member calls this for every sampled step, in order: the source with the
        step's tokens (one per logits row), the others with None (rows: how many arrive)."""
        if self.is_src:
            buffer = tokens.to(torch.int64).contiguous()
        else:
            buffer = torch.empty(rows, dtype=torch.int64, device=device)
        work = dist.broadcast(buffer, self.src, group=self.group, async_op=True)
        self._sent.append((work, buffer))
        while len(self._sent) > self.KEEP:
            self._sent.popleft()[0].wait()

    def latest(self) -> torch.Tensor:
        """The last shared step's tokens (the stream waits for them: on GPUs the host does
        not)."""
        work, buffer = self._sent[-1]
        work.wait()
        return buffer
