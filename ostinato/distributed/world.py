"""One process's view of the distributed engine: its rank, its device and its groups.

Every rank creates the same groups in the same order: the world group (NCCL on GPUs, gloo on
CPUs; it carries the stage-to-stage transfers), one tensor-parallel group per stage, and a
gloo group for control messages whose timeout is long enough to idle on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.config import EngineConfig
from ostinato.distributed.channel import Channel
from ostinato.distributed.parallel import Rank, TPGroup, set_tp_group

CONTROL_TIMEOUT = datetime.timedelta(days=30)  # a worker waits this long for its next step
JOINED_KEY = "ostinato/joined"  # each worker adds 1 on reaching the rendezvous
_IGNORED_IN_AGREEMENT = ("model", "device")  # may differ between nodes (paths, device index)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: rank 0's TCP store."""

    host: str
    port: int


@dataclass
class World:
    rank: Rank
    config: EngineConfig  # the engine's, with this rank's device
    channel: Channel  # control messages (driver <-> workers)
    groups: list[dist.ProcessGroup]  # the ones carrying device work, for abort()

    @property
    def sampling_rank(self) -> int:
        """The last stage's first tensor rank: it samples and returns each step's tokens."""
        return (self.rank.pp_size - 1) * self.rank.tp_size

    def agree_on_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.channel.group)
        return int(t.item())

    def abort(self) -> None:
        """Make every pending device collective of this process fail (a peer is gone)."""
        for group in self.groups:
            # gloo has no abort: its operations fail once the peer's socket closes
            with contextlib.suppress(RuntimeError, NotImplementedError, AttributeError):
                group.abort()


def rank_device(config: EngineConfig, rank: int) -> str:
    """cuda:<base + local rank> for GPU runs (LOCAL_RANK under torchrun), else the CPU."""
    if not config.is_cuda:
        return "cpu"
    base = int(config.device.split(":")[1]) if ":" in config.device else 0
    local = int(os.environ.get("LOCAL_RANK", rank))
    return f"cuda:{base + local}"


def join(
    config: EngineConfig,
    rank: int,
    meet: Rendezvous | None,
    wait_for_peers: Callable[[dist.Store], None] | None = None,
) -> World:
    """Join the process group as `rank` and build every group; returns this rank's World.
    meet None: torchrun's environment says where to meet. wait_for_peers(store) runs on
    rank 0 before the group forms (the launcher watches its workers meanwhile). Fails with a
    clear error when the ranks were started with different settings."""
    global _store
    device = rank_device(config, rank)
    config = dataclasses.replace(config, device=device)
    timeout = datetime.timedelta(seconds=config.distributed_timeout)
    if meet is not None:
        _store = dist.TCPStore(
            meet.host,
            meet.port,
            config.world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        if rank != 0:
            _store.add(JOINED_KEY, 1)
        elif wait_for_peers is not None:
            wait_for_peers(_store)
    if config.is_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if config.is_cuda else "gloo",
        init_method=None if meet is not None else "env://",
        store=_store if meet is not None else None,
        rank=rank,
        world_size=config.world_size,
        timeout=timeout,
        device_id=torch.device(device) if config.is_cuda else None,
    )
    if meet is None:
        _store = dist.distributed_c10d._get_default_store()
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    me = Rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    _check_agreement(config, me, control)
    groups = [dist.group.WORLD]
    tp = TPGroup()
    for stage in range(me.pp_size):
        ranks = [stage * me.tp_size + i for i in range(me.tp_size)]
        group = dist.new_group(ranks, timeout=timeout) if me.tp_size > 1 else None
        if stage == me.pp_rank and group is not None:
            tp = TPGroup(me.tp_rank, me.tp_size, group)
            groups.append(group)
    set_tp_group(tp)
    # NCCL creates a group's communicator at its first collective, which must not happen
    # inside a CUDA graph capture (the layers' all-reduces are captured): create it now
    tp.all_reduce(torch.zeros(1, device=device))
    return World(me, config, Channel(control), groups)


def _check_agreement(config: EngineConfig, me: Rank, control: dist.ProcessGroup) -> None:
    """Ranks started by hand (torchrun) may disagree; the capture plan and every step come
    from rank 0, so a rank with other settings would deadlock later. Refuse now instead."""
    from ostinato.graphs.explain import explain

    mine = {k: v for k, v in dataclasses.asdict(config).items() if k not in _IGNORED_IN_AGREEMENT}
    mine["capture_sizes_planned"] = explain(config)["capture_sizes"]
    everyone: list[dict | None] = [None] * me.world_size
    dist.all_gather_object(everyone, mine, group=control)
    for rank, theirs in enumerate(everyone):
        differ = sorted(k for k in mine if theirs.get(k) != everyone[0].get(k))
        if differ:
            raise ValueError(
                f"rank {rank} was started with other settings than rank 0 "
                f"({', '.join(f'{k}: {theirs[k]!r} vs {everyone[0][k]!r}' for k in differ)}): "
                "start every rank with the same engine flags"
            )


_store: dist.Store | None = None  # this process's rendezvous store, once it joined


def current_store() -> dist.Store | None:
    return _store


def leave() -> None:
    """Tear down this process's groups (every rank, also after a failure)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp_group(TPGroup())
