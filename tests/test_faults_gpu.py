"""Never hang, never corrupt (DESIGN.md §6): timeouts, bad routing data, busy SMs, long runs.

GPU only (skipped without an SM90 GPU). Tolerances as in test_mega_moe_gpu.py.
"""
import time

import pytest
import torch

import deep_gemm
from deep_gemm import _C
from deep_gemm.mega.api import mega_moe_function
from deep_gemm.testing import calc_diff
from deep_gemm.testing import ep_check, moe_case as mc

from conftest import record_diff

sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.skipif(not sm90, reason='needs an SM90 (Hopper) GPU'), pytest.mark.usefixtures('persistent_kernel')]

TOL = ep_check.TOLERANCE   # tests/test_mega_moe_gpu.py derives them
SMALL = (512, 256, 16, 4)


def assert_correct(w, inputs, ys, mma_type):
    for y, inp in zip(ys, inputs):
        if inp.x_q.shape[0]:
            assert not torch.isnan(y).any()
            d = calc_diff(y.float(), mc.reference(w, inp))
            record_diff(mma_type, d)
            assert d < TOL[mma_type], d


@pytest.fixture
def short_timeout():
    old = deep_gemm.get_timeout()
    deep_gemm.set_timeout(1.0)
    yield 1.0
    deep_gemm.set_timeout(old)


@pytest.mark.parametrize('mma_type', ['fp8xfp8', 'bf16xbf16'])
def test_stalled_peer_times_out_and_reset_recovers(mma_type, short_timeout):
    hidden, inter, experts, topk = SMALL
    w = mc.make_weights(mma_type, hidden, inter, experts, 2, seed=0)
    bufs = mc.make_buffers(mma_type, 2, experts, 64, topk, hidden, inter)
    inp = mc.make_inputs(mma_type, [64], hidden, experts, topk, seed=1)[0]
    fn = deep_gemm.fp8_mega_moe if mma_type == 'fp8xfp8' else deep_gemm.bf16_mega_moe
    bufs[0].stage(inp.x, inp.topk_idx, inp.topk_weights)
    y = torch.empty(64, hidden, dtype=torch.bfloat16, device='cuda')
    torch.cuda.synchronize()
    start = time.time()
    fn(y, *w.per_rank[0], bufs[0])          # rank 1 is never launched
    torch.cuda.synchronize()                 # the kernel gives up instead of hanging
    elapsed = time.time() - start
    assert elapsed < short_timeout + 1.0, f'took {elapsed:.2f} s'
    with pytest.raises(deep_gemm.MegaMoEError, match='timeout.*rank 1') as info:
        bufs[0].check()
    assert info.value.code == 1 and info.value.rank == 1 and info.value.fatal
    # The error is also raised by the next call on the buffer, before anything is launched
    with pytest.raises(deep_gemm.MegaMoEError):
        fn(y, *w.per_rank[0], bufs[0])
    for b in bufs:
        b.reset()
    inputs = mc.make_inputs(mma_type, [64, 33], hidden, experts, topk, seed=2)
    assert_correct(w, inputs, mc.run_ranks(w, inputs, bufs), mma_type)


# n = 128: the count on one CTA (count_and_send); n = 1024 (4096 routed pairs): in slices on several
# CTAs (count_slice), the last bad slot in the last slice
@pytest.mark.parametrize('n', [128, 1024])
@pytest.mark.parametrize('mma_type', ['fp8xfp8', 'bf16xbf16'])
@pytest.mark.parametrize('bad_id', [10_000, 16, -2, -(1 << 40)])
def test_bad_expert_ids_are_flagged_never_used(mma_type, bad_id, n):
    hidden, inter, experts, topk = SMALL
    w = mc.make_weights(mma_type, hidden, inter, experts, 1, seed=0)
    (buf,) = mc.make_buffers(mma_type, 1, experts, n, topk, hidden, inter)
    inp = mc.make_inputs(mma_type, [n], hidden, experts, topk, seed=3)[0]
    bad_slots = [(5, 1), (77, 3), (n - 3, 2)]
    bad = inp.topk_idx.clone()
    for t, k in bad_slots:
        bad[t, k] = bad_id
    staged = mc.RankInputs(inp.x, inp.x_q, inp.x_sf, bad, inp.topk_weights)
    (y,) = mc.run_ranks(w, [staged], [buf])
    with pytest.raises(deep_gemm.MegaMoEError, match='expert id') as info:
        buf.check()
    assert info.value.code == 2 and not info.value.fatal
    # The bad slots were skipped (treated as masked), every other slot computed normally
    masked = inp.topk_idx.clone()
    for t, k in bad_slots:
        masked[t, k] = -1
    assert_correct(w, [mc.RankInputs(inp.x, inp.x_q, inp.x_sf, masked, inp.topk_weights)], [y], mma_type)
    with pytest.raises(deep_gemm.MegaMoEError):      # reported again by the next call
        mc.run_ranks(w, [inp], [buf])
    buf.reset()
    assert_correct(w, [inp], mc.run_ranks(w, [inp], [buf]), mma_type)


