#!/usr/bin/env python3
"""FlashMLA's sm90 dense decode kernel at the configurations of `mlaserve bench mla-decode`,
timed the same way, and the ratio table of the two. Needs FlashMLA importable as the
`flash_mla` Python package (built from its public source against this machine's torch,
as its own instructions say; nothing of it is in this repository), torch, and a GPU:

  flashmla_bench.py check                      FlashMLA against a float32 torch reference
                                               (eager and graph-replayed; asserts)
  flashmla_bench.py bench [sweep] [--json F]   one row per configuration
  flashmla_bench.py compare OURS_LOG FLASH_JSON
                                               the ratio table (needs neither torch nor a GPU)

In one device call: `check`, `bench --json flash.json`, then `mlaserve bench mla-decode
> ours.log` with the same sweep, then `compare ours.log flash.json`.
Sweep flags as ours: --batch (64,128) --seq (4096,8192) --heads (16,32,64,128) --q-len (1,2,4).

Inputs as `bench_mla_decode` (crates/mlaserve-cuda-lab/src/bench.rs) builds them: one bf16
cache of max(batch) * ceil(max(seq) / 64) pages of 64 tokens x 576 (512 latent + 64 rope),
uniform in [-1, 1], pages in a random order, request b's block table being entries
b*P .. b*P+P-1 of that permutation (P = ceil(max(seq) / 64)); every request's length is the
configuration's seq; q [batch][q_len][heads][576] uniform in [-1, 1]; dv 512; softmax scale
1/sqrt(192); for q_len > 1 the bottom-right causal mask (query i of s sees positions
< seq - (s - 1 - i); FlashMLA's causal=True). Timing as its time_graph: 8 calls captured in
one CUDA graph, replayed `warmup` times, then `iters` replays each between two events;
the median replay / 8 is the time per call. FlashMLA's scheduling metadata is computed by
an untimed call before capture, as a decode step computes it once for all its layers; the
graph holds the attention kernel and its split-KV combine (ours: the kernel and its merge).
"""
import argparse
import itertools
import json
import math
import os
import re
import sys

DQK, DV, PAGE = 576, 512, 64
SCALE = 1.0 / math.sqrt(192.0)
GRAPH_CALLS = 8


def int_list(s):
    return [int(x) for x in s.split(",") if x]


def flashmla_call(q, cache, bt, seqlens, causal):
    """A closure running FlashMLA's decode on these tensors; returns (out, lse).

    Handles both interfaces: the current one (get_mla_metadata() takes no arguments and
    returns an empty FlashMLASchedMeta that the first call fills) and the older one
    (get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv) -> (metadata, num_splits)).
    """
    import flash_mla

    try:
        md, ns = flash_mla.get_mla_metadata()
    except TypeError:
        md, ns = flash_mla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2] // cache.shape[2], cache.shape[2])

    def call():
        return flash_mla.flash_mla_with_kvcache(q, cache, bt, seqlens, DV, md, ns, softmax_scale=SCALE, causal=causal)

    def splits():  # FlashMLA's split count, summed over the batch (num_splits is a prefix sum)
        t = getattr(md, "num_splits", None) if ns is None else ns
        return int(t[-1].item()) if t is not None else -1

    return call, splits


