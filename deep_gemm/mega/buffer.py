"""The symmetric buffer of the Mega MoE kernel: one allocation per rank, the same layout on every rank.

The layout (offsets and sizes of every section) comes from `deep_gemm/layout/mega_moe.cuh` through
`deep_gemm._C.get_mega_moe_layout`; this module only makes tensor views at those offsets and never
computes an offset itself. See docs/BUFFER.md for the layout and its size formula.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch

from .. import _C
from . import status

_launch = None   # deep_gemm.mega.launch (which imports this module), imported by the first stage()

# Python names of `deep_gemm::MmaType` (csrc types.cuh); the numbers are part of the kernel ABI.
MMA_TYPES: Dict[str, int] = {'fp8xfp4': 0, 'fp8xfp8': 1, 'bf16xbf16': 2}


def mma_type_to_int(mma_type: str) -> int:
    """Map an MMA type name ("fp8xfp4", "fp8xfp8", "bf16xbf16") to `deep_gemm::MmaType`'s value."""
    if not isinstance(mma_type, str) or mma_type not in MMA_TYPES:
        raise ValueError(f'mma_type = {mma_type!r} is invalid: expected one of {", ".join(map(repr, MMA_TYPES))}')
    return MMA_TYPES[mma_type]


def get_mega_moe_layout(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                        hidden: int, intermediate_hidden: int, mma_type: str = 'fp8xfp4') -> Dict[str, object]:
    """The buffer layout: section name -> (offset, num_bytes), plus `num_bytes`, `num_workspace_bytes`,
    `num_pool_rows`, `num_max_mblocks`, `num_local_experts`. Raises ValueError on an invalid shape."""
    return _C.get_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                  intermediate_hidden, mma_type_to_int(mma_type))


def get_symm_buffer_size_for_mega_moe(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int,
                                      num_topk: int, hidden: int, intermediate_hidden: int,
                                      mma_type: str = 'fp8xfp4') -> int:
    """Bytes of one rank's symmetric buffer (every rank allocates the same). Needs no GPU."""
    return _C.get_symm_buffer_size_for_mega_moe(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                                intermediate_hidden, mma_type_to_int(mma_type))


def _section(buffer: torch.Tensor, layout: Dict[str, object], name: str) -> torch.Tensor:
    offset, num_bytes = layout[name]
    return buffer[offset:offset + num_bytes]


