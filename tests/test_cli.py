"""The command line imports a command's module only when that command runs, so the answers that
need no model (`pocketllm --help`, `pocketllm policy`) start without torch; and a launcher that
starts ranks checks the run and starts them without torch (its ranks import it), so they start
sooner: every launched run of the suite asserts that (tests/conftest.py, CLI_ENTRY)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs the CLI in a fresh interpreter and fails if torch got imported along the way.
PROBE = """
import sys
from pocketllm.cli import main
try:
    code = main({argv!r})
except SystemExit as exit:
    code = exit.code
assert code == 0, code
assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["policy", "--rows", "512,4096"], ["policy", "--rows", "4096", "--pin-slices", "2"], ["generate", "--help"], ["serve", "--help"]],
)
def test_answers_that_need_no_model_do_not_import_torch(argv):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_version_is_the_packages():
    from pocketllm import __version__

    done = subprocess.run([sys.executable, "-m", "pocketllm", "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"pocketllm {__version__}\n"), done.stderr


def test_ctrl_c_while_the_command_line_is_read_is_an_interrupt_not_a_traceback(monkeypatch, capsys):
    # Reading it imports the command's module and torch, a second or more: a Ctrl-C lands there.
    from conftest import main_in_process

    from pocketllm import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main_in_process("make-checkpoint", "--preset", "tiny", "--out", "x") == 130
    assert capsys.readouterr().err == "pocketllm: interrupted\n"


def test_a_command_still_gets_its_own_flags():
    done = subprocess.run([sys.executable, "-m", "pocketllm", "policy", "--rows", "4096", "--pin-slices", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rows=4096 slices=2"
