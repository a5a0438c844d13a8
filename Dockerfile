# Two images from one file: `pdserve <command>` for the workers (prefill, decode, front, metrics
# adapter; the default target) and a slim operator image without torch (`--target operator`).
# Model weights are NOT baked in: pods mount them at /models (PVC, or a model image copied by an
# init container). No secrets at build time; NATS credentials and API keys arrive as env from Secrets.
#   docker build -t ghcr.io/pdserve/pdserve:0.1.0 .
#   docker build --target operator -t ghcr.io/pdserve/pdserve-operator:0.1.0 .
# Build arguments let a machine without an image registry build the same steps
# (scripts/k8s-images.py does, with buildah):
#   BASE            a Python 3.11 image (its `python` on PATH); the official slim image by default
#   PIP_CONSTRAINT, PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL, PIP_CERT
#                   pip's own settings, e.g. a constraints file pinning torch==2.13.0+cpu and a
#                   folder holding that wheel make a CPU-only image
# Layers: the dependencies (gigabytes for the workers) come from pyproject.toml alone, pdserve
# itself from a wheel on top, so a source change rebuilds and ships only a small layer.
ARG BASE=python:3.11-slim-bookworm

# The sources the images install: the package folders of pyproject.toml's package-dir.
FROM scratch AS sources
COPY pyproject.toml README.md /src/
COPY pdserve /src/pdserve
COPY operator /src/operator
COPY prefill /src/prefill
COPY decode /src/decode
COPY kvtransfer /src/kvtransfer
COPY kernels /src/kernels
COPY front /src/front
COPY autoscale /src/autoscale

FROM ${BASE} AS wheel
ARG PIP_CONSTRAINT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
COPY --from=sources /src /src
RUN python -m venv /tmp/venv \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /tmp/venv/bin/pip wheel --no-deps -w /wheels /src

FROM ${BASE} AS runtime
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN groupadd --gid 10001 pdserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdserve \
 && mkdir -p /models && chown 10001:10001 /models

# The operator installs only the project's requirements (its dependencies and its `k8s` extra, where
# an extra holds them) for the distributions named in [tool.pdserve] operator-image (kopf and the
# Kubernetes client): no torch, no CUDA stack.
FROM runtime AS operator
ARG PIP_CONSTRAINT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
# copied from the build context, which layer caches key by content
COPY pyproject.toml /tmp/pyproject.toml
RUN python -m venv /opt/pdserve \
 && python -c 'import re, tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; keep = set(tomllib.load(open("/tmp/pyproject.toml", "rb"))["tool"]["pdserve"]["operator-image"]); print("\n".join(d for d in p["dependencies"] + p.get("optional-dependencies", {}).get("k8s", []) if re.split(r"[<>=!~ \[;]", d)[0] in keep))' > /tmp/requirements.txt \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/pyproject.toml /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install --no-deps --no-index /wheels/*.whl \
 && /opt/pdserve/bin/python -c 'import sys, pdserve.operator.handlers; heavy = {"torch", "triton", "transformers", "numpy"} & set(sys.modules); sys.exit(f"operator imports {heavy}" if heavy else 0)'
USER 10001:10001
# liveness 8080, admission webhook 9443.
EXPOSE 8080 9443
ENTRYPOINT []
CMD ["pdserve", "operator"]

FROM runtime
ARG PIP_CONSTRAINT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
COPY pyproject.toml /tmp/pyproject.toml
# PyPI's Linux torch wheel carries CUDA; the GPU comes from the node's driver (NVIDIA device plugin).
# The `k8s` extra too, where pyproject.toml has one: the metrics adapter runs from this image.
RUN python -m venv /opt/pdserve \
 && python -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p.get("optional-dependencies", {}).get("k8s", [])))' > /tmp/requirements.txt \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/pyproject.toml /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install --no-deps --no-index /wheels/*.whl
USER 10001:10001
VOLUME ["/models"]
# data ports (prefill 7100, decode 7200), metrics 9100, HTTP front 8000, operator webhook 9443.
EXPOSE 7100 7200 8000 9100 9443
ENTRYPOINT []
CMD ["pdserve", "--help"]
