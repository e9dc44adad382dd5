"""Persistent input buffers: allocated once at maximum size, sliced by every step and graph.

CUDA graphs captured the device addresses of these slices, so a step never reallocates them:
it fills the pinned host mirror and copies the live batch in.
"""

from __future__ import annotations

import numpy as np
import torch

from ostinato.context import AttentionMetadata

_FIELDS = {  # name -> (dtype, shape in terms of (max_tokens, max_reqs, max_blocks))
    "input_ids": (torch.int64, lambda t, r, b: (t,)),
    "positions": (torch.int64, lambda t, r, b: (t,)),
    "slot_mapping": (torch.int64, lambda t, r, b: (t,)),
    "query_start_loc": (torch.int32, lambda t, r, b: (r + 1,)),
    "seq_lens": (torch.int32, lambda t, r, b: (r,)),
    "block_table": (torch.int32, lambda t, r, b: (r, b)),
    "logits_indices": (torch.int64, lambda t, r, b: (r,)),
}


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_reqs, self.max_blocks = max_tokens, max_reqs, max_blocks
        pin = device.type == "cuda"
        self.device: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        for name, (dtype, shape_of) in _FIELDS.items():
            shape = shape_of(max_tokens, max_reqs, max_blocks)
            self.device[name] = torch.zeros(shape, dtype=dtype, device=device)
            self.host[name] = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        # numpy views of the host mirror: writing through them costs far less per call
        self.host_np = {name: t.numpy() for name, t in self.host.items()}
        # Marks when the device has read the host mirror: copies are asynchronous, and a step
        # that samples nothing never waits on the device, so the next step must before writing.
        self.copied = torch.cuda.Event() if pin else None

    def host_for_writing(self) -> dict[str, np.ndarray]:
        """The host mirror as numpy arrays, once the last step's copies out of it are done."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_np

    def write(
        self,
        num_tokens: int,
        num_reqs: int,
        num_padded_tokens: int,
        num_padded_reqs: int,
        block_table_width: int,
    ) -> None:
        """Pad the host mirror past the live batch, then copy it to the device buffers.

        Padded tokens store their KV nowhere (slot -1); padded requests have no tokens.
        """
        h = self.host_np
        h["input_ids"][num_tokens:num_padded_tokens] = 0
        h["positions"][num_tokens:num_padded_tokens] = 0
        h["slot_mapping"][num_tokens:num_padded_tokens] = -1
        h["query_start_loc"][num_reqs + 1 : num_padded_reqs + 1] = num_tokens
        h["seq_lens"][num_reqs:num_padded_reqs] = 0
        d, host = self.device, self.host
        for name in ("input_ids", "positions", "slot_mapping"):
            d[name][:num_padded_tokens].copy_(host[name][:num_padded_tokens], True)
        for name in ("seq_lens", "logits_indices"):
            d[name][:num_padded_reqs].copy_(host[name][:num_padded_reqs], True)
        qsl = host["query_start_loc"][: num_padded_reqs + 1]
        d["query_start_loc"][: num_padded_reqs + 1].copy_(qsl, True)
        width = block_table_width
        bt = host["block_table"][:num_padded_reqs, :width]
        d["block_table"][:num_padded_reqs, :width].copy_(bt, True)
        if self.copied is not None:
            self.copied.record()

    def metadata(self, num_tokens: int, num_reqs: int) -> AttentionMetadata:
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
        )
