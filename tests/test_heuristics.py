"""Config heuristics of the Mega MoE kernel (`csrc/jit_kernels/heuristics/mega_moe.hpp`)."""
import json
import os
import subprocess
import sys

import pytest

from deep_gemm import _C
from deep_gemm.mega import MMA_TYPES

H200_SMEM = 232448
H200_SMS = 132
# Peak HBM bandwidth in GB/s as the launcher computes it from the device (2 x memory clock x bus width)
H200_HBM = 4917
H100_HBM = 3352


def config(mma_type='fp8xfp4', num_ranks=8, num_experts=256, num_topk=8, hidden=7168, intermediate_hidden=2048,
           num_tokens=128, num_sms=H200_SMS, max_smem_bytes=H200_SMEM, hbm_gbps=H200_HBM, block_m=0):
    return _C.get_mega_moe_config(MMA_TYPES[mma_type], num_ranks, num_experts, num_topk, hidden,
                                  intermediate_hidden, num_tokens, num_sms, max_smem_bytes, hbm_gbps=hbm_gbps, block_m=block_m)


def expected_smem(mma_type, block_m, stages):
    # Written from the kernel's carve-up (deep_gemm/impls/mega_moe_params.cuh), independently of the
    # C++: per stage an A tile of block_m rows x 128 bytes of K and the 256-row L1 B tile x 128 bytes
    # (FP4: packed, 64 bytes, plus expanded 256 x 128 E4M3 tiles outside the stages: one for decode
    # tiles, two for prefill tiles, whose next K-block is expanded while the wgmma reads the other);
    # the epilogue tile of block_m BF16 rows of 128 columns padded by 16 bytes (FP4 prefill: inside
    # its two expanded tiles, no bytes of its own); the control block
    # (2 mbarriers per stage, a task ring of 2 mbarriers + an int a slot: 4 slots at block_m 64, 32 at
    # block_m 128, whose dispatch warps fall behind the math by a pull of ~60 us; 2 x 512 + 1 ints of
    # expert tables, 128 ints of pulled-row sources, 64 bytes of scalars, the 256-byte FP4 expansion
    # table) rounded up to 1 KB; 1 KB
    # to re-align the base. FP8 activations add per stage the M-block's scales (block_m floats) and
    # the B tile's weight block scales (gate and up floats, padded to 16 bytes); FP4 adds per stage
    # the B tile's exponent deltas (256 rows x 4 bytes), and rounds those per-stage extras up to 128
    # bytes (the deltas' tensor copy lands at a 128-byte boundary). Prefill tiles (block_m 128) add
    # the pull's staging slots: 16 (FP8 x FP4: 8) of 2 KB, an mbarrier each, 128 bytes of alignment,
    # and the bulk combine's mbarriers: 4 buffers per math warpgroup (its buffers are in the stages and
    # FP4's expanded tiles).
    block_k = 64 if mma_type == 'bf16xbf16' else 128
    elem = 2 if mma_type == 'bf16xbf16' else 1
    fp8 = mma_type != 'bf16xbf16'
    fp4 = mma_type == 'fp8xfp4'
    extras = (block_m * 4 + 16 if fp8 else 0) + (256 * 4 if fp4 else 0)
    if fp4:
        extras = -(-extras // 128) * 128
    a = block_m * block_k * elem + extras
    b = 256 * 64 if fp4 else 256 * block_k * elem
    expanded = 256 * 128 * (2 if block_m == 128 else 1) if fp4 else 0
    epilogue = 0 if fp4 and block_m == 128 else block_m * (128 * 2 + 16)
    ring = 32 if block_m == 128 else 4
    control = -(-(stages * 16 + ring * 20 + (2 * 512 + 1) * 4 + 128 * 4 + 64 + 256) // 1024) * 1024
    pull_slots = (8 if fp4 else 16) if block_m == 128 else 0
    staging = pull_slots * (2048 + 8) + 128 if pull_slots else 0
    combine_bars = 2 * 4 * 8 if block_m == 128 else 0
    return stages * (a + b) + expanded + epilogue + staging + combine_bars + control + 1024


def test_decode_picks_block_m_64_and_prefill_128():
    decode = config('fp8xfp8', num_tokens=8)
    # decode: the two math warpgroups split the columns of a 64-row tile (FP8 x FP4 here takes the CTA
    # pair: test_cta_pair_choice)
    assert decode['block_m'] == 64 and decode['num_math_warpgroups'] == 2 and decode['num_threads'] == 384
    prefill = config(num_tokens=4096)
    assert prefill['block_m'] == 128 and prefill['num_math_warpgroups'] == 2 and prefill['num_threads'] == 384
    # The boundary: 64 expected tokens per local expert is still block_m 64 (n * R * topk / E)
    assert config(num_tokens=256, num_ranks=8, num_experts=256, num_topk=8)['block_m'] == 64   # 64 per expert
    assert config(num_tokens=257, num_ranks=8, num_experts=256, num_topk=8)['block_m'] == 128
    # One GPU, few experts: 64 tokens x 8 / 8 experts = 64 per expert
    assert config(num_ranks=1, num_experts=8, num_topk=8, num_tokens=64)['block_m'] == 64
    assert config(num_ranks=1, num_experts=8, num_topk=8, num_tokens=65)['block_m'] == 128
    # n = 0 (a rank with no tokens this call) is valid
    assert config(num_tokens=0)['block_m'] == 64
    # FP8 x FP8 takes 128 above 63 expected tokens per expert, BF16 above 47 (FP8 x FP4 above 64, as
    # above): one GPU, deepseek-v3 (256 experts, top-8: n / 32 per expert)
    ds = dict(num_ranks=1, num_experts=256, num_topk=8)
    for fmt, most_64 in (('fp8xfp8', 63), ('bf16xbf16', 47), ('fp8xfp4', 64)):
        assert config(fmt, num_tokens=most_64 * 32, **ds)['block_m'] == 64, fmt
        assert config(fmt, num_tokens=most_64 * 32 + 1, **ds)['block_m'] == 128, fmt
    # FP8 x FP4 takes 64 again above 128 and up to 176 expected tokens per expert (the second 128-row
    # M-block mostly padding: docs/PERF.md, session 47); FP8 x FP8 and BF16 stay at 128 there
    # (n / 32 per expert: 4097 is just above 128, 5633 just above 176)
    for n, fp4_block_m in ((4096, 128), (4097, 64), (5120, 64), (5632, 64), (5633, 128), (8192, 128)):
        assert config('fp8xfp4', num_tokens=n, **ds)['block_m'] == fp4_block_m, n
        for fmt in ('fp8xfp8', 'bf16xbf16'):
            assert config(fmt, num_tokens=n, **ds)['block_m'] == 128, (fmt, n)
    # the band counts pairs over all ranks' tokens: EP8, 256 experts, top-8, n = 576 a rank -> 144
    assert config('fp8xfp4', num_tokens=576, num_ranks=8, num_experts=256, num_topk=8)['block_m'] == 64
    # the tuning aid still forces either
    assert config('fp8xfp4', num_tokens=160 * 32, block_m=128, **ds)['block_m'] == 128


@pytest.mark.parametrize('mma_type', list(MMA_TYPES))
def test_fixed_tiles(mma_type):
    c = config(mma_type)
    assert c['mma_type'] == MMA_TYPES[mma_type]
    assert c['block_n_l1'] == 256   # block_n_l2 follows the call (test_l2_task_width)
    assert c['block_k'] == (64 if mma_type == 'bf16xbf16' else 128)
    assert c['num_sms'] == H200_SMS


@pytest.mark.parametrize('mma_type', list(MMA_TYPES))
@pytest.mark.parametrize('num_tokens', [1, 4096])
@pytest.mark.parametrize('max_smem', [H200_SMEM, 228 * 1024, 166912, 101376])
def test_stages_are_the_most_that_fit(mma_type, num_tokens, max_smem):
    block_m = 64 if num_tokens == 1 else 128
    fits = [s for s in range(2, 9) if expected_smem(mma_type, block_m, s) <= max_smem]
    if not fits:
        with pytest.raises(ValueError, match='max_smem_bytes'):
            config(mma_type, num_tokens=num_tokens, max_smem_bytes=max_smem)
        return
    c = config(mma_type, num_tokens=num_tokens, max_smem_bytes=max_smem)
    assert c['block_m'] == block_m
    assert c['num_stages'] == max(fits)
    assert c['smem_bytes'] == expected_smem(mma_type, block_m, c['num_stages']) <= max_smem


def test_h200_stage_counts():
    # 232448 bytes (expected_smem): FP8 block_m 64 -> 5 stages in 229712 (6 would need 270944),
    # block_m 128 -> 3 in 224112 (4: 273792; its 16 pull slots and the epilogue tile take 68 KB).
    # FP8 x FP4 stages hold the packed tile (16 KB + 1 KB of deltas instead of 32 KB) next to fixed
    # 32 KB expanded tiles: one at block_m 64 -> 6 stages in 212224 (7: 239232); two at block_m 128,
    # which also hold the epilogue tile -> 4 x (16384 + 16384 + 1664 extras) + 65536 + 16576 (8 pull
    # slots) + 64 + 6144 (the control block with its 32-slot ring) + 1024 = 227072 (5 would need 261504).
    for mma_type in MMA_TYPES:
        fp4 = mma_type == 'fp8xfp4'
        assert config(mma_type, num_tokens=1)['num_stages'] == (6 if fp4 else 5)
        assert config(mma_type, num_tokens=8192)['num_stages'] == (4 if fp4 else 3)


def test_weight_prefetch_stages():
    # Weight stages a task streams ahead of its inputs (measured, docs/PERF.md sessions 9 and 18):
    # FP8 x FP4 decode (block_m 64) 3 for L1 and L2 tasks; FP8 x FP8 / BF16 decode 2 for L1 tasks,
    # all for L2 tasks; prefill all of its stages
    for mma_type in MMA_TYPES:
        for n in (1, 8, 128, 8192):
            c = config(mma_type, num_tokens=n)
            decode, fp4 = c['block_m'] == 64, mma_type == 'fp8xfp4'
            l1 = min(3 if fp4 else 2, c['num_stages']) if decode else c['num_stages']
            l2 = min(3, c['num_stages']) if decode and fp4 else c['num_stages']
            assert (c['num_prefetch_stages'], c['num_prefetch_stages_l2']) == (l1, l2), (mma_type, n, c)
            assert f"num_prefetch_stages={l1}, num_prefetch_stages_l2={l2}" in c['description']
    assert config('fp8xfp4', num_tokens=1)['num_prefetch_stages'] == 3
    assert config('fp8xfp4', num_tokens=8192)['num_prefetch_stages'] == 4
    assert (config('fp8xfp8', num_tokens=1)['num_prefetch_stages'], config('fp8xfp8', num_tokens=1)['num_prefetch_stages_l2']) == (2, 5)
    # fewer stages than the cap: all of them
    small = config('fp8xfp4', num_tokens=1, max_smem_bytes=expected_smem('fp8xfp4', 64, 2))
    assert small['num_stages'] == small['num_prefetch_stages'] == small['num_prefetch_stages_l2'] == 2


def test_stages_are_capped_at_8():
    c = config(num_tokens=1, max_smem_bytes=1 << 20)
    assert c['num_stages'] == 8
    assert c['smem_bytes'] == expected_smem('fp8xfp4', 64, 8)


def test_experts_per_wave():
    # Decode, EP8: 32 local experts, 1 expected M-block x 16 N-blocks (2 * 2048 / 256) each:
    # ceil(132 / 16) = 9 experts fill the SMs once
    assert config(num_tokens=1)['num_experts_per_wave'] == 9
    # Prefill: 4096 * 8 * 8 / 256 = 1024 tokens per expert = 8 M-blocks of 128 -> 128 tasks; 2 experts
    assert config(num_tokens=4096)['num_experts_per_wave'] == 2
    # Huge experts: one is enough
    assert config(num_tokens=65536)['num_experts_per_wave'] == 1
    # Never more than the local experts
    assert config(num_ranks=8, num_experts=16, num_tokens=1, intermediate_hidden=128)['num_experts_per_wave'] == 2
    # Fewer SMs (sharing the GPU with other streams): fewer experts per wave
    assert config(num_tokens=1, num_sms=16)['num_experts_per_wave'] == 1
    assert config(num_tokens=1, num_sms=33)['num_experts_per_wave'] == 3


@pytest.mark.parametrize('kwargs, name', [
    (dict(num_ranks=0), 'num_ranks'),
    (dict(num_ranks=16, num_experts=256), 'num_ranks'),
    (dict(num_experts=100), 'num_experts'),
    (dict(num_topk=0), 'num_topk'),
    (dict(num_topk=257), 'num_topk'),
    (dict(hidden=7000), 'hidden'),
    (dict(intermediate_hidden=100), 'intermediate_hidden'),
    (dict(num_tokens=-1), 'num_tokens'),
    (dict(num_sms=0), 'num_sms'),
    (dict(max_smem_bytes=0), 'max_smem_bytes'),
    (dict(max_smem_bytes=60000), 'max_smem_bytes'),   # not even 2 stages
])
def test_invalid_inputs_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        config(**kwargs)


def test_invalid_mma_type_raises():
    with pytest.raises(ValueError, match='mma_type'):
        _C.get_mega_moe_config(7, 8, 256, 8, 7168, 2048, 1, 132, H200_SMEM)


def test_description_is_printable():
    text = config(num_tokens=1)['description']
    assert text.startswith('MegaMoEConfig(') and 'block_m=64' in text and 'num_stages=6' in text


_PRINT_SCRIPT = """
from deep_gemm import _C
args = (0, 8, 256, 8, 7168, 2048)
print('first', _C.print_mega_moe_config_if_requested(*args, 1, 132, 232448), flush=True)
print('again', _C.print_mega_moe_config_if_requested(*args, 1, 132, 232448), flush=True)
print('other', _C.print_mega_moe_config_if_requested(*args, 8192, 132, 232448), flush=True)
"""


def _run_script(script, env_name, env_value, *args, extra_env=None):
    """stdout of `python -c script args` in a fresh process (the C++ side reads env_name once per
    process), with env_name set to env_value or unset (None), and extra_env's names set too."""
    env = dict(os.environ)
    env.pop(env_name, None)
    if env_value is not None:
        env[env_name] = env_value
    env.update(extra_env or {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env['PYTHONPATH'] = root + os.pathsep + env.get('PYTHONPATH', '')
    return subprocess.run([sys.executable, '-c', script, *args], env=env, capture_output=True, text=True,
                          check=True, cwd=root).stdout


def _run_print_script(env_value):
    return _run_script(_PRINT_SCRIPT, 'DG_PRINT_CONFIGS', env_value)


def test_print_configs_once_per_distinct_config():
    out = _run_print_script('1').splitlines()
    printed = [line for line in out if line.startswith('[deep_gemm] MegaMoEConfig(')]
    assert len(printed) == 2
    assert 'block_m=64' in printed[0] and 'block_m=128' in printed[1]
    assert 'first True' in out and 'again False' in out and 'other True' in out


@pytest.mark.parametrize('value', [None, '0'])
def test_print_configs_off_by_default(value):
    out = _run_print_script(value)
    assert 'MegaMoEConfig' not in out
    assert 'first False' in out


@pytest.mark.parametrize('mma_type', list(MMA_TYPES))
@pytest.mark.parametrize('num_tokens', [1, 4096])
def test_smem_breakdown_adds_up(mma_type, num_tokens):
    # The printed breakdown (DG_PRINT_CONFIGS) accounts for every byte of smem_bytes
    c = config(mma_type, num_tokens=num_tokens)
    per_stage = c['smem_a_per_stage'] + c['smem_b_per_stage']
    assert c['num_stages'] * per_stage + c['smem_epilogue'] + c['smem_barriers'] == c['smem_bytes']
    assert c['smem_a_per_stage'] >= c['block_m'] * 128 and c['smem_barriers'] > 0


def test_l2_task_width():
    # 256-wide L2 tasks for decode calls whose 128-wide L2 tasks would outnumber the SMs (v4-flash
    # at one token: 6 experts x 32 = 192 > 132)
    assert config('fp8xfp8', num_ranks=1, num_experts=256, num_topk=6, hidden=4096, num_tokens=1)['block_n_l2'] == 256
    # mid at one token: 8 experts x 16 = 128 tasks fit 132 SMs
    assert config('fp8xfp8', num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768,
                  num_tokens=1)['block_n_l2'] == 128
    # ... but not on 64 SMs
    assert config('fp8xfp8', num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768,
                  num_tokens=1, num_sms=64)['block_n_l2'] == 256
    # prefill (BLOCK_M 128): BF16 256-wide always, FP8 x FP8 from 12 expected 256-wide L2 tasks per SM
    # (mid n = 8192: 128 experts x 4 M-blocks x 8 = 4096 on 132 SMs, 31 each; n = 4096: 15.5; n = 2048 and
    # 1280: one M-block each, 7.8), FP8 x FP4 128
    for fmt, n, width in [('fp8xfp8', 8192, 256), ('fp8xfp8', 4096, 256), ('fp8xfp8', 2048, 128), ('fp8xfp8', 1280, 128),
                          ('fp8xfp4', 8192, 128), ('bf16xbf16', 8192, 256), ('bf16xbf16', 4096, 256),
                          ('bf16xbf16', 1280, 256)]:
        c = config(fmt, num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768, num_tokens=n)
        assert (c['block_m'], c['block_n_l2']) == (128, width), (fmt, n, c)
    # ... per SM: mid n = 4096 on 264 SMs (7.8 each) stays 128; v4-flash n = 4096 (256 experts x 1 x 16
    # = 4096, 31 each) 256, but not where H is not whole 256-wide tasks (BF16 too)
    assert config('fp8xfp8', num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768,
                  num_tokens=4096, num_sms=264)['block_n_l2'] == 128
    for fmt in ('fp8xfp8', 'bf16xbf16'):
        assert config(fmt, num_ranks=1, num_experts=256, num_topk=6, hidden=4224, num_tokens=4096)['block_n_l2'] == 128
    assert config('fp8xfp8', num_ranks=1, num_experts=256, num_topk=6, hidden=4096, num_tokens=4096)['block_n_l2'] == 256
    # decode with 8 or more tokens per expert (mid: n = 128 is 8 per expert, n = 512 32; BLOCK_M 64
    # up to 63, BF16 47, FP8 x FP4 64): FP8 and BF16 512-wide, FP8 x FP4 256-wide; fewer tokens per expert 256 (mid n = 8,
    # 64: 0.5, 4 per expert)
    mid = dict(num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768)
    for fmt, n, width in [('fp8xfp8', 8, 256), ('fp8xfp8', 64, 256), ('fp8xfp8', 128, 512), ('fp8xfp8', 512, 512),
                          ('fp8xfp8', 1008, 512), ('bf16xbf16', 8, 256), ('bf16xbf16', 256, 512),
                          ('fp8xfp4', 8, 256), ('fp8xfp4', 256, 256), ('fp8xfp4', 1024, 256)]:
        c = config(fmt, num_tokens=n, **mid)
        assert (c['block_m'], c['block_n_l2']) == (64, width), (fmt, n, c)
    # ... where H is whole tasks of that width: H = 768 (3 x 256) at 16 tokens per expert: 256
    c = config('fp8xfp8', num_ranks=1, num_experts=64, num_topk=8, hidden=768, intermediate_hidden=384, num_tokens=128)
    assert (c['block_m'], c['block_n_l2']) == (64, 256)


def test_l2_task_width_one_wave():
    # Every format 512-wide where the L1 tasks fit the SMs and 512-wide L2 tasks would take one round
    # but 256-wide ones two: deepseek-v3 at one token (8 experts: 128 L1 tasks, 224 L2 tasks of 256,
    # 112 of 512 on 132 SMs)
    ds = dict(num_ranks=1, num_experts=256, num_topk=8, hidden=7168, intermediate_hidden=2048)
    for fmt in ('fp8xfp8', 'fp8xfp4', 'bf16xbf16'):
        c = config(fmt, num_tokens=1, **ds)
        assert (c['block_m'], c['block_n_l2'], c['signals_thread']) == (64, 512, False), (fmt, c)
        # two tokens: 16 experts, 256 L1 tasks, two L1 rounds: 256-wide (FP8 x FP4 with its signals thread)
        assert config(fmt, num_tokens=2, **ds)['block_n_l2'] == 256, fmt
        # fewer SMs than L1 tasks: 256
        assert config(fmt, num_tokens=1, num_sms=120, **ds)['block_n_l2'] == 256, fmt
        # v4-flash at one token: 96 L1 tasks, but 96 256-wide L2 tasks already fit: 256
        assert config(fmt, num_ranks=1, num_experts=256, num_topk=6, hidden=4096, num_tokens=1)['block_n_l2'] == 256
        # ... and at two: 192 L1 tasks (v4-flash FP8 x FP4 n = 2 512-wide: +14 %, session 30)
        assert config(fmt, num_ranks=1, num_experts=256, num_topk=6, hidden=4096, num_tokens=2)['block_n_l2'] == 256
    # mid at one token on 48 SMs: 48 L1 tasks, 128 L2 tasks of 128 / 64 of 256 / 32 of 512: 512
    mid = dict(num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768)
    assert config('fp8xfp4', num_tokens=1, num_sms=48, **mid)['block_n_l2'] == 512
    # ... on 64: the 64 L2 tasks of 256 fit one round: 256
    assert config('fp8xfp4', num_tokens=1, num_sms=64, **mid)['block_n_l2'] == 256
    # per rank: 8 ranks of deepseek-v3 at one token each receive 8 pairs each on average (8 of their 32
    # experts): 512
    assert config('fp8xfp4', num_ranks=8, num_experts=256, num_topk=8, hidden=7168, intermediate_hidden=2048,
                  num_tokens=1)['block_n_l2'] == 512


def test_l2_task_width_counts_one_ranks_tasks():
    # The count is per rank: 8 ranks, 128 experts, top-8, H 2048, one token each -> each rank
    # receives 8 pairs -> at most 8 of its 16 experts -> 8 x 16 = 128 tasks of 128 on 132 SMs
    c = config('fp8xfp8', num_ranks=8, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768, num_tokens=1)
    assert c['block_n_l2'] == 128
    # 4 tokens each, 256 experts, H 4096: 32 pairs per rank over its 32 experts -> 32 x 32 tasks
    c = config('fp8xfp8', num_ranks=8, num_experts=256, num_topk=8, hidden=4096, num_tokens=4)
    assert c['block_n_l2'] == 256


# The kernel variant a call launches (the L2 width is a template argument: kernels of either width
# exist side by side), with DG_MEGA_MOE_L2_BLOCK_N unset or set, in a fresh process (the launcher
# reads the setting once per process)
# `_C.<argv[1]>(*args)` for each args of the JSON list argv[2] (a ValueError's text in its place)
_CALLS_SCRIPT = """
import json, sys
from deep_gemm import _C
out = []
for args in json.loads(sys.argv[2]):
    try:
        out.append(getattr(_C, sys.argv[1])(*args))
    except ValueError as e:
        out.append(str(e))
print(json.dumps(out))
"""

# (mma_type, num_ranks, num_experts, num_topk, hidden, intermediate_hidden, num_tokens, num_sms)
_V4_FLASH_N1 = (MMA_TYPES['fp8xfp8'], 1, 256, 6, 4096, 2048, 1, H200_SMS)     # 6 x 32 = 192 L2 tasks of 128
_MID_N1 = (MMA_TYPES['fp8xfp8'], 1, 128, 8, 2048, 768, 1, H200_SMS)          # 8 x 16 = 128 fit 132 SMs
_MID_N4096 = (MMA_TYPES['fp8xfp8'], 1, 128, 8, 2048, 768, 4096, H200_SMS)    # prefill: BLOCK_M 128
_ODD_H_N1 = (MMA_TYPES['fp8xfp8'], 1, 256, 6, 1152, 2048, 1, H200_SMS)       # H = 9 x 128: no 256-wide task
_V4_FP4_N1 = (MMA_TYPES['fp8xfp4'], 1, 256, 6, 4096, 2048, 1, H200_SMS)
_V4_BF16_N1 = (MMA_TYPES['bf16xbf16'], 1, 256, 6, 4096, 2048, 1, H200_SMS)
_H768_N1 = (MMA_TYPES['fp8xfp8'], 1, 64, 8, 768, 384, 1, H200_SMS)           # H = 3 x 256: no 512-wide task
_MID_FP4_N4096 = (MMA_TYPES['fp8xfp4'], 1, 128, 8, 2048, 768, 4096, H200_SMS)   # prefill, no 256-wide variant
_CASES = [_V4_FLASH_N1, _MID_N1, _MID_N4096, _ODD_H_N1, _V4_FP4_N1, _V4_BF16_N1, _H768_N1, _MID_FP4_N4096]


def _launched_variants(override, cases=_CASES):
    # the persistent kernel's variants: its one-token EP1 cases would otherwise run weights-first
    return json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_L2_BLOCK_N', override, 'get_mega_moe_kernel_variant',
                                  json.dumps(cases), extra_env={'DG_MEGA_MOE_WEIGHTS_FIRST': '0'}))


@pytest.mark.parametrize('override, widths', [
    (None, [256, 128, 256, 128, 256, 256, 128, 128]),    # the heuristic's choice (mid FP8 n = 4096: 15.5 256-wide tasks per SM)
    ('128', [128, 128, 128, 128, 128, 128, 128, 128]),
    ('256', [256, 256, 256, 128, 256, 256, 256, 128]),   # BLOCK_M 128: not FP8 x FP4; not with H % 256 != 0
    ('512', [512, 512, 256, 128, 512, 512, 256, 128]),   # the widest that divides H (512: BLOCK_M 64 only)
])
def test_launched_kernel_has_the_l2_width(override, widths):
    for args, v, width in zip(_CASES, _launched_variants(override), widths):
        c = config(list(MMA_TYPES)[args[0]], *args[1:])
        assert (v['block_m'], v['num_stages'], v['block_n_l2']) == (c['block_m'], c['num_stages'], width), (args, v)
        assert v['mma_type'] == args[0] and v['fast_math'] is True
        # the kernel of that width: its cache name and its template arguments
        assert f"_m{v['block_m']}_n{width}_s{v['num_stages']}_fast" in v['name']
        source = _C.get_mega_moe_kernel_source(v['mma_type'], v['block_m'], v['num_stages'], True, v['block_n_l2'],
                                               v['wide_n_min'])
        assert source.rstrip().endswith(f"{v['block_m']}, {v['num_stages']}, true, {width}, {v['wide_n_min']})"), source


def test_launcher_rejects_a_bad_l2_width_setting():
    out = _launched_variants('192', [_MID_N1])
    assert 'DG_MEGA_MOE_L2_BLOCK_N' in out[0] and "'192'" in out[0]


@pytest.mark.parametrize('block_m', [64, 128])
def test_block_m_override(block_m):
    # The tuning aid DG_MEGA_MOE_BLOCK_M (the heuristic's block_m argument): the config is the one the
    # heuristic builds around that BLOCK_M (stages, L2 width), on either side of the heuristic's own rule
    for n in (8, 2048, 4096):   # deepseek-v3: 0.25, 64 and 128 tokens per expert
        c = config('bf16xbf16', num_ranks=1, num_experts=256, num_topk=8, hidden=7168, num_tokens=n, block_m=block_m)
        assert c['block_m'] == block_m and c['num_stages'] == (3 if block_m == 128 else 5), (n, c['description'])
    # the launcher reads the variable once per process
    ds = (MMA_TYPES['bf16xbf16'], 1, 256, 8, 7168, 2048, 2048, H200_SMS)
    v, = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_BLOCK_M', str(block_m), 'get_mega_moe_kernel_variant',
                                json.dumps([ds])))
    assert v['block_m'] == block_m and f"_m{block_m}_" in v['name']


