"""Session 28: which start-up warm-up faults (BURST's engine, blocking launches): each warm-up's
descriptor printed before it runs, the traceback's end after."""
import sys, traceback
import torch
from ostinato.graphs import capture
from ostinato import LLM

for name in dir(capture):
    cls = getattr(capture, name)
    if isinstance(cls, type) and hasattr(cls, "_warm_up"):
        original = cls._warm_up
        def logged(self, desc, warm_up, _original=original):
            print("warm-up", desc, flush=True)
            return _original(self, desc, warm_up)
        cls._warm_up = logged
try:
    LLM("random:qwen3-0.6b", max_model_len=1024, max_num_seqs=64, num_kv_blocks=4096)
    torch.cuda.synchronize()
    print("ok")
except Exception:
    print("".join(traceback.format_exc().splitlines(keepends=True)[-24:]))
