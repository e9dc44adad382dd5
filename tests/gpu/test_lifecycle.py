"""On the GPU: engines built and shut down one after another in one process each get the whole
memory budget back (issue 20: the ninth engine of a sweep ran out of KV memory)."""

import pytest
import torch

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINES = 10


def test_ten_engines_in_a_row_get_the_same_kv_cache_and_give_everything_back():
    config = {"model": "random:qwen3-0.6b", "max_model_len": 1024, "max_num_seqs": 16,
              "cuda_graph_mode": "full_and_piecewise", "gpu_memory_utilization": 0.5}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def one_engine() -> tuple[int, list[int]]:
        with LLM(**config) as llm:
            report = llm.graph_report()  # graphs and their pool were taken
            assert report["graph_memory_bytes"] > 0 and any(report["captured"].values())
            tokens = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0].token_ids
            return llm.engine.executor.num_blocks, tokens

    # engines that earlier tests of this process dropped without shutdown() are still held by
    # process-wide launch caches until the next engine replaces them: one engine first
    one_engine()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    runs = []
    for _ in range(ENGINES):
        runs.append(one_engine())
        # no gc.collect() here: shutdown alone must give it back
        assert torch.cuda.memory_allocated() == start, len(runs)
    assert runs == [runs[0]] * ENGINES, runs