def test_bad_block_m_is_rejected():
    with pytest.raises(ValueError, match='block_m = 96 is invalid: expected 0'):
        config(num_tokens=8, block_m=96)
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_BLOCK_M', '256', 'get_mega_moe_kernel_variant',
                                 json.dumps([_MID_N1])))
    assert 'DG_MEGA_MOE_BLOCK_M' in out[0] and "'256'" in out[0]


def test_wide_l2_block_m_rules():
    # BLOCK_M 128: 256 wide for FP8 x FP8 and BF16 (one K loop over a 256-row B tile); never 512
    for fmt in ('fp8xfp8', 'bf16xbf16'):
        assert _C.get_mega_moe_kernel_source(MMA_TYPES[fmt], 128, 3, True, 256).rstrip().endswith('128, 3, true, 256, 64)')
    with pytest.raises(ValueError, match='block_n_l2'):
        _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp4'], 128, 4, True, 256)
    with pytest.raises(ValueError, match='block_n_l2'):
        _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp8'], 128, 3, True, 512)
    for width in (192, 1024):
        with pytest.raises(ValueError, match='block_n_l2'):
            _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp8'], 64, 5, True, width)
    # the default is the 128-wide kernel
    assert _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp8'], 64, 5) == \
        _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp8'], 64, 5, True, 128)