def time_graph(fn, warmup, iters, calls=GRAPH_CALLS):
    """Median ms per call of `fn`: `calls` calls in one graph, timed per replay."""
    import torch

    fn()  # untimed: FlashMLA fills its scheduling metadata here
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(max(warmup, 1)):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    torch.cuda.synchronize()
    del g
    times.sort()
    return times[len(times) // 2], times[0]


def reference(q, cache, bt, lens, causal):
    """float32 attention over the paged cache: out [b][s][h][512], lse [b][h][s] (natural)."""
    import torch

    b, s, h, _ = q.shape
    out = torch.empty(b, s, h, DV, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        kv = cache[bt[i, : -(-n // PAGE)].long()].reshape(-1, DQK)[:n].float()  # [n][576]
        sc = q[i].float().reshape(s * h, DQK) @ kv.T * SCALE  # rows: s_idx * h + head
        if causal and s > 1:
            s_idx = torch.arange(s, device=q.device).repeat_interleave(h)
            hidden = torch.arange(n, device=q.device)[None, :] >= (n - (s - 1 - s_idx))[:, None]
            sc.masked_fill_(hidden, float("-inf"))
        lse[i] = torch.logsumexp(sc, -1).reshape(s, h).T
        out[i] = (torch.softmax(sc, -1) @ kv[:, :DV]).reshape(s, h, DV)
    return out, lse


def check_close(what, out, lse, ref_out, ref_lse):
    import torch

    out, lse = out.float(), lse.float()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{what}: non-finite output"
    # Per request: the largest error over the request's largest reference value.
    b = out.shape[0]
    err = ((out - ref_out).abs().reshape(b, -1).amax(1) / ref_out.abs().reshape(b, -1).amax(1)).max().item()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref_out.flatten(), dim=0).item()
    lse_err = ((lse - ref_lse).abs() / (1.0 + ref_lse.abs())).max().item()
    ok = err <= 0.02 and cos >= 1 - 1e-5 and lse_err <= 1e-3
    print(f"{what}: max|err|/max|ref| {err:.2e}, 1-cos {1 - cos:.1e}, lse rel err {lse_err:.1e}"
          f"  {'ok' if ok else 'FAIL'}")
    assert ok, f"{what}: FlashMLA differs from the reference"


def cmd_check(_args):
    """Small shapes, ragged lengths (a partial last page, several splits), every head
    count and query length of the sweep, eager and as a graph replay."""
    import torch

    torch.manual_seed(0)
    lens = [5, 64, 333, 1500]
    ppr = -(-max(lens) // PAGE)
    nb = 3 * len(lens) * ppr  # a pool larger than the pages used, in a random order
    cache = torch.empty(nb, PAGE, 1, DQK, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    bt = torch.randperm(nb, device="cuda")[: len(lens) * ppr].int().view(len(lens), ppr)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for heads, s in itertools.product([16, 32, 64, 128], [1, 2, 4]):
        q = torch.empty(len(lens), s, heads, DQK, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        call, _ = flashmla_call(q, cache, bt, sl, causal=s > 1)
        ref_out, ref_lse = reference(q, cache, bt, lens, causal=s > 1)
        out, lse = call()
        check_close(f"heads {heads:3} s {s} eager", out, lse, ref_out, ref_lse)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gout, glse = call()
        gout.zero_()
        g.replay()
        torch.cuda.synchronize()
        check_close(f"heads {heads:3} s {s} graph", gout, glse, ref_out, ref_lse)
        del g
    print("check: FlashMLA matches the float32 reference")


def cmd_bench(args):
    import torch

    torch.manual_seed(22)
    dev = torch.cuda.get_device_name()
    src = os.environ.get("FLASHMLA_SOURCE", "")
    ppr = -(-max(args.seq) // PAGE)
    nb = max(args.batch) * ppr
    max_rows = max(args.heads) * max(args.q_len)
    cache = torch.empty(nb, PAGE, 1, DQK, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    perm = torch.randperm(nb, device="cuda").int()
    q_all = torch.empty(max(args.batch) * max_rows * DQK, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    print(f"device: {dev}")
    print(f"FlashMLA dense decode (graph: replay of {GRAPH_CALLS} calls, median of {args.iters}); {src}")
    print(f"{'batch':>5} {'seq':>5} {'heads':>5} {'s':>3} {'splits':>6} {'graph_us':>9} {'min_us':>8} {'GB/s':>7} {'TFLOP/s':>8}")
    rows = []
    for batch, seq, heads, s in itertools.product(args.batch, args.seq, args.heads, args.q_len):
        q = q_all[: batch * s * heads * DQK].view(batch, s, heads, DQK)
        bt = perm[: batch * ppr].view(batch, ppr)
        sl = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
        call, splits = flashmla_call(q, cache, bt, sl, causal=s > 1)
        med, lo = time_graph(call, args.warmup, args.iters)
        out, lse = call()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), "non-finite FlashMLA output"
        rws = heads * s
        nbytes = batch * (seq * DQK * 2 + rws * (DQK * 2 + DV * 2 + 4))  # plan::min_bytes
        flops = batch * 2.0 * rws * seq * (DQK + DV)  # plan::flops
        r = dict(batch=batch, seq=seq, heads=heads, q_len=s, splits=splits() / batch, graph_us=med * 1e3,
                 min_us=lo * 1e3, gbps=nbytes / (med * 1e-3) / 1e9, tflops=flops / (med * 1e-3) / 1e12)
        rows.append(r)
        print(f"{batch:>5} {seq:>5} {heads:>5} {s:>3} {r['splits']:>6.2f} {r['graph_us']:>9.1f} {r['min_us']:>8.1f}"
              f" {r['gbps']:>7.0f} {r['tflops']:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev, source=src, iters=args.iters, rows=rows), f, indent=1)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_ours(text, order):
    """The table of `mlaserve bench mla-decode`, found by its header's column names.

    Returns ([(column name, {(batch, seq, heads, s): graph_us})], device line, ceilings
    line). Each --kernel (and --merge) asked for is one block of rows in the sweep's order
    (`order`: config -> index; a block restarts it); a block's name is its kernel's, which
    rows print with a `*` where another kernel ran in its place. Several rows of one
    config in a block (a --splits sweep) count as their least time.
    """
    header, blocks, device, ceil = None, [], "", ""
    last = None  # (position, label) of the previous row
    for line in text.splitlines():
        line = ANSI.sub("", line)
        t = line.split()
        if line.startswith("device:"):
            device = line.split(":", 1)[1].strip()
        elif line.startswith("ceilings"):
            ceil = line.strip()
        elif len(t) > 1 and t[0] == "kernel" and "graph_us" in t:
            header = t
            col = {n: t.index(n) for n in ("kernel", "batch", "seq", "heads", "s", "graph_us")}
        elif header and len(t) == len(header) and t[-1] in ("memory", "compute"):
            try:
                key = tuple(int(t[col[n]]) for n in ("batch", "seq", "heads", "s"))
                us = float(t[col["graph_us"]])
            except ValueError:
                continue
            label, pos = t[col["kernel"]], order.get(key, -1)
            if last is None or pos < last[0] or (pos == last[0] and label != last[1]):
                blocks.append(({}, set()))
            rows, labels = blocks[-1]
            rows[key] = min(us, rows.get(key, math.inf))
            labels.add(label)
            last = (pos, label)
    if header is None or not blocks:
        sys.exit("compare: no `bench mla-decode` table in our log")
    cols, seen = [], {}
    for rows, labels in blocks:
        plain = sorted(x for x in labels if not x.endswith("*"))
        name = "+".join(plain) if plain else "+".join(sorted(labels))
        seen[name] = seen.get(name, 0) + 1
        cols.append((name if seen[name] == 1 else f"{name}#{seen[name]}", rows))
    return cols, device, ceil


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def cmd_compare(args):
    with open(args.flash) as f:
        fm = json.load(f)
    keys = [(r["batch"], r["seq"], r["heads"], r["q_len"]) for r in fm["rows"]]
    with open(args.ours) as f:
        cols, our_dev, ceil = parse_ours(f.read(), {k: i for i, k in enumerate(keys)})
    w = max([9] + [len(n) for n, _ in cols])
    print(f"mlaserve: {our_dev}; {ceil}")
    print(f"FlashMLA: {fm['device']}; {fm['source']}")
    print("graph_us: median per call of a replayed graph of 8 calls; ratio = mlaserve / FlashMLA (< 1: mlaserve faster)")
    print(f"{'batch':>5} {'seq':>5} {'heads':>5} {'s':>3} {'FlashMLA':>9}" + "".join(f" {n:>{w}} {'ratio':>6}" for n, _ in cols))
    ratios = {n: [] for n, _ in cols}  # name -> [(ratio, key)]
    missing = []
    for key, r in zip(keys, fm["rows"]):
        line = f"{key[0]:>5} {key[1]:>5} {key[2]:>5} {key[3]:>3} {r['graph_us']:>9.1f}"
        for n, rows in cols:
            us = rows.get(key)
            if us is None:
                missing.append((n, key))
                line += f" {'-':>{w}} {'-':>6}"
            else:
                ratios[n].append((us / r["graph_us"], key))
                line += f" {us:>{w}.1f} {us / r['graph_us']:>6.3f}"
        print(line)
    for n, _ in cols:
        rs = ratios[n]
        if not rs:
            continue
        parts = [f"heads {h} {geomean([x for x, k in rs if k[2] == h]):.3f} ({sum(k[2] == h for _, k in rs)})"
                 for h in sorted({k[2] for _, k in rs})]
        print(f"{n}: geomean ratio " + ", ".join(parts) + f"; all {geomean([x for x, _ in rs]):.3f} ({len(rs)})")
        hi, lo = max(rs), min(rs)
        print(f"{n}: max ratio {hi[0]:.3f} at batch {hi[1][0]} seq {hi[1][1]} heads {hi[1][2]} s {hi[1][3]};"
              f" min {lo[0]:.3f} at batch {lo[1][0]} seq {lo[1][1]} heads {lo[1][2]} s {lo[1][3]}")
    extra = sorted({k for _, rows in cols for k in rows} - set(keys))
    if missing or extra:
        sys.exit(f"compare: configurations differ: missing from ours {missing}; only in ours {extra}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check").set_defaults(fn=cmd_check)
    b = sub.add_parser("bench")
    b.add_argument("--batch", type=int_list, default=[64, 128])
    b.add_argument("--seq", type=int_list, default=[4096, 8192])
    b.add_argument("--heads", type=int_list, default=[16, 32, 64, 128])
    b.add_argument("--q-len", type=int_list, default=[1, 2, 4])
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--iters", type=int, default=30)
    b.add_argument("--json")
    b.set_defaults(fn=cmd_bench)
    c = sub.add_parser("compare")
    c.add_argument("ours")
    c.add_argument("flash")
    c.set_defaults(fn=cmd_compare)
    args = p.parse_args()
    if args.cmd != "compare":
        import torch

        assert torch.cuda.is_available(), "no CUDA device"
        assert torch.cuda.get_device_capability() == (9, 0), "FlashMLA's dense decode needs sm_90"
        with torch.inference_mode():
            args.fn(args)
    else:
        args.fn(args)


if __name__ == "__main__":
    main()
