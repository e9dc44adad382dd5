"""A rank of the engine other than the driver: it runs every step rank 0 sends, until told to
stop. Rank 0 goes through the same start-up (join, then load_stage) in lockstep with them."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ostinato.config import EngineConfig
from ostinato.distributed.pipeline import PipelineLink
from ostinato.distributed.world import Rendezvous, World, current_store, join, leave
from ostinato.runner.model_runner import ModelRunner
from ostinato.runner.sampler import SamplerOutput
from ostinato.runner.step import StepInput

logger = logging.getLogger("ostinato")
ERROR_KEY = "ostinato/error/{rank}"  # a failing worker leaves its traceback here
BEAT_KEY = "ostinato/beat/{rank}"  # a serving worker's heartbeat counter
BEAT_S = 0.5  # seconds between heartbeats


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class ReportRequest:
    pass


@dataclass(frozen=True)
class StepResult:
    output: SamplerOutput | None


@dataclass(frozen=True)
class Report:
    rank: int
    report: dict


def load_stage(world: World, hf_config) -> ModelRunner:
    """Load this rank's stage, agree with every rank on the KV block count, capture graphs."""
    link = PipelineLink(world.rank)
    runner = ModelRunner(world.config, hf_config, world.rank, link, world.samples)
    runner.start(world.agree_on_min(runner.num_blocks))
    return runner


def stage_report(world: World, runner: ModelRunner) -> dict:
    start, end = runner.model.layer_range
    r = world.rank
    return {"rank": r.rank, "pp_rank": r.pp_rank, "tp_rank": r.tp_rank, "layers": [start, end]}


def serve(world: World, runner: ModelRunner) -> None:
    """Run rank 0's messages in order until Shutdown."""
    me, channel = world.rank.rank, world.channel
    beating = _start_heartbeat(me)
    while True:
        msg = channel.recv(0)
        if isinstance(msg, StepInput):
            output = runner.run(msg)
            if me == world.sampling_rank:
                channel.send(StepResult(output), 0)
        elif isinstance(msg, ReportRequest):
            channel.send(Report(me, {**stage_report(world, runner), **runner.graph_report()}), 0)
        elif isinstance(msg, Shutdown):
            beating.set()
            channel.flush(timeout=5.0)  # the driver takes every result before it says stop
            return
        else:
            raise TypeError(f"unexpected message {type(msg).__name__} from rank 0")


def worker_main(rank: int, config: EngineConfig, meet: Rendezvous | None, parent: int) -> None:
    """A spawned worker's entry point (also a torchrun rank's, with meet None, parent 0)."""
    if parent:
        die_with(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us; Ctrl-C is its
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank} %(levelname)s: %(message)s")
    if not config.is_cuda:  # ranks on one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    from ostinato.loader import load_hf_config, resolve_model

    try:
        # a torchrun rank gets a Hub id from its own cache (spawned ranks get the driver's path)
        config = replace(config, model=resolve_model(config.model, config.revision))
        world = join(config, rank, meet)
        serve(world, load_stage(world, load_hf_config(config.model)))
    except BaseException:
        _leave_error(rank, traceback.format_exc())
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # tearing down groups whose peers wait on us could hang: just go
    leave()


def _start_heartbeat(rank: int) -> threading.Event:
    """Count up BEAT_KEY every BEAT_S seconds until the returned event is set, so the driver
    can tell a rank that stopped answering (stopped, hung with the interpreter blocked) from
    one that only waits on it."""
    stop, store = threading.Event(), current_store()

    def beat() -> None:
        with contextlib.suppress(RuntimeError):  # the store went with the driver
            while True:
                store.add(BEAT_KEY.format(rank=rank), 1)
                if stop.wait(BEAT_S):
                    return

    if store is not None:
        threading.Thread(target=beat, name="ostinato-heartbeat", daemon=True).start()
    return stop


def silent_ranks(store: dist.Store, ranks: range, listen: float = 3 * BEAT_S) -> list[int]:
    """The ranks whose heartbeat did not move for `listen` seconds: they stopped answering
    (a rank that never beat, still starting up, is not counted)."""
    keys = {rank: BEAT_KEY.format(rank=rank) for rank in ranks}
    try:
        before = {rank: store.add(key, 0) for rank, key in keys.items()}
        time.sleep(listen)
        return [r for r, key in keys.items() if 0 < before[r] == store.add(key, 0)]
    except RuntimeError:  # the store is gone: nothing to tell
        return []


def _leave_error(rank: int, text: str) -> None:
    """Tell the driver why this rank is about to exit (read by its watchdog)."""
    store = current_store()
    if store is None:
        return
    with contextlib.suppress(RuntimeError):  # else the store went with the driver
        store.set(ERROR_KEY.format(rank=rank), text)


def die_with(parent: int) -> None:
    """Ask Linux to kill this process when the driver dies, however it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the driver died before prctl took effect
        os._exit(1)
