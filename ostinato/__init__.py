"""ostinato: an LLM inference engine built around a CUDA graph runtime."""

from ostinato.lora.request import LoRARequest
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Imported on first use: the engine pulls in the model code, which `explain` never needs.
    if name == "LLM":
        from ostinato.llm import LLM

        return LLM
    raise AttributeError(f"module 'ostinato' has no attribute {name!r}")
