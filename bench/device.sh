#!/usr/bin/env bash
# Run a benchmark on a bare GPU machine whose image has torch, numpy and prometheus-client but not
# this project's other runtime packages: install the wheels carried in .whl/ (cp312 builds of the
# versions pyproject.toml pins, downloaded beforehand with `pip download --only-binary=:all:
# --python-version 3.12 ...`), generate the gRPC stubs, then run the command given.
#     bash bench/device.sh python3 -m bench.frontdoor --mps --full-context --sessions 160
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH"
python3 -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/duplex/v1/*.proto
exec "$@"
