"""One small Mega MoE launch, for debuggers and sanitizers (cuda-gdb, compute-sanitizer).

    python scripts/one_launch.py [--bad-ids] [--sms N] [--ranks R] [--format fp8xfp8|bf16xbf16|fp8xfp4] [--tokens n]
                                 [--shape small|mid] [--experts-allowed A] [--calls C]

--bad-ids puts out-of-range expert ids (too large, -2) into the routing: the kernel must flag them
and never use them as an index (run under `compute-sanitizer --tool memcheck`). --tokens 8 gives
M-blocks of 1-4 tokens (the narrow decode tiles); the default 48, about 12 (the wide ones);
--tokens 1024 prefill tiles (BLOCK_M 128: the count in slices, the combine through shared memory).
--shape mid (2048/768/128/8; default small, 512/256/16/4) with --tokens 128 --format fp8xfp4 runs the
FP8 x FP4 decode kernel with 256-wide L2 tasks and N = 16 / 32 / 64 transposed tiles; --experts-allowed
A routes every token to A of the experts (larger M-blocks). --calls C runs C - 1 more calls on the same
buffers after the first, each with fresh inputs, 1..n tokens per rank and 0-30 % of the top-k slots
masked, every one checked (no stale state between calls); the figure printed is the worst of all.
"""
import argparse

import torch

import deep_gemm
from deep_gemm.mega.launch import _max_smem, kernel_variant, ranks_share_gpu
from deep_gemm.testing import calc_diff, ep_check
from deep_gemm.testing import moe_case as mc

parser = argparse.ArgumentParser()
parser.add_argument('--bad-ids', action='store_true')
parser.add_argument('--sms', type=int, default=8, help='CTAs per rank (sanitizers are slow)')
parser.add_argument('--ranks', type=int, default=1)
parser.add_argument('--format', default='fp8xfp8')
parser.add_argument('--tokens', type=int, default=48, help='tokens per rank')
parser.add_argument('--shape', choices=('small', 'mid'), default='small')
parser.add_argument('--experts-allowed', type=int, default=None, help='route to the first A experts only')
parser.add_argument('--calls', type=int, default=1, help='calls on the same buffers (fresh inputs each)')
args = parser.parse_args()
if args.calls < 1 or (args.bad_ids and args.calls > 1):
    parser.error('--calls: at least 1, and 1 with --bad-ids')

fmt, (h, i, e, k) = args.format, {'small': (512, 256, 16, 4), 'mid': (2048, 768, 128, 8)}[args.shape]
ns = [args.tokens] * args.ranks
w = mc.make_weights(fmt, h, i, e, args.ranks, seed=0)
bufs = mc.make_buffers(fmt, args.ranks, e, max(ns), k, h, i)
for b in bufs:
    b.num_sms = args.sms
inputs = mc.make_inputs(fmt, ns, h, e, k, seed=1, experts_allowed=args.experts_allowed)
expected = inputs
if args.bad_ids:
    bad = [mc.RankInputs(x.x, x.x_q, x.x_sf, x.topk_idx.clone(), x.topk_weights) for x in inputs]
    masked = [mc.RankInputs(x.x, x.x_q, x.x_sf, x.topk_idx.clone(), x.topk_weights) for x in inputs]
    for b_in, m_in in zip(bad, masked):
        b_in.topk_idx[3, 1], b_in.topk_idx[7, 2] = 1 << 20, -2
        m_in.topk_idx[3, 1], m_in.topk_idx[7, 2] = -1, -1
    inputs, expected = bad, masked
ys = mc.run_ranks(w, inputs, bufs)
# calc_diff tolerances of the GPU tests (tests/test_mega_moe_gpu.py says why); a NaN (an unwritten,
# poisoned row) fails whatever the other ranks' figures are
TOL = ep_check.TOLERANCE
diffs = [calc_diff(y.float(), mc.reference(w, x)) for y, x in zip(ys, expected)]
has_nan = any(bool(torch.isnan(y).any()) for y in ys)
gen = torch.Generator().manual_seed(2)
for call in range(1, args.calls):
    call_ns = [int(torch.randint(1, args.tokens + 1, (1,), generator=gen)) for _ in ns]
    call_inputs = mc.make_inputs(fmt, call_ns, h, e, k, seed=100 + call, experts_allowed=args.experts_allowed,
                                 mask_frac=0.1 * (call % 4))
    call_ys = mc.run_ranks(w, call_inputs, bufs)   # run_ranks poisons y before the launch
    diffs += [calc_diff(y.float(), mc.reference(w, x)) for y, x in zip(call_ys, call_inputs)]
    has_nan = has_nan or any(bool(torch.isnan(y).any()) for y in call_ys)
worst = float('nan') if has_nan else max(diffs)
try:
    for b in bufs:
        b.check()
    status = 'no error recorded'
except deep_gemm.MegaMoEError as err:
    status = f'recorded: {err}'
# the kernel rank 0 launched: (mma_type, block_m, num_stages, fast_math, block_n_l2, wide_n_min, signals_thread, cta_pair)
variant = kernel_variant(fmt, args.ranks, e, k, h, i, ns[0], args.sms, _max_smem(torch.device('cuda')),
                         shares_gpu=ranks_share_gpu(bufs[0]))
print(f'{fmt} n={args.tokens} ranks={args.ranks} calls={args.calls} bad_ids={args.bad_ids}: worst calc_diff {worst:.3e}; {status}; '
      f'kernel variant {variant}', flush=True)
ok = not has_nan and worst < TOL[fmt] and (('expert id' in status) if args.bad_ids else status == 'no error recorded')
raise SystemExit(0 if ok else 1)
