"""Our side of the megatron-core oracle: its environment, and running driver.py there on files."""

from __future__ import annotations

import functools
import json
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
MOE_DRIVER = Path(__file__).with_name("moe_driver.py")


@functools.lru_cache(maxsize=1)
def _install() -> tuple[str | None, str]:
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "install_megatron_core.sh")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"exit status {proc.returncode}"
    return proc.stdout.strip().splitlines()[-1], ""


def megatron_core_python() -> str:
    """The megatron-core environment's interpreter (installed on first use); skips the test, saying why,
    when megatron-core cannot be installed."""
    python, why = _install()
    if python is None:
        pytest.skip(f"megatron-core 0.16.1 could not be installed by tools/install_megatron_core.sh: {why}")
    return python


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_oracle(jobs: list[dict], directory: Path, world: int = 2) -> None:
    """Run the jobs (see driver.py) on `world` gloo ranks of megatron-core, isolated from our package."""
    _run(DRIVER, {"world": world, "jobs": jobs}, directory)


def run_moe_oracle(cases: list[dict], directory: Path) -> None:
    """Run megatron-core's MoELayer on the cases (see moe_driver.py) on one rank, isolated from our package."""
    _run(MOE_DRIVER, {"cases": cases}, directory)


def _run(driver: Path, spec_values: dict, directory: Path, attempts: int = 3) -> None:
    """Run `driver` on a free port; another process may take that port between our check and the
    ranks' rendezvous (EADDRINUSE), so such a start is retried on a new port."""
    spec = directory / "oracle_spec.json"
    for _ in range(attempts):
        spec.write_text(json.dumps({**spec_values, "port": _free_port()}))
        proc = subprocess.run(
            [megatron_core_python(), "-I", "-W", "ignore", str(driver), str(spec)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=600,
            env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        )
        if "EADDRINUSE" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
