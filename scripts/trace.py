"""Where does one Mega MoE call spend its time? Per-CTA %globaltimer stamps of each phase.

    python scripts/trace.py [--tasks] [--cold | --cold-read | --cold-code-warm] [fmt hidden inter experts topk n ...]

Prints, per phase, how many CTAs stamped it and the min / 10th percentile / median / 90th percentile
/ max time in microseconds after the first CTA started. Development aid (the kernel writes stamps
only when a trace buffer is given). The traced call is the last of three; warm by default (weights
may still sit in L2 from the call before), with --cold after the benchmark's L2 flush (256 MB
written), as `deep_gemm.bench` times it, with --cold-read after a flush that leaves L2 clean (256 MB
read), with --cold-code-warm after the flush and one untraced call on experts the traced call does
not use (its weights cold, the code warm).

--tasks runs the kernel variants built with the task log (DG_MEGA_MOE_TASK_LOG=1: the first 16 L1 /
L2 / combine tasks of each CTA, when the math read each from the ring, had its first L1 stage, ended
its K-loop and its epilogue, and when the producer ("P") put its ticket in the ring, had decoded it,
had its first stage free, had claimed it (B issued) and issued its first A tile) and prints, per task kind, the spread of those steps, the gaps
between a CTA's tasks and the CTAs that end last; also the first K-blocks of each CTA's last L1 task.
--tasks-light (DG_MEGA_MOE_TASK_LOG=2): the per-task stamps only (no per-K-block stamps: those of
--tasks slow the producer thread until it is the decode K-loop's slow side, so that its kernel runs
~25 % slower at v4-flash FP8 x FP4 n = 8; the light one runs at the untraced kernel's time,
docs/PERF.md session 21). Prebuild those variants with the same variable set. A weights-first call
(DG_MEGA_MOE_WEIGHTS_FIRST) with --tasks prints its stage log instead (print_ws_stage_log: the first
16 units of each CTA's first L1 and L2 chunks).
"""
import dataclasses
import os
import sys

if '--tasks' in sys.argv:   # read once per process, at the first kernel build
    os.environ['DG_MEGA_MOE_TASK_LOG'] = '1'
if '--tasks-light' in sys.argv:
    os.environ['DG_MEGA_MOE_TASK_LOG'] = '2'

import torch

from deep_gemm import _C
from deep_gemm.testing import moe_case as mc

SLOTS = ['start', 'counted', 'layout', 'pull end', 'L1 begin', 'L1 end', 'L2 begin', 'L2 end',
         'combine ready', 'combine end', 'exit', 'pull begin', 'L1 1st stage']
# The weights-first kernel's slots (WsTraceSlot in impls/sm90_mega_moe_ws.cuh; DG_MEGA_MOE_WEIGHTS_FIRST=1)
WS_SLOTS = ['start', 'routing', 'first issue', 'first stage', 'L1 consumed', 'L1 epilogue', 'L1 waited', 'h loaded',
            'L2 consumed', 'y written', 'exit']
MMA = {'fp8xfp4': 0, 'fp8xfp8': 1, 'bf16xbf16': 2}
NUM_SLOTS = _C.kTraceSlots   # per K-block stamps of the first L1 task: kTraceKbReady + kb, kTraceKbIssue + kb


def _other_experts(inputs, e):
    """The same tokens routed to experts none of `inputs` uses (each id shifted by the same offset)."""
    used = set(inputs.topk_idx[inputs.topk_idx >= 0].tolist())
    for shift in range(1, e):
        if not used & {(x + shift) % e for x in used}:
            idx = torch.where(inputs.topk_idx >= 0, (inputs.topk_idx + shift) % e, inputs.topk_idx)
            return dataclasses.replace(inputs, topk_idx=idx)
    raise ValueError('no disjoint expert set: too many experts routed')


INPUT_SEED = 1   # the traced call's routing and activations (tests/test_mega_moe_gpu.py rebuilds its routing)


