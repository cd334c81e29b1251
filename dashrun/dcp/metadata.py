"""DCP's global ``Metadata`` as JSON and back, bounded and checked: never a pickle.

:func:`describe_metadata` turns the Metadata the coordinator's ``finish`` gets
(with :class:`Where` each item's bytes are as its storage data) into JSON for
rank 0's shard description: each key's tensor properties, size and chunks (or
that it is opaque bytes, which DCP serialised itself), the planner's data
(plain values only: tuples and dicts tagged) and where each item's bytes are.
:func:`parse_metadata` builds the Metadata back from such a description, with
every chunk checked against its tensor and every item's place (rank, offset,
length) against the sizes the committed shards announce.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dashrun.errors import ProtocolError, UsageError
from dashrun.wire.messages import CheckpointInfo

__all__ = ["FORMAT", "MAX_META_DEPTH", "Where", "describe_metadata", "index_json", "parse_metadata"]

#: Version of the ``"dcp"`` part of a shard's description.
FORMAT = 1
#: Deepest nesting accepted in a description: ours is a few levels, the planner's paths a few more.
MAX_META_DEPTH = 256
#: dtypes a description may name (the attribute of ``torch`` of that name).
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64, torch.complex32,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
            "preserve_format": torch.preserve_format, "channels_last_3d": torch.channels_last_3d}


@dataclasses.dataclass(frozen=True)
class Where:
    """Where an item's bytes are: ``[start, start + length)`` of saved rank ``rank``'s private part."""

    rank: int
    start: int
    length: int


def index_json(index: MetadataIndex) -> dict[str, Any]:
    """A MetadataIndex as JSON."""
    return {"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset), "index": index.index}


def _plain(value: Any, what: str) -> Any:
    """Planner data as JSON: strings, numbers, None, lists, tuples (tagged) and dicts with string keys."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, tuple):
        return {"$t": [_plain(v, what) for v in value]}
    if isinstance(value, list):
        return [_plain(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$d": {k: _plain(v, what) for k, v in value.items()}}
    raise UsageError(f"cannot describe {what} ({type(value).__name__}) as JSON",
                     hint="dashrun.dcp stores DCP's metadata as JSON, never as a pickle: use torch's default "
                          "planners, or a planner whose planner_data holds plain values")


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$t"} and isinstance(value["$t"], list):
            return tuple(_unplain(v) for v in value["$t"])
        if set(value) == {"$d"} and isinstance(value["$d"], dict):
            return {k: _unplain(v) for k, v in value["$d"].items()}
        raise ProtocolError("malformed planner data in a dcp checkpoint's description")
    return value


def _format_name(memory_format: torch.memory_format) -> str:
    return next((name for name, f in _FORMATS.items() if f == memory_format), "contiguous_format")


def describe_metadata(metadata: Metadata) -> dict[str, Any]:
    """DCP's global Metadata (with our storage_data) as JSON."""
    keys = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            p = md.properties
            keys[fqn] = {"tensor": {
                "dtype": str(p.dtype).removeprefix("torch."), "requires_grad": bool(p.requires_grad),
                "pin_memory": bool(p.pin_memory), "memory_format": _format_name(p.memory_format),
                "size": list(md.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}}
        elif isinstance(md, BytesStorageMetadata):
            keys[fqn] = {"bytes": {}}
        else:
            raise UsageError(f"cannot describe {fqn}: DCP storage metadata of type {type(md).__name__}")
    storage = [{**index_json(index), "rank": where.rank, "start": where.start, "length": where.length}
               for index, where in (metadata.storage_data or {}).items()]
    meta = metadata.storage_meta
    return {
        "keys": keys,
        "planner_data": _plain(metadata.planner_data, "the planner's data"),
        "storage": storage,
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id, "modules": [str(m) for m in meta.modules]},
        "version": metadata.version,
    }


def _ints(value: Any, what: str, low: int = 0) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= low for v in value) or len(value) > 64:
        raise ProtocolError(f"malformed {what} in a dcp checkpoint's description")
    return value


def _string(value: Any, what: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > 4096:
        raise ProtocolError(f"malformed {what} in a dcp checkpoint's description")
    return value


def _tensor_metadata(fqn: str, raw: Any) -> TensorStorageMetadata:
    if not isinstance(raw, dict):
        raise ProtocolError(f"malformed description of {fqn!r}")
    dtype = _DTYPES.get(raw.get("dtype"))
    if dtype is None:
        raise ProtocolError(f"{fqn!r}: unknown dtype {str(raw.get('dtype'))[:40]!r}")
    size = _ints(raw.get("size"), f"size of {fqn!r}")
    chunks = raw.get("chunks")
    if not isinstance(chunks, list):
        raise ProtocolError(f"malformed chunks of {fqn!r}")
    parsed = []
    for chunk in chunks:
        if not (isinstance(chunk, list) and len(chunk) == 2):
            raise ProtocolError(f"malformed chunk of {fqn!r}")
        offsets, sizes = _ints(chunk[0], f"chunk of {fqn!r}"), _ints(chunk[1], f"chunk of {fqn!r}")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise ProtocolError(f"a chunk of {fqn!r} lies outside its tensor of size {size}")
        parsed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    properties = TensorProperties(dtype=dtype, requires_grad=raw.get("requires_grad") is True,
                                  memory_format=_FORMATS.get(raw.get("memory_format"), torch.contiguous_format),
                                  pin_memory=raw.get("pin_memory") is True)
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=parsed)


def parse_metadata(raw: Any, info: CheckpointInfo) -> Metadata:
    """DCP Metadata from rank 0's description; every item's place checked against the shards' sizes."""
    if not isinstance(raw, dict) or not isinstance(raw.get("keys"), dict) or not isinstance(raw.get("storage"), list):
        raise ProtocolError("malformed DCP metadata in a dcp checkpoint's description")
    keys: dict[str, Any] = {}
    for fqn, md in raw["keys"].items():
        if isinstance(md, dict) and set(md) == {"bytes"}:
            keys[fqn] = BytesStorageMetadata()
        elif isinstance(md, dict) and set(md) == {"tensor"}:
            keys[fqn] = _tensor_metadata(fqn, md["tensor"])
        else:
            raise ProtocolError(f"malformed description of {fqn!r}")
    storage: dict[MetadataIndex, Where] = {}
    for entry in raw["storage"]:
        if not isinstance(entry, dict):
            raise ProtocolError("malformed storage entry in a dcp checkpoint's description")
        fqn = _string(entry.get("fqn"), "storage key")
        offset = None if entry.get("offset") is None else _ints(entry.get("offset"), f"offset of {fqn!r}")
        rank, start, length = entry.get("rank"), entry.get("start"), entry.get("length")
        if not (type(rank) is int and 0 <= rank < info.world and type(start) is int and type(length) is int
                and 0 <= start and 0 <= length and start + length <= info.shards[rank].private_len):
            raise ProtocolError(f"{fqn!r}: its bytes lie outside the shard that should hold them")
        md = keys.get(fqn)
        if md is None:
            raise ProtocolError(f"{fqn!r} is stored but not described")
        if isinstance(md, TensorStorageMetadata):
            chunk = next((c for c in md.chunks if offset is not None and list(c.offsets) == offset), None)
            if chunk is None or length != math.prod(chunk.sizes) * md.properties.dtype.itemsize:
                raise ProtocolError(f"{fqn!r}: a stored chunk does not match its description")
        index = entry.get("index")
        storage[MetadataIndex(fqn, offset, index if type(index) is int else None)] = Where(rank, start, length)
    meta = raw.get("storage_meta")
    storage_meta = StorageMeta()
    if isinstance(meta, dict):
        modules = meta.get("modules")
        storage_meta = StorageMeta(checkpoint_id=_string(meta.get("checkpoint_id"), "checkpoint id", True),
                                   save_id=_string(meta.get("save_id"), "save id", True),
                                   modules=[_string(m, "module") for m in modules] if isinstance(modules, list)
                                   else [])
    return Metadata(state_dict_metadata=keys, planner_data=_unplain(raw.get("planner_data")), storage_data=storage,
                    storage_meta=storage_meta, version=_string(raw.get("version"), "version", True))
