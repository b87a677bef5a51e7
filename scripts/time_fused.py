"""Time the fused kernel alone, for A/B comparisons of kernel changes within one device call.

    python scripts/time_fused.py [--reps R] [--sys-scope] [--floor] [--stage] [--flush write|read|none] fmt hidden inter experts topk n [fmt hidden ...]

Per case: median of R CUDA-graph replays of one EP1 call (L2 flushed before each, as in
`deep_gemm.bench`), no baseline. Run it twice per variant, interleaved (A B A B), with PYTHONPATH
pointing at each variant's copy of the package (the repository root for the working tree): one device call then compares variants on the
same GPU, which separate calls (a fresh machine each) cannot. --sys-scope makes the one rank order
its signals at system scope, as with peers on other GPUs (SymmBuffer.peers_on_this_gpu = False).
--floor first times, the same way, a graph of one one-element kernel: what the method reports for a
kernel that does nothing (graph launch, event pair, the first kernel after the flush).
--stage: each replay is a decode step's two launches, `buf.stage(x, topk_idx, topk_weights)` (BF16 x
quantized into the buffer) and then the fused call, as a server runs them: the time of both, the
second launched as a programmatic dependent of the first unless DG_MEGA_MOE_PDL=0.
--flush read / none: a diagnostic flush that leaves L2 clean (bench_utils.L2Flusher) / no flush.
"""
import argparse
import gc
import os

import torch

from deep_gemm.mega import api as mega_api
from deep_gemm.testing import moe_case as mc
from deep_gemm.testing.bench_utils import L2Flusher, capture_graph, event_median_us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--reps', type=int, default=30)
    parser.add_argument('--sys-scope', action='store_true', help='system-scope signals, as with remote peers')
    parser.add_argument('--floor', action='store_true', help='also time a graph of one trivial kernel')
    parser.add_argument('--stage', action='store_true', help='time buf.stage(...) and the call together')
    parser.add_argument('--flush', choices=('write', 'read', 'none'), default='write',
                        help="L2 flush before each replay: the benchmark's memset (default), a read, or none")
    parser.add_argument('case', nargs='+', help='groups of: fmt hidden inter experts topk n')
    args = parser.parse_args()
    if len(args.case) % 6:
        parser.error(f'cases come in groups of 6 (fmt hidden inter experts topk n), got {len(args.case)} values')
    for c in range(0, len(args.case), 6):
        if args.case[c] not in mega_api.MEGA_MOE_FUNCTIONS:
            parser.error(f'format {args.case[c]!r}: expected {" / ".join(mega_api.MEGA_MOE_FUNCTIONS)}')
    flush = None if args.flush == 'none' else L2Flusher(torch.device('cuda'), mode=args.flush)
    tag = os.path.dirname(os.path.dirname(os.path.abspath(mega_api.__file__)))
    # tuning aids set for this run (AB_ENVS in scripts/ab_run.sh) name the variant too
    tag += ''.join(f' {k}={v}' for k, v in sorted(os.environ.items()) if k.startswith('DG_MEGA_MOE_'))
    if args.flush != 'write':
        tag += f' flush={args.flush}'
    if args.floor:
        one = torch.ones(1, device='cuda')
        graph, _ = capture_graph(lambda: one.add_(1.0))
        print(f'{tag}: floor (graph of one one-element kernel): {event_median_us(graph.replay, args.reps, flush):.1f} us',
              flush=True)
    for c in range(0, len(args.case), 6):
        fmt = args.case[c]
        h, i, e, k, n = map(int, args.case[c + 1:c + 6])
        w = mc.make_weights(fmt, h, i, e, 1, seed=0)
        (buf,) = mc.make_buffers(fmt, 1, e, max(n, 1), k, h, i)
        if args.sys_scope:
            buf.peers_on_this_gpu = False
        inputs = mc.make_inputs(fmt, [n], h, e, k, seed=1)
        (y,) = mc.run_ranks(w, inputs, [buf])
        l1, l2 = w.per_rank[0]
        entry = mega_api.mega_moe_function(fmt)
        if args.stage:
            x, idx, weights = inputs[0].x, inputs[0].topk_idx, inputs[0].topk_weights

            def step():
                buf.stage(x, idx, weights)
                entry(y, l1, l2, buf)
        else:
            def step():
                entry(y, l1, l2, buf)
        graph, _ = capture_graph(step)
        us = event_median_us(graph.replay, args.reps, flush)
        buf.check()
        scope = (' (sys scope)' if args.sys_scope else '') + (' stage+call' if args.stage else '')
        print(f'{tag}{scope}: {fmt} {h}/{i}/{e}/{k} n={n}: {us:.1f} us', flush=True)
        # l1/l2 hold the case's weights too: without them in the del, an H100 (80 GB) keeps the 7168-wide
        # case's 11 GB of weights while the next case draws its own (OOM at the second such case)
        del w, l1, l2, buf, inputs, y, graph
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
