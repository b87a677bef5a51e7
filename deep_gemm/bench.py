"""`python -m deep_gemm.bench`: the Mega MoE kernel against a plain torch MoE, swept over token counts.

Per row: format, shape, tokens per rank n, fused kernel us (median of CUDA-graph replays, L2 flushed
before each), TFLOPS, HBM GB/s, % of roofline, the decode target, the baseline's us and the speedup
baseline / fused. The fused output checked against the baseline's is the timed replays' own.

    python -m deep_gemm.bench                          # every shape x format x token count
    python -m deep_gemm.bench --quick --json b.json --plot b.png
    python -m deep_gemm.bench --shapes mid --formats bf16xbf16 --tokens 1 128 --ep 4 --virtual
    python -m deep_gemm.bench --ep 8                    # 8 GPUs, one process each (v4-flash, 1..4096 tokens)

Definitions (all ranks' tokens together; `deep_gemm.testing.bench_utils` has the formulas):
    routed pairs   non-masked (token, slot) entries of topk_idx
    TFLOPS         2 * 3 * H * I * routed pairs / t
    HBM GB/s       (weights of the distinct experts touched + x, scales, routing, y) / t
    roofline       max(touched weight bytes / 4.0 TB/s, FLOPs / peak); peak 1450 TFLOPS FP8,
                   756 TFLOPS BF16 (H200, DESIGN.md §8); % of roofline = 100 * roofline / t
    tgt us         touched weight bytes / 4.0 TB/s + 10 us: DESIGN.md §8's decode target on one GPU
                   (JSON: target_us, meets_target)
    baseline       torch: route (sort by expert), grouped GEMM L1, SwiGLU, grouped GEMM L2,
                   weighted scatter-add, on the same weights, in a CUDA graph: FP8 block-scaled
                   where torch has it, else (FP8 x FP8, FP8 x FP4) FP8 re-quantized with a scale
                   per weight row and per token (torch's rowwise FP8 grouped GEMM), else BF16 on
                   the dequantized weights; the row's `baseline` column says which ran

--ep N > 1 with N GPUs visible runs N processes, one per GPU, over NVLink (symmetric memory), and
reports per rank also NVLink GB/s, against an all_to_all + grouped GEMM baseline
(`deep_gemm.testing.ep_bench` defines the columns); default shape v4-flash at 1 8 128 512 4096
tokens per rank. It also runs under `torchrun --nproc-per-node N -m deep_gemm.bench --ep N`.
--ep N --virtual (or --ep N with fewer than N GPUs, which says so) runs N virtual ranks on one GPU
(one launch per rank on its own stream, 1/N of the SMs each): it times the EP protocol, not NVLink.
Without an SM90 GPU the float32 torch reference runs on the CPU instead, so the command works (and
says so) on any machine.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from .testing.bench_utils import (DECODE_TARGET_SLACK_US, MMA_TYPES, PEAK_FLOPS, HBM_BYTES_PER_S, L2_FLUSH_BYTES, L2Flusher,
                                  MoEShape, TorchMoEBaseline, routing_counts, row_metrics, time_callable)
from .testing import ep_bench
from .testing.ep_bench import EP_SHAPES, EP_TOKENS

SHAPES: Dict[str, MoEShape] = {
    'deepseek-v3': MoEShape('deepseek-v3', 7168, 2048, 256, 8),
    'mid': MoEShape('mid', 2048, 768, 128, 8),
    'v4-flash': MoEShape('v4-flash', 4096, 2048, 256, 6),
    'small': MoEShape('small', 512, 256, 16, 4),   # the GPU tests' small shape (issue 3's "one small shape")
}
DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
DEFAULT_REPS = 30
# --quick: the device script's sweep, well under 2 minutes on an H200 including weight generation
QUICK_SHAPES = ('mid', 'v4-flash')
QUICK_TOKENS = (1, 128, 4096)
QUICK_FORMATS = ('fp8xfp8', 'bf16xbf16')
QUICK_REPS = 10

# The CPU fallback: small enough to finish in well under a second with the CPU torch wheel
CPU_SHAPE = MoEShape('cpu-small', 512, 256, 16, 4)
CPU_TOKENS = 64
CPU_REPS = 5
CPU_MESSAGE = 'No SM90 GPU: the fused kernel was NOT run; timed the float32 torch reference on the CPU instead.'

NOT_BUILT = 'not built yet'
# calc_diff(fused y, baseline y) above which a row is flagged: the formats' own quantization
# (FP8 activations vs the BF16 baseline) stays near 1e-3
DIFF_WARNING = 1e-2
SEED = 2024


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f'expected a positive integer, got {text}')
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line; --quick fills in whatever --shapes/--tokens/--formats/--reps left unset."""
    parser = argparse.ArgumentParser(
        prog='python -m deep_gemm.bench',
        description='Benchmark the fused Mega MoE kernel against a plain torch MoE on the same weights.')
    parser.add_argument('--shapes', nargs='+', choices=sorted(SHAPES), metavar='NAME',
                        help='model shapes (H/I/E/topk): ' +
                             ', '.join(f'{s.name} {s.hidden}/{s.intermediate}/{s.num_experts}/{s.num_topk}'
                                       for s in SHAPES.values()) + ' (default: all)')
    parser.add_argument('--tokens', nargs='+', type=_positive_int, metavar='N',
                        help=f'tokens per rank (default: {" ".join(map(str, DEFAULT_TOKENS))})')
    parser.add_argument('--formats', nargs='+', choices=MMA_TYPES, metavar='FORMAT',
                        help=f'weight formats: {", ".join(MMA_TYPES)} (default: all)')
    parser.add_argument('--quick', action='store_true',
                        help=f'short sweep: {" ".join(QUICK_SHAPES)}, tokens {" ".join(map(str, QUICK_TOKENS))}, '
                             f'{" ".join(QUICK_FORMATS)}, {QUICK_REPS} replays')
    parser.add_argument('--ep', type=_positive_int, default=1,
                        help='expert-parallel ranks (default 1); > 1: one process per GPU when N GPUs are '
                             'visible (default shapes ' + ' '.join(EP_SHAPES) + ', tokens ' +
                             ' '.join(map(str, EP_TOKENS)) + '), else virtual ranks on one GPU')
    parser.add_argument('--virtual', action='store_true',
                        help='with --ep N: N virtual ranks on one GPU even when N GPUs are visible')
    parser.add_argument('--reps', type=_positive_int, help=f'timed replays per row (default {DEFAULT_REPS})')
    parser.add_argument('--timeout', type=float, metavar='S',
                        help='with --ep N on N GPUs: terminate the N processes after S seconds (default: no limit); '
                             'rows finished by then stay in --json')
    parser.add_argument('--json', metavar='PATH', help='write every row and the run\'s metadata as JSON')
    parser.add_argument('--plot', metavar='PATH', help='write a PNG: latency and %% of roofline vs tokens')
    args = parser.parse_args(argv)
    quick = args.quick
    # --ep N on real GPUs defaults to the EP sweep (decode and prefill of the V4-Flash shape)
    real_ep = args.ep > 1 and not args.virtual and not quick
    args.shapes = list(args.shapes or (QUICK_SHAPES if quick else EP_SHAPES if real_ep else SHAPES))
    args.tokens = list(args.tokens or (QUICK_TOKENS if quick else EP_TOKENS if real_ep else DEFAULT_TOKENS))
    args.formats = list(args.formats or (QUICK_FORMATS if quick else MMA_TYPES))
    args.reps = args.reps or (QUICK_REPS if quick else DEFAULT_REPS)
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f'--timeout {args.timeout}: expected a positive number of seconds')
    for name in args.shapes:
        if SHAPES[name].num_experts % args.ep:
            parser.error(f'--ep {args.ep}: {name} has {SHAPES[name].num_experts} experts, not a multiple of {args.ep}')
    return args


