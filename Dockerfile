# Two images from one file: `pdserve <command>` for the workers (prefill, decode, front, metrics
# adapter; the default target) and a slim operator image without torch (`--target operator`).
# Model weights are NOT baked in: pods mount them at /models (PVC, or a model image copied by an
# init container). No secrets at build time; NATS credentials and API keys arrive as env from Secrets.
#   docker build -t ghcr.io/pdserve/pdserve:0.1.0 .
#   docker build --target operator -t ghcr.io/pdserve/pdserve-operator:0.1.0 .
# Build arguments let a machine without an image registry build the same steps
# (scripts/k8s-images.py does, with buildah):
#   BASE            a Python 3.11 image (its `python` on PATH); the official slim image by default
#   BUILDER         an image of the same Debian with python3 and a C compiler (gcc 12 knows every level
#                   kernels/prebuild.py builds for); the official full Python image by default
#   PIP_CONSTRAINT, PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL, PIP_CERT
#                   pip's own settings, e.g. a constraints file pinning torch==2.13.0+cpu and a
#                   folder holding that wheel make a CPU-only image
# Layers: the dependencies (gigabytes for the workers) come from pyproject.toml alone, pdserve
# itself from a wheel on top, so a source change rebuilds and ships only a small layer.
ARG BASE=python:3.11-slim-bookworm
ARG BUILDER=python:3.11-bookworm

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

# The native kernels, compiled here once per instruction-set level (AMX, AVX512-BF16, x86-64-v4, x86-64-v3)
# by a bare Python (no torch) and shipped in the wheel: the workers have no compiler, and each loads the best
# variant its CPU runs (pdserve_engine_info on /metrics says which). Only the C sources and the two build
# scripts come in, so a Python change elsewhere reuses this layer.
FROM ${BUILDER} AS kernels
COPY kernels/*.c kernels/native_build.py kernels/prebuild.py /src/kernels/
RUN python3 /src/kernels/prebuild.py --out /prebuilt

FROM ${BASE} AS wheel
ARG PIP_CONSTRAINT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
COPY --from=sources /src /src
COPY --from=kernels /prebuilt /src/kernels/prebuilt
RUN python -m venv /tmp/venv \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /tmp/venv/bin/pip wheel --no-deps -w /wheels /src

# What each image installs, from pyproject.toml: its dependencies and its `k8s` and `otel` extras (the workers
# export traces where OTEL_EXPORTER_OTLP_ENDPOINT is set in their pods); the operator only those of the distributions named in [tool.pdserve] operator-image (kopf and
# the Kubernetes client): no torch, no CUDA stack. A stage of its own, because a COPY is cached by its
# content: the dependency layers below are rebuilt when these lists change, not when pyproject.toml's
# test settings or development tools do.
FROM ${BASE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN mkdir /requirements && python -c 'import re, tomllib; t = tomllib.load(open("/tmp/pyproject.toml", "rb")); p = t["project"]; deps = p["dependencies"] + [d for x in ("k8s", "otel") for d in p.get("optional-dependencies", {}).get(x, [])]; keep = set(t["tool"]["pdserve"]["operator-image"]); open("/requirements/workers.txt", "w").write("\n".join(deps) + "\n"); open("/requirements/operator.txt", "w").write("\n".join(d for d in deps if re.split(r"[<>=!~ \[;]", d)[0] in keep) + "\n")'

FROM ${BASE} AS runtime
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN groupadd --gid 10001 pdserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdserve \
 && mkdir -p /models && chown 10001:10001 /models

# The slim operator image (see the requirements stage).
FROM runtime AS operator
ARG PIP_CONSTRAINT
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
COPY --from=requirements /requirements/operator.txt /tmp/requirements.txt
RUN python -m venv /opt/pdserve \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
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
# PyPI's Linux torch wheel carries CUDA; the GPU comes from the node's driver (NVIDIA device plugin).
# The `k8s` extra too: the metrics adapter runs from this image.
COPY --from=requirements /requirements/workers.txt /tmp/requirements.txt
RUN python -m venv /opt/pdserve \
 && PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/pdserve/bin/pip install --no-deps --no-index /wheels/*.whl
USER 10001:10001
VOLUME ["/models"]
# data ports (prefill 7100, decode 7200), metrics 9100, HTTP front 8000, operator webhook 9443.
EXPOSE 7100 7200 8000 9100 9443
ENTRYPOINT []
CMD ["pdserve", "--help"]