# A token that lists an expert twice sends it two rows; when a (source, expert) list would then hold
# more than num_max_tokens_per_rank rows, the count cuts it there, flags the call (non-fatal) and
# masks the pairs it cut in the buffer's routing copy, which the combine reads: every token lists
# expert 3 in slots 0 and 1, so 2 n pairs compete for n slots and exactly n are masked (which ones
# is the order of the count's atomics). y must then be the MoE of the routing the kernel left.
# n = 128: one count CTA; n = 1024: count slices on several CTAs, slots reserved across them.
@pytest.mark.parametrize('n', [128, 1024])
@pytest.mark.fp8xfp8
def test_duplicate_expert_overflow_is_cut_flagged_and_masked(n):
    mma_type = 'fp8xfp8'
    hidden, inter, experts, topk = SMALL
    w = mc.make_weights(mma_type, hidden, inter, experts, 1, seed=0)
    (buf,) = mc.make_buffers(mma_type, 1, experts, n, topk, hidden, inter)
    inp = mc.make_inputs(mma_type, [n], hidden, experts, topk, seed=6)[0]
    dup = inp.topk_idx.clone()
    dup[:, 2:] = torch.where(dup[:, 2:] == 3, -1, dup[:, 2:])
    dup[:, :2] = 3
    staged = mc.RankInputs(inp.x, inp.x_q, inp.x_sf, dup, inp.topk_weights)
    (y,) = mc.run_ranks(w, [staged], [buf])
    with pytest.raises(deep_gemm.MegaMoEError) as info:
        buf.check()
    assert info.value.code == 4 and not info.value.fatal
    left = buf.topk_idx[:n].to(dup.device)
    changed = left != dup
    assert int(changed.sum()) == n, 'the cut must mask exactly the n pairs beyond the list'
    assert bool((left[changed] == -1).all()) and not bool(changed[:, 2:].any())
    assert bool(((left[:, :2] == 3).sum() == n).item())
    assert_correct(w, [mc.RankInputs(inp.x, inp.x_q, inp.x_sf, left, inp.topk_weights)], [y], mma_type)
    # Non-fatal: the workspace is consistent, clear_error() and the next call is correct
    buf.clear_error()
    assert_correct(w, [inp], mc.run_ranks(w, [inp], [buf]), mma_type)