def sm90_status() -> Optional[str]:
    """None if an SM90 GPU, its driver and CUDA torch are usable; else why not."""
    from . import _C
    if not torch.cuda.is_available():
        return f'torch {torch.__version__} sees no CUDA device'
    if not _C.has_cuda_driver():
        return 'the CUDA driver library could not be loaded'
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f'{torch.cuda.get_device_name()} is sm_{major}{minor}, the kernel needs sm_90'
    return None


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------

def make_row(mma_type: str, shape: MoEShape, n: int, ep: int, status: str = 'ok', **fields) -> Dict[str, object]:
    """A benchmark row with every key present (None where not measured)."""
    row: Dict[str, object] = dict(
        format=mma_type, shape=shape.name, hidden=shape.hidden, intermediate=shape.intermediate,
        experts=shape.num_experts, topk=shape.num_topk, ep=ep, n=n, tokens=n * ep, routed_pairs=None,
        experts_touched=None, fused_us=None, fused_timing=None, tflops=None, hbm_gbs=None, pct_roofline=None,
        roofline_us=None, target_us=None, meets_target=None, flops=None, weight_bytes=None, act_bytes=None,
        baseline=None, baseline_us=None,
        baseline_timing=None, speedup=None, diff=None, kernel=None, status=status, note='')
    unknown = set(fields) - set(row)
    if unknown:
        raise KeyError(f'unknown row fields: {sorted(unknown)}')
    row.update(fields)
    return row


