"""Regenerate the gRPC stubs next to `generate.proto`: `python -m cbserve.serving.protos.build`.

Needs `grpcio-tools` (a dev dependency); the stubs it writes require at least the `protobuf` and
`grpcio` versions of the `grpcio-tools` that made them (their headers name them). Runs `grpc_tools.protoc` from the repository root so
the generated code imports `cbserve.serving.protos.generate_pb2` by its package path.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = "cbserve/serving/protos/generate.proto"


def main() -> int:
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}", str(ROOT / PROTO)]
    rc = protoc.main(args)
    if rc == 0:  # generated code is not ours to lint
        for name in ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"):
            path = ROOT / "cbserve/serving/protos" / name
            path.write_text("# ruff: noqa\n" + path.read_text())
    return rc


if __name__ == "__main__":
    sys.exit(main())
