"""The synchronous engine: requests in, one scheduler step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import replace

from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.detokenizer import IncrementalDetokenizer, cut_at_stop
from ostinato.engine.scheduler import ScheduledBatch, Scheduler
from ostinato.engine.sequence import Sequence, SequenceStatus
from ostinato.loader import load_hf_config, resolve_model
from ostinato.lora.adapter import BaseShapes
from ostinato.lora.request import LoRARequest
from ostinato.lora.slots import AdapterSlots
from ostinato.outputs import RequestOutput
from ostinato.runner.executor import Executor, LocalExecutor, PendingStep
from ostinato.runner.step import StepInput
from ostinato.sampling_params import SamplingParams
from ostinato.structured.grammar import GrammarCompiler
from ostinato.tokenizer import load_tokenizer

logger = logging.getLogger("ostinato")


class EngineShutdownError(RuntimeError):
    """The engine was shut down: it takes no more requests or steps."""


def create_executor(config: EngineConfig, hf_config) -> Executor:
    """One process for a single GPU (or CPU); worker processes for tensor or pipeline
    parallelism."""
    if config.world_size == 1:
        return LocalExecutor(config, hf_config)
    from ostinato.distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config, hf_config)


def prompt_token_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt as token ids (text is tokenised), or a ValueError when it is empty."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: give at least one character or token id")
        return tokenizer.encode(prompt)
    return list(prompt)


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """detokenize=False: outputs carry token ids only (text stays empty) and stop strings
        are not checked; the engine-core process leaves both to the HTTP process."""
        config = replace(config, model=resolve_model(config.model, config.revision))
        self.hf_config = load_hf_config(config.model)
        config = config.for_model(self.hf_config)
        self.config = config
        self.vocab_size = self.hf_config.vocab_size
        self.tokenizer = load_tokenizer(config.model)
        self.grammars = GrammarCompiler(self.tokenizer)
        self.executor = create_executor(config, self.hf_config)
        self.runner = self.executor.runner  # the driver's own stage
        num_blocks = self.executor.num_blocks
        if num_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
                f"max_model_len={config.max_model_len}: give it more memory or lower max_model_len"
            )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.lora = None
        if config.enable_lora:
            base = BaseShapes.of(self.hf_config)
            self.lora = AdapterSlots(base, config.max_loras, config.max_lora_rank)
        self.detokenize = detokenize
        self.requests: dict[str, Sequence] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.in_flight: deque[tuple[ScheduledBatch, StepInput, PendingStep]] = deque()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.spec_draft_tokens = 0  # draft tokens verified (proposed or padded)
        self.spec_accepted_tokens = 0  # of those, accepted
        self.closed = False

    # ---- requests ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of prompt, or a ValueError naming what is wrong with it."""
        token_ids = prompt_token_ids(self.tokenizer, prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token id")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.config.max_model_len}: shorten the prompt or raise max_model_len"
            )
        return token_ids

    def validate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> list[int]:
        """Token ids of a request the engine can run, or a ValueError naming the problem."""
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.vocab_size:
                raise ValueError(
                    f"{name}={n} is more than the vocabulary's {self.vocab_size} tokens"
                )
        for name in ("stop_token_ids", "logit_bias"):
            bad = [t for t in getattr(params, name) if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} names token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})"
                )
        if params.structured_outputs is not None:
            if self.config.async_scheduling and self.config.world_size > 1:
                # a worker rank cannot hold its logits until the host has the grammar's mask
                raise ValueError(
                    "structured outputs with async scheduling need one process: start the "
                    "engine with --async-scheduling off when pipeline or tensor parallelism is on"
                )
            self.grammars.matcher(params.structured_outputs)  # compiled (and cached) now
        self.register_lora(lora_request)
        return self.encode_prompt(prompt)

    def register_lora(self, lora_request: LoRARequest | None) -> str | None:
        """The adapter's name, once it is known to work with this model (checked on its first
        use, before it takes a slot); ValueError naming the problem otherwise."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if self.lora is None:
            raise ValueError(
                f"request for LoRA adapter {lora_request.name!r}, but LoRA is off: start the "
                "engine with enable_lora=True (--enable-lora)"
            )
        return self.lora.register(lora_request)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        self.check_open()
        token_ids = self.validate(prompt, params, lora_request)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running: use a new id")
        lora_name = lora_request.name if lora_request is not None else None
        seq = Sequence(request_id, token_ids, params, lora_name, self.tokenizer.eos_token_id)
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        self.requests[request_id] = seq
        if self.detokenize:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(token_ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is not None:
            self._end(seq, "abort")

    def _end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        del self.requests[seq.request_id]
        self.detokenizers.pop(seq.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Submit batches until every pipeline stage has one (with async scheduling: until the
        next batch is launched behind the one the device runs), then finish the oldest."""
        self.check_open()
        while len(self.in_flight) < self.executor.max_in_flight:
            batch = self.scheduler.schedule()
            if batch is None:
                break
            previous = self.in_flight[-1][1] if self.in_flight else None
            step = self.runner.build_step(batch, self.lora, previous)
            self._constrain(step)
            try:
                pending = self.executor.submit(step)
            except BaseException:
                self._drop_in_flight([(batch, step, None)])
                raise
            self.in_flight.append((batch, step, pending))
        if not self.in_flight:
            return []
        batch, step, pending = self.in_flight[0]
        try:
            sampled = pending.result()
        except BaseException:
            self._drop_in_flight([])  # later steps read this one's tokens
            raise
        self.in_flight.popleft()
        outputs: list[RequestOutput] = []
        accepted: dict[str, int] = {}
        try:
            if sampled is not None:
                seqs = {seq.request_id: seq for seq in batch.seqs}
                for request_id, start, entries in sampled.prompt_logprobs:
                    scores = seqs[request_id].prompt_logprobs
                    scores[start : start + len(entries)] = entries
                for row, tokens, logprobs in zip(
                    step.sampling, sampled.token_ids, sampled.logprobs, strict=True
                ):
                    seq = seqs[row.request_id]
                    if seq.status is SequenceStatus.FINISHED:  # ended while in flight
                        continue
                    if row.draft_token_ids:
                        accepted[row.request_id] = len(tokens) - 1
                        self.spec_draft_tokens += len(row.draft_token_ids)
                        self.spec_accepted_tokens += len(tokens) - 1
                    outputs.append(self._append_tokens(seq, tokens, logprobs))
        finally:  # after the tokens are appended: the prefix cache hashes them
            self.scheduler.complete(batch, accepted)
        if self.in_flight and self.in_flight[0][1].mask_pending:
            _, held, pending = self.in_flight[0]
            pending.sample(self.grammars.bitmask(held.sampling, self._matchers(held)))
        return outputs

    def _constrain(self, step: StepInput) -> None:
        """The token bitmask of a step with structured outputs. When a constrained request's
        last token is still in flight (async scheduling), its grammar cannot tell yet: the step
        launches with mask_pending, and step() hands it the mask once that token is read, while
        the device runs the step's forward."""
        if not any(row.params.structured_outputs for row in step.sampling):
            return
        for row in step.sampling:
            seq = self.requests[row.request_id]
            if seq.grammar is not None and row.position > len(seq.token_ids):
                step.mask_pending = True
                return
        step.bitmask = self.grammars.bitmask(step.sampling, self._matchers(step))

    def _matchers(self, step: StepInput) -> list:
        """Each sampling row's grammar matcher; None for a request without one or ended."""
        seqs = (self.requests.get(row.request_id) for row in step.sampling)
        return [seq.grammar if seq is not None else None for seq in seqs]

    def _drop_in_flight(self, also: list) -> None:
        """A step failed: every batch in flight (and `also`) leaves flight without having run."""
        for batch, step, _ in [*self.in_flight, *also]:
            self.scheduler.complete(batch, ran=False)
            if self.lora is not None:
                self.lora.forget(step.lora_loads)
        self.in_flight.clear()

    def _append_tokens(
        self, seq: Sequence, tokens: list[int], logprobs: list[dict] | None
    ) -> RequestOutput:
        """Append a step's tokens (accepted drafts, then the sampled one) one at a time, as
        decoding without drafts would, and stop at the first that ends the request."""
        detok = self.detokenizers.get(seq.request_id)
        output_ids = seq.output_token_ids  # one copy per step, shared below
        reason = None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            output_ids.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if detok is not None:
                detok.update(output_ids)
            reason = self._finish_reason(seq, token, detok)
            if seq.grammar is not None and reason is None:
                seq.grammar.consume_token(token)
                if seq.grammar.is_stopped():  # the grammar is complete: nothing may follow
                    reason = "stop"
            if reason is not None:
                tokens = tokens[: i + 1]
                break
        self.generation_tokens_total += len(tokens)
        if reason is not None:
            if detok is not None and not detok.text_stopped:
                detok.update(output_ids, final=True)
            self._end(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=output_ids,
            text=detok.text if detok is not None else "",
            new_token_ids=tokens,
            finished=reason is not None,
            finish_reason=reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _finish_reason(
        self, seq: Sequence, token: int, detok: IncrementalDetokenizer | None
    ) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:  # before min_tokens nothing stops it
            if token in seq.stop_ids:
                return "stop"
            if detok is not None and cut_at_stop(detok, p.stop):
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.config.max_model_len:
            return "length"
        return None

    # ---- reports -----------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_acceptance_rate": self.spec_accepted_tokens / max(self.spec_draft_tokens, 1),
            "structured_mask_steps": self.grammars.mask_steps,
            "structured_mask_seconds": self.grammars.mask_seconds,
        }

    def graph_report(self) -> dict:
        return self.executor.graph_report()

    @property
    def failed(self) -> str | None:
        """Why the engine stopped for good (a worker process died), else None."""
        return self.executor.failed

    def shutdown(self) -> None:
        """Stop the worker processes, if any, and give back every device allocation (KV
        cache, graphs and their pool, buffers, weights). Requests still running are dropped;
        the engine takes no more steps. A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self.in_flight.clear()
        self.executor.shutdown()

    def check_open(self) -> None:
        if self.closed:
            raise EngineShutdownError(
                "this engine has been shut down (shutdown() or the end of its `with` block): "
                "build a new one"
            )