def trace_case(fmt, h, i, e, k, n, reps=3, flush=None, code_warm=False):
    w = mc.make_weights(fmt, h, i, e, 1, seed=0)
    (buf,) = mc.make_buffers(fmt, 1, e, max(n, 1), k, h, i)
    inputs = mc.make_inputs(fmt, [n], h, e, k, seed=INPUT_SEED)
    # code_warm: after the flush, one untraced call on other experts, so the traced call finds the
    # kernel's code and parameters in L2 but its own weights cold
    other = _other_experts(inputs[0], e) if code_warm else None
    # a slot block per CTA: two an SM with the CTA pair (the analysis below reads the CTAs the call ran)
    buf._trace = torch.zeros(2 * _C.get_num_sms() * NUM_SLOTS, dtype=torch.int64, device='cuda')
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
    from deep_gemm.mega.launch import _max_smem
    ws = _C.get_mega_moe_kernel_variant(MMA[fmt], 1, e, k, h, i, n, _C.get_num_sms(), _max_smem(torch.device('cuda')))['weights_first']
    for s, name in enumerate(WS_SLOTS if ws else SLOTS):
        col = t[:, s]
        col = col[col > 0].double()
        if col.numel():
            col = (col - t0) / 1e3
            q = torch.quantile(col, torch.tensor([0.1, 0.9], dtype=col.dtype)).tolist()
            print(f'{name:>14}: {col.numel():4d} CTAs  min {col.min():8.2f}  p10 {q[0]:8.2f}  median {col.median():8.2f}  '
                  f'p90 {q[1]:8.2f}  max {col.max():8.2f} us')
    if ws:
        print_ws_stage_log(t, t0)
        return
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
        # task-log kernels: the same CTA's last L1 task, its first K-blocks: math ready, producer
        # stage free (empty wait done) and A issued, math released
        last = [(name, t[r, s:s + kb_slots]) for name, s in (('ready', _C.kTraceKbLastReady), ('stage free', _C.kTraceKbLastFree),
                                                              ('A issued', _C.kTraceKbLastIssue), ('released', _C.kTraceKbLastRelease))]
        if any((v > 0).any() for _, v in last):
            for name, v in last:
                print(f'  CTA {int(r)} last L1 task {name:>10}: {fmt_us(v)}')
    if os.environ.get('DG_MEGA_MOE_TASK_LOG') in ('1', '2'):
        print_task_log(t, t0)


def print_ws_stage_log(t, t0):
    """The weights-first kernel's stage log (its `_tasklog` variants, --tasks; kWsStageLog in
    impls/sm90_mega_moe_ws.cuh): per CTA the first 16 units of its first L1 chunk (issued, the math had
    it) and of its first L2 chunk (the producer had the stage free, issued it, the math had it and
    released it), for the CTAs whose chunk's first unit was ready first, at the median and last; then,
    over every logged CTA, the spread of issue -> ready and of the math's pace between units (us)."""
    kb = _C.kTraceKbSlots
    phases = (('L1', (('issued', _C.kTraceKbIssue), ('ready', _C.kTraceKbReady))),
              ('L2', (('stage free', _C.kTraceKbLastFree), ('issued', _C.kTraceKbLastIssue), ('ready', _C.kTraceKbLastReady),
                      ('released', _C.kTraceKbLastRelease))))
    fmt_us = lambda v: ' '.join(f'{(x - t0) / 1e3:6.2f}' if x > 0 else '     -' for x in v.tolist())
    for phase, rows in phases:
        cols = {name: t[:, s:s + kb] for name, s in rows}
        ready, issued = cols['ready'], cols['issued']
        ctas = (ready[:, 0] > 0).nonzero().flatten()
        if not ctas.numel():
            continue
        order = ctas[ready[ctas, 0].argsort()]
        for label, c in (('first', order[0]), ('median', order[order.numel() // 2]), ('last', order[-1])):
            for name, v in cols.items():
                print(f'  {phase} chunk, CTA {int(c):3d} ({label:>6}) {name:>10}: {fmt_us(v[c])}')
        both = (ready[ctas] > 0) & (issued[ctas] > 0)
        lat = ((ready[ctas] - issued[ctas]).double() / 1e3)[both]
        pace = (ready[ctas, 1:] - ready[ctas, :-1]).double() / 1e3
        pace = pace[(ready[ctas, 1:] > 0) & (ready[ctas, :-1] > 0)]
        if lat.numel():
            print(f'  {phase} issue -> ready:     {_quantiles(lat.tolist())} us')
        if pace.numel():
            print(f'  {phase} ready -> next ready: {_quantiles(pace.tolist())} us')


def _quantiles(v):
    v = torch.tensor(v, dtype=torch.float64)
    q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9], dtype=v.dtype)).tolist()
    return f'n {v.numel():5d}  min {v.min():7.2f}  p10 {q[0]:7.2f}  median {q[1]:7.2f}  p90 {q[2]:7.2f}  max {v.max():7.2f}'


