"""The walk-through's shell examples work as written against a sidecar on the simulated node.

The examples are read from ``docs/simulated-node.md`` (the README's "Trying it" points there), so a
test fails when the text drifts from what the commands accept. ``.run/`` is the directory
``make run-sim`` uses; here it points at a test sidecar's directory (same layout: ``hw.json``,
``state``, ``cdi``; ``sidecar.sock`` links to its socket).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one

pytestmark = pytest.mark.e2e

WALK_THROUGH = Path(__file__).resolve().parents[2] / "docs" / "simulated-node.md"


def shell_blocks() -> list[str]:
    """The ```sh code blocks of the walk-through."""
    return re.findall(r"^```sh\n(.*?)^```", WALK_THROUGH.read_text(), re.MULTILINE | re.DOTALL)


def block_with(text: str) -> str:
    (block,) = [b for b in shell_blocks() if text in b]
    return block


def commands(block: str) -> list[str]:
    """The block's shell commands, each joined over its continuation lines and multi-line quotes."""
    result: list[str] = []
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            result.append(pending)
        pending = ""
    assert not pending, f"unterminated command in the walk-through: {pending!r}"
    return result


def grpcurl_arguments(command: str) -> list[list[str]]:
    """The arguments of every grpcurl call in ``command`` (inside ``$(...)`` and pipes too)."""
    lexer = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars="|&;()")
    lexer.whitespace_split = True
    tokens = list(lexer)
    calls: list[list[str]] = []
    for i, token in enumerate(tokens):
        if token.endswith("grpcurl"):
            args: list[str] = []
            for arg in tokens[i + 1 :]:
                if arg and set(arg) <= set("|&;()"):
                    break
                args.append(arg)
            calls.append(args)
    return calls


def in_readme_dir(car: Sidecar, tmp_path: Path) -> Path:
    """A working directory whose ``.run`` is ``car``'s directory, as ``make run-sim`` lays it out."""
    (car.root / "sidecar.sock").symlink_to(car.socket.name)
    workdir = tmp_path / "clone"
    workdir.mkdir()
    (workdir / ".run").symlink_to(car.root)
    return workdir


def run_shell(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``script`` in bash, the sidecar's console script on PATH: what ``source .venv/bin/activate`` does
    (that line of the script is left out, the test's interpreter may live elsewhere)."""
    script = "\n".join(
        line for line in script.splitlines() if not line.startswith("source .venv/bin/activate")
    )
    bash = shutil.which("bash")
    assert bash is not None
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    return subprocess.run(
        [bash, "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=CALL_TIMEOUT_S * 4,
    )


class TestGrpcurlExamples:
    def test_every_grpcurl_call_gives_its_flags_before_the_address(self) -> None:
        """grpcurl stops reading flags at the first argument that is not one ("Too many arguments")."""
        calls = [args for block in shell_blocks() for c in commands(block) for args in grpcurl_arguments(c)]
        assert len(calls) >= 8
        for args in calls:
            positional = [i for i, arg in enumerate(args) if not arg.startswith("-")]
            flags = [i for i, arg in enumerate(args) if arg.startswith("-")]
            assert positional, args
            # -d takes a value, which is the only non-flag allowed before the address.
            values = {i + 1 for i in flags if args[i] == "-d"}
            address = min(set(positional) - values)
            assert all(i < address for i in flags), f"a flag after the address: {args}"

    def test_grpcurl_dials_a_unix_target_not_the_unix_flag(self) -> None:
        """``-unix PATH`` fails on grpcurl 1.9.x ("missing port in address"); ``unix://PATH`` works."""
        calls = [args for block in shell_blocks() for c in commands(block) for args in grpcurl_arguments(c)]
        for args in calls:
            assert "-unix" not in args, args

    def test_the_talking_to_it_block_runs_against_a_sidecar(self, sidecar: Sidecar, tmp_path: Path) -> None:
        if shutil.which("grpcurl") is None and os.environ.get("CI"):
            pytest.fail("CI is set but grpcurl is missing (.ci/run installs it)")
        missing = [tool for tool in ("grpcurl", "jq") if shutil.which(tool) is None]
        if missing:
            pytest.skip(f"needs {', '.join(missing)}")  # jq comes with the system, when it does
        workdir = in_readme_dir(sidecar, tmp_path)
        result = run_shell(block_with("grpcurl -plaintext"), workdir)
        assert result.returncode == 0, result.stdout + result.stderr
        assert '"outcome": "CREATED"' in result.stdout
        assert '"released": [' in result.stdout
        status = run_shell("hami-mig-sidecar status --socket $PWD/.run/sidecar.sock", workdir)
        assert re.search(r"^0\s+IDLE\s+3g\.40gb\s+4:4\s", status.stdout, re.MULTILINE), status.stdout


class TestRecordsVerifyExample:
    def test_the_records_verify_line_counts_live_simulated_records_valid_not_stale(
        self, sidecar_factory: SidecarFactory, tmp_path: Path
    ) -> None:
        car = sidecar_factory(sim_gpus="h100-80gb:1")
        car.recover()
        allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
        (line,) = [c for c in commands(block_with("records verify")) if "records verify" in c]
        result = run_shell(line, in_readme_dir(car, tmp_path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 valid (0 stale), 0 corrupt" in result.stdout


class TestWalkThrough:
    """The walk-through as a reader on a fresh clone does it: the console script only, no grpcurl or jq."""

    def test_every_command_of_the_walk_through_runs_as_written(
        self, sidecar: Sidecar, tmp_path: Path
    ) -> None:
        walk = block_with("hami-mig-sidecar call Allocate")
        simulator = block_with("hami-mig-sidecar sim $S list")
        assert "grpcurl" not in walk + simulator
        assert "jq " not in walk + simulator
        script = "\n".join(["set -x", walk, simulator])  # one terminal: the export carries over
        workdir = in_readme_dir(sidecar, tmp_path)
        result = run_shell(script, workdir)
        assert result.returncode == 0, result.stdout + result.stderr
        # Every command ran (bash -x traces each before it runs; -e stopped at none).
        traced = [line for line in result.stderr.splitlines() if line.startswith("+ hami-mig-sidecar ")]
        run = [c for c in commands(walk) + commands(simulator) if c.startswith("hami-mig-sidecar ")]
        assert len(traced) >= len(run), result.stderr
        out, err = result.stdout, result.stderr
        assert "(process): SERVING" in out
        assert "hami.migsidecar.v1.MigSidecar: SERVING" in out
        assert '"outcome": "CREATED"' in out
        assert '"released": [' in out
        [refusal] = [line for line in err.splitlines() if line.startswith("hami-mig-sidecar call Allocate:")]
        assert refusal.startswith(
            "hami-mig-sidecar call Allocate: FAILED_PRECONDITION PLACEMENT_BUSY: placement 4:1"
        )
        assert "blocker=ACTIVE" in refusal  # the ErrorInfo metadata, on the same line
        assert "1 valid (0 stale), 0 corrupt" in out
        status = run_shell("hami-mig-sidecar status --socket $PWD/.run/sidecar.sock", workdir)
        assert re.search(r"^0\s+IDLE\s+3g\.40gb\s+4:4\s", status.stdout, re.MULTILINE), status.stdout
        assert re.search(r"^1\s+1g\.10gb\s+0:1\s", status.stdout, re.MULTILINE), status.stdout  # foreign
