"""Starting the worker processes (single node: spawned here; several nodes: torchrun starts
every rank) and watching them: the first worker to die takes the others with it, and leaves
the reason for the driver to raise."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from ostinato.config import EngineConfig
from ostinato.distributed.parallel import Rank, startup_timeout
from ostinato.distributed.worker import ERROR_KEY, worker_main
from ostinato.distributed.world import JOINED_KEY, Rendezvous


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def check_launch(config: EngineConfig) -> None:
    """Settings that cannot run here, refused before any process starts."""
    world = config.world_size
    if launched_by_torchrun():
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size != world:
            raise ValueError(
                f"torchrun started {size} processes but tensor_parallel_size * "
                f"pipeline_parallel_size = {config.tensor_parallel_size} * "
                f"{config.pipeline_parallel_size} = {world}: make --nnodes * --nproc-per-node "
                "equal to it"
            )
        return
    if config.is_cuda:
        base = int(config.device.split(":")[1]) if ":" in config.device else 0
        have = torch.cuda.device_count()
        if base + world > have:
            raise ValueError(
                f"tensor_parallel_size * pipeline_parallel_size = {world} processes need "
                f"{world} GPUs from cuda:{base}, but this machine has {have}: lower them, "
                "or run on several nodes with torchrun"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Ranks 1..world-1 as spawned processes of this one, watched from a thread.

    That thread also starts them and lives as long as any of them: a worker asks Linux to
    kill it when its parent goes (PR_SET_PDEATHSIG), and Linux counts the thread that
    started a process as its parent. Started from the caller's thread, the workers would
    die with it, e.g. when an engine is built in a thread of a pool that then ends.
    """

    def __init__(self, config: EngineConfig, meet: Rendezvous) -> None:
        self.meet = meet
        self.timeout = startup_timeout(config.distributed_timeout)  # spawning and importing
        self.cause: str | None = None  # why the engine stopped, once a worker died
        self.on_death: Callable[[], None] = lambda: None  # aborts the driver's collectives
        self._stopping = False
        # one thread at a time reaps: a process another thread is reaping reads as alive
        self._reaping = threading.RLock()
        ctx = mp.get_context("spawn")
        self.procs = {
            rank: ctx.Process(
                target=worker_main,
                args=(rank, config, meet, os.getpid()),
                name=f"ostinato-rank{rank}",
                daemon=True,
            )
            for rank in range(1, config.world_size)
        }
        self.ranks = {rank: Rank(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
                      for rank in self.procs}  # fmt: skip
        started = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._start_and_watch, args=(started, failed), name="ostinato-watchdog",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        started.wait()
        if failed:  # the thread has ended: the workers it started die with it
            self._thread.join()
            for proc in self.procs.values():
                if proc.exitcode is None and proc.pid is not None:
                    proc.join(5)
            raise failed[0]

    def _start_and_watch(self, started: threading.Event, failed: list[BaseException]) -> None:
        try:
            for proc in self.procs.values():
                proc.start()
        except BaseException as e:
            self._stopping = True
            failed.append(e)
            return
        finally:
            started.set()
        self._watch()

    def _watch(self) -> None:
        """Until every worker has exited: the first to die unasked is the engine's cause of
        failure, and takes the others with it."""
        pending = {p.sentinel: rank for rank, p in self.procs.items()}
        while pending:
            dead = wait(list(pending))
            if not self._stopping:  # the earliest rank: a later one may have died of it
                self.cause = self._describe(min(pending[sentinel] for sentinel in dead))
                self.on_death()
                self.kill()
                return
            for sentinel in dead:
                del pending[sentinel]

    def _describe(self, rank: int) -> str:
        with self._reaping:
            self.procs[rank].join(5)  # reaped, so its exit code is known (its sentinel fired)
        r, code = self.ranks[rank], self.procs[rank].exitcode
        who = f"pipeline stage {r.pp_rank}, tensor rank {r.tp_rank} (rank {rank})"
        error = self._error_of(rank)
        if error:
            return f"{who} failed: {error.strip().splitlines()[-1]}"
        if code is None:  # its status was collected elsewhere (seen only in long test runs)
            return f"{who} exited (exit status unknown)"
        if code < 0:
            return f"{who} was killed by {signal.Signals(-code).name}"
        return f"{who} exited with code {code}"

    def _error_of(self, rank: int) -> str | None:
        """The traceback the worker left in the store, if it could."""
        try:
            store = dist.TCPStore(
                self.meet.host, self.meet.port, is_master=False,
                timeout=datetime.timedelta(seconds=2),
            )  # fmt: skip
            key = ERROR_KEY.format(rank=rank)
            return store.get(key).decode() if store.check([key]) else None
        except RuntimeError:
            return None

    def settle(self, patience: float = 5.0) -> str | None:
        """The cause, once the watchdog has it: a peer's socket closes a moment before its
        process is reaped, so give a worker that is going down a few seconds to be seen."""
        deadline = time.monotonic() + patience
        while self.cause is None and time.monotonic() < deadline:
            with self._reaping:  # is_alive reaps: unlocked, it raced the watchdog's _describe
                alive = all(p.is_alive() for p in self.procs.values())
            if alive and time.monotonic() > deadline - patience + 1.0:
                break  # nobody is dying: the failure was not a worker's
            time.sleep(0.01)
        return self.cause

    def wait_until_joined(self, store: dist.Store) -> None:
        """Wait for every worker to reach the rendezvous, failing at once if one dies first."""
        timeout = self.timeout
        deadline = time.monotonic() + timeout
        while store.add(JOINED_KEY, 0) < len(self.procs):
            if self.cause is not None:
                raise RuntimeError(self.cause)
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not start within {timeout:.0f} s")
            time.sleep(0.01)

    def kill(self) -> None:
        with self._reaping:
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()
            for proc in self.procs.values():
                proc.join(5)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self, timeout: float = 10.0) -> None:
        """After Shutdown was sent: let the workers exit, kill whoever is left (at once with
        timeout 0)."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        with self._reaping:
            for proc in self.procs.values():
                proc.join(max(0.0, deadline - time.monotonic()))
            self.kill()
