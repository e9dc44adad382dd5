"""Runs scheduled batches through the model: inputs into persistent buffers, forward, sample."""

from __future__ import annotations

import logging

import numpy as np
import torch

from ostinato.attention import get_attention_backend
from ostinato.config import EngineConfig
from ostinato.context import ForwardContext, forward_context
from ostinato.engine.scheduler import ScheduledBatch
from ostinato.engine.sequence import Sequence
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.loader import load_model
from ostinato.runner.input_buffers import InputBuffers
from ostinato.runner.sampler import Sampler, SamplerOutput

logger = logging.getLogger("ostinato")


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(config.device)
        if config.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        allocated_before = torch.cuda.memory_allocated() if config.is_cuda else 0
        self.model = load_model(config, hf_config)
        self.backend = get_attention_backend(config.attention_backend)()
        self.block_size = config.block_size
        self.max_blocks = config.max_blocks_per_seq
        self.buffers = InputBuffers(
            config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks, self.device
        )
        self.static_bytes = (
            torch.cuda.memory_allocated() if config.is_cuda else 0
        ) - allocated_before
        self.sampler = Sampler()
        self.graphs = GraphRunner(config)
        self.num_blocks = self._count_kv_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.num_graph_checks = 0
        if self.graphs.mode is not CudaGraphMode.NONE:
            self.graphs.capture(
                self._forward_desc, self._fill_dummy_desc, lambda: self.buffers.device
            )

    # ---- KV cache sizing -------------------------------------------------------------
    @property
    def kv_block_bytes(self) -> int:
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_layer = 2 * self.block_size * c.num_key_value_heads * head_dim
        return per_layer * c.num_hidden_layers * self.config.torch_dtype.itemsize

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
        scratch = self._allocate_kv_cache(1)
        self._run_dummy(self.config.max_num_batched_tokens, scratch)
        torch.cuda.synchronize()
        del scratch
        activation = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        headroom = activation + self.graph_memory_reserve(activation)
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
        """Room for the graph pool: graphs share one pool, so it holds about twice the
        activations of the largest captured step, plus a few MiB of each graph's own state
        (on the H100: 0.20 GiB measured for qwen3-0.6b's 48 graphs, 0.27 GiB for llama-3.1-8b)."""
        sizes = self.graphs.dispatcher.capture_sizes()
        largest = max(sizes["full"] + sizes["piecewise"], default=0)
        if not largest:
            return 0
        share = min(1.0, largest / self.config.max_num_batched_tokens)
        num_graphs = len(sizes["full"]) + len(sizes["piecewise"])
        return int(activation * share * 2) + num_graphs * 4 * 2**20

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        c = self.hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        start, end = self.model.layer_range
        shape = (end - start, 2, num_blocks, self.block_size, c.num_key_value_heads, head_dim)
        cache = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * c.num_hidden_layers
        for i in range(start, end):
            caches[i] = (cache[i - start, 0], cache[i - start, 1])
        return caches

    # ---- one step ------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SamplerOutput] | None:
        """Run batch; sample for the requests whose query reached their last token."""
        num_tokens, num_reqs = batch.num_tokens, len(batch.seqs)
        mode, desc = self.graphs.dispatch(num_tokens, num_reqs, batch.uniform_query_len)
        padded_reqs = desc.num_reqs if mode is CudaGraphMode.FULL else num_reqs
        sample_seqs = self._prepare(batch, padded_reqs, desc.num_tokens)
        if mode is CudaGraphMode.NONE:
            out = self._forward(num_tokens, num_reqs)
        else:
            ctx = ForwardContext(
                self.buffers.metadata(desc.num_tokens, padded_reqs), self.kv_caches, self.backend
            )
            with forward_context(ctx):  # PIECEWISE breaks read the live batch from it
                out = self.graphs.replay(mode, desc)
        if not sample_seqs:
            return None
        logits = self._logits(out, len(sample_seqs))
        if mode is not CudaGraphMode.NONE and self._due_for_check():
            self._check_graph(mode, desc, padded_reqs, logits)
        return sample_seqs, self.sampler(logits, sample_seqs)

    def _logits(self, hidden: torch.Tensor, num_sampled: int) -> torch.Tensor:
        return self.model.compute_logits(
            hidden[self.buffers.device["logits_indices"][:num_sampled]]
        )

    def _forward(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        ctx = ForwardContext(
            self.buffers.metadata(num_tokens, num_reqs), self.kv_caches, self.backend
        )
        d = self.buffers.device
        with forward_context(ctx):
            return self.model(d["input_ids"][:num_tokens], d["positions"][:num_tokens])

    # ---- graphs --------------------------------------------------------------------------
    def _forward_desc(self, desc: BatchDescriptor) -> torch.Tensor:
        """The forward a graph captures: PIECEWISE keys carry no request count, and their
        breaks read the live one at replay, so any count serves the warm-up and capture.
        The LM head stays outside: each graph keeps its output, and [num_reqs, vocab] logits
        per FULL graph cost 0.6 GiB over the default plan (measured on the H100)."""
        return self._forward(desc.num_tokens, desc.num_reqs or 1)

    def _fill_dummy_desc(self, desc: BatchDescriptor) -> None:
        self._fill_dummy(desc.num_tokens, desc.num_reqs or 1)

    def _due_for_check(self) -> bool:
        every = self.config.check_graphs
        self.num_graph_checks += 1
        return every > 0 and self.num_graph_checks % every == 0

    def _check_graph(self, mode, desc, num_reqs: int, logits: torch.Tensor) -> None:
        """Re-run the step eagerly on the same buffers and compare logits (check_graphs)."""
        eager = self._logits(self._forward(desc.num_tokens, num_reqs), logits.shape[0]).float()
        diff = (eager - logits.float()).abs().max().item()
        tolerance = 1e-2 * eager.abs().max().item() + 1e-3
        if not diff <= tolerance:
            raise RuntimeError(
                f"CUDA graph check failed for {mode.value} {desc}: logits differ from eager "
                f"by up to {diff:.4g} (tolerance {tolerance:.4g})"
            )

    def graph_report(self) -> dict:
        return self.graphs.report()

    def _prepare(
        self, batch: ScheduledBatch, num_padded_reqs: int, num_padded_tokens: int
    ) -> list[Sequence]:
        """Write batch into the host mirror (vectorised over tokens), then copy it over."""
        h, seqs, bs = self.buffers.host_for_writing(), batch.seqs, self.block_size
        n, num_tokens = len(seqs), batch.num_tokens
        starts = [s.num_computed_tokens for s in seqs]
        ends = [a + q for a, q in zip(starts, batch.query_lens, strict=True)]
        q = np.asarray(batch.query_lens)
        qsl = h["query_start_loc"]
        qsl[0] = 0
        np.cumsum(q, out=qsl[1 : n + 1])
        h["seq_lens"][:n] = ends
        h["input_ids"][:num_tokens] = [
            t for s, a, b in zip(seqs, starts, ends, strict=True) for t in s.token_ids[a:b]
        ]
        req_of_token = np.repeat(np.arange(n), q)
        positions = np.arange(num_tokens) - (qsl[:n] - starts)[req_of_token]
        h["positions"][:num_tokens] = positions
        block_table = h["block_table"]
        for i, seq in enumerate(seqs):
            block_table[i, : len(seq.block_ids)] = seq.block_ids
        width = max(len(s.block_ids) for s in seqs)
        h["slot_mapping"][:num_tokens] = (
            block_table[req_of_token, positions // bs] * bs + positions % bs
        )
        sampled = [
            i for i, (seq, end) in enumerate(zip(seqs, ends, strict=True)) if end == len(seq)
        ]
        h["logits_indices"][: len(sampled)] = qsl[np.asarray(sampled, dtype=np.int64) + 1] - 1
        self.buffers.write(num_tokens, n, num_padded_tokens, num_padded_reqs, width)
        return [seqs[i] for i in sampled]

    def _fill_dummy(self, num_tokens: int, num_reqs: int) -> None:
        """Write a fake batch that stores nothing: num_reqs requests sharing num_tokens tokens."""
        h = self.buffers.host_for_writing()
        lens = np.full(num_reqs, num_tokens // num_reqs)
        lens[: num_tokens % num_reqs] += 1
        ends = np.cumsum(lens)
        h["query_start_loc"][: num_reqs + 1] = np.concatenate(([0], ends))
        h["seq_lens"][:num_reqs] = np.minimum(lens, self.config.max_model_len)
        h["logits_indices"][:num_reqs] = ends - 1
        h["block_table"][:num_reqs] = 0
        h["input_ids"][:num_tokens] = 0
        h["positions"][:num_tokens] = 0
        h["slot_mapping"][:num_tokens] = -1
        self.buffers.write(num_tokens, num_reqs, num_tokens, num_reqs, self.max_blocks)

    def _run_dummy(self, num_tokens: int, kv_caches) -> None:
        """Profile a peak step: forward, logits and softmax for a full batch of fake tokens."""
        num_reqs = min(self.config.max_num_seqs, num_tokens)
        self._fill_dummy(num_tokens, num_reqs)
        self.kv_caches = kv_caches
        hidden = self._forward(num_tokens, num_reqs)
        logits = self.model.compute_logits(hidden[self.buffers.device["logits_indices"][:num_reqs]])
        logits.float().softmax(dim=-1)
