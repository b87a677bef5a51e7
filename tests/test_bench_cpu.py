"""The benchmark CLI (`python -m deep_gemm.bench`) and its helpers, on the CPU.

What only an H200 run can check (kernel timings, CUDA-graph capture of the kernel and of torch's
grouped GEMM, the FP8 scaled grouped GEMM path) is covered by the two small GPU tests at the end and
by running `python -m deep_gemm.bench --quick` on the device.
"""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, sm90_gpu_available

from deep_gemm import bench
from deep_gemm.testing import bench_utils as bu
from deep_gemm.testing import calc_diff, moe_case, reference_moe
from deep_gemm.utils import dequant_per_block_fp8, dequant_per_token_fp8, per_block_cast_to_fp8, per_token_cast_to_fp8

# calc_diff bounds (~ relative error^2 / 2). BF16_TOL: the baseline against the float32 reference
# differs by BF16 roundings of x, h and y (relative error rms ~1.6e-3 each: ~1.3e-6 apiece, ~4e-6 in
# all); 1e-4 leaves 25x. FP8_TOL: one E4M3 rounding of h more (the scaled path re-quantizes it per
# token, as the kernel's emulation does; relative error rms ~2.6e-2: ~3.4e-4); 1e-3 leaves ~3x.
# A real mismatch (a wrong expert, scale or gate/up row) is 1e-2 or more.
BF16_TOL = 1e-4
FP8_TOL = 1e-3
# the rowwise FP8 baseline re-quantizes x, the weights and h (three E4M3 roundings: 1.9e-3 measured
# on this file's problem): its selection bound, 5e-3
ROWWISE_TOL = 5e-3


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def test_parse_args_defaults():
    args = bench.parse_args([])
    assert args.shapes == ['deepseek-v3', 'mid', 'v4-flash', 'small']
    assert args.tokens == [1, 8, 32, 128, 512, 2048, 8192]
    assert args.formats == ['fp8xfp8', 'bf16xbf16', 'fp8xfp4']
    assert (args.ep, args.reps, args.quick, args.json, args.plot) == (1, bench.DEFAULT_REPS, False, None, None)


def test_parse_args_quick_and_overrides():
    args = bench.parse_args(['--quick'])
    assert args.shapes == ['mid', 'v4-flash'] and args.tokens == [1, 128, 4096]
    assert args.formats == ['fp8xfp8', 'bf16xbf16'] and args.reps == bench.QUICK_REPS
    # Anything given explicitly wins over --quick
    args = bench.parse_args(['--quick', '--tokens', '2', '64', '--formats', 'fp8xfp4', '--reps', '3',
                             '--json', 'a.json', '--plot', 'a.png', '--ep', '4'])
    assert args.tokens == [2, 64] and args.formats == ['fp8xfp4'] and args.reps == 3
    assert args.shapes == ['mid', 'v4-flash'] and args.ep == 4
    assert (args.json, args.plot) == ('a.json', 'a.png')


@pytest.mark.parametrize('argv', [['--shapes', 'llama'], ['--formats', 'fp16'], ['--tokens', '0'],
                                  ['--tokens', 'x'], ['--ep', '0'], ['--ep', '3'], ['--shapes', 'mid', '--ep', '256']])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


# --------------------------------------------------------------------------------------------------
# FLOPs, bytes, roofline (numbers computed by hand)
# --------------------------------------------------------------------------------------------------

def test_weight_bytes_per_expert():
    # H = 256, I = 128: 3 * H * I = 98304 elements; 128x128 blocks: L1 (256/128) * (256/128) = 4, L2 2 * 1 = 2
    assert bu.weight_bytes_per_expert('fp8xfp8', 256, 128) == 98304 + 4 * 6
    assert bu.weight_bytes_per_expert('bf16xbf16', 256, 128) == 2 * 98304
    # FP4: half a byte per element + one delta byte per 32 of K + the float32 block scales
    assert bu.weight_bytes_per_expert('fp8xfp4', 256, 128) == 49152 + 3072 + 24
    # v4-flash: 3 * 4096 * 2048 = 25165824 bytes + (32 * 32 + 32 * 16) * 4 = 6144 bytes of scales
    assert bu.weight_bytes_per_expert('fp8xfp8', 4096, 2048) == 25171968
    with pytest.raises(ValueError, match='mma_type'):
        bu.weight_bytes_per_expert('fp16', 256, 128)


