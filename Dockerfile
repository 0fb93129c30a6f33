# maskd's image: the server (`maskd serve`) and the cluster worker (the Ray head and worker pods of
# the Helm chart's ray mode, and `maskd cluster up`).
#
#   make image                       # target `cluster` (server + Ray): ghcr.io/maskd/maskd:<version>
#   make image IMAGE_TARGET=server   # the server alone (no Ray):       ghcr.io/maskd/maskd:<version>-server
#
# Every `pip install` below is also run, as written, in a clean virtual environment by
# tests/deploy/test_image.py, which then starts what the image runs; keep each one on one line.
# RAY_VERSION must equal the chart's ray.rayVersion (helm/maskd/values.yaml): KubeRay starts the
# pods with the Ray version it is told, and tests check the two agree with what pyproject resolves.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: a virtual environment in /opt/maskd, copied whole into the runtime stages -------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/maskd/bin:$PATH
RUN python3 -m venv /opt/maskd
# The xgrammar backend imports torch (and transformers) when it loads, so the server needs torch:
# the CPU build, from PyTorch's CPU index, before anything can pull a CUDA build from PyPI.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# gcc builds maskd's C row codec (maskd/_rowcodec.c; without it the same codec runs in numpy, slower);
# only the build stages have it, the runtime stages copy the virtual environment alone.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md /src/
COPY maskd /src/maskd
COPY client /src/client
COPY cluster /src/cluster
RUN pip install "/src[server]"

FROM build AS build-cluster
ARG RAY_VERSION=2.60.0
RUN pip install "/src[cluster]" "ray[default]==${RAY_VERSION}"

# -- runtime: slim Python, the environment, a non-root user ----------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
# uid/gid 65532: the chart's podSecurityContext (runAsNonRoot, runAsUser 65532).
# KubeRay starts Ray in a login shell (`bash -lc`), where Debian's /etc/profile resets PATH:
# profile.d puts the environment back in front.
RUN groupadd --system --gid 65532 maskd \
    && useradd --system --uid 65532 --gid 65532 --home-dir /home/maskd --create-home --shell /usr/sbin/nologin maskd \
    && echo 'export PATH=/opt/maskd/bin:$PATH' > /etc/profile.d/maskd.sh
ENV PATH=/opt/maskd/bin:$PATH HOME=/home/maskd PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/maskd
EXPOSE 50051 9464
# Docker and Podman run it (Kubernetes uses the chart's gRPC probes instead).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["maskd", "health", "--target", "127.0.0.1:50051", "--timeout", "3"]
CMD ["maskd", "serve", "--host", "0.0.0.0", "--port", "50051"]

FROM runtime AS server
COPY --from=build /opt/maskd /opt/maskd
USER 65532:65532

# The default target (last): the server and Ray. KubeRay runs `ray start` in it (bash is in the
# slim base); the chart runs `maskd serve` or `maskd cluster up` in it.
FROM runtime AS cluster
COPY --from=build-cluster /opt/maskd /opt/maskd
USER 65532:65532
