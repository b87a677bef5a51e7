"""One Mega MoE case called eagerly a few times, for Nsight Compute (scripts/device_ncu.sh).

    python scripts/ncu_case.py [--calls C] fmt hidden inter experts topk n

EP1, the inputs of scripts/time_fused.py. The first C - 1 calls load and warm the kernel; profile
the last one (`ncu --launch-skip C-1 --launch-count 1 -k sm90_mega_moe`).
"""
import argparse

import torch

from deep_gemm.mega import api as mega_api
from deep_gemm.testing import moe_case as mc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--calls', type=int, default=3)
    parser.add_argument('fmt', choices=tuple(mega_api.MEGA_MOE_FUNCTIONS))
    parser.add_argument('shape', nargs=5, type=int, help='hidden inter experts topk n')
    args = parser.parse_args()
    h, i, e, k, n = args.shape
    w = mc.make_weights(args.fmt, h, i, e, 1, seed=0)
    (buf,) = mc.make_buffers(args.fmt, 1, e, max(n, 1), k, h, i)
    inputs = mc.make_inputs(args.fmt, [n], h, e, k, seed=1)
    (y,) = mc.run_ranks(w, inputs, [buf])   # stages the inputs and makes one call
    l1, l2 = w.per_rank[0]
    for _ in range(args.calls - 1):
        mega_api.mega_moe_function(args.fmt)(y, l1, l2, buf)
    torch.cuda.synchronize()
    buf.check()
    print(f'{args.fmt} {h}/{i}/{e}/{k} n={n}: {args.calls} calls done', flush=True)


if __name__ == '__main__':
    main()
