"""Decode attention on the GPU (one new token per row against a static KV cache), timed from CUDA-graph replays:
SDPA's backends vs plain matmuls, at the bench-step shapes. Prints microseconds per call."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def graph_time(fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return 1000 * a.elapsed_time(b) / (5 * reps)


def case(g_: int, span: int) -> None:
    b, hkv, d = 128, 8, 128
    q = torch.randn(b, hkv, g_, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, 384, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    valid = torch.rand(b, 384, device="cuda") > 0.1
    mask = valid[:, None, None, :span]
    ks, vs = k[:, :, :span], v[:, :, :span]
    out = {}

    def sdpa(backend=None):
        if backend is None:
            return lambda: F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)
        def f():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)
        return f

    def bmm():
        sc = torch.matmul(q, ks.transpose(-1, -2)) * d ** -0.5
        sc = sc.masked_fill(~mask, float("-inf"))
        p = torch.softmax(sc.float(), dim=-1).to(q.dtype)
        return torch.matmul(p, vs)

    ref = bmm().float()
    for name, fn in [("sdpa_default", sdpa()), ("sdpa_efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION)),
                     ("sdpa_cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa_math", sdpa(SDPBackend.MATH)),
                     ("bmm", bmm)]:
        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            out[name] = f"{graph_time(fn):.1f}us (rel err {err:.1e})"
        except Exception as exc:
            out[name] = f"failed: {type(exc).__name__}"
    kv_bytes = 2 * b * hkv * span * d * 2
    print(f"g={g_} span={span} kv={kv_bytes/1e6:.0f}MB bound={kv_bytes/4.8e12*1e6:.1f}us", out)


for g_ in (2, 4):
    for span in (128, 320):
        case(g_, span)
