"""``CachedFiles.dataset()``: the cache as a ``torch.utils.data.Dataset`` (rank side; imports torch)."""

from __future__ import annotations

from torch.utils.data import Dataset

__all__ = ["CachedDataset"]


class CachedDataset(Dataset):
    """Item ``i``: ``(key, local path)`` of the ``i``-th key of the listing, cached first if need be. Pickled
    into a DataLoader's workers with its CachedFiles (URL, cache, listing), so each worker reads through the
    node's cache."""

    def __init__(self, files):
        self.files = files
        self._keys = files.keys()

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: int) -> tuple[str, str]:
        key = self._keys[index]
        return key, self.files.local_path(key)