# Split-K L1 cap per format (the kernel picks 1, 2 or 4 parts per call up to it), with
# DG_MEGA_MOE_L1_SPLIT unset or set, in a fresh process (read once per process)
def _split_caps(override):
    return json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_L1_SPLIT', override, 'get_mega_moe_l1_split_max',
                                  json.dumps([[t] for t in range(3)])))


@pytest.mark.parametrize('override, caps', [
    (None, {'fp8xfp4': 2, 'fp8xfp8': 1, 'bf16xbf16': 2}),   # measured: FP8 x FP8 slower split (docs/PERF.md)
    ('0', {'fp8xfp4': 1, 'fp8xfp8': 1, 'bf16xbf16': 1}),
    ('1', {'fp8xfp4': 1, 'fp8xfp8': 1, 'bf16xbf16': 1}),
    ('4', {'fp8xfp4': 4, 'fp8xfp8': 4, 'bf16xbf16': 4}),
])
def test_l1_split_cap_per_format(override, caps):
    out = _split_caps(override)
    assert out == [caps[name] for name, _ in sorted(MMA_TYPES.items(), key=lambda kv: kv[1])]


def test_launcher_rejects_a_bad_l1_split_setting():
    out = _split_caps('3')
    assert all('DG_MEGA_MOE_L1_SPLIT' in o and "'3'" in o for o in out), out
    with pytest.raises(ValueError, match='mma_type'):
        _C.get_mega_moe_l1_split_max(3)


