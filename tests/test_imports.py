"""dash-memd and dash-agent run on a bare VM without torch; only the rank side imports it."""

import subprocess
import sys

import pytest


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


def test_dashrun_never_imports_agent():
    code = ("import sys, dashrun, dashrun.launch.launcher, dashrun.rank.checkpointer, dashrun.memd.server; "
            "print(any(m == 'agent' or m.startswith('agent.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
