"""Persistent input buffers: allocated once at maximum size, sliced by every step and graph.

CUDA graphs captured the device addresses of these slices, so a step never reallocates them:
it packs the live batch into one pinned host buffer, copies that in once, and scatters it into
the buffers with one kernel (kernels/unpack.py).
"""

from __future__ import annotations

import numpy as np
import torch

from ostinato.context import AttentionMetadata, LoRAMetadata
from ostinato.kernels.unpack import HEADER, Unpack, packed_size
from ostinato.runner.deadline import wait_for
from ostinato.runner.step import StepInput

_FIELDS = {  # name -> (dtype, shape in terms of (max_tokens, max_reqs, max_blocks))
    "input_ids": (torch.int64, lambda t, r, b: (t,)),
    "positions": (torch.int64, lambda t, r, b: (t,)),
    "slot_mapping": (torch.int64, lambda t, r, b: (t,)),
    "query_start_loc": (torch.int32, lambda t, r, b: (r + 1,)),
    "seq_lens": (torch.int32, lambda t, r, b: (r,)),
    "block_table": (torch.int32, lambda t, r, b: (r, b)),
    "logits_indices": (torch.int64, lambda t, r, b: (t,)),  # a row per token at most (drafts)
    # async scheduling: input tokens the step in flight samples, and their rows of its samples
    "placeholder_tokens": (torch.int64, lambda t, r, b: (r,)),
    "placeholder_rows": (torch.int64, lambda t, r, b: (r,)),
}
# with LoRA: tokens grouped by adapter, and each group's slot, start and count (LoRAMetadata)
_LORA_FIELDS = ("lora_tokens", "lora_slots", "lora_starts", "lora_counts")
# fields with a host mirror: copied on their own, or (query starts, lengths) read on the host
_MIRRORED = ("query_start_loc", "seq_lens", "placeholder_tokens", "placeholder_rows")


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        device: torch.device,
        max_loras: int = 0,
        timeout: float | None = None,
    ):
        """timeout: seconds a step may wait for the device to finish reading the last step's
        copies (None: no limit; several processes pass distributed_timeout)."""
        self.timeout = timeout
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        pin = device.type == "cuda"
        self.device: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        shapes = {
            name: (dtype, shape_of(max_tokens, max_reqs, max_blocks))
            for name, (dtype, shape_of) in _FIELDS.items()
        }
        if max_loras:
            lora_shapes = ((max_tokens,), (max_loras,), (max_loras,), (max_loras,))
            shapes |= {n: (torch.int32, s) for n, s in zip(_LORA_FIELDS, lora_shapes, strict=True)}
        for name, (dtype, shape) in shapes.items():
            self.device[name] = torch.zeros(shape, dtype=dtype, device=device)
            if name in _MIRRORED or name in _LORA_FIELDS:
                self.host[name] = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        size = packed_size(max_tokens, max_reqs, max_blocks)
        self.packed_host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.packed = torch.zeros(size, dtype=torch.int64, device=device)
        self.unpack = Unpack(self.packed, self.device)
        # numpy views of the host buffers: writing through them costs far less per call
        self.host_np = {name: t.numpy() for name, t in self.host.items()}
        self.packed_np = self.packed_host.numpy()
        # Marks when the device has read the host buffers: copies are asynchronous, and a step
        # that samples nothing never waits on the device, so the next step must before writing.
        self.copied = torch.cuda.Event() if pin else None

    def load(self, step: StepInput) -> None:
        """Pack step, padded to the step's graph sizes, into the pinned host buffer, copy it to
        the device in one transfer and scatter it into the buffers. Padded tokens store their
        KV nowhere (slot -1); padded requests have no tokens and no KV."""
        if self.copied is not None:  # the last step's copies out of the mirror are done
            wait_for(self.copied, self.timeout, "the last step's input copies")
        p = self.packed_np
        n, r = step.num_tokens, step.num_reqs
        num_tokens, num_reqs = step.padded_tokens, step.padded_reqs
        width = step.block_table.shape[1]
        num_rows = len(step.logits_indices)
        header = p[:HEADER]
        header[:] = num_tokens, num_reqs, num_rows, r, width
        at = HEADER
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            p[at : at + n] = getattr(step, name)
            p[at + n : at + num_tokens] = pad
            at += num_tokens
        p[at : at + num_rows] = step.logits_indices
        at += num_rows
        starts = p[at : at + num_reqs + 1]
        starts[: r + 1] = step.query_start_loc
        starts[r + 1 :] = n
        lens = p[at + num_reqs + 1 : at + 2 * num_reqs + 1]
        lens[:r] = step.seq_lens
        lens[r:] = 0
        at += 2 * num_reqs + 1
        p[at : at + r * width] = step.block_table.ravel()
        at += r * width
        self.host_np["query_start_loc"][: num_reqs + 1] = starts
        self.host_np["seq_lens"][:num_reqs] = lens
        self.packed[:at].copy_(self.packed_host[:at], True)
        self.unpack(self.packed, header, at - HEADER)
        if step.desc.num_active_loras:
            self._load_lora(step)
        if self.copied is not None:
            self.copied.record()

    def fill_placeholders(self, step: StepInput, sampled: torch.Tensor) -> None:
        """Copy the tokens the step before sampled (`sampled`, one per logits row, on the
        device) into step's placeholder input tokens, without waiting for them."""
        h, d, host = self.host_np, self.device, self.host
        n = len(step.placeholder_tokens)
        for name in ("placeholder_tokens", "placeholder_rows"):
            h[name][:n] = getattr(step, name)
            d[name][:n].copy_(host[name][:n], True)
        if self.copied is not None:  # these copies read the mirror too
            self.copied.record()
        rows, tokens = d["placeholder_rows"][:n], d["placeholder_tokens"][:n]
        d["input_ids"].index_copy_(0, tokens, sampled.index_select(0, rows))

    def _load_lora(self, step: StepInput) -> None:
        """Group the step's tokens by adapter slot; groups past the step's own (the graph key
        pads their number) are empty."""
        h, num_loras = self.host_np, step.desc.num_active_loras
        q = np.diff(step.query_start_loc)
        tokens, slots, starts, counts = group_by_adapter(np.repeat(step.lora_slots, q))
        h["lora_tokens"][: len(tokens)] = tokens
        for name, values in zip(_LORA_FIELDS[1:], (slots, starts, counts), strict=True):
            h[name][: len(values)] = values
            h[name][len(values) : num_loras] = 0
        d, host = self.device, self.host
        d["lora_tokens"][: len(tokens)].copy_(host["lora_tokens"][: len(tokens)], True)
        for name in _LORA_FIELDS[1:]:
            d[name][:num_loras].copy_(host[name][:num_loras], True)

    def lora_metadata(self, num_tokens: int, num_loras: int) -> LoRAMetadata | None:
        """The adapter groups of the first num_tokens tokens; None when no token uses one."""
        if not num_loras:
            return None
        d = self.device
        return LoRAMetadata(
            num_active=num_loras,
            token_indices=d["lora_tokens"][:num_tokens],
            slots=d["lora_slots"][:num_loras],
            starts=d["lora_starts"][:num_loras],
            counts=d["lora_counts"][:num_loras],
        )

    def metadata(
        self, num_tokens: int, num_reqs: int, uniform_query_len: int | None = None
    ) -> AttentionMetadata:
        """Attention metadata over the first num_tokens / num_reqs entries of the buffers."""
        d, h = self.device, self.host
        return AttentionMetadata(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            query_start_loc=d["query_start_loc"][: num_reqs + 1],
            seq_lens=d["seq_lens"][:num_reqs],
            block_table=d["block_table"][:num_reqs],
            slot_mapping=d["slot_mapping"][:num_tokens],
            query_start_loc_cpu=h["query_start_loc"][: num_reqs + 1],
            seq_lens_cpu=h["seq_lens"][:num_reqs],
            uniform_query_len=uniform_query_len,
        )


def group_by_adapter(token_slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-token adapter slots (-1: none) -> (token indices grouped by slot, in token order
    within a group; each group's slot, start and count), groups in ascending slot order."""
    tokens = np.flatnonzero(token_slots >= 0)
    tokens = tokens[np.argsort(token_slots[tokens], kind="stable")]
    slots, starts, counts = np.unique(token_slots[tokens], return_index=True, return_counts=True)
    return tokens, slots, starts, counts
