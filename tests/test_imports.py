"""The layout's rules, checked: import boundaries between the processes, no cycles, small documented modules.

The static rules read every module under ``dashrun/`` and ``agent/`` (installed as
``dashrun.agent``) with :mod:`ast`, function-level imports included (only
``if TYPE_CHECKING:`` blocks, which never run, are left out). The runtime rules
import modules in a fresh interpreter and look at ``sys.modules``.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"dashrun": REPO / "dashrun", "dashrun.agent": REPO / "agent"}
MAX_LINES = 500
#: The house's width of a line of code.
MAX_WIDTH = 120


def _modules() -> dict[str, Path]:
    """Every module of the project by its dotted name (packages by their name, not ``.__init__``)."""
    out = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, [], child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.append((base, [alias.name for alias in child.names], child.lineno))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _edges(name: str) -> set[str]:
    """The project modules ``name`` imports: ``from pkg import mod`` counts as importing ``pkg.mod``."""
    out = set()
    for module, names, _ in _imports(name, MODULES[name]):
        if module not in MODULES:
            continue
        submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        out.update(submodules or [module])
        if len(submodules) < len(names):
            out.add(module)
    out.discard(name)
    return out


GRAPH = {name: _edges(name) for name in MODULES}


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_there_is_no_import_cycle():
    cycles = []
    for name in MODULES:
        if name in _reachable(name):
            path = [name]
            # one cycle through it, for the message: walk back along modules that reach it
            while True:
                nxt = next(m for m in sorted(GRAPH[path[-1]]) if m == name or name in _reachable(m))
                if nxt == name:
                    break
                path.append(nxt)
            cycles.append(" -> ".join(path + [name]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


#: The layout's rules, the one table of them: (package, the packages it must never reach, transitively, and
#: whether it imports torch). docs/architecture.md's "Layout" section shows the same table, checked below.
LAYOUT = [
    ("dashrun.rank", ("dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent"), True),
    ("dashrun.dcp", ("dashrun.launch", "dashrun.memd", "dashrun.agent"), True),
    ("dashrun.memd", ("dashrun.rank", "dashrun.dcp", "dashrun.launch", "dashrun.agent"), False),
    ("dashrun.memd.store", ("dashrun.memd.fleet",), False),
    ("dashrun.agent", ("dashrun.rank", "dashrun.dcp", "dashrun.launch", "dashrun.memd"), False),
    ("dashrun.launch", ("dashrun.memd", "dashrun.agent"), True),
    ("dashrun.ledger", ("dashrun.rank", "dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent"), False),
    ("dashrun.wire", ("dashrun.rank", "dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent"), False),
    ("dashrun.util", ("dashrun.rank", "dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent",
                      "dashrun.wire"), False),
    ("dashrun.data", ("dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent"), True),
    ("dashrun.integrations", ("dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent"), True),
    ("dashrun.errors", ("dashrun",), False),
    ("dashrun.env", ("dashrun.rank", "dashrun.dcp", "dashrun.launch", "dashrun.memd", "dashrun.agent",
                     "dashrun.wire"), False),
    ("dashrun.testing", (), False),
]
# Who may import whom, transitively: (these modules, must never reach these packages)
BOUNDARIES = [(source, forbidden) for source, forbidden, _ in LAYOUT if forbidden]
#: The packages that import torch (at any depth of their own modules); the others never do.
TORCH = {source.split(".")[1] for source, _, torch in LAYOUT if torch}


@pytest.mark.parametrize("source,forbidden", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_import_boundaries(source, forbidden):
    broken = {}
    for name in MODULES:
        if not _in(name, source):
            continue
        bad = sorted(m for m in _reachable(name) if _in(m, *forbidden) and not _in(m, source))
        if bad:
            broken[name] = bad
    assert not broken, f"{source} must not import {', '.join(forbidden)}: {broken}"


def test_only_the_harness_imports_the_harness():
    """dashrun.testing is for the tests and scripts: no product module imports it (it may import any)."""
    importers = sorted(name for name, edges in GRAPH.items()
                       if not _in(name, "dashrun.testing") and any(_in(m, "dashrun.testing") for m in edges))
    assert not importers


def _architecture_layout() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    return text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def test_the_architecture_doc_shows_the_layouts_rules():
    """docs/architecture.md's rules table is LAYOUT, row for row."""
    rows = re.findall(r"^\| `(dashrun[\w.]*)` \| (.*?) \| (yes|no) \|$", _architecture_layout(), re.M)
    shown = [(package, tuple(re.findall(r"`([\w.]+)`", forbidden)), torch == "yes") for package, forbidden, torch in rows]
    assert shown == LAYOUT


