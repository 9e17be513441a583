"""No service's command line echoes a value in its errors (issue 27 security review): argparse took
``--api=SECRET`` as an abbreviation and printed "ambiguous option: --api=SECRET could match ...",
and printed "unrecognized arguments: --api-kye SECRET" for a typo -- a secret given to a mistyped
flag went to the terminal, a CI log or a supervisor's journal.  Every parser that takes a secret
(gateway, workers, pdctl with its sub-commands, the local launcher) is a ``FlagParser``."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from common.cluster.flags import EnvFlags, FlagParser, module_prog

pytestmark = pytest.mark.slow(seconds=5)  # a long file: scheduled by its length (tests/conftest.py)

SECRET = "Sup3rSecretValue-0123456789abcdef"


def gateway_parser():
    from gateway.config import build_parser
    return build_parser({})


def worker_parser():
    from worker.config import build_parser
    return build_parser("decode", "pdserve worker", {})


def pdctl_parser():
    from pdctl.cli import build_parser
    return build_parser()


MISTAKES = {
    "an abbreviation with its value": ["--api=" + SECRET],           # --api-key, --api-keys-file
    "an abbreviation, value apart": ["--api", SECRET],
    "a typo, value apart": ["--api-kye", SECRET],
    "a typo with its value": ["--api-kye=" + SECRET],
    "a stray value": ["--port", "8000", SECRET],
    "a value no number": ["--port", SECRET],
    "a value no choice": ["--routing-policy", SECRET],
    "a switch given a value": ["--allow-no-api-key=" + SECRET],
}


def error_of(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2
    out = capsys.readouterr()
    return out.out + out.err


@pytest.mark.parametrize("how", MISTAKES)
def test_the_gateway_names_the_flag_never_the_value(how, capsys):
    error = error_of(gateway_parser(), MISTAKES[how], capsys)
    assert SECRET not in error and "error:" in error, error
    flag = MISTAKES[how][0].partition("=")[0]
    assert flag in error, error


@pytest.mark.parametrize("argv", [["--admin=" + SECRET], ["--admin-tokn", SECRET], ["--role", SECRET],
                                  ["--kv-transport=" + SECRET], ["--model", "m", SECRET]])
def test_a_worker_names_the_flag_never_the_value(argv, capsys):
    error = error_of(worker_parser(), argv, capsys)
    assert SECRET not in error and "error:" in error, error


@pytest.mark.parametrize("argv", [["--admin=" + SECRET, "status"], ["--admin-tokn", SECRET, "status"],
                                  ["status", "--json=" + SECRET], ["metrics-proxy", "--metrics=" + SECRET],
                                  ["metrics-proxy", "--metrics-tokn", SECRET], ["drain", "d0", SECRET],
                                  ["set-role", "d0", SECRET]])
def test_pdctl_and_its_commands_name_the_flag_never_the_value(argv, capsys):
    error = error_of(pdctl_parser(), argv, capsys)
    assert SECRET not in error and "error:" in error, error


def test_the_launcher_names_the_flag_never_the_value():
    for argv in (["--pre=" + SECRET], ["--prefil", SECRET], ["--prefill", SECRET]):
        done = subprocess.run([sys.executable, "-m", "launcher", *argv], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and SECRET not in done.stdout + done.stderr, done.stderr
        assert "--pre" in done.stderr
        assert done.stderr.startswith("usage: python -m launcher "), done.stderr  # not "__main__.py"


def test_errors_still_say_what_is_wrong_and_full_names_still_parse(capsys):
    error = error_of(gateway_parser(), ["--api-kye=" + SECRET, "--max-inflite", "3", "x"], capsys)
    assert ("unrecognized arguments: --api-kye=(value not shown) --max-inflite and 2 values (not shown)"
            in error), error
    error = error_of(gateway_parser(), ["--routing-policy", SECRET], capsys)
    assert "argument --routing-policy: invalid choice: (value not shown) (choose from" in error, error
    args = gateway_parser().parse_args(["--api-key", SECRET, "--port=8001", "--routing-policy", "round_robin"])
    assert (args.api_key, args.port) == (SECRET, 8001)


def test_a_secret_flag_needs_a_flag_parser():
    with pytest.raises(TypeError, match="FlagParser"):
        EnvFlags(argparse.ArgumentParser(), {}).add_secret("--token", "a token")
    EnvFlags(FlagParser(), {}).add_secret("--token", "a token")


def test_a_package_run_with_python_m_is_named_so_in_its_usage():
    assert module_prog("/srv/app/gateway/__main__.py", "gateway.__main__") == "python -m gateway"
    assert module_prog("/usr/bin/pdctl", "__main__") is None  # a console script: argparse's own name
    assert module_prog("/srv/tool.py", "__main__") is None
