"""The multi-process (one process per GPU) plumbing, without a GPU.

Processes are real (torch.multiprocessing spawn, gloo backend on 127.0.0.1); what needs GPUs
(NCCL, symmetric memory, the kernel) is in tests/test_multi_gpu.py.
"""
import os
import time

import pytest
import torch

from deep_gemm import bench
from deep_gemm.testing import calc_diff, ep_bench, ep_check, multi_process
from deep_gemm.testing.bench_utils import TorchMoEBaseline
from deep_gemm.testing.multi_process import NO_MULTICAST_ENV, RankError, RanksFailed, all_ranks_agree, spawn
from deep_gemm.utils import per_token_cast_to_fp8

# Bound on every spawn here: starting two Python processes that import torch takes a few seconds on
# a busy 2-core machine
SPAWN_TIMEOUT_S = 120


# --------------------------------------------------------------------------------------------------
# Children (module level: spawn pickles them by name)
# --------------------------------------------------------------------------------------------------

def _child_plumbing(rank, world_size, tag):
    """Everything a healthy child can report: env, group, all_ranks_agree, the all_to_all baseline."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    out = dict(rank=rank, world_size=world_size, tag=tag, env={k: os.environ.get(k) for k in NO_MULTICAST_ENV},
               torchrun_env=multi_process.torchrun_env(), dist=(dist.get_rank(), dist.get_world_size()),
               backend=dist.get_backend())

    # all_ranks_agree: success shares values
    with all_ranks_agree('share') as step:
        step.share = rank * 10
    out['gathered'] = step.gathered

    # ... a failure on rank 1 only raises on both ranks, naming rank 1
    try:
        with all_ranks_agree('one rank fails'):
            if rank == 1:
                raise ValueError('bad value on rank 1')
        out['one_fails'] = 'no exception'
    except RanksFailed as e:
        out['one_fails'] = (e.what, e.failures)

    # ... NotImplementedError everywhere stays NotImplementedError
    try:
        with all_ranks_agree('not built'):
            raise NotImplementedError('issue 4')
    except NotImplementedError as e:
        out['not_built'] = str(e)

    # The all_to_all baseline against the single-process baseline on the same tokens
    out['baseline_diffs'] = {fmt: [_baseline_diff(rank, world_size, fmt, n) for n in ns]
                             for fmt, ns in (('bf16xbf16', (37, 0)), ('fp8xfp8', (5, 64)))}
    return out


def _baseline_diff(rank, world_size, mma_type, n_rank0):
    hidden, inter, experts, topk = 256, 128, 8, 3
    g = torch.Generator().manual_seed(5)       # the same weights on every rank
    l1 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    l2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    e_local = experts // world_size
    local = TorchMoEBaseline(l1[rank * e_local:(rank + 1) * e_local], l2[rank * e_local:(rank + 1) * e_local],
                             dtype=torch.float32)
    full = TorchMoEBaseline(l1, l2, dtype=torch.float32)
    ep = ep_bench.AllToAllMoEBaseline(local, rank, world_size, experts)

    n = n_rank0 if rank == 0 else 23 + 11 * rank
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, hidden, generator=g).bfloat16()
    scores = torch.rand(n, experts, generator=g)
    idx = scores.topk(topk, dim=1).indices
    idx[torch.rand(n, topk, generator=g) < 0.3] = -1                  # masked slots
    w = torch.rand(n, topk, generator=g) + 0.05
    x_sf = None
    if mma_type == 'fp8xfp8':
        x, x_sf = per_token_cast_to_fp8(x, check_finite=False)
    y = ep(x, x_sf, idx, w)
    if ep.error:
        return f'error: {ep.error}'
    if tuple(y.shape) != (n, hidden) or y.dtype != torch.bfloat16:
        return f'shape {tuple(y.shape)} {y.dtype}'
    # Reference: the single-process baseline one slot at a time (each slot's row rounded to BF16 as
    # the owner sends it back), summed in FP32
    ref = torch.zeros(n, hidden)
    for k in range(topk):
        ref += full(x, x_sf, idx[:, k:k + 1], w[:, k:k + 1]).float()
    return calc_diff(y.float(), ref.bfloat16().float()) if n else 0.0


def _child_fails_on_rank_1(rank, world_size):
    import torch.distributed as dist
    if rank == 1:
        raise ValueError('boom from the child')
    dist.barrier()    # rank 0 waits for a peer that never comes: the parent must end it
    return rank


def _child_sleeps(rank, world_size):
    time.sleep(600)


def _child_returns_then_hangs_in_teardown(rank, world_size):
    """Returns a result, then never finishes tearing down (like a destructor stuck at exit)."""
    import torch.distributed as dist
    out = dict(rank=rank, env=multi_process.process_env_report())
    if rank == 1:
        dist.destroy_process_group = lambda *a, **k: time.sleep(600)
    return out


def _child_returns_then_dies(rank, world_size):
    import torch.distributed as dist
    if rank == 0:
        dist.destroy_process_group = lambda *a, **k: os._exit(7)
    return rank


def _child_returns_unpicklable(rank, world_size):
    return lambda: None


# --------------------------------------------------------------------------------------------------
# spawn
# --------------------------------------------------------------------------------------------------

def test_no_multicast_env():
    assert NO_MULTICAST_ENV == {'NCCL_NVLS_ENABLE': '0', 'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1',
                                'NVSHMEM_DISABLE_NVLS': '1'}
    env = {'NCCL_NVLS_ENABLE': '1', 'OTHER': 'x'}
    multi_process.set_no_multicast_env(env)
    # Multicast settings override; the symmetric-memory pool default fills in only where unset
    assert env == dict(NO_MULTICAST_ENV, OTHER='x', TORCH_SYMMMEM_IMPLICIT_POOL='0')
    env = {'TORCH_SYMMMEM_IMPLICIT_POOL': '1'}
    multi_process.set_no_multicast_env(env)
    assert env == dict(NO_MULTICAST_ENV, TORCH_SYMMMEM_IMPLICIT_POOL='1')


def test_find_free_port_is_bindable():
    import socket
    port = multi_process.find_free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', port))


def test_torchrun_env(monkeypatch):
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    assert multi_process.torchrun_env() is None
    monkeypatch.setenv('RANK', '1')
    monkeypatch.setenv('WORLD_SIZE', '2')
    assert multi_process.torchrun_env() is None      # LOCAL_RANK missing
    monkeypatch.setenv('LOCAL_RANK', '1')
    assert multi_process.torchrun_env() == (1, 2, 1)
    monkeypatch.setenv('RANK', '2')
    with pytest.raises(ValueError, match='inconsistent'):
        multi_process.torchrun_env()
    monkeypatch.setenv('RANK', 'x')
    with pytest.raises(ValueError, match='integers'):
        multi_process.torchrun_env()
    with pytest.raises(RuntimeError, match='torchrun'):
        monkeypatch.delenv('RANK')
        multi_process.init_from_env('gloo')


@pytest.mark.parametrize('kwargs,error,match', [
    (dict(world_size=0), ValueError, 'world_size'),
    (dict(world_size=True), ValueError, 'world_size'),
    (dict(world_size=2, backend='mpi'), ValueError, 'backend'),
    (dict(world_size=2, backend='gloo', timeout_s=0), ValueError, 'timeout_s'),
])
def test_spawn_rejects_bad_arguments(kwargs, error, match):
    world_size = kwargs.pop('world_size')
    with pytest.raises(error, match=match):
        spawn(_child_sleeps, world_size, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 64, reason='64 GPUs visible')
def test_spawn_nccl_needs_one_gpu_per_rank():
    with pytest.raises(RuntimeError, match='one GPU per rank: world_size = 64'):
        spawn(_child_sleeps, 64)


def test_spawn_gloo_children_env_agreement_and_baseline():
    before = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
    results = spawn(_child_plumbing, 2, 'tag', backend='gloo', timeout_s=SPAWN_TIMEOUT_S)
    # The parent's environment is left as it was
    assert {k: os.environ.get(k) for k in NO_MULTICAST_ENV} == before
    assert [r['rank'] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert r['world_size'] == 2 and r['tag'] == 'tag'
        assert r['dist'] == (rank, 2) and r['backend'] == 'gloo'
        assert r['env'] == NO_MULTICAST_ENV, 'NVLink multicast must be off in every child'
        assert r['torchrun_env'] == (rank, 2, rank)
        assert r['gathered'] == [0, 10]
        assert r['one_fails'] == ('one rank fails', [(1, 'ValueError', 'bad value on rank 1')])
        assert r['not_built'] == 'issue 4'
        for fmt, diffs in r['baseline_diffs'].items():
            for d in diffs:
                # Same rows, same GEMMs: only FP32 summation order differs (a lost or misrouted row gives ~1)
                assert isinstance(d, float) and d < 1e-8, (rank, fmt, diffs)


def test_spawn_reraises_a_child_exception_with_its_rank():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_child_fails_on_rank_1, 2, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)
    e = info.value
    assert e.rank == 1 and e.exc_type == 'ValueError' and e.message == 'boom from the child'
    assert '_child_fails_on_rank_1' in e.child_traceback
    assert str(e).startswith('rank 1 raised ValueError: boom from the child')
    # rank 0 was stuck in a barrier: terminated, not waited for until a timeout
    assert time.monotonic() - start < SPAWN_TIMEOUT_S


def test_spawn_unpicklable_result_is_an_error():
    with pytest.raises(RankError, match='cannot be pickled'):
        spawn(_child_returns_unpicklable, 1, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)


def test_spawn_timeout_terminates_the_children():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r'rank\(s\) \[0, 1\] of 2 still running after 3 s \(rank\(s\) \[\] had'):
        spawn(_child_sleeps, 2, backend='gloo', timeout_s=3)
    assert time.monotonic() - start < 30


def test_spawn_keeps_results_when_a_rank_hangs_or_dies_in_teardown(monkeypatch, capfd):
    monkeypatch.setattr(multi_process, '_EXIT_GRACE_S', 2.0)
    monkeypatch.delenv('TORCH_SYMMMEM_IMPLICIT_POOL', raising=False)
    start = time.monotonic()
    results = spawn(_child_returns_then_hangs_in_teardown, 2, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)
    assert [r['rank'] for r in results] == [0, 1]
    assert results[0]['env'] == dict(NO_MULTICAST_ENV, TORCH_SYMMMEM_IMPLICIT_POOL='0')
    assert time.monotonic() - start < SPAWN_TIMEOUT_S
    assert 'did not exit within 2 s' in capfd.readouterr().err
    assert spawn(_child_returns_then_dies, 2, backend='gloo', timeout_s=SPAWN_TIMEOUT_S) == [0, 1]
    assert 'then a process failed on exit' in capfd.readouterr().err


# --------------------------------------------------------------------------------------------------
# NVLink bytes (computed by hand)
# --------------------------------------------------------------------------------------------------

def test_row_bytes():
    assert ep_bench.dispatch_row_bytes('fp8xfp8', 4096) == 4096 + 4 * 32 == 4224
    assert ep_bench.dispatch_row_bytes('fp8xfp4', 7168) == 7168 + 4 * 56 == 7392
    assert ep_bench.dispatch_row_bytes('bf16xbf16', 4096) == 8192
    assert ep_bench.combine_row_bytes(4096) == 8192
    with pytest.raises(ValueError, match='mma_type'):
        ep_bench.dispatch_row_bytes('fp16', 4096)


def test_pairs_by_owner():
    # 8 experts on 2 ranks (4 each): experts 0, 1, 3 -> rank 0; 5, 7 -> rank 1; -1 masked
    idx = torch.tensor([[0, 5, -1], [7, 1, 3]])
    assert ep_bench.pairs_by_owner(idx, 8, 2) == [3, 2]
    assert ep_bench.pairs_by_owner(idx, 8, 4) == [2, 1, 1, 1]
    assert ep_bench.pairs_by_owner(torch.empty(0, 3, dtype=torch.long), 8, 2) == [0, 0]
    with pytest.raises(ValueError):
        ep_bench.pairs_by_owner(idx, 8, 3)


def test_nvlink_bytes():
    # pair_matrix[src][owner]; rank 0 computes 5 + 3 + 6 pairs, of which 3 + 6 = 9 come from other ranks
    matrix = [[5, 2, 1], [3, 4, 0], [6, 0, 7]]
    fp8 = ep_bench.nvlink_bytes('fp8xfp8', 4096, matrix, 0)
    assert fp8 == dict(remote_pairs=9, dispatch=9 * 4224, combine=9 * 8192, total=38016 + 73728)
    assert fp8['total'] == 111744
    bf16 = ep_bench.nvlink_bytes('bf16xbf16', 2048, matrix, 2)
    assert bf16 == dict(remote_pairs=1, dispatch=4096, combine=4096, total=8192)
    # A rank whose experts only get its own tokens moves nothing over NVLink
    assert ep_bench.nvlink_bytes('fp8xfp8', 4096, [[4, 0], [0, 4]], 1)['total'] == 0
    # v4-flash EP8 decode, one token per rank, 6 experts each all on other ranks: 48 - 6 own... here
    # rank 3 receives 2 slots from each of the 7 others: 14 * (4224 + 8192) bytes
    matrix = [[2 if owner == 3 and src != 3 else 0 for owner in range(8)] for src in range(8)]
    assert ep_bench.nvlink_bytes('fp8xfp8', 4096, matrix, 3)['total'] == 14 * 12416 == 173824


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------

def _ep_row(rank, fused, base, nv, status='ok'):
    row = bench.make_row('fp8xfp8', bench.SHAPES['v4-flash'], 8, 2, status=status, routed_pairs=10 + rank,
                         fused_us=fused, fused_timing='graph', baseline='all_to_all + torch grouped_mm bf16',
                         baseline_us=base, baseline_timing='eager: host-sized all_to_all (one sync per call)',
                         speedup=base / fused if fused else None, diff=1e-6 * (rank + 1))
    row.update(rank=rank, remote_pairs=5, nvlink_bytes=nv, nvlink_dispatch_bytes=None, nvlink_combine_bytes=None,
               nvlink_gbs=nv / (fused * 1e3) if fused else None)
    return row


def test_summary_is_the_slowest_rank():
    (s,) = ep_bench.summarize([_ep_row(0, 10.0, 30.0, 1000), _ep_row(1, 12.0, 20.0, 2000)])
    assert (s['rank'], s['fused_us'], s['baseline_us'], s['routed_pairs']) == ('max', 12.0, 30.0, 21)
    assert s['speedup'] == pytest.approx(2.5)
    assert s['nvlink_bytes'] == 3000 and s['nvlink_gbs'] == pytest.approx(3000 / 12e-6 / 1e9)
    assert s['diff'] == pytest.approx(2e-6) and s['note'] == 'slowest of 2 ranks: rank 1'
    (s,) = ep_bench.summarize([_ep_row(0, None, 30.0, 0, status='error'), _ep_row(1, 12.0, 20.0, 0)])
    assert s['fused_us'] is None and s['speedup'] is None and s['status'] == 'error'


def test_ep_table():
    rows = [_ep_row(0, 10.0, 30.0, 1000), _ep_row(1, 12.0, 20.0, 2000)]
    lines = ep_bench.format_ep_table(rows).splitlines()
    assert lines[0].split()[:8] == ['format', 'shape', 'ep', 'rank', 'n', 'fused', 'us', 'TFLOPS']
    assert 'NVLink GB/s' in lines[0] and set(lines[1]) == {'-'}
    assert len(lines) == 2 + 2 * 2      # each row has a `^` line: the eager baseline timing
    assert lines[2].split()[:6] == ['fp8xfp8', 'v4-flash', '2', '0', '8', '10.0']
    assert lines[3].startswith('    ^ baseline: eager')
    assert len(ep_bench.format_ep_table(rows[:1], header=False).splitlines()) == 2


# --------------------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------------------

def test_bench_ep_defaults_and_virtual():
    args = bench.parse_args(['--ep', '2'])
    assert (args.ep, args.virtual) == (2, False)
    assert args.shapes == ['v4-flash'] and args.tokens == [1, 8, 128, 512, 4096]
    assert args.formats == list(bench.MMA_TYPES)
    args = bench.parse_args(['--ep', '2', '--virtual'])
    assert args.virtual and args.shapes == list(bench.SHAPES) and args.tokens == list(bench.DEFAULT_TOKENS)
    assert bench.parse_args(['--ep', '8', '--quick']).shapes == list(bench.QUICK_SHAPES)
    assert bench.parse_args(['--ep', '4', '--shapes', 'mid', '--tokens', '3']).tokens == [3]
    assert bench.parse_args(['--ep', '2']).timeout is None
    assert bench.parse_args(['--ep', '2', '--timeout', '200']).timeout == 200.0
    with pytest.raises(SystemExit):
        bench.parse_args(['--ep', '2', '--timeout', '0'])
    assert bench.parse_args([]).virtual is False and bench.parse_args([]).shapes == list(bench.SHAPES)


def test_bench_ep_rejects_experts_not_divisible(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(['--ep', '3'])          # v4-flash: 256 experts
    assert e.value.code == 2 and '256 experts' in capsys.readouterr().err


def test_bench_main_chooses_processes_or_virtual_ranks(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, 'sm90_status', lambda: None)
    monkeypatch.setattr(bench, 'run_gpu', lambda args: calls.append(('virtual', args.ep)) or [])
    monkeypatch.setattr(ep_bench, 'run', lambda args, argv: calls.append(('processes', args.ep)) or 0)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    assert bench.main(['--ep', '2']) == 0
    assert bench.main(['--ep', '2', '--virtual']) == 0
    assert 'falling back' not in capsys.readouterr().out
    assert bench.main(['--ep', '4']) == 0
    assert 'only 2 GPU(s) visible, fewer than 4: falling back to 4 virtual ranks' in capsys.readouterr().out
    assert bench.main(['--ep', '1']) == 0
    assert calls == [('processes', 2), ('virtual', 2), ('virtual', 4), ('virtual', 1)]


def test_bench_ep_spawn_failure_is_reported(monkeypatch, capsys, tmp_path):
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def fake_spawn(fn, nprocs, config, timeout_s=None):
        seen['timeout_s'] = timeout_s
        raise TimeoutError('spawn: rank(s) [1] of 2 still running after 200 s')
    monkeypatch.setattr(ep_bench, 'spawn', fake_spawn)
    argv = ['--ep', '2', '--timeout', '200', '--json', str(tmp_path / 'ep.json')]
    assert ep_bench.run(bench.parse_args(argv), argv) == 3
    out = capsys.readouterr().out
    assert seen['timeout_s'] == 200.0
    assert '# --ep 2 FAILED: spawn: rank(s) [1] of 2 still running' in out and '"partial": true' in out


def test_bench_torchrun_must_match_ep(monkeypatch, capsys):
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('LOCAL_RANK', '0')
    assert ep_bench.real_ep_available(8)
    assert ep_bench.run(bench.parse_args(['--ep', '4']), ['--ep', '4']) == 2
    assert 'WORLD_SIZE=2' in capsys.readouterr().out


def test_check_command_line():
    args = multi_process.parse_args(['--check'])
    assert (args.nproc, args.formats, args.shapes, args.seed, args.calls) == (
        None, ['fp8xfp8', 'fp8xfp4', 'bf16xbf16'], ['small', 'mid'], 0, 100)
    args = multi_process.parse_args(['--check', '--nproc', '4', '--formats', 'bf16xbf16', '--shapes', 'mid',
                                     '--calls', '7', '--seed', '3', '--timeout', '60'])
    assert (args.nproc, args.formats, args.shapes, args.calls, args.seed, args.timeout) == (
        4, ['bf16xbf16'], ['mid'], 7, 3, 60.0)
    for argv in ([], ['--check', '--nproc', '0'], ['--check', '--calls', '0'], ['--check', '--formats', 'fp16']):
        with pytest.raises(SystemExit):
            multi_process.parse_args(argv)
    args = multi_process.parse_args(['--probe', '--timeout', '75'])
    assert (args.probe, args.check, args.timeout) == (True, False, 75.0)


def test_format_probe_results():
    r = dict(rank=1, world_size=2, device='1: H200', torch='2.11', peer_access={0: True}, all_reduce=3.0,
             symm_backend='CUDA', offsets=[0, 0], peer_ptrs=['0x1', '0x2'], seconds=1.25,
             env=multi_process.process_env_report())
    text = multi_process.format_probe_results([r])
    assert text.startswith('rank 1/2 GPU 1: H200 torch 2.11: peer access {0: True}, all_reduce 3, symm backend CUDA')
    assert 'TORCH_SYMMMEM_IMPLICIT_POOL' in text


def test_check_without_gpus_says_so(monkeypatch, capsys):
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)
    assert multi_process.main(['--check']) == 1
    assert 'needs at least 2' in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# The check's inputs
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('world_size', [1, 2, 4, 8])
def test_default_ns(world_size):
    ns = ep_check.default_ns(world_size, 256)
    assert len(ns) == world_size and max(ns) == 256 and min(ns) >= 0
    if world_size > 1:
        assert 0 in ns and len(set(ns)) == world_size


def test_check_rejects_bad_arguments():
    # Caught before anything collective or CUDA
    with pytest.raises(ValueError, match='mma_type'):
        ep_check.check_ep_rank(0, 2, 'fp16', 'small', group=object())
    with pytest.raises(ValueError, match='shape'):
        ep_check.check_ep_rank(0, 2, 'fp8xfp8', 'huge', group=object())
    with pytest.raises(ValueError, match='cannot be split'):
        ep_check.check_ep_rank(0, 3, 'fp8xfp8', 'small', group=object())
    with pytest.raises(ValueError, match='ns'):
        ep_check.check_ep_rank(0, 2, 'fp8xfp8', 'small', [1, 2, 3], group=object())
    with pytest.raises(ValueError, match='exceeds'):
        ep_check.check_ep_rank(0, 2, 'fp8xfp8', 'small', [10, 300], n_max=256, group=object())


def test_format_case_results():
    report = dict(ns=[256, 0], n_max=256, plain=1e-5, masked=2e-5, skewed=3e-5, graph=1e-5, back_to_back=4e-5,
                  calls=107, seconds=3.2, peers=2)
    results = [dict(rank=0, world_size=2, cases={'fp8xfp8 small': dict(status='ok', report=report, error='')}),
               dict(rank=1, world_size=2, cases={'fp8xfp8 small': dict(status='fail', report=None,
                                                                       error='eager cases failed\n  rank 1: x')})]
    lines = ep_check.format_case_results(results).splitlines()
    assert lines[0].startswith('rank 0/2 fp8xfp8 small') and 'back_to_back 4.0e-05' in lines[0]
    assert '107 calls' in lines[0]
    assert lines[1].startswith('rank 1/2 fp8xfp8 small') and 'FAIL  eager cases failed' in lines[1]
    assert lines[2] == '      rank 1: x'


class _FakeBuffer:
    def __init__(self, rank, peer_ptrs, own):
        self.rank, self.num_ranks, self.peer_ptrs = rank, len(peer_ptrs), peer_ptrs
        self.buffer = type('T', (), {'data_ptr': lambda _self: own})()


def test_check_peer_table():
    ep_check.check_peer_table(_FakeBuffer(1, [0x1000, 0x2000], 0x2000), 1, 2)
    # torch's pooled symmetric memory: base pointers of the block, the tensor 512 bytes in
    with pytest.raises(ep_check.EPCheckError, match=r'peer_ptrs\[1\] = 0x2000 .* \(offset \+512\)'):
        ep_check.check_peer_table(_FakeBuffer(1, [0x1000, 0x2000], 0x2200), 1, 2)
    with pytest.raises(ep_check.EPCheckError, match='expected rank 0 of 2'):
        ep_check.check_peer_table(_FakeBuffer(1, [0x1000, 0x2000], 0x2000), 0, 2)
    with pytest.raises(ep_check.EPCheckError, match='repeated'):
        ep_check.check_peer_table(_FakeBuffer(0, [0x1000, 0x1000], 0x1000), 0, 2)


def _child_peer_table(rank, world_size):
    """buffer.py's peer table and its probe on one gloo rank, CPU memory standing in for the GPU's."""
    import torch.distributed as dist

    from deep_gemm.mega import buffer as buffer_mod
    torch.cuda.synchronize = lambda *a, **k: None
    group = dist.group.WORLD
    out = {}
    # A tensor 512 bytes into its (pooled) symmetric allocation: the base + this rank's offset
    arena = torch.zeros(4096, dtype=torch.uint8)

    class Handle:
        buffer_ptrs = [arena.data_ptr()]
    out['ptrs_ok'] = buffer_mod._peer_buffer_addresses(arena[512:], Handle(), group, 0, 1) == [arena.data_ptr() + 512]
    Handle.buffer_ptrs = [arena.data_ptr() + 1024]
    try:
        buffer_mod._peer_buffer_addresses(arena[512:], Handle(), group, 0, 1)
    except RuntimeError as e:
        out['below_base'] = str(e)
    sym = buffer_mod.get_symm_buffer_for_mega_moe(None, 8, 16, 2, 256, 128, 'bf16xbf16', device='cpu')
    buffer_mod._probe_peers(sym, group)            # its own buffer: passes
    out['marker'] = sym.buffer[:32].view(torch.int64).tolist()
    own = sym.peer_ptrs
    elsewhere = torch.zeros(64, dtype=torch.uint8)
    sym.peer_ptrs = [elsewhere.data_ptr()]
    try:
        buffer_mod._probe_peers(sym, group)
    except RuntimeError as e:
        out['wrong_peer'] = str(e)
    # The group's third probe (None: the world group) carries its sequence number 3
    sym.peer_ptrs = own
    buffer_mod._probe_peers(sym, None)
    out['world_sequence'] = sym.buffer[16:24].view(torch.int64).item()
    return out


def test_peer_table_and_probe():
    r = spawn(_child_peer_table, 1, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)[0]
    assert r['ptrs_ok']
    assert 'below its allocation base (offsets [-512])' in r['below_base']
    # The marker: magic, rank, sequence number, buffer bytes (zeroed later by _initialize on GPUs)
    assert r['marker'][:3] == [0x44474D4F45505231, 0, 1]
    assert "the peer table does not reach the peers' buffers" in r['wrong_peer']
    assert 'rank 0: peer_ptrs[0] = 0x' in r['wrong_peer'] and "holds ['0x0', '0x0', '0x0', '0x0']" in r['wrong_peer']
    assert r['world_sequence'] == 3


def test_probe_sequences_count_per_group():
    # A process in two groups may make their buffers in either order; each group's members count
    # that group's buffers alike, so the numbers are per group (by its members' global ranks)
    from deep_gemm.mega import buffer as buffer_mod
    saved = dict(buffer_mod._probe_sequences)
    try:
        buffer_mod._probe_sequences.clear()
        assert [buffer_mod._next_probe_sequence(g) for g in [(0, 1), (0, 2), (0, 2), (0, 1), (0, 1)]] == [1, 1, 2, 2, 3]
    finally:
        buffer_mod._probe_sequences.clear()
        buffer_mod._probe_sequences.update(saved)


def test_allow_cold_jit(monkeypatch):
    from deep_gemm.mega import status
    monkeypatch.setattr(status, '_timeout_s', None)
    monkeypatch.setattr(status, '_env_timeout_s', None)   # DG_TIMEOUT_S unset at import
    ep_check.allow_cold_jit()
    assert status.get_timeout() == ep_check.COLD_JIT_TIMEOUT_S == 60.0
    monkeypatch.setattr(status, '_timeout_s', None)
    monkeypatch.setenv('DG_TIMEOUT_S', '2')
    monkeypatch.setattr(status, '_env_timeout_s', status._env_timeout())   # as an import would read it
    ep_check.allow_cold_jit()            # an explicit setting wins
    assert status.get_timeout() == 2.0


# --------------------------------------------------------------------------------------------------
# The GPU code paths with a CPU stand-in for the kernel
# --------------------------------------------------------------------------------------------------
#
# check_ep_rank and bench_ep_rank run on 2 gloo ranks with: CPU tensors, the layout-exact SymmBuffer
# of this rank (virtual-rank buffers on the CPU), and a stand-in kernel that validates its arguments
# like the real entry point and computes the emulating reference, exchanging the routing with its peer
# for the receive statistics (one collective per call: like the kernel, it needs every rank to call).
# What this proves: the phases, call counts, staging, checks and rows; not the kernel.

_STAND_IN = {}


class _Replay:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def _install_stand_ins(monkeypatch_free_rank, world_size, tamper=None, not_built=()):
    import torch.distributed as dist

    from deep_gemm.mega import api as mega_api
    from deep_gemm.mega import buffer as buffer_mod
    from deep_gemm.testing import moe_case, virtual_ranks

    rank = monkeypatch_free_rank
    torch.set_num_threads(1)     # two processes on a small CPU: threads only contend
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_device_name = lambda *a: 'CPU stand-in'
    ep_check.capture_call = lambda fn: _Replay(fn)
    ep_bench.L2Flusher = lambda device: (lambda: None)
    ep_bench.event_median_us = lambda run, reps, flush: [run() for _ in range(reps)] and 10.0 + rank

    make_weights = moe_case.make_weights

    def weights_stand_in(mma_type, *args, **kwargs):
        if mma_type in not_built:
            raise NotImplementedError(f'{mma_type}: not built (stand-in)')
        _STAND_IN['weights'] = w = make_weights(mma_type, *args, **kwargs)
        return w
    moe_case.make_weights = weights_stand_in

    def symm_stand_in(group, num_experts, n_max, topk, hidden, inter, fmt):
        assert group is not None and dist.get_world_size(group) == world_size
        bufs = virtual_ranks.make_virtual_ranks(world_size, num_experts, n_max, topk, hidden, inter, fmt, device='cpu')
        return bufs[rank]
    buffer_mod.get_symm_buffer_for_mega_moe = symm_stand_in

    def kernel(y, l1, l2, buf, cumulative_local_expert_recv_stats=None, activation='swiglu', activation_clamp=None,
               fast_math=True):
        stats = cumulative_local_expert_recv_stats
        mega_api._validate(buf.mma_type, y, l1, l2, buf, stats, activation, activation_clamp, fast_math, 'stand-in')
        _STAND_IN['calls'] = _STAND_IN.get('calls', 0) + 1
        n = y.shape[0]
        inp = moe_case.RankInputs(None, buf.x[:n].clone(), None if buf.x_sf is None else buf.x_sf[:n].clone(),
                                  buf.topk_idx[:n].clone(), buf.topk_weights[:n].clone())
        y.copy_(moe_case.reference(_STAND_IN['weights'], inp, activation_clamp).bfloat16())
        if tamper is not None:
            tamper(y, _STAND_IN['calls'])
        ids = inp.topk_idx[inp.topk_idx >= 0]
        counts = torch.bincount(ids, minlength=buf.num_experts)
        dist.all_reduce(counts)
        if stats is not None:
            e = buf.num_local_experts
            stats += counts[rank * e:(rank + 1) * e].int()
    for name in ('fp8_mega_moe', 'fp8_fp4_mega_moe', 'bf16_mega_moe'):
        setattr(mega_api, name, kernel)


def _child_check_with_stand_in(rank, world_size, mma_type, num_calls, tamper_rank):
    def tamper(y, call):      # one wrong value in rank tamper_rank's 5th call (a masked-phase output)
        if rank == tamper_rank and call == 2 and y.shape[0]:
            y[0, 0] = 1000.0
    _install_stand_ins(rank, world_size, tamper if tamper_rank is not None else None)
    ns = ep_check.default_ns(world_size, 64)
    try:
        report = ep_check.check_ep_rank(rank, world_size, mma_type, 'small', ns, seed=3, num_calls=num_calls,
                                        device='cpu', sample_every=4)
    except RanksFailed as e:
        return dict(failed=(e.what, [(r, t) for r, t, _ in e.failures], str(e)), calls=_STAND_IN['calls'])
    return dict(report=report, calls=_STAND_IN['calls'])


def _child_bench_with_stand_in(rank, world_size, json_path):
    from deep_gemm.testing.bench_utils import MoEShape
    _install_stand_ins(rank, world_size, not_built=('fp8xfp8',))
    bench.SHAPES['cpu-small'] = MoEShape('cpu-small', 512, 256, 16, 4)
    config = dict(shapes=['cpu-small'], formats=['fp8xfp4', 'fp8xfp8'], tokens=[1, 48], reps=2, seed=1,
                  json=json_path, plot=None, meta=dict(gpu=None), device='cpu')
    rows = ep_bench.bench_ep_rank(rank, world_size, config)
    return dict(rows=rows, calls=_STAND_IN['calls'])


@pytest.mark.parametrize('mma_type', ['fp8xfp8', 'fp8xfp4', 'bf16xbf16'])
def test_check_ep_rank_with_a_stand_in_kernel(mma_type):
    results = spawn(_child_check_with_stand_in, 2, mma_type, 6, None, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)
    for rank, r in enumerate(results):
        report = r['report']
        # 3 eager cases + 2 x (replay + eager) + 6 back-to-back, on both ranks
        assert report['calls'] == r['calls'] == 3 + 4 + 6
        assert report['ns'] == [64, 0] and report['n_max'] == 64 and report['peers'] == 2
        for phase in ('plain', 'masked', 'skewed', 'graph', 'back_to_back'):
            assert report[phase] < 1e-12, (rank, phase, report[phase])   # the stand-in IS the reference


def test_check_ep_rank_failure_on_one_rank_fails_every_rank():
    results = spawn(_child_check_with_stand_in, 2, 'bf16xbf16', 6, 1, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)
    for r in results:
        what, failures, text = r['failed']
        assert what == 'eager cases' and failures == [(1, 'EPCheckError')]
        assert 'masked: calc_diff' in text
        assert r['calls'] == 3          # the phase's calls were all made; nothing after it


def test_bench_ep_rank_with_a_stand_in_kernel(tmp_path, capfd):
    import json
    path = str(tmp_path / 'ep.json')
    results = spawn(_child_bench_with_stand_in, 2, path, backend='gloo', timeout_s=SPAWN_TIMEOUT_S)
    rows = results[0]['rows']
    assert results[1]['rows'] is None
    # 2 token counts: 2 warm-up calls per row on each rank, then the timed replays (2)
    assert results[0]['calls'] == results[1]['calls'] == 2 * (2 + 2)
    ok = [r for r in rows if r['format'] == 'fp8xfp4']
    assert [(r['n'], r['rank']) for r in ok] == [(1, 0), (1, 1), (48, 0), (48, 1)]
    for r in ok:
        assert r['status'] == 'ok', r['note']
        assert r['fused_us'] == 10.0 + r['rank'] and r['baseline_us'] == 10.0 + r['rank']
        assert r['fused_timing'] == 'graph' and r['baseline'].startswith('all_to_all + torch')
        assert r['diff'] < bench.DIFF_WARNING, r
        # E4M3 x plus 4 FP32 scales pulled, a BF16 row written back
        assert r['nvlink_bytes'] == r['remote_pairs'] * ((512 + 4 * 4) + 2 * 512)
        assert r['nvlink_gbs'] == pytest.approx(r['nvlink_bytes'] / (r['fused_us'] * 1e3))
        assert r['tflops'] is not None and r['hbm_gbs'] is not None
    # Every pair is computed by exactly one rank
    for n in (1, 48):
        pairs = sum(r['routed_pairs'] for r in ok if r['n'] == n)
        assert 0 < pairs <= 2 * n * 4
    assert [r['status'] for r in rows if r['format'] == 'fp8xfp8'] == [bench.NOT_BUILT] * 4
    out = capfd.readouterr().out
    assert 'NVLink GB/s' in out and '# summary: the slowest of the 2 ranks per row' in out
    data = json.load(open(path))
    assert data['ep_processes'] == 2 and data['nvlink_multicast'] == 'off'
    # The final JSON replaced the partial one written after each format
    assert 'partial' not in data and 'TORCH_SYMMMEM_IMPLICIT_POOL' in data['process_env']
    summary = [r for r in data['rows'] if r['rank'] == 'max']
    assert [(r['format'], r['n'], r['fused_us']) for r in summary] == [
        ('fp8xfp4', 1, 11.0), ('fp8xfp4', 48, 11.0), ('fp8xfp8', 1, None), ('fp8xfp8', 48, None)]
