"""The one compatibility table: every rule that changes (or qualifies) the requested graph mode.

A rule fires when the current mode is one it maps and its predicate holds; rules apply in
table order, each to the mode the previous ones left. Notes map a mode to itself: they
change nothing but tell the user a limit of the mode. A rule may also leave the FULL prefill
graphs out of the capture plan (drops_full_prefill); the resolution carries the plan after
every rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from ostinato.attention import GraphSupport, get_attention_backend
from ostinato.config import EngineConfig
from ostinato.graphs.modes import CudaGraphMode
from ostinato.graphs.plan import CapturePlan

logger = logging.getLogger("ostinato")

NONE, PIECEWISE, FULL = CudaGraphMode.NONE, CudaGraphMode.PIECEWISE, CudaGraphMode.FULL
FULL_DECODE_ONLY = CudaGraphMode.FULL_DECODE_ONLY
FULL_AND_PIECEWISE = CudaGraphMode.FULL_AND_PIECEWISE


@dataclass(frozen=True)
class Facts:
    """What rules look at; its fields are also the placeholders of their sentences."""

    device: str
    is_cuda: bool
    enforce_eager: bool
    backend: str
    support: GraphSupport
    max_tokens: int | None  # largest token capture size
    max_num_batched_tokens: int
    max_reqs: int | None  # largest FULL decode capture size
    decode_query_len: int  # largest uniform decode query length: 1 + speculative tokens
    lora_counts: tuple[int, ...]  # active-adapter counts that key graphs; (0,) without LoRA
    full_prefill_graphs: int  # FULL prefill keys of the plan, every adapter count included

    @classmethod
    def of(cls, config: EngineConfig, plan: CapturePlan) -> Facts:
        return cls(
            device=config.device,
            is_cuda=config.is_cuda,
            enforce_eager=config.enforce_eager,
            backend=config.attention_backend,
            support=get_attention_backend(config.attention_backend).graph_support,
            max_tokens=plan.token_sizes[-1] if plan.token_sizes else None,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_reqs=plan.decode_sizes[-1] if plan.decode_sizes else None,
            decode_query_len=plan.decode_query_lens[-1],
            lora_counts=plan.lora_counts,
            full_prefill_graphs=len(plan.prefill_token_sizes)
            * len(plan.prefill_reqs)
            * len(plan.lora_counts),
        )


@dataclass(frozen=True)
class Rule:
    name: str
    when: Callable[[Facts], bool]
    yields: Mapping[CudaGraphMode, CudaGraphMode]  # the modes it applies to -> what each becomes
    reason: str  # the sentence a user reads; {fields} of Facts, {mode} and {new} are filled in
    drops_full_prefill: bool = False  # the plan loses its FULL prefill graphs

    def fires(self, facts: Facts, mode: CudaGraphMode) -> bool:
        return mode in self.yields and self.when(facts)


def _to_none() -> dict[CudaGraphMode, CudaGraphMode]:
    return {m: NONE for m in CudaGraphMode if m is not NONE}


def _note(*modes: CudaGraphMode) -> dict[CudaGraphMode, CudaGraphMode]:
    return {m: m for m in modes}


RULES: tuple[Rule, ...] = (
    Rule(
        "cpu_device",
        lambda f: not f.is_cuda,
        _to_none(),
        "CUDA graphs need a CUDA device (device={device}): every step runs eagerly",
    ),
    Rule(
        "enforce_eager",
        lambda f: f.enforce_eager,
        _to_none(),
        "enforce_eager is set: every step runs eagerly",
    ),
    Rule(
        "backend_not_capturable",
        lambda f: f.support is GraphSupport.NEVER,
        {FULL: PIECEWISE, FULL_AND_PIECEWISE: PIECEWISE},
        "attention backend '{backend}' cannot run inside a CUDA graph, so {mode} becomes {new}: "
        "attention runs eagerly between captured segments",
    ),
    Rule(
        "backend_not_capturable_decode_only",
        lambda f: f.support is GraphSupport.NEVER,
        {FULL_DECODE_ONLY: NONE},
        "attention backend '{backend}' cannot run inside a CUDA graph and full_decode_only has "
        "no piecewise fallback: every step runs eagerly",
    ),
    Rule(
        "backend_full_for_decode_only",
        lambda f: f.support in (GraphSupport.UNIFORM_DECODE, GraphSupport.SINGLE_TOKEN_DECODE),
        {FULL: FULL_AND_PIECEWISE},
        "attention backend '{backend}' can be captured in FULL graphs of uniform decode batches "
        "only, so {mode} becomes {new}: mixed batches use piecewise graphs",
    ),
    Rule(
        "backend_full_for_single_token_decode",
        lambda f: f.support is GraphSupport.SINGLE_TOKEN_DECODE and f.decode_query_len > 1,
        {FULL_AND_PIECEWISE: PIECEWISE, FULL_DECODE_ONLY: NONE},
        "attention backend '{backend}' can be captured in FULL graphs of one-token decodes "
        "only, but speculative decoding verifies {decode_query_len} tokens per request, so "
        "{mode} becomes {new}",
    ),
    Rule(
        "no_token_capture_sizes",
        lambda f: f.max_tokens is None,
        {PIECEWISE: NONE, FULL: NONE, FULL_AND_PIECEWISE: FULL_DECODE_ONLY},
        "no capture size fits max_capture_size and max_num_batched_tokens, so {mode} becomes "
        "{new}: no graphs keyed by token count",
    ),
    Rule(
        "no_decode_capture_sizes",
        lambda f: f.max_reqs is None,
        {FULL_DECODE_ONLY: NONE, FULL_AND_PIECEWISE: PIECEWISE},
        "no capture size fits max_num_seqs, so {mode} becomes {new}: no FULL decode graphs",
    ),
    Rule(
        "full_prefill_needs_capturable_attention",
        lambda f: f.full_prefill_graphs > 0 and f.support is not GraphSupport.ALWAYS,
        _note(FULL_AND_PIECEWISE),
        "attention backend '{backend}' can be captured in FULL graphs of uniform decode batches "
        "only, so there are no FULL prefill graphs: prefill steps of few requests replay "
        "piecewise graphs",
        drops_full_prefill=True,
    ),
    Rule(
        "full_prefill_off_with_lora",
        lambda f: f.full_prefill_graphs > 0 and len(f.lora_counts) > 1,
        _note(FULL, FULL_AND_PIECEWISE),
        "no FULL prefill graphs with LoRA: every graph is captured once per adapter count "
        "{lora_counts}, so they would add {full_prefill_graphs} graphs; prefill steps of few "
        "requests replay the token-keyed graphs",
        drops_full_prefill=True,
    ),
    Rule(
        "eager_above_capture_size",
        lambda f: f.max_tokens is not None and f.max_tokens < f.max_num_batched_tokens,
        _note(PIECEWISE, FULL, FULL_AND_PIECEWISE),
        "batches of more than {max_tokens} tokens run eagerly: that is the largest capture size "
        "(max_capture_size; by default the token graphs reach max_num_batched_tokens="
        "{max_num_batched_tokens})",
    ),
    Rule(
        "eager_outside_decode_graphs",
        lambda f: True,
        _note(FULL_DECODE_ONLY),
        "full_decode_only graphs uniform decode batches of up to {max_reqs} requests; "
        "every other batch runs eagerly",
    ),
    Rule(
        "lora_graphs_per_adapter_count",
        lambda f: len(f.lora_counts) > 1,
        _note(PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE),
        "LoRA steps replay graphs keyed by how many adapters they use, padded up to one of "
        "{lora_counts}: every size is captured once per count, and steps without adapters "
        "replay the base graphs (count 0, no LoRA cost)",
    ),
)


@dataclass(frozen=True)
class Decision:
    rule: str
    reason: str


@dataclass(frozen=True)
class Resolution:
    requested: CudaGraphMode
    resolved: CudaGraphMode
    decisions: tuple[Decision, ...]
    plan: CapturePlan  # the capture plan the rules left (the dispatcher's)

    def as_dict(self) -> dict:
        return {
            "cuda_graph_mode": self.resolved.value,
            "requested_mode": self.requested.value,
            "decisions": [asdict(d) for d in self.decisions],
        }

    def log(self) -> None:
        logger.info("cuda graph mode: %s (requested %s)", self.resolved.value, self.requested.value)
        for d in self.decisions:
            logger.info("cuda graph rule %s: %s", d.rule, d.reason)


def resolve(config: EngineConfig, plan: CapturePlan | None = None) -> Resolution:
    """Apply every rule of RULES to the configured mode and plan. Pure: touches no device."""
    plan = plan or CapturePlan.from_config(config)
    facts = Facts.of(config, plan)
    requested = mode = CudaGraphMode(config.cuda_graph_mode)
    decisions = []
    for rule in RULES:
        if rule.fires(facts, mode):
            new = rule.yields[mode]
            reason = rule.reason.format(mode=mode.value, new=new.value, **asdict(facts))
            decisions.append(Decision(rule.name, reason))
            mode = new
            if rule.drops_full_prefill:
                plan = plan.without_full_prefill()
                facts = Facts.of(config, plan)
    return Resolution(requested, mode, tuple(decisions), plan)
