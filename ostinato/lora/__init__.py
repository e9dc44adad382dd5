"""Multi-LoRA serving: PEFT adapters in fixed slots beside the base model's projections."""

from ostinato.lora.request import LoRARequest

__all__ = ["LoRARequest"]
