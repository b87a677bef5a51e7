"""Symmetric-buffer layout (`layout/mega_moe.cuh` through `_C.get_mega_moe_layout`), SymmBuffer views
and virtual ranks, on CPU."""
import pytest
import torch

import deep_gemm

from deep_gemm import _C
from deep_gemm.mega import (MMA_TYPES, SymmBuffer, get_mega_moe_layout, get_symm_buffer_for_mega_moe,
                            get_symm_buffer_size_for_mega_moe)
from deep_gemm.testing.virtual_ranks import make_virtual_ranks

SECTIONS = ['status', 'control', 'recv_count', 'combine_ready', 'send_count', 'src_index', 'mblock_arrival', 'mblock_l1_done',
            'row_info', 'row_weight', 'split_count', 'split_partials', 'ws_count', 'x', 'x_sf', 'topk_idx', 'topk_weights', 'l1_act', 'l1_sf', 'l2_act', 'l2_sf',
            'combine']
WORKSPACE = SECTIONS[:SECTIONS.index('x')]
SCALARS = ['num_bytes', 'num_workspace_bytes', 'num_pool_rows', 'num_max_mblocks', 'num_local_experts']
ALIGN = 1024

SHAPES = [
    # num_ranks, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden
    (1, 8, 16, 2, 256, 128),
    (8, 256, 4096, 8, 7168, 2048),
    (1, 256, 4096, 8, 7168, 2048),
    (4, 128, 1, 8, 2048, 768),
    (2, 2, 7, 2, 128, 128),      # topk == num_experts, local experts < topk
    (8, 8, 1000, 1, 4096, 1536),
]


def align(x, a):
    return (x + a - 1) // a * a


def expected_pool_rows(r, e_local, n, k):
    # Header comment: T = R * N * min(K, E); rows = align(T + min(E, T) * 127, 128)
    t = r * n * min(k, e_local)
    return align(t + min(e_local, t) * 127, 128)


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('mma_type', list(MMA_TYPES))
def test_sections_are_ordered_aligned_and_sized(shape, mma_type):
    r, e, n, k, h, i = shape
    layout = get_mega_moe_layout(*shape, mma_type)
    assert set(layout) == set(SECTIONS) | set(SCALARS)

    e_local = e // r
    rows = expected_pool_rows(r, e_local, n, k)
    act = 2 if mma_type == 'bf16xbf16' else 1
    fp8 = mma_type != 'bf16xbf16'
    assert layout['num_local_experts'] == e_local
    assert layout['num_pool_rows'] == rows
    assert layout['num_max_mblocks'] == rows // 64

    # Independent sizes of the sections the Python views and the kernel rely on
    expected_sizes = {
        'x': n * h * act, 'x_sf': n * h // 128 * 4 if fp8 else 0, 'topk_idx': n * k * 8, 'topk_weights': n * k * 4,
        'l1_act': rows * h * act, 'l1_sf': rows * h // 128 * 4 if fp8 else 0,
        'l2_act': rows * i * act, 'l2_sf': rows * i // 128 * 4 if fp8 else 0,
        'combine': k * n * h * 2, 'src_index': e_local * r * n * 4, 'recv_count': e_local * r * 8,
        'send_count': e * 4,
        'row_info': rows * 4, 'row_weight': rows * 4,
        'mblock_arrival': rows // 64 * 4, 'mblock_l1_done': rows // 64 * 4,
        # split-K L1 exchange: a counter for each of 128 tiles, 576 K parts of 256 x 8 FP32 partials
        # (the weights-first kernel's two phases: 2 x 144 chunks, two partials each); its 512 counters
        'split_count': 128 * 4, 'split_partials': 576 * 256 * 8 * 4, 'ws_count': 1024 * 4,
    }
    for name, size in expected_sizes.items():
        assert layout[name][1] == size, name

    cursor = 0
    for name in SECTIONS:
        offset, size = layout[name]
        assert offset == cursor, name               # in order, no gap beyond alignment
        assert offset % ALIGN == 0, name
        cursor = align(offset + size, ALIGN)
    assert layout['num_bytes'] == cursor
    assert layout['num_workspace_bytes'] == layout['x'][0]
    assert get_symm_buffer_size_for_mega_moe(*shape, mma_type) == layout['num_bytes']
    assert _C.get_symm_buffer_size_for_mega_moe(*shape, MMA_TYPES[mma_type]) == layout['num_bytes']


