"""What a caller passes to run a request through an adapter."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter: `name` identifies it (one name, one directory, for the engine's
    life), `path` is its directory (adapter_config.json + adapter_model.safetensors; a str or a
    path-like)."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRARequest name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(
                f"LoRARequest {self.name!r}: path must be the adapter's directory, got "
                f"{self.path!r}"
            )
