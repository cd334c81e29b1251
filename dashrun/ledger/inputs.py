"""The files ``dashrun sim`` and ``dashrun report`` read: a preemption trace, an hourly hazard table, a price
table. Each is small CSV, bounded as it is read; a mistake in one is a usage error that names its line."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from dashrun.errors import UsageError
from dashrun.ledger.sim import JOIN_EVENTS, KILL_EVENTS, MAX_HAZARD_HOURS, NOTICE_EVENTS, TraceEvent

__all__ = ["MARKETS", "MAX_TRACE_EVENTS", "read_hazard", "read_prices", "read_trace"]

#: Rows read from a trace at most.
MAX_TRACE_EVENTS = 1_000_000
#: Rows of a price table at most.
MAX_PRICES = 100_000
#: The markets a price is for.
MARKETS = ("spot", "on-demand")
_MAX_NAME = 255


def _rows(path: Path, what: str, limit: int) -> list[list[str]]:
    try:
        if path.stat().st_size > 64 * limit:
            raise UsageError(f"{what} {path} is too large (more than {limit} rows)")
        text = path.read_text()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not text") from None
    rows = [row for row in csv.reader(io.StringIO(text)) if row and not row[0].lstrip().startswith("#")]
    if len(rows) > limit:
        raise UsageError(f"{what} {path} has more than {limit} rows")
    return rows


def read_trace(path: Path) -> tuple[TraceEvent, ...]:
    """A trace: CSV ``time,node,event`` (a header line allowed), events ``killed``/``died``/``preempted`` (gone,
    no notice), ``notice``/``left`` (gone after a notice: an emergency checkpoint), ``joined``; sorted by time."""
    events = []
    for number, row in enumerate(_rows(path, "trace", MAX_TRACE_EVENTS), 1):
        if number == 1 and row[0].strip().lower() == "time":
            continue
        if len(row) != 3:
            raise UsageError(f"{path} line {number}: expected time,node,event")
        when, node, event = (cell.strip() for cell in row)
        try:
            seconds = float(when)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < math.inf:
            raise UsageError(f"{path} line {number}: time {when!r} is not seconds from the start")
        if not node or len(node) > _MAX_NAME or not node.isprintable():
            raise UsageError(f"{path} line {number}: the node must be a name of 1 to {_MAX_NAME} characters")
        if event not in NOTICE_EVENTS | KILL_EVENTS | JOIN_EVENTS:
            raise UsageError(f"{path} line {number}: event {event!r} is not joined, notice or killed")
        events.append(TraceEvent(seconds, node, event))
    if not events:
        raise UsageError(f"trace {path} has no events")
    return tuple(sorted(events, key=lambda e: e.time))


def read_hazard(path: Path) -> tuple[float, ...]:
    """An hourly hazard table: CSV ``hour,probability`` (a header line allowed), hours 0, 1, 2, ... in order: the
    probability that a node alive at the start of that hour of its life is taken within it."""
    table = []
    for number, row in enumerate(_rows(path, "hazard table", MAX_HAZARD_HOURS), 1):
        if number == 1 and row[0].strip().lower() == "hour":
            continue
        try:
            hour, p = int(row[0]), float(row[1])
        except (ValueError, IndexError):
            raise UsageError(f"{path} line {number}: expected hour,probability") from None
        if hour != len(table) or not 0 <= p <= 1:
            raise UsageError(f"{path} line {number}: hours count up from 0, each with a probability from 0 to 1")
        table.append(p)
    if not table:
        raise UsageError(f"hazard table {path} has no hours")
    return tuple(table)


def read_prices(path: Path) -> dict[tuple[str, str], float]:
    """A price table: CSV ``instance_type,market,usd_per_hour`` (a header line allowed), market ``spot`` or
    ``on-demand``: {(instance type, market): USD per node-hour}."""
    prices: dict[tuple[str, str], float] = {}
    for number, row in enumerate(_rows(path, "price file", MAX_PRICES), 1):
        if number == 1 and row[0].strip().lower() == "instance_type":
            continue
        if len(row) != 3:
            raise UsageError(f"{path} line {number}: expected instance_type,market,usd_per_hour")
        kind, market, usd = (cell.strip() for cell in row)
        try:
            price = float(usd)
        except ValueError:
            price = -1.0
        if not kind or len(kind) > _MAX_NAME or not kind.isprintable():
            raise UsageError(f"{path} line {number}: the instance type must be a name of 1 to {_MAX_NAME} characters")
        if market not in MARKETS:
            raise UsageError(f"{path} line {number}: market {market!r} is not spot or on-demand")
        if not 0 <= price < math.inf:
            raise UsageError(f"{path} line {number}: {usd!r} is not USD per hour")
        prices[(kind, market)] = price
    if not prices:
        raise UsageError(f"price file {path} has no prices")
    return prices