def test_activation_bytes_and_flops():
    # fp8: x 4096 + sf 32 * 4 + routing 6 * 12 + y 2 * 4096 per token
    assert bu.activation_bytes('fp8xfp8', 1, 4096, 6) == 4096 + 128 + 72 + 8192
    assert bu.activation_bytes('fp8xfp4', 3, 4096, 6) == 3 * 12488
    assert bu.activation_bytes('bf16xbf16', 2, 2048, 8) == 2 * (4096 + 96 + 4096)
    assert bu.moe_flops(4096, 2048, 6) == 301989888
    assert bu.moe_flops(4096, 2048, 0) == 0


def test_roofline_decode_is_memory_bound():
    # v4-flash fp8, one token, 6 experts: 6 * 25171968 B / 4e12 B/s = 37.757952 us (FLOPs: 0.21 us)
    assert bu.roofline_us('fp8xfp8', 6 * 25171968, 301989888) == pytest.approx(37.757952)
    m = bu.row_metrics('fp8xfp8', bench.SHAPES['v4-flash'], 1, 6, 6, 2 * 37.757952)
    assert m['weight_bytes'] == 151031808 and m['act_bytes'] == 12488 and m['flops'] == 301989888
    assert m['pct_roofline'] == pytest.approx(50.0)
    assert m['tflops'] == pytest.approx(301989888 / 75.515904e-6 / 1e12)   # 3.999
    assert m['hbm_gbs'] == pytest.approx(2000.0 + 12488 / 75.515904e-6 / 1e9)
    # Not timed: only the time-free quantities
    m = bu.row_metrics('fp8xfp8', bench.SHAPES['v4-flash'], 1, 6, 6, None)
    assert m['tflops'] is None and m['pct_roofline'] is None and m['roofline_us'] == pytest.approx(37.757952)
    assert m['meets_target'] is None


def test_decode_target():
    # DESIGN.md §8: weight bytes / 4.0 TB/s + 10 us; v4-flash fp8, one token, 6 experts: 47.757952 us
    s = bench.SHAPES['v4-flash']
    assert bu.row_metrics('fp8xfp8', s, 1, 6, 6, None)['target_us'] == pytest.approx(47.757952)
    assert bu.row_metrics('fp8xfp8', s, 1, 6, 6, 47.7)['meets_target'] is True
    assert bu.row_metrics('fp8xfp8', s, 1, 6, 6, 47.8)['meets_target'] is False
    # mid fp8, one token, 8 experts of 4,719,744 bytes: 19.44 us (issue 3's mid one-token bar is 2x the floor: 18.9)
    assert bu.row_metrics('fp8xfp8', bench.SHAPES['mid'], 1, 8, 8, None)['target_us'] == pytest.approx(8 * 4719744 / 4e6 + 10)


def test_roofline_prefill_is_compute_bound():
    # deepseek-v3 at 8192 tokens, every expert: 6 * 7168 * 2048 * 65536 FLOPs / 1450e12 = 3981 us (DESIGN.md §8)
    # > 256 * 44050944 B / 4e12 = 2819 us
    s = bench.SHAPES['deepseek-v3']
    m = bu.row_metrics('fp8xfp8', s, 8192, 65536, 256, 3981.0)
    assert m['flops'] == 5772436045824 and m['weight_bytes'] == 256 * 44050944
    assert m['roofline_us'] == pytest.approx(3980.99, abs=0.01)
    assert m['pct_roofline'] == pytest.approx(100.0, abs=0.01)
    assert m['tflops'] == pytest.approx(1450.0, rel=1e-5)
    # BF16: 756 TFLOPS -> 7635.5 us, still above the 5637.1 us of its 2-byte weights
    assert bu.row_metrics('bf16xbf16', s, 8192, 65536, 256, None)['roofline_us'] == pytest.approx(7635.50, abs=0.01)


def test_routing_counts():
    rank0 = torch.tensor([[0, 3, -1], [3, 5, 1]])
    rank1 = torch.tensor([[-1, -1, -1], [7, 0, 2]])
    assert bu.routing_counts([rank0, rank1]) == (8, 6)
    assert bu.routing_counts([rank1[:1]]) == (0, 0)
    assert bu.routing_counts([]) == (0, 0)


