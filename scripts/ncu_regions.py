"""Where the warp-stall samples of a `scripts/device_ncu.sh` report fall, by SASS region (CPU side).

    python scripts/ncu_regions.py [--top N] report.txt [start-end ...]

`report.txt` is one file device_ncu.sh writes under $OUT (its source page, after the line
"=== source", is every SASS instruction with its stall samples). Offsets are from the kernel's first
instruction, as cuobjdump prints them, so ranges read off a local SASS dump of the same cubin apply.
Prints the kernel's total samples and its top instructions, then per region (the GMMA loops found by
their back-edges, then each `start-end` given in hex) its share of the kernel's samples, its stall
reasons and its top instructions. Samples are where warps were seen, not where time goes: a loop's
share says how often its warps were sampled there, and a stall reason at an instruction is not by
itself a cost on the critical path (docs/PERF.md, session 22).
"""
import argparse
import collections
import csv
import io
import re


def load(path):
    """[(offset, sass, {stall reason: samples})] in address order."""
    text = open(path).read()
    if '=== source' not in text:
        raise SystemExit(f'{path}: no "=== source" section (not a scripts/device_ncu.sh report?)')
    src = text.split('=== source', 1)[1]
    rows = list(csv.DictReader(io.StringIO(src[src.index('"Address"'):])))
    keys = [k for k in rows[0] if k.startswith('stall_') and 'Not Issued' not in k]
    out = []
    for r in rows:
        try:
            addr = int(r['Address'], 16)
        except ValueError:
            continue
        out.append((addr, r['Source'].strip(), {k[len('stall_'):]: float(r[k].replace(',', '') or 0) for k in keys}))
    out.sort(key=lambda x: x[0])
    base = out[0][0]
    return [(a - base, s, v) for a, s, v in out], base


def gmma_loops(ins, base):
    """(start, end) of each innermost loop closed by a backward branch whose body holds a GMMA."""
    offsets = {a for a, _, _ in ins}
    loops = []
    for i, (a, s, _) in enumerate(ins):
        m = re.search(r'\bBRA\b.*?0x([0-9a-f]+)', s)
        if not m:
            continue
        target = int(m.group(1), 16) - base
        if target < a and target in offsets:
            body = [x for x in ins if target <= x[0] <= a]
            if any('GMMA' in x[1] for x in body):
                loops.append((target, a))
    loops = set(loops)
    # the K-loops themselves: no other GMMA loop inside (the task loops around them hold them all)
    inner = [r for r in loops if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in loops)]
    return sorted(inner)


def summarize(ins, lo, hi, total, top):
    part = [x for x in ins if lo <= x[0] <= hi]
    reasons = collections.Counter()
    for _, _, v in part:
        reasons.update(v)
    n = sum(reasons.values())
    print(f'{lo:#07x}-{hi:#07x}: {len(part)} instructions, {n:.0f} samples ({100 * n / max(total, 1):.1f} % of the kernel)')
    if n:
        print('    ' + ', '.join(f'{k} {100 * c / n:.1f} %' for k, c in reasons.most_common(8)))
        for a, s, v in sorted(part, key=lambda x: -sum(x[2].values()))[:top]:
            print(f'    {a:#07x} {100 * sum(v.values()) / n:5.1f} %  {max(v, key=v.get):16s} {s[:72]}')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--top', type=int, default=8, help='instructions listed per region')
    parser.add_argument('report')
    parser.add_argument('ranges', nargs='*', help='start-end offsets in hex (e.g. 0x117f0-0x12920)')
    args = parser.parse_args()
    ins, base = load(args.report)
    total = sum(sum(v.values()) for _, _, v in ins)
    print(f'{args.report}: {len(ins)} instructions, {total:.0f} samples')
    summarize(ins, 0, ins[-1][0], total, args.top)
    print('GMMA loops:')
    for lo, hi in gmma_loops(ins, base):
        summarize(ins, lo, hi, total, args.top)
    for r in args.ranges:
        lo, hi = (int(x, 16) for x in r.split('-'))
        summarize(ins, lo, hi, total, args.top)


if __name__ == '__main__':
    main()