def test_the_architecture_doc_maps_every_installed_package():
    """Every package setup.cfg installs has its folder in the map (agent/ is installed as dashrun.agent)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    packages = config["options"]["packages"].split()
    tree = _architecture_layout().split("```", 2)[1]
    folders = set(re.findall(r"([a-z_]+)/", tree))
    missing = [p for p in packages if p != "dashrun" and p.rsplit(".", 1)[1] not in folders]
    assert not missing, missing
    assert "package_dir =\n    dashrun.agent = agent" in (REPO / "setup.cfg").read_text()
    assert "agent/     dash-agent, installed as dashrun.agent" in tree


def test_nothing_imports_the_agent_but_the_agent():
    importers = sorted(name for name, edges in GRAPH.items()
                       if not _in(name, "dashrun.agent") and any(_in(m, "dashrun.agent") for m in edges))
    assert not importers


def test_no_module_reaches_into_another_modules_private_names():
    reaches = []
    for name, path in MODULES.items():
        for module, names, line in _imports(name, path):
            if not _in(module, "dashrun") or module == name:
                continue
            for imported in names:
                # a private module (the C helper dashrun.util._ntcopy) is a module, not a helper
                private = imported.startswith("_") and not (imported.startswith("__") and imported.endswith("__"))
                if private and f"{module}.{imported}" not in MODULES and imported != "_ntcopy":
                    reaches.append(f"{path.relative_to(REPO)}:{line}: {module}.{imported}")
    assert not reaches, "\n".join(reaches)


def test_modules_are_small_documented_and_state_their_public_names():
    problems = []
    for name, path in MODULES.items():
        rel = path.relative_to(REPO)
        text = path.read_text().splitlines()
        lines = len(text)
        if lines > MAX_LINES:
            problems.append(f"{rel}: {lines} lines (at most {MAX_LINES})")
        problems += [f"{rel}:{i}: {len(line)} characters (at most {MAX_WIDTH})"
                     for i, line in enumerate(text, 1) if len(line) > MAX_WIDTH]
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        if not ast.get_docstring(tree):
            problems.append(f"{rel}: no module docstring")
        targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets] + [
            n.target for n in tree.body if isinstance(n, ast.AnnAssign)]
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            problems.append(f"{rel}: no __all__")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("modules", [
    "dashrun, dashrun.memd.cli, dashrun.memd.server, dashrun.wire.memd_client, dashrun.wire.protocol",
    "dashrun.agent.cli, dashrun.agent.service",
])
def test_daemons_do_not_import_torch(modules):
    code = f"import sys; import {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dashrun_package_import_is_lazy_about_the_checkpointer():
    code = ("import sys, dashrun; before = 'torch' in sys.modules; dashrun.Checkpointer; "
            "print(before, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


def test_no_command_and_no_import_of_dashrun_loads_a_training_framework():
    """Lightning and transformers are optional extras: only their own adapters in dashrun.integrations import them."""
    code = ("import sys, dashrun, dashrun.integrations, dashrun.launch.cli, dashrun.launch.launcher, "
            "dashrun.rank.checkpointer; dashrun.Checkpointer; dashrun.ElasticSampler; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    frameworks = {"dashrun.integrations.lightning": "lightning", "dashrun.integrations.hf": "transformers"}
    importers = {name: sorted({m.split(".")[0] for m, _, _ in _imports(name, path)} & {"lightning", "transformers"})
                 for name, path in MODULES.items()}
    assert {name: found for name, found in importers.items() if found} == {
        name: [framework] for name, framework in frameworks.items() if name in MODULES}


def test_dashrun_package_import_is_lazy_about_dcp():
    """``dashrun.dcp`` is reachable after a bare ``import dashrun``; torch.distributed.checkpoint loads only then."""
    code = ("import sys, dashrun; before = 'torch.distributed.checkpoint' in sys.modules; dashrun.dcp.Writer; "
            "print(before, 'torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


def test_a_launch_imports_neither_the_job_commands_nor_ssh():
    """The launcher's own imports stand between the command and the ranks' start: rich and click (the job
    commands, named in COMMANDS without importing them) and paramiko (a hostfile's fan-out) stay out."""
    from dashrun.launch import cli, commands

    assert cli.COMMANDS == frozenset(commands.cli.commands)
    code = ("import sys, dashrun.launch.cli, dashrun.launch.dispatch, dashrun.launch.launcher; "
            "print(sorted(m for m in ('rich', 'click', 'paramiko', 'dashrun.launch.commands', "
            "'dashrun.launch.fanout') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_dashrun_never_imports_agent_at_run_time():
    code = ("import sys, dashrun, dashrun.launch.cli, dashrun.launch.launcher, dashrun.launch.commands, "
            "dashrun.rank.checkpointer, dashrun.memd.server; "
            "print(any(m.startswith('dashrun.agent') or m == 'agent' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_agent_installs_inside_dashrun_not_as_a_top_level_package(tmp_path):
    """From outside the checkout (where the project root is not on sys.path), ``agent`` is nobody's package."""
    code = ("import importlib.util, dashrun.agent; print(importlib.util.find_spec('agent') is None, "
            "dashrun.agent.__name__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env=env)
    assert out.stdout.split() == ["True", "dashrun.agent"]


@pytest.mark.parametrize("command", [
    ["-m", "dashrun"], ["-m", "dashrun", "status"], ["-m", "dashrun.memd"], ["-m", "dashrun.agent"],
])
def test_every_command_tells_its_version(command, tmp_path):
    import dashrun

    out = subprocess.run([sys.executable, *command, "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == dashrun.__version__
    assert "version = attr: dashrun.version.__version__" in (REPO / "setup.cfg").read_text()


def _click_options(command, path=()):
    import click

    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            yield " ".join(path) or command.name, param
    for name, sub in getattr(command, "commands", {}).items():
        yield from _click_options(sub, (*path, name))


def test_every_option_of_the_three_commands_has_an_environment_twin_that_help_shows():
    """dash-memd and dash-agent (click), the job commands (click, DASH_<COMMAND>_<OPTION> where not named),
    and the launcher's own options (torchrun's parser, where torchrun's flags keep their PET_* twins)."""
    from dashrun import env
    from dashrun.agent.cli import cli as agent_cli
    from dashrun.launch.commands import cli as commands_cli
    from dashrun.launch.options import NAMES, build_parser
    from dashrun.memd.cli import cli as memd_cli

    assert commands_cli.context_settings.get("auto_envvar_prefix") == "DASH"
    missing = []
    for program, group, auto in (("dash-memd", memd_cli, False), ("dash-agent", agent_cli, False),
                                 ("dashrun", commands_cli, True)):
        for where, option in _click_options(group):
            named = isinstance(option.envvar, str) and option.envvar.startswith("DASH_")
            if not option.show_envvar or not (named or (auto and option.allow_from_autoenv)):
                missing.append(f"{program} {where} --{option.name.replace('_', '-')}")
    parser_help = " ".join(build_parser().format_help().split())
    own = [name for dest, name in NAMES.items() if isinstance(getattr(env, dest.upper(), None), env.Var)]
    assert len(own) >= 10  # the rest of NAMES are torchrun's, with their PET_* twins
    missing += [f"dashrun {name.strings[0]}" for name in own if f"env DASH_{name.dest.upper()}" not in parser_help]
    assert not missing, missing


def test_environment_twins_set_their_options(tmp_path, monkeypatch):
    """DASH_MEMORY_LIMIT (in the usual units) and DASH_MAX_CONNECTIONS reach dash-memd's config; DASH_GC_KEEP
    reaches ``dashrun gc``."""
    from click.testing import CliRunner

    from dashrun.launch.commands import cli as commands_cli
    from dashrun.memd import cli as memd_cli
    from dashrun.util.tokens import write_token

    write_token(tmp_path / "token")
    configs = []
    monkeypatch.setattr(memd_cli, "run", lambda config: configs.append(config) or 0)
    monkeypatch.setattr(memd_cli, "setup_logging", lambda *args: None)
    result = CliRunner().invoke(memd_cli.cli, ["start"], env={
        "DASH_DATA_DIR": str(tmp_path / "data"), "DASH_TOKEN_FILE": str(tmp_path / "token"),
        "DASH_MEMORY_LIMIT": "2GB", "DASH_MAX_CONNECTIONS": "7"})
    assert result.exit_code == 0, result.output
    assert (configs[0].memory_limit, configs[0].max_connections) == (2 * 10**9, 7)
    result = CliRunner().invoke(commands_cli, ["gc", "job-1"], env={"DASH_GC_KEEP": "0"})
    assert result.exit_code == 2 and "DASH_GC_KEEP" not in result.output and "0 is not in the range" in result.output


def test_numpy_installs_with_dashrun():
    """Without numpy torch warns "Failed to initialize NumPy" as it is imported: at the start of every dashrun
    command and every rank. So it is one of dashrun's own requirements, not only the tests'. Read from setup.cfg,
    not from the installed metadata, which a stale ``dashrun.egg-info`` in the checkout can stand in for."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    requirements = config["options"]["install_requires"].split()
    assert any(re.match(r"numpy\b", r) for r in requirements), requirements


def test_a_ranks_save_path_runs_without_numpy():
    """torch does not require numpy, and an environment installed without dashrun's requirements may lack it: a
    rank's notices and RNG capture must not need it."""
    code = """
import sys
sys.modules["numpy"] = None  # importing numpy fails, as where it is not installed
import torch
import torch.distributed as dist
from dashrun.rank.notices import NoticeBoard
from dashrun.rank.restore import restore_rng
from dashrun.rank.snapshot import capture_rng
try:
    torch.zeros(1).numpy()
    raise SystemExit("numpy is still there")
except RuntimeError:  # "Numpy is not available"
    pass
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
board = NoticeBoard(world=2, early_interval=5)
seen = []
for starved in (False, True, False, False):
    seen.append(board.agree().starved)  # what the previous save() published
    board.publish(starved=starved)
board.close()
assert seen == [False, False, True, False], seen
restore_rng(capture_rng())
dist.destroy_process_group()
print("ran without numpy")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0 and "ran without numpy" in result.stdout, result.stderr[-3000:]


#: torch itself, and the frameworks that import it (dashrun.integrations' adapters import those).
TORCH_FRAMEWORKS = ("torch", "lightning", "transformers", "accelerate")


def test_only_the_packages_the_layout_names_import_torch():
    """LAYOUT (and so docs/architecture.md): of the packages, only rank/, launch/, dcp/, data/ and integrations/
    import torch."""
    importers = {name.split(".")[1] for name, path in MODULES.items() if name.count(".") >= 1
                 and any(module.split(".")[0] in TORCH_FRAMEWORKS for module, _, _ in _imports(name, path))}
    assert importers == TORCH == {"rank", "launch", "dcp", "data", "integrations"}
