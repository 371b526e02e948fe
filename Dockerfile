# syntax=docker/dockerfile:1
# One image for every service: encoder, talker, decoder, gateway (k8s/ picks the command).
#
#   GPU (default): docker build -t REGISTRY/personaplex-serve:0.1.0 .
#   CPU only:      docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                    -t REGISTRY/personaplex-serve:0.1.0-cpu .
#
# The CUDA runtime comes inside the torch wheel (its nvidia-* dependencies); the driver
# and the MPS binaries (nvidia-cuda-mps-control, nvidia-cuda-mps-server) are injected
# from the node by the NVIDIA container toolkit (CDI), so the base is plain Python.
# No checkpoint is baked in: pods mount it at /models.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# pyproject allows torch >=2.11,<2.15; the default PyPI index serves the CUDA build.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # GPUs come only from the pod's device claim (CDI), never from an inherited "all".
    NVIDIA_VISIBLE_DEVICES=void \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /app

# Layers from the least to the most often changed: torch, the other dependencies, the code.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY protos/ protos/
COPY services/ services/
COPY tools/ tools/

# The project itself (editable: one copy of the code, under /app), then the gRPC
# stubs generated from protos/ into /app/duplex/ (the Makefile's `stubs` step).
RUN pip install --no-deps -e . \
 && python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/duplex/v1/*.proto \
 && python -c "from duplex.v1 import talker_pb2_grpc, encoder_pb2_grpc, decoder_pb2_grpc"

# Non-root, with the uid/gid the manifests run as (MPS needs all cell containers on one uid).
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin app
USER 10001:10001

EXPOSE 8000 50051 50052 50053 9101 9102 9103
CMD ["python", "-m", "services.gateway", "--help"]