def test_pools_grow_with_tokens_times_topk_not_experts():
    small = get_mega_moe_layout(1, 8, 1024, 8, 1024, 512, 'fp8xfp8')['num_pool_rows']
    many = get_mega_moe_layout(1, 512, 1024, 8, 1024, 512, 'fp8xfp8')['num_pool_rows']
    # 512 experts x 1024 tokens would be 512K rows: the bound is tokens * topk plus per-expert padding
    assert many <= 1024 * 8 + 512 * 127 + 128
    assert small <= 1024 * 8 + 8 * 127 + 128


def test_kernel_limits_are_checked():
    # shared-memory expert tables hold 512 local experts; (rank, token, slot) of a row fits an int32
    with pytest.raises(ValueError, match='512 local experts'):
        get_mega_moe_layout(1, 1024, 16, 8, 256, 128, 'fp8xfp8')
    assert get_mega_moe_layout(2, 1024, 16, 8, 256, 128, 'fp8xfp8')['num_local_experts'] == 512
    with pytest.raises(ValueError, match='2\\^31'):
        get_mega_moe_layout(8, 64, 1 << 25, 8, 256, 128, 'fp8xfp8')


def test_mma_type_strings():
    assert MMA_TYPES == {'fp8xfp4': 0, 'fp8xfp8': 1, 'bf16xbf16': 2}
    with pytest.raises(ValueError) as e:
        get_symm_buffer_size_for_mega_moe(1, 8, 16, 2, 256, 128, 'fp4')
    for name in MMA_TYPES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match='mma_type'):
        _C.get_mega_moe_layout(1, 8, 16, 2, 256, 128, 3)


@pytest.mark.parametrize('args, name', [
    ((0, 8, 16, 2, 256, 128), 'num_ranks'),
    ((9, 72, 16, 2, 256, 128), 'num_ranks'),
    ((1, 0, 16, 2, 256, 128), 'num_experts'),
    ((3, 8, 16, 2, 256, 128), 'num_experts'),
    ((1, 8, 0, 2, 256, 128), 'num_max_tokens_per_rank'),
    ((1, 8, -5, 2, 256, 128), 'num_max_tokens_per_rank'),
    ((1, 8, 16, 0, 256, 128), 'num_topk'),
    ((1, 8, 16, 9, 256, 128), 'num_topk'),
    ((1, 8, 16, 2, 200, 128), 'hidden'),
    ((1, 8, 16, 2, 0, 128), 'hidden'),
    ((1, 8, 16, 2, 256, 64), 'intermediate_hidden'),
    ((1, 8, 16, 2, 256, -128), 'intermediate_hidden'),
])
def test_invalid_arguments_are_named(args, name):
    for fn in (_C.get_mega_moe_layout, _C.get_symm_buffer_size_for_mega_moe):
        with pytest.raises(ValueError, match=name):
            fn(*args, 0)
    with pytest.raises(ValueError, match=name):
        get_symm_buffer_for_mega_moe(None, *args[1:], device='cpu') if args[0] == 1 else \
            get_symm_buffer_size_for_mega_moe(*args)


