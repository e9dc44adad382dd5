"""The model executor for tensor and pipeline parallelism: this process is rank 0 (the driver
and the first stage's first tensor rank); the other ranks are spawned workers on this node, or
torchrun's processes on several nodes.

A step goes to every worker as a control message, rank 0 runs its own part, and the last
stage's first tensor rank sends the sampled tokens back. Up to pipeline_parallel_size steps
are in flight; their results come back in order.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections import deque

import torch.distributed as dist

from ostinato.config import EngineConfig
from ostinato.distributed.launcher import Workers, check_launch, free_port, launched_by_torchrun
from ostinato.distributed.parallel import Rank
from ostinato.distributed.worker import (
    Report,
    ReportRequest,
    Shutdown,
    StepResult,
    load_stage,
    silent_ranks,
    stage_report,
    worker_main,
)
from ostinato.distributed.world import Rendezvous, World, current_store, join, leave, teardown
from ostinato.runner.executor import Deferred
from ostinato.runner.sampler import SamplerOutput
from ostinato.runner.step import StepInput

logger = logging.getLogger("ostinato")


SHUTDOWN_PATIENCE = 5.0  # seconds the workers get to take their Shutdown message


class WorkerError(RuntimeError):
    """A worker died or raised: the engine has stopped."""


class RemoteStep:
    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor = executor
        self._done = False
        self._output: SamplerOutput | None = None

    def resolve(self, output: SamplerOutput | None) -> None:
        self._output, self._done = output, True

    def result(self) -> SamplerOutput | None:
        while not self._done:
            self._executor.receive()
        return self._output


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, hf_config) -> None:
        check_launch(config)
        if dist.is_initialized():
            raise ValueError(
                "this process already drives a multi-process engine (or joined another process "
                "group): one multi-process engine at a time; shut the other down first "
                "(LLMEngine.shutdown())"
            )
        self.config = config
        # one batch per stage, and with async scheduling one more launched behind them
        self.max_in_flight = config.pipeline_parallel_size + bool(config.async_scheduling)
        self.workers: Workers | None = None
        self._failed: str | None = None  # set once the engine stopped after a failure
        self._unresolved: deque[RemoteStep] = deque()
        self._reports: dict[int, dict] = {}
        meet = None
        if launched_by_torchrun():
            rank = int(os.environ["RANK"])
            if rank != 0:  # this process is a worker: serve rank 0, then end with it
                worker_main(rank, config, None, parent=0)
                sys.exit(0)
        else:
            meet = Rendezvous("127.0.0.1", free_port())
            self.workers = Workers(config, meet)
        self._closer = weakref.finalize(self, _close, None, self.workers)
        try:
            self.world = join(config, 0, meet, self.workers and self.workers.wait_until_joined)
            if self.workers is not None:  # from now on a death also fails our collectives
                self.workers.on_death = self.world.abort
            self._closer.detach()
            self._closer = weakref.finalize(self, _close, self.world, self.workers)
            self.runner = load_stage(self.world, hf_config)
        except BaseException as e:
            error = self._error(e)  # before closing: the watchdog stops watching then
            if self.workers is not None:  # still starting up: none would read a Shutdown
                self.workers.stop(0)
            self._closer()
            raise error from e
        self.num_blocks = self.runner.num_blocks

    @property
    def ranks(self) -> range:
        return range(1, self.world.rank.world_size)

    def submit(self, step: StepInput) -> RemoteStep | Deferred:
        self._check_alive()
        try:
            for rank in self.ranks:
                self.world.channel.send(step, rank)
            output = self.runner.run(step)
        except BaseException as e:
            raise self._fail(e) from e
        if self.world.sampling_rank == 0:
            return Deferred(lambda: output)
        pending = RemoteStep(self)
        self._unresolved.append(pending)
        return pending

    def receive(self) -> None:
        """Take the sampling rank's next message: a step's result or a report. It must come
        within distributed_timeout, as any transfer of a step must: a rank that sends nothing
        for that long is stuck, and the engine stops rather than wait on it."""
        self._check_alive()
        rank = self.world.sampling_rank
        try:
            msg = self.world.channel.recv(rank, timeout=self.config.distributed_timeout)
        except TimeoutError as e:
            raise self._fail(WorkerError(self._stuck(rank))) from e
        except BaseException as e:
            raise self._fail(e) from e
        if isinstance(msg, StepResult):
            self._unresolved.popleft().resolve(msg.output)
        elif isinstance(msg, Report):
            self._reports[msg.rank] = msg.report
        else:
            raise self._fail(TypeError(f"unexpected message {type(msg).__name__}"))

    def graph_report(self) -> dict:
        """Rank 0's report, with every rank's under "stages"."""
        self._check_alive()
        for rank in self.ranks:
            self.world.channel.send(ReportRequest(), rank)
        for rank in self.ranks:
            try:
                while rank not in self._reports:
                    if rank == self.world.sampling_rank:
                        self.receive()
                    else:
                        timeout = self.config.distributed_timeout
                        self._reports[rank] = self.world.channel.recv(rank, timeout).report
            except TimeoutError as e:
                raise self._fail(WorkerError(self._stuck(rank))) from e
            except BaseException as e:
                raise self._fail(e) from e
        own = self.runner.graph_report()
        stages = [{**stage_report(self.world, self.runner), **own}]
        stages += [self._reports.pop(rank) for rank in self.ranks]
        return {**own, "stages": stages}

    def shutdown(self) -> None:
        """Stop the workers and give back this rank's device memory. Steps still in flight
        finish first (the last stage's result of each is taken, so no rank waits on an unread
        message), then every rank leaves. A second call does nothing."""
        try:
            if self.failed is None and self._closer.alive:
                try:
                    while self._unresolved:
                        self.receive()
                except BaseException:  # _fail has closed everything
                    if self.failed is None:
                        raise
            self._closer()
        finally:
            if self.runner.model is not None:
                self.runner.close()

    # ---- failures ------------------------------------------------------------------------
    @property
    def failed(self) -> str | None:
        """Why the engine stopped, else None; as soon as a worker died, even between steps
        (the server's /health reports it before any request fails)."""
        if self._failed is None and self.workers is not None:
            return self.workers.cause
        return self._failed

    def _check_alive(self) -> None:
        if self._failed is None and self.failed is not None:  # died between steps
            raise self._fail(RuntimeError(self.failed))
        if self._failed is not None:
            raise WorkerError(f"{self._failed}; the engine has stopped: start a new one")

    def _fail(self, e: BaseException) -> BaseException:
        """Any failure mid-step leaves the ranks out of step with each other, so the engine
        stops: the workers are stopped and every later call raises."""
        error = self._error(e)
        self._failed = str(error) or type(error).__name__
        teardown(abort=True)  # nothing of this process may wait on a stuck peer any more
        if self.workers is not None:  # mid-step they would not read a Shutdown: no asking
            self.workers.stop(0)
        self._closer()
        return error

    def _error(self, e: BaseException) -> BaseException:
        cause = self.workers.settle() if self.workers is not None else None
        if cause is None and isinstance(e, RuntimeError) and "by peer" in str(e):
            cause = f"a worker disconnected ({e})"
        timed_out = isinstance(e, TimeoutError) or (
            isinstance(e, RuntimeError) and "Timed out" in str(e)
        )
        if cause is None and timed_out:
            cause = (
                f"{self._silent() or 'a worker is stuck, or steps are that slow'}: a transfer, "
                "collective or device wait of a step took longer than distributed_timeout="
                f"{self.config.distributed_timeout:g} s (raise --distributed-timeout if steps "
                f"are that slow) ({e})"
            )
        return WorkerError(cause) if cause else e

    def _stuck(self, rank: int) -> str:
        c = self.config
        return (
            f"{self._silent() or self._who(rank) + ' sent nothing'} for distributed_timeout="
            f"{c.distributed_timeout:g} s: it is stuck, or its steps are that slow (then raise "
            "--distributed-timeout)"
        )

    def _who(self, rank: int) -> str:
        r = Rank(rank, self.config.tensor_parallel_size, self.config.pipeline_parallel_size)
        return f"pipeline stage {r.pp_rank}, tensor rank {r.tp_rank} (rank {rank})"

    def _silent(self) -> str | None:
        """'<who> stopped answering' for the workers whose heartbeat stopped, else None."""
        store = current_store()
        silent = silent_ranks(store, range(1, self.config.world_size)) if store is not None else []
        if not silent:
            return None
        return " and ".join(self._who(rank) for rank in silent) + " stopped answering"


def _close(world: World | None, workers: Workers | None) -> None:
    """Stop the workers (asking first, killing what is left) and leave the group. Runs once:
    at shutdown(), on failure, or when the executor is collected or the interpreter exits.
    Never waits long: a worker that does not take its Shutdown in SHUTDOWN_PATIENCE seconds
    (it may wait in a step the driver left, e.g. after Ctrl-C) is killed, or under torchrun
    finds the group gone."""
    delivered = False
    if world is not None and (workers is None or (workers.cause is None and not workers.stopping)):
        try:
            for rank in range(1, world.rank.world_size):
                world.channel.send(Shutdown(), rank)
            delivered = world.channel.flush(SHUTDOWN_PATIENCE)
            if not delivered:
                logger.warning("a worker did not take its shutdown message: stopping it")
        except (RuntimeError, ValueError) as e:  # a worker or the groups are gone already
            logger.debug("shutdown message not delivered: %s", e)
    if workers is not None:
        workers.stop(10.0 if delivered else 0.0)
    leave()