@pytest.mark.fp8xfp8
@pytest.mark.parametrize('ranks', [1, 2])
def test_epoch_wraps_around(ranks):
    # The 32-bit call epoch wraps after 2^32 calls on a buffer (days of serving): the published tags
    # (counts, combine_ready) are compared modulo 2^32. The buffers are set to the state 12 calls
    # before the wrap (the last call's epoch in the control word and in every tag), then 24 calls run
    # across it, n = 0..64 (one rank: some weights-first), each checked
    mma_type = 'fp8xfp8'
    hidden, inter, experts, topk = SMALL
    w = mc.make_weights(mma_type, hidden, inter, experts, ranks, seed=0)
    bufs = mc.make_buffers(mma_type, ranks, experts, 64, topk, hidden, inter)
    streams = mc.VirtualRankStreams(ranks)
    last = 2 ** 32 - 12

    def as_int(value, bits):   # the same bits as a signed integer of `bits`
        return (value + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)
    for b in bufs:
        def words(name, dtype):
            offset, num_bytes = b.layout[name]
            return b.workspace[offset:offset + num_bytes].view(dtype)
        words('control', torch.int32)[_C.kControlEpoch] = as_int(last, 32)
        words('recv_count', torch.int64).fill_(as_int(last << 32, 64))   # tag `last`, count 0
        words('combine_ready', torch.int64).fill_(last)
    torch.cuda.synchronize()
    g = torch.Generator().manual_seed(5)
    old = _C.set_mega_moe_weights_first(1)   # this suite pins the persistent kernel; both advance the epoch
    try:
        for call in range(24):
            ns = torch.randint(0, 65, (ranks,), generator=g).tolist()
            if call % 4 == 0:
                ns = [1] * ranks   # one token: the weights-first kernel at one rank
            inputs = mc.make_inputs(mma_type, ns, hidden, experts, topk, seed=700 + call, mask_frac=0.2 * (call % 2))
            ys = mc.run_ranks(w, inputs, bufs, streams=streams)
            for b in bufs:
                b.check()
            assert_correct(w, inputs, ys, mma_type)
    finally:
        _C.set_mega_moe_weights_first(old)
    for b in bufs:
        offset = b.layout['control'][0]
        epoch = int(b.workspace[offset:offset + b.layout['control'][1]].view(torch.int32)[_C.kControlEpoch]) % 2 ** 32
        assert epoch == (last + 24) % 2 ** 32 == 12


SPIN_SOURCE = r'''
extern "C" __global__ void spin(unsigned long long duration_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < duration_ns);
}
'''


