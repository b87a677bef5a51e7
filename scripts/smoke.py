"""A few Mega MoE cases with diagnostics (calc_diff per rank, status), continuing past failures."""
import sys
import time
import traceback

import torch

import deep_gemm
from deep_gemm.testing import calc_diff
from deep_gemm.testing import moe_case as mc

CASES = [
    ('fp8xfp8', (512, 256, 16, 4), [64]),
    ('bf16xbf16', (512, 256, 16, 4), [64]),
    ('fp8xfp8', (512, 256, 16, 4), [1]),
    ('fp8xfp8', (512, 256, 16, 4), [300, 5]),
    ('bf16xbf16', (512, 256, 16, 4), [300, 0, 17, 64]),
    ('fp8xfp8', (2048, 768, 128, 8), [1024]),
    ('bf16xbf16', (2048, 768, 128, 8), [1024]),
]

deep_gemm.set_timeout(3)
ok = True
for fmt, (h, i, e, k), ns in CASES:
    t = time.time()
    try:
        w = mc.make_weights(fmt, h, i, e, len(ns), seed=0)
        bufs = mc.make_buffers(fmt, len(ns), e, max(ns), k, h, i)
        inputs = mc.make_inputs(fmt, ns, h, e, k, seed=1)
        ys = mc.run_ranks(w, inputs, bufs)
        diffs = []
        for y, inp in zip(ys, inputs):
            ref = mc.reference(w, inp)
            nan_rows = int(torch.isnan(y.float()).any(1).sum()) if y.numel() else 0
            diffs.append((calc_diff(y.float(), ref) if y.numel() else 0.0, nan_rows))
        for b in bufs:
            b.check()
        print(f'{fmt} {h}/{i}/{e}/{k} ns={ns}: diffs={diffs} ({time.time() - t:.1f} s)', flush=True)
        ok &= all(d < 1e-5 and nr == 0 for d, nr in diffs)
    except Exception:
        ok = False
        print(f'{fmt} {h}/{i}/{e}/{k} ns={ns}: FAILED', flush=True)
        traceback.print_exc()
        torch.cuda.synchronize()
sys.exit(0 if ok else 1)
