"""Runs one rank's part of each step: step into persistent buffers, forward, hand on or sample.

Every rank holds a ModelRunner for its pipeline stage and tensor slice. The driver (rank 0)
also turns scheduled batches into StepInputs; every rank then runs the same StepInput: the
first stage embeds, later stages receive the previous stage's intermediates into persistent
buffers, the last stage computes logits and its first tensor rank samples.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from ostinato.attention import get_attention_backend
from ostinato.config import EngineConfig
from ostinato.context import ForwardContext, forward_context
from ostinato.distributed.parallel import Rank, startup_timeout, tp_group
from ostinato.distributed.world import release_before_teardown
from ostinato.engine.scheduler import ScheduledBatch
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.memory import graph_memory_reserve
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.kernels import triton_key
from ostinato.layout import kv_heads_per_rank, stage_layers
from ostinato.loader import load_model
from ostinato.lora.model import LoRAModel
from ostinato.lora.slots import AdapterSlots
from ostinato.models.base import IntermediateTensors
from ostinato.models.llama import head_dim
from ostinato.runner.deadline import DeviceTimeout, wait_for
from ostinato.runner.input_buffers import InputBuffers
from ostinato.runner.sampler import (
    PromptScores,
    SampledTokens,
    Sampler,
    SamplerOutput,
    greedy_rows,
    nucleus_rows,
    warm_up_rows,
)
from ostinato.runner.step import StepInput, build_step, dummy_step
from ostinato.structured.bitmask import TokenBitmask, words_for

logger = logging.getLogger("ostinato")

StageOutput = torch.Tensor | IntermediateTensors
PROMPT_LOGITS_ROWS = 256  # prompt positions scored per logits pass (the sampling peak's rows)


class StageLink(Protocol):
    """How a pipeline stage exchanges intermediates with its neighbours."""

    def recv(self, into: IntermediateTensors) -> None: ...

    def send(self, out: IntermediateTensors) -> None: ...


class SampleLink(Protocol):
    """Async scheduling with several processes: the sampled tokens of every step, from the
    sampling rank to the first stage's ranks (their next step's placeholders)."""

    is_src: bool

    def share(self, rows: int, tokens: torch.Tensor | None, device: torch.device) -> None: ...

    def latest(self) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        rank: Rank | None = None,
        link: StageLink | None = None,
        samples: SampleLink | None = None,
    ) -> None:
        """Loads this rank's stage and measures how many KV blocks fit (num_blocks). The
        KV cache and graphs come in start(), once every rank agreed on the block count.
        samples: this rank's part in sharing sampled tokens (async scheduling over several
        processes; None when it neither samples for nor embeds after another rank)."""
        self.config, self.hf_config = config, hf_config
        self.rank, self.link, self.samples = rank or Rank(), link, samples
        self.device = torch.device(config.device)
        if config.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.start_up_seconds: dict[str, float] = {}  # weights, kv_sizing, kv_cache
        hashing = triton_key.prepare() if config.is_cuda else None
        allocated_before = torch.cuda.memory_allocated() if config.is_cuda else 0
        layers = stage_layers(
            hf_config.num_hidden_layers, config.pipeline_parallel_size, config.pp_layer_partition
        )[self.rank.pp_rank]
        with self._timed("weights"):
            self.model = load_model(config, hf_config, (layers.start, layers.stop))
            if hashing is not None:
                hashing.join()
        # the stage's first large collectives follow (the KV sizing's peak step): wait for
        # the stage's slowest loader here, under a start-up deadline, not inside them
        tp_group().wait_for_peers(startup_timeout(config.distributed_timeout))
        # host waits on the device get a deadline when a peer may leave the device waiting
        self.device_timeout = config.distributed_timeout if config.world_size > 1 else None
        self.lora = None
        if config.enable_lora:  # slot buffers now, so the KV sizing counts them as weights
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank)
        self.backend = get_attention_backend(config.attention_backend)()
        self.block_size = config.block_size
        self.max_blocks = config.max_blocks_per_seq
        max_tokens = config.max_num_batched_tokens
        self.buffers = InputBuffers(
            max_tokens,
            config.max_num_seqs,
            self.max_blocks,
            self.device,
            config.max_loras if config.enable_lora else 0,
            self.device_timeout,
        )
        self.intermediate = None
        if not self.rank.is_first_stage:  # received into here; graphs captured these addresses
            hidden = torch.zeros(max_tokens, hf_config.hidden_size, dtype=config.torch_dtype)
            self.intermediate = IntermediateTensors(
                hidden.to(self.device), torch.zeros_like(hidden, device=self.device)
            )
        self.head_input = None  # the LM head's padded input rows (last stage)
        if self.rank.is_last_stage:
            shape = (head_rows(self._most_logits_rows()), hf_config.hidden_size)
            self.head_input = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        self.static_bytes = (
            torch.cuda.memory_allocated() if config.is_cuda else 0
        ) - allocated_before
        self.sampler = Sampler(self.device_timeout)
        self.last_sampled: SampledTokens | None = None  # the last step's, for placeholders
        self.held = None  # logits and rows of a step whose sampling waits for its bitmask
        self.graphs = GraphRunner(config, tp_group().agree_max)
        if self.rank.world_size > 1 and self.graphs.mode is not CudaGraphMode.NONE:
            release_before_teardown(self.graphs.close)  # graphs hold the communicators
        self.kv_caches: list = []
        self.num_graph_checks = 0
        self.graph_memory_budget = 0  # bytes the KV sizing left for graphs (CUDA only)
        self.warm_up_seconds = 0.0  # start-up's eager warm-up batches (_eager_warm_up)
        with self._timed("kv_sizing"):
            self.num_blocks = self._count_kv_blocks()

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Seconds of one start-up phase, its device work included, in start_up_seconds."""
        start = time.perf_counter()
        yield
        if self.config.is_cuda:
            torch.cuda.synchronize(self.device)
        self.start_up_seconds[phase] = time.perf_counter() - start

    def start(self, num_blocks: int | None = None) -> None:
        """Allocate the KV cache (num_blocks: the count every rank agreed on) and capture."""
        self.num_blocks = num_blocks or self.num_blocks
        with self._timed("kv_cache"):
            self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        if self.graphs.mode is not CudaGraphMode.NONE:
            self.graphs.capture(self._forward_desc, self._fill_dummy_desc, self._graph_inputs)
        if self.config.is_cuda and not self.graphs.lazy:
            self._eager_warm_up()

    def _eager_warm_up(self) -> None:
        """Run the attention backend's warm-up batches eagerly, once: their kernels compile
        now, not in the middle of a step that every running request waits for; then the
        step's tail. Lazy capture pays first uses when they come, compiles included, and
        skips this."""
        c = self.hf_config
        k_cache = next(kv for kv in self.kv_caches if kv is not None)[0]
        batches = self.backend.warm_up_batches(
            c.num_attention_heads // self.rank.tp_size,
            k_cache,
            self.buffers.device["block_table"].shape[1],
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
        )
        start = time.perf_counter()
        for num_tokens, num_reqs in batches:
            dummy = self._dummy(num_tokens, num_reqs)
            self.buffers.load(dummy)
            self._forward_desc(dummy.desc)
        if self.rank.is_last_stage:
            self._warm_up_tail()
        torch.cuda.synchronize(self.device)
        self.warm_up_seconds = time.perf_counter() - start
        logger.info(
            "eager warm-up: %d batches and the step's tail in %.2f s",
            len(batches),
            self.warm_up_seconds,
        )

    def _most_sampling_rows(self) -> int:
        """A row per request and one per draft token, within the step's token budget."""
        c = self.config
        return min(c.max_num_seqs * (1 + c.num_speculative_tokens), c.max_num_batched_tokens)

    def _most_logits_rows(self) -> int:
        """The LM head's most rows in one pass: the sampling rows or a chunk of scored
        prompt positions."""
        most = max(self._most_sampling_rows(), PROMPT_LOGITS_ROWS)
        return min(most, self.config.max_num_batched_tokens)

    def _warm_up_tail(self) -> None:
        """The LM head and the sampler run outside every graph. Launch the LM head once per
        row count it can see (cuBLAS loads the kernel it picks for a count on first use) and
        the sampler at the fewest and the most rows with every kind of request, and once with
        a token bitmask, so their kernels are compiled and loaded and the caching allocator
        holds their blocks before the first request. Without this the first burst after
        start-up (80 prompts) waited about 60 ms longer for its first tokens than the next
        (benchmarks/h100-2026-11-26-s25.md)."""
        for rows in sorted({head_rows(n) for n in range(1, self._most_logits_rows() + 1)}):
            logits = self.model.compute_logits(self.head_input[:rows])  # every tensor rank
        most = self._most_sampling_rows()
        if tp_group().rank == 0:
            for rows in sorted({min(3, most), most}):  # from 3 rows on, every path is taken
                self.sampler(logits[:rows], warm_up_rows(rows))
                self.sampler(logits[:rows], nucleus_rows(rows))
                self.sampler(logits[:rows], greedy_rows(rows))
            # structured outputs' token bitmask: its kernel does not specialise on the
            # tokenizer's width, which only the grammar library knows, so any width will do
            mask = TokenBitmask.for_rows([0], words_for(self.hf_config.vocab_size))
            mask.bits[:] = -1
            self.sampler(logits[:1], warm_up_rows(1), mask)

    def close(self) -> None:
        """Give back every device allocation: graphs and their pool, KV cache, persistent
        buffers, weights. The runner takes no more steps; its graph report stays readable.
        With several processes the device may wait for good on a peer that stopped answering
        (a replayed all-reduce): past the steps' deadline the memory is left to the process's
        exit, since freeing it would wait on the device too."""
        drained = self._drained()
        self.graphs.close()
        self.kv_caches = []
        self.model = self.lora = self.buffers = self.intermediate = self.last_sampled = None
        if drained:
            release_memory()
        else:
            logger.warning(
                "the device still waits on a peer after distributed_timeout=%g s: its memory "
                "is left to this process's exit",
                self.device_timeout,
            )

    def _drained(self) -> bool:
        """Whether the device finished its work: every stream's with one process; with
        several, the steps' stream's (where replayed collectives wait), within device_timeout."""
        if not self.config.is_cuda:
            return True
        if self.device_timeout is None:
            torch.cuda.synchronize(self.device)
            return True
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        try:
            wait_for(done, self.device_timeout, "the last steps before closing")
        except DeviceTimeout:
            return False
        return True

    def _graph_inputs(self) -> dict[str, torch.Tensor]:
        """Every persistent buffer a graph reads: the step's, and a later stage's intermediates
        (debug_graph_addresses checks at each replay that none has moved)."""
        if self.intermediate is None:
            return self.buffers.device
        hidden, residual = self.intermediate.hidden_states, self.intermediate.residual
        return {**self.buffers.device, "hidden_states": hidden, "residual": residual}

    # ---- KV cache sizing -------------------------------------------------------------
    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block across this rank's layers and KV heads."""
        c = self.hf_config
        kv_heads = kv_heads_per_rank(c.num_key_value_heads, self.rank.tp_size)
        start, end = self.model.layer_range
        per_layer = 2 * self.block_size * kv_heads * head_dim(c)
        return per_layer * (end - start) * self.config.torch_dtype.itemsize

    def _count_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if not self.config.is_cuda:
            return max(1, self.config.kv_cache_memory // self.kv_block_bytes)
        return self._profile_kv_blocks()

    def _profile_kv_blocks(self) -> int:
        """Blocks that fit once weights, a peak step and the graphs are counted.

        The engine takes gpu_memory_utilization of the device's total memory, counting only
        its own allocations (other engines or processes are not charged to it), and never
        more than is free now.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.kv_caches = self._allocate_kv_cache(1)
        self._run_dummy()
        torch.cuda.synchronize()
        self.kv_caches = []
        activation = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        self.graph_memory_budget = self.graph_memory_reserve(activation)  # lazy capture's too
        headroom = activation + self.graph_memory_budget
        allowed = total * self.config.gpu_memory_utilization - self.static_bytes - headroom
        budget = min(allowed, free - headroom - 256 * 2**20)  # 256 MiB for the allocator's slack
        num_blocks = int(budget // self.kv_block_bytes)
        if num_blocks * self.block_size < self.config.max_model_len:
            raise ValueError(
                f"only {max(num_blocks, 0)} KV blocks fit ({free / 2**30:.1f} GiB free, "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization}), fewer than one "
                f"max_model_len={self.config.max_model_len} sequence needs: raise "
                "gpu_memory_utilization or lower max_model_len / max_num_batched_tokens"
            )
        logger.info(
            "KV cache: %d blocks (%.2f GiB); weights %.2f GiB, peak step activations %.2f GiB",
            num_blocks,
            num_blocks * self.kv_block_bytes / 2**30,
            self.static_bytes / 2**30,
            activation / 2**30,
        )
        return num_blocks

    def graph_memory_reserve(self, activation: int) -> int:
        """Room for the graphs of this runner's plan (graphs/memory.py)."""
        descriptors = [d for ds in self.graphs.dispatcher.descriptors().values() for d in ds]
        return graph_memory_reserve(descriptors, activation, self.config.max_num_batched_tokens)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        c = self.hf_config
        kv_heads = kv_heads_per_rank(c.num_key_value_heads, self.rank.tp_size)
        start, end = self.model.layer_range
        shape = (end - start, 2, num_blocks, self.block_size, kv_heads, head_dim(c))
        cache = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * c.num_hidden_layers
        for i in range(start, end):
            caches[i] = (cache[i - start, 0], cache[i - start, 1])
        return caches

    # ---- one step ------------------------------------------------------------------------
    def build_step(
        self,
        batch: ScheduledBatch,
        lora: AdapterSlots | None = None,
        previous: StepInput | None = None,
    ) -> StepInput:
        """The driver's half: the batch as arrays, with its adapter slots and graph decision
        (`previous`: the step in flight, which samples the tokens batch does not know yet)."""
        return build_step(batch, self.block_size, self.graphs.dispatch, lora, previous)

    def run(self, step: StepInput) -> SamplerOutput | None:
        """Every rank's half. Returns the sampled tokens on the sampling rank (the last stage's
        first tensor rank) when some request reached its last token; None elsewhere."""
        sampled = self.launch(step)
        return sampled.result() if sampled is not None else None

    def launch(self, step: StepInput) -> SampledTokens | None:
        """run() without waiting for the device: the samples are still on their way."""
        for load in step.lora_loads:  # this rank's layers of each adapter, into fixed slots
            self.lora.load(load.slot, load.path)
        self.buffers.load(step)
        if step.placeholder_tokens is not None and self.rank.is_first_stage:  # it embeds them
            self.buffers.fill_placeholders(step, self._sampled_before())
        num_tokens, num_reqs = step.padded_tokens, step.padded_reqs
        if self.intermediate is not None:
            self.link.recv(self._intermediate(num_tokens))
        ctx = self._context(num_tokens, num_reqs, step.desc)
        with forward_context(ctx):  # PIECEWISE breaks read the live batch from it
            out = self.graphs.run(
                step.mode, step.desc, step.num_tokens, lambda: self._model_forward(num_tokens)
            )
            if step.mode is not CudaGraphMode.NONE and self._due_for_check():
                self._check_graph(step, out)
        if not self.rank.is_last_stage:
            self.link.send(_rows(out, num_tokens))
            self._share(step, None)
            return None
        if not step.sampling and not step.prompt_rows:
            return None
        num_rows = step.num_sampling_rows
        logits = self._logits(out, 0, num_rows)
        prompt = self._prompt_scores(out, step) if step.prompt_rows else None
        if tp_group().rank != 0:
            self._share(step, None)
            return None
        if step.mask_pending:  # sampled by sample_held() once the engine has the mask
            self.held = (logits, step.sampling, self._input_tokens(num_rows), prompt)
            return None
        self._sample(logits, step.sampling, step.bitmask, self._input_tokens(num_rows), prompt)
        self._share(step, self.last_sampled.tokens)
        return self.last_sampled

    def sample_held(self, bitmask: TokenBitmask | None) -> SampledTokens:
        """Sample the last launched step, which waited for its token bitmask."""
        (logits, rows, inputs, prompt), self.held = self.held, None
        return self._sample(logits, rows, bitmask, inputs, prompt)

    def _sample(self, logits, rows, bitmask, inputs, prompt) -> SampledTokens:
        self.last_sampled = self.sampler.launch(logits, rows, bitmask, inputs, prompt)
        return self.last_sampled

    def _input_tokens(self, num_rows: int) -> Callable[[], torch.Tensor]:
        """Each logits row's input token on the device, read when the sampler needs it."""
        d = self.buffers.device
        return lambda: d["input_ids"][d["logits_indices"][:num_rows]]

    def _share(self, step: StepInput, tokens: torch.Tensor | None) -> None:
        if self.samples is not None and step.sampling:
            self.samples.share(step.num_sampling_rows, tokens, self.device)

    def _sampled_before(self) -> torch.Tensor:
        """The tokens the step before sampled: this rank's own, or the sampling rank's."""
        if self.samples is None or self.samples.is_src:
            return self.last_sampled.tokens
        return self.samples.latest()

    def _logits(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The logits of the step's logits indices [start, stop). The LM head runs over
        head_rows(stop - start) rows (the padding rows hold earlier values; their logits are
        dropped): a few row counts instead of every one, so start-up warms each once."""
        n = stop - start
        indices = self.buffers.device["logits_indices"][start:stop]
        torch.index_select(hidden, 0, indices, out=self.head_input[:n])
        return self.model.compute_logits(self.head_input[: head_rows(n)])[:n]

    def _prompt_scores(self, hidden: torch.Tensor, step: StepInput) -> PromptScores:
        """Logprobs of the prompt positions the step scores (the logits rows after the
        sampling ones), PROMPT_LOGITS_ROWS rows at a time: a long prefill chunk's logits
        would otherwise take [chunk, vocab] floats at once."""
        first, stop = step.num_sampling_rows, len(step.logits_indices)
        chunks = (
            self._logits(hidden, a, min(a + PROMPT_LOGITS_ROWS, stop))
            for a in range(first, stop, PROMPT_LOGITS_ROWS)
        )
        return PromptScores.score(step.prompt_rows, chunks, self.device)

    def _intermediate(self, num_tokens: int) -> IntermediateTensors:
        return _rows(self.intermediate, num_tokens)

    def _model_forward(self, num_tokens: int) -> StageOutput:
        """The model over the first num_tokens of the buffers, in the current forward context."""
        d = self.buffers.device
        intermediate = self._intermediate(num_tokens) if self.intermediate is not None else None
        return self.model(d["input_ids"][:num_tokens], d["positions"][:num_tokens], intermediate)

    def _context(self, num_tokens: int, num_reqs: int, desc: BatchDescriptor) -> ForwardContext:
        """The first num_tokens / num_reqs entries of the buffers, run under desc (its
        uniform query length, its adapter count)."""
        b = self.buffers
        return ForwardContext(
            b.metadata(num_tokens, num_reqs, desc.uniform_query_len),
            self.kv_caches,
            self.backend,
            b.lora_metadata(num_tokens, desc.num_active_loras),
        )

    # ---- graphs --------------------------------------------------------------------------
    def _forward_desc(self, desc: BatchDescriptor) -> StageOutput:
        """The forward of desc over the buffers: what a graph captures, and the eager warm-up
        and peak-memory batches (their dummy steps' descriptors). PIECEWISE keys carry no
        request count, and their breaks read the live one at replay, so any count serves the
        warm-up and capture.
        The LM head stays outside: each graph keeps its output, and [num_reqs, vocab] logits
        per FULL graph cost 0.6 GiB over the default plan (measured on the H100)."""
        num_tokens, num_reqs = desc.num_tokens, desc.num_reqs or 1
        with forward_context(self._context(num_tokens, num_reqs, desc)):
            return self._model_forward(num_tokens)

    def _fill_dummy_desc(self, desc: BatchDescriptor) -> None:
        self.buffers.load(self._dummy(desc.num_tokens, desc.num_reqs or 1, desc.num_active_loras))

    def _dummy(self, num_tokens: int, num_reqs: int, num_loras: int = 0) -> StepInput:
        c = self.config
        return dummy_step(num_tokens, num_reqs, c.max_model_len, self.block_size, num_loras)

    def _due_for_check(self) -> bool:
        """Every graphed step counts, on every rank alike: the eager re-run of a tensor-parallel
        stage has collectives, so all its ranks must make it together."""
        every = self.config.check_graphs
        self.num_graph_checks += 1
        return every > 0 and self.num_graph_checks % every == 0

    def _check_graph(self, step: StepInput, out: StageOutput) -> None:
        """Re-run the step eagerly on the same buffers and compare this stage's output for the
        live tokens (check_graphs)."""
        eager = self._model_forward(step.padded_tokens)
        for name, got, want in _named_tensors(out, eager):
            got, want = got[: step.num_tokens].float(), want[: step.num_tokens].float()
            diff = (want - got).abs().max().item()
            tolerance = 1e-2 * want.abs().max().item() + 1e-3
            if not diff <= tolerance:
                raise RuntimeError(
                    f"CUDA graph check failed for {step.mode.value} {step.desc}: {name} of "
                    f"stage {self.rank.pp_rank} differs from eager by up to {diff:.4g} "
                    f"(tolerance {tolerance:.4g})"
                )

    def graph_report(self) -> dict:
        """The graph runtime's report, with the bytes the KV sizing left for graphs and the
        seconds start-up spent compiling eager steps' kernels."""
        return {
            **self.graphs.report(),
            "graph_memory_budget_bytes": self.graph_memory_budget,
            "eager_warm_up_seconds": self.warm_up_seconds,
            "start_up_seconds": dict(self.start_up_seconds),
        }

    def _run_dummy(self) -> None:
        """Profile a peak step of max_num_batched_tokens: forward (through every adapter slot
        with LoRA), and on the last stage logits and a float32 softmax over the most rows the
        LM head sees in one pass (the sampling rows, or a chunk of scored prompt positions),
        padded as it pads them."""
        num_tokens = self.config.max_num_batched_tokens
        num_reqs = min(self.config.max_num_seqs, num_tokens)
        num_loras = self.config.max_loras if self.lora is not None else 0
        dummy = self._dummy(num_tokens, num_reqs, num_loras)
        self.buffers.load(dummy)
        out = self._forward_desc(dummy.desc)
        if self.rank.is_last_stage:  # gathered into the head's input, as _logits does
            rows = min(len(self.head_input), len(out))
            self.head_input[:rows].copy_(out[:rows])
            self.model.compute_logits(self.head_input).float().softmax(dim=-1)


def head_rows(num_rows: int) -> int:
    """The rows the LM head runs over for num_rows: the smallest power of two or three
    quarters of one (1, 2, 3, 4, 6, 8, 12, ..., 192, 256) that holds them. cuBLAS loads a new
    kernel at the first use of many counts (3-28 ms each on the H100: 1, 9, 17, 25, 33, 48,
    56, 64, 72, 96, 128, 129 and 200 of the 25 counts tried), so the head sees 16 counts,
    each warmed at start-up; up to 256 rows the head reads its weight once whatever the rows,
    so padding costs nothing measurable (benchmarks/h100-2026-11-26-s26.md)."""
    power = 1 << (num_rows - 1).bit_length()
    return 3 * power // 4 if num_rows <= 3 * power // 4 else power


def release_memory() -> None:
    """Free what was dropped now, not when the cycle collector next runs, and hand the cached
    blocks back to the device so the next engine in this process can size its KV cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # cuBLAS keeps a workspace per stream, from the caching allocator: each engine's
        # capture stream would leave one behind
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def _rows(x: StageOutput, n: int) -> StageOutput:
    if isinstance(x, IntermediateTensors):
        return IntermediateTensors(x.hidden_states[:n], x.residual[:n])
    return x[:n]


def _named_tensors(a: StageOutput, b: StageOutput):
    if isinstance(a, IntermediateTensors):
        yield "hidden states", a.hidden_states, b.hidden_states
        yield "residual", a.residual, b.residual
    else:
        yield "hidden states", a, b
