"""The offline API: LLM(model=...).generate(prompts)."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from ostinato.config import EngineConfig
from ostinato.engine.engine import LLMEngine
from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """The offline engine, in this process. Release it with shutdown() or a `with` block:

        with LLM(model="tiny") as llm:
            outs = llm.generate(["Hello"])

    Afterwards every GPU allocation (KV cache, graphs and their pool, buffers, weights) and
    every worker process is gone, so a new engine in this process gets the full budget."""

    def __init__(
        self, model: str = "tiny", *, config: EngineConfig | None = None, **kwargs
    ) -> None:
        """Build the engine from keyword arguments (see EngineConfig) or a ready config."""
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers and give back every device allocation; a second call does
        nothing, and generate() afterwards raises EngineShutdownError."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order. `lora_request`: one
        adapter for every prompt, or one (or None, the base model) per prompt.

        Every prompt is checked before any is queued, so a bad one (or a bad adapter) raises
        ValueError and leaves the engine as it was.
        """
        self.engine.check_open()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params or SamplingParams(), SamplingParams, prompts)
        loras = _per_prompt(lora_request, LoRARequest | None, prompts, "LoRA requests")
        token_ids = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras, strict=True)):
            try:
                token_ids.append(self.engine.validate(prompt, p, lora))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [
            self.engine.add_request(t, p, lora_request=lora)
            for t, p, lora in zip(token_ids, params, loras, strict=True)
        ]
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2)
        try:
            while len(finished) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        finally:  # an error or Ctrl-C must not leave requests behind for the next call
            bar.close()
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
        return [finished[i] for i in ids]

    def graph_report(self) -> dict:
        return self.engine.graph_report()

    def stats(self) -> dict:
        """The engine's counters: requests, tokens, KV blocks, prefix cache, preemptions, and
        speculative decoding's draft and accepted tokens and acceptance rate."""
        return self.engine.stats()


def _per_prompt(value, one: type, prompts: Sequence, what: str = "sampling params") -> list:
    """`value` for every prompt, or one per prompt."""
    if isinstance(value, one):
        return [value] * len(prompts)
    values = list(value)
    if len(values) != len(prompts):
        raise ValueError(f"got {len(values)} {what} for {len(prompts)} prompts")
    return values
