"""The driver's side of LoRA: which adapters exist, and which slot holds each.

Every rank runs the steps in the order the driver built them, so a slot may be given to a new
adapter as soon as the batch being built does not use it: batches still in flight that used
its old adapter run before the step carrying the load, on every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ostinato.lora.adapter import BaseShapes, check_adapter
from ostinato.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRALoad:
    """Copy adapter `name` from `path` into `slot` before running the step that carries it."""

    slot: int
    name: str
    path: str


class AdapterSlots:
    def __init__(self, base: BaseShapes, max_loras: int, max_rank: int) -> None:
        self.base, self.max_loras, self.max_rank = base, max_loras, max_rank
        self.paths: dict[str, str] = {}  # every adapter checked so far
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.free = list(range(max_loras - 1, -1, -1))

    def register(self, request: LoRARequest) -> str:
        """Check the adapter on first use (ValueError naming the problem; nothing changes) and
        return its name."""
        known = self.paths.get(request.name)
        if known is not None:
            if known != request.path:
                raise ValueError(
                    f"LoRA adapter {request.name!r} is already loaded from {known}, not "
                    f"{request.path}: give each adapter directory its own name"
                )
            return request.name
        try:
            check_adapter(request.path, self.base, self.max_rank)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {request.name!r} ({request.path}): {e}") from None
        self.paths[request.name] = request.path
        return request.name

    def assign(self, names: Sequence[str | None]) -> tuple[np.ndarray, tuple[LoRALoad, ...]]:
        """Slots for one batch's requests (-1: no adapter; at most max_loras distinct adapters)
        and the loads that put adapters not resident yet into slots."""
        wanted = list(dict.fromkeys(n for n in names if n is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a batch uses {len(wanted)} adapters, above max_loras")
        for name in wanted:
            if name in self.resident:
                self.resident.move_to_end(name)
        loads = []
        for name in wanted:
            if name not in self.resident:
                slot = self.free.pop() if self.free else self._evict(wanted)
                self.resident[name] = slot
                loads.append(LoRALoad(slot, name, self.paths[name]))
        slots = np.fromiter(
            (-1 if n is None else self.resident[n] for n in names), np.int32, len(names)
        )
        return slots, tuple(loads)

    def _evict(self, keep: list[str]) -> int:
        name = next(n for n in self.resident if n not in keep)  # least recently used
        return self.resident.pop(name)

    def forget(self, loads: Sequence[LoRALoad]) -> None:
        """The steps carrying these loads failed: their slots hold nothing usable."""
        for load in loads:
            if self.resident.get(load.name) == load.slot:
                del self.resident[load.name]
                self.free.append(load.slot)
