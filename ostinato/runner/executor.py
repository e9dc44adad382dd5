"""The model executor: what the engine drives, whether the model lives in this process or is
split over worker processes (ostinato.distributed)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

from ostinato.config import EngineConfig
from ostinato.runner.model_runner import ModelRunner
from ostinato.runner.sampler import SamplerOutput
from ostinato.runner.step import StepInput


class PendingStep(Protocol):
    def result(self) -> SamplerOutput | None:
        """Block until the step ran; the sampled tokens, or None when nothing was sampled."""


class Executor(Protocol):
    runner: ModelRunner  # this process's runner: the driver's stage
    num_blocks: int  # KV blocks every rank holds
    max_in_flight: int  # steps that may run at once (one per pipeline stage)
    failed: str | None  # why it stopped for good (a worker died), else None

    def submit(self, step: StepInput) -> PendingStep: ...

    def graph_report(self) -> dict: ...

    def shutdown(self) -> None: ...


class Deferred:
    def __init__(self, run: Callable[[], SamplerOutput | None]) -> None:
        self.result = run


class LocalExecutor:
    """The whole model in this process: a step runs when its result is asked for."""

    max_in_flight = 1
    failed = None

    def __init__(self, config: EngineConfig, hf_config) -> None:
        self.runner = ModelRunner(config, hf_config)
        self.runner.start()
        self.num_blocks = self.runner.num_blocks

    def submit(self, step: StepInput) -> Deferred:
        return Deferred(partial(self.runner.run, step))

    def graph_report(self) -> dict:
        return self.runner.graph_report()

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig, hf_config) -> Executor:
    """One process for a single GPU (or CPU); worker processes for tensor or pipeline
    parallelism."""
    if config.world_size == 1:
        return LocalExecutor(config, hf_config)
    from ostinato.distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config, hf_config)
