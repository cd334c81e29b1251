"""The rank's staging copy into the shared-memory buffer, with streaming stores where it can.

The staged bytes are written once and never read again by the rank: the agent
reads them from the segment. An ordinary copy reads every destination line
into the cache before writing it and evicts the training's own data; with
non-temporal stores (dashrun's C helper ``dashrun._ntcopy``, built at install
where a C compiler is present, x86-64 only) the copy costs the training core
about a third less CPU and memory traffic. Elsewhere it is torch's ``copy_``.
"""

from __future__ import annotations

import torch

try:
    from dashrun import _ntcopy
except ImportError:  # not built (no C compiler at install): torch's copy_ does the work
    _ntcopy = None

#: Whether copy_into uses streaming stores; tests and benchmarks may turn it off to compare.
streaming = bool(_ntcopy is not None and _ntcopy.STREAMING)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for flat uint8 tensors of one length; streamed when both are contiguous in RAM."""
    if (streaming and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.dtype == torch.uint8 and src.dtype == torch.uint8 and dst.dim() == 1 and src.dim() == 1
            and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous()):
        if dst.numel():
            _ntcopy.copy(dst.data_ptr(), src.data_ptr(), dst.numel())
        return
    dst.copy_(src)
