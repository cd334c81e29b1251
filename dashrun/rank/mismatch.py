"""A checkpoint that does not fit the script: torch's errors for it, as one :class:`RestoreMismatchError` line.

A job id names the run that saved under it, and a derived id is the script's
path and arguments, not its contents: a script whose model changed, relaunched
the same way, resumes the earlier run's checkpoint. ``load_state_dict()`` then
fails on every rank with a line per differing tensor. :func:`must_fit` turns
that failure into one line that names the job, the object, the first
difference and the way out (``--fresh`` or a new ``--job-id``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import torch

from dashrun.errors import RestoreMismatchError

__all__ = ["difference", "mismatch_hint", "must_fit"]

#: torch's line for a parameter of another shape (``nn.Module.load_state_dict``), the shapes in brackets.
_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                            r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
#: Characters of one difference shown at most (a list of missing keys can name every parameter).
DIFFERENCE_CHARS = 200


def mismatch_hint(job_id: str) -> str:
    return (f"to train this script anew, pass --fresh, which deletes job {job_id}'s checkpoints, or a new --job-id, "
            "which keeps them")


@contextlib.contextmanager
def must_fit(job_id: str, step: int, name: str, obj: Any) -> Iterator[None]:
    """A ``load_state_dict()`` of ``name`` in the block that finds other shapes or keys than the checkpoint's
    raises :class:`RestoreMismatchError` (its cause: torch's error); any other error passes as it is."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError) as e:
        found = difference(e, obj)
        if found is None:
            raise
        raise RestoreMismatchError(f"job {job_id}'s checkpoint of step {step} does not fit this run's {name}=: "
                                   f"{found}", hint=mismatch_hint(job_id)) from e


def difference(e: BaseException, obj: Any) -> str | None:
    """The first difference between a checkpoint and ``obj`` that ``e`` reports, as one line, with how many more
    there are; None when ``e`` says something else.

    ``nn.Module.load_state_dict`` raises RuntimeError("Error(s) in loading state_dict for ...") with one tab-led
    line per difference (missing keys, unexpected keys, each size mismatch); an optimizer raises ValueError for
    parameter groups of other sizes; a KeyError from a ``load_state_dict()`` is a key the saved state lacks.
    """
    if isinstance(e, RuntimeError) and str(e).startswith("Error(s) in loading state_dict"):
        found = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        if not found:
            return None
        size = _SIZE_MISMATCH.match(found[0])
        first = f"{size[1]} is {size[2]} in the checkpoint, {size[3]} here" if size else found[0].rstrip(". ")
    elif isinstance(e, ValueError) and isinstance(obj, torch.optim.Optimizer):
        found, first = [e], str(e)
    elif isinstance(e, KeyError):
        found, first = [e], f"the saved state has no key {e}"
    else:
        return None
    first = " ".join(first.split())
    if len(first) > DIFFERENCE_CHARS:
        first = first[:DIFFERENCE_CHARS - 3] + "..."
    more = len(found) - 1
    return first + (f", and {more} more difference{'s' if more > 1 else ''}" if more else "")