def _fmt(value: object, digits: int = 1) -> str:
    if value is None:
        return '-'
    if isinstance(value, float):
        if math.isnan(value):
            return 'nan'
        return f'{value:.{digits}f}' if abs(value) < 1e5 else f'{value:.3g}'
    return str(value)


_COLUMNS = (  # header, key, digits, minimum width (so that rows printed one at a time line up)
    ('format', 'format', 0, 9), ('shape', 'shape', 0, 11), ('ep', 'ep', 0, 2), ('n', 'n', 0, 5),
    ('fused us', 'fused_us', 1, 8), ('TFLOPS', 'tflops', 1, 6), ('GB/s', 'hbm_gbs', 0, 5),
    ('% roof', 'pct_roofline', 1, 6), ('roof us', 'roofline_us', 1, 7), ('tgt us', 'target_us', 1, 7),
    ('base us', 'baseline_us', 1, 8),
    ('speedup', 'speedup', 2, 7), ('diff', 'diff', 0, 7), ('baseline', 'baseline', 0, 0),
)


def format_table(rows: Sequence[Dict[str, object]], header: bool = True) -> str:
    """Rows as an aligned text table; a row's status (if not ok), eager timings and note follow on a
    `^` line under it. `header=False` drops the header (widths then fit the rows only)."""
    cells = [[c[0] for c in _COLUMNS]]
    for row in rows:
        line = []
        for _, key, digits, _ in _COLUMNS:
            value = row.get(key)
            line.append(f'{value:.1e}' if key == 'diff' and isinstance(value, float) else _fmt(value, digits))
        cells.append(line)
    widths = [max([col[3]] + [len(c[i]) for c in cells]) for i, col in enumerate(_COLUMNS)]
    out = []
    for i, line in enumerate(cells):
        if i == 0 and not header:
            continue
        out.append('  '.join(c.rjust(w) if 2 <= j <= 12 else c.ljust(w) for j, (c, w) in enumerate(zip(line, widths)))
                   .rstrip())
        if i == 0:
            out.append('-' * len(out[-1]))
            continue
        row = rows[i - 1]
        extra = [str(row['status'])] if row.get('status') not in (None, 'ok') else []
        for who in ('fused', 'baseline'):
            how = row.get(f'{who}_timing')
            if how not in (None, 'graph'):
                extra.append(f'{who}: {how}')
        extra += [str(row['note'])] if row.get('note') else []
        if extra:
            out.append('    ^ ' + '; '.join(extra))
    return '\n'.join(out)


