"""The JIT runtime: nvcc compilation and its cache, settings, TMA argument checks, driver errors.

CPU tests compile real sm_90a kernels (nvcc needs no GPU); GPU tests (skipped without a Hopper
GPU) load and launch them through the driver API.
"""
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

import deep_gemm.jit as jit
from deep_gemm import _C

from conftest import REPO_ROOT, cuobjdump_path

# A small but real kernel: it includes the buffer layout header and uses Hopper-only instructions
# (wgmma.fence, setmaxnreg), which ptxas rejects for every target but sm_90a.
SMOKE_KERNEL = textwrap.dedent('''
    #include <cstdint>
    #include <deep_gemm/common/types.cuh>
    #include <deep_gemm/layout/mega_moe.cuh>

    extern "C" __global__ void __launch_bounds__(256, 1) jit_smoke_kernel(int64_t* out) {
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        // Register rebalancing between warpgroups, as the Mega MoE roles do
        if (threadIdx.x < 128)
            asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        else
            asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            out[0] = deep_gemm::layout::kMaxBlockM;
            out[1] = deep_gemm::layout::MegaMoELayout::pool_rows(8, 32, 128, 8);
            out[2] = static_cast<int64_t>(deep_gemm::MmaType::kBF16xBF16);
            out[3] = deep_gemm::align_up<int64_t>(1000, 128);
        }
    }
''')

EM_CUDA = 190  # ELF e_machine of NVIDIA GPU code


def _cubin(kernel_dir: str) -> bytes:
    with open(os.path.join(kernel_dir, 'kernel.cubin'), 'rb') as f:
        return f.read()


def _run_python(code: str, env_updates: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, **env_updates)
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------------------------------
# Compilation and the cache (CPU)
# --------------------------------------------------------------------------------------------------

def test_compile_sm90a_kernel_and_cache_hit(requires_nvcc, jit_cache_dir):
    before = _C.get_num_nvcc_invocations()
    kernel_dir = jit.compile_kernel('jit_smoke', SMOKE_KERNEL)
    assert _C.get_num_nvcc_invocations() == before + 1
    assert os.path.dirname(os.path.dirname(kernel_dir)) == str(jit_cache_dir)
    assert os.path.basename(kernel_dir).startswith('jit_smoke_')

    cubin = _cubin(kernel_dir)
    assert cubin[:4] == b'\x7fELF'
    assert struct.unpack_from('<H', cubin, 18)[0] == EM_CUDA
    # The SM number sits in e_flags (low byte in older ELF ABIs, second byte since CUDA 12.8);
    # the 'a' suffix is proven by compilation itself: wgmma/setmaxnreg exist only on sm_90a
    e_flags = struct.unpack_from('<I', cubin, 48)[0]
    assert 90 in (e_flags & 0xff, (e_flags >> 8) & 0xff), hex(e_flags)
    with open(os.path.join(kernel_dir, 'kernel.cu')) as f:
        assert f.read() == SMOKE_KERNEL

    cuobjdump = cuobjdump_path()
    if cuobjdump is not None:
        out = subprocess.run([cuobjdump, '--dump-sass', os.path.join(kernel_dir, 'kernel.cubin')],
                             capture_output=True, text=True, check=True).stdout
        assert 'sm_90a' in out, out[:2000]
        assert 'jit_smoke_kernel' in out

    # Same source again: no nvcc, same directory
    assert jit.compile_kernel('jit_smoke', SMOKE_KERNEL) == kernel_dir
    assert _C.get_num_nvcc_invocations() == before + 1

    # A disk hit (the in-process table is dropped with the cache-dir setting) is also free
    _C.set_cache_dir(str(jit_cache_dir))
    assert jit.compile_kernel('jit_smoke', SMOKE_KERNEL) == kernel_dir
    assert _C.get_num_nvcc_invocations() == before + 1

    # Any source change is a new kernel
    changed = SMOKE_KERNEL.replace('1000', '1001')
    changed_dir = jit.compile_kernel('jit_smoke', changed)
    assert changed_dir != kernel_dir
    assert _C.get_num_nvcc_invocations() == before + 2
    # ... and so are different flags
    flagged_dir = jit.compile_kernel('jit_smoke', SMOKE_KERNEL, ['-DDG_TEST_FLAG=1'])
    assert flagged_dir not in (kernel_dir, changed_dir)
    assert _C.get_num_nvcc_invocations() == before + 3
    # Nothing is left behind in the temporary area
    assert os.listdir(os.path.join(str(jit_cache_dir), 'tmp')) == []


