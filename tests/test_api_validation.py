"""Host-side validation of the Mega MoE entry points, on CPU: every bad argument is a clear error
naming it, raised before anything is written."""
import gc
import math
import re
import weakref

import pytest
import torch

import deep_gemm
import deep_gemm.mega as mega
from deep_gemm.mega import api as mega_api
from deep_gemm.mega import (SymmBuffer, bf16_mega_moe, fp8_fp4_mega_moe, fp8_mega_moe, get_symm_buffer_for_mega_moe,
                            transform_weights_for_mega_moe)

E, N, K, H, I = 4, 8, 2, 256, 128
ENTRY = {'fp8xfp4': fp8_fp4_mega_moe, 'fp8xfp8': fp8_mega_moe, 'bf16xbf16': bf16_mega_moe}


def make_weights(mma_type):
    if mma_type == 'bf16xbf16':
        l1, l2 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
    elif mma_type == 'fp8xfp8':
        l1 = (torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn), torch.ones(E, 2 * I // 128, H // 128))
        l2 = (torch.zeros(E, H, I, dtype=torch.float8_e4m3fn), torch.ones(E, H // 128, I // 128))
    else:
        l1 = (torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8))
        l2 = (torch.zeros(E, H, I // 2, dtype=torch.uint8), torch.full((E, H, I // 32), 127, dtype=torch.uint8))
    return transform_weights_for_mega_moe(l1, l2)


class Case:
    def __init__(self, mma_type='fp8xfp4', n=N):
        self.mma_type = mma_type
        self.fn = ENTRY[mma_type]
        self.buf = get_symm_buffer_for_mega_moe(None, E, N, K, H, I, mma_type=mma_type, device='cpu')
        self.buf.topk_idx[:n] = torch.randint(0, E, (n, K))
        self.buf.topk_weights[:n] = 0.5
        self.l1, self.l2 = make_weights(mma_type)
        self.y = torch.full((n, H), 7.0, dtype=torch.bfloat16)
        self.snapshot = self.buf.buffer.clone()
        self.y_snapshot = self.y.clone()

    def kwargs(self, **overrides):
        args = dict(y=self.y, l1_weights=self.l1, l2_weights=self.l2, sym_buffer=self.buf,
                    cumulative_local_expert_recv_stats=None, activation='swiglu', activation_clamp=None,
                    fast_math=True)
        args.update(overrides)
        return args

    def reject(self, error, match, **overrides):
        with pytest.raises(error, match=match):
            self.fn(**self.kwargs(**overrides))
        assert torch.equal(self.buf.buffer, self.snapshot), 'a rejected call wrote into the buffer'
        assert torch.equal(self.y, self.y_snapshot), 'a rejected call wrote into y'


@pytest.fixture(params=list(ENTRY))
def case(request):
    return Case(request.param)


def test_valid_call_on_cpu_reaches_the_gpu_check(case):
    # Everything valid: the only complaint left is the missing GPU, still before anything is written
    case.reject(RuntimeError, 'SM90')
    case.reject(RuntimeError, 'Hopper', cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int32),
                activation_clamp=10.0, fast_math=False)


def test_n_zero_is_valid(case):
    case.reject(RuntimeError, 'SM90', y=torch.empty(0, H, dtype=torch.bfloat16))


# y --------------------------------------------------------------------------------------------------

def test_y_wrong_dtype(case):
    case.reject(TypeError, r'y must be torch\.bfloat16', y=torch.zeros(N, H))


def test_y_wrong_shape(case):
    case.reject(ValueError, r'y must have shape \[n, hidden = 256\]', y=torch.zeros(N, H + 128, dtype=torch.bfloat16))
    case.reject(ValueError, 'y must have shape', y=torch.zeros(N * H, dtype=torch.bfloat16))


def test_y_too_many_tokens(case):
    case.reject(ValueError, 'num_max_tokens_per_rank = 8', y=torch.zeros(N + 1, H, dtype=torch.bfloat16))


def test_y_not_contiguous(case):
    case.reject(ValueError, 'y must be contiguous', y=torch.zeros(H, N, dtype=torch.bfloat16).t())


def test_y_misaligned(case):
    # the combine writes y's rows 16 bytes at a time: a view at an odd offset is refused on the host
    y = torch.full((N * H + 1,), 7.0, dtype=torch.bfloat16)[1:].view(N, H)
    case.reject(ValueError, r'y must start at a 16-byte aligned address, got data_ptr\(\) % 16 = 2', y=y)


def test_y_wrong_device(case):
    case.reject(ValueError, "y must be on cpu", y=torch.zeros(N, H, dtype=torch.bfloat16, device='meta'))


def test_y_not_a_tensor(case):
    case.reject(TypeError, 'y must be a torch.Tensor', y=[[0.0] * H])


# sym_buffer ---------------------------------------------------------------------------------------

def test_wrong_buffer_type(case):
    case.reject(TypeError, 'sym_buffer must be a SymmBuffer', sym_buffer=case.buf.buffer)


def test_buffer_of_another_format():
    case = Case('fp8xfp8')
    other = get_symm_buffer_for_mega_moe(None, E, N, K, H, I, mma_type='bf16xbf16', device='cpu')
    case.reject(ValueError, "mma_type = 'bf16xbf16'.*fp8_mega_moe expects mma_type = 'fp8xfp8'", sym_buffer=other)


def test_buffer_takes_deep_gemms_keywords():
    # use_fp8_dispatch (when given, it must agree with mma_type) and activation ("swiglu" only)
    for mma_type, fp8 in (('fp8xfp4', True), ('fp8xfp8', True), ('bf16xbf16', False)):
        buf = get_symm_buffer_for_mega_moe(None, E, N, K, H, I, mma_type=mma_type, use_fp8_dispatch=fp8,
                                           activation='swiglu', device='cpu')
        assert buf.mma_type == mma_type
        with pytest.raises(ValueError, match=f'use_fp8_dispatch = {not fp8} disagrees with mma_type'):
            get_symm_buffer_for_mega_moe(None, E, N, K, H, I, mma_type=mma_type, use_fp8_dispatch=not fp8, device='cpu')
    with pytest.raises(ValueError, match="activation = 'gelu' is not supported"):
        get_symm_buffer_for_mega_moe(None, E, N, K, H, I, activation='gelu', device='cpu')


def test_hidden_not_multiple_of_128_at_buffer_creation():
    with pytest.raises(ValueError, match='hidden = 200'):
        get_symm_buffer_for_mega_moe(None, E, N, K, 200, I, device='cpu')
    with pytest.raises(ValueError, match='intermediate_hidden = 100'):
        get_symm_buffer_for_mega_moe(None, E, N, K, H, 100, device='cpu')


# weights ------------------------------------------------------------------------------------------

def test_weights_wrong_structure(case):
    if case.mma_type == 'bf16xbf16':
        case.reject(TypeError, 'l1_weights must be a tensor', l1_weights=(case.l1,))
    else:
        case.reject(TypeError, r'l1_weights must be a \d-tuple', l1_weights=case.l1[0])
        case.reject(TypeError, r'l2_weights must be a \d-tuple', l2_weights=tuple(case.l2[:-1]))


def test_untransformed_fp4_weights_rejected():
    case = Case('fp8xfp4')
    raw = (case.l1[0], case.l1[1])
    case.reject(TypeError, 'transform_weights_for_mega_moe', l1_weights=raw)


def test_fp4_row_major_delta_rejected():
    # The kernel takes deltas as one 512-byte block per 128x128 weight block, not row-major [E, N, K/32]
    from deep_gemm.mega.transform import _deltas_from_kernel_blocks
    case = Case('fp8xfp4')
    row_major = _deltas_from_kernel_blocks(case.l1[1])
    case.reject(ValueError, r'l1_weights delta must have shape \[4, 2, 2, 512\], got \[4, 256, 8\]',
                l1_weights=(case.l1[0], row_major, case.l1[2]))


def test_fp4_misaligned_delta_rejected():
    # Deltas arrive by bulk copies (16-byte aligned addresses): a view at an odd offset is refused on
    # the host instead of faulting on the device
    case = Case('fp8xfp4')
    delta = case.l1[1]
    storage = torch.empty(delta.numel() + 16, dtype=torch.uint8, device=delta.device)
    shifted = storage[8:8 + delta.numel()].view(delta.shape)
    shifted.copy_(delta)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 8
    case.reject(ValueError, r'l1_weights delta must start at a 16-byte aligned address, got data_ptr\(\) % 16 = 8',
                l1_weights=(case.l1[0], shifted, case.l1[2]))


def test_weights_wrong_dtype(case):
    if case.mma_type == 'bf16xbf16':
        case.reject(TypeError, r'l1_weights must be torch\.bfloat16', l1_weights=case.l1.float())
    elif case.mma_type == 'fp8xfp8':
        case.reject(TypeError, r'l1_weights weights must be torch\.float8_e4m3fn',
                    l1_weights=(case.l1[0].view(torch.uint8), case.l1[1]))
        case.reject(TypeError, r'l2_weights scales must be torch\.float32', l2_weights=(case.l2[0], case.l2[1].double()))
    else:
        case.reject(TypeError, r'l2_weights block_scale must be torch\.float32',
                    l2_weights=(case.l2[0], case.l2[1], case.l2[2].half()))
        case.reject(TypeError, r'l1_weights delta must be torch\.uint8',
                    l1_weights=(case.l1[0], case.l1[1].to(torch.int8), case.l1[2]))


def test_weights_wrong_shape(case):
    def first(w):
        return w if isinstance(w, torch.Tensor) else w[0]

    def replace_first(w, t):
        return t if isinstance(w, torch.Tensor) else (t, *w[1:])

    w1 = first(case.l1)
    # fp8xfp4 weights are [E, N/128, K/128, 8192] blocks, the others [E, N, K]
    expected = r'\[4, 2, ' if case.mma_type == 'fp8xfp4' else r'\[4, 256'
    case.reject(ValueError, r'l1_weights.*must have shape ' + expected, l1_weights=replace_first(case.l1, w1[:-1]))
    w2 = first(case.l2)
    bigger = torch.cat([w2, w2[:1]])
    expected = r'\[4, 2, ' if case.mma_type == 'fp8xfp4' else r'\[4, 256'
    case.reject(ValueError, r'l2_weights.*must have shape ' + expected, l2_weights=replace_first(case.l2, bigger))
    # l1 and l2 swapped
    case.reject((ValueError, TypeError), 'l1_weights', l1_weights=case.l2, l2_weights=case.l1)
    if case.mma_type != 'bf16xbf16':
        sf = case.l1[-1]
        case.reject(ValueError, r'l1_weights (scales|block_scale) must have shape',
                    l1_weights=(*case.l1[:-1], sf[:, :, :-1].contiguous()))


def test_weights_not_contiguous(case):
    w1 = case.l1 if isinstance(case.l1, torch.Tensor) else case.l1[0]
    strided = torch.empty(*w1.shape[:-2], w1.shape[-1], w1.shape[-2], dtype=w1.dtype).transpose(-1, -2)
    weights = strided if isinstance(case.l1, torch.Tensor) else (strided, *case.l1[1:])
    case.reject(ValueError, 'l1_weights.*must be contiguous', l1_weights=weights)


def test_weights_wrong_device(case):
    def to_meta(w):
        return w.to('meta') if isinstance(w, torch.Tensor) else tuple(t.to('meta') for t in w)
    case.reject(ValueError, 'l2_weights.*must be on cpu', l2_weights=to_meta(case.l2))


# the checked-weights memo (api._CheckedWeights): a later call with the same weight tensors skips
# their checks; anything that moves a weight or changes its shape is checked again

def _first(w):
    return w if isinstance(w, torch.Tensor) else w[0]


class _CheckCounter:
    """Counts the full weight checks (api._check_weights) the calls run."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = mega_api._check_weights

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(mega_api, '_check_weights', counted)


def test_weights_checked_once_then_remembered(monkeypatch, case):
    checks = _CheckCounter(monkeypatch)
    case.reject(RuntimeError, 'SM90')
    assert checks.calls == 2                                    # l1 and l2
    case.reject(RuntimeError, 'SM90')
    assert checks.calls == 2, 'the second call checked the same weights again'
    if case.mma_type != 'bf16xbf16':
        # the same tensors in new containers (a list too) are the same weights
        case.reject(RuntimeError, 'SM90', l1_weights=list(case.l1), l2_weights=tuple(case.l2))
        assert checks.calls == 2
        # another tensor in the container is not
        case.reject(RuntimeError, 'SM90', l1_weights=(_first(case.l1).clone(), *case.l1[1:]))
        assert checks.calls == 4
        # nor are the same tensors held another way (one of l1's moved into l2)
        case.reject(TypeError, r'l1_weights must be a \d-tuple', l1_weights=case.l1[:-1], l2_weights=(case.l1[-1], *case.l2))


def test_layers_sharing_a_buffer_are_each_checked_once(monkeypatch, case):
    # A model's layers call one buffer in turn, each with its own weights
    layers = [make_weights(case.mma_type) for _ in range(3)]
    checks = _CheckCounter(monkeypatch)
    for _ in range(3):
        for l1, l2 in layers:
            case.reject(RuntimeError, 'SM90', l1_weights=l1, l2_weights=l2)
    assert checks.calls == 2 * len(layers)
    # a layer's weights freed: its entry goes with them
    assert len(case.buf._checked_weights) == len(layers)
    del layers[1:], l1, l2
    gc.collect()
    assert len(case.buf._checked_weights) == 1


def test_weight_moved_after_a_call_is_checked_again(case):
    case.reject(RuntimeError, 'SM90')
    w = _first(case.l1)
    w.data = torch.zeros(w.shape, dtype=torch.float32)   # the same object, elsewhere, of another dtype
    case.reject(TypeError, r'l1_weights.*must be torch\.(bfloat16|float8_e4m3fn|uint8), got torch\.float32')


def test_weight_relaid_out_at_the_same_address_is_checked_again(case):
    # a transposed view at the same address (same data_ptr, other strides) is not what was checked
    case.reject(RuntimeError, 'SM90')
    w = _first(case.l2)
    w.data = w.data.transpose(-1, -2)
    case.reject(ValueError, r'l2_weights.*must have shape')


def test_weights_in_a_tuple_subclass(monkeypatch, case):
    # a namedtuple of weights is as good as a tuple, and is remembered too
    if case.mma_type == 'bf16xbf16':
        pytest.skip('BF16 weights are one tensor each, not a tuple')
    import collections
    fields = ('a', 'b', 'c')[:len(case.l1)]
    Weights = collections.namedtuple('Weights', fields)
    checks = _CheckCounter(monkeypatch)
    for _ in range(2):
        case.reject(RuntimeError, 'SM90', l1_weights=Weights(*case.l1), l2_weights=Weights(*case.l2))
    assert checks.calls == 2


def test_weight_freed_and_replaced_is_checked_again(case):
    case.reject(RuntimeError, 'SM90')
    assert len(case.buf._checked_weights) == 1
    if case.mma_type == 'bf16xbf16':
        case.l2 = torch.zeros(E, H, I, dtype=torch.float32)   # the old l2 dies here
    else:
        case.l2 = (case.l2[0], torch.zeros(case.l2[1].shape, dtype=torch.float64), *case.l2[2:])
    assert not case.buf._checked_weights, 'the death of a checked weight did not end its entry'
    case.reject(TypeError, r'l2_weights.*must be torch\.(bfloat16|float32|uint8), got torch\.float(32|64)')


def test_checked_weights_keep_no_weights_alive(case):
    case.reject(RuntimeError, 'SM90')
    ref = weakref.ref(_first(case.l1))
    case.l1 = case.l2 = None
    gc.collect()
    assert ref() is None, 'the buffer kept the weights of its last call alive'


def test_checked_addresses_are_the_launchers(case):
    from deep_gemm.mega.transform import kernel_weight_addresses
    for _ in range(2):   # checked, then from the memo
        addresses = mega_api._validate(case.mma_type, case.y, case.l1, case.l2, case.buf, None, 'swiglu', None, True, 'f')
        assert addresses == kernel_weight_addresses(case.mma_type, case.l1, case.l2)
        # each in its place: the weights' own address first, then the scales' and deltas' (or 0)
        if case.mma_type == 'bf16xbf16':
            expected = (case.l1.data_ptr(), 0, 0)
        elif case.mma_type == 'fp8xfp8':
            expected = (case.l1[0].data_ptr(), case.l1[1].data_ptr(), 0)
        else:   # (packed codes, delta, block_scale): the kernel takes (codes, block scales, deltas)
            expected = (case.l1[0].data_ptr(), case.l1[2].data_ptr(), case.l1[1].data_ptr())
        assert addresses[:3] == expected
        assert len(addresses) == 6 and all(isinstance(a, int) for a in addresses) and addresses[0] != 0


# stats, activation, options -----------------------------------------------------------------------

@pytest.mark.parametrize('stats, error, match', [
    (torch.zeros(E + 1, dtype=torch.int32), ValueError, r'shape \[num_local_experts = 4\]'),
    (torch.zeros(E, 1, dtype=torch.int32), ValueError, r'shape \[num_local_experts = 4\]'),
    (torch.zeros(E, dtype=torch.int64), TypeError, r'torch\.int32'),
    (torch.zeros(2 * E, dtype=torch.int32)[::2], ValueError, 'contiguous'),
    (torch.zeros(E, dtype=torch.int32, device='meta'), ValueError, 'must be on cpu'),
    ([0] * E, TypeError, 'torch.Tensor'),
])
def test_stats(stats, error, match):
    case = Case('fp8xfp8')
    case.reject(error, 'cumulative_local_expert_recv_stats.*' + match, cumulative_local_expert_recv_stats=stats)


@pytest.mark.parametrize('activation', ['gelu', 'SwiGLU', None])
def test_bad_activation(activation):
    Case('bf16xbf16').reject(ValueError, 'activation', activation=activation)


@pytest.mark.parametrize('clamp', [0, -1.0, math.inf, math.nan, True, '7', torch.tensor(7.0)])
def test_bad_activation_clamp(clamp):
    Case('fp8xfp4').reject(ValueError, 'activation_clamp', activation_clamp=clamp)


@pytest.mark.parametrize('fast_math', [1, None, 'yes'])
def test_bad_fast_math(fast_math):
    Case('fp8xfp4').reject(TypeError, 'fast_math', fast_math=fast_math)


# DG_CHECK_INPUTS ----------------------------------------------------------------------------------

def test_check_inputs_flags_bad_expert(monkeypatch):
    monkeypatch.setattr(mega_api, '_check_inputs', True)
    case = Case('fp8xfp8')
    case.buf.topk_idx[5, 1] = E
    case.buf.topk_idx[6, 0] = -3
    case.snapshot = case.buf.buffer.clone()
    case.reject(ValueError, r'topk_idx\[5, 1\] = 4 is outside \[-1, num_experts = 4\)')
    # a negative id other than -1 alone (the one above is found first)
    case.buf.topk_idx[5, 1] = 0
    case.snapshot = case.buf.buffer.clone()
    case.reject(ValueError, r'topk_idx\[6, 0\] = -3 is outside \[-1, num_experts = 4\)')


def test_check_inputs_flags_non_finite_weight(monkeypatch):
    monkeypatch.setattr(mega_api, '_check_inputs', True)
    case = Case('fp8xfp8')
    case.buf.topk_weights[3, 0] = math.nan
    case.buf.topk_idx[2, 1] = -1
    case.buf.topk_weights[2, 1] = math.inf     # masked slot: its weight is never read
    case.snapshot = case.buf.buffer.clone()
    case.reject(ValueError, r'topk_weights\[3, 0\] = nan is not finite')


def test_check_inputs_only_reads_the_first_n_tokens(monkeypatch):
    monkeypatch.setattr(mega_api, '_check_inputs', True)
    case = Case('fp8xfp8', n=4)
    case.buf.topk_idx[6, 0] = 1000    # beyond n: not part of this call
    case.snapshot = case.buf.buffer.clone()
    case.reject(RuntimeError, 'SM90')


def test_check_inputs_off_does_not_look(monkeypatch):
    monkeypatch.setattr(mega_api, '_check_inputs', False)
    case = Case('fp8xfp8')
    case.buf.topk_idx[5, 1] = 1000
    case.snapshot = case.buf.buffer.clone()
    case.reject(RuntimeError, 'SM90')


def test_timeout_setting(monkeypatch):
    from deep_gemm.mega import status
    monkeypatch.setattr(status, '_timeout_s', None)
    for value, expected in (('2.5', 2.5), (None, status.DEFAULT_TIMEOUT_S)):
        if value is None:
            monkeypatch.delenv('DG_TIMEOUT_S', raising=False)
        else:
            monkeypatch.setenv('DG_TIMEOUT_S', value)
        monkeypatch.setattr(status, '_env_timeout_s', status._env_timeout())   # as an import reads it
        assert status.get_timeout() == expected
    # inf, NaN and bounds past MAX_TIMEOUT_S (1e6 s) would not fit the kernels' uint64 nanoseconds
    for bad in ('abc', '0', '-1', 'inf', 'nan', '1e7'):
        monkeypatch.setenv('DG_TIMEOUT_S', bad)
        monkeypatch.setattr(status, '_env_timeout_s', status._env_timeout())
        with pytest.raises(ValueError, match=re.escape(f"DG_TIMEOUT_S = '{bad}': expected a number of seconds in (0, 1e+06]")):
            status.get_timeout()
    for bad in (0, -1.0, math.inf, math.nan, 1e7, True, '3'):
        with pytest.raises(ValueError, match=r'seconds: expected a number in \(0, 1e\+06\]'):
            status.set_timeout(bad)
    status.set_timeout(status.MAX_TIMEOUT_S)   # the bound itself is accepted
    assert status.get_timeout() == 1e6
    status.set_timeout(3.0)                  # set_timeout wins over the environment (restored by monkeypatch)
    assert status.get_timeout() == 3.0


def test_public_names():
    for name in mega.__all__:
        obj = getattr(mega, name)
        assert obj is not None
        if callable(obj):
            assert obj.__doc__, name


def test_launcher_bounds_the_combine_index():
    # The launcher's own last checks (the entry points check n against the buffer first): the kernel
    # indexes y's 16-byte chunks, n * hidden / 8 of them, in int32. Raised before any device work.
    from deep_gemm import _C
    n, hidden = 2 ** 28, 128
    args = [1, [1], 0, 8, n, 2, hidden, 128, n] + [0] * 11 + [0.0, True, 1.0, 132, 232448, True]
    with pytest.raises(ValueError, match='num_tokens \\* hidden / 8 < 2\\^31 \\(hidden = 128\\)'):
        _C.launch_mega_moe(*args)
    args[8] = n + 1
    with pytest.raises(ValueError, match='num_tokens: expected 0 <= num_tokens <= num_max_tokens_per_rank'):
        _C.launch_mega_moe(*args)


def _parameter_names(binding) -> list:
    """A pybind11 function's parameter names, in order, from its signature line."""
    return re.findall(r'(?:\(|, )(\w+): ', binding.__doc__.splitlines()[0])


class _LaunchRecorder:
    """Stands in for deep_gemm._C in deep_gemm.mega.launch: records the launches' arguments."""

    def __init__(self):
        from deep_gemm import _C
        self._C = _C
        self.launches, self.stages = [], []

    def __getattr__(self, name):
        return getattr(self._C, name)

    def launch_mega_moe(self, *args):
        self.launches.append(list(args))

    def launch_mega_moe_stage(self, *args):
        self.stages.append(list(args))

    def get_num_sms(self):
        return 132


def _recorded_launches(monkeypatch, recorder=None, device_index=0):
    """A Case('fp8xfp8') whose launches go to `recorder` (a _LaunchRecorder; a new one by default), with
    the constants a GPU would give its buffer (`device_index`'s)."""
    from deep_gemm.mega import launch
    recorder = recorder or _LaunchRecorder()
    monkeypatch.setattr(launch, '_C', recorder)
    monkeypatch.setattr(launch, '_raw_stream', lambda index: 0x5eed)
    case = Case('fp8xfp8')
    case.buf._launch_device_constants = (device_index, 232448, 4917)
    return recorder, case


def test_launcher_passes_each_argument_in_its_place(monkeypatch, case):
    # The Python launcher calls _C positionally (keyword matching costs host time): each value must
    # land on its parameter, and the binding must accept them all
    from deep_gemm import _C
    from deep_gemm.mega import launch
    recorder = _LaunchRecorder()
    monkeypatch.setattr(launch, '_C', recorder)
    monkeypatch.setattr(launch, '_raw_stream', lambda index: 0x5eed)
    case.buf._launch_device_constants = (0, 232448, 4917)   # what a GPU would give
    stats = torch.zeros(E, dtype=torch.int32)
    addresses = mega_api._validate(case.mma_type, case.y, case.l1, case.l2, case.buf, stats, 'swiglu', 2.5, False, 'f')
    launch.launch_mega_moe(case.mma_type, case.y, case.l1, case.l2, case.buf, stats, 2.5, False, addresses)
    launch.launch_mega_moe(case.mma_type, case.y, case.l1, case.l2, case.buf, stats, 2.5, False)   # addresses read there
    names = _parameter_names(_C.launch_mega_moe)
    first, second = recorder.launches
    assert first == second and len(first) == len(names), (len(first), names)
    got = dict(zip(names, first))
    buf = case.buf
    expected = dict(mma_type=mega.MMA_TYPES[case.mma_type], buffers=buf.peer_ptrs, rank=0, num_experts=E,
                    num_max_tokens_per_rank=N, num_topk=K, hidden=H, intermediate_hidden=I, num_tokens=N,
                    y=case.y.data_ptr(), stats=stats.data_ptr(), host_status=0, trace=0, stream=0x5eed,
                    activation_clamp=2.5, fast_math=False, timeout_s=deep_gemm.get_timeout(), num_sms=132,
                    max_smem_bytes=232448, peers_on_this_gpu=True, ranks_share_gpu=False, hbm_gbps=4917)
    for i, side in enumerate(('l1', 'l2')):
        for j, part in enumerate(('weights', 'weight_scales', 'weight_deltas')):
            expected[f'{side}_{part}'] = addresses[3 * i + j]
    assert got == expected
    # The binding takes them: its own last check (n past the buffer's) raises before any device work
    first[names.index('num_tokens')] = N + 1
    with pytest.raises(ValueError, match='num_tokens: expected 0 <= num_tokens'):
        _C.launch_mega_moe(*first)
    # ... and a timeout outside set_timeout's range (NaN, inf, 0), called directly
    first[names.index('num_tokens')] = N
    for bad in (math.nan, math.inf, 0.0):
        first[names.index('timeout_s')] = bad
        with pytest.raises(ValueError, match=r'timeout_s: expected a number of seconds in \(0, 1e6\]'):
            _C.launch_mega_moe(*first)


def test_stage_launcher_passes_each_argument_in_its_place(monkeypatch):
    from deep_gemm import _C
    from deep_gemm.mega import launch
    recorder, case = _recorded_launches(monkeypatch)
    x = torch.randn(5, H + 8).bfloat16()[:, :H]   # strided rows
    idx, w = torch.randint(0, E, (5, K)), torch.rand(5, K)
    assert case.buf._stage_problem(x, idx, w) is None
    launch.launch_stage(case.buf, x, idx, w)
    names = _parameter_names(_C.launch_mega_moe_stage)
    (args,) = recorder.stages
    assert dict(zip(names, args)) == dict(
        mma_type=mega.MMA_TYPES['fp8xfp8'], num_ranks=1, num_experts=E, num_max_tokens_per_rank=N, num_topk=K, hidden=H,
        intermediate_hidden=I, buffer=case.buf.buffer.data_ptr(), x=x.data_ptr(), x_row_stride=H + 8,
        topk_idx=idx.data_ptr(), topk_weights=w.data_ptr(), num_tokens=5, num_sms=132, stream=0x5eed)
    assert len(args) == len(names)


def test_stage_rejects_strided_channels_at_any_n():
    # the staging kernel reads a row's channels as one run: every-other-channel views are refused at
    # one row as at several (at one row the row stride does not matter, the channel stride does)
    case = Case('fp8xfp8')
    for n in (1, 2):
        x = torch.randn(n, 2 * H).bfloat16()[:, ::2]
        idx, w = torch.randint(0, E, (n, K)), torch.rand(n, K)
        assert 'contiguous channels' in case.buf._stage_problem(x, idx, w)
    one_row = torch.randn(3, H + 8).bfloat16()[1:2, :H]   # a row of a wider tensor: fine
    assert case.buf._stage_problem(one_row, torch.randint(0, E, (1, K)), torch.rand(1, K)) is None


def test_stage_binding_checks_its_layout():
    # the private binding builds its buffer layout through the checked constructor: a bad shape is a
    # ValueError before any device work, not a division by zero in the process
    from deep_gemm import _C
    args = dict(mma_type=mega.MMA_TYPES['fp8xfp8'], num_ranks=1, num_experts=E, num_max_tokens_per_rank=N, num_topk=K,
                hidden=H, intermediate_hidden=I, buffer=0, x=0, x_row_stride=H, topk_idx=0, topk_weights=0,
                num_tokens=1, num_sms=132, stream=0)
    for bad, match in ((dict(num_ranks=0), 'num_ranks = 0'), (dict(num_experts=0), 'num_experts = 0'),
                       (dict(hidden=H + 64), 'hidden')):
        with pytest.raises(ValueError, match=match):
            _C.launch_mega_moe_stage(**{**args, **bad})


@pytest.mark.parametrize('which', ['call', 'stage'])
def test_launch_on_another_device_says_so(monkeypatch, which):
    # A buffer on cuda:1 called while cuda:0 is current: the driver refuses the launch (the kernel is
    # loaded into the current context, the stream is the buffer's device's); the error names the fix.
    # The same failure with the right device current passes through unchanged.
    from deep_gemm.mega import launch

    class Failing(_LaunchRecorder):
        def launch_mega_moe(self, *args):
            raise RuntimeError('cuLaunchKernel failed: invalid resource handle')
        launch_mega_moe_stage = launch_mega_moe

    _, case = _recorded_launches(monkeypatch, Failing(), device_index=1)

    def run():
        if which == 'call':
            launch.launch_mega_moe('fp8xfp8', case.y, case.l1, case.l2, case.buf, None, None, True)
        else:
            launch.launch_stage(case.buf, torch.randn(2, H).bfloat16(), torch.randint(0, E, (2, K)), torch.rand(2, K))
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    with pytest.raises(RuntimeError, match=r'the buffer is on cuda:1 but the current CUDA device is cuda:0: call '
                                           r'torch.cuda.set_device\(1\).*invalid resource handle'):
        run()
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 1)
    with pytest.raises(RuntimeError, match=r'^cuLaunchKernel failed: invalid resource handle$'):
        run()


def test_error_of_an_earlier_call_raises_before_the_next_launch(monkeypatch):
    # DESIGN.md §6: an error a finished call recorded is raised at the latest by the next call, before
    # it launches, from the pinned host mirror (no sync). A CPU buffer gets a stand-in mirror (GPU
    # buffers make a pinned one); clear_error() / reset() forget the error and calls launch again.
    from deep_gemm import _C
    from deep_gemm.mega import launch, status
    recorder, case = _recorded_launches(monkeypatch)
    mirror = torch.zeros(_C.kNumStatusWords, dtype=torch.int64)
    case.buf._host_status, case.buf._host_status_words = mirror, mirror.numpy()

    def call():
        launch.launch_mega_moe('fp8xfp8', case.y, case.l1, case.l2, case.buf, None, None, True)
    call()
    assert len(recorder.launches) == 1
    bad_id = status._CODE['bad_expert_id'] | (3 << 40)          # token 3, non-fatal
    timeout = status._CODE['timeout'] | (1 << 16)               # waiting for rank 1, fatal
    for word, fatal, recover, match in ((bad_id, 0, case.buf.clear_error, 'expert id outside .* at token 3.*clear_error'),
                                        (timeout, 1, case.buf.reset, 'timeout .* waiting for rank 1.*reset')):
        mirror[_C.kStatusError], mirror[_C.kStatusAbort] = word, fatal
        launched = len(recorder.launches)
        for _ in range(2):   # raised again until recovered from
            with pytest.raises(status.MegaMoEError, match=match) as e:
                call()
            assert e.value.fatal == bool(fatal) and e.value.word == word
        assert len(recorder.launches) == launched, 'a call launched after an unreported error'
        recover()
        assert int(mirror.abs().sum()) == 0
        call()
    assert len(recorder.launches) == 3


def test_reset_and_clear_error_wait_for_calls_in_flight(monkeypatch):
    # A call still running (a peer's, timing out) would record its error after the reset: both
    # recovery calls synchronize the buffer's device before clearing anything (GPU buffers only)
    from deep_gemm.mega import status as status_mod
    case = Case('fp8xfp8')
    order = []
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: order.append(('sync', device)))
    clear = status_mod.clear
    monkeypatch.setattr(status_mod, 'clear', lambda buf, **kw: (order.append('clear'), clear(buf, **kw)))
    for recover in (case.buf.reset, case.buf.clear_error):
        recover()
    assert order == ['clear', 'clear']                        # a CPU buffer: nothing to wait for
    order.clear()
    monkeypatch.setattr(SymmBuffer, 'device', property(lambda self: torch.device('cuda', 3)))
    monkeypatch.setattr(case.buf, 'workspace', torch.zeros(8))   # zero_() stays on the CPU
    for recover in (case.buf.reset, case.buf.clear_error):
        recover()
    assert order == [('sync', torch.device('cuda', 3)), 'clear'] * 2


class _PrepareRecorder:
    """Stands in for deep_gemm._C in deep_gemm.mega.launch: the variant choice is the real one, the
    compiles are recorded (a CPU test does not run nvcc for every variant)."""

    def __init__(self):
        from deep_gemm import _C
        self._C = _C
        self.prepared, self.stages = [], []

    def __getattr__(self, name):
        return getattr(self._C, name)

    def prepare_mega_moe(self, *args, **kwargs):
        self.prepared.append((args, kwargs))
        return '/nowhere'

    def compile_mega_moe_stage(self, fp8, load=False):
        self.stages.append((fp8, load))
        return '/nowhere'


@pytest.mark.parametrize('mma_type', ['fp8xfp4', 'fp8xfp8', 'bf16xbf16'])
def test_prepare_mega_moe_kernels_every_variant_once(monkeypatch, mma_type):
    # deepseek-v3's shape, n up to 8192 on a CPU buffer: every distinct kernel that n = 0..8192 pick on
    # an H200 or an H100 is compiled once (not loaded: no GPU) with the arguments that pick it, the
    # staging kernel too; the names are the launcher's
    from deep_gemm import _C
    from deep_gemm.mega import launch
    recorder = _PrepareRecorder()
    monkeypatch.setattr(launch, '_C', recorder)
    experts, topk, hidden, inter, most = 256, 8, 7168, 2048, 8192
    buf = get_symm_buffer_for_mega_moe(None, experts, most, topk, hidden, inter, mma_type=mma_type, device='cpu')
    names = mega.prepare_mega_moe_kernels(buf)
    kind = mega.mma_type_to_int(mma_type)
    expected = {_C.get_mega_moe_kernel_variant(kind, 1, experts, topk, hidden, inter, n, 132, 232448, True,
                                               ranks_share_gpu=False, hbm_gbps=gbps)['name']
                for n in range(most + 1) for gbps in (4917, 3352)}
    assert names == sorted(expected) and len(names) >= 3, names
    assert len(recorder.prepared) == len(names)
    picked = set()
    for args, kwargs in recorder.prepared:
        assert args[-1] is False, 'a CPU buffer: compiled, not loaded'
        picked.add(_C.get_mega_moe_kernel_variant(*args[:-1], **kwargs)['name'])
    assert picked == expected
    assert recorder.stages == [(mma_type != 'bf16xbf16', False)]
    # decode and prefill tiles both among them
    assert any('_m64_' in name for name in names) and any('_m128_' in name for name in names), names


def test_prepare_mega_moe_kernels_token_counts(monkeypatch):
    from deep_gemm.mega import launch
    recorder = _PrepareRecorder()
    monkeypatch.setattr(launch, '_C', recorder)
    buf = get_symm_buffer_for_mega_moe(None, 256, 4096, 8, 7168, 2048, mma_type='fp8xfp4', device='cpu')
    one = mega.prepare_mega_moe_kernels(buf, 1)
    assert len(one) in (1, 2) and all('_m64_' in name for name in one), one   # H200 and H100 may differ
    prefill = mega.prepare_mega_moe_kernels(buf, [4096])
    assert prefill == ['sm90_mega_moe_fp8xfp4_m128_n128_s4_fast'], prefill
    exact = mega.prepare_mega_moe_kernels(buf, range(4095, 4097), fast_math=False)
    assert exact and all(name.endswith('_exact') or '_exact_' in name for name in exact), exact
    # virtual ranks: a slice of the SMs each, never the CTA pair
    buf.num_ranks, buf.num_sms = 2, 66
    assert not any('_pair' in name for name in mega.prepare_mega_moe_kernels(buf, range(0, 65)))


@pytest.mark.parametrize('num_tokens, error, match', [
    (-1, ValueError, 'n = -1 is invalid: expected 0 <= n <= num_max_tokens_per_rank = 8'),
    (9, ValueError, 'n = 9 is invalid'),
    ([1, 2, 100], ValueError, 'n = 100 is invalid'),
    ([], ValueError, 'num_tokens is empty'),
    (2.0, TypeError, 'must be None, an int or an iterable of ints'),
    ([1, 2.5], TypeError, '2.5 is not an int'),
    ([True], TypeError, 'True is not an int'),
    ('8', TypeError, "'8' is not an int"),
])
def test_prepare_mega_moe_kernels_bad_token_counts(num_tokens, error, match):
    buf = get_symm_buffer_for_mega_moe(None, E, N, K, H, I, mma_type='fp8xfp8', device='cpu')
    with pytest.raises(error, match=match):
        mega.prepare_mega_moe_kernels(buf, num_tokens)


def test_prepare_mega_moe_kernels_bad_arguments():
    buf = get_symm_buffer_for_mega_moe(None, E, N, K, H, I, mma_type='fp8xfp8', device='cpu')
    with pytest.raises(TypeError, match='sym_buffer must be a SymmBuffer'):
        mega.prepare_mega_moe_kernels(buf.buffer)
    with pytest.raises(TypeError, match='fast_math = 1 must be a bool'):
        mega.prepare_mega_moe_kernels(buf, 1, fast_math=1)


def test_every_public_python_function_has_a_docstring():
    # DESIGN.md §1: everything reachable from Python has a docstring. Every module of the package, its
    # public functions and classes and their public methods (names without a leading underscore)
    import importlib
    import inspect
    import pkgutil

    import deep_gemm
    missing = []
    for info in pkgutil.walk_packages(deep_gemm.__path__, 'deep_gemm.'):
        module = importlib.import_module(info.name)
        assert module.__doc__, info.name
        for name, obj in vars(module).items():
            if name.startswith('_') or getattr(obj, '__module__', None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                if not obj.__doc__:
                    missing.append(f'{module.__name__}.{name}')
                if inspect.isclass(obj):
                    missing += [f'{module.__name__}.{name}.{m}' for m, f in vars(obj).items()
                                if not m.startswith('_') and inspect.isfunction(f) and not f.__doc__]
    assert not missing, missing
