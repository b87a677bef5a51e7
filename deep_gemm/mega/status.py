"""Errors a Mega MoE call records on the device, and how the host surfaces them (DESIGN.md §6).

The kernel writes the first error of a call into the buffer's status words and into a small
pinned host mirror, without trapping: the process and its CUDA context stay usable. The host
reads the mirror (no synchronization) before the next call on the buffer, or on demand through
`SymmBuffer.check()`, and raises `MegaMoEError`; `SymmBuffer.reset()` makes the buffer usable again.

Encoding (deep_gemm/include/deep_gemm/impls/mega_moe_params.cuh): bits 0-7 code, 8-15 phase,
16-23 rank, 24-39 CTA, 40-63 detail.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .. import _C

# Numeric codes, phases and slots come from the kernel's header through _C (one definition)
_CODE = dict(_C.STATUS_CODES)
_PHASE = dict(_C.STATUS_PHASES)
CODES = {_CODE['timeout']: 'timeout', _CODE['bad_expert_id']: 'expert id outside [-1, num_experts)',
         _CODE['bad_count']: 'corrupted receive count',
         _CODE['duplicate_expert']: 'a token lists the same expert more than once',
         _CODE['epoch_mismatch']: 'ranks out of step (a peer is two or more calls ahead: reset() ran on some ranks only)'}
PHASES = {_PHASE['none']: 'none', _PHASE['recv_counts']: 'waiting for receive counts', _PHASE['pull']: 'pull',
          _PHASE['l1_wait']: 'L1 waiting for its M-block tokens', _PHASE['l2_wait']: 'L2 waiting for L1 of its M-block',
          _PHASE['combine_wait']: 'combine waiting for peers', _PHASE['pipeline']: 'pipeline', _PHASE['count']: 'count'}
_ERROR, _ABORT = _C.kStatusError, _C.kStatusAbort

_timeout_s: Optional[float] = None   # set_timeout's
# The longest bound accepted (~11.6 days): the kernels count it in uint64 nanoseconds, and some waits
# wait twice the bound, so it stays far below 2^63 ns; inf or a larger number would wrap to ~0 there
MAX_TIMEOUT_S = _C.kMaxTimeoutSeconds


def _env_timeout() -> Optional[float]:
    """DG_TIMEOUT_S in seconds, None when unset, NaN when not a positive number (get_timeout raises)."""
    value = os.environ.get('DG_TIMEOUT_S')
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return math.nan
    return seconds if 0 < seconds <= MAX_TIMEOUT_S else math.nan


# DG_TIMEOUT_S, read once, when deep_gemm is imported: every launch passes the bound, and an
# environment lookup costs ~1 us (docs/PERF.md, session 49); set_timeout changes it later
_env_timeout_s: Optional[float] = _env_timeout()
DEFAULT_TIMEOUT_S = 5.0


def set_timeout(seconds: float) -> None:
    """Bound every spin-wait of the Mega MoE kernels (default `DG_TIMEOUT_S` as at import, else 5 s)."""
    global _timeout_s
    if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ValueError(f'seconds: expected a number in (0, {MAX_TIMEOUT_S:g}], got {seconds!r}')
    _timeout_s = float(seconds)


def get_timeout() -> float:
    """Current spin-wait bound in seconds: `set_timeout`'s, else `DG_TIMEOUT_S` as at import, else 5."""
    if _timeout_s is not None:
        return _timeout_s
    if _env_timeout_s is None:
        return DEFAULT_TIMEOUT_S
    if math.isnan(_env_timeout_s):
        raise ValueError(f'DG_TIMEOUT_S = {os.environ.get("DG_TIMEOUT_S")!r}: expected a number of seconds in '
                         f'(0, {MAX_TIMEOUT_S:g}]')
    return _env_timeout_s


def timeout_from_environment() -> bool:
    """Whether DG_TIMEOUT_S was set when deep_gemm was imported."""
    return _env_timeout_s is not None


