"""The docs are claims too: every relative link in README.md and docs/ resolves, and every option docs/usage.md
names is an option of dashrun, its commands, dash-memd or dash-agent."""

from __future__ import annotations

import re
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: An inline code span that starts with an option: `--memd HOST:PORT`, `--no-tls` ...
OPTION_SPAN = re.compile(r"`(--[a-z][a-z0-9-]*)")


def test_the_readme_is_the_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 160


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def _click_options(command: click.Command) -> set[str]:
    found = set()
    for param in command.params:
        found.update(o for o in param.opts + param.secondary_opts if o.startswith("--"))
    for sub in getattr(command, "commands", {}).values():
        found |= _click_options(sub)
    return found


def known_options() -> set[str]:
    from dashrun.agent.cli import cli as agent_cli
    from dashrun.launch.commands import cli as commands_cli
    from dashrun.launch.data_commands import data as data_cli
    from dashrun.launch.options import build_parser
    from dashrun.memd.cli import cli as memd_cli

    launcher = {o for action in build_parser()._actions for o in action.option_strings if o.startswith("--")}
    clis = (commands_cli, memd_cli, agent_cli, data_cli)
    return launcher.union(*(_click_options(c) for c in clis))


def test_every_option_docs_usage_names_exists():
    named = set(OPTION_SPAN.findall((REPO / "docs" / "usage.md").read_text()))
    assert len(named) >= 20  # the page does name the options
    unknown = sorted(named - known_options())
    assert not unknown, f"docs/usage.md names options that no command has: {unknown}"
