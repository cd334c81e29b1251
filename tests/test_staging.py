"""The staging copy: streaming stores (dashrun.util._ntcopy) give the same bytes as torch's copy_, and the
checksum computed as they copy is the CRC-32C dash-memd computes."""

from __future__ import annotations

import platform
import shutil
import sysconfig

import pytest
import torch

from dashrun.rank import staging
from dashrun.wire.protocol import crc32c

needs_helper = pytest.mark.skipif(not staging.streaming,
                                  reason="dashrun.util._ntcopy not built, or not x86-64 with SSE4.2")


def test_the_helper_is_built_where_it_can_be():
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        pytest.skip("no C compiler here: dashrun stages with torch's copy_")
    assert staging._ntcopy is not None, "pip install -e . should have built dashrun.util._ntcopy"
    assert staging.streaming == (platform.machine() in ("x86_64", "AMD64"))  # every x86-64 of this decade: SSE4.2


@needs_helper
@pytest.mark.parametrize("nbytes", [0, 1, 15, 64, 65535, 65536 + 7, 65536 + 64 + 63, (1 << 20) + 13])
@pytest.mark.parametrize("dst_shift,src_shift", [(0, 0), (1, 0), (3, 5), (15, 1), (16, 9)])
def test_streamed_copy_is_exact_and_stays_in_its_range(nbytes, dst_shift, src_shift):
    gen = torch.Generator().manual_seed(nbytes * 31 + dst_shift)
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen)
    dst = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8)
    staging.copy_into(dst[dst_shift:dst_shift + nbytes], src[src_shift:src_shift + nbytes])
    assert torch.equal(dst[dst_shift:dst_shift + nbytes], src[src_shift:src_shift + nbytes])
    assert bool((dst[:dst_shift] == 0xA5).all()) and bool((dst[dst_shift + nbytes:] == 0xA5).all())


@needs_helper
@pytest.mark.parametrize("nbytes", [0, 5, 4096, 65536 + 7, 3 * 65536 + 191, 3 * 65536 + 192 + 15, (1 << 20) + 13,
                                    (8 << 20) + 1])
@pytest.mark.parametrize("dst_shift,src_shift", [(0, 0), (1, 0), (15, 6)])
def test_the_checksum_taken_while_copying_is_the_bytes_crc32c(nbytes, dst_shift, src_shift):
    gen = torch.Generator().manual_seed(nbytes + 7 * dst_shift)
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8)
    prefix = b"the shard so far"
    running = crc32c(prefix)
    crc = staging.copy_into(dst[dst_shift:dst_shift + nbytes], src[src_shift:src_shift + nbytes], running)
    expected = bytes(src[src_shift:src_shift + nbytes].tolist())
    assert crc == crc32c(prefix + expected)
    assert bytes(dst[dst_shift:dst_shift + nbytes].tolist()) == expected


def test_without_the_helper_the_checksum_is_computed_after_the_copy(monkeypatch):
    monkeypatch.setattr(staging, "streaming", False)
    src = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    dst = torch.zeros_like(src)
    assert staging.copy_into(dst, src, 0) == crc32c(bytes(src.tolist()))
    assert staging.copy_into(dst, src) is None


def test_what_cannot_be_streamed_is_copied_by_torch(monkeypatch):
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    strided = src[::2]                                    # not contiguous
    dst = torch.zeros(strided.numel(), dtype=torch.uint8)
    staging.copy_into(dst, strided)
    assert torch.equal(dst, strided)
    monkeypatch.setattr(staging, "streaming", False)      # the path without the helper
    dst2 = torch.zeros(src.numel(), dtype=torch.uint8)
    staging.copy_into(dst2, src)
    assert torch.equal(dst2, src)


@needs_helper
def test_the_helper_refuses_nonsense_arguments():
    with pytest.raises(ValueError):
        staging._ntcopy.copy_crc(0, 0, 16, 0)
    with pytest.raises(ValueError):
        staging._ntcopy.copy_crc(1, 1, -1, 0)
    with pytest.raises(TypeError):
        staging._ntcopy.copy_crc("a", 1, 1, 0)