def test_route_sorts_by_expert_masked_last():
    r = bu.route(torch.tensor([[2, 0], [-1, 2]]), torch.tensor([[0.5, 0.25], [0.125, 1.0]]), num_experts=3)
    assert r.token_of_row.tolist() == [0, 0, 1, 1]
    assert r.weight_of_row.tolist() == [0.25, 0.5, 1.0, 0.125]
    assert r.valid_row.tolist() == [True, True, True, False]
    assert r.counts.tolist() == [1, 0, 2] and r.offs.tolist() == [1, 1, 3] and r.offs.dtype == torch.int32


# --------------------------------------------------------------------------------------------------
# The torch baseline against the float32 reference
# --------------------------------------------------------------------------------------------------

E, H, I, TOPK, N = 8, 256, 128, 3, 24


def _problem(seed=0, mask_frac=0.25):
    g = torch.Generator().manual_seed(seed)
    l1 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    l2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    x = torch.randn(N, H, generator=g)
    idx, w = moe_case.make_routing(N, E, TOPK, g, 'cpu', mask_frac=mask_frac)
    idx[0] = -1   # one token with every slot masked: its row of y must be 0
    return l1, l2, x, idx, w


@pytest.mark.parametrize('mode', [bu.GEMM_GROUPED, bu.GEMM_LOOP])
def test_baseline_float32_matches_reference(mode):
    l1, l2, x, idx, w = _problem()
    y = bu.TorchMoEBaseline(l1, l2, dtype=torch.float32).forward(x, None, idx, w, mode)
    ref = reference_moe(x, idx, w, l1, l2)
    assert y.dtype == torch.bfloat16 and y.shape == (N, H)
    # The only rounding is y's BF16 (relative 2^-9)
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-6)
    assert bool((y[0] == 0).all())


def test_baseline_bf16_and_fp8_inputs():
    l1, l2, x, idx, w = _problem(seed=1)
    ref = reference_moe(x, idx, w, l1, l2)
    y = bu.TorchMoEBaseline(l1, l2)(x.bfloat16(), None, idx, w)
    assert calc_diff(y.float(), ref) < BF16_TOL
    # FP8 activations are dequantized inside the call: same as the reference on the dequantized x
    x_q, x_sf = per_token_cast_to_fp8(x)
    y = bu.TorchMoEBaseline(l1, l2, dtype=torch.float32)(x_q, x_sf, idx, w)
    torch.testing.assert_close(y.float(), reference_moe(dequant_per_token_fp8(x_q, x_sf), idx, w, l1, l2),
                               rtol=2 ** -8, atol=1e-6)


def test_baseline_select_prefers_grouped_mm():
    l1, l2, x, idx, w = _problem()
    b = bu.TorchMoEBaseline(l1, l2)
    assert b.select(x.bfloat16(), None, idx, w) == ''
    assert b.mode == bu.GEMM_GROUPED and b.capturable
    assert b.describe() == 'torch grouped_mm bf16'


def test_baseline_select_falls_back_to_loop(monkeypatch):
    l1, l2, x, idx, w = _problem()

    def broken(*args, **kwargs):
        raise RuntimeError('grouped_mm is not available\nsecond line')
    monkeypatch.setattr(torch, '_grouped_mm', broken)
    b = bu.TorchMoEBaseline(l1, l2, weight_format='fp8xfp8')
    note = b.select(x.bfloat16(), None, idx, w)
    assert b.mode == bu.GEMM_LOOP and not b.capturable
    # the rowwise FP8 path (a quantized format) has no CPU kernel either
    assert note.startswith('scaled_grouped_mm rowwise: ')
    assert note.endswith('; grouped_mm: RuntimeError: grouped_mm is not available')
    assert b.describe() == 'torch matmul loop bf16 (dequantized fp8 weights)'
    assert calc_diff(b(x.bfloat16(), None, idx, w).float(), reference_moe(x, idx, w, l1, l2)) < BF16_TOL
    # A broken strategy is not tried again
    assert b.select(x.bfloat16(), None, idx, w) == 'scaled_grouped_mm rowwise unsupported here; grouped_mm unsupported here'


