"""L2 prefetch experiment (session 24): the decode attention kernel brings the next weights
into L2 (PagedAttention(prefetch_bytes=...)) while it waits on latency. A decode chain of real
kernels at batch 1 (norm-fused GEMV or cuBLAS as the engine chooses), distinct weights per
layer, in one CUDA graph; µs per step."""
import statistics, sys, torch
import torch.nn.functional as F
from ostinato.kernels import gemv as G
from ostinato.kernels.paged_attention import PagedAttention

SHAPES = {  # heads, kv heads, head_dim, hidden, intermediate, layers
    "qwen3-0.6b": (16, 8, 128, 1024, 3072, 28),
    "llama-3.1-8b": (32, 8, 128, 4096, 14336, 32),
}
CTX, BS, dev, bf = 576, 16, "cuda", torch.bfloat16

def proj(x, w, add=None):
    if G.gemv_pays(x, w):
        return G.gemv(x, w, add=add)
    y = F.linear(x, w)
    return y if add is None else y + add

def run(model, pf, batch=1, hot=False, trials=7, replays=5):
    H, KVH, D, HID, INTER, LAYERS = SHAPES[model]
    torch.manual_seed(0)
    def layer():
        qkv = torch.randn((H + 2 * KVH) * D, HID, device=dev, dtype=bf) * 0.02
        packed = torch.randn(HID * H * D + 2 * INTER * HID + HID * INTER, device=dev, dtype=bf) * 0.02
        o, gu, down = packed.split([HID * H * D, 2 * INTER * HID, HID * INTER])
        return qkv, o.view(HID, H * D), gu.view(2 * INTER, HID), down.view(HID, INTER), packed
    ws = [layer() for _ in range(1 if hot else LAYERS)] * (LAYERS if hot else 1)
    nb = CTX // BS
    kc = torch.randn(LAYERS * nb * batch + 8, BS, KVH, D, device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    tables = torch.randperm(LAYERS * nb * batch, device=dev, dtype=torch.int32).view(LAYERS, batch, nb)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), CTX, device=dev, dtype=torch.int32)
    x = torch.randn(batch, HID, device=dev, dtype=bf); res = torch.randn_like(x)
    nw = torch.ones(HID, device=dev, dtype=bf)
    q = torch.randn(batch, H, D, device=dev, dtype=bf); out = torch.empty_like(q)
    nbytes = int(pf * HID * H * D * 2)  # pf: in units of o_proj's bytes
    atts = [PagedAttention(q, out, kc, qsl, lens, tables[i], D ** -0.5, prefetch_bytes=nbytes)
            for i in range(LAYERS)]
    def step():
        h, r = x, res
        for i, (wqkv, wo, wgu, wd, packed) in enumerate(ws):
            qkv = proj(F.rms_norm(h, (HID,), nw), wqkv)
            atts[i](q, kc, vc, out, packed if nbytes else None)
            h = proj(out.view(batch, -1), wo, add=r)
            g = proj(F.rms_norm(h, (HID,), nw), wgu)
            g = F.silu(g[:, :INTER]) * g[:, INTER:]
            h = proj(g, wd, add=h)
        return h
    step(); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    graph.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            graph.replay()
        e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / replays * 1e3)
    wbytes = LAYERS * ((H + 2 * KVH) * D * HID + HID * H * D + 3 * INTER * HID) * 2
    return statistics.median(times), y.clone(), wbytes

if __name__ == "__main__":
    for model in sys.argv[1:] or SHAPES:
        for batch in (1, 8):
            base = None
            for rnd in range(2):
                for pf in (0, 0.5, 1, 1.5, 2.5):
                    t, y, wbytes = run(model, pf, batch)
                    same = "" if base is None else f" equal={bool(torch.equal(y, base))}"
                    base = y if base is None else base
                    print(f"{model} b{batch} round {rnd} prefetch {pf:3.1f}x o_proj: {t:8.1f} us/step{same}", flush=True)
            print(f"{model} b{batch} hot (one layer's weights each layer): {run(model, 0, batch, hot=True)[0]:8.1f} us/step")
            print(f"{model} weights {wbytes/1e6:.0f} MB; at 3.0 TB/s {wbytes/3e12*1e6:.0f} us", flush=True)
