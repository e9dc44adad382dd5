"""The Llama decoder (Llama 2/3.x; Mistral without a sliding window), shared by the Qwen models.

Parameter names follow the Hugging Face checkpoints, except that q|k|v and gate|up are merged
(`qkv_proj`, `gate_up_proj`: one matmul each) and layers are keyed by their global index, so a
pipeline stage holding layers [start, end) reads the same names as the whole model. Under
tensor parallelism each rank holds its heads and features (the layers split themselves by
tp_group()); names stay the same, and each parameter's weight_loader reads its own share.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ostinato.kernels.fp8 import settled
from ostinato.layers.attention import Attention
from ostinato.layers.embedding import LMHead, VocabEmbedding
from ostinato.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    normed_projection,
    residual_projection,
)
from ostinato.layers.norm import RMSNorm
from ostinato.layers.rotary import RotaryEmbedding, rope_parameters
from ostinato.layers.weights import Loadable, loader_of
from ostinato.models.base import IntermediateTensors

# checkpoint projection -> (merged module, shard)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
TIED = ("model.embed_tokens.weight", "lm_head.weight")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config,
        layer_idx: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        heads, kv_heads, dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim(config),
        )
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [heads * dim, kv_heads * dim, kv_heads * dim],
            qkv_bias,
            units=[dim] * 3,
        )
        # this rank's heads; a KV head is shared by several ranks when there are fewer of them
        q_rows, kv_rows, _ = self.qkv_proj.out_sizes
        self.heads, self.kv_heads, self.dim = q_rows // dim, kv_rows // dim, dim
        self.head_split = [self.heads, self.kv_heads, self.kv_heads]  # q | k | v, in heads
        self.o_proj = RowParallelLinear(heads * dim, config.hidden_size, o_bias)
        # Qwen3 normalises each head of q and k before rotating them
        self.q_norm = RMSNorm(dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.heads, self.kv_heads, dim, layer_idx)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream (hidden + residual; hidden alone when residual is None) after
        this block adds attention over norm(stream) to it, as the same kind of pair."""
        qkv, residual = normed_projection(self.qkv_proj, norm, hidden, residual)
        # one view and one split: this runs once a layer in every eager step
        q, k, v = qkv.view(qkv.shape[0], -1, self.dim).split_with_sizes(self.head_split, 1)
        out = self.attn.forward(  # not __call__: see LlamaModel.forward
            positions, q, k, v, self.rotary, self.q_norm, self.k_norm
        )
        return residual_projection(self.o_proj, out.flatten(1), residual)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As LlamaAttention.forward, with silu(gate) * up -> down over norm(stream)."""
        act, residual = normed_projection(self.gate_up_proj, norm, hidden, residual, silu=True)
        return residual_projection(self.down_proj, act, residual)


def dense_mlp(config, layer_idx: int) -> nn.Module:
    return LlamaMLP(
        config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
    )


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module, **attn_options
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, **attn_options)
        self.mlp = mlp  # dense, or a mixture of experts
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream in and out as (hidden, residual): their sum, or hidden alone
        when residual is None. Where an add is left pending, the next norm does it in the same
        kernel; where the small-batch projections run, each norm runs inside the projection
        after it and each residual add inside the projection before it."""
        # forward, not __call__: see LlamaModel.forward
        hidden, residual = self.self_attn.forward(positions, hidden, residual, self.input_layernorm)
        return self.mlp.forward(hidden, residual, self.post_attention_layernorm)


