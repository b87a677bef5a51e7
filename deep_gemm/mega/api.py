"""Mega MoE entry points: one kernel launch runs dispatch -> L1 GEMM + SwiGLU -> L2 GEMM -> combine.

Every argument is checked here, on the host and before anything is written, so that a wrong dtype,
shape, device or layout is a Python error naming the argument rather than a corrupted buffer. The
launch itself lives in `deep_gemm.mega.launch`.

Number formats on SM90 (DESIGN.md §2):

==================  ==================================  ======================================  =========
tensor              fp8xfp8 (`fp8_mega_moe`)            fp8xfp4 (`fp8_fp4_mega_moe`)            bf16xbf16
==================  ==================================  ======================================  =========
x (L1 input)        E4M3, FP32 scale / token / 128 ch   same                                    BF16
L1/L2 weights       E4M3, FP32 scale / 128x128 block    MXFP4 (E2M1, UE8M0 / 32 of K), rebased  BF16
L1 out = L2 in      E4M3, FP32 scale / token / 128      same                                    BF16
y                   BF16, FP32 accumulation             same                                    same
==================  ==================================  ======================================  =========
"""
from __future__ import annotations

import math
import numbers
import os
import weakref
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

from . import launch
from .buffer import SymmBuffer
from .transform import FP4_DELTA_BLOCK_BYTES, FP4_PACKED_BLOCK_BYTES, Weights, kernel_weight_addresses

# Expected kernel-format weights per MMA type: one (name, dtype, shape) entry per tensor of l1 / l2,
# shapes as functions of (E_local, I, H). A plain tensor for bf16, a tuple otherwise.
_WeightSpec = Tuple[Tuple[str, torch.dtype, object], ...]


