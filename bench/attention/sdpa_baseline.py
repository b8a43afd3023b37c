#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""PyTorch scaled_dot_product_attention on the shapes of weft_bench_prefill's kernel rows, per backend.

Prints, for every total sequence length, the median time of SDPA's flash and cuDNN backends (each where it runs) and
their TFLOP/s counted as weft_bench_prefill counts them (4 x visible (query, key) pairs x q-heads x dim; causal: the
pairs at or below the diagonal). The inputs have weft's layout, [S, heads, dim] row-major, viewed as SDPA's
[1, heads, S, dim] (a transpose, no copy); a backend that rejects the strides is retried on contiguous copies.

    python3 bench/attention/sdpa_baseline.py --sizes 16K,32K,64K,128K --heads 32/32 --dim 128
"""

import argparse
import json
import sys


def parse_size(text):
    text = text.strip().upper()
    mult = 1
    if text.endswith("K"):
        mult, text = 1024, text[:-1]
    elif text.endswith("M"):
        mult, text = 1024 * 1024, text[:-1]
    return int(text) * mult


def attention_flops(seq, causal, hq, dim):
    pairs = seq * (seq + 1) // 2 if causal else seq * seq
    return 4.0 * pairs * hq * dim


def time_ms(fn, warmup, iters):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16K,32K,64K,128K", help="total sequence lengths (K = 1024)")
    ap.add_argument("--heads", default="32/32", help="q-heads / KV heads")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="", help="write the rows to this file")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv = (int(x) for x in args.heads.split("/"))
    causal = not args.no_causal
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    props = torch.cuda.get_device_properties(0)
    print(f"# sdpa_baseline  GPU {props.name}  torch {torch.__version__}  {args.dtype} dim {args.dim} "
          f"heads {hq}/{hkv}  {'causal' if causal else 'no mask'}  iters {args.iters} warmup {args.warmup}")
    print(f"{'seq':>9} {'backend':>8} {'ms':>10} {'TFLOP/s':>9}")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for seq in (parse_size(s) for s in args.sizes.split(",")):
        q = torch.randn(seq, hq, args.dim, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(seq, hkv, args.dim, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(seq, hkv, args.dim, device="cuda", dtype=dtype, generator=gen)
        views = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)]  # [1, heads, S, dim], strided
        gqa = {"enable_gqa": True} if hq != hkv else {}
        for name, backend in backends:
            ms = None
            why = ""
            for inputs in (views, [t.contiguous() for t in views]):
                try:
                    with sdpa_kernel([backend]):
                        def call():
                            F.scaled_dot_product_attention(*inputs, is_causal=causal, **gqa)
                        ms = time_ms(call, args.warmup, args.iters)
                    break
                except RuntimeError as e:  # the backend does not take these inputs
                    why = str(e).splitlines()[0][:100]
            if ms is None:
                print(f"{seq:>9} {name:>8}   not available: {why}")
                continue
            tflops = attention_flops(seq, causal, hq, args.dim) / (ms * 1e-3) / 1e12
            print(f"{seq:>9} {name:>8} {ms:>10.3f} {tflops:>9.1f}")
            sys.stdout.flush()
            rows.append({"seq": seq, "backend": name, "ms": ms, "tflops": tflops, "q_heads": hq, "kv_heads": hkv,
                         "dim": args.dim, "causal": causal})
        del q, k, v, views
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sdpa_baseline", "gpu": props.name, "torch": torch.__version__, "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
