"""Benchmark helpers for `python -m deep_gemm.bench`: roofline arithmetic, CUDA timing, torch baseline.

- Arithmetic (`MoEShape`, `weight_bytes_per_expert`, `activation_bytes`, `moe_flops`, `routing_counts`,
  `roofline_us`, `row_metrics`): pure Python, what every row of the benchmark reports.
- Timing (`L2Flusher`, `time_callable`): CUDA events around each replay of a CUDA graph (eager where
  the work cannot be captured), L2 flushed before every replay, median over the replays.
- `TorchMoEBaseline`: the plain torch MoE pipeline the fused kernel is compared with in the same run
  (route -> grouped GEMM L1 -> SwiGLU -> grouped GEMM L2 -> weighted scatter-add). Its math runs on
  the CPU too, so its correctness is tested without a GPU.

Ceilings are the ones measured on the H200 (DESIGN.md §8); the HBM term uses 4.0 TB/s, a little
below the 4.2 TB/s copy rate, as the attainable streaming rate of a GEMM.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..utils.quant import FP8_E4M3_MAX, dequant_per_token_fp8, per_token_cast_to_fp8
from .reference import calc_diff

# --------------------------------------------------------------------------------------------------
# Ceilings and format constants
# --------------------------------------------------------------------------------------------------

# Attainable HBM streaming rate on the H200, bytes/s (copy measured at 4.2e12)
HBM_BYTES_PER_S = 4.0e12
# DESIGN.md §8's decode target on one GPU: the touched experts' weight bytes at HBM_BYTES_PER_S plus
# this many microseconds (the rows report it for every n; it is a decode target)
DECODE_TARGET_SLACK_US = 10.0
# Dense GEMM ceilings measured on the H200 (torch._scaled_mm / torch.mm at 8192^3). fp8xfp4 runs FP8
# WGMMA after expanding E2M1 to E4M3 in shared memory, so it shares the FP8 ceiling.
PEAK_FLOPS: Dict[str, float] = {'fp8xfp8': 1450e12, 'fp8xfp4': 1450e12, 'bf16xbf16': 756e12}
MMA_TYPES: Tuple[str, ...] = ('fp8xfp8', 'bf16xbf16', 'fp8xfp4')

# 256 MB is 5x the H200's 50 MB L2: zeroing it evicts every weight line of the previous replay
L2_FLUSH_BYTES = 256 << 20
# FP8 scale blocks (weights 128 x 128, activations 1 x 128) and MXFP4 exponent groups (1 x 32)
FP8_BLOCK = 128
MXFP4_GROUP = 32
# Routing bytes per (token, slot): int64 expert id + float32 weight
ROUTING_BYTES_PER_SLOT = 8 + 4


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer: hidden H, intermediate I (per expert), experts E, experts per token topk."""
    name: str
    hidden: int
    intermediate: int
    num_experts: int
    num_topk: int

    def __str__(self) -> str:
        return f'{self.name} ({self.hidden}/{self.intermediate}/{self.num_experts}/{self.num_topk})'


# --------------------------------------------------------------------------------------------------
# FLOPs, bytes, roofline
# --------------------------------------------------------------------------------------------------

def _check_mma_type(mma_type: str) -> None:
    if mma_type not in PEAK_FLOPS:
        raise ValueError(f'mma_type = {mma_type!r} is invalid: expected one of {", ".join(PEAK_FLOPS)}')