def test_baseline_select_rejects_wrong_results(monkeypatch):
    l1, l2, x, idx, w = _problem()
    monkeypatch.setattr(torch, '_grouped_mm', lambda a, b, offs: torch.zeros(a.shape[0], b.shape[-1], dtype=a.dtype))
    b = bu.TorchMoEBaseline(l1, l2)
    assert b.select(x.bfloat16(), None, idx, w).startswith('grouped_mm: wrong result')
    assert b.mode == bu.GEMM_LOOP


def test_baseline_fp8_weights():
    # The scaled FP8 path is tried first; on the CPU torch has no kernel for it, so grouped_mm runs on the
    # dequantized weights. Either way the result must be right.
    l1, l2, x, idx, w = _problem(seed=2)
    q1, q2 = per_block_cast_to_fp8(l1), per_block_cast_to_fp8(l2)
    d1, d2 = dequant_per_block_fp8(*q1), dequant_per_block_fp8(*q2)
    x_q, x_sf = per_token_cast_to_fp8(x)
    b = bu.TorchMoEBaseline(d1, d2, fp8_weights=(q1, q2), weight_format='fp8xfp8')
    note = b.select(x_q, x_sf, idx, w)
    assert b.mode in (bu.GEMM_SCALED, bu.GEMM_ROWWISE, bu.GEMM_GROUPED)
    if b.mode == bu.GEMM_GROUPED:
        assert note.startswith('scaled_grouped_mm: ') and b.fp8_weights is None
    ref = reference_moe(dequant_per_token_fp8(x_q, x_sf), idx, w, d1, d2)
    assert calc_diff(b(x_q, x_sf, idx, w).float(), ref) < (ROWWISE_TOL if b.mode == bu.GEMM_ROWWISE else FP8_TOL)


def test_rowwise_cast_to_fp8():
    t = torch.randn(3, 5, 256) * torch.logspace(-3, 3, 5)[None, :, None]
    t[1, 2] = 0.0
    q, scale = bu.rowwise_cast_to_fp8(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 5) and scale.dtype == torch.float32
    assert scale[1, 2] == 1.0 and bool((q[1, 2].float() == 0).all())
    back = q.float() * scale[..., None]
    # each row's largest magnitude maps to 448; E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 of a
    # normal value, and values below 2^-6 x scale (subnormals) are within 2^-10 x scale
    err = (back - t).abs()
    assert bool((err <= 2 ** -4 * t.abs() + 2 ** -10 * scale[..., None]).all())
    assert torch.allclose(q.float().abs().amax(-1)[scale != 1.0], torch.tensor(448.0))


