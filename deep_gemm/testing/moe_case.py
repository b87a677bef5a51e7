"""Random Mega MoE problems on virtual ranks: weights, routed inputs, the kernel call and its reference.

Shared by the GPU tests and the benchmark. Every case draws fresh random data from its seed; no
input is zeros. Weights are generated per expert directly in the kernel's storage format with
power-of-two block scales (`pow2_scales=True`, used for the large shapes) so that their exact
dequantized values fit in BF16 and the float reference of a 256-expert 7168-hidden layer fits in
GPU memory; small shapes use `per_block_cast_to_fp8` of float weights (general scales).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import List, Optional, Sequence

import torch

from ..mega import api as mega_api
from ..mega import launch as mega_launch
from ..mega.transform import (GATE_UP_INTERLEAVE, _deinterleave_gate_up, dequant_mega_moe_fp4,
                              transform_weights_for_mega_moe)
from ..utils import dequant_per_block_fp8, per_block_cast_to_fp8, per_token_cast_to_fp8
from .reference import reference_moe_emulated
from .virtual_ranks import VirtualRankStreams, make_virtual_ranks


@dataclasses.dataclass
class MoEWeights:
    """All E experts: kernel-format weights per rank and exact dequantized float weights."""
    mma_type: str
    l1_ref: torch.Tensor          # [E, 2I, H] exact values (bf16 or float32 storage)
    l2_ref: torch.Tensor          # [E, H, I]
    per_rank: List[tuple]         # (l1, l2) transformed for each rank's local experts


def make_weights(mma_type: str, hidden: int, intermediate: int, num_experts: int, num_ranks: int,
                 seed: int, device='cuda', pow2_scales: Optional[bool] = None,
                 fp4_options: Optional[dict] = None) -> MoEWeights:
    """Random weights of E experts in `mma_type`'s format: per rank its local experts transformed for the
    kernel, and the exact values the kernel computes with (l1_ref / l2_ref, for the reference). FP8
    layers above 2^28 weights get power-of-two block scales (exact BF16 reference storage); FP8 x FP4
    takes `fp4_options` (see fp4_weight)."""
    g = torch.Generator(device=device).manual_seed(seed)
    e_local = num_experts // num_ranks
    if pow2_scales is None:
        pow2_scales = hidden * intermediate * num_experts > (1 << 28)

    # Normal draws times `scale` in `dtype`, made a few experts at a time: a whole deepseek-v3 L1 in
    # float32 is 28 GiB, and one such temporary beside another kept an 80 GB H100 from making the BF16
    # weights (the benchmark's deepseek-v3 BF16 rows ran out of memory)
    def randn(rows: int, cols: int, scale: float, dtype, clamp: Optional[float] = None):
        out = torch.empty(num_experts, rows, cols, dtype=dtype, device=device)
        for e0 in range(0, num_experts, 8):
            chunk = torch.randn(min(8, num_experts - e0), rows, cols, device=device, generator=g).mul_(scale)
            out[e0:e0 + 8] = chunk if clamp is None else chunk.clamp_(-clamp, clamp)
        return out

    def fp8_weight(rows: int, cols: int, fan_in: int):
        if pow2_scales:
            w = randn(rows, cols, 64.0, torch.float8_e4m3fn, clamp=448.0)
            exps = torch.randint(-14, -10, (num_experts, rows // 128, cols // 128), device=device, generator=g)
            sf = torch.pow(2.0, exps.float())
            ref = (w.to(torch.bfloat16).view(num_experts, rows // 128, 128, cols // 128, 128)
                   * sf.to(torch.bfloat16)[:, :, None, :, None]).view(num_experts, rows, cols)
            return w, sf, ref
        w = torch.randn(num_experts, rows, cols, device=device, generator=g) / fan_in ** 0.5
        w_q, sf = per_block_cast_to_fp8(w)
        return w_q, sf, dequant_per_block_fp8(w_q, sf)

    if mma_type == 'fp8xfp8':
        w1, s1, l1_ref = fp8_weight(2 * intermediate, hidden, hidden)
        w2, s2, l2_ref = fp8_weight(hidden, intermediate, intermediate)
        per_rank = [transform_weights_for_mega_moe((w1[r * e_local:(r + 1) * e_local].contiguous(),
                                                    s1[r * e_local:(r + 1) * e_local].contiguous()),
                                                   (w2[r * e_local:(r + 1) * e_local].contiguous(),
                                                    s2[r * e_local:(r + 1) * e_local].contiguous()))
                    for r in range(num_ranks)]
    elif mma_type == 'bf16xbf16':
        l1_ref = randn(2 * intermediate, hidden, hidden ** -0.5, torch.bfloat16)
        l2_ref = randn(hidden, intermediate, intermediate ** -0.5, torch.bfloat16)
        per_rank = [transform_weights_for_mega_moe(l1_ref[r * e_local:(r + 1) * e_local].contiguous(),
                                                   l2_ref[r * e_local:(r + 1) * e_local].contiguous())
                    for r in range(num_ranks)]
    elif mma_type == 'fp8xfp4':
        w1, s1 = fp4_weight(num_experts, 2 * intermediate, hidden, g, device, **(fp4_options or {}))
        w2, s2 = fp4_weight(num_experts, hidden, intermediate, g, device, **(fp4_options or {}))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')    # lossy groups are intended in some cases
            per_rank = [transform_weights_for_mega_moe((w1[r * e_local:(r + 1) * e_local], s1[r * e_local:(r + 1) * e_local]),
                                                       (w2[r * e_local:(r + 1) * e_local], s2[r * e_local:(r + 1) * e_local]))
                        for r in range(num_ranks)]
        # The exact weights the kernel computes with (lossy groups included), back in [gate | up] order;
        # E2M1 x power-of-two values fit BF16 exactly
        # (dequantized a few experts at a time: the reference helper's int64 intermediates of a whole
        # 256-expert 7168-hidden layer would not fit in GPU memory)
        def exact(t, interleaved):
            out = []
            for e0 in range(0, t[0].shape[0], 8):
                w = dequant_mega_moe_fp4(*(x[e0:e0 + 8] for x in t))
                out.append((_deinterleave_gate_up(w, GATE_UP_INTERLEAVE) if interleaved else w).bfloat16())
            return torch.cat(out)
        l1_ref = torch.cat([exact(l1, True) for l1, _ in per_rank])
        l2_ref = torch.cat([exact(l2, False) for _, l2 in per_rank])
    else:
        raise ValueError(f'mma_type: unknown {mma_type!r}')
    return MoEWeights(mma_type, l1_ref, l2_ref, per_rank)


def fp4_weight(num_experts: int, rows: int, cols: int, g: torch.Generator, device, exponent_range=(118, 124),
               zero_rows: int = 0, max_code_in_every_group: bool = False, low_group_frac: float = 0.0):
    """Random MXFP4 weights: every E2M1 code, UE8M0 exponents drawn from `exponent_range` (a narrow
    range is lossless in the kernel format; a wide one exercises the clamped deltas). `low_group_frac`
    of the groups get an exponent 12-14 below the range's largest (deltas of 12-14 from their block's
    largest, which is that one in any block of a narrow range: still exact, in E4M3 subnormals)."""
    packed = torch.randint(0, 256, (num_experts, rows, cols // 2), dtype=torch.uint8, device=device, generator=g)
    sf = torch.randint(exponent_range[0], exponent_range[1], (num_experts, rows, cols // 32), dtype=torch.uint8,
                       device=device, generator=g)
    if low_group_frac:
        low = torch.rand(sf.shape, device=device, generator=g) < low_group_frac
        below = torch.randint(12, 15, sf.shape, dtype=torch.uint8, device=device, generator=g)
        sf = torch.where(low, exponent_range[1] - 1 - below, sf)
    if max_code_in_every_group:   # +6 or -6 as the first element of every 32-wide group
        first = packed[..., ::16]
        packed[..., ::16] = (first & 0xF0) | (0x7 | (first & 0x8))
    if zero_rows:
        packed[:, :zero_rows] = 0
    return packed, sf


@dataclasses.dataclass
class RankInputs:
    x: torch.Tensor               # bf16 [n, H] (before quantization)
    x_q: torch.Tensor             # what the kernel reads: E4M3 or BF16
    x_sf: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def make_routing(n: int, num_experts: int, topk: int, g: torch.Generator, device, mask_frac: float = 0.0,
                 hot_expert: Optional[int] = None, experts_allowed: Optional[int] = None):
    """Distinct experts per token (a token never lists an expert twice), optional masks/skew."""
    pool = num_experts if experts_allowed is None else experts_allowed
    scores = torch.rand(n, pool, device=device, generator=g)
    idx = scores.topk(min(topk, pool), dim=1).indices
    if idx.shape[1] < topk:
        idx = torch.cat([idx, torch.full((n, topk - idx.shape[1]), -1, device=device, dtype=idx.dtype)], 1)
    if hot_expert is not None and n > 0:
        # every token routes slot 0 to the hot expert; keep the other slots distinct from it
        clash = idx == hot_expert
        idx[clash] = idx[:, :1].expand_as(idx)[clash]
        idx[:, 0] = hot_expert
    if mask_frac > 0:
        idx[torch.rand(n, topk, device=device, generator=g) < mask_frac] = -1
    weights = torch.rand(n, topk, device=device, generator=g) + 0.05
    return idx.long().contiguous(), weights.float().contiguous()


def make_inputs(mma_type: str, ns: Sequence[int], hidden: int, num_experts: int, topk: int, seed: int,
                device='cuda', **routing) -> List[RankInputs]:
    """Per rank: n random tokens (BF16, and their E4M3 + scales for FP8 formats) with routing from
    make_routing (`routing`: mask_frac, hot_expert, experts_allowed)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for n in ns:
        x = torch.randn(n, hidden, device=device, generator=g).bfloat16()
        idx, w = make_routing(n, num_experts, topk, g, device, **routing)
        if mma_type == 'bf16xbf16':
            out.append(RankInputs(x, x, None, idx, w))
        else:
            x_q, x_sf = per_token_cast_to_fp8(x, check_finite=False)
            out.append(RankInputs(x, x_q, x_sf, idx, w))
    return out


