"""FP8 dot rows at batch 32: which launch makes the step slower under PDL (experiment)."""

import sys

import triton

from ostinato import cli
from ostinato.kernels import fp8
from ostinato.kernels.small_batch import split_span

variant = sys.argv[1]
fp8.FP8_DOT_ROWS = 16 if variant == "base16" else 32
batches = sys.argv[2] if len(sys.argv) > 2 else "32"
orig_config, orig_launch, orig_pdl = fp8.gemv_config, fp8._launch, fp8.pdl_options
state = {"off": False}


def config(m, n, k, block, sms, dtype):
    c = orig_config(m, n, k, block, sms, dtype)
    if variant in ("dot32-2waves", "w2all") and c.fp8_x and (c.rows == 32 or variant == "w2all"):
        split = max(1, min(2 * sms // triton.cdiv(n, c.block_n), k // (4 * c.block_k)))
        span, split = split_span(k, c.block_k, split, triton.cdiv(n, c.block_n))
        c = c._replace(span=span, split=split)
    return c


def launch(x, w, scale, block, c):
    state["off"] = variant == "dot32-nopdl" and c.fp8_x and c.rows == 32
    try:
        return orig_launch(x, w, scale, block, c)
    finally:
        state["off"] = False


def pdl():
    o = orig_pdl()
    return {"PDL": False, "launch_pdl": False} if state["off"] else o


fp8.gemv_config, fp8._launch, fp8.pdl_options = config, launch, pdl
sys.exit(
    cli.main(
        [
            "bench",
            "latency",
            "--model",
            "random:llama-3.1-8b",
            "--quantization",
            "fp8",
            "--json",
            "--batch-size",
            batches,
            "--input-len",
            "128",
            "--output-len",
            "64",
            "--iters",
            "3",
            "--max-model-len",
            "2048",
        ]
    )
)