# --------------------------------------------------------------------------------------------------
# The GPU sweep
# --------------------------------------------------------------------------------------------------

def _error_text(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ''
    return f'{type(e).__name__}: {first[:160]}'


def _fused_launcher(fn, weights, buffers, ys, streams):
    """One call of every rank's kernel on already staged buffers (no staging, no sync)."""
    if len(buffers) == 1:
        l1, l2 = weights.per_rank[0]
        return lambda: fn(ys[0], l1, l2, buffers[0])

    def launch_all():
        streams.fork()
        for r, (buf, y) in enumerate(zip(buffers, ys)):
            with torch.cuda.stream(streams[r]):
                fn(y, *weights.per_rank[r], buf)
        streams.join()
    return launch_all


def _baseline_for(mma_type: str, weights) -> TorchMoEBaseline:
    """The torch baseline on the same weights: exact dequantized values, plus the FP8 ones to try
    torch's FP8 block-scaled grouped GEMM with."""
    fp8 = None
    if mma_type == 'fp8xfp8':
        from .mega.transform import inverse_transform_weights_for_mega_moe
        parts = [inverse_transform_weights_for_mega_moe(*lw) for lw in weights.per_rank]
        fp8 = tuple((torch.cat([p[layer][0] for p in parts]), torch.cat([p[layer][1] for p in parts]))
                    for layer in (0, 1))
    return TorchMoEBaseline(weights.l1_ref, weights.l2_ref, dtype=torch.bfloat16, fp8_weights=fp8,
                            weight_format=mma_type)


def kernel_name(mma_type: str, shape: MoEShape, n: int, ep: int, num_sms: int, max_smem: int, shares_gpu: bool) -> str:
    """The kernel variant a rank of n tokens launches (the C++ launcher's choice, its env overrides
    included): `sm90_mega_moe_<format>_m<BLOCK_M>_n<L2 width>_s<stages>_<fast|exact>` and the
    variant's suffixes (`_sig` signals thread, `_pair` CTA pair, `_w16` / `_w32` transposed tiles)."""
    from . import _C
    from .mega.buffer import mma_type_to_int
    return _C.get_mega_moe_kernel_variant(mma_type_to_int(mma_type), ep, shape.num_experts, shape.num_topk, shape.hidden,
                                          shape.intermediate, n, num_sms, max_smem, True, shares_gpu)['name']


def bench_row(mma_type: str, shape: MoEShape, n: int, ep: int, weights, buffers, baseline: TorchMoEBaseline,
              streams, reps: int, flush, seed: int) -> Dict[str, object]:
    """Time the fused kernel and the baseline on one fresh random routing of n tokens per rank."""
    from .mega import api as mega_api
    from .testing.moe_case import make_inputs, run_ranks
    from .testing.reference import calc_diff

    fn = mega_api.mega_moe_function(mma_type)
    inputs = make_inputs(mma_type, [n] * ep, shape.hidden, shape.num_experts, shape.num_topk, seed, device='cuda')
    pairs, touched = routing_counts([inp.topk_idx for inp in inputs])
    fields: Dict[str, object] = dict(routed_pairs=pairs, experts_touched=touched)
    notes: List[str] = []

    # Fused: stage + first call (JIT compile, warm-up) through run_ranks, then time launches only
    fused = None
    try:
        ys = run_ranks(weights, inputs, buffers, streams=streams)
        # y poisoned after the warm-up: the output checked below is the timed replays' own
        timing = time_callable(_fused_launcher(fn, weights, buffers, ys, streams), reps, flush,
                               try_graph=ep == 1, why_eager=f'{ep} virtual ranks on {ep} streams',
                               before_timing=lambda: [y.fill_(float('nan')) for y in ys])
        for buf in buffers:
            buf.check()
        fused = torch.cat(ys)
        fields.update(fused_us=timing.us, fused_timing=timing.how)
        buf = buffers[0]
        if torch.device(buf.device).type == 'cuda':   # rank 0's kernel (the JSON's `kernel`)
            from . import _C
            from .mega import launch
            num_sms = getattr(buf, 'num_sms', None) or _C.get_num_sms()   # as launch_mega_moe
            fields['kernel'] = kernel_name(mma_type, shape, n, ep, num_sms, launch._max_smem(torch.device(buf.device)),
                                           launch.ranks_share_gpu(buf))
    except NotImplementedError as e:
        fields['status'] = NOT_BUILT
        notes.append(_error_text(e))
    except Exception as e:  # noqa: BLE001 - report the failure in its row and go on with the sweep
        fields['status'] = 'error'
        notes.append(f'fused: {_error_text(e)}')

    # Baseline on all ranks' tokens at once (the same total work on one GPU)
    try:
        x = torch.cat([inp.x_q for inp in inputs])
        x_sf = None if inputs[0].x_sf is None else torch.cat([inp.x_sf for inp in inputs])
        idx = torch.cat([inp.topk_idx for inp in inputs])
        w = torch.cat([inp.topk_weights for inp in inputs])
        rejected = baseline.select(x, x_sf, idx, w)
        if rejected:
            notes.append(f'baseline fallback ({rejected})')
        timing = time_callable(lambda: baseline(x, x_sf, idx, w), reps, flush, try_graph=baseline.capturable,
                               why_eager='per-expert loop syncs the host')
        fields.update(baseline=baseline.describe(), baseline_us=timing.us, baseline_timing=timing.how)
        if fused is not None:
            fields['diff'] = diff = calc_diff(fused.float(), timing.output.float())
            if not diff < DIFF_WARNING:   # a wrong answer fails the run (its timing means nothing)
                fields['status'] = 'mismatch'
                notes.append(f'CHECK: fused and baseline outputs disagree (calc_diff {diff:.1e})')
    except Exception as e:  # noqa: BLE001
        notes.append(f'baseline: {_error_text(e)}')

    fused_us = fields.get('fused_us')
    fields.update((k, v) for k, v in row_metrics(mma_type, shape, n * ep, pairs, touched, fused_us).items())
    if fused_us and fields.get('baseline_us'):
        fields['speedup'] = fields['baseline_us'] / fused_us
    return make_row(mma_type, shape, n, ep, note='; '.join(notes), **fields)


def bench_format_shape(mma_type: str, shape: MoEShape, tokens: Sequence[int], ep: int, reps: int,
                       flush) -> List[Dict[str, object]]:
    """All token counts of one (format, shape): weights and buffers are made once, freed after."""
    from .testing.moe_case import make_buffers, make_weights
    from .testing.virtual_ranks import VirtualRankStreams

    start = time.perf_counter()
    try:
        weights = make_weights(mma_type, shape.hidden, shape.intermediate, shape.num_experts, ep, SEED,
                               device='cuda')
    except NotImplementedError as e:
        return [make_row(mma_type, shape, n, ep, status=NOT_BUILT, note=_error_text(e)) for n in tokens]
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: report and go on
        rows = [make_row(mma_type, shape, n, ep, status='error', note=f'weights: {_error_text(e)}') for n in tokens]
        del e
        _free_gpu_memory()
        return rows
    rows = []
    try:
        buffers = make_buffers(mma_type, ep, shape.num_experts, max(tokens), shape.num_topk, shape.hidden,
                               shape.intermediate)
        baseline = _baseline_for(mma_type, weights)
        streams = VirtualRankStreams(ep) if ep > 1 else None
        torch.cuda.synchronize()
        print(f'# {mma_type} {shape}: weights and buffers in {time.perf_counter() - start:.1f} s', flush=True)
        for i, n in enumerate(tokens):
            row = bench_row(mma_type, shape, n, ep, weights, buffers, baseline, streams, reps, flush,
                            seed=SEED + 1000 * i + n)
            print(format_table([row], header=False), flush=True)
            rows.append(row)
    except Exception as e:  # noqa: BLE001
        done = {r['n'] for r in rows}
        rows += [make_row(mma_type, shape, n, ep, status='error', note=_error_text(e)) for n in tokens
                 if n not in done]
    finally:
        weights = buffers = baseline = None
        _free_gpu_memory()
    return rows


def _free_gpu_memory() -> None:
    # The next (format, shape) needs the memory: deepseek-v3's BF16 weights, reference and kernel layout
    # take ~45 GB
    gc.collect()
    torch.cuda.empty_cache()


def run_gpu(args: argparse.Namespace) -> List[Dict[str, object]]:
    """The sweep: every shape x format x token count."""
    print(f'# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.reps} replays per timing, '
          f'L2 flushed (256 MB) before each', flush=True)
    if args.ep > 1:
        print(f'# --ep {args.ep}: {args.ep} VIRTUAL ranks on this one GPU (one launch per rank on its own stream, '
              f'1/{args.ep} of the SMs each), not {args.ep} GPUs; n is tokens per rank', flush=True)
    flush = L2Flusher(torch.device('cuda'))
    print(format_table([]), flush=True)
    rows: List[Dict[str, object]] = []
    for name in args.shapes:
        for mma_type in args.formats:
            rows += bench_format_shape(mma_type, SHAPES[name], args.tokens, args.ep, args.reps, flush)
    return rows


# --------------------------------------------------------------------------------------------------
# The CPU fallback
# --------------------------------------------------------------------------------------------------

def run_cpu_reference(reps: int = CPU_REPS) -> Dict[str, object]:
    """Time `deep_gemm.testing.reference_moe` (float32) on a small shape on the CPU; returns a row."""
    from .testing.moe_case import make_routing
    from .testing.reference import reference_moe

    s, n = CPU_SHAPE, CPU_TOKENS
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, s.hidden, generator=g)
    idx, w = make_routing(n, s.num_experts, s.num_topk, g, 'cpu')
    l1 = torch.randn(s.num_experts, 2 * s.intermediate, s.hidden, generator=g) / s.hidden ** 0.5
    l2 = torch.randn(s.num_experts, s.hidden, s.intermediate, generator=g) / s.intermediate ** 0.5
    # One thread: on a small problem more threads only add contention (40x slower on a busy 2-core box)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference_moe(x, idx, w, l1, l2)   # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            reference_moe(x, idx, w, l1, l2)
            times.append((time.perf_counter() - start) * 1e6)
    finally:
        torch.set_num_threads(threads)
    times.sort()
    t_us = times[len(times) // 2]
    pairs, touched = routing_counts([idx])
    metrics = row_metrics('bf16xbf16', s, n, pairs, touched, None)
    return make_row('fp32 reference (CPU)', s, n, 1, routed_pairs=pairs, experts_touched=touched,
                    baseline='deep_gemm.testing.reference_moe', baseline_us=t_us, baseline_timing='eager: CPU',
                    flops=metrics['flops'], note=f'fused kernel NOT run; median of {reps} runs, float32, 1 CPU thread')


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------

def run_metadata(argv: Optional[Sequence[str]], mode: str, reps: Optional[int] = None) -> Dict[str, object]:
    """What the JSON records about the run besides its rows (`reps`: the timed replays per row, where timed)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(mode=mode, gpu=gpu, torch=torch.__version__, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
                command=' '.join(['python -m deep_gemm.bench', *(sys.argv[1:] if argv is None else argv)]),
                hbm_bytes_per_s=HBM_BYTES_PER_S, peak_flops=dict(PEAK_FLOPS), decode_target_slack_us=DECODE_TARGET_SLACK_US,
                reps=reps, l2_flush_bytes=L2_FLUSH_BYTES)


def write_json(path: str, rows: Sequence[Dict[str, object]], meta: Dict[str, object]) -> None:
    """Write {**meta, "rows": rows} to `path` (NaN/inf written as null)."""
    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v
    data = dict(meta, rows=[{k: clean(v) for k, v in row.items()} for row in rows])
    with open(path, 'w') as f:
        json.dump(data, f, indent=1)
        f.write('\n')


def plot_rows(rows: Sequence[Dict[str, object]], path: str, title: str = '') -> bool:
    """PNG with two panels: latency vs tokens (log-log, fused solid, baseline dashed) and % of roofline
    vs tokens, one colour per (format, shape). Returns False (with a note) if matplotlib is missing or
    there is nothing to plot."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print(f'# matplotlib is not installed: no plot written to {path} (pip install matplotlib)')
        return False
    series: Dict[str, List[Dict[str, object]]] = {}
    for row in rows:
        # a row whose output was wrong (or that raised) has no performance to show
        if row.get('status') == 'ok' and (row.get('fused_us') or row.get('baseline_us')):
            series.setdefault(f'{row["format"]} {row["shape"]}', []).append(row)
    if not series:
        print(f'# nothing was timed: no plot written to {path}')
        return False
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 5))
    for i, (label, group) in enumerate(sorted(series.items())):
        group = sorted(group, key=lambda r: r['n'])
        color = f'C{i % 10}'
        for key, style, suffix in (('fused_us', '-o', 'fused'), ('baseline_us', '--x', 'torch')):
            pts = [(r['n'], r[key]) for r in group if r.get(key)]
            if pts:
                ax_t.plot(*zip(*pts), style, color=color, label=f'{label} {suffix}')
        pts = [(r['n'], r['pct_roofline']) for r in group if r.get('pct_roofline') is not None]
        if pts:
            ax_r.plot(*zip(*pts), '-o', color=color, label=label)
    ax_t.set(xscale='log', yscale='log', xlabel='tokens per rank', ylabel='latency (us)',
             title='latency: fused (solid) vs torch baseline (dashed)')
    top = max([105.0] + [float(r['pct_roofline']) + 5 for r in rows if r.get('pct_roofline') is not None])
    ax_r.set(xscale='log', xlabel='tokens per rank', ylabel='% of roofline', ylim=(0, top),
             title='fused kernel, % of roofline')
    for ax in (ax_t, ax_r):
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m deep_gemm.bench`: the sweep (or, without an SM90 GPU, the CPU reference row), the table,
    optional JSON and plot. Returns the exit status: 1 when a row raised or mismatched."""
    args = parse_args(argv)
    if args.ep > 1:
        ep_bench.select_torchrun_device()
    why_not = sm90_status()
    if why_not is not None:
        row = run_cpu_reference()
        print(f'# {why_not}')
        print(format_table([row]))
        print(f'float32 torch reference, {CPU_SHAPE}, n = {CPU_TOKENS}: {row["baseline_us"]:.0f} us (CPU)')
        print(CPU_MESSAGE)
        rows, mode = [row], 'cpu-reference'
    elif args.ep > 1 and not args.virtual and ep_bench.real_ep_available(args.ep):
        # One process per GPU: rank 0 prints the tables and writes the JSON and plot
        return ep_bench.run(args, argv)
    else:
        if args.ep > 1 and not args.virtual:
            print(f'# --ep {args.ep}: only {torch.cuda.device_count()} GPU(s) visible, fewer than {args.ep}: '
                  f'falling back to {args.ep} virtual ranks on one GPU (--virtual asks for this mode)', flush=True)
        rows, mode = run_gpu(args), 'gpu'
        print()
        print(format_table(rows))
    if args.json:
        write_json(args.json, rows, run_metadata(argv, mode, args.reps if mode == 'gpu' else None))
        print(f'# wrote {args.json}')
    if args.plot:
        if mode == 'gpu' and plot_rows(rows, args.plot, title=run_metadata(argv, mode)['gpu'] or ''):
            print(f'# wrote {args.plot}')
        elif mode != 'gpu':
            print(f'# no GPU rows: no plot written to {args.plot}')
    failed = [r for r in rows if r['status'] in ('error', 'mismatch')]
    if failed:
        print(f'# {len(failed)} row(s) failed: ' + ', '.join(f"{r['format']} {r['shape']} n={r['n']} ({r['status']})" for r in failed))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