def reference(weights: MoEWeights, inp: RankInputs, activation_clamp: Optional[float] = None) -> torch.Tensor:
    """The kernel's quantization steps in float32 (deep_gemm.testing.reference_moe_emulated)."""
    l1, l2 = weights.l1_ref, weights.l2_ref
    if l1.dtype != torch.float32:
        return _reference_lazy(weights, inp, activation_clamp)
    return reference_moe_emulated(inp.x_q, inp.x_sf, inp.topk_idx, inp.topk_weights, l1, l2,
                                  weights.mma_type, activation_clamp)


def _reference_lazy(weights: MoEWeights, inp: RankInputs, activation_clamp: Optional[float]) -> torch.Tensor:
    # Same function, evaluated per expert so that [E, 2I, H] is never upcast whole: feed the
    # reference one expert at a time (with its tokens only) and add the per-slot contributions.
    from .reference import reference_moe_emulated as ref
    n, hidden = inp.x_q.shape
    topk = inp.topk_idx.shape[1]
    slots = torch.zeros(n, topk, hidden, dtype=torch.float32, device=inp.x_q.device)
    valid = inp.topk_idx >= 0
    for e in torch.unique(inp.topk_idx[valid]).tolist():
        tok, k = (inp.topk_idx == e).nonzero(as_tuple=True)
        one_idx = torch.full((tok.numel(), 1), 0, dtype=torch.long, device=inp.x_q.device)
        y = ref(inp.x_q[tok], None if inp.x_sf is None else inp.x_sf[tok], one_idx,
                inp.topk_weights[tok, k][:, None].contiguous(), weights.l1_ref[e:e + 1].float(),
                weights.l2_ref[e:e + 1].float(), weights.mma_type, activation_clamp)
        slots[tok, k] = y      # one slot per row: y is that slot's BF16 contribution
    out = torch.zeros(n, hidden, dtype=torch.float32, device=inp.x_q.device)
    for k in range(topk):
        out = torch.where(valid[:, k:k + 1], out + slots[:, k], out)
    return out.bfloat16().float()