class SymmBuffer:
    """One rank's Mega MoE symmetric buffer and its input views.

    Attributes (N = num_max_tokens_per_rank, H = hidden, K = num_topk):
        x:            [N, H] float8_e4m3fn ("fp8xfp4", "fp8xfp8") or bfloat16 ("bf16xbf16"), tokens to send
        x_sf:         [N, H / 128] float32 per-token per-128-channel scales of x; None for "bf16xbf16"
        topk_idx:     [N, K] int64 global expert ids, -1 = masked slot
        topk_weights: [N, K] float32 routing weights
        buffer:       the whole allocation, uint8 [layout['num_bytes']]
        workspace:    uint8 view of the workspace (counters, slot tables, status); zero at creation
        layout:       dict from `deep_gemm._C.get_mega_moe_layout` (section -> (offset, num_bytes), sizes)
        peer_ptrs:    every rank's buffer base address (list of num_ranks ints, index = rank)
        peers_on_this_gpu: True when every rank's buffer is on this GPU (default: a single rank); the
                      kernel then orders cross-rank signals at gpu scope instead of system scope
        rank, num_ranks, group, num_experts, num_local_experts, num_max_tokens_per_rank, num_topk,
        hidden, intermediate_hidden, mma_type (the string)

    Only rows [:n] of the input views are read by a call with n tokens. Create it with
    `get_symm_buffer_for_mega_moe` (or `deep_gemm.testing.virtual_ranks.make_virtual_ranks`).
    """

    def __init__(self, buffer: torch.Tensor, *, rank: int, num_ranks: int, peer_ptrs: Sequence[int], group,
                 num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                 intermediate_hidden: int, mma_type: str, layout: Optional[Dict[str, object]] = None,
                 handle=None, peers_on_this_gpu: Optional[bool] = None) -> None:
        if layout is None:
            layout = get_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                         intermediate_hidden, mma_type)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout['num_bytes']:
            raise ValueError(f'buffer must be a 1-D uint8 tensor of at least {layout["num_bytes"]} bytes, '
                             f'got {buffer.dtype} {tuple(buffer.shape)}')
        if not 0 <= rank < num_ranks:
            raise ValueError(f'rank = {rank} is invalid: expected 0 <= rank < num_ranks = {num_ranks}')
        if len(peer_ptrs) != num_ranks:
            raise ValueError(f'peer_ptrs has {len(peer_ptrs)} entries: expected num_ranks = {num_ranks}')

        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_experts = num_experts
        self.num_local_experts: int = layout['num_local_experts']
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.mma_type = mma_type
        self.layout = layout
        self.buffer = buffer
        self.peer_ptrs: List[int] = [int(p) for p in peer_ptrs]
        # Every peer buffer on this GPU (one rank, or virtual ranks): the kernel orders what crosses
        # ranks at gpu scope instead of system scope. Default: only for a single rank.
        self.peers_on_this_gpu: bool = num_ranks == 1 if peers_on_this_gpu is None else bool(peers_on_this_gpu)
        # Keeps the symmetric-memory mapping (and so every peer pointer) alive with the buffer
        self._handle = handle
        # CTAs of this rank's persistent grid; None = `deep_gemm.get_num_sms()`. Virtual ranks
        # sharing one GPU each get a slice so that all of them are resident at once.
        self.num_sms: Optional[int] = None
        self._host_status: Optional[torch.Tensor] = None
        self._host_status_words = None   # a numpy view of _host_status (status.host_status)
        # Kept for the entry points' host time (docs/PERF.md, session 49): the weight sets calls passed,
        # as checked (api._CheckedWeights, by their tensors' ids), and the GPU's launch constants
        # (launch._device_constants)
        self._checked_weights: Dict[tuple, object] = {}
        self._launch_device_constants: Optional[tuple] = None
        self._trace: Optional[torch.Tensor] = None   # scripts/trace.py: the kernel's per-CTA time stamps

        n, h, k = num_max_tokens_per_rank, hidden, num_topk
        fp8 = mma_type != 'bf16xbf16'
        x_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self.x: torch.Tensor = _section(buffer, layout, 'x').view(x_dtype).view(n, h)
        self.x_sf: Optional[torch.Tensor] = (_section(buffer, layout, 'x_sf').view(torch.float32).view(n, h // 128)
                                             if fp8 else None)
        self.topk_idx: torch.Tensor = _section(buffer, layout, 'topk_idx').view(torch.int64).view(n, k)
        self.topk_weights: torch.Tensor = _section(buffer, layout, 'topk_weights').view(torch.float32).view(n, k)
        self.workspace: torch.Tensor = buffer[:layout['num_workspace_bytes']]

    @property
    def device(self) -> torch.device:
        """Device of the buffer."""
        return self.buffer.device

    @property
    def num_bytes(self) -> int:
        """Bytes of the buffer's layout."""
        return self.layout['num_bytes']

    def reset(self) -> None:
        """Zero the workspace (counters, slot tables, status): recovery after an error.

        With several ranks every rank must reset before any rank calls the kernel again. Waits for the
        device first: a call still in flight (a peer's, timing out) would otherwise record its error
        after the reset, in the status words and the host mirror.
        """
        self._wait_for_calls_in_flight()
        self.workspace.zero_()
        status.clear(self)

    def _wait_for_calls_in_flight(self) -> None:
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)

    def _initialize(self) -> None:
        # Counters and epochs start at 0; inputs hold harmless values (no routed slot) until written.
        # The pinned status mirror is made now, not on the first call (which may be inside a CUDA
        # graph capture).
        status.host_status(self)
        self.reset()
        self.x.zero_()
        if self.x_sf is not None:
            self.x_sf.fill_(1.0)
        self.topk_idx.fill_(-1)
        self.topk_weights.zero_()

    def clear_error(self) -> None:
        """Forget a non-fatal error (bad expert id, duplicate expert) on this rank only.

        The call that recorded it completed and left the workspace consistent, so the counters and
        the epoch are kept and the group stays in step. After a fatal error (timeout, corrupted
        counts, ranks out of step) use `reset()` on every rank instead. Waits for the device first
        (as `reset()`).
        """
        self._wait_for_calls_in_flight()
        status.clear(self, status_words=True)

    def check(self) -> None:
        """Raise `MegaMoEError` if a call on this buffer recorded an error (stalled peer, bad expert id).

        Synchronizes the device. Without `check()` the error is raised by the next call on the buffer.
        """
        status.raise_if_failed(self, sync=True)

    def stage(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Fill this rank's inputs in one launch on the current stream (no sync, graph-capturable).

        Args:
            x: bfloat16 [n, hidden] (rows may be strided; channels contiguous). FP8 buffers get
                E4M3 + FP32 scales per token per 128 (`deep_gemm.utils.per_token_cast_to_fp8`, bit
                for bit); BF16 buffers get a copy.
            topk_idx: int64 [n, num_topk], -1 = masked slot (ids are checked by the kernel, §6).
            topk_weights: float32 [n, num_topk].
        """
        problem = self._stage_problem(x, topk_idx, topk_weights)
        if problem is not None:
            raise ValueError(f'SymmBuffer.stage: {problem}')
        if x.device.type != 'cuda':
            raise RuntimeError('SymmBuffer.stage needs an SM90 (Hopper) GPU; this buffer is on '
                               f'{self.device} (copy into buf.x / x_sf / topk_idx / topk_weights instead)')
        global _launch
        if _launch is None:
            from . import launch as _launch
        _launch.launch_stage(self, x, topk_idx, topk_weights)

    def _stage_problem(self, x: object, topk_idx: object, topk_weights: object) -> Optional[str]:
        """What is wrong with `stage`'s arguments (the first thing), or None. Every call runs this, so
        a message is formatted only when its check fails."""
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() == 2):
            return f'x: expected a bfloat16 [n, {self.hidden}] tensor'
        n, hidden = x.shape
        if n > self.num_max_tokens_per_rank:
            return f'x: n = {n} exceeds num_max_tokens_per_rank = {self.num_max_tokens_per_rank}'
        # channels contiguous (for every n: the kernel reads a row as one run); the row stride matters
        # only from two rows on (a one-row view of a wider tensor is fine)
        if not (hidden == self.hidden and (n == 0 or x.stride(1) == 1) and (n <= 1 or x.stride(0) % 8 == 0) and
                x.data_ptr() % 16 == 0):
            return f'x: expected shape [n, {self.hidden}] with contiguous channels, 16-byte aligned rows'
        k = self.num_topk
        if not (isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int64 and topk_idx.shape == (n, k) and
                topk_idx.is_contiguous()):
            return f'topk_idx: expected a contiguous int64 [{n}, {k}] tensor'
        if not (isinstance(topk_weights, torch.Tensor) and topk_weights.dtype == torch.float32 and
                topk_weights.shape == (n, k) and topk_weights.is_contiguous()):
            return f'topk_weights: expected a contiguous float32 [{n}, {k}] tensor'
        device = self.device
        for name, t in (('x', x), ('topk_idx', topk_idx), ('topk_weights', topk_weights)):
            if t.device != device:
                return f'{name} is on {t.device}, expected the buffer\'s {device}'
        return None

    def __repr__(self) -> str:
        gib = self.num_bytes / 2 ** 30
        return (f'SymmBuffer(rank={self.rank}/{self.num_ranks}, mma_type={self.mma_type!r}, '
                f'num_experts={self.num_experts} ({self.num_local_experts} local), '
                f'num_max_tokens_per_rank={self.num_max_tokens_per_rank}, num_topk={self.num_topk}, '
                f'hidden={self.hidden}, intermediate_hidden={self.intermediate_hidden}, '
                f'num_pool_rows={self.layout["num_pool_rows"]}, bytes={self.num_bytes} ({gib:.3f} GiB), '
                f'device={self.device})')


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist
    return dist.get_world_size(group)


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                                 intermediate_hidden: int, mma_type: str = 'fp8xfp4', *,
                                 device: Optional[Union[str, torch.device]] = None,
                                 use_fp8_dispatch: Optional[bool] = None, activation: str = 'swiglu') -> SymmBuffer:
    """Allocate this rank's Mega MoE symmetric buffer.

    Args:
        group: the expert-parallel `torch.distributed` process group (at most 8 ranks of one node), or
            None for one GPU. Collective: every rank of the group must call it with the same arguments.
        num_experts: experts of the layer (all ranks); a multiple of the group size.
        num_max_tokens_per_rank: most tokens any rank sends in one call (`n` of every call is <= this).
        num_topk: experts per token.
        hidden, intermediate_hidden: H and I, multiples of 128.
        mma_type: "fp8xfp4", "fp8xfp8" or "bf16xbf16" (selects the entry point the buffer serves).
        device: where to allocate; default "cuda" (the current device). "cpu" works for one rank only
            (layout and validation tests).
        use_fp8_dispatch, activation: DeepGEMM's (keywords only here): use_fp8_dispatch, when given, must
            agree with mma_type (FP8 activations: "fp8xfp4" / "fp8xfp8"); activation must be "swiglu".

    Returns:
        A SymmBuffer whose workspace is zero and whose topk_idx is all -1.
    """
    mma_type_to_int(mma_type)
    if use_fp8_dispatch is not None and bool(use_fp8_dispatch) != mma_type.startswith('fp8'):
        raise ValueError(f'use_fp8_dispatch = {use_fp8_dispatch!r} disagrees with mma_type = {mma_type!r} (its activations '
                         f'are {"FP8" if mma_type.startswith("fp8") else "BF16"}): pass mma_type alone')
    if activation != 'swiglu':
        raise ValueError(f'activation = {activation!r} is not supported: expected "swiglu"')
    num_ranks = _group_size(group)
    layout = get_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                 intermediate_hidden, mma_type)
    num_bytes = layout['num_bytes']
    if num_ranks == 1:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device if device is not None else 'cuda')
        sym = SymmBuffer(buffer, rank=0, num_ranks=1, peer_ptrs=[buffer.data_ptr()], group=group,
                         num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
                         num_topk=num_topk, hidden=hidden, intermediate_hidden=intermediate_hidden,
                         mma_type=mma_type, layout=layout)
        sym._initialize()
        return sym

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    if device is None:
        device = torch.device('cuda', torch.cuda.current_device())
    device = torch.device(device)
    if device.type != 'cuda':
        raise ValueError(f'device = {device} is invalid for a group of {num_ranks} ranks: expected a CUDA device')
    if device.index is None:
        device = torch.device('cuda', torch.cuda.current_device())
    buffer = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group)
    rank = dist.get_rank(group)
    peer_ptrs = _peer_buffer_addresses(buffer, handle, group, rank, num_ranks)
    sym = SymmBuffer(buffer, rank=rank, num_ranks=num_ranks, peer_ptrs=peer_ptrs, group=group,
                     num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                     hidden=hidden, intermediate_hidden=intermediate_hidden, mma_type=mma_type, layout=layout,
                     handle=handle, peers_on_this_gpu=False)
    # Every peer address must reach that peer's buffer before any kernel trusts it: a wrong one
    # would otherwise show up as a kernel timeout or, worse, as writes into someone else's memory
    _probe_peers(sym, group)
    sym._initialize()
    # Peers write into this workspace from their first call on: it must be zero before any rank starts
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return sym


def _peer_buffer_addresses(buffer: torch.Tensor, handle, group, rank: int, num_ranks: int) -> List[int]:
    """Every rank's address of its buffer, as mapped in this process.

    `handle.buffer_ptrs` are the bases of the ranks' symmetric allocations. torch's implicit
    symmetric-memory pool (TORCH_SYMMMEM_IMPLICIT_POOL, on by default from torch 2.11) may carve
    this tensor out of a pooled allocation at an offset; the offset is exchanged rather than
    assumed equal on every rank (each rank's pool reuses blocks on its own).
    """
    import torch.distributed as dist
    bases = [int(p) for p in handle.buffer_ptrs]
    if len(bases) != num_ranks:
        raise RuntimeError(f'symmetric memory: rendezvous returned {len(bases)} buffer addresses for a group of '
                           f'{num_ranks} ranks')
    offsets: List[int] = [0] * num_ranks
    dist.all_gather_object(offsets, buffer.data_ptr() - bases[rank], group=group)
    # Checked after the exchange, the same on every rank: all raise together
    bad = [r for r, off in enumerate(offsets) if off < 0]
    if bad:
        raise RuntimeError(f'symmetric memory: rank(s) {bad}: buffer below its allocation base (offsets {offsets})')
    return [base + int(off) for base, off in zip(bases, offsets)]


# Marker written at the start of each rank's buffer (then zeroed with the workspace) to check the
# peer table: magic, rank, allocation sequence number (the same on every rank of a group: counted
# per group, by its members' global ranks, since buffers of one group are made collectively, in the
# same order on every member, while a process in several groups may make theirs in any order)
_PROBE_MAGIC = 0x4447_4d4f_4550_5231   # "DGMOEPR1"
_PROBE_WORDS = 4
_probe_sequences: Dict[tuple, int] = {}


def _next_probe_sequence(members: tuple) -> int:
    """The next allocation sequence number of the group of these global ranks (1 first)."""
    sequence = _probe_sequences[members] = _probe_sequences.get(members, 0) + 1
    return sequence


def _probe_peers(sym: 'SymmBuffer', group) -> None:
    """Check that `sym.peer_ptrs[r]` holds rank r's buffer for every r, by reading a marker that
    each rank wrote into its own buffer through the very addresses the kernel will use (a copy on
    this rank's GPU over NVLink). Collective. Raises RuntimeError naming the wrong peers.

    Skipped (with no error) where torch lacks the private `_construct_storage_from_data_pointer`."""
    import torch.distributed as dist
    sequence = _next_probe_sequence(tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
    construct = getattr(torch._C, '_construct_storage_from_data_pointer', None)
    device = sym.device
    nbytes = _PROBE_WORDS * 8

    def marker(rank: int) -> torch.Tensor:
        return torch.tensor([_PROBE_MAGIC, rank, sequence, sym.num_bytes], dtype=torch.int64)

    if construct is not None:
        sym.buffer[:nbytes].copy_(marker(sym.rank).view(torch.uint8).to(device))
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    bad = []
    if construct is not None:
        for r, ptr in enumerate(sym.peer_ptrs):
            # A view of `nbytes` at the raw address on this GPU (no ownership), copied out by this GPU
            storage = construct(ptr, device, nbytes)
            view = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
            seen = view.clone().cpu().view(torch.int64)
            if not torch.equal(seen, marker(r)):
                bad.append(f'peer_ptrs[{r}] = {ptr:#x} holds {[hex(int(v)) for v in seen]}')
    torch.cuda.synchronize(device)
    # Doubles as the barrier after which a rank may zero its marker (_initialize); every rank
    # learns every rank's failures, so all raise together
    everyone: List[List[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, bad, group=group)
    failures = [f'rank {r}: {b}' for r, rank_bad in enumerate(everyone) for b in rank_bad]
    if failures:
        raise RuntimeError(f'symmetric memory: the peer table does not reach the peers\' buffers (expected '
                           f'[magic, rank, {sequence}, {sym.num_bytes}] at each): ' + '; '.join(failures))
