"""The development scripts under scripts/ stay runnable: shell scripts parse, Python scripts
compile, CUDA probes build for sm_90a, and the A/B timer's command line works without a GPU."""
import csv
import glob
import io
import os
import py_compile
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(SCRIPTS, '*.sh'))), ids=os.path.basename)
def test_shell_script_parses(path):
    result = subprocess.run(['bash', '-n', path], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(SCRIPTS, '*.py'))), ids=os.path.basename)
def test_python_script_compiles(path, tmp_path):
    py_compile.compile(path, cfile=str(tmp_path / 'out.pyc'), doraise=True)


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(SCRIPTS, '*.cu'))), ids=os.path.basename)
def test_cuda_probe_compiles_for_sm90a(path, tmp_path, requires_nvcc):
    """The standalone probes (the stream probes, racecheck, code address, the prefill operand probe)
    still compile as docs/PERF.md says (to an object file: a link-time break would not show here), with
    the package's headers and CuTe's on the include path (the operand probe's wgmma atoms)."""
    from deep_gemm import jit
    cutlass = jit.find_cutlass_include()
    includes = ['-I', jit.include_dir()] + (['-I', cutlass] if cutlass else [])
    result = subprocess.run([requires_nvcc, '-O2', '-std=c++17', '-gencode=arch=compute_90a,code=sm_90a', *includes, '-c', path, '-o',
                             str(tmp_path / 'probe.o')], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr


def test_time_fused_help_runs_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'time_fused.py'), '--help'],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert 'case' in result.stdout and '--reps' in result.stdout


def test_time_fused_rejects_a_malformed_case():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    for args in (['fp8xfp8', '2048', '768'], ['fp16', '2048', '768', '128', '8', '1']):
        result = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'time_fused.py'), *args],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 2, result.stderr
        assert 'groups of 6' in result.stderr or 'expected fp8xfp8' in result.stderr, result.stderr