# The split-K L1 plan (the kernel's build_layout calls the same function): the rows the kernel's
# comments and docs/KERNEL.md name, then, for many (tiles, K-blocks, grid), the plan against a list
# schedule of its parts (each SM takes the next part in task order when it is free): with at most one
# tile per SM no plan of even parts up to the cap may end sooner; with more tiles than SMs it never
# splits (its cost of the unsplit tiles is one round)
@pytest.mark.parametrize('tiles, num_kb, grid, split_max, plan', [
    (48, 16, 132, 2, (2, 8)),      # mid at one token: halves
    (96, 32, 132, 2, (1, 32)),     # v4-flash at one token: halves would take two rounds of 16
    (96, 32, 132, 4, (4, 8)),      # ... quarters three rounds of 8 (measured slower: the cap is 2)
    (24, 6, 132, 2, (2, 3)),       # ODD_256 of the GPU tests
    (12, 5, 132, 2, (1, 5)),       # an odd K-block count does not halve
    (48, 16, 132, 1, (1, 16)),     # the cap: FP8 x FP8 never splits
    (200, 32, 132, 4, (1, 32)),    # more tiles than SMs: no split pays
    (129, 16, 132, 2, (1, 16)),    # more than kMaxSplitTiles tiles
    (128, 16, 132, 4, (1, 16)),    # quarters: 512 parts would do, but take 4 rounds of 4
    (0, 32, 132, 2, (1, 32)),
])
def test_l1_split_plan_rows(tiles, num_kb, grid, split_max, plan):
    assert tuple(_C.get_mega_moe_l1_split_plan(tiles, num_kb, grid, split_max)) == plan


