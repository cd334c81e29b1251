"""The schedulers' examples (examples/kubernetes, examples/skypilot, examples/slurm) are claims too: they parse,
name only options that dashrun and dash-memd have, treat exit 75 as "run it again", give the ranks their grace,
and are shown verbatim by their pages in docs/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from test_docs import known_options

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
#: What the grace must cover beyond --shutdown-timeout: dash-agent's hand-over and dashrun's report (schedulers.md).
HAND_OVER = 15


def documents(path: Path) -> dict[str, dict]:
    """The YAML file's documents by kind (Kubernetes) or the one document (SkyPilot) as {"task": ...}."""
    loaded = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {d.get("kind", "task"): d for d in loaded}


def command_options(argv: list[str], program: str) -> dict[str, str | None]:
    """The options ``program`` is given in ``argv`` (a command line), up to the training script: {option: value}."""
    start = argv.index(program) + 1
    options: dict[str, str | None] = {}
    i = start
    while i < len(argv) and not argv[i].endswith(".py"):
        word = argv[i]
        if word.startswith("--"):
            name, _, value = word.partition("=")
            following = argv[i + 1] if i + 1 < len(argv) else None
            if not value and following is not None and not following.startswith("--") \
                    and not following.endswith(".py"):
                value, i = following, i + 1
            options[name] = value or None
        i += 1
    return options


def shell_argv(script: str, program: str) -> list[str]:
    """The words of the line of ``script`` (continuations joined) that runs ``program``."""
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.strip().startswith(program))
    return shlex.split(line.split(" &")[0])


def memd_start_options() -> set[str]:
    from dashrun.memd.cli import cli

    return {o for p in cli.commands["start"].params for o in p.opts + p.secondary_opts if o.startswith("--")}


def test_the_kubernetes_job_ignores_exit_75_and_covers_the_ranks_grace():
    job = documents(EXAMPLES / "kubernetes" / "job.yaml")["Job"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = spec["podFailurePolicy"]["rules"]
    exit_rules = [r for r in rules if "onExitCodes" in r]
    assert [(r["action"], r["onExitCodes"]["operator"], r["onExitCodes"]["values"]) for r in exit_rules] == [
        ("Ignore", "In", [75])]
    container = next(c for c in pod["containers"] if c["name"] == exit_rules[0]["onExitCodes"]["containerName"])
    options = command_options(container["command"], "dashrun")
    assert container["command"][0] == "dashrun"  # the exec form: SIGTERM reaches dashrun itself
    assert pod["terminationGracePeriodSeconds"] >= int(options["--shutdown-timeout"]) + HAND_OVER
    assert any(r["action"] == "Ignore" and r.get("onPodConditions") == [{"type": "DisruptionTarget"}] for r in rules)

    unknown = sorted(set(options) - known_options())
    assert not unknown, f"examples/kubernetes/job.yaml gives dashrun options it does not have: {unknown}"


def test_dash_memd_runs_off_spot_behind_the_service_the_job_names():
    memd = documents(EXAMPLES / "kubernetes" / "memd.yaml")
    deployment, service = memd["Deployment"], memd["Service"]
    pod = deployment["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert any(e["operator"] == "NotIn" and "SPOT" in [v.upper() for v in e["values"]]
               for t in terms for e in t["matchExpressions"])
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    command = pod["containers"][0]["command"]
    assert command[:2] == ["dash-memd", "start"]
    options = command_options(command, "start")
    unknown = sorted(set(options) - memd_start_options())
    assert not unknown, f"examples/kubernetes/memd.yaml gives dash-memd start options it does not have: {unknown}"
    port = int(options["--listen"].rsplit(":", 1)[1])
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == port

    job = documents(EXAMPLES / "kubernetes" / "job.yaml")["Job"]
    train = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command_options(train, "dashrun")["--memd"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"


def test_the_skypilot_job_recovers_on_exit_75_and_names_only_existing_options():
    task = documents(EXAMPLES / "skypilot" / "train.yaml")["task"]
    resources = task["resources"]
    assert resources["use_spot"] is True
    recovery = resources["job_recovery"]
    assert set(recovery) <= {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}
    assert recovery["recover_on_exit_codes"] == [75]
    options = command_options(shell_argv(task["run"], "dashrun"), "dashrun")
    unknown = sorted(set(options) - known_options())
    assert not unknown, f"examples/skypilot/train.yaml gives dashrun options it does not have: {unknown}"
    assert options["--cloud"] == "auto"  # dash-agent watches the cloud's notice; SkyPilot's controller does not

    memd = documents(EXAMPLES / "skypilot" / "memd.yaml")["task"]
    assert memd["resources"]["use_spot"] is False
    start = shell_argv(memd["run"], "dash-memd")
    unknown = sorted(set(command_options(start, "start")) - memd_start_options())
    assert not unknown, f"examples/skypilot/memd.yaml gives dash-memd start options it does not have: {unknown}"


def test_the_slurm_script_names_only_existing_options_and_requeues_on_75():
    script = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH (--[a-z-]+)(?:=(\S+))?$", script, re.M))
    assert directives["--signal"].startswith("B:TERM@") and "--requeue" in directives
    options = command_options(shell_argv(script, "dashrun"), "dashrun")
    unknown = sorted(set(options) - known_options())
    assert not unknown, f"examples/slurm/train.sbatch gives dashrun options it does not have: {unknown}"
    lead = int(directives["--signal"].split("@")[1])
    assert lead >= int(options["--shutdown-timeout"]) + HAND_OVER
    assert re.search(r'if \[ "\$code" -eq 75 \]; then\n\s+scontrol requeue "\$SLURM_JOB_ID"', script)


@pytest.mark.parametrize("page, files", [
    ("kubernetes.md", ["kubernetes/job.yaml", "kubernetes/memd.yaml"]),
    ("skypilot.md", ["skypilot/train.yaml", "skypilot/memd.yaml"]),
    ("slurm.md", ["slurm/train.sbatch"]),
])
def test_each_page_shows_its_examples_verbatim(page, files):
    text = (REPO / "docs" / page).read_text()
    for name in files:
        assert (EXAMPLES / name).read_text() in text, f"docs/{page} does not show examples/{name} as it is"
