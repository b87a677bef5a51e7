"""Expert parallelism over real GPUs: run a function in N processes, one per GPU (issue 6).

The kernel is the same as with virtual ranks (DESIGN.md §7): each rank's launch takes its rank index
and every rank's buffer base address. With one process per GPU those addresses come from
`torch.distributed._symmetric_memory` (`get_symm_buffer_for_mega_moe(group, ...)`), so the peers'
buffers are reached over NVLink.

- `spawn(fn, world_size, *args)`: start `world_size` processes, rank r on GPU r, each with an
  initialized process group (NCCL, or gloo for CPU tests), call `fn(rank, world_size, *args)` in each
  and return the ranks' return values (index = rank). A child's exception is raised in the parent
  as `RankError`, naming the rank and carrying its traceback.
- `init_from_env()`: the same set-up for a process started by `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK).
- `all_ranks_agree(what)`: a block that either succeeds on every rank or raises on every rank, so
  that a failure on one rank never leaves the others waiting in a collective or in the kernel.
- NVLink multicast stays off in every process (`NO_MULTICAST_ENV`): the kernel never uses multimem
  operations, and creating multicast objects fails or changes NCCL's algorithms on some systems.
  `PROCESS_ENV_DEFAULTS` (torch's implicit symmetric-memory pool off) applies where not set.
- `--probe` (command line, `ep_check.probe_rank`): NCCL and symmetric memory without the kernel.

Command line (the EP correctness check of `deep_gemm.testing.ep_check` on real GPUs)::

    python -m deep_gemm.testing.multi_process --check --nproc 2            # spawns 2 processes
    python -m deep_gemm.testing.multi_process --probe --nproc 2 --timeout 75   # no kernel
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 -m deep_gemm.testing.multi_process --check
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

# Set in every process this module starts (and by `init_from_env`), before any communicator exists
NO_MULTICAST_ENV: Dict[str, str] = {
    'NCCL_NVLS_ENABLE': '0',                   # NCCL: no NVLink SHARP (multicast) algorithms
    'TORCH_SYMM_MEM_DISABLE_MULTICAST': '1',   # torch symmetric memory: no multicast object at rendezvous
    'NVSHMEM_DISABLE_NVLS': '1',               # NVSHMEM (if torch's symmetric memory uses it): same
}
# Defaults for every process this module starts (and `init_from_env`), kept where already set:
# torch's implicit symmetric-memory pool off, so that every buffer is its own allocation with its
# own rendezvous (the pool's block reuse is per rank; the buffer code copes with it, but the plain
# path has fewer moving parts on a first run; TORCH_SYMMMEM_IMPLICIT_POOL=1 tests the pool)
PROCESS_ENV_DEFAULTS: Dict[str, str] = {
    'TORCH_SYMMMEM_IMPLICIT_POOL': '0',
}
BACKENDS = ('nccl', 'gloo')
# How often the parent looks for finished or failed children while it waits
_POLL_S = 0.5
# Seconds a terminated child gets before it is killed
_TERMINATE_GRACE_S = 5.0
# Seconds children that all returned a result get to exit before they are terminated (a hang in
# process teardown, e.g. in NCCL or symmetric-memory destructors, must not cost the results)
_EXIT_GRACE_S = 30.0
# An exception's message is cut to this many characters when it is sent to the other ranks
_MAX_MESSAGE_CHARS = 4000


class RankError(RuntimeError):
    """A spawned rank failed: `rank`, `exc_type` (class name of its exception, or 'exited' when the
    process died without one), `message`, `child_traceback` (the child's formatted traceback)."""

    def __init__(self, rank: int, exc_type: str, message: str, child_traceback: str = '') -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.child_traceback = child_traceback
        text = f'rank {rank} raised {exc_type}: {message}'
        if child_traceback:
            text += f'\n\n-- traceback of rank {rank} --\n{child_traceback.rstrip()}'
        super().__init__(text)


class RanksFailed(RuntimeError):
    """Raised on every rank by `all_ranks_agree` when the block failed on at least one rank.

    `what` names the block; `failures` is a list of (rank, exception class name, message).
    """

    def __init__(self, what: str, failures: Sequence[Tuple[int, str, str]]) -> None:
        self.what = what
        self.failures = list(failures)
        ranks = ', '.join(str(r) for r, _, _ in self.failures)
        details = '\n'.join(f'  rank {r}: {t}: {m}' for r, t, m in self.failures)
        super().__init__(f'{what} failed on rank(s) {ranks}:\n{details}')


# --------------------------------------------------------------------------------------------------
# Process set-up
# --------------------------------------------------------------------------------------------------

def set_no_multicast_env(environ: Optional[Dict[str, str]] = None) -> None:
    """Write `NO_MULTICAST_ENV` into `environ` (default `os.environ`), overriding earlier values, and
    `PROCESS_ENV_DEFAULTS` where not set."""
    environ = os.environ if environ is None else environ
    environ.update(NO_MULTICAST_ENV)
    for k, v in PROCESS_ENV_DEFAULTS.items():
        environ.setdefault(k, v)


def process_env_report() -> Dict[str, Optional[str]]:
    """The values of the variables this module sets, as this process sees them."""
    return {k: os.environ.get(k) for k in (*NO_MULTICAST_ENV, *PROCESS_ENV_DEFAULTS)}


@contextlib.contextmanager
def _temporary_env(values: Dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set inside the block, restored after it (children inherit it)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def find_free_port(host: str = '127.0.0.1') -> int:
    """A TCP port on `host` that nothing listens on now (the OS picks it; another process could take
    it before it is used, which init_process_group then reports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_env() -> Optional[Tuple[int, int, int]]:
    """(rank, world_size, local_rank) from torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or None when
    any of them is missing. Raises ValueError on values that are not consistent integers."""
    names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK')
    if not all(n in os.environ for n in names):
        return None
    try:
        rank, world_size, local_rank = (int(os.environ[n]) for n in names)
    except ValueError:
        raise ValueError('RANK, WORLD_SIZE and LOCAL_RANK must be integers, got ' +
                         ', '.join(f'{n}={os.environ[n]!r}' for n in names)) from None
    if not (world_size >= 1 and 0 <= rank < world_size and 0 <= local_rank < world_size):
        raise ValueError(f'inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world_size}, '
                         f'LOCAL_RANK={local_rank}')
    return rank, world_size, local_rank


def init_rank(rank: int, world_size: int, backend: str = 'nccl', init_method: str = 'env://',
              local_rank: Optional[int] = None, timeout_s: Optional[float] = None) -> None:
    """Join the default process group as `rank`; with NCCL, use GPU `local_rank` (default `rank`).

    Sets `NO_MULTICAST_ENV` first. `timeout_s` bounds collectives (None: torch's default).
    """
    import torch.distributed as dist
    if backend not in BACKENDS:
        raise ValueError(f'backend = {backend!r} is invalid: expected one of {BACKENDS}')
    set_no_multicast_env()
    kwargs: Dict[str, Any] = dict(backend=backend, init_method=init_method, rank=rank, world_size=world_size)
    if timeout_s is not None:
        kwargs['timeout'] = datetime.timedelta(seconds=timeout_s)
    if backend == 'nccl':
        local_rank = rank if local_rank is None else local_rank
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f'rank {rank}: local rank {local_rank} needs GPU {local_rank}, but {count} '
                               f'GPU(s) are visible')
        torch.cuda.set_device(local_rank)
        try:
            # Binding the device makes NCCL create its communicator now and barriers use this GPU
            dist.init_process_group(device_id=torch.device('cuda', local_rank), **kwargs)
        except TypeError:   # torch without `device_id`
            dist.init_process_group(**kwargs)
    else:
        dist.init_process_group(**kwargs)


def init_from_env(backend: str = 'nccl', timeout_s: Optional[float] = None) -> Tuple[int, int]:
    """Initialize a process started by torchrun; returns (rank, world_size)."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError('not started by torchrun: RANK, WORLD_SIZE and LOCAL_RANK must be set')
    rank, world_size, local_rank = env
    init_rank(rank, world_size, backend, 'env://', local_rank, timeout_s)
    return rank, world_size


def destroy() -> None:
    """Leave the process group cleanly: a barrier (no rank tears down while a peer still talks to
    it), then `destroy_process_group`. Nothing if no group is initialized."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# spawn
# --------------------------------------------------------------------------------------------------

def _result_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f'rank{rank}.pkl')


def _write_result(result_dir: str, rank: int, record: tuple) -> None:
    path = _result_path(result_dir, rank)
    with open(path + '.tmp', 'wb') as f:
        pickle.dump(record, f)
    os.replace(path + '.tmp', path)   # the parent never reads a half-written file


def _read_result(result_dir: str, rank: int) -> Optional[tuple]:
    try:
        with open(_result_path(result_dir, rank), 'rb') as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _worker(local_rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
            result_dir: str, timeout_s: Optional[float], args: tuple) -> None:
    rank = local_rank
    set_no_multicast_env()
    # What torchrun would set, for code that reads it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    try:
        init_rank(rank, world_size, backend, f'tcp://127.0.0.1:{port}', local_rank, timeout_s)
        result = fn(rank, world_size, *args)
        try:
            _write_result(result_dir, rank, ('ok', result))
        except Exception as e:  # noqa: BLE001 - an unpicklable result is the child's error
            raise TypeError(f'the return value of {getattr(fn, "__name__", fn)} cannot be pickled: {e}') from e
    except BaseException as e:
        # Time of failure: the parent reports the rank that failed first (the others usually fail
        # because of it: a peer stopped answering)
        _write_result(result_dir, rank, ('error', time.time(), type(e).__name__, str(e), traceback.format_exc()))
        raise
    # Success only: after an error a peer may be stuck in a collective and the barrier would hang
    destroy()


def _all_returned(result_dir: str, world_size: int) -> bool:
    """Every rank wrote an 'ok' result."""
    return all((_read_result(result_dir, r) or ('',))[0] == 'ok' for r in range(world_size))


def _rank_error(result_dir: str, world_size: int, error: BaseException) -> RankError:
    """The RankError for a failed spawn: the child that recorded an exception first, else the one
    torch.multiprocessing reported (a child that died without a Python exception)."""
    recorded = [(rec[1], r, rec) for r in range(world_size)
                if (rec := _read_result(result_dir, r)) is not None and rec[0] == 'error']
    if recorded:
        _, rank, (_, _, exc_type, message, tb) = min(recorded)
        return RankError(rank, exc_type, message, tb)
    rank = getattr(error, 'error_index', -1)
    return RankError(rank, 'exited', str(error).strip())


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = 'nccl',
          timeout_s: Optional[float] = None, collective_timeout_s: Optional[float] = None) -> List[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes and return their results.

    Each process: `NO_MULTICAST_ENV` in its environment from the start, RANK/WORLD_SIZE/LOCAL_RANK
    set as torchrun would, `torch.cuda.set_device(rank)` (NCCL), the default process group joined
    through a free TCP port on 127.0.0.1, and after `fn` returns a barrier and
    `destroy_process_group`.

    Args:
        fn: a module-level function (it is pickled into the children); its return value must pickle.
        world_size: number of processes (>= 1); with NCCL at most the number of visible GPUs.
        args: passed to `fn` after (rank, world_size); must pickle.
        backend: "nccl" (one GPU per rank) or "gloo" (CPU; tests of the process plumbing).
        timeout_s: wall-clock bound for the whole run (None: none). When it passes, the children
            still running are terminated and TimeoutError names them. Once every child has
            returned its result, a child that does not exit within _EXIT_GRACE_S, or that dies
            while exiting, is terminated and reported on stderr: the results are kept.
        collective_timeout_s: bound of one collective (torch's default when None).

    Returns:
        [fn's return value on rank 0, on rank 1, ...].

    Raises:
        RankError: a child raised (the first one to fail: its rank, exception type, message and
            traceback) or died; the other children are terminated.
    """
    import torch.multiprocessing as mp
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f'world_size = {world_size!r} is invalid: expected an integer >= 1')
    if backend not in BACKENDS:
        raise ValueError(f'backend = {backend!r} is invalid: expected one of {BACKENDS}')
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f'timeout_s = {timeout_s!r} is invalid: expected None or a positive number')
    if backend == 'nccl':
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world_size:
            raise RuntimeError(f'spawn(backend="nccl") needs one GPU per rank: world_size = {world_size}, '
                               f'{count} GPU(s) visible')
    port = find_free_port()
    child_env = dict(NO_MULTICAST_ENV, **{k: os.environ.get(k, v) for k, v in PROCESS_ENV_DEFAULTS.items()})
    with tempfile.TemporaryDirectory(prefix='deep_gemm_spawn_') as result_dir:
        with _temporary_env(child_env):
            context = mp.spawn(_worker, args=(fn, world_size, port, backend, result_dir, collective_timeout_s, args),
                               nprocs=world_size, join=False)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        all_returned_at = None
        try:
            while not context.join(timeout=_POLL_S):
                now = time.monotonic()
                if all_returned_at is None and _all_returned(result_dir, world_size):
                    all_returned_at = now
                if all_returned_at is not None and now - all_returned_at > _EXIT_GRACE_S:
                    running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    print(f'# spawn: every rank returned its result, but rank(s) {running} did not exit within '
                          f'{_EXIT_GRACE_S:.0f} s (a hang in teardown); terminated', file=sys.stderr, flush=True)
                    break
                if deadline is not None and now > deadline:
                    running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    returned = [r for r in range(world_size) if (_read_result(result_dir, r) or ('',))[0] == 'ok']
                    raise TimeoutError(f'spawn: rank(s) {running} of {world_size} still running after '
                                       f'{timeout_s} s (rank(s) {returned} had returned); terminated')
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            if not _all_returned(result_dir, world_size):
                raise _rank_error(result_dir, world_size, e) from None
            # Every rank returned; one died afterwards (in teardown): keep the results
            print(f'# spawn: every rank returned its result, then a process failed on exit: '
                  f'{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}',
                  file=sys.stderr, flush=True)
        finally:
            _stop(context.processes)
        results = []
        for rank in range(world_size):
            record = _read_result(result_dir, rank)
            if record is None or record[0] != 'ok':
                raise RankError(rank, 'exited', 'the process ended without returning a result')
            results.append(record[1])
        return results


def _stop(processes: Sequence[Any]) -> None:
    """Terminate, then kill, the given child processes that are still alive (ours, by object)."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# --------------------------------------------------------------------------------------------------
# Failing together
# --------------------------------------------------------------------------------------------------

class all_ranks_agree:
    """Context manager: a block that succeeds on every rank or raises on every rank.

    On leaving the block every rank sends (its exception, if any; `self.share`) to all others (one
    `all_gather_object`). If the block raised anywhere, every rank raises `RanksFailed` listing the
    failed ranks (or NotImplementedError when every rank raised one), so that all ranks take the same
    path afterwards and none is left waiting in a collective or a kernel call. Otherwise
    `self.gathered` is the list of every rank's `share` (index = rank).

    Inside the block: no collective that a failing rank could skip (it would pair with the
    all_gather of another rank's exit); kernel calls are fine (a peer that stops calling makes
    them time out, DESIGN.md §6). KeyboardInterrupt and SystemExit pass through untouched.

    Usage::

        with all_ranks_agree('stage and call') as step:
            ...
            step.share = local_counts
        counts = step.gathered
    """

    def __init__(self, what: str, group=None) -> None:
        self.what = what
        self.group = group
        self.share: Any = None
        self.gathered: Optional[List[Any]] = None

    def __enter__(self) -> 'all_ranks_agree':
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        import torch.distributed as dist
        if exc_type is not None and not issubclass(exc_type, Exception):
            return False
        mine = None if exc is None else (type(exc).__name__, str(exc)[:_MAX_MESSAGE_CHARS])
        gathered: List[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (mine, None if exc is not None else self.share), group=self.group)
        failures = [(r, g[0][0], g[0][1]) for r, g in enumerate(gathered) if g[0] is not None]
        if not failures:
            self.gathered = [g[1] for g in gathered]
            return False
        if len(failures) == len(gathered) and all(t == 'NotImplementedError' for _, t, _ in failures):
            raise NotImplementedError(failures[0][2]) from exc
        raise RanksFailed(self.what, failures) from exc


# --------------------------------------------------------------------------------------------------
# Command line: the EP correctness check on real GPUs
# --------------------------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line of `python -m deep_gemm.testing.multi_process`."""
    from .ep_check import CHECK_FORMATS, CHECK_SHAPES, DEFAULT_NUM_CALLS
    parser = argparse.ArgumentParser(
        prog='python -m deep_gemm.testing.multi_process',
        description='Expert-parallel Mega MoE on real GPUs, one process per GPU (symmetric memory, NVLink). '
                    'Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) runs this rank; otherwise spawns --nproc '
                    'processes.')
    parser.add_argument('--check', action='store_true',
                        help='run the correctness check (eager cases, masks, skew, CUDA graph, back-to-back calls)')
    parser.add_argument('--probe', action='store_true',
                        help='first contact, no kernel: peer access, an NCCL all_reduce and one symmetric buffer '
                             '(rendezvous and the peer-table probe) per rank')
    parser.add_argument('--nproc', type=int, default=None,
                        help='processes to spawn when not under torchrun (default: every visible GPU)')
    parser.add_argument('--formats', nargs='+', choices=CHECK_FORMATS, default=list(CHECK_FORMATS),
                        help=f'weight formats (default: {" ".join(CHECK_FORMATS)})')
    parser.add_argument('--shapes', nargs='+', choices=sorted(CHECK_SHAPES), default=list(CHECK_SHAPES),
                        help='shapes: ' + ', '.join(f'{k} {"/".join(map(str, v))}' for k, v in CHECK_SHAPES.items()))
    parser.add_argument('--seed', type=int, default=0, help='random seed (default 0)')
    parser.add_argument('--calls', type=int, default=DEFAULT_NUM_CALLS,
                        help=f'back-to-back calls with changing n and routing (default {DEFAULT_NUM_CALLS})')
    parser.add_argument('--timeout', type=float, default=None, metavar='S',
                        help='spawn mode: terminate everything after S seconds (default: no limit)')
    args = parser.parse_args(argv)
    if not (args.check or args.probe):
        parser.error('nothing to do: pass --check and/or --probe')
    if args.nproc is not None and args.nproc < 1:
        parser.error(f'--nproc {args.nproc}: expected a positive integer')
    if args.calls < 1:
        parser.error(f'--calls {args.calls}: expected a positive integer')
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the check under torchrun (this rank) or spawn it; print one line per rank and case."""
    from .ep_check import format_case_results, probe_rank, run_check_cases
    args = parse_args(argv)
    cases = [(f, s) for f in args.formats for s in args.shapes]
    env = torchrun_env()
    if env is not None:
        rank, world_size = init_from_env('nccl')
        code = 0
        try:
            if args.probe:
                print(format_probe_results([probe_rank(rank, world_size)]), flush=True)
            if args.check:
                result = run_check_cases(rank, world_size, cases, args.seed, args.calls)
                print(format_case_results([result], first_rank=rank), flush=True)
                code = 0 if all(c['status'] in ('ok', 'not built') for c in result['cases'].values()) else 1
        finally:
            destroy()
        return code
    nproc = args.nproc if args.nproc is not None else torch.cuda.device_count()
    if nproc < 2:
        print(f'# {nproc} GPU(s) visible: the multi-GPU check needs at least 2 (--nproc N, or torchrun)')
        return 1
    print(f'# spawning {nproc} processes, one per GPU; NVLink multicast off '
          f'({" ".join(f"{k}={v}" for k, v in NO_MULTICAST_ENV.items())})', flush=True)
    code = 0
    if args.probe:
        start = time.perf_counter()
        try:
            print(format_probe_results(spawn(probe_rank, nproc, timeout_s=args.timeout)), flush=True)
            print(f'# probe: {time.perf_counter() - start:.1f} s', flush=True)
        except (RankError, TimeoutError) as e:
            print(f'# probe FAILED after {time.perf_counter() - start:.1f} s: {e}', flush=True)
            return 1
    if args.check:
        start = time.perf_counter()
        results = spawn(run_check_cases, nproc, cases, args.seed, args.calls, timeout_s=args.timeout)
        print(format_case_results(results), flush=True)
        print(f'# {time.perf_counter() - start:.1f} s')
        code = 0 if all(c['status'] in ('ok', 'not built') for r in results for c in r['cases'].values()) else 1
    return code


def format_probe_results(results: Sequence[Dict[str, Any]]) -> str:
    """One line per rank of `ep_check.probe_rank` results."""
    lines = []
    for r in results:
        lines.append(f'rank {r["rank"]}/{r["world_size"]} GPU {r["device"]} torch {r["torch"]}: peer access '
                     f'{r["peer_access"]}, all_reduce {r["all_reduce"]:g}, symm backend {r["symm_backend"]}, '
                     f'offsets {r["offsets"]}, peer_ptrs {r["peer_ptrs"]}, {r["seconds"]:.1f} s')
        lines.append(f'    env {r["env"]}')
    return '\n'.join(lines)


if __name__ == '__main__':
    sys.exit(main())