def check_supported(config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {config.hidden_act!r}: ostinato supports silu")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)  # Qwen: which layers use the window
    sliding = "sliding_attention" in layer_types if layer_types else window is not None
    if sliding and window < config.max_position_embeddings:
        raise ValueError(
            f"sliding-window attention (window {window} < {config.max_position_embeddings} "
            "positions) is not supported"
        )


class LlamaModel(nn.Module):
    def __init__(
        self, config, layer_range: tuple[int, int] | None, make_mlp=dense_mlp, **attn_options
    ) -> None:
        super().__init__()
        check_supported(config)
        num_layers = config.num_hidden_layers
        self.start, self.end = layer_range or (0, num_layers)
        if not 0 <= self.start < self.end <= num_layers:
            raise ValueError(f"layer_range {layer_range} is not within the {num_layers} layers")
        self.embed_tokens = (
            VocabEmbedding(config.vocab_size, config.hidden_size) if self.start == 0 else None
        )
        self.rotary_emb = RotaryEmbedding(
            head_dim(config), config.max_position_embeddings, rope_parameters(config)
        )
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaDecoderLayer(
                    config, i, self.rotary_emb, make_mlp(config, i), **attn_options
                )
                for i in range(self.start, self.end)
            }
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if self.end == num_layers else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None:
            hidden = self.embed_tokens(input_ids)
        else:
            # a new tensor, so the layers' in-place norms never write into the received buffers
            hidden = intermediate.hidden_states + intermediate.residual
        residual = None
        for layer in self.layers.values():
            # forward, not __call__, here and for the attention and MLP blocks inside: the
            # hook checks of Module.__call__ cost ~2 µs a call on the build machine (4 calls
            # a layer, ~10% of an eager decode step's host time); no module here has hooks
            hidden, residual = layer.forward(positions, hidden, residual)
        if self.norm is None:
            hidden = settled(hidden)  # an FP8 down projection's SplitSum
            if residual is None:  # the next stage adds the two
                residual = torch.zeros_like(hidden)
            return IntermediateTensors(hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


def merged_name(name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (parameter name, shard of a merged parameter or None)."""
    for part, (merged, shard) in PACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{merged}."), shard
    return name, None


def checkpoint_name(name: str, shard: int | None) -> str:
    for part, (merged, s) in PACKED.items():
        if s == shard and f".{merged}." in name:
            return name.replace(f".{merged}.", f".{part}.")
    return name


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config, layer_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(
            hf_config, layer_range, self.make_mlp, **self.attention_options(hf_config)
        )
        self.layer_range = (self.model.start, self.model.end)  # resolved: global [start, end)
        self.lm_head = None
        if self.model.norm is not None:
            self.lm_head = LMHead(hf_config.vocab_size, hf_config.hidden_size)
            if hf_config.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_options(config) -> dict:
        bias = getattr(config, "attention_bias", False)
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    make_mlp = staticmethod(dense_mlp)  # (config, layer_idx) -> the layer's MLP
    param_name = staticmethod(merged_name)  # checkpoint -> (param, shard)
    checkpoint_name = staticmethod(checkpoint_name)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [num_tokens] (requests packed back to back). The last stage
        returns the final-normed hidden states [num_tokens, hidden]; others the intermediates."""
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in the model dtype."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Loadable]]) -> None:
        """Copies checkpoint tensors (Hugging Face names; torch tensors or lazy ones that read
        only what is indexed) into this stage's parameters, each through its weight_loader,
        which takes this tensor rank's share; names this stage does not hold are skipped.
        Raises ValueError if any parameter stays unfilled."""
        params = dict(self.named_parameters())  # a tied weight appears once
        loaded: set[tuple[str, int | None]] = set()
        for ckpt_name, tensor in weights:
            name, shard = self.param_name(ckpt_name)
            targets = TIED if self.config.tie_word_embeddings and name in TIED else (name,)
            for target in (t for t in targets if t in params):
                param = params[target]
                try:
                    loader_of(param)(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"{ckpt_name}: {e}") from None
                loaded.add((target, shard))
        expected = {
            (name, shard)
            for name, param in params.items()
            for shard in (range(param.num_shards) if hasattr(param, "num_shards") else [None])
        }
        missing = sorted(self.checkpoint_name(*key) for key in expected - loaded)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"the checkpoint lacks weights: {', '.join(missing[:5])}{more}")
