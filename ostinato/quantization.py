"""Which weight quantisation a model runs with: the checkpoint's own (config.json's
`quantization_config`) or one applied at load (`quantization="fp8"` on a bf16 checkpoint).

Supported: block-wise FP8 checkpoints (quant_method "fp8", the format of the Qwen3 and DeepSeek
FP8 releases: float8_e4m3fn weights with one `weight_scale_inv` per 128 x 128 block), and FP8
at load (per-output-channel weight scales). Any other method is refused by name: its weights
would load as garbage.
"""

from __future__ import annotations

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
    if not (isinstance(block, list | tuple) and len(block) == 2):
        raise ValueError(
            f"unsupported fp8 checkpoint: weight_block_size {block!r} in quantization_config; "
            "ostinato runs block-wise fp8 (weight_block_size [128, 128])"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"unsupported fp8 activation_scheme {scheme!r}: ostinato runs 'dynamic' only"
        )
    return QuantSpec("fp8", (int(block[0]), int(block[1])))
