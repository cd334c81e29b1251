"""Write this rank's environment to OUT/env-rank<RANK>.json (for the launcher-parity tests)."""

import json
import os
import sys

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"env-rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