def stage_inputs(buf, inp: RankInputs) -> int:
    """Copy one rank's already-quantized inputs into its buffer (as a user would); returns n."""
    n = inp.x_q.shape[0]
    buf.x[:n].copy_(inp.x_q)
    if inp.x_sf is not None:
        buf.x_sf[:n].copy_(inp.x_sf)
    buf.topk_idx[:n].copy_(inp.topk_idx)
    buf.topk_weights[:n].copy_(inp.topk_weights)
    return n


def run_ranks(weights: MoEWeights, inputs: List[RankInputs], buffers, activation_clamp=None, stats=None,
              poison=True, streams: Optional[VirtualRankStreams] = None) -> List[torch.Tensor]:
    """Stage every rank's inputs, launch every rank on its own stream, return the y's (synchronized).

    `poison`: what y holds before the call, NaN (True), a number, or nothing written (False). Runs
    compared bit for bit poison differently, so rows a call leaves unwritten do not compare equal."""
    fn = mega_api.mega_moe_function(weights.mma_type)
    ys = []
    for buf, inp in zip(buffers, inputs):
        n = stage_inputs(buf, inp)
        y = torch.empty(n, buf.hidden, dtype=torch.bfloat16, device=buf.device)
        if poison is not False:
            y.fill_(float('nan') if poison is True else float(poison))
        ys.append(y)
    if len(buffers) > 1:
        # Every rank's kernel variant compiled and loaded before the first launch: a rank that
        # JIT-compiled its variant (it depends on its n), or only loaded its module (CUDA's lazy
        # loading may synchronize the device), after the ranks before it were launched would keep
        # them waiting past their spin-wait bound (they time out and leave y unwritten)
        for buf, y in zip(buffers, ys):
            mega_launch.compile_mega_moe_kernel(weights.mma_type, y.shape[0], buf)
    streams = streams or VirtualRankStreams(len(buffers))
    streams.fork()
    for r, (buf, y) in enumerate(zip(buffers, ys)):
        with torch.cuda.stream(streams[r]):
            l1, l2 = weights.per_rank[r]
            fn(y, l1, l2, buf, cumulative_local_expert_recv_stats=None if stats is None else stats[r],
               activation_clamp=activation_clamp)
    streams.join()
    torch.cuda.synchronize()
    return ys


def make_buffers(mma_type: str, num_ranks: int, num_experts: int, n_max: int, topk: int, hidden: int,
                 intermediate: int):
    """One SymmBuffer per (virtual) rank on the current GPU (`make_virtual_ranks`)."""
    return make_virtual_ranks(num_ranks, num_experts, n_max, topk, hidden, intermediate, mma_type)
