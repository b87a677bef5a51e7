"""Host side of one Mega MoE call: addresses, stream, SM count, status mirror -> `_C.launch_mega_moe`.

The kernel variant (format, BLOCK_M, stages, fast/exact SwiGLU, L2 task width 128 / 256 / 512, FP8 x
FP4 decode's transposed tile widths, the signals thread, the CTA pair, or the weights-first kernel) is
chosen in C++ from the heuristics and the DG_MEGA_MOE_* tuning aids of the README's table;
`_C.get_mega_moe_kernel_variant` shows it.

Called by `deep_gemm.mega.api` after validation; nothing here allocates device memory or
synchronizes, so calls are CUDA-graph capturable (the pinned status mirror is made on first use,
outside any capture that follows a warm-up call).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import _C
from . import status
from .buffer import MMA_TYPES, mma_type_to_int
from .transform import kernel_weight_addresses

_device_info_by_index = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# The raw handle of a device's current stream (what `torch.cuda.current_stream(index).cuda_stream` gives,
# without making a Stream object: ~1 us less a call)
_raw_stream = getattr(torch._C, '_cuda_getCurrentRawStream', None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _device_info(device: torch.device) -> dict:
    index = _device_index(device)
    if index not in _device_info_by_index:
        _device_info_by_index[index] = _C.get_device_info(index)
    return _device_info_by_index[index]


def _max_smem(device: torch.device) -> int:
    return int(_device_info(device)['max_smem_per_block_optin'])


def _hbm_gbps(device: torch.device) -> int:
    """Peak HBM bandwidth in GB/s, which the heuristics take where a choice depends on it."""
    return int(_device_info(device)['hbm_gbps'])


def ranks_share_gpu(buf) -> bool:
    """Whether other ranks' kernels of a call run on this rank's GPU at the same time: several ranks, this
    one given a slice of the GPU's SMs (`buf.num_sms`, as `make_virtual_ranks` sets). Their persistent
    grids must all be resident at once, so the launcher then leaves out the CTA pair (two CTAs an SM),
    which beside another rank's one-CTA-an-SM kernel cannot promise that (docs/KERNEL.md)."""
    return buf.num_ranks > 1 and getattr(buf, 'num_sms', None) is not None


def kernel_variant(kind: str, num_ranks: int, num_experts: int, num_topk: int, hidden: int, intermediate_hidden: int,
                   num_tokens: int, num_sms: int, max_smem: int, fast_math: bool = True, shares_gpu: bool = False,
                   hbm_gbps: int = -1):
    """(mma_type, block_m, num_stages, fast_math, block_n_l2, wide_n_min, signals_thread, cta_pair) of the kernel
    that a call with these arguments launches: the C++ launcher's own choice (heuristic, DG_MEGA_MOE_L2_BLOCK_N,
    DG_MEGA_MOE_WIDE_N, DG_MEGA_MOE_SIGNALS_THREAD and DG_MEGA_MOE_CTA_PAIR), the arguments of
    `_C.compile_mega_moe`. `shares_gpu`: `ranks_share_gpu(buf)` of the rank (virtual ranks: True). `hbm_gbps`:
    the GPU's peak HBM bandwidth in GB/s, -1 the current device's as the launcher takes it (0 without one)."""
    v = _C.get_mega_moe_kernel_variant(mma_type_to_int(kind), num_ranks, num_experts, num_topk, hidden,
                                       intermediate_hidden, int(num_tokens), int(num_sms), int(max_smem),
                                       bool(fast_math), bool(shares_gpu), int(hbm_gbps))
    return v['mma_type'], v['block_m'], v['num_stages'], v['fast_math'], v['block_n_l2'], v['wide_n_min'], v['signals_thread'], v['cta_pair']


# The SM90 parts the kernels are built for where no GPU says (a CPU buffer): the H200 and H100 SXM both
# have 132 SMs and 232448 bytes of opt-in shared memory a block; their peak HBM bandwidths (GB/s)
# differ, which one heuristic choice reads (the CTA pair's N = 16 / 32 tiles)
SM90_NUM_SMS = 132
SM90_MAX_SMEM = 232448
SM90_HBM_GBPS = {'H200': 4917, 'H100': 3352}