def _emulated_scaled_grouped_mm(a_q, b_q, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    # torch's rowwise FP8 grouped GEMM as defined (2-D a, 3-D b [E, K, N], groups of a's rows ending at
    # offs): out[m, :] = scale_a[m] * (a_q[m] @ b_q[e]) * scale_b[e], in float32
    out = torch.zeros(a_q.shape[0], b_q.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = (a_q[start:end].float() @ b_q[e].float()) * scale_a[start:end, None] * scale_b[e][None, :]
        start = end
    return out.to(out_dtype)


@pytest.mark.parametrize('weight_format', ['fp8xfp8', 'fp8xfp4'])
def test_baseline_rowwise_fp8_path(monkeypatch, weight_format):
    # Where torch has an FP8 rowwise grouped GEMM (SM90) and not the block-scaled one, a quantized
    # format's baseline runs FP8 re-quantized per weight row and per token; emulated here with
    # torch's definition of the op: the result must match the reference within three E4M3 roundings
    l1, l2, x, idx, w = _problem(seed=3)
    q1, q2 = per_block_cast_to_fp8(l1), per_block_cast_to_fp8(l2)
    d1, d2 = dequant_per_block_fp8(*q1), dequant_per_block_fp8(*q2)
    x_q, x_sf = per_token_cast_to_fp8(x)
    monkeypatch.setattr(torch, '_scaled_grouped_mm', _emulated_scaled_grouped_mm, raising=False)
    b = bu.TorchMoEBaseline(d1, d2, dtype=torch.float32, weight_format=weight_format)
    note = b.select(x_q, x_sf, idx, w)
    assert b.mode == bu.GEMM_ROWWISE, note
    assert 'scaled_grouped_mm rowwise chosen (calc_diff ' in note
    assert b.describe() == f'torch scaled_grouped_mm fp8 rowwise (re-quantized {weight_format.split("x")[1]} weights)'
    ref = reference_moe(dequant_per_token_fp8(x_q, x_sf), idx, w, d1, d2)
    d = calc_diff(b(x_q, x_sf, idx, w).float(), ref)
    assert 1e-5 < d < ROWWISE_TOL, d   # quantized (not the float path) and close
    # BF16 weights never take it
    bf16 = bu.TorchMoEBaseline(d1, d2, dtype=torch.float32)
    bf16.select(x.bfloat16(), None, idx, w)
    assert bf16.mode == bu.GEMM_GROUPED


def test_baseline_rejects_mismatched_weights():
    with pytest.raises(ValueError, match='do not match'):
        bu.TorchMoEBaseline(torch.zeros(2, 256, 128), torch.zeros(2, 128, 64))


# --------------------------------------------------------------------------------------------------
# Timing fallbacks (the CUDA parts are replaced by stand-ins)
# --------------------------------------------------------------------------------------------------

def test_time_callable_falls_back_to_eager(monkeypatch):
    calls = []

    def no_capture(fn):
        raise RuntimeError('operation not permitted when stream is capturing')
    monkeypatch.setattr(bu, 'capture_graph', no_capture)
    monkeypatch.setattr(bu, 'event_median_us', lambda run, reps, flush: [run() for _ in range(reps)] and 12.5)
    t = bu.time_callable(lambda: calls.append(1) or len(calls), reps=4, flush=None)
    assert t.us == 12.5 and t.output == 5   # one warm-up + 4 timed calls, the last output kept
    assert t.how == 'eager: capture failed: RuntimeError: operation not permitted when stream is capturing'
    t = bu.time_callable(lambda: 7, reps=2, flush=None, try_graph=False, why_eager='loop')
    assert (t.how, t.output) == ('eager: loop', 7)


def test_time_callable_uses_the_graph(monkeypatch):
    replays = []

    class FakeGraph:
        def replay(self):
            replays.append(1)
    monkeypatch.setattr(bu, 'capture_graph', lambda fn: (FakeGraph(), 'out'))
    monkeypatch.setattr(bu, 'event_median_us', lambda run, reps, flush: [run() for _ in range(reps)] and 3.0)
    t = bu.time_callable(lambda: None, reps=6, flush=None)
    assert (t.us, t.how, t.output, len(replays)) == (3.0, 'graph', 'out', 6)


# --------------------------------------------------------------------------------------------------
# Rows, table, JSON, plot
# --------------------------------------------------------------------------------------------------

def _fake_rows():
    s = bench.SHAPES['mid']
    rows = []
    for n, fused, base in ((1, 20.0, 60.0), (128, 150.0, 300.0), (4096, 900.0, 2500.0)):
        m = bu.row_metrics('fp8xfp8', s, n, n * 8, min(128, n * 8), fused)
        rows.append(bench.make_row('fp8xfp8', s, n, 1, routed_pairs=n * 8, experts_touched=min(128, n * 8),
                                   fused_us=fused, fused_timing='graph', baseline='torch grouped_mm bf16',
                                   baseline_us=base, baseline_timing='graph', speedup=base / fused, diff=4e-4, **m))
    rows.append(bench.make_row('fp8xfp4', s, 1, 1, status=bench.NOT_BUILT, note='NotImplementedError: issue 4'))
    return rows


def test_make_row_has_every_key():
    row = bench.make_row('bf16xbf16', bench.SHAPES['v4-flash'], 8, 2)
    assert (row['tokens'], row['hidden'], row['experts'], row['status'], row['fused_us']) == (16, 4096, 256, 'ok', None)
    with pytest.raises(KeyError, match='fused_ms'):
        bench.make_row('bf16xbf16', bench.SHAPES['mid'], 8, 1, fused_ms=1.0)


def test_format_table():
    rows = _fake_rows()
    text = bench.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ['format', 'shape', 'ep', 'n', 'fused', 'us']
    assert set(lines[1]) == {'-'}
    assert 'fp8xfp8' in lines[2] and '20.0' in lines[2] and '3.00' in lines[2] and '4.0e-04' in lines[2]
    assert lines[-2].startswith('fp8xfp4') and ' - ' in lines[-2]
    assert lines[-1] == '    ^ not built yet; NotImplementedError: issue 4'
    assert bench.format_table(rows[:1], header=False).splitlines()[0].startswith('fp8xfp8')
    assert len(bench.format_table([]).splitlines()) == 2


def test_write_json(tmp_path):
    rows = _fake_rows()
    rows[0]['diff'] = float('nan')
    path = tmp_path / 'bench.json'
    bench.write_json(str(path), rows, bench.run_metadata(['--quick'], 'gpu'))
    data = json.loads(path.read_text())
    assert data['mode'] == 'gpu' and data['torch'] == torch.__version__
    assert data['command'] == 'python -m deep_gemm.bench --quick' and data['date']
    assert 'gpu' in data and data['peak_flops']['bf16xbf16'] == 756e12
    assert len(data['rows']) == 4 and data['rows'][0]['diff'] is None
    assert data['rows'][1]['fused_us'] == 150.0 and data['rows'][3]['status'] == 'not built yet'


def test_plot(tmp_path):
    pytest.importorskip('matplotlib')
    path = tmp_path / 'bench.png'
    assert bench.plot_rows(_fake_rows(), str(path), title='fake')
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert not bench.plot_rows(_fake_rows()[-1:], str(tmp_path / 'empty.png'))


def test_not_built_formats_become_rows(monkeypatch):
    # A format whose kernel raises NotImplementedError becomes 'not built yet' rows, not a crash

    def not_yet(mma_type, *args, **kwargs):
        raise NotImplementedError(f'{mma_type}: test weights for this format land with its kernel (issue 4)')
    monkeypatch.setattr(moe_case, 'make_weights', not_yet)
    rows = bench.bench_format_shape('fp8xfp4', bench.SHAPES['mid'], [1, 128], 1, 3, None)
    assert [(r['n'], r['status']) for r in rows] == [(1, 'not built yet'), (128, 'not built yet')]
    assert 'issue 4' in rows[0]['note']


def _cpu_sweep(monkeypatch, mma_type, ep, corrupt=None, replays_write=True):
    # The GPU sweep (weights, virtual-rank buffers, staging, fused + baseline timing, row metrics) run on
    # the CPU: the kernel is replaced by the emulating reference (through `corrupt`, if given) and
    # CUDA timing by a fixed number. Returns the rows and the launches the stand-in saw. The timing
    # stand-in runs the launcher, then `before_timing` (the sweep poisons y there), then the launcher
    # again as the timed run; `replays_write=False`: the launcher writes nothing (a broken replay).
    from deep_gemm.mega import api
    from deep_gemm.testing import virtual_ranks

    make_weights, make_inputs = moe_case.make_weights, moe_case.make_inputs
    monkeypatch.setattr(moe_case, 'make_weights', lambda *a, device, **k: make_weights(*a, device='cpu', **k))
    monkeypatch.setattr(moe_case, 'make_inputs', lambda *a, device, **k: make_inputs(*a, device='cpu', **k))
    monkeypatch.setattr(moe_case, 'make_buffers', lambda t, r, e, n, k, h, i: virtual_ranks.make_virtual_ranks(
        r, e, n, k, h, i, t, device='cpu'))
    corrupt = corrupt or (lambda y: y)
    answers = {}   # each y's answer, which a launch writes into it again

    def run_ranks(weights, inputs, buffers, streams):
        ys = [corrupt(moe_case.reference(weights, inp).bfloat16()) for inp in inputs]
        answers.update((id(y), y.clone()) for y in ys)
        return ys
    monkeypatch.setattr(moe_case, 'run_ranks', run_ranks)
    launches = []

    def launch(y, *rest):
        launches.append((y, *rest))
        if replays_write:
            y.copy_(answers[id(y)])
    monkeypatch.setattr(api, 'bf16_mega_moe', launch)
    monkeypatch.setattr(api, 'fp8_mega_moe', launch)

    def time_callable(fn, reps, flush, try_graph, why_eager, before_timing=None):
        fn()
        if before_timing is not None:
            before_timing()
        return bu.Timing(10.0, 'graph' if try_graph else f'eager: {why_eager}', fn())
    monkeypatch.setattr(bench, 'time_callable', time_callable)

    class Streams:
        def __init__(self, n):
            self.n = n

        def fork(self):
            pass
        join = fork

        def __getitem__(self, r):
            return None
    monkeypatch.setattr(virtual_ranks, 'VirtualRankStreams', Streams)
    monkeypatch.setattr(torch.cuda, 'stream', lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda *a: None)
    monkeypatch.setattr(torch.cuda, 'empty_cache', lambda: None)

    shape = bu.MoEShape('tiny', 256, 128, 8, 2)
    return bench.bench_format_shape(mma_type, shape, [1, 16], ep, 3, None), launches


@pytest.mark.parametrize('mma_type', ['bf16xbf16', 'fp8xfp8'])
@pytest.mark.parametrize('ep', [1, 2])
def test_sweep_plumbing_with_cpu_stand_ins(monkeypatch, mma_type, ep):
    rows, launches = _cpu_sweep(monkeypatch, mma_type, ep)
    assert [(r['n'], r['tokens'], r['status']) for r in rows] == [(1, ep, 'ok'), (16, 16 * ep, 'ok')]
    assert len(launches) == 2 * 2 * ep   # per row and rank, the timing stand-in's two launches
    for row in rows:
        assert row['fused_us'] == 10.0 and row['baseline_us'] == 10.0 and row['speedup'] == 1.0
        assert row['fused_timing'] == ('graph' if ep == 1 else f'eager: {ep} virtual ranks on {ep} streams')
        assert row['baseline'].startswith('torch grouped_mm bf16') and row['baseline_timing'] == 'graph'
        # The baseline computes what the kernel's emulation computes (same weights, gate/up order, ranks)
        assert row['diff'] < FP8_TOL
        assert 0 < row['experts_touched'] <= 8 and 0 < row['routed_pairs'] <= 2 * row['tokens']
        assert row['pct_roofline'] == pytest.approx(100 * row['roofline_us'] / 10.0)


def test_wrong_fused_output_fails_the_row_and_the_run(monkeypatch, capsys):
    # A kernel that answers wrongly (here: the reference with its sign flipped in every other column)
    # must not read as a timing: the row's status is 'mismatch' and main() exits 1 naming it
    def corrupt(y):
        y = y.clone()
        y[:, ::2] = -y[:, ::2]
        return y
    rows, _ = _cpu_sweep(monkeypatch, 'fp8xfp8', 1, corrupt)
    assert [r['status'] for r in rows] == ['mismatch', 'mismatch']
    assert all(r['diff'] > bench.DIFF_WARNING and 'CHECK' in r['note'] for r in rows)
    monkeypatch.setattr(bench, 'sm90_status', lambda: None)
    monkeypatch.setattr(bench, 'run_gpu', lambda args: rows)
    assert bench.main(['--quick']) == 1
    assert '2 row(s) failed: fp8xfp8 tiny n=1 (mismatch), fp8xfp8 tiny n=16 (mismatch)' in capsys.readouterr().out


def test_fused_output_checked_is_the_timed_runs_own(monkeypatch):
    # The output compared with the baseline's is what the timed runs wrote (y is poisoned after the
    # warm-up): a replay that writes nothing fails the row, although the warm-up's answer was right
    rows, _ = _cpu_sweep(monkeypatch, 'bf16xbf16', 1, replays_write=False)
    assert [r['status'] for r in rows] == ['mismatch', 'mismatch']
    assert all(r['diff'] is None or not r['diff'] < bench.DIFF_WARNING for r in rows)


# --------------------------------------------------------------------------------------------------
# The CPU path end to end
# --------------------------------------------------------------------------------------------------

def test_main_without_gpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, 'sm90_status', lambda: 'no GPU in this test')
    path = tmp_path / 'cpu.json'
    assert bench.main(['--quick', '--json', str(path), '--plot', str(tmp_path / 'cpu.png')]) == 0
    out = capsys.readouterr().out
    assert bench.CPU_MESSAGE in out and 'no GPU in this test' in out
    assert not (tmp_path / 'cpu.png').exists()
    data = json.loads(path.read_text())
    assert data['mode'] == 'cpu-reference'
    row, = data['rows']
    assert row['format'] == 'fp32 reference (CPU)' and row['fused_us'] is None and row['baseline_us'] > 0
    assert (row['hidden'], row['intermediate'], row['experts'], row['topk'], row['n']) == (512, 256, 16, 4, 64)


@pytest.mark.skipif(sm90_gpu_available(), reason='with an SM90 GPU the command runs the full GPU sweep')
def test_cli_on_cpu():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable, '-m', 'deep_gemm.bench'], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert bench.CPU_MESSAGE in proc.stdout.splitlines()


