"""The expert-parallel correctness check on real GPUs: one rank of it per process (issue 6).

`check_ep_rank` runs on every rank of an initialized NCCL group (started by
`deep_gemm.testing.multi_process.spawn` or torchrun). Every rank builds the same full weights from
the same seed and keeps its own experts, gets its buffer from `get_symm_buffer_for_mega_moe(group, ...)`
(torch symmetric memory: the peers' buffers over NVLink) and checks its own tokens against
`moe_case.reference` with the tolerances of `tests/test_mega_moe_gpu.py` (calc_diff 3e-4 for FP8
activations, fp8xfp8 and fp8xfp4; 2e-6 BF16; that file's docstring derives them). Phases, in order:

1. eager cases: a different n on every rank, 0 included (the ranks' n rotate from case to case),
   then 30 % masked slots, then all tokens' first slot to one expert of the last rank (skew); y
   poisoned with NaN before each call; `cumulative_local_expert_recv_stats` against the routing of
   all ranks; `buf.check()`.
2. CUDA graph: one call captured, replayed with changed inputs (new tokens, routing and masks);
   each replay equals an eager call on the same inputs bit for bit, and the reference.
3. back-to-back: `num_calls` calls with changing n (0 included), routing, masks and skew, queued
   without a host synchronization in between; the reference on a sample of them.

The kernel's cross-rank protocol counts calls, so every rank makes exactly the same calls. Each
phase is an `all_ranks_agree` block: a failure on any rank (a wrong value, a kernel timeout) makes
every rank raise at the end of that phase, with every rank's message, instead of leaving peers
waiting for calls that never come.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import moe_case
from .multi_process import RanksFailed, all_ranks_agree
from .reference import calc_diff

# calc_diff bounds against the emulating reference (tests/test_mega_moe_gpu.py derives them)
TOLERANCE: Dict[str, float] = {'fp8xfp8': 3e-4, 'fp8xfp4': 3e-4, 'bf16xbf16': 2e-6}
CHECK_FORMATS: Tuple[str, ...] = ('fp8xfp8', 'fp8xfp4', 'bf16xbf16')
# (hidden, intermediate, experts, topk)
CHECK_SHAPES: Dict[str, Tuple[int, int, int, int]] = {'small': (512, 256, 16, 4), 'mid': (2048, 768, 128, 8)}
# Tokens per rank the buffer is sized for, per shape
CHECK_MAX_TOKENS: Dict[str, int] = {'small': 256, 'mid': 512}
DEFAULT_NUM_CALLS = 100
# Back-to-back: the reference runs on every SAMPLE_EVERY-th call and on the last
SAMPLE_EVERY = 10
MASK_FRAC = 0.3
# Spin-wait bound while checking (unless DG_TIMEOUT_S is set): the kernel variant depends on each
# rank's n, so a rank may JIT-compile one (tens of seconds on a cold cache) while its peers'
# kernels already wait for it; the default 5 s would turn that into a timeout
COLD_JIT_TIMEOUT_S = 60.0

Shape = Union[str, Sequence[int]]


class EPCheckError(AssertionError):
    """A check failed (raised on the rank that saw it, inside a phase)."""


def default_ns(world_size: int, n_max: int) -> List[int]:
    """Tokens per rank for the eager cases: all different where possible, one rank with 0, one with n_max."""
    pattern = [n_max, 0, 1, 129, 7, n_max // 2, 64, 3]
    return [min(pattern[r % len(pattern)] + (r // len(pattern)), n_max) for r in range(world_size)]


def _resolve_shape(shape: Shape) -> Tuple[int, int, int, int]:
    if isinstance(shape, str):
        if shape not in CHECK_SHAPES:
            raise ValueError(f'shape = {shape!r} is invalid: expected one of {sorted(CHECK_SHAPES)} or (H, I, E, topk)')
        return CHECK_SHAPES[shape]
    values = tuple(int(v) for v in shape)
    if len(values) != 4:
        raise ValueError(f'shape = {shape!r} is invalid: expected (hidden, intermediate, experts, topk)')
    return values  # type: ignore[return-value]


def _seed(*parts: int) -> int:
    """A per-(phase, call, rank) seed: distinct for distinct parts, the same on every run."""
    value = 0
    for p in parts:
        value = (value * 1000003 + int(p)) % (2 ** 62)
    return value


def _weights_checksum(weights: moe_case.MoEWeights) -> List[int]:
    """Per expert, the integer sum of the bit patterns of its exact L1 and L2 weights: equal on every
    rank iff every rank generated the same weights (one expert at a time: no large temporary)."""
    sums = []
    for e in range(weights.l1_ref.shape[0]):
        total = 0
        for t in (weights.l1_ref[e], weights.l2_ref[e]):
            bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
            total += int(bits.to(torch.int64).sum())
        sums.append(total)
    return sums


def allow_cold_jit() -> None:
    """Raise the kernel's spin-wait bound to COLD_JIT_TIMEOUT_S unless DG_TIMEOUT_S (as at import) says otherwise."""
    from ..mega import status
    if not status.timeout_from_environment():
        status.set_timeout(max(status.get_timeout(), COLD_JIT_TIMEOUT_S))


def check_peer_table(buf, rank: int, world_size: int) -> None:
    """EPCheckError unless `buf` is rank `rank` of `world_size` with one distinct address per rank and
    its own entry equal to its own buffer's address."""
    if (buf.rank, buf.num_ranks, len(buf.peer_ptrs)) != (rank, world_size, world_size):
        raise EPCheckError(f'buffer has rank {buf.rank} of {buf.num_ranks} with {len(buf.peer_ptrs)} peer '
                           f'addresses, expected rank {rank} of {world_size}')
    own = buf.buffer.data_ptr()
    if buf.peer_ptrs[rank] != own:
        # torch's implicit symmetric-memory pool (TORCH_SYMMMEM_IMPLICIT_POOL, default on) places the
        # tensor at an offset inside a pooled block, and handle.buffer_ptrs are the blocks' bases
        raise EPCheckError(f'peer_ptrs[{rank}] = {buf.peer_ptrs[rank]:#x} is not this rank\'s buffer {own:#x} '
                           f'(offset {own - buf.peer_ptrs[rank]:+d}): the peer table must hold every rank\'s '
                           f'address of the buffer itself (symmetric-memory base + the tensor\'s offset)')
    if len(set(buf.peer_ptrs)) != world_size:
        raise EPCheckError(f'peer_ptrs has repeated addresses: {[hex(p) for p in buf.peer_ptrs]}')


def _stage(buf, inp) -> None:
    moe_case.stage_inputs(buf, inp)


def _poisoned_y(n: int, hidden: int, device) -> torch.Tensor:
    return torch.full((n, hidden), float('nan'), dtype=torch.bfloat16, device=device)


def _check_output(what: str, y: torch.Tensor, weights, inp, tol: float, clamp: Optional[float]) -> float:
    """calc_diff of y against the reference; EPCheckError on NaN rows or a diff >= tol."""
    n = inp.x_q.shape[0]
    if tuple(y.shape) != (n, weights.l2_ref.shape[1]):
        raise EPCheckError(f'{what}: y has shape {list(y.shape)}, expected [{n}, {weights.l2_ref.shape[1]}]')
    if n == 0:
        return 0.0
    nan_rows = torch.isnan(y.float()).any(dim=1)
    if bool(nan_rows.any()):
        rows = nan_rows.nonzero().flatten()
        raise EPCheckError(f'{what}: {rows.numel()} of {n} rows of y not written (NaN), first {rows[:8].tolist()}')
    diff = calc_diff(y.float(), moe_case.reference(weights, inp, clamp))
    if not diff < tol:
        raise EPCheckError(f'{what}: calc_diff {diff:.3e} >= {tol:.0e} (n = {n})')
    return diff


def capture_call(fn) -> torch.cuda.CUDAGraph:
    """Capture one call of `fn` (already run eagerly: compiled and loaded) on a side stream. thread_local: NCCL's watchdog thread may query
    events while this thread captures, which the default ('global') mode turns into an error."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side, capture_error_mode='thread_local'):
        fn()
    torch.cuda.synchronize()
    return graph


def check_ep_rank(rank: int, world_size: int, mma_type: str, shape: Shape, ns: Optional[Sequence[int]] = None,
                  seed: int = 0, *, n_max: Optional[int] = None, num_calls: int = DEFAULT_NUM_CALLS,
                  group=None, activation_clamp: Optional[float] = None,
                  sample_every: int = SAMPLE_EVERY, device=None) -> Dict[str, Any]:
    """Check the fused kernel on this rank of a real multi-GPU group (see the module docstring).

    Args:
        rank, world_size: this process's rank in `group` and the group's size.
        mma_type: "fp8xfp8", "fp8xfp4" or "bf16xbf16" (a format not built raises NotImplementedError
            on every rank).
        shape: "small" / "mid" or (hidden, intermediate, experts, topk); experts a multiple of world_size.
        ns: tokens of every rank for the eager cases (length world_size; default `default_ns`).
        seed: weights seed (the same on every rank); inputs derive per-rank seeds from it.
        n_max: the buffer's num_max_tokens_per_rank (default: max(ns), at least 1); also the largest
            n of the back-to-back calls.
        num_calls: back-to-back calls.
        group: the process group (default: the world).
        activation_clamp: passed to every call and to the reference.
        sample_every: back-to-back calls between reference checks.
        device: where tensors live (default: the current CUDA device; tests of the plumbing with a
            stand-in kernel pass "cpu").

    Returns:
        dict: worst calc_diff per phase ('plain', 'masked', 'skewed', 'graph', 'back_to_back'),
        'calls' (kernel calls made by this rank), 'ns', 'n_max', 'peers' (number of distinct peer
        buffer addresses), 'seconds'.

    Raises:
        RanksFailed (on every rank) when a phase failed on any rank; NotImplementedError when the
        format is not built.
    """
    import torch.distributed as dist
    from ..mega import api as mega_api
    from ..mega.buffer import get_symm_buffer_for_mega_moe

    start = time.perf_counter()
    group = group if group is not None else dist.group.WORLD
    if mma_type not in TOLERANCE:
        raise ValueError(f'mma_type = {mma_type!r} is invalid: expected one of {tuple(TOLERANCE)}')
    hidden, inter, experts, topk = _resolve_shape(shape)
    if experts % world_size:
        raise ValueError(f'{experts} experts cannot be split over {world_size} ranks')
    ns = list(ns) if ns is not None else default_ns(world_size, n_max or max(CHECK_MAX_TOKENS.values()))
    if len(ns) != world_size or min(ns) < 0:
        raise ValueError(f'ns = {ns} is invalid: expected {world_size} token counts >= 0')
    n_max = n_max or max(max(ns), 1)
    if max(ns) > n_max:
        raise ValueError(f'ns = {ns} exceeds n_max = {n_max}')
    device = torch.device(device) if device is not None else torch.device('cuda', torch.cuda.current_device())
    tol = TOLERANCE[mma_type]
    fn = mega_api.mega_moe_function(mma_type)
    e_local = experts // world_size
    report: Dict[str, Any] = dict(ns=ns, n_max=n_max)
    calls = 0

    # ---- weights: the same on every rank -------------------------------------------------------
    with all_ranks_agree(f'{mma_type} weights', group) as step:
        weights = moe_case.make_weights(mma_type, hidden, inter, experts, world_size, seed, device=device)
        l1, l2 = weights.per_rank[rank]
        weights.per_rank = [lw if r == rank else None for r, lw in enumerate(weights.per_rank)]
        step.share = _weights_checksum(weights)
    # Deterministic from the gathered values: every rank takes the same branch
    differ = [r for r, s in enumerate(step.gathered) if s != step.gathered[0]]
    if differ:
        raise RanksFailed('weights identical on every rank',
                          [(r, 'EPCheckError', 'weights differ from rank 0 (same seed)') for r in differ])

    # ---- the symmetric buffer (collective: every rank allocates and maps the peers) ------------
    with all_ranks_agree('get_symm_buffer_for_mega_moe', group) as step:
        buf = get_symm_buffer_for_mega_moe(group, experts, n_max, topk, hidden, inter, mma_type)
        check_peer_table(buf, rank, world_size)
        step.share = buf.peer_ptrs
    report['peers'] = len(set(step.gathered[rank]))

    # ---- 1. eager cases -------------------------------------------------------------------------
    hot_expert = (world_size - 1) * e_local + (1 % e_local)   # owned by the last rank
    cases = [('plain', {}), ('masked', dict(mask_frac=MASK_FRAC)), ('skewed', dict(hot_expert=hot_expert))]
    stats = torch.zeros(e_local, dtype=torch.int32, device=device)
    with all_ranks_agree('eager cases', group) as step:
        outputs = []
        counts = torch.zeros(experts, dtype=torch.int64, device=device)
        for i, (name, routing) in enumerate(cases):
            n = ns[(rank + i) % world_size]   # rotate: every rank gets 0 and n_max tokens in some case
            inp = moe_case.make_inputs(mma_type, [n], hidden, experts, topk, _seed(seed, 1, i, rank),
                                       device=device, **routing)[0]
            _stage(buf, inp)
            y = _poisoned_y(n, hidden, device)
            fn(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats, activation_clamp=activation_clamp)
            calls += 1
            outputs.append((name, y, inp))
            ids = inp.topk_idx[inp.topk_idx >= 0]
            counts += torch.bincount(ids, minlength=experts)
        torch.cuda.synchronize()
        buf.check()
        for name, y, inp in outputs:
            report[name] = _check_output(name, y, weights, inp, tol, activation_clamp)
        step.share = counts.cpu()
    received = torch.stack(step.gathered).sum(0)[rank * e_local:(rank + 1) * e_local]
    with all_ranks_agree('cumulative_local_expert_recv_stats', group):
        if not torch.equal(stats.cpu().long(), received):
            raise EPCheckError(f'stats {stats.cpu().tolist()} != tokens received per local expert '
                               f'{received.tolist()}')
    del outputs

    # ---- 2. CUDA graph: capture once, replay with changed inputs --------------------------------
    n = ns[rank]
    dist.barrier(group=group)
    with all_ranks_agree('CUDA graph capture and replay', group):
        y_graph = torch.empty(n, hidden, dtype=torch.bfloat16, device=device)
        graph = capture_call(lambda: fn(y_graph, l1, l2, buf, activation_clamp=activation_clamp))
        worst = 0.0
        for j, mask_frac in enumerate((0.0, MASK_FRAC)):
            inp = moe_case.make_inputs(mma_type, [n], hidden, experts, topk, _seed(seed, 2, j, rank),
                                       device=device, mask_frac=mask_frac)[0]
            _stage(buf, inp)
            y_graph.fill_(float('nan'))
            graph.replay()
            calls += 1
            _stage(buf, inp)
            y_eager = _poisoned_y(n, hidden, device)
            fn(y_eager, l1, l2, buf, activation_clamp=activation_clamp)
            calls += 1
            torch.cuda.synchronize()
            buf.check()
            if not torch.equal(y_graph.view(torch.int16), y_eager.view(torch.int16)):
                bad = (y_graph.view(torch.int16) != y_eager.view(torch.int16)).any(dim=1).sum().item()
                raise EPCheckError(f'graph replay {j}: {bad} of {n} rows differ from the eager call on the same inputs')
            worst = max(worst, _check_output(f'graph replay {j}', y_graph, weights, inp, tol, activation_clamp))
        report['graph'] = worst
        del graph

    # ---- 3. back-to-back calls with changing n, routing, masks and skew -------------------------
    dist.barrier(group=group)
    with all_ranks_agree(f'{num_calls} back-to-back calls', group):
        g = torch.Generator().manual_seed(_seed(seed, 3, rank))
        samples = []
        for call in range(num_calls):
            n = 0 if call % (world_size + 1) == rank else int(torch.randint(0, n_max + 1, (1,), generator=g))
            routing: Dict[str, Any] = dict(mask_frac=0.2 * (call % 3))
            if call % 5 == 4:
                routing['hot_expert'] = call % experts
            inp = moe_case.make_inputs(mma_type, [n], hidden, experts, topk, _seed(seed, 3, call, rank),
                                       device=device, **routing)[0]
            _stage(buf, inp)       # stream-ordered after the previous call: no host sync in between
            y = _poisoned_y(n, hidden, device)
            fn(y, l1, l2, buf, activation_clamp=activation_clamp)
            calls += 1
            if call % sample_every == 0 or call == num_calls - 1:
                samples.append((call, y, inp))
        torch.cuda.synchronize()
        buf.check()
        report['back_to_back'] = max([_check_output(f'back-to-back call {c}', y, weights, inp, tol, activation_clamp)
                                      for c, y, inp in samples] or [0.0])
        del samples

    # Every rank made the same calls (the protocol's call counting depends on it)
    with all_ranks_agree('same number of calls on every rank', group) as step:
        step.share = calls
    if len(set(step.gathered)) != 1:
        raise RanksFailed('same number of calls on every rank',
                          [(r, 'EPCheckError', f'{c} calls') for r, c in enumerate(step.gathered)])
    report['calls'] = calls
    report['seconds'] = time.perf_counter() - start
    return report


def run_check_cases(rank: int, world_size: int, cases: Sequence[Tuple[str, str]], seed: int = 0,
                    num_calls: int = DEFAULT_NUM_CALLS) -> Dict[str, Any]:
    """`check_ep_rank` for each (format, shape name) case, one after the other, on this rank.

    A failed case does not stop the others (every rank saw it fail, so all go on together).

    Returns:
        {'rank', 'world_size', 'device' (GPU name), 'env' (the NVLink-multicast variables as this
        process sees them), 'cases': {'<format> <shape>': {'status': 'ok' | 'fail' | 'not built',
        'report': dict or None, 'error': str}}}.
    """
    import os

    import torch.distributed as dist

    from .multi_process import NO_MULTICAST_ENV, process_env_report
    allow_cold_jit()
    out: Dict[str, Any] = dict(rank=rank, world_size=world_size, device=torch.cuda.get_device_name(),
                               env={k: os.environ.get(k) for k in NO_MULTICAST_ENV},
                               process_env=process_env_report(), cases={})
    for mma_type, shape in cases:
        key = f'{mma_type} {shape}'
        ns = default_ns(world_size, CHECK_MAX_TOKENS.get(shape, 256))
        try:
            report = check_ep_rank(rank, world_size, mma_type, shape, ns, seed, num_calls=num_calls)
            out['cases'][key] = dict(status='ok', report=report, error='')
        except NotImplementedError as e:
            out['cases'][key] = dict(status='not built', report=None, error=f'NotImplementedError: {e}')
        except RanksFailed as e:
            out['cases'][key] = dict(status='fail', report=None, error=str(e))
        # Free this case's weights and buffer before the next one allocates
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        dist.barrier()
    return out


def probe_rank(rank: int, world_size: int, shape: Shape = 'small', mma_type: str = 'bf16xbf16') -> Dict[str, Any]:
    """First contact without the kernel: this rank's GPU and peer access, an NCCL all_reduce, then one
    symmetric buffer (`get_symm_buffer_for_mega_moe`: rendezvous, the peer-table probe that reads
    every peer's marker through the kernel's addresses). A `spawn` / torchrun target.

    Returns {'rank', 'device', 'torch', 'env', 'peer_access' (can_device_access_peer to every other
    visible GPU), 'all_reduce' (sum of rank + 1: expected world_size (world_size + 1) / 2),
    'symm_backend', 'buffer' (repr), 'peer_ptrs' (hex), 'offsets' (buffer - symmetric base, per
    rank), 'seconds'}. Raises RanksFailed on every rank if the buffer failed on any.
    """
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from ..mega.buffer import get_symm_buffer_for_mega_moe
    from .multi_process import process_env_report
    start = time.perf_counter()
    index = torch.cuda.current_device()
    device = torch.device('cuda', index)
    out: Dict[str, Any] = dict(rank=rank, world_size=world_size, device=f'{index}: {torch.cuda.get_device_name()}',
                               torch=torch.__version__, env=process_env_report())
    out['peer_access'] = {j: bool(torch.cuda.can_device_access_peer(index, j))
                          for j in range(torch.cuda.device_count()) if j != index}
    t = torch.full((1,), float(rank + 1), device=device)
    dist.all_reduce(t)
    out['all_reduce'] = float(t.item())
    try:
        out['symm_backend'] = symm_mem.get_backend(device)
    except Exception as e:  # noqa: BLE001 - older torch: no get_backend
        out['symm_backend'] = f'unknown ({type(e).__name__})'
    hidden, inter, experts, topk = _resolve_shape(shape)
    with all_ranks_agree('get_symm_buffer_for_mega_moe', dist.group.WORLD) as step:
        buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, experts, 64, topk, hidden, inter, mma_type)
        check_peer_table(buf, rank, world_size)
        bases = [int(p) for p in buf._handle.buffer_ptrs]
        step.share = buf.buffer.data_ptr() - bases[rank]
    out.update(buffer=repr(buf), peer_ptrs=[hex(p) for p in buf.peer_ptrs], offsets=step.gathered,
               seconds=time.perf_counter() - start)
    del buf
    torch.cuda.synchronize()
    dist.barrier()
    return out


def format_case_results(results: Sequence[Dict[str, Any]], first_rank: int = 0) -> str:
    """One line per (rank, case): status, worst calc_diff per phase, calls, seconds; then errors."""
    lines = []
    for i, result in enumerate(results):
        rank = result.get('rank', first_rank + i)
        for key, case in result['cases'].items():
            if case['status'] == 'ok':
                r = case['report']
                diffs = ' '.join(f'{p} {r[p]:.1e}' for p in ('plain', 'masked', 'skewed', 'graph', 'back_to_back'))
                lines.append(f'rank {rank}/{result["world_size"]} {key:<16} ok    ns {r["ns"]}  calc_diff: {diffs}  '
                             f'{r["calls"]} calls  {r["seconds"]:.1f} s')
            else:
                first = case['error'].splitlines()[0] if case['error'] else ''
                lines.append(f'rank {rank}/{result["world_size"]} {key:<16} {case["status"].upper()}  {first}')
                lines += [f'    {line}' for line in case['error'].splitlines()[1:]]
    return '\n'.join(lines)
