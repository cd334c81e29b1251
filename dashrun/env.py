"""The contract between dashrun's processes: every ``DASH_*`` variable, the default port, the preemption record.

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
import json
import os

from dashrun.util.boundedjson import loads_bounded

__all__ = ["ALL", "DEFAULT_PEER_PORT", "DEFAULT_PORT", "PreemptionRecord", "Var", "get"]

#: The port dash-memd listens on and every client dials when an address names none.
DEFAULT_PORT = 7070
#: The port dash-agent listens on for the other agents of its job (the peer link).
DEFAULT_PEER_PORT = 7071


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    meaning: str
    set_by: str
    read_by: str


MEMD = Var("DASH_MEMD", "HOST:PORT of dash-memd", "user", "dashrun, dash-agent, ranks")
TOKEN_FILE = Var("DASH_TOKEN_FILE", "file holding the cluster's shared token", "user",
                 "dashrun, dash-agent, dash-memd, ranks")
JOB_ID = Var("DASH_JOB_ID", "the job's stable id; a relaunch with the same id resumes", "user, dashrun",
             "dashrun, ranks")
FRESH = Var("DASH_FRESH", "'1': delete the job's earlier checkpoints and start from step 0", "user", "dashrun")
AGENT_SOCKET = Var("DASH_AGENT_SOCKET", "path of this node's dash-agent Unix socket", "dashrun", "ranks, dash-agent")
CLOUD = Var("DASH_CLOUD", "where notices come from: auto, aws, gcp, azure, none", "user", "dashrun, dash-agent")
METADATA_ENDPOINT = Var("DASH_METADATA_ENDPOINT", "base URL of the cloud metadata service", "user",
                        "dashrun, dash-agent")
POLL_INTERVAL = Var("DASH_POLL_INTERVAL", "seconds between metadata polls", "user", "dashrun, dash-agent")
FAILURE_DOMAIN = Var("DASH_FAILURE_DOMAIN", "this node's failure domain, ZONE or ZONE/POOL, where replicas of other "
                     "nodes' state are placed apart from (default: the zone, instance type and market the cloud's "
                     "metadata service gives)", "user", "dashrun, dash-agent")
INSTANCE_TYPE = Var("DASH_INSTANCE_TYPE", "this node's instance type, for the job's cost ledger and its failure "
                    "domain's pool (default: the metadata service's)", "user", "dashrun, dash-agent")
MARKET = Var("DASH_MARKET", "this node's market, spot or on-demand (default: the metadata service's)", "user",
             "dashrun, dash-agent")
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
LOG_LEVEL = Var("DASH_LOG_LEVEL", "logging level: DEBUG, INFO, WARNING or ERROR (dashrun passes its own on to "
                "its dash-agent and private dash-memd)", "user, dashrun", "dashrun, dash-agent, dash-memd")
LOG_FORMAT = Var("DASH_LOG_FORMAT", "text, or json: one JSON object a line for log shippers", "user, dashrun",
                 "dashrun, dash-agent, dash-memd")
METRICS_LISTEN = Var("DASH_METRICS_LISTEN", "HOST:PORT dash-memd serves Prometheus /metrics on (a HOST left out: "
                     "loopback)", "user", "dash-memd")
AGENT_METRICS_LISTEN = Var("DASH_AGENT_METRICS_LISTEN", "HOST:PORT dash-agent serves Prometheus /metrics on (a "
                           "HOST left out: loopback); its own twin, so that a launcher's private dash-memd beside "
                           "it does not take the same port", "user", "dash-agent")
METRICS_TLS_CERT = Var("DASH_METRICS_TLS_CERT", "PEM certificate (chain, leaf first) /metrics is served over HTTPS "
                       "with", "user", "dash-memd, dash-agent")
METRICS_TLS_KEY = Var("DASH_METRICS_TLS_KEY", "the unencrypted PEM key of DASH_METRICS_TLS_CERT (default: in its "
                      "file)", "user", "dash-memd, dash-agent")
METRICS_TOKEN_FILE = Var("DASH_METRICS_TOKEN_FILE", "file with the bearer token a scrape of /metrics must show",
                         "user", "dash-memd, dash-agent")
MEMD_WAIT = Var("DASH_MEMD_WAIT", "seconds a launch waits for an unreachable dash-memd (it may be restarting)", "user",
                "dashrun")
MEMD_TIMEOUT = Var("DASH_MEMD_TIMEOUT", "seconds a request to dash-memd may stay silent", "user", "dash-agent")
DRAIN_TIMEOUT = Var("DASH_DRAIN_TIMEOUT", "seconds dash-agent gets to deliver handed-over shards when stopping", "user",
                    "dash-agent")
PARENT_PID = Var("DASH_PARENT_PID", "the launcher's pid: dash-agent (after draining) and the private dash-memd (after "
                 "its disk writes) exit once it is gone", "dashrun", "dash-agent, dash-memd")
AGENT_LISTEN_FD = Var("DASH_AGENT_LISTEN_FD", "descriptor of dash-agent's socket, made and handed on by dashrun",
                      "dashrun", "dash-agent")
UPLOAD_QUEUE = Var("DASH_UPLOAD_QUEUE", "uploads waiting at most; a full queue drops its oldest", "user", "dash-memd")
MAX_CONNECTIONS = Var("DASH_MAX_CONNECTIONS", "clients dash-memd serves at once", "user", "dash-memd")
MAX_UNAUTHENTICATED = Var("DASH_MAX_UNAUTHENTICATED", "connections to dash-memd still logging in, at once (apart from "
                          "DASH_MAX_CONNECTIONS); a new one beyond drops the oldest", "user", "dash-memd")
AUTH_TIMEOUT = Var("DASH_AUTH_TIMEOUT", "seconds a new connection to dash-memd has to authenticate", "user",
                   "dash-memd")
IDLE_TIMEOUT = Var("DASH_IDLE_TIMEOUT", "seconds an authenticated connection to dash-memd may stay silent", "user",
                   "dash-memd")
SHUTDOWN_TIMEOUT = Var("DASH_SHUTDOWN_TIMEOUT", "seconds dash-memd gets to finish disk writes on SIGTERM", "user",
                       "dash-memd")
READY_FILE = Var("DASH_READY_FILE", "file dash-memd writes HOST:PORT to once it listens", "dashrun, tests", "dash-memd")
TOKEN_OUT = Var("DASH_TOKEN_OUT", "where 'dash-memd token' writes a new token", "user", "dash-memd token")
NO_TLS = Var("DASH_NO_TLS", "'1': plaintext TCP to and at dash-memd instead of TLS (every end must say so): no "
             "encryption; the token login and each record's MAC still hold. Not sent on to the hosts of --hostfile: "
             "the fan-out gives them --no-tls on their command line", "user", "dashrun, dash-agent, dash-memd, ranks")
INSECURE_PLAINTEXT = Var("DASH_INSECURE_PLAINTEXT", "'1': let dash-memd --no-tls listen on an address beyond "
                         "loopback", "user", "dash-memd")
NO_PREFETCH = Var("DASH_NO_PREFETCH", "'1': dash-agent waits for a rank's restore() before fetching the job's "
                  "newest checkpoint", "user", "dash-agent")
TLS_CERT = Var("DASH_TLS_CERT", "dash-memd's TLS certificate, PEM (default: its own self-signed one, kept in its "
               "data dir)", "user", "dash-memd")
TLS_KEY = Var("DASH_TLS_KEY", "the key of --tls-cert, PEM (default: in the certificate's file)", "user", "dash-memd")
TLS_CA = Var("DASH_TLS_CA", "CA certificates to also verify dash-memd's certificate and host name with", "user",
             "dashrun, dash-agent, ranks")
TLS_FINGERPRINT = Var("DASH_TLS_FINGERPRINT", "SHA256:... of the only certificate dash-memd may show ('dash-memd "
                      "fingerprint' prints it); any other is refused before the login", "user, dashrun",
                      "dashrun, dash-agent, ranks")
AGENT_CPUS = Var("DASH_AGENT_CPUS", "CPUs for dash-agent, kept from the ranks: auto, none or a list like 6-7", "user",
                 "dashrun")
ELASTIC = Var("DASH_ELASTIC", "'1': the job's world may change; a rank whose node stays restarts at the new size "
              "instead of stopping", "dashrun", "ranks")
GENERATION = Var("DASH_GENERATION", "the world's generation (its rendezvous round): dash-memd refuses shards of an "
                 "older one", "dashrun", "ranks")
MEMBERSHIP = Var("DASH_MEMBERSHIP", "the job's nodes and world history, JSON (Checkpointer.membership)", "dashrun",
                 "ranks")
TERM_GRACE = Var("DASH_TERM_GRACE", "seconds a rank has, from SIGTERM, to commit its emergency checkpoint before "
                 "its launcher kills it (dashrun sets it from torchrun's --shutdown-timeout)", "dashrun", "ranks")
TOKEN_JOB = Var("DASH_TOKEN_JOB", "the job whose credential dash-memd token writes (from the cluster's token)",
                "user", "dash-memd")
KEYS_OUT = Var("DASH_KEYS_OUT", "where dash-memd keys writes the operator's private key (and .pub)", "user",
               "dash-memd")
WEAK_TOKEN_OK = Var("DASH_WEAK_TOKEN_OK", "'1': take a token that is not 64 random hex digits (with a warning)",
                    "user", "all")
OPERATOR_KEY = Var("DASH_OPERATOR_KEY", "the operator's Ed25519 private key (dash-memd keys): signs launch specs",
                   "user", "dashrun")
OPERATOR_PUBKEY = Var("DASH_OPERATOR_PUBKEY", "the operator's Ed25519 public key: dashrun resume runs only specs "
                      "it signed", "user", "dashrun resume")
PEER_PORT = Var("DASH_PEER_PORT", "TCP port dash-agent listens on for its job's other agents (0: any free port)",
                "user", "dash-agent")
PEER_MEMORY_LIMIT = Var("DASH_PEER_MEMORY_LIMIT", "bytes of shards dash-agent keeps in its own memory: its node's "
                        "snapshot and other nodes' replicas", "user", "dash-agent")
REPLICAS = Var("DASH_REPLICAS", "other nodes that hold a copy of each node's snapshot in their agent's memory", "user",
               "dash-agent")
NODE = Var("DASH_NODE", "this node's name among the job's nodes (default: its host name): unique per node",
           "user, tests", "dash-agent")
PEERS = Var("DASH_PEERS", "HOST:PORT of the agents this node's replicas go to, given by hand (tests)", "tests",
            "dash-agent")
DATA_CACHE = Var("DASH_DATA_CACHE", "the node's data set cache directory (default ~/.cache/dashrun/data), shared by "
                 "every job and rank of the node", "user, dashrun", "ranks, dash-agent, dashrun data")
DATA_CACHE_LIMIT = Var("DASH_DATA_CACHE_LIMIT", "bytes the data cache may hold (default: what it holds plus the file "
                       "system's free space, less a tenth of it); least recently used objects are evicted",
                       "user, dashrun", "ranks, dash-agent, dashrun data")
MEMD_DATA_CACHE = Var("DASH_MEMD_DATA_CACHE", "dash-memd's own data set cache directory, which fills from what the "
                      "nodes cache and serves nodes whose cache is empty (dash-memd start --data-cache)", "user",
                      "dash-memd")
MEMD_DATA_CACHE_LIMIT = Var("DASH_MEMD_DATA_CACHE_LIMIT", "bytes dash-memd's data cache may hold", "user",
                            "dash-memd")
CRASH_AT = Var("DASH_CRASH_AT", "crash points armed for fault-injection tests (see dashrun.util.faults)", "tests",
               "all")

ALL: tuple[Var, ...] = (
    MEMD, TOKEN_FILE, JOB_ID, FRESH, CLOUD, METADATA_ENDPOINT, POLL_INTERVAL, FAILURE_DOMAIN, INSTANCE_TYPE, MARKET,
    AGENT_SOCKET, LISTEN, DATA_DIR, MEMORY_LIMIT, KEEP_RAM, KEEP_DISK, S3, KEEP_OBJECT, HOSTFILE, SSH_CONFIG,
    REMOTE_PYTHON, LOG_LEVEL, LOG_FORMAT,
    METRICS_LISTEN, AGENT_METRICS_LISTEN, METRICS_TLS_CERT, METRICS_TLS_KEY, METRICS_TOKEN_FILE, MEMD_WAIT,
    MEMD_TIMEOUT, DRAIN_TIMEOUT, PARENT_PID, AGENT_LISTEN_FD, UPLOAD_QUEUE, MAX_CONNECTIONS, MAX_UNAUTHENTICATED,
    AUTH_TIMEOUT, IDLE_TIMEOUT, SHUTDOWN_TIMEOUT, READY_FILE, TOKEN_OUT, NO_TLS, NO_PREFETCH, TLS_CERT, TLS_KEY,
    TLS_CA, AGENT_CPUS, TLS_FINGERPRINT, INSECURE_PLAINTEXT, ELASTIC, GENERATION, MEMBERSHIP, TERM_GRACE, TOKEN_JOB,
    KEYS_OUT, WEAK_TOKEN_OK, OPERATOR_KEY, OPERATOR_PUBKEY, PEER_PORT, PEER_MEMORY_LIMIT, REPLICAS, NODE, PEERS,
    DATA_CACHE, DATA_CACHE_LIMIT, MEMD_DATA_CACHE, MEMD_DATA_CACHE_LIMIT, CRASH_AT,
)


def get(var: Var, default: str | None = None) -> str | None:
    value = os.environ.get(var.name)
    return value if value not in (None, "") else default


@dataclasses.dataclass(frozen=True)
class PreemptionRecord:
    """dash-agent's record that its node must stop, which the launcher beside it watches.

    Written once, atomically, as ``FILE`` beside the agent's socket (the
    directory of ``DASH_AGENT_SOCKET``). ``reason`` is ``"notice"`` (this
    node's cloud served an interruption notice: ``cloud``, ``kind`` and the
    ``deadline`` in epoch seconds, None when unknown) or ``"job"`` (a rank of
    this node took the job's emergency checkpoint of ``step``).
    """

    FILE = "preempted.json"
    NOTICE, JOB = "notice", "job"

    reason: str
    cloud: str = ""
    kind: str = ""
    deadline: float | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.reason not in (self.NOTICE, self.JOB):
            raise ValueError(f"unknown preemption reason {self.reason!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> PreemptionRecord:
        """Raises ValueError for anything that is not a record this version wrote."""
        raw = loads_bounded(text)
        if not isinstance(raw, dict):
            raise ValueError("a preemption record is a JSON object")
        deadline, step = raw.get("deadline"), raw.get("step")
        if (not isinstance(raw.get("cloud", ""), str) or not isinstance(raw.get("kind", ""), str)
                or not (deadline is None or type(deadline) in (int, float))
                or not (step is None or type(step) is int)):
            raise ValueError("malformed preemption record")
        return cls(reason=raw.get("reason"), cloud=raw.get("cloud", ""), kind=raw.get("kind", ""),
                   deadline=None if deadline is None else float(deadline), step=step)