def test_sizes_that_overflow_are_rejected():
    # (rank, token, slot) past int32 (the kernel's row encoding), which also bounds pool rows
    with pytest.raises(ValueError, match='2\\^31'):
        get_mega_moe_layout(8, 256, 2 ** 25, 8, 128, 128)
    # A pulled row's (rank, token slot) packs into a uint32 of shared memory: 29 bits of slot
    with pytest.raises(ValueError, match='num_max_tokens_per_rank = 67108864 is invalid: expected '
                                         'num_max_tokens_per_rank \\* num_topk < 2\\^29'):
        get_mega_moe_layout(1, 8, 2 ** 26, 8, 128, 128)
    assert get_mega_moe_layout(1, 8, 2 ** 26 - 1, 8, 128, 128)['num_bytes'] > 0
    # FP8 activations: hidden / intermediate past the kernel's 128 K-blocks (task weight scales live
    # in shared memory)
    with pytest.raises(ValueError, match='hidden = 1073741824 is invalid: expected at most 16384'):
        get_mega_moe_layout(1, 8, 2 ** 27, 8, 2 ** 30, 128)
    with pytest.raises(ValueError, match='intermediate_hidden = 16512 is invalid: expected at most 16384'):
        get_mega_moe_layout(1, 8, 16, 8, 128, 16512)
    # BF16 has no per-K-block scales: no such bound, so bytes past int64 are caught on their own
    assert get_mega_moe_layout(1, 8, 16, 8, 128, 16512, 'bf16xbf16')['num_bytes'] > 0
    with pytest.raises(ValueError, match='int64'):
        get_mega_moe_layout(1, 8, 2 ** 26 - 1, 8, 2 ** 31 - 128, 2 ** 31 - 128, 'bf16xbf16')
    # Largest-ish shapes that do fit are computed exactly
    layout = get_mega_moe_layout(8, 256, 1 << 18, 8, 16384, 16384, 'bf16xbf16')
    assert layout['num_pool_rows'] == expected_pool_rows(8, 32, 1 << 18, 8)
    assert layout['num_bytes'] > 2 ** 40


# --------------------------------------------------------------------------------------------------
# SymmBuffer on CPU
# --------------------------------------------------------------------------------------------------

def _view_offset(buf, t):
    return t.data_ptr() - buf.buffer.data_ptr()


@pytest.mark.parametrize('mma_type', list(MMA_TYPES))
def test_symm_buffer_views(mma_type):
    shape = (1, 8, 16, 2, 256, 128)
    buf = get_symm_buffer_for_mega_moe(None, *shape[1:], mma_type=mma_type, device='cpu')
    layout = get_mega_moe_layout(*shape, mma_type)
    assert isinstance(buf, SymmBuffer)
    assert buf.layout == layout
    assert buf.buffer.dtype == torch.uint8 and buf.buffer.numel() == layout['num_bytes']
    assert (buf.rank, buf.num_ranks, buf.group) == (0, 1, None)
    assert (buf.num_experts, buf.num_local_experts, buf.num_max_tokens_per_rank, buf.num_topk) == (8, 8, 16, 2)
    assert (buf.hidden, buf.intermediate_hidden, buf.mma_type) == (256, 128, mma_type)
    assert buf.peer_ptrs == [buf.buffer.data_ptr()]

    fp8 = mma_type != 'bf16xbf16'
    assert buf.x.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert buf.x.shape == (16, 256) and _view_offset(buf, buf.x) == layout['x'][0]
    if fp8:
        assert buf.x_sf.dtype == torch.float32 and buf.x_sf.shape == (16, 2)
        assert _view_offset(buf, buf.x_sf) == layout['x_sf'][0]
    else:
        assert buf.x_sf is None
    assert buf.topk_idx.dtype == torch.int64 and buf.topk_idx.shape == (16, 2)
    assert buf.topk_weights.dtype == torch.float32 and buf.topk_weights.shape == (16, 2)
    assert _view_offset(buf, buf.topk_idx) == layout['topk_idx'][0]
    assert _view_offset(buf, buf.topk_weights) == layout['topk_weights'][0]
    assert buf.workspace.dtype == torch.uint8 and buf.workspace.numel() == layout['num_workspace_bytes']
    assert _view_offset(buf, buf.workspace) == 0
    for view in (buf.x, buf.topk_idx, buf.topk_weights, buf.workspace):
        assert view.is_contiguous()

    # Initial state: workspace zero, no routed slot, harmless inputs
    assert int(buf.workspace.count_nonzero()) == 0
    assert bool((buf.topk_idx == -1).all())
    assert bool((buf.topk_weights == 0).all())
    assert bool((buf.x.float() == 0).all())
    if fp8:
        assert bool((buf.x_sf == 1).all())

    # Views write where the layout says, and reset() clears only the workspace
    buf.topk_idx[3, 1] = 5
    offset = layout['topk_idx'][0] + (3 * 2 + 1) * 8
    assert buf.buffer[offset:offset + 8].view(torch.int64).item() == 5
    buf.workspace.fill_(7)
    buf.reset()
    assert int(buf.workspace.count_nonzero()) == 0
    assert buf.topk_idx[3, 1].item() == 5