def test_prebuild_lists_the_ep_kernels():
    """`prebuild_kernels.py --ep 2` names what scripts/device_ep.sh runs: both BLOCK_M of every format,
    fast math (the API default), the L2 task widths the launcher picks, with the first case that needs each."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    run = lambda *args: subprocess.run([sys.executable, os.path.join(SCRIPTS, 'prebuild_kernels.py'), '--list', *args],
                                       capture_output=True, text=True, env=env, timeout=120)
    result = run('--ep', '2', 'fp8xfp8', 'fp8xfp4', 'bf16xbf16')
    assert result.returncode == 0, result.stderr
    keys = [eval(line) for line in result.stdout.splitlines() if line.startswith('(')]
    assert sorted({(k[0], k[1]) for k in keys}) == [(f, m) for f in (0, 1, 2) for m in (64, 128)]
    # L2 widths: 128, 256 at BLOCK_M 64 and for FP8 x FP8 / BF16 (mma types 1, 2) at 128, 512 at BLOCK_M 64 for
    # FP8 / BF16 (mma types 1, 2)
    assert all(k[3] is True for k in keys)
    assert all(k[4] == 128 or (k[4], k[1]) == (256, 64) or (k[4], k[1], k[0] != 0) == (256, 128, True) or
               (k[4], k[1], k[0] != 0) == (512, 64, True) for k in keys)
    assert 'first needed by fp8xfp8 check small n=0' in result.stdout
    full = run('fp8xfp8', 'fp8xfp4', 'bf16xbf16')
    # fast and exact, 256-wide L2 at BLOCK_M 64 (FP8 and BF16 also 512-wide: 4) and FP8 x FP8 / BF16
    # prefill's (4), FP8 x FP4 decode with
    # and without the N = 16 / 32 tiles, each of those 8 with and without the signals thread, and its
    # 512-wide kernel of the one-wave rows (N = 64, no signals thread: 2); and the CTA pair (FP8 x FP4
    # decode, 2 stages): N = 64 and N = 16 kernels, 128- and 256-wide L2, with and without the signals
    # thread (16)
    assert full.returncode == 0 and len(full.stdout.splitlines()) == 40 + 16
    pair = [eval(line) for line in full.stdout.splitlines() if line.startswith('(') and eval(line)[7]]
    assert sorted((k[3], k[4], k[5], k[6]) for k in pair) == sorted((f, w, n, s) for f in (False, True) for w in (128, 256)
                                                                     for n in (16, 64) for s in (False, True))
    assert all(k[:2] == (0, 64) and k[2] == 2 for k in pair)
    assert all(k[5] == 64 or (k[0], k[1], k[5]) == (0, 64, 16) for k in keys)
    assert run('--ep', '1').returncode == 2 and run('fp16').returncode == 2


def _load_trace_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location('dg_trace_script', os.path.join(SCRIPTS, 'trace.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_ws_stage_log(capsys):
    """scripts/trace.py --tasks on a weights-first call reads the stage log as its `_tasklog` kernel writes
    it (kWsStageLog: the first 16 units of each CTA's first L1 chunk at kTraceKbIssue / kTraceKbReady,
    of its first L2 chunk at kTraceKbLastFree / LastIssue / LastReady / LastRelease) and reports the
    first, median and last CTA and the spread of issue -> ready and of the math's pace."""
    import torch
    from deep_gemm import _C
    trace = _load_trace_script()
    kb = _C.kTraceKbSlots
    assert kb == 16 and _C.kTraceKbLastRelease + kb <= _C.kTraceSlots
    t = torch.zeros(4, _C.kTraceSlots, dtype=torch.int64)
    t[:, 0] = 10_000
    for c in range(4):
        for u in range(kb):   # L1: issued every 1 us from 13 us (+0.5 a CTA), ready 2 us after its issue
            t[c, _C.kTraceKbIssue + u] = 13_000 + 500 * c + 1_000 * u
            t[c, _C.kTraceKbReady + u] = 15_000 + 500 * c + 1_000 * u
        if c < 3:   # L2 (three CTAs): free, issued 0.1 later, ready 3 us after issue, released 0.25 later, every 1.5 us
            for u in range(kb):
                base = 40_000 + 1_000 * c + 1_500 * u
                t[c, _C.kTraceKbLastFree + u], t[c, _C.kTraceKbLastIssue + u] = base, base + 100
                t[c, _C.kTraceKbLastReady + u], t[c, _C.kTraceKbLastRelease + u] = base + 3_100, base + 3_350
    trace.print_ws_stage_log(t, 10_000)
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.strip()]
    assert sum('L1 chunk' in l for l in lines) == 3 * 2 and sum('L2 chunk' in l for l in lines) == 3 * 4
    assert 'L1 chunk, CTA   0 ( first)      ready:   5.00   6.00' in out
    assert 'L2 chunk, CTA   2 (  last)   released:  35.35' in out
    stats = {l.split(':')[0].strip(): l for l in lines if 'median' in l}
    assert 'n    64' in stats['L1 issue -> ready'] and 'median    2.00' in stats['L1 issue -> ready']
    assert 'n    48' in stats['L2 issue -> ready'] and 'median    3.00' in stats['L2 issue -> ready']
    assert 'median    1.50' in stats['L2 ready -> next ready'] and 'median    1.00' in stats['L1 ready -> next ready']


