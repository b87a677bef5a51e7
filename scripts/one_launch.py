"""One small fp8 Mega MoE launch, for debuggers (cuda-gdb, compute-sanitizer)."""
import torch

import deep_gemm
from deep_gemm.testing import calc_diff
from deep_gemm.testing import moe_case as mc

fmt, (h, i, e, k), ns = 'fp8xfp8', (512, 256, 16, 4), [64]
w = mc.make_weights(fmt, h, i, e, len(ns), seed=0)
bufs = mc.make_buffers(fmt, len(ns), e, max(ns), k, h, i)
inputs = mc.make_inputs(fmt, ns, h, e, k, seed=1)
print('launching', flush=True)
ys = mc.run_ranks(w, inputs, bufs)
print('diff', calc_diff(ys[0].float(), mc.reference(w, inputs[0])), flush=True)
