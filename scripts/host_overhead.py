"""Host time of one eager Mega MoE call (DESIGN.md §5: "a few microseconds"), split by layer.

    python scripts/host_overhead.py [--calls C] [fmt hidden inter experts topk n ...]   (default: each format, mid, n = 1)

Per case, after a warm-up call, the median over R rounds of C back-to-back calls (no synchronization
inside a round: the time to enqueue them, divided by C; C stays well below the launch queue's depth,
so the host is not held by the GPU) of:
  entry      `deep_gemm.fp8_mega_moe(...)` etc.: argument checks, status mirror check, launch
  checks     the entry point's argument checks alone (`deep_gemm.mega.api._validate`)
  launcher   `deep_gemm.mega.launch.launch_mega_moe` (Python launcher: addresses, status, `_C` call)
  _C         `_C.launch_mega_moe` alone, with the arguments the launcher passed (C++: pybind11's argument
             conversion, the heuristic, the launch plan or its tensor maps, cuLaunchKernelEx)
  replay     a CUDA graph of the same call, `graph.replay()` (what a server that captures pays)
  stage      `buf.stage(x, topk_idx, topk_weights)` (checks and the staging kernel's launch), eager
Needs an SM90 GPU.
"""
import argparse
import statistics
import time

import torch

from deep_gemm.mega import api as mega_api
from deep_gemm.mega import launch
from deep_gemm.testing import moe_case as mc
from deep_gemm.testing.bench_utils import capture_graph

DEFAULT_CASES = ['fp8xfp8', '2048', '768', '128', '8', '1', 'fp8xfp4', '2048', '768', '128', '8', '1',
                 'bf16xbf16', '2048', '768', '128', '8', '1']


def per_call_us(fn, calls: int, rounds: int = 15) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


class _CaptureC:
    """Stands in for `launch._C` for one call: records the arguments of `_C.launch_mega_moe`."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def launch_mega_moe(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.real.launch_mega_moe(*args, **kwargs)


def captured_c_args(call):
    """The (args, kwargs) `launch.launch_mega_moe` passes to `_C.launch_mega_moe` in `call()`."""
    capture = _CaptureC(launch._C)
    launch._C = capture
    try:
        call()
    finally:
        launch._C = capture.real
    (args_kwargs,) = capture.calls
    return args_kwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('--calls', type=int, default=64, help='calls per timed round (below the launch queue depth)')
    parser.add_argument('case', nargs='*', help='groups of: fmt hidden inter experts topk n')
    args = parser.parse_args()
    cases = args.case or DEFAULT_CASES
    if len(cases) % 6:
        parser.error(f'cases come in groups of 6 (fmt hidden inter experts topk n), got {len(cases)} values')
    print(f'# {torch.cuda.get_device_name()}: host us per call, median of 15 rounds of {args.calls} calls')
    print(f'{"case":<34} {"entry":>7} {"checks":>7} {"launcher":>9} {"_C":>7} {"replay":>7} {"stage":>7}')
    for c in range(0, len(cases), 6):
        fmt = cases[c]
        h, i, e, k, n = map(int, cases[c + 1:c + 6])
        w = mc.make_weights(fmt, h, i, e, 1, seed=0)
        (buf,) = mc.make_buffers(fmt, 1, e, max(n, 1), k, h, i)
        inputs = mc.make_inputs(fmt, [n], h, e, k, seed=1)
        (y,) = mc.run_ranks(w, inputs, [buf])   # warm-up: compile, load, status mirror
        l1, l2 = w.per_rank[0]
        entry = mega_api.mega_moe_function(fmt)
        name = mega_api.MEGA_MOE_FUNCTIONS[fmt]
        graph, _ = capture_graph(lambda: entry(y, l1, l2, buf))
        c_args, c_kwargs = captured_c_args(lambda: launch.launch_mega_moe(fmt, y, l1, l2, buf, None, None, True))
        row = [
            per_call_us(lambda: entry(y, l1, l2, buf), args.calls),
            per_call_us(lambda: mega_api._validate(fmt, y, l1, l2, buf, None, 'swiglu', None, True, name), args.calls),
            per_call_us(lambda: launch.launch_mega_moe(fmt, y, l1, l2, buf, None, None, True), args.calls),
            per_call_us(lambda: launch._C.launch_mega_moe(*c_args, **c_kwargs), args.calls),
            per_call_us(graph.replay, args.calls),
            per_call_us(lambda: buf.stage(inputs[0].x, inputs[0].topk_idx, inputs[0].topk_weights), args.calls),
        ]
        buf.check()
        print(f'{fmt + f" {h}/{i}/{e}/{k} n={n}":<34} ' + ' '.join(f'{v:>{wd}.1f}' for v, wd in zip(row, (7, 7, 9, 7, 7, 7))),
              flush=True)
        del w, l1, l2, buf, inputs, y, graph, c_args, c_kwargs


if __name__ == '__main__':
    main()
