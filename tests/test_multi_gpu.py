"""Expert parallelism on real GPUs: one process per GPU, symmetric memory over NVLink (issue 6).

Skipped unless at least 2 SM90 GPUs are visible; world sizes above the GPU count skip. Every case is
`deep_gemm.testing.ep_check.check_ep_rank` on every rank (eager cases with a different n per rank,
0 included, masks and skew; CUDA-graph replay against eager bit for bit; back-to-back calls), with
the tolerances of tests/test_mega_moe_gpu.py. One `spawn` per world size runs all its cases (process
start-up and NCCL set-up cost seconds); each test reads its case from that run. A case that fails
fails on every rank together, so the next case still runs.

The same check by hand: `python -m deep_gemm.testing.multi_process --check --nproc 2`.

Settings (the device scripts use them to fit a time budget): DG_TEST_EP_WORLD_SIZES (default
"2 4 8"), DG_TEST_EP_CALLS (back-to-back calls per case, default 100), DG_TEST_EP_TIMEOUT_S (bound
of the one spawn per world size, default 280). Every rank's per-case line (status, worst calc_diff
per phase) is printed when a world size's run ends (visible with `pytest -s`).
"""
import os
import time

import pytest
import torch

from deep_gemm.testing import MMA_TYPES, ep_check, multi_process

from conftest import record_diff, sm90_gpu_available


def _num_sm90_gpus() -> int:
    if not sm90_gpu_available():
        return 0
    count = torch.cuda.device_count()
    return count if all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(count)) else 0


NUM_GPUS = _num_sm90_gpus()
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason='needs at least 2 SM90 (Hopper) GPUs')

FORMATS = list(MMA_TYPES)
SHAPES = ['small', 'mid']
NUM_CALLS = int(os.environ.get('DG_TEST_EP_CALLS', str(ep_check.DEFAULT_NUM_CALLS)))
SEED = 0
# Everything of one world size (start-up, 6 cases, 107 calls each); a hung run is terminated
SPAWN_TIMEOUT_S = float(os.environ.get('DG_TEST_EP_TIMEOUT_S', '280'))
WORLD_SIZES = [int(w) for w in os.environ.get('DG_TEST_EP_WORLD_SIZES', '2 4 8').split()]

_runs = {}


def run_for(world_size):
    """Every rank's `run_check_cases` result for all (format, shape) cases, or the spawn's exception."""
    if world_size not in _runs:
        cases = [(f, s) for f in FORMATS for s in SHAPES]
        start = time.perf_counter()
        try:
            _runs[world_size] = multi_process.spawn(ep_check.run_check_cases, world_size, cases, SEED, NUM_CALLS,
                                                    timeout_s=SPAWN_TIMEOUT_S)
            print(f'\n# EP{world_size}: {len(cases)} cases, {NUM_CALLS} back-to-back calls each, '
                  f'{time.perf_counter() - start:.1f} s\n' + ep_check.format_case_results(_runs[world_size]),
                  flush=True)
        except Exception as e:  # noqa: BLE001 - every test of this world size reports it
            _runs[world_size] = e
            print(f'\n# EP{world_size}: spawn failed after {time.perf_counter() - start:.1f} s: {e}', flush=True)
    return _runs[world_size]


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('mma_type', FORMATS)
@pytest.mark.parametrize('world_size', WORLD_SIZES)
def test_ep_on_real_gpus(world_size, mma_type, shape):
    if world_size > NUM_GPUS:
        pytest.skip(f'needs {world_size} GPUs, {NUM_GPUS} visible')
    results = run_for(world_size)
    if isinstance(results, Exception):
        pytest.fail(f'spawn of {world_size} ranks failed: {results}')
    key = f'{mma_type} {shape}'
    assert [r['rank'] for r in results] == list(range(world_size))
    for rank, result in enumerate(results):
        assert result['env'] == multi_process.NO_MULTICAST_ENV, f'rank {rank}: NVLink multicast not off'
        case = result['cases'][key]
        if case['status'] == 'not built':
            pytest.skip(f'issue 4: {case["error"]}' if mma_type == 'fp8xfp4' else case['error'])
        assert case['status'] == 'ok', f'rank {rank}: {case["error"]}'
        report = case['report']
        tol = ep_check.TOLERANCE[mma_type]
        for phase in ('plain', 'masked', 'skewed', 'graph', 'back_to_back'):
            assert report[phase] < tol, f'rank {rank} {phase}: calc_diff {report[phase]:.3e}'
            record_diff(mma_type, report[phase])
        assert report['calls'] == 3 + 4 + NUM_CALLS
        assert report['peers'] == world_size
    # Every rank's n differs in the eager cases and one rank has none
    ns = results[0]['cases'][key]['report']['ns']
    assert 0 in ns and len(set(ns)) == world_size


@pytest.mark.bf16xbf16
def test_ep_bench_two_processes():
    # The --ep benchmark's plumbing on 2 GPUs (fused in a CUDA graph, all_to_all baseline, NVLink bytes)
    from deep_gemm import bench
    from deep_gemm.testing import ep_bench
    config = dict(shapes=['mid'], formats=['bf16xbf16'], tokens=[1, 64], reps=3, seed=bench.SEED, json=None,
                  plot=None, meta={})
    rows = multi_process.spawn(ep_bench.bench_ep_rank, 2, config, timeout_s=SPAWN_TIMEOUT_S)[0]
    assert [(r['n'], r['rank']) for r in rows] == [(1, 0), (1, 1), (64, 0), (64, 1)]
    for r in rows:
        assert r['status'] == 'ok', r['note']
        assert r['fused_us'] > 0 and r['baseline_us'] > 0 and r['fused_timing'] == 'graph', r
        assert r['diff'] < bench.DIFF_WARNING, r
        assert r['nvlink_bytes'] == r['remote_pairs'] * (2 * 2048 + 2 * 2048)
    assert sum(r['remote_pairs'] for r in rows if r['n'] == 64) > 0
