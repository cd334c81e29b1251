"""A rank that reports itself and holds still: writes OUT/rank<RANK>.json ({"pid": ...}) atomically, then
waits (polling, at most 120 s) until OUT/release exists, so a test can look at the live processes."""

import json
import os
import sys
import time

out = sys.argv[1]
report = os.path.join(out, f"rank{os.environ['RANK']}.json")
with open(report + ".tmp", "w") as f:
    json.dump({"pid": os.getpid()}, f)
os.replace(report + ".tmp", report)
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
    time.sleep(0.02)