# --------------------------------------------------------------------------------------------------
# GPU (cheap; the sweep itself is `python -m deep_gemm.bench --quick` on the device)
# --------------------------------------------------------------------------------------------------

def test_gpu_baseline_grouped_mm_and_graph(requires_sm90):
    l1, l2, x, idx, w = (t.cuda() for t in _problem())
    ref = reference_moe(x, idx, w, l1, l2)
    b = bu.TorchMoEBaseline(l1, l2)
    note = b.select(x.bfloat16(), None, idx, w)
    assert b.mode == bu.GEMM_GROUPED, note
    t = bu.time_callable(lambda: b(x.bfloat16(), None, idx, w), 3, bu.L2Flusher(x.device))
    assert t.how == 'graph' and t.us > 0
    assert calc_diff(t.output.float(), ref) < BF16_TOL


def test_gpu_baseline_fp8_weights(requires_sm90):
    l1, l2, x, idx, w = (t.cuda() for t in _problem(seed=3))
    q1, q2 = per_block_cast_to_fp8(l1), per_block_cast_to_fp8(l2)
    d1, d2 = dequant_per_block_fp8(*q1), dequant_per_block_fp8(*q2)
    x_q, x_sf = per_token_cast_to_fp8(x)
    b = bu.TorchMoEBaseline(d1, d2, fp8_weights=(q1, q2), weight_format='fp8xfp8')
    b.select(x_q, x_sf, idx, w)
    ref = reference_moe(dequant_per_token_fp8(x_q, x_sf), idx, w, d1, d2)
    assert b.mode != bu.GEMM_LOOP and calc_diff(b(x_q, x_sf, idx, w).float(), ref) < FP8_TOL


