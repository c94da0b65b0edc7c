"""`make chart-config` (`scripts/chart_config.py`): the chart's Serve config,
`helm/cbserve/files/serve_config.yaml`, is generated from `ray_config.yaml`, and the committed file
is what the script writes now. No Ray, no torch: the script is plain Python."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "chart_config.py"
RAY_CONFIG = REPO / "ray_config.yaml"
CHART_COPY = REPO / "helm" / "cbserve" / "files" / "serve_config.yaml"


def run_script(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False)


def test_the_committed_chart_config_is_up_to_date() -> None:
    out = run_script("--check")
    assert out.returncode == 0, f"{out.stderr}\n(after changing ray_config.yaml: make chart-config)"


def test_check_fails_when_ray_config_changes_until_regenerated(tmp_path: Path) -> None:
    source, output = tmp_path / "ray_config.yaml", tmp_path / "serve_config.yaml"
    shutil.copy(CHART_COPY, output)
    text = RAY_CONFIG.read_text()
    changed, n = re.subn(r"(max_batch_tokens: *)(\d+)", lambda m: f"{m[1]}{int(m[2]) + 64}", text, count=1)
    assert n == 1
    source.write_text(changed)

    stale = run_script("--check", "--source", source, "--output", output)
    assert stale.returncode == 1, stale.stdout
    assert "make chart-config" in stale.stderr and re.search(r"^\+ +max_batch_tokens", stale.stderr, re.MULTILINE)
    assert output.read_text() == CHART_COPY.read_text()  # --check writes nothing

    assert run_script("--source", source, "--output", output).returncode == 0
    assert run_script("--check", "--source", source, "--output", output).returncode == 0
    generated = output.read_text()
    # The chart serves ray_config.yaml's settings (its templates add the Kubernetes ones), under its own header.
    assert yaml.safe_load(generated) == yaml.safe_load(changed)
    assert generated.startswith("# Generated from ray_config.yaml by `make chart-config`")
    assert "On a laptop" in text and "On a laptop" not in generated
