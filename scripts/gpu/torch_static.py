"""The strong PyTorch baselines of tandem's GPU benchmark, on gpu_bench's Llama-3.1-8B shape with
random bf16 weights, written the way fast PyTorch inference is (gpt-fast's recipe): fused QKV
and gate-up weights, a static KV cache, RoPE from a table.

- prefill of 512, 2048 and 8192 tokens with SDPA forced onto its flash backend;
- decode steps with a static KV cache at batch 1, 8, 32 and 128 (context 512) and 1, 8 and 32
  (context 4096), each step replayed from one CUDA graph ("graph");
- the same step through torch.compile (inductor, fullgraph, one compile of the layer function
  reused by all 32 layers) inside one CUDA graph ("compiled"), at batch 1 and 128, context 512.

Each result is printed as one JSON line as soon as it exists (a step cut off by its time limit
keeps what it printed); the last line gathers them all. Times are medians of CUDA-event-timed
replays after warm-up. `--small` runs a two-layer shape, for a quick look."""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

LLAMA_8B = dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8,
                head_dim=128, theta=500000.0, eps=1e-5)


def emit(results, key, value):
    results[key] = value
    print(json.dumps({key: value}), flush=True)


class Model:
    """Weights and a static KV cache; `prefill` and `decode` are plain functions of them."""

    def __init__(self, cfg, max_batch, max_len, dev):
        self.cfg = cfg
        h, hd = cfg["hidden"], cfg["head_dim"]
        qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * hd
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(rows, cols):
            # Uniform with the fan-in scale of gpu_bench's dummy weights (never zeros).
            w = torch.rand(rows, cols, generator=g, device=dev, dtype=torch.float32)
            return ((w * 2 - 1) * math.sqrt(3.0 / cols)).to(torch.bfloat16)

        self.embed = rand(cfg["vocab"], h)
        self.layers = []
        for _ in range(cfg["layers"]):
            self.layers.append(dict(
                ln1=torch.ones(h, device=dev, dtype=torch.bfloat16),
                wqkv=rand(qkv, h), wo=rand(h, cfg["heads"] * hd),
                ln2=torch.ones(h, device=dev, dtype=torch.bfloat16),
                w13=rand(2 * cfg["inter"], h), w2=rand(h, cfg["inter"])))
        self.norm = torch.ones(h, device=dev, dtype=torch.bfloat16)
        self.lm_head = rand(cfg["vocab"], h)
        self.max_len = max_len
        shape = (cfg["layers"], max_batch, cfg["kv_heads"], max_len, hd)
        self.k_cache = torch.zeros(shape, device=dev, dtype=torch.bfloat16)
        self.v_cache = torch.zeros(shape, device=dev, dtype=torch.bfloat16)
        inv = 1.0 / (cfg["theta"] ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(max(max_len, 8192), device=dev, dtype=torch.float32), inv)
        self.cos, self.sin = ang.cos(), ang.sin()


def rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    # x [..., T, hd] with cos/sin [T, hd/2] (rotate-half, as the CPU engine does).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def prefill(m, ids):
    """One prompt [T] through every layer, causal SDPA; logits of the last row."""
    c = m.cfg
    hd, nh, nkv = c["head_dim"], c["heads"], c["kv_heads"]
    t = ids.shape[0]
    x = m.embed[ids]
    cos, sin = m.cos[:t], m.sin[:t]
    for layer in m.layers:
        qkv = rms(x, layer["ln1"], c["eps"]) @ layer["wqkv"].T
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        q = rope(q.view(t, nh, hd).transpose(0, 1), cos, sin)
        k = rope(k.view(t, nkv, hd).transpose(0, 1), cos, sin)
        v = v.view(t, nkv, hd).transpose(0, 1)
        # Each KV head repeated for its query heads (a copy of T x kv width: small beside the
        # attention itself), so the flash backend takes it on any PyTorch version.
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)
        x = x + a[0].transpose(0, 1).reshape(t, nh * hd) @ layer["wo"].T
        gu = rms(x, layer["ln2"], c["eps"]) @ layer["w13"].T
        g, u = gu.chunk(2, -1)
        x = x + (F.silu(g) * u) @ layer["w2"].T
    return rms(x[-1:], m.norm, c["eps"]) @ m.lm_head.T


