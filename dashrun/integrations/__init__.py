"""Adapters from training frameworks to :class:`dashrun.Checkpointer`: one small module per framework.

* :mod:`dashrun.integrations.lightning` — ``DashrunCheckpoint``, a Lightning ``Callback`` (extra
  ``dashrun[lightning]``).
* :mod:`dashrun.integrations.hf` — ``DashrunCallback``, a transformers ``TrainerCallback`` (extra ``dashrun[hf]``).

Each translates its framework's state (module, optimizers, schedulers, loop progress, data position) into the
Checkpointer's objects and back; the Checkpointer does the rest (RNG states, notices, SIGTERM, the transport).
Nothing here is imported by ``import dashrun``: each module imports its framework.
"""

from __future__ import annotations

__all__: list[str] = []
