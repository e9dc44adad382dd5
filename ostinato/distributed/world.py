"""One process's view of the distributed engine: its rank, its device and its groups.

Every rank creates the same groups in the same order: the world group (NCCL on GPUs, gloo on
CPUs; it carries the stage-to-stage transfers), a gloo group for control messages whose
timeout is long enough to idle on, and per stage a tensor-parallel group and a gloo group of
the same ranks for agreeing on host-side decisions (graph warm-ups, dropped sizes).

NCCL faults: the engine owns every abort. A host wait on the device has a deadline
(distributed_timeout), a dead worker is seen by the launcher's watchdog, and either way the
driver aborts its groups once (`teardown`) and stops the workers. PyTorch's NCCL watchdog
stays out of it. Every rank runs with TORCH_NCCL_ASYNC_ERROR_HANDLING=0, so the watchdog never
tears a process down (SIGABRT) nor aborts a communicator behind the engine's back. Its NCCL
groups time out later than the engine's deadline (`watchdog_timeout`): a collective the
watchdog sees time out signals a flight-recorder dump, after which PyTorch's heartbeat monitor
sleeps TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (480 s) and every group's destructor waits for that
sleep (a rank stopped with SIGSTOP held the driver that long: benchmarks/h100-2026-11-27-s35.md).
And the monitor may not kill the process after that sleep (TORCH_NCCL_ENABLE_MONITORING=0),
which it would do where an abort was left to the process's exit. Both settings hold unless
set otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.config import EngineConfig
from ostinato.distributed.channel import Channel
from ostinato.distributed.parallel import Rank, TPGroup, set_tp_group, startup_timeout
from ostinato.distributed.pipeline import SampleShare

logger = logging.getLogger("ostinato")
# read when an NCCL group is made: the engine aborts and keeps the deadlines, not PyTorch
NCCL_FAULT_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0"}
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
    samples: SampleShare | None = None  # async scheduling: this rank sends or needs samples

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
        teardown(abort=True)


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
    group_timeout = watchdog_timeout(config)
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
    for name, value in NCCL_FAULT_SETTINGS.items():  # unless set otherwise
        os.environ.setdefault(name, value)
    _teardown.reset(nccl=config.is_cuda)
    dist.init_process_group(
        "nccl" if config.is_cuda else "gloo",
        init_method=None if meet is not None else "env://",
        store=_store if meet is not None else None,
        rank=rank,
        world_size=config.world_size,
        timeout=group_timeout,
        device_id=torch.device(device) if config.is_cuda else None,
    )
    if meet is None:
        _store = dist.distributed_c10d._get_default_store()
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    me = Rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    _check_agreement(config, me, control)
    tp = TPGroup()
    agreement = datetime.timedelta(seconds=startup_timeout(config.distributed_timeout))
    for stage in range(me.pp_size):  # every rank makes every group, in the same order
        if me.tp_size == 1:
            break
        ranks = [stage * me.tp_size + i for i in range(me.tp_size)]
        group = dist.new_group(ranks, timeout=group_timeout)
        control_of_stage = dist.new_group(ranks, backend="gloo", timeout=agreement)
        if stage == me.pp_rank:
            tp = TPGroup(me.tp_rank, me.tp_size, group, control_of_stage)
    set_tp_group(tp)
    samples = _sample_share(me, group_timeout) if config.async_scheduling else None
    # NCCL creates a group's communicator at its first collective, which must not happen
    # inside a CUDA graph capture (the layers' all-reduces are captured): create it now
    tp.all_reduce(torch.zeros(1, device=device))
    return World(me, config, Channel(control), samples)


def watchdog_timeout(config: EngineConfig) -> datetime.timedelta:
    """The timeout of the groups on the device backend. NCCL's only feeds PyTorch's watchdog,
    which must not see a step's collective time out before the engine's deadline aborts it
    (see above): the start-up wait, longer than any step. gloo's timeouts end the host's
    waits, so on CPUs it is distributed_timeout."""
    seconds = config.distributed_timeout
    return datetime.timedelta(seconds=startup_timeout(seconds) if config.is_cuda else seconds)


def _sample_share(me: Rank, timeout: datetime.timedelta) -> SampleShare | None:
    """The group from the sampling rank to the first stage's ranks (every rank makes it)."""
    source = (me.pp_size - 1) * me.tp_size
    members = sorted({*range(me.tp_size), source})
    group = dist.new_group(members, timeout=timeout)
    return SampleShare(me, group, source) if me.rank in members else None


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


TEARDOWN_S = 10.0  # seconds one destroy or abort of the groups may take before it is left


class _Teardown:
    """The one owner of this process's group teardown. The launcher's watchdog thread aborts
    when a worker dies while the main thread may be leaving: the two never overlap, an abort
    after leaving does nothing, and each happens at most once.

    Both first drop what holds the communicators (`release_before_teardown`). Over NCCL they
    then run with a deadline: a destroy or abort that does not return in TEARDOWN_S is left to
    the process's exit with a warning, and nothing later touches the groups (gloo ends its
    waits at its own timeouts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.aborted = self.left = self.stuck = self.nccl = False

    def reset(self, nccl: bool = False) -> None:
        with self._lock:
            self.aborted = self.left = self.stuck = False
            self.nccl = nccl

    def __call__(self, abort: bool) -> None:
        with self._lock:
            if self.left or (abort and self.aborted):
                return
            _release_holders()
            if abort:
                self.aborted = True
                self._bounded(_abort_all, "aborting the process groups")
                return
            self.left = True
            if dist.is_initialized():
                self._bounded(_destroy_all, "destroying the process groups")
            set_tp_group(TPGroup())

    def _bounded(self, op: Callable[[], None], what: str) -> None:
        if self.stuck:  # an earlier op still runs: a second one would wait behind it
            return
        if not self.nccl:
            op()
            return
        thread = threading.Thread(target=op, name="ostinato-teardown", daemon=True)
        thread.start()
        thread.join(TEARDOWN_S)
        if thread.is_alive():
            self.stuck = True
            logger.warning(
                "%s did not finish in %g s: left to the process's exit", what, TEARDOWN_S
            )


_holders: list[weakref.WeakMethod] = []


def release_before_teardown(release: Callable[[], None]) -> None:
    """Have every teardown call release (a bound method, held weakly) before it destroys or
    aborts the groups. NCCL's destroy and abort both wait, without a deadline, until every
    CUDA graph that captured a collective of the communicator is destroyed (NCCL counts each
    as a persistent reference), so a rank's graphs must go first."""
    _holders.append(weakref.WeakMethod(release))


def _release_holders() -> None:
    if not _holders:
        return
    while _holders:
        release = _holders.pop()()
        if release is not None:
            release()
    gc.collect()  # the dropped graphs may sit in reference cycles


def _destroy_all() -> None:
    with contextlib.suppress(RuntimeError, ValueError):  # aborted groups are gone
        dist.destroy_process_group()


def _abort_all() -> None:
    """Abort every group of this process at once: PyTorch aborts all NCCL communicators
    inside one group call (aborting them one after the other can deadlock, pytorch#119797);
    pending gloo operations fail too."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(RuntimeError, NotImplementedError, AttributeError, ValueError):
        dist.distributed_c10d._abort_process_group(dist.group.WORLD)


_teardown = _Teardown()


def teardown(abort: bool = False) -> None:
    """abort=True: make every pending device collective of this process fail (a peer is
    gone); else leave: destroy this process's groups. Safe from any thread, any number of
    times."""
    _teardown(abort)


def leave() -> None:
    """Tear down this process's groups (every rank, also after a failure)."""
    teardown(abort=False)