def test_trace_task_log_summary(capsys):
    """scripts/trace.py --tasks reads the task log as the kernel writes it (kTraceTaskBase, one slot a
    TraceTaskStamp: the math's id word, got, first L1 stage, K-loop end, epilogue end; the producer's
    ticket, first claim, first A, decoded, first stage free; kinds TraceTaskKind) and reports each
    step, the gaps between a CTA's tasks and the CTAs that end last."""
    import torch
    from deep_gemm import _C
    trace = _load_trace_script()
    S = _C.kTraceTaskStamp
    assert sorted(S.values()) == list(range(_C.kTraceTaskStamps)) and len(S) == 10
    assert _C.kTraceSlots >= _C.kTraceTaskBase + _C.kTraceTasks * _C.kTraceTaskStamps
    kinds = {name: k for k, name in _C.kTraceTaskKinds.items()}
    assert sorted(kinds) == ['L1', 'L2', 'combine']
    t = torch.zeros(3, _C.kTraceSlots, dtype=torch.int64)
    t[:, 0] = 10_000
    for c in range(3):
        now = 12_000
        for i, kind in enumerate(('L1', 'L1', 'L2', 'combine')):
            e = _C.kTraceTaskBase + i * _C.kTraceTaskStamps
            t[c, e + S['id']] = (1 << 40) | (kinds[kind] << 32) | (100 * c + i)
            t[c, e + S['got']] = now
            t[c, e + S['first_stage']] = now + 700 if kind == 'L1' else 0
            t[c, e + S['loop_end']] = now + 3_000 if kind != 'combine' else 0
            t[c, e + S['end']] = now + 3_500
            if kind != 'combine':   # the producer: ticket 1.2 us before the math got it, first claim 0.3 later, first A 0.4 later
                t[c, e + S['ticket']], t[c, e + S['claimed']], t[c, e + S['first_a']] = now - 1_200, now - 900, now - 500
                t[c, e + S['decoded']], t[c, e + S['stage_free']] = now - 1_100, now - 950
            now += 4_000 + 1_000 * c   # gaps of 0.5 / 1.5 / 2.5 us
    trace.print_task_log(t, 10_000)
    out = capsys.readouterr().out
    assert 'task log (12 tasks' in out
    lines = {l.split(':')[0].strip(): l for l in out.splitlines() if ':' in l}
    key = lambda kind, name: f'{kind:>8} {name:>24}'.strip()
    assert 'median    0.70' in lines[key('L1', 'got -> 1st stage')]
    assert 'n     6' in lines[key('L1', 'task')] and 'median    3.50' in lines[key('L1', 'task')]
    assert 'n     3' in lines[key('combine', 'task')] and key('combine', 'got -> loop end') not in lines
    assert 'median    0.30' in lines[key('L1', 'P ticket -> claim')] and 'median    0.40' in lines[key('L1', 'P claim -> A')]
    assert 'median    1.20' in lines[key('L1', 'P A -> 1st stage')] and key('L2', 'P A -> 1st stage') not in lines
    assert 'median    0.10' in lines[key('L2', 'P ticket -> decoded')] and 'median    0.15' in lines[key('L2', 'P decoded -> free')]
    assert 'median    0.05' in lines[key('L1', 'P free -> claimed')]
    # the second L1 task's ticket (now - 1.2 us) against the first's loop end (its start + 3 us)
    assert 'n     3' in lines[key('L1', 'P ticket - prev loop end')]
    assert 'min   -0.20' in lines[key('L1', 'P ticket - prev loop end')] and 'max    1.80' in lines[key('L1', 'P ticket - prev loop end')]
    assert 'min    0.50' in lines['gap            L1 -> L1'] and 'max    2.50' in lines['gap            L1 -> L1']
    assert 'CTA 2 (ends 23.5)' in out and 'L2[202:1r] 14.0-17.5' in out
    # per CTA: first task at 2 us; L1 first stages 2 x 0.7; K-loops 2 x 3 - 1.4 + 3; epilogues 3 x 0.5;
    # one combine task of 3.5; gaps 3 x (0.5, 1.5, 2.5); after the last task 23.5 - (17.5, 20.5, 23.5)
    assert ('per CTA (3 CTAs with every task logged; medians, us): before its first task 2.0, L1 first-stage '
            'waits 1.4, K-loops 7.6, epilogues 1.5, combine tasks 3.5, between tasks 4.5, after its last task 3.0') in out


def _fake_ncu_report(path, base=0x7f0000001000):
    """A device_ncu.sh report in miniature: a header, then the source page's CSV after '=== source'.
    Instructions 2-5 form a K-loop (a QGMMA, a backward branch to instruction 2), instruction 7 a
    task loop around it; samples: the wait branch 30 (long_sb), the QGMMA 10 (wait), the rest 1-2."""
    sass = ['LDC R1, c[0x0][0x28]', 'MOV R2, RZ', 'SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3], R4',
            f'@!P0 BRA {base + 0x20:#x}', 'QGMMA.64x8x32.F32.E4M3.E4M3 R24, R32, gdesc[UR16], RZ',
            f'@P1 BRA {base + 0x20:#x}', 'IADD3 R2, R2, 0x1, RZ', f'@P2 BRA {base + 0x10:#x}', 'EXIT']
    samples = [(1, 'selected'), (1, 'selected'), (2, 'wait'), (30, 'long_sb'), (10, 'wait'), (1, 'branch_resolving'),
               (1, 'selected'), (1, 'branch_resolving'), (0, 'selected')]
    reasons = ['long_sb', 'wait', 'selected', 'branch_resolving']
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(['Address', 'Source', 'Instructions Executed'] + [f'stall_{r}' for r in reasons] + [f'stall_{r} (Not Issued)' for r in reasons])
    for i, (s, (n, reason)) in enumerate(zip(sass, samples)):
        w.writerow([f'{base + 0x10 * i:#x}', s, 1] + [n if r == reason else 0 for r in reasons] + [0] * len(reasons))
    path.write_text('==PROF== a kernel\n  Duration us 1.0\n=== source\n' + out.getvalue())