def _weight_specs(mma_type: str, e: int, i: int, h: int) -> Tuple[_WeightSpec, _WeightSpec]:
    if mma_type == 'bf16xbf16':
        return ((('weights', torch.bfloat16, (e, 2 * i, h)),),
                (('weights', torch.bfloat16, (e, h, i)),))
    if mma_type == 'fp8xfp8':
        return ((('weights', torch.float8_e4m3fn, (e, 2 * i, h)), ('scales', torch.float32, (e, 2 * i // 128, h // 128))),
                (('weights', torch.float8_e4m3fn, (e, h, i)), ('scales', torch.float32, (e, h // 128, i // 128))))
    # fp8xfp4: per 128x128 weight block one 8 KB block of packed codes and one 512-byte block of
    # deltas (transform.py, "Packed layout" and "Delta layout")
    return ((('weights', torch.uint8, (e, 2 * i // 128, h // 128, FP4_PACKED_BLOCK_BYTES)),
             ('delta', torch.uint8, (e, 2 * i // 128, h // 128, FP4_DELTA_BLOCK_BYTES)),
             ('block_scale', torch.float32, (e, 2 * i // 128, h // 128))),
            (('weights', torch.uint8, (e, h // 128, i // 128, FP4_PACKED_BLOCK_BYTES)),
             ('delta', torch.uint8, (e, h // 128, i // 128, FP4_DELTA_BLOCK_BYTES)),
             ('block_scale', torch.float32, (e, h // 128, i // 128))))


def _describe(spec: _WeightSpec) -> str:
    parts = [f'{dtype} {list(shape)}'.replace('torch.', '') for _, dtype, shape in spec]
    return parts[0] if len(parts) == 1 else '(' + ', '.join(parts) + ')'


def _check_weights(arg: str, weights: object, spec: _WeightSpec, device: torch.device) -> Tuple[torch.Tensor, ...]:
    """The tensors of `weights` (one, or the tuple's) once each matches `spec`; raises naming the first that does not."""
    # The expected-format text is built only for an error message
    if len(spec) == 1:
        if not isinstance(weights, torch.Tensor):
            raise TypeError(f'{arg} must be a tensor {_describe(spec)} (from transform_weights_for_mega_moe), '
                            f'got {type(weights).__name__}')
        tensors = (weights,)
    else:
        if not isinstance(weights, (tuple, list)) or len(weights) != len(spec):
            got = f'a {len(weights)}-tuple' if isinstance(weights, (tuple, list)) else type(weights).__name__
            raise TypeError(f'{arg} must be a {len(spec)}-tuple {_describe(spec)} (from transform_weights_for_mega_moe), '
                            f'got {got}')
        tensors = tuple(weights)
    for t, (name, dtype, shape) in zip(tensors, spec):
        what = arg if len(spec) == 1 else f'{arg} {name}'
        if not isinstance(t, torch.Tensor):
            raise TypeError(f'{what} must be a torch.Tensor, got {type(t).__name__}')
        if t.dtype != dtype:
            raise TypeError(f'{what} must be {dtype}, got {t.dtype} (expected {arg} = {_describe(spec)})')
        if t.shape != shape:   # torch.Size against a tuple, no copy
            raise ValueError(f'{what} must have shape {list(shape)}, got {list(t.shape)} (expected {arg} = {_describe(spec)})')
        if t.device != device:
            raise ValueError(f'{what} must be on {device} (the buffer\'s device), got {t.device}')
        if not t.is_contiguous():
            raise ValueError(f'{what} must be contiguous')
        # Weights are read by TMA and FP4 deltas by bulk copies: both need 16-byte aligned addresses
        # (a view at an odd offset would fault on the device instead of raising here)
        if name in ('weights', 'delta') and t.data_ptr() % 16 != 0:
            raise ValueError(f'{what} must start at a 16-byte aligned address, got data_ptr() % 16 = {t.data_ptr() % 16}')
    return tensors


_data_ptr = torch.Tensor.data_ptr
_strides = torch.Tensor.stride


# Weight sets a buffer remembers as checked: a model's layers (tens to a few hundred weight sets)
# usually share one buffer; past this many the memo starts over
_MAX_CHECKED_WEIGHT_SETS = 1024


def _weights_key(l1_weights: object, l2_weights: object) -> Optional[Tuple[tuple, tuple]]:
    """(memo key, the objects in it) of a call's l1 and l2: the objects' `id`s and how l1 and l2 hold
    them (a tensor each, or tuples, l1's length first), so that the same tensors in another
    arrangement are not the same weights; None when they cannot be weights of any format."""
    if isinstance(l1_weights, torch.Tensor) and isinstance(l2_weights, torch.Tensor):
        objects, arrangement = (l1_weights, l2_weights), -1
    elif isinstance(l1_weights, (tuple, list)) and isinstance(l2_weights, (tuple, list)):
        objects, arrangement = (*l1_weights, *l2_weights), len(l1_weights)
    else:
        return None
    return (arrangement, *map(id, objects)), objects


class _CheckedWeights:
    """One weight set as checked, and its kernel addresses: an entry of `SymmBuffer._checked_weights`,
    keyed by `_weights_key` (its tensors' `id`s and how the call's l1 and l2 held them).

    `_check_weights` reads ~6 attributes per tensor (~1 us a tensor on a server's host) on every call,
    although a server passes the same weight tensors every time (one set per layer). So a call whose
    weights are the very tensor objects an earlier call on the buffer checked, each still at the
    address and with the strides it was checked with, skips them: the kernel reads weights by
    address, with the shapes the buffer gives, so such a weight still lays out what the checks saw
    (its bytes in the same places); a `.data =` or `set_()` that moves a weight or relays it out at
    the same address (a transposed view) is seen and the full checks run again. No weight is kept
    alive: a weak reference to each removes the entry when its tensor dies (an `id` names one object
    only while it lives). ~1 us against ~4 (FP8, this machine's CPU; docs/PERF.md, session 49), the
    strides ~0.2 us a tensor of it."""
    __slots__ = ('ptrs', 'strides', 'addresses', 'refs')

    def __init__(self, kind: str, l1_tensors: Tuple[torch.Tensor, ...], l2_tensors: Tuple[torch.Tensor, ...],
                 memo: Dict[tuple, '_CheckedWeights'], key: Optional[tuple]) -> None:
        tensors = l1_tensors + l2_tensors
        self.ptrs = tuple(map(_data_ptr, tensors))
        self.strides = tuple(map(_strides, tensors))
        self.addresses = kernel_weight_addresses(kind, l1_tensors, l2_tensors)

        def forget(_ref) -> None:   # holds the memo, not the buffer
            memo.pop(key, None)
        self.refs = tuple(weakref.ref(t, forget) for t in tensors)
        if len(memo) >= _MAX_CHECKED_WEIGHT_SETS:
            memo.clear()
        memo[key] = self

    @staticmethod
    def find(memo: Dict[tuple, '_CheckedWeights'], found: Optional[Tuple[tuple, tuple]]) -> Optional['_CheckedWeights']:
        """The entry of a call's weights (`_weights_key`) if each is still at its checked address."""
        if found is None:
            return None
        key, objects = found
        checked = memo.get(key)
        # a hit: every object is one of the entry's tensors, all alive (a dead one removed the entry)
        if checked is None or tuple(map(_data_ptr, objects)) != checked.ptrs or tuple(map(_strides, objects)) != checked.strides:
            return None
        return checked


def _validate(kind: str, y: object, l1_weights: object, l2_weights: object, sym_buffer: object,
              cumulative_local_expert_recv_stats: object, activation: object, activation_clamp: object,
              fast_math: object, function: str) -> Tuple[int, ...]:
    """Every argument of a call checked (raises naming the first bad one); returns the six weight
    addresses `launch.launch_mega_moe` passes to the kernel (l1's then l2's: weights, block scales, deltas)."""
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f'sym_buffer must be a SymmBuffer (from get_symm_buffer_for_mega_moe), '
                        f'got {type(sym_buffer).__name__}')
    if sym_buffer.mma_type != kind:
        raise ValueError(f'sym_buffer was created with mma_type = {sym_buffer.mma_type!r}: {function} expects '
                         f'mma_type = {kind!r}')
    device = sym_buffer.device
    h, e = sym_buffer.hidden, sym_buffer.num_local_experts

    if not isinstance(y, torch.Tensor):
        raise TypeError(f'y must be a torch.Tensor, got {type(y).__name__}')
    if y.dtype != torch.bfloat16:
        raise TypeError(f'y must be torch.bfloat16, got {y.dtype}')
    y_shape = y.shape
    if len(y_shape) != 2 or y_shape[1] != h:
        raise ValueError(f'y must have shape [n, hidden = {h}], got {list(y_shape)}')
    if y_shape[0] > sym_buffer.num_max_tokens_per_rank:
        raise ValueError(f'y has n = {y_shape[0]} tokens: expected n <= num_max_tokens_per_rank = '
                         f'{sym_buffer.num_max_tokens_per_rank} of sym_buffer')
    if y.device != device:
        raise ValueError(f'y must be on {device} (the buffer\'s device), got {y.device}')
    if not y.is_contiguous():
        raise ValueError('y must be contiguous')
    # the combine writes y's rows 16 bytes at a time: a view at an odd offset would fault on the device
    if y.data_ptr() % 16 != 0:
        raise ValueError(f'y must start at a 16-byte aligned address, got data_ptr() % 16 = {y.data_ptr() % 16}')

    memo = sym_buffer._checked_weights
    found = _weights_key(l1_weights, l2_weights)
    checked = _CheckedWeights.find(memo, found)
    if checked is None:
        l1_spec, l2_spec = _weight_specs(kind, e, sym_buffer.intermediate_hidden, h)
        l1_tensors = _check_weights('l1_weights', l1_weights, l1_spec, device)
        l2_tensors = _check_weights('l2_weights', l2_weights, l2_spec, device)
        checked = _CheckedWeights(kind, l1_tensors, l2_tensors, memo, found[0])   # valid weights have a key

    stats = cumulative_local_expert_recv_stats
    if stats is not None:
        name = 'cumulative_local_expert_recv_stats'
        if not isinstance(stats, torch.Tensor):
            raise TypeError(f'{name} must be None or a torch.Tensor, got {type(stats).__name__}')
        if stats.dtype != torch.int32:
            raise TypeError(f'{name} must be torch.int32, got {stats.dtype}')
        if tuple(stats.shape) != (e,):
            raise ValueError(f'{name} must have shape [num_local_experts = {e}], got {list(stats.shape)}')
        if stats.device != device:
            raise ValueError(f'{name} must be on {device} (the buffer\'s device), got {stats.device}')
        if not stats.is_contiguous():
            raise ValueError(f'{name} must be contiguous')

    if activation != 'swiglu':
        raise ValueError(f'activation = {activation!r} is not supported: expected "swiglu"')
    if activation_clamp is not None:
        if (isinstance(activation_clamp, bool) or not isinstance(activation_clamp, numbers.Real)
                or not math.isfinite(activation_clamp) or activation_clamp <= 0):
            raise ValueError(f'activation_clamp = {activation_clamp!r} is invalid: expected None or a finite '
                             'positive number')
    if fast_math is not True and fast_math is not False:
        raise TypeError(f'fast_math = {fast_math!r} must be a bool')
    return checked.addresses


def _check_routing_on_host(sym_buffer: SymmBuffer, n: int) -> None:
    """DG_CHECK_INPUTS=1: copy topk_idx / topk_weights [:n] to the host and check them (synchronizes)."""
    idx = sym_buffer.topk_idx[:n].cpu()
    weights = sym_buffer.topk_weights[:n].cpu()
    bad = (idx < -1) | (idx >= sym_buffer.num_experts)
    if bool(bad.any()):
        token, slot = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f'sym_buffer.topk_idx[{token}, {slot}] = {int(idx[token, slot])} is outside '
                         f'[-1, num_experts = {sym_buffer.num_experts}) (DG_CHECK_INPUTS=1)')
    bad = ~torch.isfinite(weights) & (idx != -1)
    if bool(bad.any()):
        token, slot = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f'sym_buffer.topk_weights[{token}, {slot}] = {float(weights[token, slot])} is not finite '
                         f'(expert {int(idx[token, slot])}) (DG_CHECK_INPUTS=1)')


# DG_CHECK_INPUTS, read once, when this module is imported: an environment lookup costs ~1 us, and
# this is every call's path (docs/PERF.md, session 49)
_check_inputs: bool = os.environ.get('DG_CHECK_INPUTS', '0') == '1'


def _run(kind: str, function: str, y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
         activation, activation_clamp, fast_math) -> None:
    weight_addresses = _validate(kind, y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
                                 activation, activation_clamp, fast_math, function)
    if _check_inputs:
        _check_routing_on_host(sym_buffer, y.shape[0])
    if y.device.type != 'cuda':
        raise RuntimeError(f'{function} needs an SM90 (Hopper) GPU; y and sym_buffer are on {y.device}')
    launch.launch_mega_moe(
        kind, y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
        None if activation_clamp is None else float(activation_clamp), fast_math, weight_addresses)


_ARGS_DOC = """
    Args:
        y: bfloat16 [n, hidden], contiguous, on the buffer's device: output, overwritten. n (<=
            num_max_tokens_per_rank, may be 0) is the number of this rank's tokens; their inputs are
            sym_buffer.x[:n]{sf}, sym_buffer.topk_idx[:n] (int64, -1 = masked slot) and
            sym_buffer.topk_weights[:n] (float32), written before the call.
        l1_weights: {l1}
            rows interleaved gate/up by `transform_weights_for_mega_moe` (E = local experts,
            I = intermediate_hidden, H = hidden).
        l2_weights: {l2}
        sym_buffer: SymmBuffer from `get_symm_buffer_for_mega_moe(..., mma_type="{kind}")`.
        cumulative_local_expert_recv_stats: None or int32 [E]: the kernel adds the tokens each local
            expert received in this call.
        activation: "swiglu" (silu(gate) * up).
        activation_clamp: None or a finite positive number c: gate clamped to <= c and up to [-c, c]
            before SwiGLU.
        fast_math: allow approximate exp/reciprocal in SwiGLU.

    One kernel launch, no host synchronization and no allocation (CUDA-graph capturable), except
    with DG_CHECK_INPUTS=1 (read when deep_gemm is imported), which checks the routing on the host
    first. Raises TypeError/ValueError naming the argument before anything is written. A later call
    with the same weight tensors, each still at its address, skips their checks.
"""

_FORMATS_DOC = (__doc__ or '')[(__doc__ or '').find('Number formats'):] if __doc__ else ''


def fp8_fp4_mega_moe(y: torch.Tensor, l1_weights: Weights, l2_weights: Weights, sym_buffer: SymmBuffer,
                     cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, activation: str = 'swiglu',
                     activation_clamp: Optional[float] = None, fast_math: bool = True) -> None:
    """MoE layer with FP8 (E4M3) activations and MXFP4 weights (y = sum_k w_k * expert_k(x))."""
    _run('fp8xfp4', 'fp8_fp4_mega_moe', y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
         activation, activation_clamp, fast_math)


def fp8_mega_moe(y: torch.Tensor, l1_weights: Weights, l2_weights: Weights, sym_buffer: SymmBuffer,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, activation: str = 'swiglu',
                 activation_clamp: Optional[float] = None, fast_math: bool = True) -> None:
    """MoE layer with FP8 (E4M3) activations and FP8 weights with 128x128 block scales."""
    _run('fp8xfp8', 'fp8_mega_moe', y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
         activation, activation_clamp, fast_math)


def bf16_mega_moe(y: torch.Tensor, l1_weights: Weights, l2_weights: Weights, sym_buffer: SymmBuffer,
                  cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, activation: str = 'swiglu',
                  activation_clamp: Optional[float] = None, fast_math: bool = True) -> None:
    """MoE layer with BF16 activations and BF16 weights."""
    _run('bf16xbf16', 'bf16_mega_moe', y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
         activation, activation_clamp, fast_math)


def prepare_mega_moe_kernels(sym_buffer: SymmBuffer, num_tokens: Union[None, int, Iterable[int]] = None,
                             fast_math: bool = True) -> List[str]:
    """Compile (JIT, or find in DG_JIT_CACHE_DIR) and load every kernel that calls on `sym_buffer` can
    launch, so that no later call compiles or loads one: call it at start-up, before capturing CUDA
    graphs for many batch sizes.

    Which kernel a call launches depends on its own token count n (decode and prefill tiles, L2 task
    widths, ...: the heuristics of docs/KERNEL.md), so a graph captured at a new n may need a kernel
    no call has loaded yet, and loading one inside a capture is not allowed. Every rank calls this for
    its own buffer (virtual ranks: after `make_virtual_ranks` gave each its SMs), with the SM count
    (`deep_gemm.set_num_sms`) and DG_MEGA_MOE_* tuning variables as its calls will have them.

    Args:
        sym_buffer: the rank's SymmBuffer; its mma_type picks the format.
        num_tokens: the token counts the calls will have: None (default) every n from 0 to
            num_max_tokens_per_rank, an int, or an iterable of ints in that range.
        fast_math: as the calls will pass it.

    A call that finds its kernel neither compiled nor loaded compiles it inside the call, holding the
    GIL (minutes for a cold cache); this compiles with the GIL released, so a server's other threads
    run meanwhile.

    Also loads `SymmBuffer.stage`'s kernel and makes the buffer's pinned status mirror. On a CPU buffer
    (no GPU): compiles only, the variants an H200 and an H100 would launch. Returns the kernels'
    names (e.g. `sm90_mega_moe_fp8xfp4_m128_n128_s4_fast`), sorted.
    """
    if not isinstance(sym_buffer, SymmBuffer):
        raise TypeError(f'sym_buffer must be a SymmBuffer (from get_symm_buffer_for_mega_moe), '
                        f'got {type(sym_buffer).__name__}')
    most = sym_buffer.num_max_tokens_per_rank
    if num_tokens is None:
        counts = range(most + 1)
    elif isinstance(num_tokens, numbers.Integral) and not isinstance(num_tokens, bool):
        counts = [int(num_tokens)]
    else:
        try:
            counts = list(num_tokens)
        except TypeError:
            raise TypeError(f'num_tokens = {num_tokens!r} must be None, an int or an iterable of ints') from None
        if not counts:
            raise ValueError('num_tokens is empty: expected at least one token count')
    for n in counts:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f'num_tokens: {n!r} is not an int')
        if not 0 <= n <= most:
            raise ValueError(f'num_tokens: n = {n} is invalid: expected 0 <= n <= num_max_tokens_per_rank = {most}')
    if not isinstance(fast_math, bool):
        raise TypeError(f'fast_math = {fast_math!r} must be a bool')
    return launch.prepare_kernels(sym_buffer, counts, fast_math)


# The entry point of each weight format, by name (benchmarks, checks and tests pick the call by format)
MEGA_MOE_FUNCTIONS = {'fp8xfp8': 'fp8_mega_moe', 'fp8xfp4': 'fp8_fp4_mega_moe', 'bf16xbf16': 'bf16_mega_moe'}


def mega_moe_function(mma_type: str):
    """The entry point for `mma_type`, looked up when called (so a patched module attribute counts)."""
    return globals()[MEGA_MOE_FUNCTIONS[mma_type]]


def _fill_docs() -> None:
    fp8_sf = ', sym_buffer.x_sf[:n] (float32 [n, hidden/128])'
    docs = {
        fp8_fp4_mega_moe: dict(kind='fp8xfp4', sf=' (float8_e4m3fn)' + fp8_sf,
                               l1='(w uint8 [E, 2I/128, H/128, 8192] packed E2M1 (one 8 KB block per 128x128 '
                                  'weight block, bytes r * 64 .. r * 64 + 63 = row r of its K-block, permuted, signs moved within '
                                  'each 32-bit word: see deep_gemm.mega.fp4_packed_byte_position and '
                                  'fp4_sign_bit_position), delta uint8 '
                                  '[E, 2I/128, H/128, 512] (one 512-byte block per 128x128 weight block, byte '
                                  'r * 4 + g = row r, 32-group g), block_scale float32 [E, 2I/128, H/128]),',
                               l2='(w uint8 [E, H/128, I/128, 8192], delta uint8 [E, H/128, I/128, 512], '
                                  'block_scale float32 [E, H/128, I/128]).'),
        fp8_mega_moe: dict(kind='fp8xfp8', sf=' (float8_e4m3fn)' + fp8_sf,
                           l1='(w float8_e4m3fn [E, 2I, H], sf float32 [E, 2I/128, H/128]),',
                           l2='(w float8_e4m3fn [E, H, I], sf float32 [E, H/128, I/128]).'),
        bf16_mega_moe: dict(kind='bf16xbf16', sf=' (bfloat16)', l1='bfloat16 [E, 2I, H],', l2='bfloat16 [E, H, I].'),
    }
    for fn, fields in docs.items():
        if fn.__doc__ is None:  # python -OO
            continue
        fn.__doc__ = fn.__doc__ + '\n' + _ARGS_DOC.format(**fields) + '\n    ' + \
            _FORMATS_DOC.replace('\n', '\n    ')


_fill_docs()
