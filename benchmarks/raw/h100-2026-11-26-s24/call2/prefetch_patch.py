p="ostinato/kernels/paged_attention.py"; s=open(p).read()
def rep(old,new,n=1):
    global s
    assert s.count(old)==n,(old,s.count(old)); s=s.replace(old,new)
rep("""def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_ptr,""","""def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, prefetch_ptr,
    part_ptr,""")
rep("""    qk_scale, num_reqs,
    stride_qt,""","""    qk_scale, num_reqs, prefetch_bytes,
    stride_qt,""")
rep("""    SPLITS: tl.constexpr, REQ_CHUNK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip""","""    SPLITS: tl.constexpr, REQ_CHUNK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip""")
rep("""    the parts, row by row as the combine does (count_ptr: a zeroed count per tile and KV
    head, set back to 0 by that part).\"\"\"
    if PDL:""","""    the parts, row by row as the combine does (count_ptr: a zeroed count per tile and KV
    head, set back to 0 by that part). PREFETCH: each program asks L2 for PREFETCH chunks of
    the prefetch_bytes at prefetch_ptr (weights the next kernel reads; nothing writes them,
    so before the PDL wait), which come from memory while attention waits on latency.\"\"\"
    if PREFETCH:
        _prefetch_l2(prefetch_ptr, prefetch_bytes, PREFETCH)
    if PDL:""")
rep("""@jit(do_not_specialize=["num_reqs"])  # no compiled variant per batch size
def _attention_kernel(""","""PREFETCH_CHUNK = 16384  # bytes one bulk prefetch asks for


@jit
def _prefetch_l2(ptr, nbytes, LANES: tl.constexpr):
    \"\"\"LANES bulk L2 prefetches of PREFETCH_CHUNK bytes (Hopper's cp.async.bulk) in each
    program, the chunks dealt round the grid's programs; none past nbytes (a multiple of 16).\"\"\"
    program = tl.program_id(0) + tl.num_programs(0) * (
        tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)
    )
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    chunk = (tl.arange(0, LANES) * programs + program).to(tl.int64) * PREFETCH_CHUNK
    size = tl.minimum(nbytes - chunk, PREFETCH_CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.pointer_type(tl.uint8)) + chunk, size], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@jit(do_not_specialize=["num_reqs"])  # no compiled variant per batch size
def _attention_kernel(""")
open(p,"w").write(s)
p="ostinato/kernels/paged_attention.py"; s=open(p).read()
def rep(old,new,n=1):
    global s
    assert s.count(old)==n,(old,s.count(old)); s=s.replace(old,new)
rep("PREFETCH_CHUNK = 16384  # bytes one bulk prefetch asks for","PREFETCH_CHUNK = tl.constexpr(16384)  # bytes one bulk prefetch asks for")
rep("""        config: Config | None = None,
        merge: bool = False,
    ) -> None:
        \"\"\"merge: the attention kernel merges a split KV's parts itself (MERGE), no combine
        launch: for eager steps, which pay a launch's host time; a graph's replay does not.\"\"\"""","""        config: Config | None = None,
        merge: bool = False,
        prefetch_bytes: int = 0,
    ) -> None:
        \"\"\"merge: the attention kernel merges a split KV's parts itself (MERGE), no combine
        launch: for eager steps, which pay a launch's host time; a graph's replay does not.
        prefetch_bytes: every call passes a tensor of that many bytes (the weights read next)
        for the kernel to bring into L2 (Hopper only; elsewhere nothing is fetched).\"\"\"""")
rep("""        pdl = pdl_options()
        self.attend = Launch(
            _attention_kernel,
            (tiles, kv_heads, cfg.splits),
            num_head=4,  # q, k_cache, v_cache, out: each layer's own""","""        pdl = pdl_options()
        programs = tiles * kv_heads * cfg.splits
        lanes = -(-prefetch_bytes // PREFETCH_CHUNK.value) if pdl["PDL"] else 0
        self.attend = Launch(
            _attention_kernel,
            (tiles, kv_heads, cfg.splits),
            num_head=5,  # q, k_cache, v_cache, out, prefetch: each layer's own""")
rep("""                scale * _LOG2E,
                num_reqs,
                q.stride(0),""","""                scale * _LOG2E,
                num_reqs,
                prefetch_bytes,
                q.stride(0),""")
rep("""                PDL=pdl["PDL"],
            ),  # fmt: skip
            num_warps=cfg.num_warps,""","""                PDL=pdl["PDL"],
                PREFETCH=triton.next_power_of_2(-(-lanes // programs)) if lanes else 0,
            ),  # fmt: skip
            num_warps=cfg.num_warps,""")
rep("""    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        if self.attend is None:
            return
        self.attend(q, k_cache, v_cache, out)""","""    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        prefetch: torch.Tensor | None = None,
    ) -> None:
        if self.attend is None:
            return
        self.attend(q, k_cache, v_cache, out, out if prefetch is None else prefetch)""")
open(p,"w").write(s)
