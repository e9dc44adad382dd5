"""One request as the engine tracks it: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum

from ostinato.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_name: str | None = None,
        eos_token_id: int | None = None,
    ):
        self.request_id = request_id
        self.lora_name = lora_name  # the adapter it runs through; None: the base model
        self.token_ids = list(prompt_token_ids)
        # Kept apart and never mutated, so every output can share it instead of copying it.
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # the tokens that end it: its stop_token_ids, and EOS unless it ignores EOS
        eos = () if params.ignore_eos or eos_token_id is None else (eos_token_id,)
        self.stop_ids = frozenset((*params.stop_token_ids, *eos))
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # Async scheduling runs a request's next batch while its last one is in flight: the
        # tokens those batches compute, and the tokens they sample (not yet appended).
        self.num_in_flight_tokens = 0
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.block_ids: list[int] = []
        self.num_committed_blocks = 0  # leading full blocks already offered to the prefix cache
        self.block_hashes: list[int] = []  # chain hashes of the full blocks, in order
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.grammar = None  # structured outputs: its llguidance matcher, advanced per token
        # per prompt position (the first has none), filled as prefill chunks score them
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or being computed: where the next batch starts."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens no batch has computed or is computing (an in-flight sample counts as one)."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_scheduled_tokens

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone, so every token is computed again on resume."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids = []
