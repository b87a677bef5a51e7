"""`python -m deep_gemm.bench --ep N` on N GPUs: one process per GPU, real NVLink (issue 6).

Every rank builds the same weights (same seed) and keeps its experts, draws its own n tokens per
call, and times, in the same run:

- fused: the Mega MoE kernel on its symmetric buffer (`get_symm_buffer_for_mega_moe(group, ...)`),
  median of CUDA-graph replays (eager calls if capture fails on any rank), L2 flushed before each;
- baseline (`AllToAllMoEBaseline`): `all_to_all_single` of the routed (token, slot) rows to the
  experts' owners, the torch grouped-GEMM MoE of `bench_utils.TorchMoEBaseline` on the rows each
  rank received, `all_to_all_single` of the BF16 results back and the weighted top-k sum. It sizes
  its exchanges on the host (one synchronization per call), so it is timed eagerly.

Per rank and token count a row reports (besides `bench.make_row`'s fields, here for THIS rank):
    routed_pairs     (token, slot) pairs this rank's experts compute, from every rank's tokens
    experts_touched  this rank's experts that receive at least one token
    TFLOPS, HBM GB/s `bench_utils.row_metrics` of those pairs and experts and this rank's n tokens
    remote_pairs     of routed_pairs, those whose token lives on another rank
    nvlink_bytes     remote_pairs * (dispatch row + combine row): the kernel on this rank pulls each
                     remote token (x, plus its per-128 FP32 scales for FP8) from its source rank and
                     writes the BF16 L2 row back into the source's combine slot
    NVLink GB/s      nvlink_bytes / fused time
    rank             the rank ('max' in the summary rows: the slowest rank's times, total pairs and
                     NVLink bytes over all ranks, aggregate NVLink GB/s)
Rank 0 prints the table, then a summary (slowest rank per token count), and writes the JSON and plot.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .bench_utils import (FP8_BLOCK, L2Flusher, MoEShape, TorchMoEBaseline, event_median_us, row_metrics)
from .multi_process import (NO_MULTICAST_ENV, RankError, RanksFailed, all_ranks_agree, destroy, init_from_env,
                            process_env_report, spawn, torchrun_env)

# Default sweep of the multi-process mode (DESIGN.md §8 targets: decode at 1-8 tokens, prefill at 4096)
EP_SHAPES: Tuple[str, ...] = ('v4-flash',)
EP_TOKENS: Tuple[int, ...] = (1, 8, 128, 512, 4096)
# Bytes of the combine row a remote owner writes back per (token, slot): BF16 hidden
COMBINE_BYTES_PER_ELEMENT = 2
# Baseline dispatch rows carry the local expert id (int32) and the routing weight (float32)
_ROUTE_BYTES = 4 + 4


# --------------------------------------------------------------------------------------------------
# NVLink traffic
# --------------------------------------------------------------------------------------------------

def dispatch_row_bytes(mma_type: str, hidden: int) -> int:
    """Bytes the owner pulls per remote (token, slot): x (E4M3, or BF16 for bf16xbf16) plus, for FP8,
    one float32 scale per 128 channels."""
    if mma_type == 'bf16xbf16':
        return 2 * hidden
    if mma_type in ('fp8xfp8', 'fp8xfp4'):
        return hidden + 4 * (hidden // FP8_BLOCK)
    raise ValueError(f'mma_type = {mma_type!r} is invalid: expected fp8xfp8, bf16xbf16 or fp8xfp4')


def combine_row_bytes(hidden: int) -> int:
    """Bytes the owner writes back per remote (token, slot): one BF16 row."""
    return COMBINE_BYTES_PER_ELEMENT * hidden


def pairs_by_owner(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> List[int]:
    """Non-masked (token, slot) pairs of one rank's int64 [n, topk] routing, per owner rank of the expert."""
    if num_experts % num_ranks:
        raise ValueError(f'{num_experts} experts cannot be split over {num_ranks} ranks')
    ids = topk_idx[topk_idx >= 0].flatten().to('cpu')
    return torch.bincount(ids // (num_experts // num_ranks), minlength=num_ranks)[:num_ranks].tolist()


def nvlink_bytes(mma_type: str, hidden: int, pair_matrix: Sequence[Sequence[int]], rank: int) -> Dict[str, int]:
    """NVLink bytes moved by `rank`'s kernel in one call.

    Args:
        pair_matrix: pair_matrix[src][owner] = pairs of rank src's tokens routed to owner's experts
            (`pairs_by_owner` of every rank).
        rank: the owner whose traffic is counted.

    Returns:
        {'remote_pairs', 'dispatch' (pulled x rows), 'combine' (BF16 rows written back), 'total'}.
    """
    remote = sum(int(row[rank]) for src, row in enumerate(pair_matrix) if src != rank)
    dispatch = remote * dispatch_row_bytes(mma_type, hidden)
    combine = remote * combine_row_bytes(hidden)
    return dict(remote_pairs=remote, dispatch=dispatch, combine=combine, total=dispatch + combine)


# --------------------------------------------------------------------------------------------------
# The all-to-all baseline
# --------------------------------------------------------------------------------------------------

class AllToAllMoEBaseline:
    """EP MoE in plain torch + NCCL: all_to_all dispatch -> grouped-GEMM MoE on local experts ->
    all_to_all back -> weighted top-k sum.

    Args:
        local: a `TorchMoEBaseline` over this rank's experts (global expert e is local e % E_local).
        rank, num_ranks: this rank and the group size; num_experts: all ranks' experts.
        group: the process group (None: the world).

    Call it as `baseline(x, x_sf, topk_idx, topk_weights)` -> bfloat16 [n, H], like TorchMoEBaseline.
    Every rank must call it the same number of times (it runs three all_to_all_single). A failure of
    the local GEMMs does not break that: the rank sends zeros and records the error in `error`.
    """

    def __init__(self, local: TorchMoEBaseline, rank: int, num_ranks: int, num_experts: int, group=None) -> None:
        if num_experts % num_ranks or local.num_experts != num_experts // num_ranks:
            raise ValueError(f'local baseline has {local.num_experts} experts: expected num_experts / num_ranks = '
                             f'{num_experts} / {num_ranks}')
        self.local = local
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_experts = num_experts
        self.num_local_experts = num_experts // num_ranks
        self.group = group
        self.error: Optional[str] = None

    def describe(self) -> str:
        """What the baseline runs, for the table's `baseline` column."""
        return f'all_to_all + {self.local.describe()} + all_to_all'

    def dispatch(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor):
        """Send every routed (token, slot) row to its expert's owner. Returns (received x, x_sf, local
        expert ids [m, 1], weights [m, 1]) and the context `combine` needs."""
        import torch.distributed as dist
        n, topk = topk_idx.shape
        flat = topk_idx.reshape(-1)
        valid = flat >= 0
        owner = torch.where(valid, flat // self.num_local_experts, torch.full_like(flat, self.num_ranks))
        order = torch.argsort(owner, stable=True)   # by owner rank; masked slots last
        send = torch.zeros(self.num_ranks + 1, dtype=torch.int64, device=flat.device)
        send.scatter_add_(0, owner, torch.ones_like(owner))
        send = send[:self.num_ranks].contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        splits = torch.stack([send, recv]).cpu()   # the host sizes the exchange: one synchronization
        send_splits, recv_splits = splits[0].tolist(), splits[1].tolist()
        rows = order[:sum(send_splits)]
        token = rows // topk

        # One byte row per pair: [x | x_sf | local expert int32 | weight float32]
        parts = [x[token].view(torch.uint8)]
        if x_sf is not None:
            parts.append(x_sf[token].contiguous().view(torch.uint8))
        parts.append((flat[rows] % self.num_local_experts).to(torch.int32).unsqueeze(1).view(torch.uint8))
        parts.append(topk_weights.reshape(-1)[rows].float().unsqueeze(1).view(torch.uint8))
        packed = torch.cat(parts, 1)
        received = torch.empty(sum(recv_splits), packed.shape[1], dtype=torch.uint8, device=packed.device)
        dist.all_to_all_single(received, packed, recv_splits, send_splits, group=self.group)

        x_bytes = x.shape[1] * x.element_size()
        sf_bytes = 0 if x_sf is None else x_sf.shape[1] * 4
        x_recv = received[:, :x_bytes].contiguous().view(x.dtype)
        sf_recv = None if x_sf is None else received[:, x_bytes:x_bytes + sf_bytes].contiguous().view(torch.float32)
        expert = received[:, -_ROUTE_BYTES:-4].contiguous().view(torch.int32).long()
        weight = received[:, -4:].contiguous().view(torch.float32)
        return (x_recv, sf_recv, expert, weight), (n, token, send_splits, recv_splits)

    def compute(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], expert: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        """The local experts on the received rows: bfloat16 [m, H], each row times its weight."""
        if x.shape[0] == 0:
            return torch.empty(0, self.local.hidden, dtype=torch.bfloat16, device=x.device)
        try:
            return self.local(x, x_sf, expert, weight)
        except Exception as e:  # noqa: BLE001 - keep the collectives in step; the row reports the error
            self.error = f'local GEMMs: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ""}'
            return torch.zeros(x.shape[0], self.local.hidden, dtype=torch.bfloat16, device=x.device)

    def combine(self, out: torch.Tensor, context) -> torch.Tensor:
        """Send the result rows back to their tokens' ranks and sum each token's slots in FP32."""
        import torch.distributed as dist
        n, token, send_splits, recv_splits = context
        hidden = out.shape[1]
        # As bytes: the bits of BF16, whatever dtypes the backend supports
        back = torch.empty(sum(send_splits), 2 * hidden, dtype=torch.uint8, device=out.device)
        dist.all_to_all_single(back, out.contiguous().view(torch.uint8), send_splits, recv_splits, group=self.group)
        y = torch.zeros(n, hidden, dtype=torch.float32, device=out.device)
        y.index_add_(0, token, back.view(torch.bfloat16).float())
        return y.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        received, context = self.dispatch(x, x_sf, topk_idx, topk_weights)
        return self.combine(self.compute(*received), context)

    def prepare(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> str:
        """One call that also lets the local baseline pick its GEMM strategy on the rows this rank
        receives (`TorchMoEBaseline.select`); returns select's note."""
        received, context = self.dispatch(x, x_sf, topk_idx, topk_weights)
        note = ''
        if received[0].shape[0]:
            try:
                note = self.local.select(*received)
            except Exception as e:  # noqa: BLE001 - same as compute: stay in step with the peers
                note = f'select: {type(e).__name__}'
        self.combine(self.compute(*received), context)
        return note


def local_baseline(mma_type: str, weights, rank: int, num_ranks: int) -> TorchMoEBaseline:
    """TorchMoEBaseline over `rank`'s experts of `moe_case.make_weights` weights (own copies: the full
    reference weights can be freed after)."""
    from ..mega.transform import inverse_transform_weights_for_mega_moe
    e_local = weights.l1_ref.shape[0] // num_ranks
    sl = slice(rank * e_local, (rank + 1) * e_local)
    fp8 = None
    if mma_type == 'fp8xfp8':
        (w1, s1), (w2, s2) = inverse_transform_weights_for_mega_moe(*weights.per_rank[rank])
        fp8 = ((w1, s1), (w2, s2))
    return TorchMoEBaseline(weights.l1_ref[sl].to(torch.bfloat16, copy=True),
                            weights.l2_ref[sl].to(torch.bfloat16, copy=True), dtype=torch.bfloat16,
                            fp8_weights=fp8, weight_format=mma_type)


# --------------------------------------------------------------------------------------------------
# Rows and tables
# --------------------------------------------------------------------------------------------------

_EP_COLUMNS = (  # header, key, digits
    ('format', 'format', 0), ('shape', 'shape', 0), ('ep', 'ep', 0), ('rank', 'rank', 0), ('n', 'n', 0),
    ('fused us', 'fused_us', 1), ('TFLOPS', 'tflops', 1), ('HBM GB/s', 'hbm_gbs', 0),
    ('NVLink GB/s', 'nvlink_gbs', 0), ('remote', 'remote_pairs', 0), ('base us', 'baseline_us', 1),
    ('speedup', 'speedup', 2), ('diff', 'diff', 0), ('baseline', 'baseline', 0),
)
_EP_WIDTHS = (9, 11, 2, 4, 5, 8, 6, 8, 11, 6, 8, 7, 7, 0)
_LEFT = ('format', 'shape', 'baseline')


def format_ep_table(rows: Sequence[Dict[str, Any]], header: bool = True) -> str:
    """Per-rank rows as an aligned table; status (if not ok), eager timings and notes on a `^` line."""
    from ..bench import _fmt
    cells = [[c[0] for c in _EP_COLUMNS]]
    for row in rows:
        cells.append([f'{row[key]:.1e}' if key == 'diff' and isinstance(row.get(key), float)
                      else _fmt(row.get(key), digits) for _, key, digits in _EP_COLUMNS])
    widths = [max([w] + [len(c[i]) for c in cells]) for i, w in enumerate(_EP_WIDTHS)]
    out = []
    for i, line in enumerate(cells):
        if i == 0 and not header:
            continue
        out.append('  '.join(c.ljust(w) if key in _LEFT else c.rjust(w)
                             for c, w, (_, key, _) in zip(line, widths, _EP_COLUMNS)).rstrip())
        if i == 0:
            out.append('-' * len(out[-1]))
            continue
        row = rows[i - 1]
        extra = [str(row['status'])] if row.get('status') not in (None, 'ok') else []
        extra += [f'{who}: {row[f"{who}_timing"]}' for who in ('fused', 'baseline')
                  if row.get(f'{who}_timing') not in (None, 'graph')]
        extra += [str(row['note'])] if row.get('note') else []
        if extra:
            out.append('    ^ ' + '; '.join(extra))
    return '\n'.join(out)


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (format, shape, n): the slowest rank's fused and baseline times (the layer is as
    fast as its slowest rank), total routed pairs and NVLink bytes, aggregate NVLink GB/s."""
    from ..bench import SHAPES, make_row
    groups: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row['format'], row['shape'], row['n']), []).append(row)
    out = []
    for (mma_type, shape_name, n), group in groups.items():
        ref = group[0]
        shape = SHAPES.get(shape_name) or MoEShape(shape_name, ref['hidden'], ref['intermediate'], ref['experts'],
                                                   ref['topk'])
        fused = [r['fused_us'] for r in group]
        base = [r['baseline_us'] for r in group]
        fused_us = max(fused) if all(v is not None for v in fused) else None
        base_us = max(base) if all(v is not None for v in base) else None
        pairs = sum(r['routed_pairs'] or 0 for r in group)
        nv = sum(r.get('nvlink_bytes') or 0 for r in group)
        statuses = [r['status'] for r in group if r['status'] != 'ok']
        diffs = [r['diff'] for r in group if r.get('diff') is not None]
        slowest = max(range(len(group)), key=lambda i: fused[i] or 0.0) if fused_us else None
        row = make_row(mma_type, shape, n, ref['ep'], status=statuses[0] if statuses else 'ok',
                       routed_pairs=pairs, fused_us=fused_us, fused_timing=ref['fused_timing'],
                       baseline=ref['baseline'], baseline_us=base_us, baseline_timing=ref['baseline_timing'],
                       speedup=base_us / fused_us if fused_us and base_us else None,
                       diff=max(diffs) if diffs else None,
                       note=f'slowest of {len(group)} ranks' + (f': rank {group[slowest]["rank"]}'
                                                                 if slowest is not None else ''))
        row.update(rank='max', nvlink_bytes=nv, nvlink_gbs=nv / (fused_us * 1e3) if fused_us else None)
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------------
# One rank of the sweep
# --------------------------------------------------------------------------------------------------

def _failure_text(e: RanksFailed) -> str:
    """What failed and the first rank's message, on one line."""
    if not e.failures:
        return str(e).splitlines()[0]
    rank, exc_type, message = e.failures[0]
    first = message.splitlines()[0][:160] if message else ''
    return f'{e.what} failed on rank(s) {", ".join(str(f[0]) for f in e.failures)} (rank {rank}: {exc_type}: {first})'


def _first_line(e: BaseException) -> str:
    from ..bench import _error_text
    return _error_text(e)


def _stage(buf, inp) -> None:
    from .moe_case import stage_inputs
    stage_inputs(buf, inp)


def _bench_ep_row(rank: int, world_size: int, mma_type: str, shape: MoEShape, n: int, l1, l2, buf,
                  baseline: AllToAllMoEBaseline, reps: int, flush, seed: int) -> Dict[str, Any]:
    """Time fused and baseline on this rank for one fresh routing; returns this rank's row."""
    import torch.distributed as dist

    from .. import bench
    from ..mega import api as mega_api
    from .ep_check import capture_call
    from .moe_case import make_inputs
    from .reference import calc_diff

    fn = mega_api.mega_moe_function(mma_type)
    device = buf.device
    e_local = shape.num_experts // world_size
    fields: Dict[str, Any] = {}
    notes: List[str] = []

    with all_ranks_agree('inputs and routing') as step:
        inp = make_inputs(mma_type, [n], shape.hidden, shape.num_experts, shape.num_topk, seed + 7919 * rank,
                          device=device)[0]
        ids = inp.topk_idx[inp.topk_idx >= 0]
        step.share = (pairs_by_owner(inp.topk_idx, shape.num_experts, world_size),
                      torch.bincount(ids, minlength=shape.num_experts).cpu())
    matrix = [s[0] for s in step.gathered]
    per_expert = torch.stack([s[1] for s in step.gathered]).sum(0)
    pairs = sum(row[rank] for row in matrix)
    touched = int((per_expert[rank * e_local:(rank + 1) * e_local] > 0).sum())
    nv = nvlink_bytes(mma_type, shape.hidden, matrix, rank)
    fields.update(routed_pairs=pairs, experts_touched=touched)

    # ---- fused ------------------------------------------------------------------------------------
    fused_y = None
    y = torch.empty(n, shape.hidden, dtype=torch.bfloat16, device=device)
    try:
        with all_ranks_agree('fused warm-up'):   # JIT compile and load, then checked calls
            _stage(buf, inp)
            for _ in range(2):
                fn(y, l1, l2, buf)
            torch.cuda.synchronize()
            buf.check()
        with all_ranks_agree('fused capture') as step:
            try:   # capture launches nothing: a failure here leaves the ranks' call counts equal
                graph = capture_call(lambda: fn(y, l1, l2, buf))
                step.share = None
            except Exception as e:  # noqa: BLE001 - capture failed here: every rank times eagerly
                graph, step.share = None, _first_line(e)
        failed = [(r, why) for r, why in enumerate(step.gathered) if why]
        how = 'graph' if not failed else f'eager: capture failed on rank {failed[0][0]}: {failed[0][1]}'
        run = graph.replay if not failed else (lambda: fn(y, l1, l2, buf))
        y.fill_(float('nan'))   # after the warm-up: the output checked below is the timed runs' own
        dist.barrier()
        with all_ranks_agree('fused timing'):
            us = event_median_us(run, reps, flush)
            torch.cuda.synchronize()
            buf.check()
        fused_y = y.clone()
        fields.update(fused_us=us, fused_timing=how)
    except NotImplementedError as e:
        fields['status'] = bench.NOT_BUILT
        notes.append(_first_line(e))
    except RanksFailed as e:
        fields['status'] = 'error'
        notes.append(f'fused: {_failure_text(e)}')
        # Every rank is here: clear the recorded error so that the next rows can call the kernel
        torch.cuda.synchronize()
        buf.reset()
        dist.barrier()

    # ---- baseline ---------------------------------------------------------------------------------
    dist.barrier()
    try:
        box: List[torch.Tensor] = []

        def run_baseline() -> None:
            box[:] = [baseline(inp.x_q, inp.x_sf, inp.topk_idx, inp.topk_weights)]

        with all_ranks_agree('baseline'):
            baseline.error = None
            note = baseline.prepare(inp.x_q, inp.x_sf, inp.topk_idx, inp.topk_weights)
            if note:
                notes.append(f'baseline fallback ({note})')
            us = event_median_us(run_baseline, reps, flush)
        fields.update(baseline=baseline.describe(), baseline_us=us,
                      baseline_timing='eager: host-sized all_to_all (one sync per call)')
        if baseline.error:
            notes.append(f'baseline: {baseline.error}')
        if fused_y is not None and n > 0:
            fields['diff'] = diff = calc_diff(fused_y.float(), box[-1].float())
            if not diff < bench.DIFF_WARNING:   # a wrong answer fails the run, as in bench.bench_row
                fields['status'] = 'mismatch'
                notes.append(f'CHECK: fused and baseline outputs disagree (calc_diff {diff:.1e})')
    except RanksFailed as e:
        notes.append(f'baseline: {_failure_text(e)}')

    fused_us = fields.get('fused_us')
    fields.update(row_metrics(mma_type, shape, n, pairs, touched, fused_us))
    if fused_us and fields.get('baseline_us'):
        fields['speedup'] = fields['baseline_us'] / fused_us
    row = bench.make_row(mma_type, shape, n, world_size, note='; '.join(notes), **fields)
    row.update(rank=rank, remote_pairs=nv['remote_pairs'], nvlink_bytes=nv['total'],
               nvlink_dispatch_bytes=nv['dispatch'], nvlink_combine_bytes=nv['combine'],
               nvlink_gbs=nv['total'] / (fused_us * 1e3) if fused_us else None)
    return row


def _rows_for_all(mma_type: str, shape: MoEShape, tokens: Sequence[int], rank: int, world_size: int,
                  status: str, note: str) -> List[Dict[str, Any]]:
    from ..bench import make_row
    rows = []
    for n in tokens:
        row = make_row(mma_type, shape, n, world_size, status=status, note=note)
        row.update(rank=rank, remote_pairs=None, nvlink_bytes=None, nvlink_dispatch_bytes=None,
                   nvlink_combine_bytes=None, nvlink_gbs=None)
        rows.append(row)
    return rows


def _bench_format_shape(rank: int, world_size: int, mma_type: str, shape: MoEShape, tokens: Sequence[int],
                        reps: int, flush, seed: int, device: torch.device) -> List[Dict[str, Any]]:
    """Every token count of one (format, shape) on this rank; returns every rank's rows (all ranks)."""
    import torch.distributed as dist

    from .. import bench
    from ..mega.buffer import get_symm_buffer_for_mega_moe
    from .ep_check import check_peer_table
    from .moe_case import make_weights

    lead = rank == 0
    start = time.perf_counter()
    mine: List[Dict[str, Any]] = []
    try:
        with all_ranks_agree(f'{mma_type} {shape.name}: weights'):
            weights = make_weights(mma_type, shape.hidden, shape.intermediate, shape.num_experts, world_size, seed,
                                   device=device)
            l1, l2 = weights.per_rank[rank]
            local = local_baseline(mma_type, weights, rank, world_size)
            del weights   # the full reference weights: only this rank's experts are needed from here
            torch.cuda.empty_cache()
        with all_ranks_agree('symmetric buffer'):
            buf = get_symm_buffer_for_mega_moe(dist.group.WORLD, shape.num_experts, max(tokens), shape.num_topk,
                                               shape.hidden, shape.intermediate, mma_type)
            check_peer_table(buf, rank, world_size)
        baseline = AllToAllMoEBaseline(local, rank, world_size, shape.num_experts)
    except NotImplementedError as e:
        mine = _rows_for_all(mma_type, shape, tokens, rank, world_size, bench.NOT_BUILT, _first_line(e))
    except RanksFailed as e:
        mine = _rows_for_all(mma_type, shape, tokens, rank, world_size, 'error', _failure_text(e))
    if mine:
        return [r for rows in _all_gather(mine) for r in rows]

    if lead:
        print(f'# {mma_type} {shape}: weights and buffers in {time.perf_counter() - start:.1f} s', flush=True)
    every: List[Dict[str, Any]] = []
    for i, n in enumerate(tokens):
        try:
            row = _bench_ep_row(rank, world_size, mma_type, shape, n, l1, l2, buf, baseline, reps, flush,
                                seed=seed + 1000 * i + n)
        except RanksFailed as e:
            row = _rows_for_all(mma_type, shape, [n], rank, world_size, 'error', _failure_text(e))[0]
        rows = _all_gather(row)
        if lead:
            print(format_ep_table(rows, header=False), flush=True)
        every += rows
    del buf, baseline, local, l1, l2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    return every


def _all_gather(obj: Any) -> List[Any]:
    import torch.distributed as dist
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def bench_ep_rank(rank: int, world_size: int, config: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """One rank of the multi-process sweep (a `spawn` / torchrun target).

    config: shapes (names of `bench.SHAPES`), formats, tokens, reps, seed, json, plot (paths or
    None), meta (the JSON's metadata), optional device (default the current CUDA device; "cpu" for
    tests with a stand-in kernel). Rank 0 prints and writes; returns every rank's rows on rank 0,
    None on the others.
    """
    from .. import bench
    from .ep_check import allow_cold_jit
    lead = rank == 0
    allow_cold_jit()
    device = torch.device(config.get('device') or f'cuda:{torch.cuda.current_device()}')
    flush = L2Flusher(device)
    if lead:
        print(f'# --ep {world_size}: {world_size} processes, one per GPU ({torch.cuda.get_device_name()}), '
              f'symmetric memory over NVLink, multicast off; torch {torch.__version__}; {config["reps"]} timings '
              f'per row, L2 flushed before each; n = tokens per rank', flush=True)
        print(format_ep_table([]), flush=True)
    meta = dict(config.get('meta') or {}, ep_processes=world_size, nvlink_multicast='off', env=dict(NO_MULTICAST_ENV),
                process_env=process_env_report())
    rows: List[Dict[str, Any]] = []
    for name in config['shapes']:
        for mma_type in config['formats']:
            rows += _bench_format_shape(rank, world_size, mma_type, bench.SHAPES[name], config['tokens'],
                                        config['reps'], flush, config.get('seed', bench.SEED), device)
            if lead and config.get('json'):
                # What is done so far survives a run cut short (a timeout, a hung rank)
                bench.write_json(config['json'], rows + summarize(rows), dict(meta, partial=True))
    if not lead:
        return None
    summary = summarize(rows)
    print()
    print(format_ep_table(rows))
    print()
    print(f'# summary: the slowest of the {world_size} ranks per row')
    print(bench.format_table(summary))
    if config.get('json'):
        bench.write_json(config['json'], rows + summary, meta)
        print(f'# wrote {config["json"]}')
    if config.get('plot') and bench.plot_rows(summary, config['plot'],
                                              title=f'{meta.get("gpu") or ""} x{world_size}, one process per GPU'):
        print(f'# wrote {config["plot"]}')
    return rows


# --------------------------------------------------------------------------------------------------
# Entry from `python -m deep_gemm.bench --ep N`
# --------------------------------------------------------------------------------------------------

def real_ep_available(num_ranks: int) -> bool:
    """True when N processes with one GPU each can run: N visible GPUs (or already under torchrun)."""
    return torchrun_env() is not None or (torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks)


def select_torchrun_device() -> None:
    """Under torchrun, make LOCAL_RANK the current GPU before anything touches CUDA (otherwise every
    rank would create a context on GPU 0)."""
    env = torchrun_env()
    if env is not None and torch.cuda.is_available():
        torch.cuda.set_device(env[2])


def run(args, argv: Optional[Sequence[str]] = None) -> int:
    """Run the sweep of `args` (bench.parse_args) on `args.ep` GPUs; returns the exit code.

    Under torchrun (WORLD_SIZE = args.ep) this process is one rank; otherwise `spawn` starts
    args.ep processes. Exit code 1 if any row failed.
    """
    from .. import bench
    config = dict(shapes=list(args.shapes), formats=list(args.formats), tokens=list(args.tokens), reps=args.reps,
                  seed=bench.SEED, json=args.json, plot=args.plot, meta=bench.run_metadata(argv, 'gpu-ep', args.reps))
    env = torchrun_env()
    if env is not None:
        rank, world_size, _ = env
        if world_size != args.ep:
            print(f'# --ep {args.ep} under torchrun with WORLD_SIZE={world_size}: they must match')
            return 2
        init_from_env('nccl')
        try:
            rows = bench_ep_rank(rank, world_size, config)
        finally:
            destroy()
    else:
        timeout_s = getattr(args, 'timeout', None)
        try:
            rows = spawn(bench_ep_rank, args.ep, config, timeout_s=timeout_s)[0]
        except (RankError, TimeoutError) as e:
            print(f'# --ep {args.ep} FAILED: {e}', flush=True)
            if args.json:
                print(f'# rows finished before the failure (if any) are in {args.json} ("partial": true)')
            return 3
    if rows is None:
        return 0
    return 1 if any(r['status'] in ('error', 'mismatch') for r in rows) else 0