def test_cache_is_shared_across_processes(requires_nvcc, tmp_path):
    """A second process finds the first one's cubin (DG_JIT_CACHE_DIR honoured by init())."""
    code = '''
        import deep_gemm.jit as jit
        from deep_gemm import _C
        src = open(%r).read()
        print(jit.compile_kernel('jit_smoke', src))
        print(_C.get_num_nvcc_invocations())
        print(_C.get_cache_dir())
    '''
    source_file = tmp_path / 'kernel.cu'
    source_file.write_text(SMOKE_KERNEL)
    env = {'DG_JIT_CACHE_DIR': str(tmp_path / 'cache')}
    first = _run_python(code % str(source_file), env)
    assert first.returncode == 0, first.stderr
    second = _run_python(code % str(source_file), env)
    assert second.returncode == 0, second.stderr
    first_dir, first_count, cache_dir = first.stdout.split()
    second_dir, second_count, _ = second.stdout.split()
    assert cache_dir == str(tmp_path / 'cache')
    assert (first_count, second_count) == ('1', '0')
    assert first_dir == second_dir


def test_header_edit_invalidates_cache(requires_nvcc, tmp_path):
    """Every header under the include dir is part of the key: touching one recompiles."""
    include = tmp_path / 'include'
    shutil.copytree(jit.include_dir(), include)
    source_file = tmp_path / 'kernel.cu'
    source_file.write_text(SMOKE_KERNEL)
    code = f'''
        from deep_gemm import _C
        from deep_gemm.cuda_home import find_cuda_home
        _C.init({str(include)!r}, find_cuda_home() or '', '')
        _C.set_cache_dir({str(tmp_path / 'cache')!r})
        print(_C.compile('jit_smoke', open({str(source_file)!r}).read()))
        print(_C.get_num_nvcc_invocations())
    '''

    def run():
        result = _run_python(code, {})
        assert result.returncode == 0, result.stderr
        path, count = result.stdout.split()
        return path, int(count)

    first_dir, first_count = run()
    assert first_count == 1
    assert run() == (first_dir, 0)
    # A comment in a header the kernel does not even use still changes the key: the digest
    # covers the whole include tree, since includes are not tracked
    with open(include / 'deep_gemm' / 'common' / 'types.cuh', 'a') as f:
        f.write('\n// edited by test_header_edit_invalidates_cache\n')
    edited_dir, edited_count = run()
    assert edited_count == 1
    assert edited_dir != first_dir


def test_compile_error_reports_nvcc_output(requires_nvcc, jit_cache_dir):
    broken = SMOKE_KERNEL + '\nstatic_assert(sizeof(int) == 3, "deep_gemm_test_marker: int is not 3 bytes");\n'
    with pytest.raises(RuntimeError) as info:
        jit.compile_kernel('jit_broken', broken)
    message = str(info.value)
    assert 'nvcc failed to compile kernel `jit_broken`' in message
    assert 'deep_gemm_test_marker' in message  # nvcc's own diagnostic
    assert '-gencode=arch=compute_90a,code=sm_90a' in message  # the command, to reproduce it
    # A failure is not cached
    assert not os.path.isdir(os.path.join(str(jit_cache_dir), 'cache')) or \
        not [d for d in os.listdir(os.path.join(str(jit_cache_dir), 'cache')) if d.startswith('jit_broken')]


