"""A plain CUDA copy kernel (CuPy RawKernel): one thread block per range, the GPU benchmark's ceiling.

`RangeCopy` copies a list of (src offset, dst offset, length) ranges from one
device pointer to another; either pointer may be a peer GPU's memory (peer
access enabled, or an opened CUDA IPC handle), so the kernel reads or writes
over NVLink directly. Ranges longer than `CHUNK` bytes are split first (one
block each), so 1 GiB is 16384 blocks. Each thread moves 16-byte words, four
loads in flight before the stores, where both ends are 16-byte aligned, and
bytes otherwise.

Concurrency: one instance per (device, range list); launches go on the stream given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from _gpu.harness import chunk_ranges

__all__ = ["CHUNK", "THREADS", "RangeCopy", "enable_peer_access"]

CHUNK = 64 << 10
"""Bytes per thread block at most."""
THREADS = 256

SOURCE = r"""
extern "C" __global__ void copy_ranges(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                       const long long* __restrict__ src_off, const long long* __restrict__ dst_off,
                                       const long long* __restrict__ len) {
    const long long r = blockIdx.x;
    const unsigned char* s = src + src_off[r];
    unsigned char* d = dst + dst_off[r];
    const long long n = len[r];
    const long long t = threadIdx.x, step = blockDim.x;
    if (((reinterpret_cast<unsigned long long>(s) | reinterpret_cast<unsigned long long>(d)) & 15ull) == 0) {
        const uint4* s4 = reinterpret_cast<const uint4*>(s);
        uint4* d4 = reinterpret_cast<uint4*>(d);
        const long long n4 = n >> 4;
        long long i = t;
        for (; i + 3 * step < n4; i += 4 * step) {
            const uint4 a = s4[i], b = s4[i + step], c = s4[i + 2 * step], e = s4[i + 3 * step];
            d4[i] = a;
            d4[i + step] = b;
            d4[i + 2 * step] = c;
            d4[i + 3 * step] = e;
        }
        for (; i < n4; i += step) d4[i] = s4[i];
        for (long long j = (n4 << 4) + t; j < n; j += step) d[j] = s[j];
    } else {
        for (long long j = t; j < n; j += step) d[j] = s[j];
    }
}
"""

_kernels: dict[int, Any] = {}


def _kernel(device: int) -> Any:
    import cupy

    if device not in _kernels:
        with cupy.cuda.Device(device):
            _kernels[device] = cupy.RawKernel(SOURCE, "copy_ranges")
    return _kernels[device]


def enable_peer_access(device: int, peer: int) -> None:
    """Let `device` reach `peer`'s memory (no error if already enabled)."""
    import cupy

    with cupy.cuda.Device(device):
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(peer)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            if "AlreadyEnabled" not in str(exc) and "704" not in str(exc):
                raise


class RangeCopy:
    """Launches of the copy kernel on `device` for one range list between two pointers."""

    def __init__(self, device: int, src_ptr: int, dst_ptr: int, so: np.ndarray, do: np.ndarray, ln: np.ndarray, stream: Any) -> None:
        import cupy

        cs, cd, cl = chunk_ranges(so, do, ln, CHUNK)
        self.blocks = int(cl.size)
        self._device = device
        self._stream = stream
        self._kernel = _kernel(device)
        with cupy.cuda.Device(device):
            self._args = (np.uint64(src_ptr), np.uint64(dst_ptr), cupy.asarray(cs), cupy.asarray(cd), cupy.asarray(cl))
        self._grid, self._block = (self.blocks,), (THREADS,)

    def post(self) -> None:
        """Launch (asynchronously, on the stream)."""
        import cupy

        with cupy.cuda.Device(self._device):
            self._kernel(self._grid, self._block, self._args, stream=self._stream)