def layer_step(x, pos, mask, cos, sin, ln1, wqkv, wo, ln2, w13, w2, k_cache, v_cache, nh, nkv, hd, eps):
    """One layer of a decode step: x [B, h], one new token per sequence at `pos` [B]."""
    b = x.shape[0]
    qkv = rms(x, ln1, eps) @ wqkv.T
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
    q = rope(q.view(b, nh, 1, hd), cos, sin)
    k = rope(k.view(b, nkv, 1, hd), cos, sin)
    v = v.view(b, nkv, 1, hd)
    rows = torch.arange(b, device=x.device)
    k_cache[rows, :, pos] = k[:, :, 0]
    v_cache[rows, :, pos] = v[:, :, 0]
    # A KV head's query heads are the query rows of one attention over its cache: all at the
    # same position, so one mask serves them and the cache is read once per KV head.
    q = q.view(b, nkv, nh // nkv, hd)
    a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
    x = x + a.reshape(b, nh * hd) @ wo.T
    g, u = (rms(x, ln2, eps) @ w13.T).chunk(2, -1)
    return x + (F.silu(g) * u) @ w2.T


def decode_step(m, layer_fn, tokens, pos, batch):
    c = m.cfg
    x = m.embed[tokens]
    # Keys at or before each sequence's position (the static cache's length is max_len).
    mask = (torch.arange(m.max_len, device=x.device)[None, :] <= pos[:, None])[:, None, None, :]
    cos, sin = m.cos[pos][:, None, None, :], m.sin[pos][:, None, None, :]
    for i, layer in enumerate(m.layers):
        x = layer_fn(x, pos, mask, cos, sin, layer["ln1"], layer["wqkv"], layer["wo"], layer["ln2"],
                     layer["w13"], layer["w2"], m.k_cache[i, :batch], m.v_cache[i, :batch],
                     c["heads"], c["kv_heads"], c["head_dim"], c["eps"])
    logits = rms(x, m.norm, c["eps"]) @ m.lm_head.T
    return logits.argmax(-1)


def event_median(fn, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graphed_decode_ms(m, layer_fn, batch, context, reps):
    dev = m.embed.device
    tokens = torch.randint(0, m.cfg["vocab"], (batch,), device=dev)
    pos = torch.full((batch,), context, device=dev, dtype=torch.long)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up (and, for torch.compile, the compile itself)
            decode_step(m, layer_fn, tokens, pos, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step(m, layer_fn, tokens, pos, batch)
    for _ in range(3):
        graph.replay()
    return event_median(graph.replay, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="two layers: a quick look")
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    cfg = dict(LLAMA_8B)
    if args.small:
        cfg["layers"] = 2
    dev = "cuda"
    results = {"shape": "Llama-3.1-8B" if not args.small else "Llama-3.1-8B, 2 layers",
               "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    # One cache for every decode run: 128 sequences of 544 positions or 32 of 4112.
    m = Model(cfg, max_batch=128, max_len=544, dev=dev)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with torch.no_grad():
        for t in (512, 2048, 8192):
            ids = torch.randint(0, cfg["vocab"], (t,), device=dev)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                prefill(m, ids)
                ms = event_median(lambda: prefill(m, ids), 5)
            emit(results, f"prefill_sdpa_flash_t{t}_tok_s", t / ms * 1e3)
        for b in (1, 8, 32, 128):
            emit(results, f"decode_graph_c512_b{b}_ms", graphed_decode_ms(m, layer_step, b, 512, 20))
        if not args.skip_compile:
            t0 = time.perf_counter()
            compiled = torch.compile(layer_step, fullgraph=True, dynamic=False)
            for b in (1, 128):
                emit(results, f"decode_compiled_c512_b{b}_ms", graphed_decode_ms(m, compiled, b, 512, 20))
            emit(results, "compile_and_time_s", time.perf_counter() - t0)
        del m
        torch.cuda.empty_cache()
        m = Model(cfg, max_batch=32, max_len=4112, dev=dev)
        for b in (1, 8, 32):
            emit(results, f"decode_graph_c4096_b{b}_ms", graphed_decode_ms(m, layer_step, b, 4096, 20))
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
