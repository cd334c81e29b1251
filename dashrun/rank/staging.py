"""The rank's staging copy into the shared-memory buffer, with streaming stores where it can.

The staged bytes are written once and never read again by the rank: the agent
reads them from the segment. An ordinary copy reads every destination line
into the cache before writing it and evicts the training's own data. With
non-temporal stores (dashrun's C helper ``dashrun.util._ntcopy``, built at
install where a C compiler is present; x86-64 with SSE4.2) the copy writes
around the cache: it neither reads the destination nor evicts the training's
data, so the training core spends less CPU on it. The same loop computes the
bytes' CRC-32C from the registers it copies through, so the rank hands over
its shard with the checksum dash-memd verifies, and dash-agent makes no pass
of its own over the segment. Elsewhere it is torch's ``copy_`` and the agent
checksums as it sends.
"""

from __future__ import annotations

import ctypes

import torch

from dashrun.wire.protocol import crc32c

try:
    from dashrun.util import _ntcopy
except ImportError:  # not built (no C compiler at install): torch's copy_ does the work
    _ntcopy = None

__all__ = ["bytes_of", "copy_into", "crc_of", "streaming"]

#: Whether copy_into streams and checksums with the helper (and so the rank hands over its checksum);
#: tests and benchmarks may turn it off to compare.
streaming = bool(_ntcopy is not None and _ntcopy.STREAMING)


def _streamable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == torch.uint8
            and src.dtype == torch.uint8 and dst.dim() == 1 and src.dim() == 1 and dst.numel() == src.numel()
            and dst.is_contiguous() and src.is_contiguous())


def bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy (no numpy needed)."""
    if not (t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous()):
        raise ValueError("bytes_of needs a contiguous uint8 CPU tensor")
    if not t.numel():
        return memoryview(b"")
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def crc_of(region: torch.Tensor, crc: int) -> int:
    """``crc`` extended over a stretch of the staging buffer (the gaps between copies, the description)."""
    return crc32c(bytes_of(region), crc)


def copy_into(dst: torch.Tensor, src: torch.Tensor, crc: int | None = None) -> int | None:
    """``dst.copy_(src)`` for flat uint8 tensors of one length; streamed when both are contiguous in RAM.

    With a running CRC-32C ``crc``, returns it extended over the copied bytes.
    """
    if not dst.numel() and not src.numel():
        return crc
    if streaming and _streamable(dst, src):  # the checksum comes free with the copy
        extended = _ntcopy.copy_crc(dst.data_ptr(), src.data_ptr(), dst.numel(), crc or 0)
        return None if crc is None else extended
    dst.copy_(src)
    return None if crc is None else crc_of(dst, crc)