def test_l2_flusher_modes():
    # the benchmark's flush writes its buffer; the diagnostic 'read' mode only reads it
    f = bu.L2Flusher(torch.device('cpu'), num_bytes=4096)
    f.buffer.fill_(3)
    f()
    assert int(f.buffer.abs().sum()) == 0
    r = bu.L2Flusher(torch.device('cpu'), num_bytes=4096, mode='read')
    r.buffer.fill_(3)
    r()
    assert int(r.buffer.sum()) == 3 * 1024 and int(r.sink) == 3 * 1024
    with pytest.raises(ValueError, match='mode'):
        bu.L2Flusher(torch.device('cpu'), num_bytes=4096, mode='evict')


def test_rows_name_the_kernel_they_ran():
    # The JSON's `kernel`: the variant rank 0 launched, from the launcher's own choice (so a sweep shows
    # where the heuristic switched kernels): v4-flash FP8 x FP4 at 8 tokens on a whole H200 is the CTA
    # pair, at one token the two-warpgroup kernel; the same n on virtual ranks never the pair
    row = bench.make_row('fp8xfp8', bench.SHAPES['mid'], 1, 1)
    assert 'kernel' in row and row['kernel'] is None   # not run: no kernel named
    v4 = bench.SHAPES['v4-flash']
    assert bench.kernel_name('fp8xfp4', v4, 8, 1, 132, 232448, False).endswith('_pair')
    one = bench.kernel_name('fp8xfp4', v4, 1, 1, 132, 232448, False)
    assert one.startswith('sm90_mega_moe_fp8xfp4_m64_') and '_pair' not in one
    assert '_pair' not in bench.kernel_name('fp8xfp4', bench.SHAPES['mid'], 32, 2, 66, 232448, True)
    assert bench.kernel_name('bf16xbf16', bench.SHAPES['mid'], 4096, 1, 132, 232448, False).startswith('sm90_mega_moe_bf16xbf16_m128_')