def test_ncu_regions_finds_the_k_loop_and_its_stalls(tmp_path):
    report = tmp_path / 'case.txt'
    _fake_ncu_report(report)
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'ncu_regions.py'), '--top', '2', str(report), '0x60-0x70'],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert '9 instructions, 47 samples' in lines[0]
    loops = lines[lines.index('GMMA loops:') + 1:]
    # the innermost GMMA loop only (offsets 0x20-0x50: 43 of 47 samples), not the task loop around it
    assert loops[0].startswith('0x00020-0x00050: 4 instructions, 43 samples (91.5 % of the kernel)'), loops[0]
    assert 'long_sb 69.8 %' in loops[1] and 'wait 27.9 %' in loops[1]
    assert 'TRYWAIT' not in loops[2] and '0x00030  69.8 %  long_sb' in loops[2] and 'BRA' in loops[2]
    assert not any(line.startswith('0x00010-') for line in loops)
    # the range asked for: offsets 0x60 and 0x70
    assert any(line.startswith('0x00060-0x00070: 2 instructions, 2 samples') for line in loops)


def test_ncu_regions_rejects_a_file_without_a_source_page(tmp_path):
    report = tmp_path / 'log.txt'
    report.write_text('ncu exit 1\n')
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'ncu_regions.py'), str(report)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and 'no "=== source" section' in result.stderr


def test_pair_wide_device_script_kernels_are_prebuilt():
    """scripts/device_pair_wide.sh times each of its cases with DG_MEGA_MOE_CTA_PAIR=0 and =1: both
    kernels of every case (fast math, the heuristic's other choices) are in the prebuild list, so the
    device call compiles nothing; with =1 every case is the pair with its N = 16 tiles (6 or more tokens
    per expert), with =0 the two-warpgroup kernel."""
    from deep_gemm import _C
    script = open(os.path.join(SCRIPTS, 'device_pair_wide.sh')).read()
    cases = script.split('CASES="', 1)[1].split('"', 1)[0].split()
    assert len(cases) % 6 == 0 and len(cases) >= 6 * 10
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    listing = subprocess.run([sys.executable, os.path.join(SCRIPTS, 'prebuild_kernels.py'), '--list', 'fp8xfp4', 'fp8xfp8', 'bf16xbf16'],
                             capture_output=True, text=True, env=env, timeout=120)
    prebuilt = {eval(line) for line in listing.stdout.splitlines() if line.startswith('(')}
    for c in range(0, len(cases), 6):
        fmt, hidden, inter, experts, topk, n = cases[c], *map(int, cases[c + 1:c + 6])
        assert fmt == 'fp8xfp4'
        for pair in (0, 1):
            k = _C.get_mega_moe_config(0, 1, experts, topk, hidden, inter, n, 132, 232448, cta_pair=pair)
            key = (0, k['block_m'], k['num_stages'], True, k['block_n_l2'], k['wide_n_min'], k['signals_thread'], k['cta_pair'])
            assert key in prebuilt, (cases[c:c + 6], pair, key)
            assert k['cta_pair'] == bool(pair) and k['wide_n_min'] == 16, (cases[c:c + 6], pair, k)


def _carry_cache(src, dst, *flags):
    """scripts/carry_cache.py SRC DST for one BF16 prefill case (the same kernel on an H200 and an H100),
    the working tree only (an ab/ left in a developer's checkout would add its variants' kernels)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, 'carry_cache.py'), str(src), str(dst), *flags,
                           '--ab-dir', str(dst) + '.no_ab',
                           '--case', 'bf16xbf16', '2048', '768', '128', '8', '4096'],
                          capture_output=True, text=True, env=env, timeout=900)


def _assert_carried_the_case(src, dst):
    """DST holds exactly the case's kernel (a cubin, also in SRC) and the two staging kernels."""
    names = sorted(os.listdir(dst / 'cache'))
    assert len(names) == 3, names
    assert sum(n.startswith('mega_moe_stage_') for n in names) == 2, names
    kernel = [n for n in names if n.startswith('sm90_mega_moe_bf16xbf16_m128_')]
    assert len(kernel) == 1 and os.path.isfile(dst / 'cache' / kernel[0] / 'kernel.cubin'), names
    assert os.path.isdir(src / 'cache' / kernel[0])