def weight_bytes_per_expert(mma_type: str, hidden: int, intermediate: int) -> int:
    """HBM bytes of one expert's L1 [2I, H] and L2 [H, I] weights in the kernel's format.

    fp8xfp8: 1 byte/element + one float32 per 128x128 block. bf16xbf16: 2 bytes/element.
    fp8xfp4: 0.5 byte/element + one uint8 exponent delta per 32 of K (stored as 512-byte blocks
    [N/128, K/128, 512], the same count) + one float32 per 128x128 block.
    """
    _check_mma_type(mma_type)
    elements = 3 * hidden * intermediate
    scale_blocks = (2 * intermediate // FP8_BLOCK) * (hidden // FP8_BLOCK) + \
        (hidden // FP8_BLOCK) * (intermediate // FP8_BLOCK)
    if mma_type == 'bf16xbf16':
        return 2 * elements
    if mma_type == 'fp8xfp8':
        return elements + 4 * scale_blocks
    return elements // 2 + elements // MXFP4_GROUP + 4 * scale_blocks


def activation_bytes(mma_type: str, num_tokens: int, hidden: int, num_topk: int) -> int:
    """HBM bytes of a call's inputs and output: x (+ per-128 float32 scales), routing, BF16 y."""
    _check_mma_type(mma_type)
    x = 2 * hidden if mma_type == 'bf16xbf16' else hidden + 4 * (hidden // FP8_BLOCK)
    return num_tokens * (x + ROUTING_BYTES_PER_SLOT * num_topk + 2 * hidden)


def moe_flops(hidden: int, intermediate: int, num_routed_pairs: int) -> int:
    """FLOPs of the two GEMMs: per routed (token, expert) pair 2 * H * 2I (L1) + 2 * I * H (L2)."""
    return 2 * 3 * hidden * intermediate * num_routed_pairs


def routing_counts(topk_idx: Sequence[torch.Tensor]) -> Tuple[int, int]:
    """(routed pairs, distinct experts touched) over one or more ranks' int64 [n, topk] topk_idx.

    Routed pairs are the non-masked (token, slot) entries (-1 = masked).
    """
    ids = [t[t >= 0].flatten() for t in topk_idx]
    if not ids:
        return 0, 0
    ids = torch.cat([i.to('cpu') for i in ids])
    return int(ids.numel()), int(torch.unique(ids).numel())


def roofline_us(mma_type: str, weight_bytes: int, flops: int) -> float:
    """Lower bound of a call: max(weight bytes / HBM rate, FLOPs / GEMM peak), in microseconds."""
    _check_mma_type(mma_type)
    return max(weight_bytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS[mma_type]) * 1e6


def row_metrics(mma_type: str, shape: MoEShape, num_tokens: int, num_routed_pairs: int,
                num_experts_touched: int, time_us: Optional[float]) -> Dict[str, Optional[float]]:
    """Everything a benchmark row derives from one timing (all ranks' tokens together).

    Returns a dict: flops, weight_bytes (touched experts), act_bytes, roofline_us, target_us (the
    decode target: weight bytes at HBM_BYTES_PER_S + DECODE_TARGET_SLACK_US), and — None when
    `time_us` is None — tflops, hbm_gbs ((weight + activation bytes) / t), pct_roofline (100 *
    roofline / t), meets_target (t <= target_us).
    """
    flops = moe_flops(shape.hidden, shape.intermediate, num_routed_pairs)
    w_bytes = num_experts_touched * weight_bytes_per_expert(mma_type, shape.hidden, shape.intermediate)
    a_bytes = activation_bytes(mma_type, num_tokens, shape.hidden, shape.num_topk)
    floor = roofline_us(mma_type, w_bytes, flops)
    target = w_bytes / HBM_BYTES_PER_S * 1e6 + DECODE_TARGET_SLACK_US
    out: Dict[str, Optional[float]] = dict(flops=flops, weight_bytes=w_bytes, act_bytes=a_bytes,
                                           roofline_us=floor, target_us=target, tflops=None, hbm_gbs=None,
                                           pct_roofline=None, meets_target=None)
    if time_us is not None and time_us > 0:
        seconds = time_us * 1e-6
        out.update(tflops=flops / seconds / 1e12, hbm_gbs=(w_bytes + a_bytes) / seconds / 1e9,
                   pct_roofline=100.0 * floor / time_us, meets_target=time_us <= target)
    return out


# --------------------------------------------------------------------------------------------------
# CUDA timing
# --------------------------------------------------------------------------------------------------

class L2Flusher:
    """Evicts L2 by zeroing a 256 MB buffer (one memset kernel, ~70 us on an H200): the benchmark's
    flush. It leaves L2 full of dirty lines, which the next kernel's first misses write back.
    mode='read' sums the buffer instead (L2 left full of clean lines): a diagnostic, to tell the
    cost of those write-backs from that of cold lines (scripts/time_fused.py --flush read)."""

    def __init__(self, device: torch.device, num_bytes: int = L2_FLUSH_BYTES, mode: str = 'write') -> None:
        if mode not in ('write', 'read'):
            raise ValueError(f"L2Flusher mode: expected 'write' or 'read', got {mode!r}")
        self.mode = mode
        self.buffer = torch.empty(num_bytes // 4, dtype=torch.int32, device=device)
        self.sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        if self.mode == 'write':
            self.buffer.zero_()
        else:
            torch.sum(self.buffer, dim=0, out=self.sink)


@dataclasses.dataclass
class Timing:
    """Median microseconds over the replays, how it ran ('graph' or 'eager: <why>'), the last output."""
    us: float
    how: str
    output: object = None


def capture_graph(fn: Callable[[], object]) -> Tuple['torch.cuda.CUDAGraph', object]:
    """Warm `fn` up on a side stream (as graph capture requires), then capture one call of it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def event_median_us(run: Callable[[], object], reps: int, flush: Optional[Callable[[], None]]) -> float:
    """Median of `reps` CUDA-event timings of `run()`, each preceded (outside the events) by `flush()`."""
    if reps < 1:
        raise ValueError(f'reps must be >= 1, got {reps}')
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def time_callable(fn: Callable[[], object], reps: int, flush: Optional[Callable[[], None]],
                  try_graph: bool = True, why_eager: str = 'not capturable',
                  before_timing: Optional[Callable[[], None]] = None) -> Timing:
    """Time `fn` (already warmed up: JIT compiled) as a CUDA-graph replay, or eagerly if capture fails.

    `why_eager` is the note when `try_graph` is False. The output of the last replay is returned
    (the graph's output tensors hold it). `before_timing` runs after the capture and its warm-up
    calls, before the timed runs: poisoning an output there makes what it holds afterwards the timed
    runs' own (a replay that wrote nothing leaves the poison).
    """
    if try_graph:
        try:
            graph, out = capture_graph(fn)
        except Exception as e:  # noqa: BLE001 - any capture failure means: time it eagerly
            why_eager = f'capture failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ""}'
        else:
            if before_timing is not None:
                before_timing()
            us = event_median_us(graph.replay, reps, flush)
            return Timing(us, 'graph', out)
    box: List[object] = [None]

    def run() -> None:
        box[0] = fn()

    run()
    if before_timing is not None:
        before_timing()
    us = event_median_us(run, reps, flush)
    return Timing(us, f'eager: {why_eager}', box[0])


def _rowwise_cast_per_expert(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`rowwise_cast_to_fp8` of [E, N, K] weights one expert at a time (the float32 temporaries of the
    whole tensor at once would be ~4x its BF16 size: 60 GB for deepseek-v3's l1)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], scale[e] = rowwise_cast_to_fp8(w[e])
    return q, scale


# --------------------------------------------------------------------------------------------------
# The plain torch MoE baseline
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Routing:
    """(token, slot) pairs sorted by expert, masked pairs last; fixed shapes, no host sync."""
    token_of_row: torch.Tensor    # int64 [n * topk]: source token of each sorted row
    weight_of_row: torch.Tensor   # float32 [n * topk]: its routing weight
    valid_row: torch.Tensor       # bool [n * topk]: False for masked slots (they sort last)
    counts: torch.Tensor          # int64 [E]: rows per expert
    offs: torch.Tensor            # int32 [E]: end row of each expert's group (grouped GEMM offsets)


def route(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (token, slot) pairs by expert without a host sync (CUDA-graph capturable)."""
    n, topk = topk_idx.shape
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    # scatter_add_, not bincount: bincount reads its max on the host
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    return Routing(token_of_row=order // topk, weight_of_row=topk_weights.reshape(-1)[order].float(),
                   valid_row=valid[order], counts=counts, offs=counts.cumsum(0).to(torch.int32))


# Baseline GEMM strategies, in the order `TorchMoEBaseline.select` tries them
GEMM_SCALED = 'scaled_grouped_mm'   # FP8 weights and activations, block scales (if torch supports it)
GEMM_ROWWISE = 'scaled_grouped_mm rowwise'   # FP8 re-quantized with a scale per row (weights) / token
GEMM_GROUPED = 'grouped_mm'         # torch._grouped_mm on BF16 (or float32 on the CPU)
GEMM_LOOP = 'matmul loop'           # one torch.matmul per expert (host sync: never graph-captured)
GEMM_MODES = (GEMM_SCALED, GEMM_ROWWISE, GEMM_GROUPED, GEMM_LOOP)
# calc_diff against the per-expert loop above which a faster strategy is rejected as wrong. The
# scaled path re-quantizes h to E4M3 per token (relative error rms ~2.6e-2: calc_diff ~3.4e-4); the
# rowwise one re-quantizes x, the weights and h (three such roundings: 1.9e-3 measured on
# tests/test_bench_cpu.py's problem, with torch's op emulated; 5e-3 leaves 2.6x, and stays half the
# benchmark's 1e-2 mismatch line); grouped vs loop on the same BF16 operands differ only in
# accumulation order.
_SELECT_TOLERANCE = {GEMM_SCALED: 1e-3, GEMM_ROWWISE: 5e-3, GEMM_GROUPED: 1e-4}
def rowwise_cast_to_fp8(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one float32 scale per row (over the last dim): (q, scale) with t ~ q * scale[..., None]
    (the decode scale torch's rowwise scaled GEMMs multiply by). An all-zero row gets scale 1."""
    amax = t.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (t.float() / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class TorchMoEBaseline:
    """Plain torch MoE: route -> L1 GEMM -> SwiGLU (x routing weight) -> L2 GEMM -> scatter-add combine.

    Args:
        l1_weights: [E, 2I, H] rows [gate | up], exact (dequantized) values, any float dtype.
        l2_weights: [E, H, I].
        dtype: GEMM operand dtype for the grouped/loop strategies: torch.bfloat16 (GPU) or
            torch.float32 (CPU tests). The weights are converted once, here.
        fp8_weights: optional checkpoint-format FP8 weights ((w1 e4m3 [E, 2I, H], sf1 f32
            [E, 2I/128, H/128]), (w2 e4m3 [E, H, I], sf2 f32 [E, H/128, I/128])) for the
            scaled_grouped_mm strategy.
        weight_format: the format the weights came from ("fp8xfp8", ...), for `describe`: a
            quantized format run on `dtype` operands is labelled as dequantized. A quantized format
            (FP8 x FP8, FP8 x FP4) also tries FP8 with a scale per weight row and per token
            (`scaled_grouped_mm rowwise`, weights re-quantized from the dequantized values): torch's
            FP8 grouped GEMM that SM90 runs, reading 1 byte a weight instead of BF16's 2.

    Call it as `baseline(x, x_sf, topk_idx, topk_weights)` -> bfloat16 [n, H]; x is BF16 with
    x_sf None, or E4M3 with float32 x_sf [n, H/128] (dequantized inside the timed call).
    `mode` is the strategy in use (set by `select`, default grouped_mm); `capturable` says whether
    it can be put in a CUDA graph.
    """

    def __init__(self, l1_weights: torch.Tensor, l2_weights: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                 fp8_weights: Optional[tuple] = None, weight_format: str = 'bf16xbf16') -> None:
        if l1_weights.dim() != 3 or l2_weights.dim() != 3 or l1_weights.shape[0] != l2_weights.shape[0] \
                or l1_weights.shape[1] != 2 * l2_weights.shape[2] or l1_weights.shape[2] != l2_weights.shape[1]:
            raise ValueError(f'l1_weights [E, 2I, H] and l2_weights [E, H, I] do not match: '
                             f'{list(l1_weights.shape)} and {list(l2_weights.shape)}')
        self.num_experts, self.hidden, self.intermediate = l2_weights.shape[0], l2_weights.shape[1], l2_weights.shape[2]
        self.dtype = dtype
        self.w1 = l1_weights.to(dtype)
        self.w2 = l2_weights.to(dtype)
        self.fp8_weights = fp8_weights
        self.weight_format = weight_format
        self.mode = GEMM_GROUPED
        self.rowwise_weights: Optional[tuple] = None   # ((q1, s1), (q2, s2)), made when first tried
        # Strategies that raised once are not tried again (why -> note)
        self.broken: Dict[str, str] = {}
        if fp8_weights is None:
            self.broken[GEMM_SCALED] = 'no FP8 weights (this format)'
        if weight_format == 'bf16xbf16':
            self.broken[GEMM_ROWWISE] = 'no FP8 weights (this format)'

    @property
    def capturable(self) -> bool:
        return self.mode != GEMM_LOOP

    def describe(self) -> str:
        """The row's `baseline` column: strategy and the operands it ran on."""
        if self.mode == GEMM_SCALED:
            return 'torch scaled_grouped_mm fp8'
        if self.mode == GEMM_ROWWISE:
            return f'torch scaled_grouped_mm fp8 rowwise (re-quantized {self.weight_format.split("x")[1]} weights)'
        operands = 'bf16' if self.dtype == torch.bfloat16 else str(self.dtype).replace('torch.', '')
        if self.weight_format != 'bf16xbf16':
            operands += f' (dequantized {self.weight_format.split("x")[1]} weights)'
        return f'torch {self.mode} {operands}'

    # ---- the pipeline ----------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        return self.forward(x, x_sf, topk_idx, topk_weights, self.mode)

    def forward(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, mode: str) -> torch.Tensor:
        """The MoE layer on these inputs with the GEMM path `mode` (the scaled FP8 grouped GEMM, or BF16 on
        dequantized operands): route, L1, SwiGLU, L2, weighted top-k sum; bfloat16 [n, hidden]."""
        n = x.shape[0]
        r = route(topk_idx, topk_weights, self.num_experts)
        if mode == GEMM_SCALED:
            h = self._scaled_gemm(x[r.token_of_row], x_sf[r.token_of_row], 0, r)
        else:
            x_dense = x if x_sf is None else dequant_per_token_fp8(x, x_sf)
            if mode == GEMM_ROWWISE:
                h = self._rowwise_gemm(x_dense[r.token_of_row], 0, r)
            else:
                h = self._gemm(x_dense.to(self.dtype)[r.token_of_row], 0, r, mode)
        gate, up = h[:, :self.intermediate].float(), h[:, self.intermediate:].float()
        act = F.silu(gate) * up * r.weight_of_row[:, None]
        if mode == GEMM_SCALED:
            act_q, act_sf = per_token_cast_to_fp8(act, check_finite=False)
            out = self._scaled_gemm(act_q, act_sf, 1, r)
        elif mode == GEMM_ROWWISE:
            out = self._rowwise_gemm(act, 1, r)
        else:
            out = self._gemm(act.to(self.dtype), 1, r, mode)
        # Rows past the last group are not written by a grouped GEMM: select, never multiply, them away
        out = torch.where(r.valid_row[:, None], out.float(), 0.0)
        y = torch.zeros(n, self.hidden, dtype=torch.float32, device=x.device)
        y.index_add_(0, r.token_of_row, out)
        return y.to(torch.bfloat16)

    def _gemm(self, a: torch.Tensor, layer: int, r: Routing, mode: str) -> torch.Tensor:
        """Per-expert `a_rows @ W[e].T` for the sorted rows a [n * topk, K]."""
        w = self.w1 if layer == 0 else self.w2
        if mode == GEMM_GROUPED:
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=r.offs)
        if mode != GEMM_LOOP:
            raise ValueError(f'mode = {mode!r} is invalid: expected one of {GEMM_MODES}')
        out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for e, count in enumerate(r.counts.tolist()):
            if count:
                torch.matmul(a[start:start + count], w[e].T, out=out[start:start + count])
            start += count
        return out

    def _scaled_gemm(self, a_q: torch.Tensor, a_sf: torch.Tensor, layer: int, r: Routing) -> torch.Tensor:
        """FP8 grouped GEMM with 1x128 activation and 128x128 weight scales (torch >= 2.9 API)."""
        w, w_sf = self.fp8_weights[layer]
        # Hopper block-scaled GEMMs want M-major activation scales ("outer-dim-major")
        a_sf = a_sf.t().contiguous().t()
        return F.scaled_grouped_mm(a_q, w.transpose(-2, -1), a_sf, F.ScalingType.BlockWise1x128, w_sf,
                                   F.ScalingType.BlockWise128x128, offs=r.offs, output_dtype=torch.bfloat16)

    def _rowwise_gemm(self, a: torch.Tensor, layer: int, r: Routing) -> torch.Tensor:
        """FP8 grouped GEMM with a scale per row of `a` (sorted rows [n * topk, K], quantized here, in
        the timed call) and per weight row (`rowwise_weights`, quantized once)."""
        if self.rowwise_weights is None:
            self.rowwise_weights = tuple(_rowwise_cast_per_expert(w) for w in (self.w1, self.w2))
        w_q, w_scale = self.rowwise_weights[layer]
        a_q, a_scale = rowwise_cast_to_fp8(a)
        # the weights as [E, K, N] column-major (K fastest), as torch's FP8 grouped GEMM takes them
        return torch._scaled_grouped_mm(a_q, w_q.transpose(-2, -1), a_scale, w_scale, offs=r.offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    # ---- choosing the strategy -------------------------------------------------------------------

    def select(self, x: torch.Tensor, x_sf: Optional[torch.Tensor], topk_idx: torch.Tensor,
               topk_weights: torch.Tensor) -> str:
        """Pick the fastest strategy that runs and agrees with the per-expert loop on these inputs.

        Tries scaled_grouped_mm (FP8 weights only), its rowwise form (quantized formats), then
        grouped_mm, else keeps the loop. Sets `self.mode`; returns a note on what was rejected and
        why ('' if nothing was).
        """
        reference = self.forward(x, x_sf, topk_idx, topk_weights, GEMM_LOOP)
        notes = []
        for mode in (GEMM_SCALED, GEMM_ROWWISE, GEMM_GROUPED):
            if mode in self.broken:
                # The full reason went into the note of the call that found it
                if not self.broken[mode].startswith('no FP8'):
                    notes.append(f'{mode} unsupported here')
                continue
            try:
                diff = calc_diff(self.forward(x, x_sf, topk_idx, topk_weights, mode), reference)
            except Exception as e:  # noqa: BLE001 - unsupported op/layout: fall back to the next strategy
                msg = str(e).splitlines()[0][:100] if str(e) else ''
                self.broken[mode] = f'{type(e).__name__}: {msg}'
                if mode == GEMM_SCALED:
                    self.fp8_weights = None   # frees the FP8 copy
                if mode == GEMM_ROWWISE:
                    self.rowwise_weights = None
                notes.append(f'{mode}: {self.broken[mode]}')
                continue
            if diff < _SELECT_TOLERANCE[mode]:
                self.mode = mode
                if mode == GEMM_ROWWISE:   # its own quantization error, for the record
                    notes.append(f'{mode} chosen (calc_diff {diff:.1e} vs the loop)')
                return '; '.join(notes)
            if mode == GEMM_ROWWISE:   # a numerics question, not this input's: not tried again
                self.broken[mode] = f'wrong result (calc_diff {diff:.2e} vs the loop), not tried for later rows'
                self.rowwise_weights = None
                notes.append(f'{mode}: {self.broken[mode]}')
            else:
                notes.append(f'{mode}: wrong result (calc_diff {diff:.2e} vs the loop)')
        self.mode = GEMM_LOOP
        return '; '.join(notes)