def test_debug_and_ptxas_verbose_output(requires_nvcc, jit_cache_dir, monkeypatch, capfd):
    monkeypatch.setenv('DG_JIT_DEBUG', '1')
    monkeypatch.setenv('DG_JIT_PTXAS_VERBOSE', '1')
    kernel_dir = jit.compile_kernel('jit_verbose', SMOKE_KERNEL)
    err = capfd.readouterr().err
    assert 'cache miss' in err and kernel_dir in err
    assert 'nvcc' in err and '-Xptxas -v' in err
    assert 'Used' in err and 'registers' in err  # ptxas's report
    assert 'compiled in' in err

    _C.set_cache_dir(str(jit_cache_dir))  # forget the in-process entry: the next call reads the disk
    assert jit.compile_kernel('jit_verbose', SMOKE_KERNEL) == kernel_dir
    assert 'cache hit' in capfd.readouterr().err


def _fake_elf(section_headers=1) -> bytes:
    """The smallest file the JIT takes for a cubin: a 64-bit ELF header whose section header table
    (`section_headers` entries of 64 bytes, right after it) lies within the file."""
    header = bytearray(64)
    header[:5] = b'\x7fELF\x02'
    struct.pack_into('<Q', header, 0x28, 64)                  # e_shoff
    struct.pack_into('<HH', header, 0x3a, 64, section_headers)   # e_shentsize, e_shnum
    return bytes(header) + bytes(64 * section_headers)


def _fake_nvcc(tmp_path, seconds, cubin=None):
    """A stand-in nvcc (for DG_NVCC) that sleeps `seconds` per compile, writes `cubin` (default a
    minimal valid one, `_fake_elf()`) and exits 0."""
    template = tmp_path / 'fake.cubin'
    template.write_bytes(_fake_elf() if cubin is None else cubin)
    fake_nvcc = tmp_path / 'fake_nvcc'
    fake_nvcc.write_text(textwrap.dedent(f'''\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "fake nvcc 0.1"; exit 0; fi
        prev=""; out=""
        for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
        sleep {seconds}
        cp "{template}" "$out"
    '''))
    fake_nvcc.chmod(0o755)
    return fake_nvcc