def _list_schedule_end(tiles, grid, parts, part_kb):
    free = [0] * grid
    for _ in range(tiles * parts):
        i = min(range(grid), key=lambda k: free[k])
        free[i] += part_kb
    return max(free)


@pytest.mark.parametrize('grid', [8, 64, 78, 132])
def test_l1_split_plan_against_a_list_schedule(grid):
    for num_kb in (3, 5, 6, 16, 32, 56, 64):
        for tiles in range(1, 129):
            for split_max in (1, 2, 4):
                parts, part_kb = _C.get_mega_moe_l1_split_plan(tiles, num_kb, grid, split_max)
                assert parts in (1, 2, 4) and parts <= split_max or parts == 1, (tiles, num_kb, grid, split_max, parts)
                assert parts * part_kb == num_kb and tiles * parts <= 512
                if tiles > grid:   # the rule measures against one round of whole tiles: no split
                    assert parts == 1, (tiles, num_kb, grid, split_max, parts)
                    continue
                end = _list_schedule_end(tiles, grid, parts, part_kb)
                others = [_list_schedule_end(tiles, grid, s, num_kb // s) for s in (1, 2, 4)
                          if s <= max(split_max, 1) and num_kb % s == 0 and tiles * s <= 512]
                assert end == min(others), (tiles, num_kb, grid, split_max, parts, end, others)


# FP8 x FP4 decode: the kernel with transposed tiles of N = 16 / 32 from 6 expected tokens per local
# expert on (kFP4WideTokensPerExpert), N = 64 only below; every other kernel N = 64 (none of its own)
@pytest.mark.parametrize('fmt, experts, topk, n, ranks, wide_n_min', [
    ('fp8xfp4', 256, 6, 128, 1, 64),     # 3 tokens per expert: narrow tiles dominate
    ('fp8xfp4', 256, 6, 255, 1, 64),     # 5.98
    ('fp8xfp4', 256, 6, 256, 1, 16),     # 6
    ('fp8xfp4', 256, 6, 512, 1, 16),
    ('fp8xfp4', 128, 8, 128, 1, 16),     # 8
    ('fp8xfp4', 256, 8, 32, 8, 16),      # 8 ranks of 32 tokens: 8 per expert
    ('fp8xfp4', 256, 8, 1 << 14, 1, 64),  # prefill (BLOCK_M 128): no transposed tiles
    ('fp8xfp8', 256, 6, 512, 1, 64),
    ('bf16xbf16', 128, 8, 128, 1, 64),
])
def test_fp4_decode_wide_tiles(fmt, experts, topk, n, ranks, wide_n_min):
    c = config(fmt, num_ranks=ranks, num_experts=experts, num_topk=topk, hidden=4096, num_tokens=n)
    assert c['wide_n_min'] == wide_n_min, c
    assert f'wide_n_min={wide_n_min}' in c['description']


def test_wide_n_variant_arguments():
    # the N = 16 / 32 tiles exist in FP8 x FP4 decode kernels only; the default is N = 64 only
    for bad in [(MMA_TYPES['fp8xfp8'], 64, 5, True, 128, 16), (MMA_TYPES['fp8xfp4'], 128, 4, True, 128, 16),
                (MMA_TYPES['fp8xfp4'], 64, 6, True, 128, 8)]:
        with pytest.raises(ValueError, match='wide_n_min'):
            _C.get_mega_moe_kernel_source(*bad)
    assert _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp4'], 64, 6) == \
        _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp4'], 64, 6, True, 128, 64)
    assert _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp4'], 64, 6, True, 256, 16).rstrip().endswith('true, 256, 16)')


