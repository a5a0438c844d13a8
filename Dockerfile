# One image for the operator and the workers (prefill, decode, front): `pdserve <command>`.
# Model weights are NOT baked in: pods mount them at /models (PVC, or a model image copied by an
# init container). No secrets at build time; NATS credentials and API keys arrive as env from Secrets.
#   docker build -t ghcr.io/pdserve/pdserve:0.1.0 .
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY operator ./operator
COPY prefill ./prefill
COPY decode ./decode
COPY kvtransfer ./kvtransfer
COPY kernels ./kernels
COPY front ./front
COPY autoscale ./autoscale
# PyPI's Linux torch wheel carries CUDA; the GPU comes from the node's driver (NVIDIA device plugin).
# [k8s]: the operator and the metrics adapter run from this image too.
RUN python -m venv /opt/pdserve && /opt/pdserve/bin/pip install ".[k8s]"

FROM python:3.11-slim-bookworm
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
COPY --from=build /opt/pdserve /opt/pdserve
RUN groupadd --gid 10001 pdserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pdserve \
 && mkdir -p /models && chown 10001:10001 /models
USER 10001:10001
VOLUME ["/models"]
# data ports (prefill 7100, decode 7200), metrics 9100, HTTP front 8000, operator webhook 9443.
EXPOSE 7100 7200 8000 9100 9443
ENTRYPOINT []
CMD ["pdserve", "--help"]
