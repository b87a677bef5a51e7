"""Where does one Mega MoE call spend its time? Per-CTA %globaltimer stamps of each phase.

    python scripts/trace.py [--cold | --cold-read | --cold-code-warm] [fmt hidden inter experts topk n ...]

Prints, per phase, how many CTAs stamped it and the min / 10th percentile / median / 90th percentile
/ max time in microseconds after the first CTA started. Development aid (the kernel writes stamps
only when a trace buffer is given). The traced call is the last of three; warm by default (weights
may still sit in L2 from the call before), with --cold after the benchmark's L2 flush (256 MB
written), as `deep_gemm.bench` times it, with --cold-read after a flush that leaves L2 clean (256 MB
read), with --cold-code-warm after the flush and one untraced call on experts the traced call does
not use (its weights cold, the code warm).
"""
import dataclasses
import sys

import torch

from deep_gemm import _C
from deep_gemm.testing import moe_case as mc

SLOTS = ['start', 'counted', 'layout', 'pull end', 'L1 begin', 'L1 end', 'L2 begin', 'L2 end',
         'combine ready', 'combine end', 'exit', 'pull begin', 'L1 1st stage']
NUM_SLOTS = _C.kTraceSlots   # per K-block stamps of the first L1 task: kTraceKbReady + kb, kTraceKbIssue + kb


def _other_experts(inputs, e):
    """The same tokens routed to experts none of `inputs` uses (each id shifted by the same offset)."""
    used = set(inputs.topk_idx[inputs.topk_idx >= 0].tolist())
    for shift in range(1, e):
        if not used & {(x + shift) % e for x in used}:
            idx = torch.where(inputs.topk_idx >= 0, (inputs.topk_idx + shift) % e, inputs.topk_idx)
            return dataclasses.replace(inputs, topk_idx=idx)
    raise ValueError('no disjoint expert set: too many experts routed')


def trace_case(fmt, h, i, e, k, n, reps=3, flush=None, code_warm=False):
    w = mc.make_weights(fmt, h, i, e, 1, seed=0)
    (buf,) = mc.make_buffers(fmt, 1, e, max(n, 1), k, h, i)
    inputs = mc.make_inputs(fmt, [n], h, e, k, seed=1)
    # code_warm: after the flush, one untraced call on other experts, so the traced call finds the
    # kernel's code and parameters in L2 but its own weights cold
    other = _other_experts(inputs[0], e) if code_warm else None
    buf._trace = torch.zeros(_C.get_num_sms() * NUM_SLOTS, dtype=torch.int64, device='cuda')
    for r in range(reps):   # the last call is traced (after the flush when given)
        buf._trace.zero_()
        if flush is not None and r == reps - 1:
            flush()
            if other is not None:
                mc.run_ranks(w, [other], [buf])
                buf._trace.zero_()
        mc.run_ranks(w, inputs, [buf])
    t = buf._trace.view(-1, NUM_SLOTS).cpu()
    t0 = t[:, 0][t[:, 0] > 0].min()
    print(f'--- {fmt} {h}/{i}/{e}/{k} n={n}' + (f' (cold: L2 flushed, {flush.mode}' + (', code warmed by a call on other experts)' if code_warm else ')')
                                              if flush is not None else ''))
    for s, name in enumerate(SLOTS):
        col = t[:, s]
        col = col[col > 0].double()
        if col.numel():
            col = (col - t0) / 1e3
            q = torch.quantile(col, torch.tensor([0.1, 0.9], dtype=col.dtype)).tolist()
            print(f'{name:>14}: {col.numel():4d} CTAs  min {col.min():8.2f}  p10 {q[0]:8.2f}  median {col.median():8.2f}  '
                  f'p90 {q[1]:8.2f}  max {col.max():8.2f} us')
    # K-block cadence of the first L1 task, on the CTA that started L1 first
    kb_slots = _C.kTraceKbSlots
    ready = t[:, _C.kTraceKbReady:_C.kTraceKbReady + kb_slots]
    issue = t[:, _C.kTraceKbIssue:_C.kTraceKbIssue + kb_slots]
    rows = (ready[:, 0] > 0).nonzero().flatten()
    if rows.numel():
        r = rows[ready[rows, 0].argmin()]
        fmt_us = lambda v: ' '.join(f'{(x - t0) / 1e3:6.2f}' if x > 0 else '     -' for x in v.tolist())
        print(f'  CTA {int(r)} K-block ready: {fmt_us(ready[r])}')
        print(f'  CTA {int(r)} A issued:      {fmt_us(issue[r])}')


def warm_up_gpu(seconds=1.0):
    # Idle H200s sit at a low SM clock; a second of matmuls brings them to their working clock
    import time
    a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        a @ a
    torch.cuda.synchronize()


if __name__ == '__main__':
    warm_up_gpu()
    args = sys.argv[1:]
    flush = None
    code_warm = False
    if args and args[0] in ('--cold', '--cold-read', '--cold-code-warm'):
        from deep_gemm.testing.bench_utils import L2Flusher
        flush = L2Flusher(torch.device('cuda'), mode='read' if args[0] == '--cold-read' else 'write')
        code_warm = args[0] == '--cold-code-warm'
        args = args[1:]
    if args:
        for c in range(0, len(args), 6):   # groups of: fmt hidden inter experts topk n
            trace_case(args[c], *map(int, args[c + 1:c + 6]), flush=flush, code_warm=code_warm)
    else:
        for fmt in ('fp8xfp8',):
            trace_case(fmt, 2048, 768, 128, 8, 1, flush=flush)
            trace_case(fmt, 4096, 2048, 256, 6, 1, flush=flush)
            trace_case(fmt, 2048, 768, 128, 8, 128, flush=flush)
            trace_case(fmt, 4096, 2048, 256, 6, 4096, flush=flush)