def test_symm_buffer_repr_and_pending_methods():
    buf = get_symm_buffer_for_mega_moe(None, 8, 16, 2, 256, 128, device='cpu')
    text = repr(buf)
    assert 'fp8xfp4' in text and str(buf.layout['num_bytes']) in text and 'hidden=256' in text
    buf.check()                      # a fresh buffer holds no error
    # A status word as the kernel writes it: timeout (1) in phase 5 (combine), waiting for rank 3, CTA 17
    status = buf.workspace[buf.layout['status'][0]:buf.layout['status'][0] + 16].view(torch.int64)
    status[0] = 1 | (5 << 8) | (3 << 16) | (17 << 24)
    status[1] = 1
    with pytest.raises(deep_gemm.MegaMoEError, match='timeout.*combine.*rank 3') as info:
        buf.check()
    assert (info.value.code, info.value.phase, info.value.rank, info.value.cta) == (1, 5, 3, 17) and info.value.fatal
    buf.reset()
    buf.check()
    # A non-fatal error (bad expert id at token 9): clear_error() forgets it and keeps the counters
    control = buf.workspace[buf.layout['control'][0]:buf.layout['control'][0] + 4].view(torch.int32)
    control[0] = 5                   # epoch: 5 calls done
    status[0] = 2 | (7 << 8) | (9 << 40)
    with pytest.raises(deep_gemm.MegaMoEError, match='expert id.*token 9.*clear_error'):
        buf.check()
    buf.clear_error()
    buf.check()
    assert int(control[0]) == 5
    # A fatal one asks for reset() on every rank
    status[0], status[1] = 5 | (1 << 8) | (2 << 16), 1
    with pytest.raises(deep_gemm.MegaMoEError, match='out of step.*reset\\(\\) on every rank'):
        buf.check()
    buf.reset()
    assert int(control[0]) == 0
    # stage(): arguments are validated first (naming the argument), then it needs a GPU
    x = torch.randn(3, 256).bfloat16()
    idx, w = torch.randint(0, 8, (3, 2)), torch.rand(3, 2)
    with pytest.raises(ValueError, match='x: expected a bfloat16'):
        buf.stage(x.float(), idx, w)
    with pytest.raises(ValueError, match='exceeds num_max_tokens_per_rank'):
        buf.stage(torch.randn(17, 256).bfloat16(), torch.randint(0, 8, (17, 2)), torch.rand(17, 2))
    with pytest.raises(ValueError, match='topk_idx'):
        buf.stage(x, idx.int(), w)
    with pytest.raises(ValueError, match='topk_weights'):
        buf.stage(x, idx, w[:, :1])
    with pytest.raises(ValueError, match=r'x: expected shape \[n, 256\] with contiguous channels'):
        buf.stage(torch.randn(256, 3).bfloat16().t(), idx, w)                  # strided channels
    with pytest.raises(ValueError, match='16-byte aligned rows'):
        buf.stage(torch.randn(3, 260).bfloat16()[:, :256], idx, w)              # rows 520 bytes apart
    with pytest.raises(ValueError, match=r'x: expected a bfloat16 \[n, 256\]'):
        buf.stage(x[0], idx, w)                                                   # one dimension
    with pytest.raises(ValueError, match="topk_weights is on meta, expected the buffer's cpu"):
        buf.stage(x, idx, w.to('meta'))
    with pytest.raises(RuntimeError, match='SM90'):
        buf.stage(x, idx, w)
    with pytest.raises(RuntimeError, match='SM90'):                              # n = 0: the same checks
        buf.stage(x[:0], idx[:0], w[:0])