class MegaMoEError(RuntimeError):
    """A Mega MoE call failed on the device; `code`, `phase`, `rank`, `cta`, `detail` decode the status word."""

    def __init__(self, word: int, own_rank: int, fatal: bool) -> None:
        self.word = word
        self.code = word & 0xFF
        self.phase = (word >> 8) & 0xFF
        self.rank = (word >> 16) & 0xFF
        self.cta = (word >> 24) & 0xFFFF
        self.detail = (word >> 40) & 0xFFFFFF
        self.fatal = fatal
        what = CODES.get(self.code, f'unknown error code {self.code}')
        phase = PHASES.get(self.phase, f'phase {self.phase}')
        if self.code == _CODE['timeout']:
            msg = (f'Mega MoE rank {own_rank}: timeout in phase "{phase}" waiting for rank {self.rank} '
                   f'(CTA {self.cta}); a peer stalled or was never launched. Call reset() on every rank.')
        elif self.code in (_CODE['bad_expert_id'], _CODE['duplicate_expert']):
            msg = (f'Mega MoE rank {own_rank}: {what} at token {self.detail} (the slot was skipped, '
                   f'the output of that token is incomplete)')
        else:
            msg = f'Mega MoE rank {own_rank}: {what} in phase "{phase}" (rank {self.rank}, detail {self.detail})'
        # Recovery: a non-fatal error left the buffer consistent; a fatal one stopped the call midway
        msg += (' Call reset() on every rank of the group before the next call.' if fatal and self.code != _CODE['timeout']
                else '' if fatal else ' The call completed: clear_error() on this rank to continue.')
        super().__init__(msg)


def host_status(buffer) -> Optional[torch.Tensor]:
    """The pinned [2] int64 mirror of `buffer`'s status words (created on first use; GPU only)."""
    mirror = getattr(buffer, '_host_status', None)
    if mirror is None and buffer.device.type == 'cuda':
        mirror = torch.zeros(_C.kNumStatusWords, dtype=torch.int64, pin_memory=True)
        buffer._host_status = mirror
        buffer._host_status_words = mirror.numpy()   # the same memory (raise_if_failed's fast read)
    return mirror


def raise_if_failed(buffer, sync: bool = False) -> None:
    """Raise `MegaMoEError` if a finished call on `buffer` recorded an error.

    `sync=False` reads only the host mirror (no device synchronization: it sees calls that have
    completed); `sync=True` also synchronizes and reads the device words.
    """
    word, fatal = 0, 0
    mirror = getattr(buffer, '_host_status', None)
    if not sync and mirror is not None:
        # The hot path (every eager call): the error word through the numpy view of the same pinned
        # memory that host_status keeps, ~0.1 us, where indexing the tensor costs ~2 us
        words = getattr(buffer, '_host_status_words', None)
        if words is not None and not words[_ERROR]:
            return
    if sync:
        torch.cuda.synchronize(buffer.device) if buffer.device.type == 'cuda' else None
        offset, num_bytes = buffer.layout['status']
        device_words = buffer.workspace[offset:offset + num_bytes].view(torch.int64)
        word, fatal = int(device_words[_ERROR]), int(device_words[_ABORT])
    if not word and mirror is not None:
        word, fatal = int(mirror[_ERROR]), int(mirror[_ABORT])
    if word:
        raise MegaMoEError(word & 0xFFFFFFFFFFFFFFFF, buffer.rank, bool(fatal))


def clear(buffer, status_words: bool = False) -> None:
    """Forget recorded errors: the host mirror, and with `status_words` the device status words
    (`SymmBuffer.clear_error()`; `reset()` zeroes the whole workspace instead)."""
    if status_words:
        offset = buffer.layout['status'][0]
        buffer.workspace[offset:offset + buffer.layout['status'][1]].zero_()
    mirror = getattr(buffer, '_host_status', None)
    if mirror is not None:
        mirror.zero_()
