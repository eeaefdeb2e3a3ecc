# rallypoint in a container: `rallypoint` is the entrypoint, so the image runs like the
# command (`docker run IMAGE run --standalone --nproc-per-node 2 train.py`).
#
#   docker build -t rallypoint:0.1.0 .
#   docker build -t rallypoint:0.1.0-cu124 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 .
#   docker build --build-arg PLUGINS="etcd prometheus" --build-arg EXTRAS="" .
#
# Build arguments:
#   PYTHON_VERSION   the python:<version>-slim base image (3.10 or newer)
#   TORCH_VERSION    the torch release, installed first and pinned
#   TORCH_INDEX_URL  where torch comes from: the CPU build by default; a CUDA index
#                    (https://download.pytorch.org/whl/cu124) for GPU nodes
#   PLUGINS          plugins to install, by name: etcd, redis, prometheus (space-separated)
#   EXTRAS           extras of the rallypoint distribution; `examples` brings scikit-learn
#                    for /opt/rallypoint/examples/train_digits.py
ARG PYTHON_VERSION=3.11

# --- build: wheels of rallypoint and the chosen plugins, from this checkout -----------------
FROM python:${PYTHON_VERSION}-slim AS build
ARG PLUGINS="etcd redis prometheus"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY core ./core
COPY cli ./cli
COPY plugins ./plugins
# PLUGINS is a list of words: split on purpose.
# hadolint ignore=SC2086
RUN set -eu; \
    dirs=""; \
    for name in ${PLUGINS}; do \
        case "$name" in \
            etcd) dirs="$dirs plugins/rendezvous_etcd" ;; \
            redis) dirs="$dirs plugins/rendezvous_redis" ;; \
            prometheus) dirs="$dirs plugins/metrics_prometheus" ;; \
            *) echo "unknown plugin '$name' in PLUGINS; choose from: etcd redis prometheus" >&2; exit 2 ;; \
        esac; \
    done; \
    pip wheel --no-deps --wheel-dir /wheels . $dirs

# --- runtime: torch, the wheels, a non-root user ----------------------------------------------
FROM python:${PYTHON_VERSION}-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS="examples"
LABEL org.opencontainers.image.title="rallypoint" \
      org.opencontainers.image.description="Fault-tolerant, elastic launcher for PyTorch distributed training" \
      org.opencontainers.image.licenses="BSD-3-Clause"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/rallypoint/venv \
    PATH=/opt/rallypoint/venv/bin:$PATH

# torch first and pinned, from TORCH_INDEX_URL: otherwise pip would pull the default
# (CUDA) build from PyPI for rallypoint's torch requirement.
RUN python -m venv "$VIRTUAL_ENV" \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY --from=build /wheels /tmp/wheels
# The wheels were built from this checkout, so they are pinned; their dependencies follow
# the ranges of the pyproject.toml files. $plugins is a list of paths: split on purpose.
# hadolint ignore=DL3013,SC2086
RUN set -eu; \
    core=""; plugins=""; \
    for wheel in /tmp/wheels/*.whl; do \
        case "${wheel##*/}" in \
            rallypoint-[0-9]*) core="$wheel" ;; \
            *) plugins="$plugins $wheel" ;; \
        esac; \
    done; \
    if [ -n "${EXTRAS}" ]; then core="${core}[${EXTRAS}]"; fi; \
    pip install "$core" $plugins; \
    rm -rf /tmp/wheels; \
    rallypoint plugins

COPY examples/train_digits.py /opt/rallypoint/examples/train_digits.py

RUN useradd --create-home --uid 1000 --user-group rallypoint \
    && mkdir -p /workspace /checkpoints \
    && chown rallypoint:rallypoint /workspace /checkpoints
USER 1000:1000
WORKDIR /workspace

# 9400: the prometheus plugin's /metrics (--metrics prometheus --metrics-port 9400);
# 29400: the c10d store, on the node that hosts it.
EXPOSE 9400 29400
ENTRYPOINT ["rallypoint"]
CMD ["--help"]
