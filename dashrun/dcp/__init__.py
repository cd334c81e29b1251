"""dash-memd as storage for ``torch.distributed.checkpoint``: :class:`Writer` and :class:`Reader`.

Code that already calls ``dcp.save``, ``dcp.async_save`` or ``dcp.load``
(torchtitan, Lightning's FSDP strategy, plain scripts) gets dash-memd's tiers
by passing one object::

    dcp.save(state, checkpoint_id=step, storage_writer=dashrun.dcp.Writer())
    dcp.load(state, checkpoint_id=step, storage_reader=dashrun.dcp.Reader())

A checkpoint written through :class:`Writer` is an ordinary dashrun
checkpoint of a job and a step: every rank of DCP's process group sends one
shard, dash-memd commits the step once every shard arrived and verified, and it
is listed, retained and exported like any other. Its shards hold no
replicated part (``rep_total`` 0): each rank's write items' bytes are its
private part, one after the other, and its layout description (JSON, never a
pickle) lists them under ``"dcp"``. Rank 0's description also carries DCP's
global ``Metadata`` as JSON: each key's tensor properties, size and chunks (or
that it is opaque bytes, which DCP serialised itself), the planner's data, and
where each item's bytes are (rank, offset, length). DCP calls ``finish`` on
its coordinator only after every rank's ``write_data``, so the other ranks send
their shards from ``write_data`` and the coordinator sends its own, with the
metadata, from ``finish``: ``dcp.save`` returns once the step is committed.

:class:`Reader` builds DCP's ``Metadata`` from rank 0's description of a
committed step and reads each item as byte ranges of the shard that holds it:
only the bytes of the slices this rank's planner asks for, never the whole
checkpoint. Every offset and length read from a description is checked against
the shard's announced sizes before it is used. A value DCP pickled (anything
not a tensor) is loaded as ``torch.load(weights_only=True)`` does, with any
planner, DCP's default too: bytes dash-memd serves may come from its bucket,
and never run code on a rank. :class:`SafeLoadPlanner` is DCP's default
planner doing the same; ``allow_pickle=True`` (of the Reader, and of the
planner if it is used) is the opt-in to a full unpickling.

Transport: :class:`Writer` hands its shard to the node's dash-agent through a
shared-memory segment when it runs under dashrun (``DASH_AGENT_SOCKET``), and
otherwise connects to dash-memd itself (``memd=``/``token_file=``, or
``DASH_MEMD``/``DASH_TOKEN_FILE``, with ``DASH_NO_TLS``/``DASH_TLS_CA``).
:class:`Reader` reads DCP's metadata from dash-memd, and the items' byte
ranges through the node's dash-agent under dashrun (one request for all of
a load's ranges, which the agent reads over several streams into the node's
image, as a restore's pieces), else from dash-memd itself. dashrun sets
those variables for its ranks, so under dashrun neither needs an argument. Connections are
made on first use and never pickled: DCP's process based ``async_save``
pickles the writer into its checkpointing process.

The package: :mod:`~dashrun.dcp.target` (job, step, the way to dash-memd),
:mod:`~dashrun.dcp.metadata` (DCP's Metadata as bounded JSON),
:mod:`~dashrun.dcp.writer`, :mod:`~dashrun.dcp.reader` and :mod:`~dashrun.dcp.planner` (weights-only
loading of what DCP pickled).
"""

from __future__ import annotations

from dashrun.dcp.metadata import FORMAT
from dashrun.dcp.planner import PickleRefused, SafeLoadPlanner
from dashrun.dcp.reader import Reader, describe_dcp, full_state
from dashrun.dcp.target import step_of
from dashrun.dcp.writer import Writer

__all__ = ["FORMAT", "PickleRefused", "Reader", "SafeLoadPlanner", "Writer", "describe_dcp", "full_state", "step_of"]