def print_task_log(t, t0):
    """The task log of a DG_MEGA_MOE_TASK_LOG=1 or 2 kernel: per kind, the steps of a task (us). Slots
    and kinds as the kernel names them (TraceTaskStamp, TraceTaskKind in mega_moe_params.cuh)."""
    base, num, stamps = _C.kTraceTaskBase, _C.kTraceTasks, _C.kTraceTaskStamps
    S = _C.kTraceTaskStamp
    log = t[:, base:base + num * stamps].view(-1, num, stamps)
    us = lambda x: (x - t0) / 1e3
    kind_of = lambda e: _C.kTraceTaskKinds.get((e[S['id']] >> 32) & 0xff, '?')
    # (name, from stamp, to stamp): a step's span where both stamps were written
    spans = (('got -> 1st stage', 'got', 'first_stage'), ('got -> loop end', 'got', 'loop_end'), ('epilogue', 'loop_end', 'end'),
             ('task', 'got', 'end'), ('P ticket -> claim', 'ticket', 'claimed'), ('P ticket -> decoded', 'ticket', 'decoded'),
             ('P decoded -> free', 'decoded', 'stage_free'), ('P free -> claimed', 'stage_free', 'claimed'),
             ('P claim -> A', 'claimed', 'first_a'), ('P A -> 1st stage', 'first_a', 'first_stage'))
    steps, gaps, ends = {}, {}, []
    for c in range(log.shape[0]):
        entries = [e for e in log[c].tolist() if e[S['got']] > 0]
        for k, e in enumerate(entries):
            kind = kind_of(e)
            d = steps.setdefault(kind, {'begin': [], **{name: [] for name, _, _ in spans}, 'P ticket - prev loop end': []})
            d['begin'].append(us(e[S['got']]))
            for name, a, b in spans:
                if e[S[a]] > 0 and e[S[b]] > 0:
                    d[name].append((e[S[b]] - e[S[a]]) / 1e3)
            prev = entries[k - 1] if k > 0 else None
            if prev is not None and prev[S['end']] > 0:
                gaps.setdefault(f'{kind_of(prev)} -> {kind}', []).append((e[S['got']] - prev[S['end']]) / 1e3)
                if e[S['ticket']] > 0 and prev[S['loop_end']] > 0:   # < 0: the producer had this ticket before the math's last loop ended
                    d['P ticket - prev loop end'].append((e[S['ticket']] - prev[S['loop_end']]) / 1e3)
        if entries and entries[-1][S['end']] > 0:
            ends.append((us(entries[-1][S['end']]), c, entries))
    print(f'  task log ({sum(len(d["begin"]) for d in steps.values())} tasks; us):')
    for kind, d in steps.items():
        for name, v in d.items():
            if v:
                print(f'  {kind:>8} {name:>24}: {_quantiles(v)}')
    for name, v in sorted(gaps.items()):
        print(f'  gap {name:>19}: {_quantiles(v)}')
    ends.sort()
    if ends:
        print(f'  CTA last task end: {_quantiles([e[0] for e in ends])}')
        # Where a CTA's time goes (CTAs whose every task is in the log), medians over the CTAs
        last = ends[-1][0]
        budget = {k: [] for k in ('before its first task', 'L1 first-stage waits', 'K-loops', 'epilogues',
                                  'combine tasks', 'between tasks', 'after its last task')}
        span = lambda e, a, b: (e[S[b]] - e[S[a]]) / 1e3
        for end, c, entries in ends:
            if len(entries) >= num:
                continue
            gemm = [e for e in entries if kind_of(e) != 'combine' and e[S['loop_end']] > 0]
            wait = sum(span(e, 'got', 'first_stage') for e in entries if kind_of(e) == 'L1' and e[S['first_stage']] > 0)
            budget['before its first task'].append(us(entries[0][S['got']]))
            budget['L1 first-stage waits'].append(wait)
            budget['K-loops'].append(sum(span(e, 'got', 'loop_end') for e in gemm) - wait)
            budget['epilogues'].append(sum(span(e, 'loop_end', 'end') for e in gemm))
            budget['combine tasks'].append(sum(span(e, 'got', 'end') for e in entries if kind_of(e) == 'combine'))
            budget['between tasks'].append(sum((b[S['got']] - a[S['end']]) / 1e3 for a, b in zip(entries, entries[1:])))
            budget['after its last task'].append(last - end)
        if budget['K-loops']:
            print(f'  per CTA ({len(budget["K-loops"])} CTAs with every task logged; medians, us): ' +
                  ', '.join(f'{k} {torch.tensor(v).median().item():.1f}' for k, v in budget.items()))
    for end, c, entries in ends[-3:]:
        line = ' '.join(f'{kind_of(e)}[{e[S["id"]] & 0xffffffff}:{e[S["id"]] >> 40}r] '
                        f'{us(e[S["got"]]):.1f}-{us(e[S["end"]]) if e[S["end"]] else float("nan"):.1f}' for e in entries)
        print(f'  CTA {c} (ends {end:.1f}): {line}')


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
    args = [a for a in sys.argv[1:] if a not in ('--tasks', '--tasks-light')]
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
