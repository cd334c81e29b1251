"""Loading what DCP pickled without running it: :class:`SafeLoadPlanner` and :func:`load_weights_only`.

DCP stores every value that is not a tensor (an int, a string, a list of
learning rates, an object) as opaque bytes (``BYTE_IO``) that its save planner
wrote with ``torch.save``, and its default load planner reads them back with
``torch.load(weights_only=False)``: a full unpickling, which runs whatever the
bytes say. Bytes that come back from dash-memd may have been on its disk and
in the bucket; whoever could write there must not be able to make a rank run
code. Here such a value is unpickled as ``torch.load(weights_only=True)``
does: plain data, tensors and the types ``torch.serialization.add_safe_globals``
allows are rebuilt, anything else is refused with one line whose hint names
the way out, ``allow_pickle=True``, for callers whose dash-memd and bucket are
trusted.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from dashrun.errors import UsageError

__all__ = ["PickleRefused", "SafeLoadPlanner", "load_weights_only"]

#: Where the hint of a refusal points: the ways to load the value anyway.
HINT = ("such values are loaded as torch.load(weights_only=True) does; allow the type with "
        "torch.serialization.add_safe_globals, or, where dash-memd and its bucket are trusted, pass "
        "dashrun.dcp.Reader(allow_pickle=True) (and SafeLoadPlanner(allow_pickle=True) if you use it)")


class PickleRefused(UsageError):
    """A value DCP pickled needs more than ``torch.load(weights_only=True)`` allows: it was not loaded, and
    nothing it names ran."""


def load_weights_only(value: io.BytesIO, what: str) -> Any:
    """The value ``torch.save`` wrote into ``value``, as ``torch.load(weights_only=True)`` loads it; raises
    PickleRefused, naming ``what``, for a value that needs a full unpickling."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph of advice; the sentence after "WeightsUnpickler error:" says what it refused.
        reason = str(e).partition("WeightsUnpickler error:")[2].split(". ")[0].strip() or "refused by torch.load"
        raise PickleRefused(f"{what} holds a value DCP pickled that is not plain data ({reason[:200]})",
                            hint=HINT) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, but a value DCP pickled is loaded as ``torch.load(weights_only=True)`` does.

    Tensors are read as DCP's planner reads them (no pickle is involved).
    A ``BYTE_IO`` value that needs a full unpickling is refused with
    :class:`PickleRefused` (one line; DCP raises it inside its
    ``CheckpointException``), and nothing it names runs. ``allow_pickle=True``
    gives DCP's own behaviour, ``torch.load(weights_only=False)``: only for a
    checkpoint from a source you trust.

    :class:`~dashrun.dcp.Reader` loads ``BYTE_IO`` values weights-only with
    any planner (also DCP's default, when ``dcp.load`` is given none), unless
    it was built with ``allow_pickle=True``; with this planner it leaves the
    loading to the planner, so a full unpickling needs both to allow it.
    The other arguments are ``DefaultLoadPlanner``'s.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False, *, allow_pickle: bool = False, **kwargs: Any):
        # By keyword: a subclass that also derives from _EmptyStateDictLoadPlanner takes ``keys`` first.
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load, **kwargs)
        self.allow_pickle = allow_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.allow_pickle:
            super().load_bytes(read_item, value)
            return
        loaded = load_weights_only(value, repr(read_item.dest_index.fqn))
        # As DefaultLoadPlanner.load_bytes puts it, its torch.load aside.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
