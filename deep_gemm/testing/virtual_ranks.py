"""Virtual ranks: emulate an R-rank expert-parallel group on one GPU (DESIGN.md §7).

R buffers on the same device share one peer-pointer table; each is launched on its own stream with
`num_sms / R` CTAs. The kernel sees exactly what it sees on R GPUs (a rank index and the peers' base
addresses), so the EP2/EP4/EP8 protocols are exercised on one GPU.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

from .. import _C
from ..mega.buffer import SymmBuffer, get_mega_moe_layout, mma_type_to_int


def make_virtual_ranks(num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                       intermediate_hidden: int, mma_type: str = 'fp8xfp4',
                       device: Union[str, torch.device] = 'cuda') -> List[SymmBuffer]:
    """R SymmBuffers on one device, one per virtual rank (index = rank), sharing one peer table.

    Every buffer has the layout of an R-rank group, `rank` = its index and `peer_ptrs` = the base
    addresses of all R buffers. Works on CPU too (layout tests); launching needs a GPU.
    """
    mma_type_to_int(mma_type)
    layout = get_mega_moe_layout(num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                 intermediate_hidden, mma_type)
    buffers = [torch.empty(layout['num_bytes'], dtype=torch.uint8, device=device) for _ in range(num_ranks)]
    peer_ptrs = [b.data_ptr() for b in buffers]
    ranks = []
    for rank, buffer in enumerate(buffers):
        sym = SymmBuffer(buffer, rank=rank, num_ranks=num_ranks, peer_ptrs=peer_ptrs, group=None,
                         num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
                         num_topk=num_topk, hidden=hidden, intermediate_hidden=intermediate_hidden,
                         mma_type=mma_type, layout=layout)
        sym._initialize()
        if buffer.device.type == 'cuda':
            # One SM slice per rank: the R persistent grids must be co-resident to wait on each other
            sym.num_sms = max(1, _C.get_num_sms() // num_ranks)
        ranks.append(sym)
    return ranks


class VirtualRankStreams:
    """One CUDA stream per virtual rank, plus helpers to fork from and join back to the current stream.

    Usage::

        streams = VirtualRankStreams(len(ranks))
        streams.fork()                       # every rank stream waits for work queued so far
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                ...launch rank r...
        streams.join()                       # the current stream waits for every rank
    """

    def __init__(self, num_ranks: int, device: Optional[Union[str, torch.device]] = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError('VirtualRankStreams needs a CUDA device')
        self.device = torch.device(device) if device is not None else torch.device('cuda', torch.cuda.current_device())
        self.streams: List[torch.cuda.Stream] = [torch.cuda.Stream(device=self.device) for _ in range(num_ranks)]

    def __len__(self) -> int:
        return len(self.streams)

    def __iter__(self):
        return iter(self.streams)

    def __getitem__(self, rank: int) -> torch.cuda.Stream:
        return self.streams[rank]

    def fork(self) -> None:
        """Make every rank stream wait for the work already queued on the current stream."""
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            s.wait_stream(current)

    def join(self) -> None:
        """Make the current stream wait for every rank stream."""
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            current.wait_stream(s)
