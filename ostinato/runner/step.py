"""One step as every rank needs it: built on the driver from the scheduler's batch, host-side
only and picklable, so pipeline and tensor-parallel workers run exactly what rank 0 decided."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ostinato.engine.scheduler import ScheduledBatch
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.lora.slots import AdapterSlots, LoRALoad
from ostinato.sampling_params import SamplingParams
from ostinato.structured.bitmask import TokenBitmask

Dispatch = Callable[[int, int, int | None, int], tuple[CudaGraphMode, BatchDescriptor]]


@dataclass(frozen=True)
class SamplingRow:
    """One request that samples this step. It owns 1 + len(draft_token_ids) consecutive logits
    rows, in order: row j verifies draft j (it predicts the token after draft j - 1, or after
    the request's last token for j = 0), the last one gives the token after every draft."""

    request_id: str
    params: SamplingParams
    position: int  # where row 0's token goes in the request's sequence (seeded draws key on it)
    draft_token_ids: tuple[int, ...] = ()
    history: TokenHistory | None = None  # what penalties read; None when the request has none
    banned: tuple[int, ...] = ()  # ids masked in rows j < min_tokens_left (EOS, stop ids)
    min_tokens_left: int = 0


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a penalized request's row 0 follows: its prompt and the output tokens the
    host knows; `pending`: one more output token is in flight, the row's input token, which
    only the device knows yet (async scheduling). Row j also follows drafts 0..j-1."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    pending: bool


@dataclass(frozen=True)
class PromptRows:
    """Logits rows that score a request's prompt (prompt_logprobs): row i predicts prompt
    token start + i, which is targets[i]."""

    request_id: str
    start: int
    targets: tuple[int, ...]
    num_logprobs: int


@dataclass
class StepInput:
    """The live batch (unpadded) plus the graph decision every rank follows.

    Arrays: tokens [num_tokens], requests [num_reqs] (+1 for query_start_loc), block_table
    [num_reqs, widest request's blocks], logits_indices [rows whose logits are computed: one
    per sampling row and draft token, then one per prompt position scored for prompt_logprobs
    (prompt_rows, in order)], lora_slots [num_reqs] (each request's adapter slot, -1
    for none; None when no request uses an adapter). lora_loads: adapters every rank copies
    into their slots (its own layers' share) before running the step.

    With async scheduling some input tokens are not known when the step is built: the step
    before it, still in flight, samples them. input_ids holds 0 there; the runner copies
    the previous step's sampled token of logits row placeholder_rows[i] into input token
    placeholder_tokens[i] on the device.

    bitmask: the tokens each constrained logits row may sample (structured outputs; None: no
    constraint; see ostinato/structured/bitmask.py). When a constrained request's grammar
    waits for the token in flight, mask_pending is set instead: the step's forward runs at
    once and its sampling waits for the engine to hand over the mask.
    """

    mode: CudaGraphMode
    desc: BatchDescriptor
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    logits_indices: np.ndarray
    sampling: list[SamplingRow]
    lora_slots: np.ndarray | None = None
    lora_loads: tuple[LoRALoad, ...] = ()
    placeholder_tokens: np.ndarray | None = None
    placeholder_rows: np.ndarray | None = None
    bitmask: TokenBitmask | None = None
    mask_pending: bool = False
    prompt_rows: list[PromptRows] = field(default_factory=list)

    @property
    def num_sampling_rows(self) -> int:
        """Logits rows that sample; the prompt rows follow them."""
        return len(self.logits_indices) - sum(len(r.targets) for r in self.prompt_rows)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def padded_tokens(self) -> int:
        return self.desc.num_tokens

    @property
    def padded_reqs(self) -> int:
        """FULL graphs run a fixed request count (padded requests have no tokens)."""
        return self.desc.num_reqs if self.mode is CudaGraphMode.FULL else self.num_reqs


def build_step(
    batch: ScheduledBatch,
    block_size: int,
    dispatch: Dispatch,
    lora: AdapterSlots | None = None,
    previous: StepInput | None = None,
) -> StepInput:
    """Token-level arrays of `batch`, vectorised over tokens, its adapter slots (assigned by
    `lora`) and its graph decision. A request's draft tokens follow its last token; each
    sampling request gets a logits row for its last token and one per draft. A token that
    `previous` (the step in flight) samples becomes a placeholder."""
    seqs, drafts, n = batch.seqs, batch.drafts, len(batch.seqs)
    lora_slots, lora_loads, num_loras = None, (), 0
    if lora is not None and any(s.lora_name is not None for s in seqs):
        lora_slots, lora_loads = lora.assign([s.lora_name for s in seqs])
        num_loras = len(np.unique(lora_slots[lora_slots >= 0]))
    mode, desc = dispatch(batch.num_tokens, n, batch.uniform_query_len, num_loras)
    starts = np.asarray(batch.starts, dtype=np.int64)
    q = np.asarray(batch.query_lens, dtype=np.int64)
    ends = starts + q
    query_start_loc = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q, out=query_start_loc[1:])
    speculating = any(drafts)
    num_drafts = np.fromiter((len(d) for d in drafts), np.int64, n) if speculating else 0
    token_ends = ends - num_drafts  # where each request's own tokens end; its drafts follow
    known_ends = np.minimum(token_ends, [len(s.token_ids) for s in seqs])
    ids: list[int] = []  # list.extend copies in C: a per-token generator cost ~1 ms at 8k tokens
    for s, d, a, b, unknown in zip(seqs, drafts, starts.tolist(), known_ends.tolist(),
                                   (token_ends - known_ends).tolist(), strict=True):  # fmt: skip
        ids += s.token_ids[a:b]
        ids += [0] * unknown
        ids += d
    input_ids = np.array(ids, dtype=np.int64)
    req_of_token = np.repeat(np.arange(n), q)
    positions = np.arange(batch.num_tokens) - (query_start_loc[:n] - starts)[req_of_token]
    block_table = np.zeros((n, max(len(s.block_ids) for s in seqs)), dtype=np.int32)
    for i, seq in enumerate(seqs):
        block_table[i, : len(seq.block_ids)] = seq.block_ids
    slot_mapping = (
        block_table[req_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    sampled = np.flatnonzero(batch.sampled)
    placeholders = np.flatnonzero(token_ends > known_ends)
    # a sampling request's logits rows end with its tokens (its last draft, or its last token)
    row_ends = query_start_loc[1:][sampled].astype(np.int64)
    if speculating:
        logits_indices = _logits_rows(row_ends, 1 + num_drafts[sampled])
    else:
        logits_indices = row_ends - 1
    prompt_rows = [
        _prompt_rows(s, a, b, qsl)
        for s, a, b, qsl in zip(seqs, starts.tolist(), token_ends.tolist(),
                                query_start_loc[:n].tolist(), strict=True)
        if s.params.prompt_logprobs is not None and a < s.num_prompt_tokens - 1
    ]  # fmt: skip
    if prompt_rows:
        scored = [token_rows for token_rows, _ in prompt_rows]
        logits_indices = np.concatenate([logits_indices, *scored])
    unknown = token_ends - known_ends
    return StepInput(
        mode=mode,
        desc=desc,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=ends.astype(np.int32),
        block_table=block_table,
        logits_indices=logits_indices,
        sampling=[
            _sampling_row(seqs[i], int(token_ends[i]), drafts[i], bool(unknown[i]))
            for i in sampled.tolist()
        ],
        lora_slots=lora_slots,
        lora_loads=lora_loads,
        placeholder_tokens=(query_start_loc[placeholders] + known_ends[placeholders]
                            - starts[placeholders]) if placeholders.size else None,
        placeholder_rows=_sampled_rows(previous, [seqs[i] for i in placeholders.tolist()])
        if placeholders.size else None,
        prompt_rows=[rows for _, rows in prompt_rows],
    )  # fmt: skip


def _sampling_row(seq, position: int, drafts: list[int], pending: bool) -> SamplingRow:
    """The request's sampling row; what its penalties and min_tokens read only when it has
    them (per-step host work stays flat for the others)."""
    p = seq.params
    row = SamplingRow(seq.request_id, p, position, tuple(drafts))
    if not p.penalized and not p.min_tokens:
        return row
    history = None
    if p.penalized:
        output = tuple(seq.token_ids[seq.num_prompt_tokens :])
        history = TokenHistory(seq.prompt_token_ids, output, pending)
    left = p.min_tokens - (position - seq.num_prompt_tokens)
    banned = tuple(sorted(seq.stop_ids)) if left > 0 else ()
    return replace(row, history=history, banned=banned, min_tokens_left=max(left, 0))


def _prompt_rows(seq, start: int, end: int, row: int) -> tuple[np.ndarray, PromptRows]:
    """The token rows of seq's chunk [start, end) (position start is token row `row`) whose
    next token is a prompt token, and what their logits score."""
    stop = min(end, seq.num_prompt_tokens - 1)
    targets = seq.prompt_token_ids[start + 1 : stop + 1]
    rows = PromptRows(seq.request_id, start + 1, targets, seq.params.prompt_logprobs)
    return np.arange(row, row + len(targets)), rows


def _sampled_rows(previous: StepInput | None, seqs: list) -> np.ndarray:
    """The logits row of `previous` whose sample is each request's next token (its last: a
    request whose token is still unknown had no drafts in flight)."""
    if previous is None:
        raise ValueError("a step with tokens still being sampled needs the step in flight")
    last_row, row = {}, -1
    for sampling in previous.sampling:
        row += 1 + len(sampling.draft_token_ids)
        last_row[sampling.request_id] = row
    return np.asarray([last_row[s.request_id] for s in seqs], dtype=np.int64)


def _logits_rows(ends: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The last widths[i] token rows before each ends[i], in order."""
    offsets = np.arange(int(widths.sum())) - np.repeat(np.cumsum(widths) - widths, widths)
    return np.repeat(ends - widths, widths) + offsets


def dummy_step(
    num_tokens: int, num_reqs: int, max_model_len: int, block_size: int, num_loras: int = 0
) -> StepInput:
    """A fake batch that stores nothing: num_reqs requests sharing num_tokens tokens, every
    one reading block 0, for warm-up, capture and memory profiling. Its logits rows are every
    request's last token. With num_loras, requests take slots 0..num_loras-1 in turn (graph
    keys of num_loras groups; groups beyond the requests are empty). Its descriptor has the
    uniform query length of an even cut, as a live step of those lengths would."""
    lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    lens[: num_tokens % num_reqs] += 1
    ends = np.cumsum(lens)
    seq_lens = np.minimum(lens, max_model_len)
    uniform = num_tokens // num_reqs if num_tokens % num_reqs == 0 else 0
    return StepInput(
        mode=CudaGraphMode.NONE,
        desc=BatchDescriptor(num_tokens, num_reqs, uniform or None, num_loras),
        input_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.zeros(num_tokens, dtype=np.int64),
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
        query_start_loc=np.concatenate(([0], ends)).astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=np.zeros((num_reqs, -(-int(seq_lens.max()) // block_size)), dtype=np.int32),
        logits_indices=ends - 1,
        sampling=[],
        lora_slots=np.arange(num_reqs, dtype=np.int32) % num_loras if num_loras else None,
    )
