#!/usr/bin/env python3
"""torch's fp8 GEMMs at DeepSeek-V3's projection shapes: the baseline beside
`mlaserve-cuda-check --fp8` (run both in the same device call).

For each (out=N, in=K) and M in 1, 4, 64, 256, 4096 it times
  - block-scaled fp8: torch._scaled_mm(a, b, scale_a, scale_b) with a = x e4m3 [M, K],
    b = W e4m3 [N, K] viewed as [K, N] (column-major), scale_a (M, K/128) f32 made as a
    (K/128, M) tensor and transposed, scale_b made as (ceil(N/128), K/128) and transposed
    (DeepSeek's 1x128 activation / 128x128 weight scaling);
  - per-tensor fp8: the same with scalar scales;
  - bf16 torch.mm on the same shape.
Each is captured in a CUDA graph of one call per weight copy (at least 8; copies span
256 MB, at most 64, so small weights still come from HBM), replayed after warm-up and
timed with CUDA events; the median over replays, per call, is printed in µs with
TFLOP/s and weight GB/s (the same method as `mlaserve-cuda-check --fp8`).

Usage: python3 tools/gpu/fp8_gemm_baseline.py [--quick] [--iters N] [--rows 256,4096]
"""
import argparse
import statistics
import sys

import torch

SHAPES = [
    ("q_a 7168->1536", 1536, 7168),
    ("q_b 1536->24576", 24576, 1536),
    ("q_b/tp8 1536->3072", 3072, 1536),
    ("kv_a 7168->576", 576, 7168),
    ("o_proj 16384->7168", 7168, 16384),
    ("o_proj/tp8 2048->7168", 7168, 2048),
    ("mlp up 7168->18432", 18432, 7168),
    ("mlp down 18432->7168", 7168, 18432),
    ("mlp up/tp8 7168->2304", 2304, 7168),
    ("mlp down/tp8 2304->7168", 7168, 2304),
    ("expert up 7168->2048", 2048, 7168),
    ("expert down 2048->7168", 7168, 2048),
    ("expert up/tp8 7168->256", 256, 7168),
    ("expert down/tp8 256->7168", 7168, 256),
]
ROWS = [1, 4, 64, 256, 4096]
SPAN = 256 << 20
CALLS = 8  # fewest calls in a timed graph


def time_graph(fn, iters, calls):
    """Median µs per call of `fn` (`calls` calls per graph replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rows", help="comma-separated row counts (default: the full sweep)")
    args = ap.parse_args()
    rows = [1, 64, 4096] if args.quick else ROWS
    if args.rows:
        rows = [int(r) for r in args.rows.split(",")]
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    hdr = f"{'shape':<26} {'m':>5} {'block us':>9} {'TF/s':>7} {'GB/s':>7} {'tensor us':>9} {'TF/s':>7} {'bf16 us':>9} {'TF/s':>7}"
    print(hdr)
    f8 = torch.float8_e4m3fn
    for name, n, k in SHAPES:
        copies = max(1, min(64, -(-SPAN // (n * k))))
        w0 = (torch.rand(n, k, device=dev) * 2 - 1).mul_(448).to(f8)
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]
        sb = [torch.rand(-(-n // 128), k // 128, device=dev, dtype=torch.float32).mul_(1e-4).t() for _ in range(copies)]
        bcopies = max(1, min(64, -(-SPAN // (2 * n * k))))
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05 for _ in range(bcopies)]
        one = torch.ones((), device=dev, dtype=torch.float32)
        for m in rows:
            iters = min(args.iters, 5) if m >= 4096 else args.iters
            x = (torch.rand(m, k, device=dev) * 2 - 1).mul_(448).to(f8)
            sa = torch.rand(k // 128, m, device=dev, dtype=torch.float32).t()
            xb = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            flop = 2.0 * m * n * k

            def block(i):
                return torch._scaled_mm(x, ws[i % copies].t(), scale_a=sa, scale_b=sb[i % copies], out_dtype=torch.bfloat16)

            def tensor(i):
                return torch._scaled_mm(x, ws[i % copies].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            def bf(i):
                return torch.mm(xb, wb[i % bcopies].t())

            res = []
            for fn, c in ((block, copies), (tensor, copies), (bf, bcopies)):
                try:
                    res.append(time_graph(fn, iters, max(CALLS, c)))
                except Exception as e:  # noqa: BLE001 (report what torch refuses, keep going)
                    print(f"  {name} m={m} {fn.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
                    res.append(float("nan"))
            bt, tt, bft = res
            print(
                f"{name:<26} {m:>5} {bt:>9.1f} {flop / bt / 1e6:>7.1f} {n * k / bt / 1e3:>7.0f} "
                f"{tt:>9.1f} {flop / tt / 1e6:>7.1f} {bft:>9.1f} {flop / bft / 1e6:>7.1f}",
                flush=True,
            )
        del ws, sb, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