def test_peers_on_this_gpu_defaults_to_a_single_rank():
    layout = get_mega_moe_layout(1, 16, 8, 4, 256, 128, 'fp8xfp8')
    buffer = torch.zeros(layout['num_bytes'], dtype=torch.uint8)
    kw = dict(rank=0, num_ranks=1, peer_ptrs=[buffer.data_ptr()], group=None, num_experts=16, num_max_tokens_per_rank=8,
              num_topk=4, hidden=256, intermediate_hidden=128, mma_type='fp8xfp8')
    assert SymmBuffer(buffer, **kw).peers_on_this_gpu is True
    assert SymmBuffer(buffer, **kw, peers_on_this_gpu=False).peers_on_this_gpu is False


def test_symm_buffer_rejects_bad_mma_type_before_allocating():
    with pytest.raises(ValueError, match='mma_type'):
        get_symm_buffer_for_mega_moe(None, 8, 16, 2, 256, 128, mma_type='fp16', device='cpu')


@pytest.mark.parametrize('num_ranks', [2, 4, 8])
def test_virtual_ranks_share_one_peer_table(num_ranks):
    ranks = make_virtual_ranks(num_ranks, 16, 8, 4, 256, 128, 'fp8xfp4', device='cpu')
    assert len(ranks) == num_ranks
    table = [r.buffer.data_ptr() for r in ranks]
    assert len(set(table)) == num_ranks
    layout = get_mega_moe_layout(num_ranks, 16, 8, 4, 256, 128, 'fp8xfp4')
    for index, r in enumerate(ranks):
        assert r.rank == index and r.num_ranks == num_ranks
        assert r.peer_ptrs == table
        assert r.layout == layout and r.num_local_experts == 16 // num_ranks
        assert int(r.workspace.count_nonzero()) == 0 and bool((r.topk_idx == -1).all())
        # Virtual ranks stand in for peers on other GPUs: the kernel keeps system-scope signals
        assert r.peers_on_this_gpu is False
    # Buffers are independent memory
    ranks[0].topk_idx.fill_(3)
    assert bool((ranks[1].topk_idx == -1).all())


@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('mma_type', list(MMA_TYPES))
def test_size_formula_of_the_docs(shape, mma_type):
    # docs/BUFFER.md "Size formula": exact up to 1024-byte alignment of each of the 22 sections
    r, e, n, k, h, i = shape
    el = e // r
    a, s = (2, 0) if mma_type == 'bf16xbf16' else (1, 1)
    rows = expected_pool_rows(r, el, n, k)
    workspace = 64 + 64 + 8 * el * r + 8 * r + 4 * e + 4 * el * r * n + 8 * (rows // 64) + 8 * rows + 4 * 128 + 576 * 8192 + 4 * 1024
    inputs = n * h * a + s * 4 * n * (h // 128) + 12 * n * k
    pools = rows * (h + i) * a + s * 4 * rows * ((h + i) // 128)
    combine = 2 * k * n * h
    formula = workspace + inputs + pools + combine
    num_bytes = get_symm_buffer_size_for_mega_moe(*shape, mma_type)
    assert formula <= num_bytes < formula + len(SECTIONS) * ALIGN


def test_docs_worked_example():
    assert get_symm_buffer_size_for_mega_moe(8, 256, 4096, 8, 7168, 2048, 'fp8xfp4') == 3041866752
    assert get_symm_buffer_size_for_mega_moe(1, 256, 4096, 8, 7168, 2048, 'fp8xfp4') == 1130308608
    # the numbers docs/BUFFER.md prints, as its "Querying it" example would print them now
    import os
    import re
    with open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'BUFFER.md')) as f:
        doc = f.read()
    size = re.search(r'get_symm_buffer_size_for_mega_moe\(8, 256, 4096, 8, 7168, 2048, "fp8xfp4"\)\s+# (\d+)', doc)
    l1_act = re.search(r'layout\["l1_act"\]\s+# \((\d+), (\d+)\)', doc)
    assert size and l1_act, 'docs/BUFFER.md no longer has its query example'
    assert int(size.group(1)) == get_symm_buffer_size_for_mega_moe(8, 256, 4096, 8, 7168, 2048, 'fp8xfp4')
    layout = get_mega_moe_layout(8, 256, 4096, 8, 7168, 2048, 'fp8xfp4')
    assert (int(l1_act.group(1)), int(l1_act.group(2))) == tuple(layout['l1_act'])
    assert '3,041,866,752 B' in doc and '1,130,308,608 B' in doc
