"""The weights-first kernel's plan (`MegaMoEWsPlan` through `_C.get_mega_moe_ws_plan`), on CPU: the chunks
cover every unit once, each chunk holds a part of at most two tiles (its two partial-sum slots), the
slots of a phase never collide, and each tile's part count (the kernel's formula in `exchange`) is
the number of chunks that hold a part of it. A collision or a wrong count would mix or lose partial
sums (a silent wrong answer), or leave a last part waiting. The whole forms (1: L1, 2: L2, 3: both):
a chunk is exactly one L1 tile / one (column tile, slot)'s K-blocks, so that an L1 tile has one part
and an L2 chunk owns its slot's pair columns of its column tile (whose slot, 288 + column tile, must
stay in split_partials)."""
import pytest

from deep_gemm import _C
from deep_gemm.mega.buffer import mma_type_to_int

MAX_CHUNKS = 144   # layout::kMaxWsChunks: slots [0, 288) for L1, [288, 576) for L2
SHAPES = [(512, 256), (2048, 768), (4096, 2048), (7168, 2048), (256, 128), (36864, 128)]


def pieces(units, s, group_units):
    """(chunk, group) of every unit, enumerated."""
    out = {}
    for u in range(units):
        out.setdefault((u // s, u // group_units), 0)
        out[(u // s, u // group_units)] += 1
    return out


@pytest.mark.parametrize('fmt', ['fp8xfp8', 'bf16xbf16'])
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('slots', [1, 2, 5, 8])
@pytest.mark.parametrize('grid', [1, 3, 16, 132, 144, 200])
def test_chunks_slots_and_part_counts(fmt, shape, slots, grid):
    hidden, inter = shape
    p = _C.get_mega_moe_ws_plan(mma_type_to_int(fmt), hidden, inter, slots, grid)
    assert not p['whole1'] and not p['whole2'] and p == _C.get_mega_moe_ws_plan(mma_type_to_int(fmt), hidden, inter, slots, grid, 0)
    bk = 128 if fmt == 'fp8xfp8' else 64
    assert p['kb1'] == hidden // bk and p['kb2'] == inter // bk
    assert p['tiles1'] == slots * inter // 128 and p['units1'] == p['tiles1'] * p['kb1']
    assert p['columns'] == hidden // 256 and p['per_column'] == slots * p['kb2'] and p['units2'] == p['columns'] * p['per_column']
    for units, s, chunks, group_units, groups in ((p['units1'], p['s1'], p['chunks1'], p['kb1'], p['tiles1']),
                                                  (p['units2'], p['s2'], p['chunks2'], p['per_column'], p['columns'])):
        assert (chunks - 1) * s < units <= chunks * s            # every unit in one chunk, no empty chunk
        assert chunks <= MAX_CHUNKS and s <= group_units         # the workspace's slots; at most one group's worth
        if units and groups <= min(grid, MAX_CHUNKS):            # one wave: no chunk longer than an even share
            assert s <= -(-units // min(grid, MAX_CHUNKS))
        got = pieces(units, s, group_units)
        slots_used = {}
        for (k, g) in got:
            first_group = (k * s) // group_units
            assert g in (first_group, first_group + 1), 'a chunk holds parts of at most two groups'
            slot = 2 * k + (0 if g == first_group else 1)
            assert slot < 2 * MAX_CHUNKS and slot not in slots_used, (k, g, slot)
            slots_used[slot] = (k, g)
        for g in range(groups):
            first = (g * group_units) // s
            parts = ((g + 1) * group_units - 1) // s - first + 1
            assert sorted(k for (k, gg) in got if gg == g) == list(range(first, first + parts)), g


def test_no_routed_expert_has_no_units():
    p = _C.get_mega_moe_ws_plan(mma_type_to_int('fp8xfp8'), 2048, 768, 0, 132)
    assert p['units1'] == p['units2'] == p['chunks1'] == p['chunks2'] == 0


@pytest.mark.parametrize('fmt', ['fp8xfp8', 'bf16xbf16'])
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('slots', [1, 2, 5, 8])
@pytest.mark.parametrize('form', [1, 2, 3, 4, 7])
def test_whole_forms(fmt, shape, slots, form):
    hidden, inter = shape
    split = _C.get_mega_moe_ws_plan(mma_type_to_int(fmt), hidden, inter, slots, 132, 0)
    p = _C.get_mega_moe_ws_plan(mma_type_to_int(fmt), hidden, inter, slots, 132, form)
    assert p['whole1'] == bool(form & 1) and p['whole2'] == bool(form & 2) and p['l2_after_l1'] == bool(form & 4)
    for key in ('kb1', 'tiles1', 'units1', 'kb2', 'per_column', 'columns', 'units2'):
        assert p[key] == split[key], key
    if form & 1:   # one chunk per L1 tile, in tile order
        assert p['s1'] == p['kb1'] and p['chunks1'] == p['tiles1']
    else:
        assert (p['s1'], p['chunks1']) == (split['s1'], split['chunks1'])
    if form & 2:   # one chunk per (column tile, slot): chunk k is column tile k // slots, slot k % slots
        assert p['s2'] == p['kb2'] and p['chunks2'] == p['columns'] * slots
        for k in range(p['chunks2']):
            units = range(k * p['s2'], (k + 1) * p['s2'])
            assert {u // p['kb2'] // slots for u in units} == {k // slots} and {u // p['kb2'] % slots for u in units} == {k % slots}
        assert p['columns'] <= MAX_CHUNKS   # its exchange slot 2 x MAX_CHUNKS + column tile < 4 x MAX_CHUNKS
    else:
        assert (p['s2'], p['chunks2']) == (split['s2'], split['chunks2'])


def test_form_out_of_range_is_refused():
    for form in (-1, 8):
        with pytest.raises(ValueError, match='form'):
            _C.get_mega_moe_ws_plan(mma_type_to_int('fp8xfp8'), 2048, 768, 8, 132, form)
    with pytest.raises(ValueError, match='DG_MEGA_MOE_WS_PLAN'):
        _C.set_mega_moe_ws_plan(8)
