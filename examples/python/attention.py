# SPDX-License-Identifier: MIT
"""weft's attention on torch tensors, beside torch's scaled_dot_product_attention, on one GPU (no weft.init needed).

    python examples/python/attention.py [--seq 4096] [--heads 32/8] [--dim 128]

Prefill: one causal sequence through weft.flash_attention and through SDPA (its default backend choice), the outputs
compared and both timed. Decode: one token per sequence against a paged KV cache (pages in random order) through
weft.decode_attention, checked against SDPA over each sequence's gathered keys.
"""
import argparse
import math

import torch
import torch.nn.functional as F

import weft
from example_utils import rel_error, time_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", default="32/8", help="q-heads / KV heads")
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    s, d = args.seq, args.dim
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())

    # Prefill: weft takes [seq, heads, dim]; SDPA [batch, heads, seq, dim] (the same memory, transposed views).
    q = torch.randn(s, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(s, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(s, hkv, d, device=dev, dtype=torch.bfloat16)
    out = weft.flash_attention(q, k, v, causal=True)
    sdpa_args = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    gqa = {"enable_gqa": True} if hq != hkv else {}
    ref = F.scaled_dot_product_attention(*sdpa_args, is_causal=True, **gqa)[0].transpose(0, 1)
    err = rel_error(out, ref)
    t_weft = time_ms(lambda: weft.flash_attention(q, k, v, out, causal=True), warmup=5)
    t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(*sdpa_args, is_causal=True, **gqa), warmup=5)
    print(f"prefill  seq {s}  heads {hq}/{hkv}  dim {d}  causal: weft {t_weft:.3f} ms, SDPA {t_sdpa:.3f} ms "
          f"({t_sdpa / t_weft:.2f}x), relative difference {err:.1e}")

    # Decode: 8 sequences of up to `seq` tokens in a cache of 16-token pages in random order.
    batch, page = 8, 16
    lens = torch.randint(1, s + 1, (batch,), dtype=torch.int32)
    per_seq = (s + page - 1) // page
    pages = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32)
    table = pages.reshape(batch, per_seq)
    k_cache = torch.randn(batch * per_seq, page, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    qd = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    lens_d = lens.to(dev)
    out_d = weft.decode_attention(qd, k_cache, v_cache, table, lens_d, max_seq_len=s)
    worst = 0.0
    for b in range(batch):
        n = int(lens[b])
        kb = k_cache[table[b].long()].reshape(-1, hkv, d)[:n]  # the sequence's keys, gathered in order
        vb = v_cache[table[b].long()].reshape(-1, hkv, d)[:n]
        want = F.scaled_dot_product_attention(qd[b].unsqueeze(1).unsqueeze(0), kb.transpose(0, 1).unsqueeze(0),
                                              vb.transpose(0, 1).unsqueeze(0), **gqa)[0, :, 0]
        e = ((out_d[b].float() - want.float()).norm() / want.float().norm()).item()
        worst = max(worst, e) if math.isfinite(e) else math.inf  # a NaN fails
    t_dec = time_ms(lambda: weft.decode_attention(qd, k_cache, v_cache, table, lens_d, out_d, max_seq_len=s), warmup=5)
    print(f"decode   batch {batch}  up to {s} tokens  page {page}: weft {t_dec * 1000:.1f} us, worst relative "
          f"difference to SDPA {worst:.1e}")
    ok = err < 2e-2 and worst < 2e-2
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