def test_concurrent_compiles_publish_once(tmp_path):
    """Threads and processes racing on one kernel all get the same complete directory.

    Uses a stand-in nvcc (DG_NVCC) that sleeps, so the race is wide and no real compiler runs.
    """
    fake_nvcc = _fake_nvcc(tmp_path, 0.5)
    code = '''
        import threading
        import deep_gemm.jit as jit
        results = []
        threads = [threading.Thread(target=lambda: results.append(jit.compile_kernel('race', 'int x;')))
                   for _ in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(' '.join(results))
    '''
    env = {'DG_NVCC': str(fake_nvcc), 'DG_JIT_CACHE_DIR': str(tmp_path / 'cache')}
    procs = [subprocess.Popen([sys.executable, '-c', textwrap.dedent(code)], cwd=REPO_ROOT,
                              env=dict(os.environ, PYTHONPATH=REPO_ROOT, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    dirs = {d for out, _ in outputs for d in out.split()}
    assert len(dirs) == 1
    (kernel_dir,) = dirs
    assert _cubin(kernel_dir) == _fake_elf()
    assert os.listdir(tmp_path / 'cache' / 'cache') == [os.path.basename(kernel_dir)]
    assert os.listdir(tmp_path / 'cache' / 'tmp') == []


def test_start_up_compiles_release_the_gil(tmp_path):
    """`_C.prepare_mega_moe` (prepare_mega_moe_kernels) and `_C.compile_mega_moe_stage` run nvcc without
    holding the GIL: a Python thread keeps running while a stand-in nvcc sleeps 1 s per kernel. (The
    launches release it too; without a driver they stop before compiling, so only a GPU could show it.)"""
    fake_nvcc = _fake_nvcc(tmp_path, 1)
    code = '''
        import threading, time
        import deep_gemm.jit as jit
        from deep_gemm import _C
        jit.init()
        for name, start in (('prepare', lambda: _C.prepare_mega_moe(2, 1, 8, 2, 256, 128, 1, 132, 232448)),
                            ('stage', lambda: _C.compile_mega_moe_stage(True))):
            ticks, done = [0], threading.Event()
            def count():
                while not done.is_set():
                    ticks[0] += 1
                    time.sleep(0.01)
            t = threading.Thread(target=count)
            t.start()
            start()
            done.set()
            t.join()
            print(name, ticks[0])
    '''
    env = {'DG_NVCC': str(fake_nvcc), 'DG_JIT_CACHE_DIR': str(tmp_path / 'cache')}
    out = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO_ROOT, **env), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    ticks = dict(line.split() for line in out.stdout.split('\n') if line)
    # ~100 ticks of 10 ms per 1 s nvcc run; a call holding the GIL leaves the thread at 0-1 (its start)
    assert all(int(ticks[k]) >= 20 for k in ('prepare', 'stage')), ticks


def test_broken_cubins_are_never_published_nor_trusted(tmp_path):
    """nvcc on a full disk can exit 0 leaving an empty or truncated cubin: the compile fails with a
    message saying so and publishes nothing; an entry broken in the cache (truncated later) is
    compiled again instead of being taken as a hit."""
    code = '''
        import os
        import deep_gemm.jit as jit
        try:
            jit.compile_kernel('k', 'int x;')
        except RuntimeError as e:
            print('ERROR', str(e).splitlines()[0])
        print(os.listdir(os.environ['DG_JIT_CACHE_DIR'] + '/cache') if os.path.isdir(os.environ['DG_JIT_CACHE_DIR'] + '/cache') else [])
    '''
    for bad in (b'', _fake_elf()[:100], _fake_elf(0)):
        work = tmp_path / f'bad{len(bad)}'
        work.mkdir()
        result = _run_python(code, {'DG_NVCC': str(_fake_nvcc(work, 0, cubin=bad)), 'DG_JIT_CACHE_DIR': str(work / 'cache')})
        assert result.returncode == 0, result.stderr
        assert 'ERROR deep_gemm: nvcc failed to compile kernel `k` (exit status 0; its cubin is ' in result.stdout, result.stdout
        assert 'is the disk full?' in result.stdout and result.stdout.strip().endswith('[]')
    # A good entry, then truncated in place: the next process compiles it again
    work = tmp_path / 'good'
    work.mkdir()
    env = {'DG_NVCC': str(_fake_nvcc(work, 0)), 'DG_JIT_CACHE_DIR': str(work / 'cache')}
    count = '''
        import deep_gemm.jit as jit
        from deep_gemm import _C
        print(jit.compile_kernel('k', 'int x;'), _C.get_num_nvcc_invocations())
    '''
    kernel_dir, runs = _run_python(count, env).stdout.split()
    assert runs == '1'
    with open(os.path.join(kernel_dir, 'kernel.cubin'), 'r+b') as f:
        f.truncate(80)
    result = _run_python(count, env)
    assert result.stdout.split() == [kernel_dir, '1'], result.stdout + result.stderr
    assert 'is truncated' in result.stderr and 'compiling it again' in result.stderr
    assert _cubin(kernel_dir) == _fake_elf()


def test_nvcc_environment_is_part_of_the_key(tmp_path):
    # NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS / NVCC_CCBIN change what nvcc builds: another cache entry
    code = '''
        import deep_gemm.jit as jit
        print(jit.compile_kernel('k', 'int x;'))
    '''
    env = {'DG_NVCC': str(_fake_nvcc(tmp_path, 0)), 'DG_JIT_CACHE_DIR': str(tmp_path / 'cache')}
    plain = _run_python(code, env).stdout.strip()
    appended = _run_python(code, dict(env, NVCC_APPEND_FLAGS='-DX')).stdout.strip()
    assert plain and appended and plain != appended
    assert _run_python(code, env).stdout.strip() == plain


def test_deleted_cache_is_compiled_again_in_process(jit_cache_dir, tmp_path, monkeypatch):
    # The in-process memo of compiled directories drops an entry whose directory was deleted
    monkeypatch.setenv('DG_NVCC', str(_fake_nvcc(tmp_path, 0)))
    jit.init(force=True)
    try:
        _C.set_cache_dir(str(jit_cache_dir))
        first = jit.compile_kernel('k', 'int x;')
        shutil.rmtree(jit_cache_dir)
        again = jit.compile_kernel('k', 'int x;')
        assert again == first and os.path.exists(os.path.join(again, 'kernel.cubin'))
        assert _cubin(again) == _fake_elf()   # the stand-in compiled it (twice)
    finally:   # the real nvcc again for the tests after this one
        monkeypatch.delenv('DG_NVCC')
        jit.init(force=True)


def test_compiles_survive_a_thread_changing_the_environment(tmp_path):
    """Compiles run without the GIL; a Python thread changing os.environ meanwhile (putenv frees and
    moves the strings nvcc's environment pointed at) once crashed them within a few compiles. nvcc
    now runs with a copy taken with the GIL held. 40 misses (stand-in nvcc) against such a thread."""
    code = '''
        import os, threading
        import deep_gemm.jit as jit
        jit.init()
        stop = False
        def churn():
            i = 0
            while not stop:
                os.environ['DG_TEST_CHURN_%d' % i] = 'v' * (i % 50)
                i += 1
                if i % 500 == 0:
                    for j in range(i - 500, i):
                        del os.environ['DG_TEST_CHURN_%d' % j]
        t = threading.Thread(target=churn)
        t.start()
        try:
            for n in range(40):
                jit.compile_kernel('churn', 'int x%d;' % n)
        finally:
            stop = True
            t.join()
        print('compiled 40')
    '''
    result = _run_python(code, {'DG_NVCC': str(_fake_nvcc(tmp_path, 0)), 'DG_JIT_CACHE_DIR': str(tmp_path / 'cache')})
    assert result.returncode == 0 and 'compiled 40' in result.stdout, result.stdout[-1000:] + result.stderr[-2000:]


def test_stale_temporary_directories_are_removed(tmp_path):
    # A compile that never finished (its process killed) leaves its build directory under tmp/: a
    # process's first cache miss removes those a day old, not younger ones (a compile in progress)
    cache = tmp_path / 'cache'
    old, young = cache / 'tmp' / 'k_old.1.0', cache / 'tmp' / 'k_young.2.0'
    for d in (old, young):
        d.mkdir(parents=True)
        (d / 'kernel.cu').write_text('int x;')
    two_days_ago = os.path.getmtime(young) - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    code = '''
        import deep_gemm.jit as jit
        jit.compile_kernel('k', 'int y;')
    '''
    result = _run_python(code, {'DG_NVCC': str(_fake_nvcc(tmp_path, 0)), 'DG_JIT_CACHE_DIR': str(cache)})
    assert result.returncode == 0, result.stderr
    assert not old.exists() and young.exists()


def test_cache_without_a_home_is_per_user(tmp_path):
    # No HOME (systemd units, some containers): not a directory every user can write cubins into
    env = {k: v for k, v in os.environ.items() if k not in ('HOME', 'DG_JIT_CACHE_DIR')}
    code = 'import deep_gemm.jit as jit; from deep_gemm import _C; jit.init(); print(_C.get_cache_dir())'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=REPO_ROOT,
                         env=dict(env, PYTHONPATH=REPO_ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    assert os.path.basename(out.stdout.strip()) == f'deep_gemm-{os.getuid()}'


def test_bad_nvcc_is_a_clear_error(tmp_path):
    code = '''
        import deep_gemm.jit as jit
        try:
            jit.compile_kernel('k', 'int x;')
        except RuntimeError as e:
            print(e)
    '''
    result = _run_python(code, {'DG_NVCC': str(tmp_path / 'no_such_nvcc'), 'DG_JIT_CACHE_DIR': str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert 'no_such_nvcc' in result.stdout and 'DG_NVCC' in result.stdout


def test_kernel_name_is_validated(jit_cache_dir):
    for name in ['', 'a/b', '../escape', 'x' * 200, 'has space']:
        with pytest.raises(ValueError, match='kernel name'):
            _C.compile(name, 'int x;')


def test_settings_and_flags():
    jit.init()
    jit.init()  # idempotent
    flags = _C.get_compile_flags()
    for flag in ['-std=c++20', '-gencode=arch=compute_90a,code=sm_90a', '-cubin', '-O3',
                 '--expt-relaxed-constexpr', '--expt-extended-lambda', '-lineinfo', '-I' + jit.include_dir()]:
        assert flag in flags
    assert _C.get_compile_flags(['-DX=1'])[-1] == '-DX=1'
    assert os.path.isfile(os.path.join(jit.include_dir(), 'deep_gemm', 'layout', 'mega_moe.cuh'))
    assert jit.__doc__ is not None
    for name in ['DG_JIT_CACHE_DIR', 'DG_JIT_DEBUG', 'DG_JIT_PTXAS_VERBOSE', 'DG_NVCC', 'DG_CUTLASS_INCLUDE']:
        assert name in jit.__doc__
    for name in ['init', 'compile', 'get_cache_dir', 'set_cache_dir', 'get_nvcc_version', 'get_num_nvcc_invocations',
                 'set_num_sms', 'get_num_sms', 'has_cuda_driver', 'get_device_info', 'make_tma_2d', 'launch_kernel',
                 'get_kernel_info', 'get_compile_flags']:
        assert getattr(_C, name).__doc__, name


def test_nvcc_version(requires_nvcc):
    jit.init()
    assert 'Cuda compilation tools' in _C.get_nvcc_version()


def test_cutlass_include_override(monkeypatch, tmp_path):
    monkeypatch.setenv('DG_CUTLASS_INCLUDE', str(tmp_path))
    assert jit.find_cutlass_include() == str(tmp_path)
    monkeypatch.delenv('DG_CUTLASS_INCLUDE')
    found = jit.find_cutlass_include()
    assert found == '' or os.path.isdir(os.path.join(found, 'cutlass'))


# --------------------------------------------------------------------------------------------------
# SM count, TMA checks, and behaviour without a driver (CPU)
# --------------------------------------------------------------------------------------------------

def test_has_cuda_driver_is_a_bool():
    assert isinstance(_C.has_cuda_driver(), bool)


def test_gpu_calls_without_driver_raise_clearly(requires_nvcc, jit_cache_dir):
    if _C.has_cuda_driver():
        pytest.skip('a CUDA driver is present')
    message = 'no CUDA driver (libcuda.so.1) found'
    kernel_dir = jit.compile_kernel('jit_smoke', SMOKE_KERNEL)  # compiling needs no driver
    calls = [
        _C.get_device_info,
        _C.get_num_sms,  # nothing set: needs the device
        lambda: _C.make_tma_2d(1 << 20, 9, 128, 64, 64, 32, 256, 3),  # valid arguments
        lambda: _C.launch_kernel(kernel_dir, '', [1], [256], 0, 0, [0]),
        lambda: _C.get_kernel_info(kernel_dir),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=message.replace('(', r'\(').replace(')', r'\)')):
            call()


def test_num_sms_setting():
    try:
        limit = _C.get_device_info()['num_sms'] if _C.has_cuda_driver() else 1000
    except RuntimeError:
        limit = 1000
    _C.set_num_sms(min(100, limit))
    try:
        assert _C.get_num_sms() == min(100, limit)
        with pytest.raises(ValueError, match='num_sms'):
            _C.set_num_sms(-1)
        if _C.has_cuda_driver() and limit != 1000:
            with pytest.raises(ValueError, match='num_sms'):
                _C.set_num_sms(limit + 1)
    finally:
        _C.set_num_sms(0)


BF16, UINT8, FP32 = 9, 0, 7
SWIZZLE_NONE, SWIZZLE_64B, SWIZZLE_128B = 0, 2, 3


@pytest.mark.parametrize('kwargs, argument', [
    (dict(ptr=8), 'ptr'),
    (dict(ptr=0), 'ptr'),
    (dict(inner_box=0), 'inner_box'),
    (dict(outer_box=257), 'outer_box'),
    (dict(inner_dim=0), 'inner_dim'),
    (dict(outer_dim=(1 << 32) + 1), 'outer_dim'),
    (dict(outer_stride_bytes=264), 'outer_stride_bytes'),            # not a multiple of 16
    (dict(outer_stride_bytes=128), 'outer_stride_bytes'),            # rows overlap (256 B rows)
    (dict(inner_box=4), 'inner_box'),                                 # 8 bytes: not a multiple of 16
    (dict(inner_box=128), 'inner_box'),                               # 256 B > 128 B swizzle span
    (dict(inner_box=64, swizzle=SWIZZLE_64B), 'inner_box'),           # 128 B > 64 B span
    (dict(dtype=13), 'dtype'),                                        # packed 4-bit: SM100 only
    (dict(swizzle=4), 'swizzle'),                                     # 128B_ATOM_32B: SM100 only
])
def test_tma_argument_checks(kwargs, argument):
    args = dict(ptr=1 << 20, dtype=BF16, inner_dim=128, outer_dim=64, inner_box=64, outer_box=32,
                outer_stride_bytes=256, swizzle=SWIZZLE_128B)
    args.update(kwargs)
    with pytest.raises(ValueError, match=argument):
        _C.make_tma_2d(**args)


# --------------------------------------------------------------------------------------------------
# GPU: load, launch, TMA (skipped without a Hopper GPU)
# --------------------------------------------------------------------------------------------------

TMA_KERNEL = textwrap.dedent('''
    #include <cuda.h>
    #include <cuda_bf16.h>
    #include <cstdint>

    // Copy one [32, 64] BF16 box at (x0, y0) through TMA (128B swizzle) and write it out unswizzled
    extern "C" __global__ void __launch_bounds__(128, 1)
    tma_tile_copy(const __grid_constant__ CUtensorMap map, __nv_bfloat16* out, int64_t x0, int64_t y0) {
        constexpr int kRows = 32, kCols = 64, kBytes = kRows * kCols * 2;
        extern __shared__ uint8_t dynamic_smem[];
        __shared__ uint64_t barrier;
        // The 128B swizzle pattern repeats every 1024 bytes: the tile must start on that boundary
        const auto base = static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_smem));
        uint8_t* smem = dynamic_smem + ((1024 - base % 1024) % 1024);
        const auto bar = static_cast<uint32_t>(__cvta_generic_to_shared(&barrier));
        const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
        if (threadIdx.x == 0) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(kBytes) : "memory");
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                         :: "r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(static_cast<int>(x0)),
                            "r"(static_cast<int>(y0)), "r"(bar) : "memory");
        }
        uint32_t done = 0;
        for (int64_t spin = 0; not done; ++spin) {  // bounded: a lost copy traps instead of hanging
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(0u) : "memory");
            if (spin > (int64_t(1) << 26)) __trap();
        }
        for (int i = threadIdx.x; i < kRows * kCols; i += blockDim.x) {
            const int row = i / kCols, byte = (i % kCols) * 2;
            // 128B swizzle: 16-byte chunk c of row r lands in chunk c ^ (r % 8)
            const int offset = row * 128 + (((byte / 16) ^ (row % 8)) * 16) + byte % 16;
            out[i] = *reinterpret_cast<const __nv_bfloat16*>(smem + offset);
        }
    }
''')


def test_gpu_device_info_and_num_sms(requires_sm90):
    import torch
    info = _C.get_device_info()
    assert info['compute_capability'] == (9, 0)
    assert info['num_sms'] == torch.cuda.get_device_properties(0).multi_processor_count
    assert info['max_smem_per_block_optin'] >= 227 * 1024
    assert info['driver_version'] >= 12000
    assert _C.get_num_sms() == info['num_sms']
    with pytest.raises(ValueError, match='num_sms'):
        _C.set_num_sms(info['num_sms'] + 1)
    _C.set_num_sms(info['num_sms'] // 2)
    try:
        assert _C.get_num_sms() == info['num_sms'] // 2
    finally:
        _C.set_num_sms(0)


def test_gpu_launch_smoke_kernel(requires_nvcc, requires_sm90, jit_cache_dir):
    import torch
    kernel_dir = jit.compile_kernel('jit_smoke', SMOKE_KERNEL)
    out = torch.zeros(4, dtype=torch.int64, device='cuda')
    stream = torch.cuda.current_stream().cuda_stream
    # By name, and as the cubin's only kernel; cooperative launch accepted
    _C.launch_kernel(kernel_dir, 'jit_smoke_kernel', [1], [256], 0, stream, [out.data_ptr()])
    _C.launch_kernel(kernel_dir, '', [2], [256], 0, stream, [out.data_ptr()], cooperative=True)
    torch.cuda.synchronize()
    assert out.tolist() == [128, 12288, 2, 1024]
    info = _C.get_kernel_info(kernel_dir)
    assert info['symbol'] == 'jit_smoke_kernel' and info['local_bytes'] == 0
    with pytest.raises(ValueError, match='block'):
        _C.launch_kernel(kernel_dir, '', [1], [512], 0, stream, [out.data_ptr()])  # over __launch_bounds__
    with pytest.raises(RuntimeError, match='cuModuleGetFunction'):
        _C.launch_kernel(kernel_dir, 'no_such_kernel', [1], [256], 0, stream, [out.data_ptr()])


def test_gpu_tma_2d_copy(requires_nvcc, requires_sm90, jit_cache_dir):
    import torch
    kernel_dir = jit.compile_kernel('jit_tma_copy', TMA_KERNEL)
    rows, cols = 96, 192
    x = torch.randn(rows, cols, device='cuda').to(torch.bfloat16)
    tma = _C.make_tma_2d(x.data_ptr(), BF16, cols, rows, 64, 32, x.stride(0) * 2, SWIZZLE_128B)
    assert len(tma) == 128
    stream = torch.cuda.current_stream().cuda_stream
    # 100 KB of dynamic shared memory exercises the > 48 KB opt-in
    for x0, y0 in [(64, 32), (128, 80)]:  # the second box runs past the last row: zero fill
        out = torch.full((32, 64), float('nan'), dtype=torch.bfloat16, device='cuda')
        _C.launch_kernel(kernel_dir, 'tma_tile_copy', [1], [128], 100 * 1024, stream, [tma, out.data_ptr(), x0, y0])
        torch.cuda.synchronize()
        expected = torch.zeros(32, 64, dtype=torch.bfloat16, device='cuda')
        valid = min(32, rows - y0)
        expected[:valid] = x[y0:y0 + valid, x0:x0 + 64]
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match='smem_bytes'):
        _C.launch_kernel(kernel_dir, 'tma_tile_copy', [1], [128], 256 * 1024, stream, [tma, out.data_ptr(), 0, 0])


def test_gpu_compile_in_threads_and_launch(requires_nvcc, requires_sm90, jit_cache_dir):
    """compile() releases the GIL; kernels load in threads that have no context of their own yet."""
    import torch
    out = torch.zeros(4, dtype=torch.int64, device='cuda')
    torch.cuda.synchronize()
    errors = []

    def worker():
        try:
            kernel_dir = jit.compile_kernel('jit_smoke', SMOKE_KERNEL)
            _C.launch_kernel(kernel_dir, '', [1], [256], 0, 0, [out.data_ptr()])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert out.tolist() == [128, 12288, 2, 1024]
