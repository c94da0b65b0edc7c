"""The Helm chart's Serve config, `helm/cbserve/files/serve_config.yaml`, generated from `ray_config.yaml`
(`make chart-config`; `--check` says whether the chart's file is up to date, as a test does). Plain
Python, no cbserve import (which would load torch): it runs in a fraction of a second.

The chart serves the settings of `ray_config.yaml` unchanged: what depends on the Kubernetes
cluster (bind address, ports, model, dtype, tp_size, GPUs and CPUs per rank, replicas, the API
key) its templates set from `values.yaml` when they render (`templates/_helpers.tpl`). The one
difference is the header: `ray_config.yaml`'s opening comment tells how to run it on a laptop,
which is not how the chart runs it.

    python scripts/chart_config.py [--check] [--source ray_config.yaml] [--output PATH]
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "ray_config.yaml"
OUTPUT = REPO / "helm" / "cbserve" / "files" / "serve_config.yaml"
REGENERATE = "make chart-config"

# Replaces the source's opening comment block (how to run it locally).
CHART_HEADER = f"""\
# Generated from ray_config.yaml by `{REGENERATE}` (scripts/chart_config.py): edit
# ray_config.yaml, then regenerate; a test fails while this file is out of date.
# The chart renders serveConfigV2 from it and sets from values.yaml what depends on the Kubernetes
# cluster: bind address and ports, model, dtype, tp_size, GPUs and CPUs per rank, replica counts,
# the API key (templates/_helpers.tpl). Every `args` field is described in the README ("Serving
# on Ray") and on `cbserve.cluster.settings.ClusterArgs`.
"""


def _body(source_text: str) -> str:
    """The source without its opening comment block (and the blank lines after it)."""
    lines = source_text.splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].lstrip().startswith("#"):
        start += 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    return "".join(lines[start:])


def chart_config(source_text: str) -> str:
    """The chart's file for `ray_config.yaml`'s text: its settings and comments, the chart's header."""
    return CHART_HEADER + "\n" + _body(source_text)


def _stale(output: Path, expected: str) -> list[str]:
    """Diff lines from the file at `output` to `expected` (none: up to date)."""
    current = output.read_text() if output.exists() else ""
    return list(difflib.unified_diff(current.splitlines(), expected.splitlines(), str(output), "generated",
                                     lineterm="", n=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=SOURCE, help="the Serve config (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the chart's copy (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the output is out of date")
    opts = parser.parse_args(argv)
    expected = chart_config(opts.source.read_text())
    if not opts.check:
        opts.output.write_text(expected)
        print(f"wrote {opts.output} from {opts.source}")
        return 0
    diff = _stale(opts.output, expected)
    if diff:
        print(f"{opts.output} is out of date with {opts.source}: run `{REGENERATE}`", file=sys.stderr)
        print("\n".join(diff[:40]), file=sys.stderr)
        return 1
    print(f"{opts.output} is up to date with {opts.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