@pytest.mark.fp8xfp8
def test_completes_while_another_stream_holds_half_the_sms():
    mma_type = 'fp8xfp8'
    hidden, inter, experts, topk = 2048, 768, 128, 8
    w = mc.make_weights(mma_type, hidden, inter, experts, 1, seed=0)
    (buf,) = mc.make_buffers(mma_type, 1, experts, 1024, topk, hidden, inter)
    inp = mc.make_inputs(mma_type, [1024], hidden, experts, topk, seed=4)[0]
    cubin = compile_helper('test_spin')
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    other = torch.cuda.Stream()
    # The call's kernel compiled and loaded, its inputs staged, before the other stream takes the SMs
    from deep_gemm.mega import launch as mega_launch
    mega_launch.compile_mega_moe_kernel(mma_type, 1024, buf)
    n = mc.stage_inputs(buf, inp)
    y = torch.full((n, hidden), float('nan'), dtype=torch.bfloat16, device='cuda')
    torch.cuda.synchronize()
    # One CTA per SM on half the SMs (200 KB of shared memory each: no MoE CTA fits beside one) for
    # 2 s, well inside the calls' 5 s spin-wait bound
    _C.launch_kernel(cubin, 'spin', [num_sms // 2, 1, 1], [32, 1, 1], 200 * 1024, other.cuda_stream,
                     [2_000_000_000], False)
    spin_done = torch.cuda.Event()
    spin_done.record(other)
    time.sleep(0.1)   # the spin's CTAs resident first
    mega_moe_function(mma_type)(y, *w.per_rank[0], buf)   # the MoE grid wants every SM
    call_done = torch.cuda.Event()
    call_done.record()
    call_done.synchronize()
    # A call that needed its whole grid resident would have finished only after the spin let go
    finished_beside_the_spin = not spin_done.query()
    torch.cuda.synchronize()
    assert finished_beside_the_spin, 'the call completed only once the other stream released its SMs'
    assert_correct(w, [inp], [y], mma_type)
    buf.check()


# Raises the abort of a buffer from outside, `delay_ns` after it starts: the fault lands wherever
# the call is (waiting on a stage, in a wgmma, in an epilogue), unlike a stalled peer, which stops
# a call before its pipeline starts. The word is a timeout with a CTA index no grid has.
INJECT_SOURCE = r'''
extern "C" __global__ void inject(unsigned long long* status, unsigned long long word, unsigned long long delay_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < delay_ns);
    if (threadIdx.x == 0) {
        atomicCAS(status, 0ull, word);
        atomicExch(status + 1, 1ull);
        __threadfence_system();
    }
}
'''
INJECTED_WORD = 1 | (6 << 8) | (0xFFFF << 24) | (0x5AB << 40)    # timeout, pipeline phase, CTA 0xFFFF

# The helper kernels by JIT name (scripts/prebuild_kernels.py compiles them ahead of a device call)
HELPER_KERNELS = {'test_spin': SPIN_SOURCE, 'test_inject': INJECT_SOURCE}


def compile_helper(name):
    return _C.compile(name, HELPER_KERNELS[name])


@pytest.mark.parametrize('n', [128, 4096])       # decode tiles (split columns) and prefill tiles
@pytest.mark.parametrize('mma_type', ['fp8xfp8', 'fp8xfp4', 'bf16xbf16'])
def test_abort_in_the_middle_of_a_call_leaves_cleanly(mma_type, n):
    """Every group leaves together (no thread waits alone at a barrier or wgmma), the producer
    drains the stages it armed, the process and the buffer stay usable after reset()."""
    hidden, inter, experts, topk = 2048, 768, 128, 8
    w = mc.make_weights(mma_type, hidden, inter, experts, 1, seed=0)
    (buf,) = mc.make_buffers(mma_type, 1, experts, n, topk, hidden, inter)
    inp = mc.make_inputs(mma_type, [n], hidden, experts, topk, seed=6)[0]
    fn = mega_moe_function(mma_type)
    cubin = compile_helper('test_inject')
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    status_ptr = buf.workspace.data_ptr() + buf.layout['status'][0]
    other = torch.cuda.Stream()
    old_sms = deep_gemm.get_num_sms()
    deep_gemm.set_num_sms(num_sms - 1)      # the injector keeps one SM
    try:
        (y,) = mc.run_ranks(w, [inp], [buf])                 # warm (JIT), and how long a call takes
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        mc.stage_inputs(buf, inp)
        start.record()
        fn(y, *w.per_rank[0], buf)
        end.record()
        torch.cuda.synchronize()
        call_ns = int(start.elapsed_time(end) * 1e6)
        y.fill_(float('nan'))
        torch.cuda.synchronize()
        t0 = time.time()
        _C.launch_kernel(cubin, 'inject', [1, 1, 1], [32, 1, 1], 0, other.cuda_stream,
                         [status_ptr, INJECTED_WORD, call_ns // 2], False)
        fn(y, *w.per_rank[0], buf)
        torch.cuda.synchronize()
        elapsed = time.time() - t0
        assert elapsed < deep_gemm.get_timeout() + 1.0, f'took {elapsed:.2f} s'
        with pytest.raises(deep_gemm.MegaMoEError) as info:
            buf.check()
        assert info.value.word == INJECTED_WORD and info.value.fatal
        unfinished = int(torch.isnan(y).any(dim=1).sum())
        print(f'{mma_type} n={n}: call {call_ns / 1e3:.0f} us, abort after {call_ns / 2e3:.0f} us, '
              f'{unfinished} of {n} rows left unwritten')
        buf.reset()
        inputs = mc.make_inputs(mma_type, [n], hidden, experts, topk, seed=7)
        assert_correct(w, inputs, mc.run_ranks(w, inputs, [buf]), mma_type)
        buf.check()
    finally:
        deep_gemm.set_num_sms(0 if old_sms == num_sms else old_sms)


@pytest.mark.parametrize('mma_type', ['fp8xfp8', 'bf16xbf16'])
def test_stage_matches_host_quantization(mma_type):
    hidden, inter, experts, topk = 2048, 768, 128, 8
    w = mc.make_weights(mma_type, hidden, inter, experts, 1, seed=0)
    (buf,) = mc.make_buffers(mma_type, 1, experts, 300, topk, hidden, inter)
    inp = mc.make_inputs(mma_type, [300], hidden, experts, topk, seed=5, mask_frac=0.2)[0]
    # Strided rows: stage reads a view of a wider tensor
    wide = torch.randn(300, hidden + 64, device='cuda').bfloat16()
    wide[:, :hidden] = inp.x
    buf.x.fill_(float('nan')) if mma_type == 'bf16xbf16' else buf.x.view(torch.uint8).fill_(0x7F)
    buf.stage(wide[:, :hidden], inp.topk_idx, inp.topk_weights)
    torch.cuda.synchronize()
    n = 300
    if mma_type == 'fp8xfp8':
        assert torch.equal(buf.x[:n].view(torch.uint8), inp.x_q.view(torch.uint8))
        assert torch.equal(buf.x_sf[:n], inp.x_sf)
    else:
        assert torch.equal(buf.x[:n].view(torch.int16), inp.x.view(torch.int16))
    assert torch.equal(buf.topk_idx[:n], inp.topk_idx) and torch.equal(buf.topk_weights[:n], inp.topk_weights)
    y = torch.full((n, hidden), float('nan'), dtype=torch.bfloat16, device='cuda')
    fn = deep_gemm.fp8_mega_moe if mma_type == 'fp8xfp8' else deep_gemm.bf16_mega_moe
    fn(y, *w.per_rank[0], buf)
    torch.cuda.synchronize()
    assert_correct(w, [inp], [y], mma_type)


@pytest.mark.parametrize('mma_type', ['fp8xfp8', 'bf16xbf16'])
def test_ten_thousand_calls_random_n_routing_masks_and_ranks(mma_type):
    hidden, inter, experts, topk = SMALL
    groups = {r: (mc.make_weights(mma_type, hidden, inter, experts, r, seed=r),
                  mc.make_buffers(mma_type, r, experts, 128, topk, hidden, inter),
                  mc.VirtualRankStreams(r)) for r in (1, 2, 4)}
    g = torch.Generator().manual_seed(1)
    unwritten = []   # per call, on the device: any NaN (the poison) left in a rank's y
    for call in range(10_000):
        ranks = (1, 2, 4)[call % 3]
        w, bufs, streams = groups[ranks]
        ns = torch.randint(0, 129, (ranks,), generator=g).tolist()
        inputs = mc.make_inputs(mma_type, ns, hidden, experts, topk, seed=call, mask_frac=float(call % 4) * 0.15)
        ys = mc.run_ranks(w, inputs, bufs, streams=streams)
        unwritten.append(torch.stack([torch.isnan(y).any() for y in ys]).any())
        if call % 500 == 0 or call >= 9_997:   # the reference on a sample, the poison on every call
            assert_correct(w, inputs, ys, mma_type)
    bad = torch.stack(unwritten).nonzero().flatten().tolist()
    assert not bad, f'calls {bad[:5]} left rows of y unwritten'
    for w, bufs, _ in groups.values():
        for b in bufs:
            b.check()


@pytest.mark.fp8xfp8
def test_corrupted_receive_count_is_an_error_not_a_wild_write(short_timeout):
    # Rank 1 is never launched; instead its "published" count for a local expert of rank 0 is
    # forged: tagged with the right epoch but larger than any rank can send.
    mma_type = 'fp8xfp8'
    hidden, inter, experts, topk = SMALL
    w = mc.make_weights(mma_type, hidden, inter, experts, 2, seed=0)
    bufs = mc.make_buffers(mma_type, 2, experts, 64, topk, hidden, inter)
    recv = bufs[0].workspace[bufs[0].layout['recv_count'][0]:].view(torch.int64)
    forged = (1 << 32) | (1 << 20)            # epoch 1 (the first call), count 2^20 > 64
    for local_expert in range(experts // 2):
        recv[local_expert * 2 + 1] = forged   # [local expert][source rank 1]
    inp = mc.make_inputs(mma_type, [64], hidden, experts, topk, seed=1)[0]
    bufs[0].stage(inp.x, inp.topk_idx, inp.topk_weights)
    y = torch.empty(64, hidden, dtype=torch.bfloat16, device='cuda')
    deep_gemm.fp8_mega_moe(y, *w.per_rank[0], bufs[0])
    torch.cuda.synchronize()
    with pytest.raises(deep_gemm.MegaMoEError, match='corrupted receive count') as info:
        bufs[0].check()
    assert info.value.code == 3 and info.value.fatal
    for b in bufs:
        b.reset()
    inputs = mc.make_inputs(mma_type, [64, 9], hidden, experts, topk, seed=2)
    assert_correct(w, inputs, mc.run_ranks(w, inputs, bufs), mma_type)
