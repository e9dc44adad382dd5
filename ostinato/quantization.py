"""Which weight quantisation a model runs with: the checkpoint's own (config.json's
`quantization_config`) or one applied at load (`quantization="fp8"` on a bf16 checkpoint).

Supported: block-wise FP8 checkpoints (quant_method "fp8", the format of the Qwen3 and DeepSeek
FP8 releases: float8_e4m3fn weights with one `weight_scale_inv` per 128 x 128 block), and FP8
at load (per-output-channel weight scales). Any other method is refused by name: its weights
would load as garbage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

QUANTIZATIONS = ("fp8",)  # what `quantization=` may ask for at load


@dataclass(frozen=True)
class QuantSpec:
    """How the linear layers hold their weights. block: the (rows, columns) one scale covers
    in a checkpoint's block-wise scheme; None: one scale per output row (FP8 at load)."""

    method: str
    block: tuple[int, int] | None = None

    @property
    def from_checkpoint(self) -> bool:
        return self.block is not None


def checkpoint_quantization(hf_config) -> QuantSpec | None:
    """The checkpoint's quantisation, or None for plain weights; ValueError naming the method
    (or the field) when it is one ostinato cannot run."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"unsupported quantization {method!r} (config.json quantization_config): ostinato "
            "runs block-wise fp8 checkpoints only; use the bf16 release of the model"
        )
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block)
    ):
        raise ValueError(
            f"unsupported fp8 checkpoint: weight_block_size {block!r} in quantization_config; "
            "ostinato runs block-wise fp8 with power-of-two blocks (weight_block_size [128, 128])"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"unsupported fp8 activation_scheme {scheme!r}: ostinato runs 'dynamic' only"
        )
    return QuantSpec("fp8", (int(block[0]), int(block[1])))


def resolve_quantization(requested: str | None, hf_config) -> QuantSpec | None:
    """The scheme the model runs with: the checkpoint's own, else FP8 at load if requested
    (a checkpoint already in FP8 stays as it is). Mixture-of-experts models run unquantised."""
    spec = checkpoint_quantization(hf_config)
    if spec is None and requested is not None:
        spec = QuantSpec(requested)
    experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "num_local_experts", None
    )
    if spec is not None and experts:
        raise ValueError(
            "fp8 weights of a mixture-of-experts model are not supported yet: run its bf16 "
            "checkpoint without --quantization"
        )
    return spec


_building: QuantSpec | None = None  # the scheme of the linear layers being constructed


@contextmanager
def building(spec: QuantSpec | None) -> Iterator[None]:
    """Linear layers constructed inside hold their weights as `spec` says."""
    global _building
    previous, _building = _building, spec
    try:
        yield
    finally:
        _building = previous


def building_spec() -> QuantSpec | None:
    return _building
