"""Intermediates between pipeline stages: the previous stage's hidden states and residual
arrive in this stage's persistent buffers (whose addresses its graphs captured) and this
stage's output goes to the next one. Outside the graphs; NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

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