_V4_FP4_N512 = (MMA_TYPES['fp8xfp4'], 1, 256, 6, 4096, 2048, 512, H200_SMS)


@pytest.mark.parametrize('override, wide_ns', [
    (None, [64, 16, 64]),    # the heuristic's: v4-flash FP4 n = 1 / 512, FP8
    ('16', [16, 16, 64]),
    ('32', [32, 32, 64]),
    ('64', [64, 64, 64]),    # not where the kernel has no transposed tiles (FP8)
])
def test_launched_kernel_has_the_wide_tiles(override, wide_ns):
    cases = [_V4_FP4_N1, _V4_FP4_N512, _V4_FLASH_N1]
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_WIDE_N', override, 'get_mega_moe_kernel_variant', json.dumps(cases)))
    assert [v['wide_n_min'] for v in out] == wide_ns
    for v in out:
        assert v['name'].endswith(f"_w{v['wide_n_min']}") == (v['wide_n_min'] != 64), v['name']


def test_launcher_rejects_a_bad_wide_n_setting():
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_WIDE_N', '8', 'get_mega_moe_kernel_variant', json.dumps([_V4_FP4_N1])))
    assert 'DG_MEGA_MOE_WIDE_N' in out[0] and "'8'" in out[0]


# DG_MEGA_MOE_WS_STAGES caps the weights-first kernel's stages (a tuning aid: the stage A/B of
# docs/PERF.md session 53); unset, the most that fit, at most 8 (FP8 x FP4: 8, FP8 x FP8 at v4-flash: 6);
# a cap above the fit changes nothing; a value outside 3..8 is refused by name
@pytest.mark.parametrize('cap, stages', [(None, [8, 6]), ('7', [7, 6]), ('5', [5, 5]), ('8', [8, 6])])
def test_weights_first_stage_cap(cap, stages):
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_WS_STAGES', cap, 'get_mega_moe_kernel_variant',
                                 json.dumps([_V4_FP4_N1, _V4_FLASH_N1]), extra_env={'DG_MEGA_MOE_WEIGHTS_FIRST': '1'}))
    assert [v['weights_first'] for v in out] == [True, True]
    assert [v['num_stages'] for v in out] == stages
    assert all(v['name'].startswith(f"sm90_mega_moe_ws_{fmt}_s{s}_") for v, fmt, s in zip(out, ('fp8xfp4', 'fp8xfp8'), stages))


def test_launcher_rejects_a_bad_ws_stages_setting():
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_WS_STAGES', '9', 'get_mega_moe_kernel_variant', json.dumps([_V4_FP4_N1]),
                                 extra_env={'DG_MEGA_MOE_WEIGHTS_FIRST': '1'}))
    assert 'DG_MEGA_MOE_WS_STAGES' in out[0] and "'9'" in out[0]


# The signals thread (FP8 x FP4 decode, a kernel variant): on from kSignalsThreadMinTasksPerSM (4)
# expected L1 + L2 tasks per SM, off at one token (v4-flash: 96 + 96 tasks on 132 SMs), in prefill
# tiles and in the other formats (their kernels raise their own signals)
@pytest.mark.parametrize('fmt, hidden, inter, experts, topk, n, on', [
    ('fp8xfp4', 4096, 2048, 256, 6, 1, False),    # 192 tasks on 132 SMs
    ('fp8xfp4', 4096, 2048, 256, 6, 2, False),    # 384: 2.9 per SM
    ('fp8xfp4', 4096, 2048, 256, 6, 4, True),     # 768: 5.8 per SM
    ('fp8xfp4', 4096, 2048, 256, 6, 8, True),
    ('fp8xfp4', 4096, 2048, 256, 6, 128, True),
    ('fp8xfp4', 7168, 2048, 256, 8, 8, True),
    ('fp8xfp4', 2048, 768, 128, 8, 1, False),     # mid: 8 x (6 + 8) = 112 tasks
    ('fp8xfp4', 2048, 768, 128, 8, 4, False),     # 448: 3.4 per SM
    ('fp8xfp4', 2048, 768, 128, 8, 8, True),      # 896
    ('fp8xfp4', 2048, 768, 128, 8, 128, True),
    ('fp8xfp4', 4096, 2048, 256, 6, 4096, False),  # prefill tiles
    ('fp8xfp8', 4096, 2048, 256, 6, 8, False),
    ('bf16xbf16', 4096, 2048, 256, 6, 128, False),
])
def test_signals_thread_choice(fmt, hidden, inter, experts, topk, n, on):
    c = config(fmt, num_ranks=1, num_experts=experts, num_topk=topk, hidden=hidden, intermediate_hidden=inter, num_tokens=n)
    assert c['signals_thread'] is on, c
    assert f'signals_thread={int(on)}' in c['description']


_V4_FP4_N8 = (MMA_TYPES['fp8xfp4'], 1, 256, 6, 4096, 2048, 8, H200_SMS)


def _launched_kernel_kind(env, override, key, suffix, on):
    """The variants launch_mega_moe picks for v4-flash FP4 n = 1 / 8 and FP8 n = 1 under `env` = override
    (a child: read once per process); each variant with `key` on is a kernel of its own: its cache name
    has `suffix`, its source defines `env` as 1."""
    cases = [_V4_FP4_N1, _V4_FP4_N8, _V4_FLASH_N1]
    out = json.loads(_run_script(_CALLS_SCRIPT, env, override, 'get_mega_moe_kernel_variant', json.dumps(cases)))
    assert [v[key] for v in out] == on
    for v in out:
        assert (suffix in v['name']) == v[key], v['name']
        source = _C.get_mega_moe_kernel_source(v['mma_type'], v['block_m'], v['num_stages'], True, v['block_n_l2'],
                                               v['wide_n_min'], v['signals_thread'], v['cta_pair'])
        assert (f'#define {env} 1' in source) == v[key], source
    return out


# (override, on) for the cases above: the heuristic's (v4-flash FP4 n = 1 / 8, FP8), forced on (not
# where the kernel cannot have it: FP8), forced off
_KIND_OVERRIDES = [(None, [False, True, False]), ('1', [True, True, False]), ('0', [False, False, False])]


@pytest.mark.parametrize('override, on', _KIND_OVERRIDES)
def test_launched_kernel_has_the_signals_thread(override, on):
    _launched_kernel_kind('DG_MEGA_MOE_SIGNALS_THREAD', override, 'signals_thread', '_sig', on)


def test_signals_thread_variant_arguments():
    for bad in [(MMA_TYPES['fp8xfp8'], 64, 5, True, 128, 64, True), (MMA_TYPES['fp8xfp4'], 128, 4, True, 128, 64, True)]:
        with pytest.raises(ValueError, match='signals_thread'):
            _C.get_mega_moe_kernel_source(*bad)
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_SIGNALS_THREAD', '2', 'get_mega_moe_kernel_variant', json.dumps([_V4_FP4_N1])))
    assert 'DG_MEGA_MOE_SIGNALS_THREAD' in out[0] and "'2'" in out[0]