def prepare_kernels(buf, num_tokens, fast_math: bool = True) -> list:
    """Compile, and on a GPU load, every kernel variant that calls on `buf` with the token counts
    `num_tokens` (an iterable of ints) launch, and the staging kernel (`deep_gemm.prepare_mega_moe_kernels`
    validates the arguments). A CPU buffer: compile only, for an H200 and an H100 (the variants of both).
    Returns the kernels' names, sorted."""
    kind, on_gpu = buf.mma_type, torch.device(buf.device).type == 'cuda'
    shares = ranks_share_gpu(buf)
    if on_gpu:
        with torch.cuda.device(buf.device):
            num_sms = int(getattr(buf, 'num_sms', None) or _C.get_num_sms())
        gpus = [(num_sms, _max_smem(buf.device), _hbm_gbps(buf.device))]
    else:
        gpus = [(int(getattr(buf, 'num_sms', None) or SM90_NUM_SMS), SM90_MAX_SMEM, gbps) for gbps in SM90_HBM_GBPS.values()]
    names = {}
    for num_sms, max_smem, gbps in gpus:
        for n in num_tokens:
            args = (mma_type_to_int(kind), buf.num_ranks, buf.num_experts, buf.num_topk, buf.hidden,
                    buf.intermediate_hidden, int(n), num_sms, int(max_smem), bool(fast_math))
            name = _C.get_mega_moe_kernel_variant(*args, ranks_share_gpu=shares, hbm_gbps=gbps)['name']
            if name not in names:
                names[name] = args + (gbps,)
    for name, args in names.items():
        if on_gpu:
            compile_mega_moe_kernel(kind, args[6], buf, fast_math)   # compiled and loaded as the call would
        else:
            _C.prepare_mega_moe(*args[:-1], False, ranks_share_gpu=shares, hbm_gbps=args[-1])
    with torch.cuda.device(buf.device) if on_gpu else contextlib.nullcontext():
        _C.compile_mega_moe_stage(kind != 'bf16xbf16', load=on_gpu)
    status.host_status(buf)   # the pinned status mirror, made outside any capture that follows
    return sorted(names)


_compiled_calls = set()


def compile_mega_moe_kernel(kind: str, num_tokens: int, buf, fast_math: bool = True) -> None:
    """JIT-compile (or find in DG_JIT_CACHE_DIR) the kernel variant that `launch_mega_moe` would launch
    for `num_tokens` tokens on `buf` and, on a GPU, load it as its first launch would, without launching it.

    The variant depends on the rank's own n (BLOCK_M, L2 task width), so ranks of one call may launch
    different kernels. A launcher that starts several ranks from one thread (virtual ranks) calls this
    for every rank first. Otherwise a rank whose variant is not ready compiles it (seconds) or loads
    its module, which may synchronize the device (CUDA lazy loading), while the ranks launched before
    it already wait for it: their spin-waits time out ("waiting for receive counts")."""
    num_sms = int(getattr(buf, 'num_sms', None) or _C.get_num_sms())
    key = (kind, buf.num_ranks, buf.num_experts, buf.num_topk, buf.hidden, buf.intermediate_hidden, int(num_tokens),
           num_sms, bool(fast_math), ranks_share_gpu(buf), buf.device)
    if key in _compiled_calls:
        return
    load = torch.device(buf.device).type == 'cuda'    # CPU buffers (tests): compile only
    with torch.cuda.device(buf.device) if load else contextlib.nullcontext():
        _C.prepare_mega_moe(mma_type_to_int(kind), buf.num_ranks, buf.num_experts, buf.num_topk, buf.hidden,
                            buf.intermediate_hidden, int(num_tokens), int(num_sms), int(_max_smem(buf.device)),
                            bool(fast_math), load, ranks_share_gpu=ranks_share_gpu(buf),
                            hbm_gbps=_hbm_gbps(buf.device) if load else 0)
    _compiled_calls.add(key)