def test_carry_cache_copies_what_a_case_needs(tmp_path, requires_nvcc):
    """scripts/carry_cache.py: from a cache without the case's kernel it stops (prebuild first), then,
    the kernel now in that cache, it copies exactly the case's kernel and the two staging kernels."""
    src, dst = tmp_path / 'src', tmp_path / 'dst'
    first = _carry_cache(src, dst)
    assert first.returncode != 0 and 'prebuild' in first.stderr, first.stderr
    assert not dst.exists()
    second = _carry_cache(src, dst)
    assert second.returncode == 0, second.stderr
    _assert_carried_the_case(src, dst)


def test_carry_cache_compile_copies_a_missing_kernel_in_one_run(tmp_path, requires_nvcc):
    """scripts/carry_cache.py --compile: from an empty cache one run compiles the case's kernel into
    it and copies it (what an A/B of a few cases needs after `ab_prebuild.sh --trees-only`)."""
    src, dst = tmp_path / 'src', tmp_path / 'dst'
    out = _carry_cache(src, dst, '--compile')
    assert out.returncode == 0, out.stderr
    _assert_carried_the_case(src, dst)


def test_every_gpu_test_is_selected_by_its_format():
    # A device call that runs one format's GPU tests selects them with `-k <format>`; a test whose id
    # does not name its format carries it as a marker (tests/conftest.py), else such a call leaves
    # it out without a word (session 41's line `-k fp8xfp4` missed the FP8 x FP4 prefill tests)
    from deep_gemm.testing import MMA_TYPES
    files = sorted(os.path.join('tests', f) for f in os.listdir(os.path.join(ROOT, 'tests')) if f.endswith('_gpu.py'))
    assert len(files) >= 4, files

    def collected(*select):
        out = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider', *files, *select],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]   # 5: nothing selected
        return {line for line in out.stdout.splitlines() if '::' in line}

    every = collected()
    assert len(every) > 100, sorted(every)[:5]
    by_format = {mma_type: collected('-k', mma_type) for mma_type in MMA_TYPES}
    assert set().union(*by_format.values()) == every, sorted(every - set().union(*by_format.values()))
    # the FP8 x FP4 prefill tests among them (their ids name no format)
    assert any('test_fp4_prefill_idle_warpgroup' in t for t in by_format['fp8xfp4'])
    assert any('test_fp4_awkward_weights' in t for t in by_format['fp8xfp4'])


def test_ab_run_passes_a_quoted_k_expression_as_one_argument(tmp_path):
    """scripts/ab_run.sh reads AB_TESTS as shell words: a quoted `-k` expression with spaces reaches
    the test run as one argument (plain word splitting cut it at its spaces, so pytest took `and` and
    the rest as paths). Run in a copy with the device script, the compiler set-up and python3 stubbed."""
    work = tmp_path / 'repo'
    (work / 'scripts').mkdir(parents=True)
    (work / 'bin').mkdir()
    with open(os.path.join(SCRIPTS, 'ab_run.sh')) as f:
        (work / 'scripts' / 'ab_run.sh').write_text(f.read())
    (work / 'scripts' / 'device_run.sh').write_text('for a in "$@"; do echo "$a"; done > "$OUT/args"\n')
    (work / 'scripts' / 'device_compiler.sh').write_text('true\n')
    (work / 'bin' / 'python3').write_text('#!/bin/sh\nexit 0\n')
    (work / 'bin' / 'python3').chmod(0o755)
    out = tmp_path / 'out'
    env = dict(os.environ, OUT=str(out), PATH=f'{work / "bin"}{os.pathsep}{os.environ["PATH"]}',
               AB_TESTS="tests/test_mega_moe_gpu.py -k 'fp8xfp4 and (prefill or big_shape)' -x")
    run = subprocess.run(['bash', 'scripts/ab_run.sh', 'fp8xfp4', '2048', '768', '128', '8', '1'], cwd=work, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert (out / 'args').read_text().splitlines() == ['tests/test_mega_moe_gpu.py', '-k', 'fp8xfp4 and (prefill or big_shape)', '-x']