def test_signals_thread_counts_tasks_per_sm():
    # the same call on fewer SMs has more tasks per SM: v4-flash at two tokens, 384 tasks
    kw = dict(num_ranks=1, num_experts=256, num_topk=6, hidden=4096, intermediate_hidden=2048, num_tokens=2)
    assert not config('fp8xfp4', **kw)['signals_thread']
    assert config('fp8xfp4', num_sms=64, **kw)['signals_thread']


# The CTA pair (FP8 x FP4 decode, kernel variant `_pair`): below 6 expected tokens per expert (token
# passes of 8) from 8 expected L1 + L2 tasks per SM (docs/PERF.md, sessions 31-33); from 6 to 16 tokens
# per expert (passes of 32 with N = 16 / 32 tiles, `_pair_w16`) from 32 tasks per SM (session 35).
# Rows: (shape, n, picked)
_V4, _DS, _MID = (256, 6, 4096, 2048), (256, 8, 7168, 2048), (128, 8, 2048, 768)


@pytest.mark.parametrize('shape, n, on', [
    (_V4, 1, False), (_V4, 2, False), (_V4, 8, True), (_V4, 16, True), (_V4, 32, True),
    (_V4, 64, True), (_V4, 192, True),
    (_V4, 256, True), (_V4, 512, True), (_V4, 682, True),   # 6 / 12 / 16 tokens per expert: N = 16 / 32 tiles, 62 tasks per SM
    (_V4, 683, False), (_V4, 1024, False), (_V4, 2048, False),   # more than 16 per expert: second token passes
    (_DS, 4, True), (_DS, 8, True), (_DS, 32, True), (_DS, 128, True), (_DS, 192, True), (_DS, 512, True),
    (_DS, 768, False),
    (_MID, 8, False),     # 6.8 tasks per SM
    (_MID, 16, True), (_MID, 32, True), (_MID, 64, True),
    (_MID, 96, False), (_MID, 256, False),   # 6 / 16 tokens per expert, 13.6 tasks per SM
])
def test_cta_pair_choice(shape, n, on):
    experts, topk, hidden, inter = shape
    c = config('fp8xfp4', num_ranks=1, num_experts=experts, num_topk=topk, hidden=hidden, intermediate_hidden=inter, num_tokens=n)
    assert c['cta_pair'] is on, c
    assert f'cta_pair={int(on)}' in c['description']
    # on an H100 (and where the bandwidth is unknown) the pair of N = 16 / 32 tiles is not taken
    for hbm in (H100_HBM, 0):
        other = config('fp8xfp4', num_ranks=1, num_experts=experts, num_topk=topk, hidden=hidden, intermediate_hidden=inter,
                       num_tokens=n, hbm_gbps=hbm)
        assert other['cta_pair'] is (on and c['wide_n_min'] == 64), (hbm, other)
    solo = _C.get_mega_moe_config(MMA_TYPES['fp8xfp4'], 1, experts, topk, hidden, inter, n, H200_SMS, H200_SMEM, cta_pair=0)
    # the pair keeps the two-warpgroup kernel's transposed tiles: N = 64 only below 6 tokens per expert
    assert c['wide_n_min'] == solo['wide_n_min'] == (16 if n * topk >= 6 * experts else 64)
    if on:
        # two CTAs an SM: 256 threads, one math warpgroup, two stages in half an SM (228 KB / 2 less the
        # driver's 1 KB a CTA); the rest is the two-warpgroup kernel's choice
        assert (c['num_sms'], c['num_threads'], c['num_math_warpgroups']) == (2 * H200_SMS, 256, 1)
        assert c['num_stages'] == 2 and c['smem_bytes'] <= 233472 // 2 - 1024 < expected_smem('fp8xfp4', 64, 3)
        assert c['smem_bytes'] == expected_smem('fp8xfp4', 64, 2)
        assert not solo['cta_pair'] and solo['num_sms'] == H200_SMS and solo['num_threads'] == 384
        for key in ('block_m', 'block_n_l2', 'signals_thread', 'num_experts_per_wave'):
            assert c[key] == solo[key], key
        assert c['num_prefetch_stages'] == min(solo['num_prefetch_stages'], 2)


def test_cta_pair_other_formats_and_forcing():
    v4 = dict(num_ranks=1, num_experts=256, num_topk=6, hidden=4096, intermediate_hidden=2048)
    for fmt in ('fp8xfp8', 'bf16xbf16'):   # no such kernel: never, even forced
        for n in (8, 32):
            assert not config(fmt, num_tokens=n, **v4)['cta_pair']
            assert not _C.get_mega_moe_config(MMA_TYPES[fmt], 1, 256, 6, 4096, 2048, n, H200_SMS, H200_SMEM, cta_pair=1)['cta_pair']
    fp4 = MMA_TYPES['fp8xfp4']
    assert _C.get_mega_moe_config(fp4, 1, 256, 6, 4096, 2048, 1, H200_SMS, H200_SMEM, cta_pair=1)['cta_pair']
    assert not _C.get_mega_moe_config(fp4, 1, 256, 6, 4096, 2048, 8, H200_SMS, H200_SMEM, cta_pair=0)['cta_pair']
    # forced where the heuristic takes N = 16 tiles but no pair (36 tokens per expert): the pair with
    # them (token passes of 32, narrow or N = 16 / 32 tiles), all else the forced pair's
    wide = _C.get_mega_moe_config(fp4, 1, 256, 6, 4096, 2048, 1536, H200_SMS, H200_SMEM, cta_pair=-1)
    forced = _C.get_mega_moe_config(fp4, 1, 256, 6, 4096, 2048, 1536, H200_SMS, H200_SMEM, cta_pair=1)
    assert wide['wide_n_min'] == 16 and not wide['cta_pair']
    assert forced['cta_pair'] and forced['wide_n_min'] == 16 and forced['num_stages'] == 2 and forced['num_threads'] == 256
    assert forced['block_n_l2'] == wide['block_n_l2'] and forced['signals_thread'] == wide['signals_thread']
    # prefill tiles (BLOCK_M 128): no pair
    assert not _C.get_mega_moe_config(fp4, 1, 256, 6, 4096, 2048, 1 << 16, H200_SMS, H200_SMEM, cta_pair=1)['cta_pair']
    with pytest.raises(ValueError, match='cta_pair'):
        _C.get_mega_moe_config(fp4, 1, 256, 6, 4096, 2048, 8, H200_SMS, H200_SMEM, cta_pair=2)
    # fewer SMs, more tasks per SM: v4-flash at two tokens (384 tasks) pairs on 32 SMs, not on 132;
    # mid at 6 tokens per expert (1792 tasks, N = 16 tiles) on 48 SMs (37 per SM), not on 132 (13.6)
    assert not config('fp8xfp4', num_tokens=2, **v4)['cta_pair']
    assert config('fp8xfp4', num_tokens=2, num_sms=32, **v4)['cta_pair']
    mid = dict(num_ranks=1, num_experts=128, num_topk=8, hidden=2048, intermediate_hidden=768, num_tokens=96)
    assert not config('fp8xfp4', **mid)['cta_pair']
    on_48 = config('fp8xfp4', num_sms=48, **mid)
    assert on_48['cta_pair'] and on_48['wide_n_min'] == 16
    assert not config('fp8xfp4', num_sms=48, hbm_gbps=H100_HBM, **mid)['cta_pair']
    with pytest.raises(ValueError, match='hbm_gbps'):
        config('fp8xfp4', hbm_gbps=-1, **mid)
    # the launcher passes the bandwidth through (-1, its default: the current device's; none here on a
    # CPU-only machine: 0, no pair of N = 16 / 32 tiles)
    v4_512 = (fp4, 1, 256, 6, 4096, 2048, 512, H200_SMS)
    picks = [_C.get_mega_moe_kernel_variant(*v4_512, hbm_gbps=hbm) for hbm in (H200_HBM, H100_HBM)]
    assert [(v['cta_pair'], v['wide_n_min'], v['name'].endswith('_pair_w16')) for v in picks] == [(True, 16, True), (False, 16, False)]