def _device_constants(buf) -> tuple:
    """(device index, opt-in shared memory per block, peak HBM GB/s) of the buffer's GPU, kept on the buffer."""
    constants = buf._launch_device_constants
    if constants is None:
        device = buf.device
        constants = buf._launch_device_constants = (_device_index(device), _max_smem(device), _hbm_gbps(device))
    return constants


def launch_mega_moe(kind: str, y: torch.Tensor, l1, l2, buf, stats: Optional[torch.Tensor],
                    activation_clamp: Optional[float], fast_math: bool, weight_addresses: Optional[tuple] = None) -> None:
    """Launch one rank's kernel on the current stream (see `deep_gemm.fp8_mega_moe`); the C++ launcher
    picks the kernel variant (JIT-compiled on first use, or found in DG_JIT_CACHE_DIR).
    `weight_addresses`: the six of `transform.kernel_weight_addresses(kind, l1, l2)` (the entry point's
    checks return them), None to read them here.

    This runs on every eager call, so it reads only attributes and addresses: the arguments go to
    `_C.launch_mega_moe` positionally (keyword matching costs ~1 us a call), the stream as a raw
    handle, the GPU's constants from the buffer, and the C++ side reuses the tensor maps of earlier
    calls with the same buffers and weights (its launch plans)."""
    # A previous call on this buffer that failed is reported now, without a sync (DESIGN.md §6)
    status.raise_if_failed(buf)
    mirror = status.host_status(buf)
    if weight_addresses is None:
        weight_addresses = kernel_weight_addresses(kind, l1, l2)
    index, max_smem, hbm_gbps = _device_constants(buf)
    trace = buf._trace
    # The argument order of _C.launch_mega_moe (csrc/apis/mega_moe.hpp)
    try:
        _C.launch_mega_moe(
            MMA_TYPES[kind], buf.peer_ptrs, buf.rank, buf.num_experts, buf.num_max_tokens_per_rank, buf.num_topk,
            buf.hidden, buf.intermediate_hidden, y.shape[0], y.data_ptr(), *weight_addresses,
            0 if stats is None else stats.data_ptr(), 0 if mirror is None else mirror.data_ptr(),
            0 if trace is None else trace.data_ptr(), _raw_stream(index),
            0.0 if activation_clamp is None else float(activation_clamp), bool(fast_math), status.get_timeout(),
            buf.num_sms or _C.get_num_sms(), max_smem, bool(buf.peers_on_this_gpu), ranks_share_gpu(buf), hbm_gbps)
    except RuntimeError as e:
        _raise_if_on_another_device(index, e)
        raise


def launch_stage(buf, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """`SymmBuffer.stage`'s launch (its arguments checked there): one kernel fills the buffer's inputs."""
    n = x.shape[0]
    index = _device_constants(buf)[0]
    # The argument order of _C.launch_mega_moe_stage (csrc/apis/mega_moe.hpp), positional as above
    try:
        _C.launch_mega_moe_stage(
            MMA_TYPES[buf.mma_type], buf.num_ranks, buf.num_experts, buf.num_max_tokens_per_rank, buf.num_topk, buf.hidden,
            buf.intermediate_hidden, buf.buffer.data_ptr(), x.data_ptr(), x.stride(0) if n > 0 else buf.hidden,
            topk_idx.data_ptr(), topk_weights.data_ptr(), n, _C.get_num_sms(), _raw_stream(index))
    except RuntimeError as e:
        _raise_if_on_another_device(index, e)
        raise


def _raise_if_on_another_device(index: int, error: RuntimeError) -> None:
    """A launch failed: when the buffer's GPU is not the current device, say so instead of the driver's
    error. The kernels load into the current CUDA context and launch on the buffer's device's stream,
    which the driver refuses across devices (torch ops follow their tensors' device; these follow the
    current one, like a raw CUDA launch). Checked only after a failure: the current device costs host
    time on every call."""
    try:
        current = torch.cuda.current_device()
    except Exception:   # no usable CUDA: the original error says more
        return
    if current != index:
        raise RuntimeError(f'the buffer is on cuda:{index} but the current CUDA device is cuda:{current}: call '
                           f'torch.cuda.set_device({index}) or make the call inside `with torch.cuda.device({index}):` '
                           f'(the launch failed with: {error})') from error
