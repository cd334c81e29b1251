"""The environment contract between dashrun's processes, in one table.

``dashrun`` (the launcher) sets these for its ranks and its ``dash-agent``;
the command-line options of ``dashrun``, ``dash-agent`` and ``dash-memd`` read
the same names as their environment twins (precedence: default < env < flag).
torch's own variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ...) keep
torchrun's meaning and are not repeated here; note that ``RANK`` is NOT stable
across elastic restarts, so nothing dashrun stores is keyed by a rank's
identity beyond one checkpoint.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    meaning: str
    set_by: str
    read_by: str


MEMD = Var("DASH_MEMD", "HOST:PORT of dash-memd", "user", "dashrun, dash-agent")
TOKEN_FILE = Var("DASH_TOKEN_FILE", "file holding the cluster's shared token", "user", "dashrun, dash-agent, dash-memd")
JOB_ID = Var("DASH_JOB_ID", "the job's stable id; a relaunch with the same id resumes", "user, dashrun",
             "dashrun, ranks")
FRESH = Var("DASH_FRESH", "'1': delete the job's earlier checkpoints and start from step 0", "user", "dashrun")
AGENT_SOCKET = Var("DASH_AGENT_SOCKET", "path of this node's dash-agent Unix socket", "dashrun", "ranks, dash-agent")
CLOUD = Var("DASH_CLOUD", "where notices come from: auto, aws, gcp, azure, none", "user", "dashrun, dash-agent")
METADATA_ENDPOINT = Var("DASH_METADATA_ENDPOINT", "base URL of the cloud metadata service", "user",
                        "dashrun, dash-agent")
POLL_INTERVAL = Var("DASH_POLL_INTERVAL", "seconds between metadata polls", "user", "dashrun, dash-agent")
LISTEN = Var("DASH_LISTEN", "HOST:PORT dash-memd listens on", "user", "dash-memd")
DATA_DIR = Var("DASH_DATA_DIR", "dash-memd's disk tier directory", "user", "dash-memd")
MEMORY_LIMIT = Var("DASH_MEMORY_LIMIT", "bytes of checkpoint data dash-memd may hold in RAM", "user", "dash-memd")
KEEP_RAM = Var("DASH_KEEP_RAM", "committed checkpoints per job kept in RAM", "user", "dash-memd")
KEEP_DISK = Var("DASH_KEEP_DISK", "committed checkpoints per job kept on disk", "user", "dash-memd")
S3 = Var("DASH_S3", "s3://bucket/prefix: dash-memd's object tier (credentials: the AWS chain)", "user", "dash-memd")
KEEP_OBJECT = Var("DASH_KEEP_OBJECT", "committed checkpoints per job kept in the object store", "user", "dash-memd")
HOSTFILE = Var("DASH_HOSTFILE", "hostfile ('HOST slots=N' per line): start dashrun on each host over SSH", "user",
               "dashrun")
SSH_CONFIG = Var("DASH_SSH_CONFIG", "OpenSSH client config for --hostfile (default ~/.ssh/config)", "user", "dashrun")
REMOTE_PYTHON = Var("DASH_REMOTE_PYTHON", "Python that runs dashrun on the hosts of --hostfile", "user", "dashrun")
CRASH_AT = Var("DASH_CRASH_AT", "crash points armed for fault-injection tests (see dashrun.faults)", "tests", "all")

ALL: tuple[Var, ...] = (
    MEMD, TOKEN_FILE, JOB_ID, FRESH, CLOUD, METADATA_ENDPOINT, POLL_INTERVAL, AGENT_SOCKET, LISTEN, DATA_DIR,
    MEMORY_LIMIT, KEEP_RAM, KEEP_DISK, S3, KEEP_OBJECT, HOSTFILE, SSH_CONFIG, REMOTE_PYTHON, CRASH_AT,
)


def get(var: Var, default: str | None = None) -> str | None:
    value = os.environ.get(var.name)
    return value if value not in (None, "") else default
