"""Development aid: run named Mega MoE cases, report per rank the kernel variant, status, NaN rows
and calc_diff against the emulating reference.   python scripts/diag_cases.py"""
import os
import sys

import torch

from deep_gemm.mega.launch import kernel_variant, _max_smem, ranks_share_gpu
from deep_gemm.testing import moe_case as mc
from deep_gemm.testing.reference import calc_diff

CASES = [  # fmt, (hidden, inter, experts, topk), ns, routing
    ('fp8xfp8', (2048, 768, 128, 8), [1], {}),
    ('fp8xfp8', (2048, 768, 128, 8), [7], {}),
    ('fp8xfp8', (2048, 768, 128, 8), [64], {}),
    ('fp8xfp8', (2048, 768, 128, 8), [64], dict(experts_allowed=8)),
    ('fp8xfp8', (2048, 768, 128, 8), [64], dict(experts_allowed=24)),
    ('bf16xbf16', (2048, 768, 128, 8), [64], dict(experts_allowed=8)),
    ('fp8xfp4', (2048, 768, 128, 8), [64], dict(experts_allowed=8)),
    ('fp8xfp8', (2048, 768, 128, 8), [64, 7, 0, 1024], {}),
    ('fp8xfp8', (2048, 768, 128, 8), [7, 7], dict(experts_allowed=8)),
]


def main():
    print('DG_MEGA_MOE_L2_BLOCK_N =', os.environ.get('DG_MEGA_MOE_L2_BLOCK_N'), flush=True)
    for fmt, (h, i, e, k), ns, routing in CASES:
        w = mc.make_weights(fmt, h, i, e, len(ns), seed=0)
        bufs = mc.make_buffers(fmt, len(ns), e, max(max(ns), 1), k, h, i)
        inputs = mc.make_inputs(fmt, ns, h, e, k, seed=3, **routing)
        try:
            ys = mc.run_ranks(w, inputs, bufs)
        except Exception as ex:  # noqa: BLE001
            print(f'{fmt} {ns} {routing}: run failed: {type(ex).__name__}: {ex}'.splitlines()[0], flush=True)
            continue
        for r, (y, inp, buf) in enumerate(zip(ys, inputs, bufs)):
            try:
                buf.check()
                st = 'ok'
            except Exception as ex:  # noqa: BLE001
                st = f'{type(ex).__name__}: {str(ex).splitlines()[0][:200]}'
            var = kernel_variant(fmt, len(ns), e, k, h, i, ns[r], buf.num_sms or torch.cuda.get_device_properties(0).multi_processor_count,
                                 _max_smem(buf.device), shares_gpu=ranks_share_gpu(buf))
            nan_rows = int(torch.isnan(y.float()).any(1).sum()) if ns[r] else 0
            d = calc_diff(y.float(), mc.reference(w, inp)) if ns[r] and nan_rows < ns[r] else float('nan')
            print(f'{fmt} {ns} {routing} rank {r} n={ns[r]} variant {var}: status {st}; NaN rows {nan_rows}/{ns[r]}; '
                  f'calc_diff {d:.3e}', flush=True)
        del w, bufs
        torch.cuda.empty_cache()


if __name__ == '__main__':
    sys.exit(main())
