"""The model executor: what the engine drives, whether the model lives in this process or is
split over worker processes (ostinato.distributed.executor; the engine picks one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ostinato.config import EngineConfig
from ostinato.runner.model_runner import ModelRunner
from ostinato.runner.sampler import SamplerOutput
from ostinato.runner.step import StepInput
from ostinato.structured.bitmask import TokenBitmask


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

    def shutdown(self) -> None:
        """Stop any worker and give back every device allocation; idempotent."""


class Deferred:
    def __init__(self, run: Callable[[], SamplerOutput | None]) -> None:
        self.result = run


class HeldSample:
    """A launched step whose sampling waits for its token bitmask (StepInput.mask_pending):
    the engine calls sample() once the grammars have read the tokens in flight."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.sampled = runner, None

    def sample(self, bitmask: TokenBitmask | None) -> None:
        self.sampled = self.runner.sample_held(bitmask)

    def result(self) -> SamplerOutput:
        return self.sampled.result()


class LocalExecutor:
    """The whole model in this process: a step is launched when it is submitted. With async
    scheduling two steps are in flight: the engine builds and launches the next one while the
    device runs the last."""

    failed = None

    def __init__(self, config: EngineConfig, hf_config) -> None:
        self.runner = ModelRunner(config, hf_config)
        self.runner.start()
        self.num_blocks = self.runner.num_blocks
        self.max_in_flight = 2 if config.async_scheduling else 1

    def submit(self, step: StepInput) -> Deferred | HeldSample:
        sampled = self.runner.launch(step)
        if step.mask_pending:
            return HeldSample(self.runner)
        return Deferred(lambda: sampled.result() if sampled is not None else None)

    def graph_report(self) -> dict:
        return self.runner.graph_report()

    def shutdown(self) -> None:
        """Give back the runner's device memory; a second call does nothing."""
        if self.runner.model is not None:
            self.runner.close()