@pytest.mark.parametrize('override, on', _KIND_OVERRIDES)
def test_launched_kernel_is_the_cta_pair(override, on):
    for v in _launched_kernel_kind('DG_MEGA_MOE_CTA_PAIR', override, 'cta_pair', '_pair', on):
        assert v['num_stages'] == 2 if v['cta_pair'] else v['num_stages'] > 2   # half an SM's stages
        assert not v['cta_pair'] or v['wide_n_min'] == 64   # these rows are below 6 tokens per expert


# DG_MEGA_MOE_CTA_PAIR=1 at v4-flash n = 1536 (36 tokens per expert: the heuristic's N = 16 tiles, no
# pair) launches the pair with them, `_pair_w16`; with DG_MEGA_MOE_WIDE_N=64 too, the pair of narrow
# token passes; DG_MEGA_MOE_WIDE_N=32 the pair without N = 16 tiles
@pytest.mark.parametrize('wide_env, wide', [(None, 16), ('64', 64), ('32', 32)])
def test_forced_cta_pair_keeps_the_calls_transposed_tiles(wide_env, wide):
    case = [(MMA_TYPES['fp8xfp4'], 1, 256, 6, 4096, 2048, 1536, H200_SMS)]
    extra = {'DG_MEGA_MOE_WIDE_N': wide_env} if wide_env else {}
    (v,) = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_CTA_PAIR', '1', 'get_mega_moe_kernel_variant', json.dumps(case),
                                  extra_env=extra))
    assert v['cta_pair'] and v['wide_n_min'] == wide and v['num_stages'] == 2, v
    assert v['name'].endswith('_pair' if wide == 64 else f'_pair_w{wide}'), v['name']
    source = _C.get_mega_moe_kernel_source(v['mma_type'], v['block_m'], v['num_stages'], True, v['block_n_l2'], v['wide_n_min'],
                                           v['signals_thread'], v['cta_pair'])
    assert '#define DG_MEGA_MOE_CTA_PAIR 1' in source and f', {wide})' in source


def test_cta_pair_variant_arguments():
    for bad in [(MMA_TYPES['fp8xfp8'], 64, 5, True, 128, 64, False, True),    # no FP8 x FP8 pair
                (MMA_TYPES['fp8xfp4'], 128, 4, True, 128, 64, False, True)]:  # prefill tiles
        with pytest.raises(ValueError, match='cta_pair'):
            _C.get_mega_moe_kernel_source(*bad)
    for wide in (16, 32):   # the pair with N = 16 / 32 transposed tiles (token passes of 32)
        source = _C.get_mega_moe_kernel_source(MMA_TYPES['fp8xfp4'], 64, 2, True, 256, wide, False, True)
        assert '#define DG_MEGA_MOE_CTA_PAIR 1' in source and f'256, {wide})' in source
    out = json.loads(_run_script(_CALLS_SCRIPT, 'DG_MEGA_MOE_CTA_PAIR', '2', 'get_mega_moe_kernel_variant', json.dumps([_V4_FP4_N8])))
    assert 'DG_MEGA_MOE_CTA_PAIR' in out[0] and "'2'" in out[0]


def test_weights_first_off_when_asked_and_where_it_cannot_run():
    # The weights-first kernel's choice (no GPU needed): on by default for FP8 x FP8 and BF16 one-rank
    # calls of at most 8 routed pairs, FP8 x FP4 only when asked, never with two ranks or 16 pairs;
    # set_mega_moe_weights_first overrides the environment (restored after)
    old = _C.set_mega_moe_weights_first(-1)   # the environment's choice, else the default: on (FP8 x FP4: off)
    try:
        if os.environ.get('DG_MEGA_MOE_WEIGHTS_FIRST') is None:
            assert _C.get_mega_moe_kernel_variant(1, 1, 128, 8, 2048, 768, 1, 132)['weights_first']
            assert not _C.get_mega_moe_kernel_variant(0, 1, 128, 8, 2048, 768, 1, 132)['weights_first']
        _C.set_mega_moe_weights_first(0)
        assert not _C.get_mega_moe_kernel_variant(1, 1, 128, 8, 2048, 768, 1, 132)['weights_first']
        _C.set_mega_moe_weights_first(1)
        assert _C.get_mega_moe_kernel_variant(0, 1, 128, 8, 2048, 768, 1, 132)['weights_first']   # FP8 x FP4: when asked
        assert not _C.get_mega_moe_kernel_variant(1, 2, 128, 8, 2048, 768, 1, 132)['weights_first']   # two ranks
        assert not _C.get_mega_moe_kernel_variant(1, 1, 128, 8, 2048, 768, 2, 132)['weights_first']   # 16 pairs
    finally:
        _C.set_mega_moe_weights_first(old)


def test_weights_first_l2_lead_setting():
    # set_mega_moe_ws_l2_lead: -1 follows DG_MEGA_MOE_WS_L2_LEAD (else 0), 0..64 units; returns the previous
    old = _C.set_mega_moe_ws_l2_lead(12)
    try:
        assert _C.get_mega_moe_ws_l2_lead() == 12
        assert _C.set_mega_moe_ws_l2_lead(0) == 12 and _C.get_mega_moe_ws_l2_lead() == 0
        for bad in (-2, 65):
            with pytest.raises(ValueError, match='set_mega_moe_ws_l2_lead: expected -1'):
                _C.set_mega_moe_ws_l2_lead(bad)
    finally:
        _C.set_mega_moe_ws_l2_lead(old)
    # the environment (read once per process: children)
    code = 'from deep_gemm import _C; print(_C.get_mega_moe_ws_l2_lead())'
    for value, expected in (('5', '5'), (None, '0'), ('64', '64')):
        env = {k: v for k, v in os.environ.items() if k != 'DG_MEGA_MOE_WS_L2_LEAD'}
        if value is not None:
            env['DG_MEGA_MOE_WS_L2_LEAD'] = value
        out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == expected
    for bad in ('abc', '-1', '65', '4x'):
        out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                             env=dict(os.environ, DG_MEGA_MOE_WS_L2_LEAD=bad))
        assert out.returncode != 0 and 'DG_MEGA_MOE_WS_L2_LEAD: expected an integer in [0, 64]' in out.stderr, out.stderr[-500:]
