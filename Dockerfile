# One image, three entry points (all the `disaggpool` console script):
#   disaggpool operator                      the Kopf operator (manifests/03-operator.yaml)
#   disaggpool sidecar --config FILE         the routing sidecar (rendered by the operator)
#   disaggpool calibrate --endpoint URL ...  the calibration probe (run as a Job by the operator)
# Runs as an unprivileged user with a read-only root filesystem (only /tmp needs to be writable).
#
#   docker build -t disaggpool:dev .          (or: buildah bud -t disaggpool:dev .)
#
# BASE is any image with Python 3.11 as `python3` and its `venv` module: the official slim image
# by default; the test node builds this file on a Debian bookworm root filesystem instead
# (tests/cluster/images.py, docs/test-node.md), because no registry is reachable there.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# A virtual environment rather than `pip install --prefix`: it lands where the final stage expects
# it on any base (a distribution's Python looks for packages elsewhere than the official image's).
RUN python3 -m venv /opt/disaggpool && /opt/disaggpool/bin/pip install --no-cache-dir .

FROM ${BASE}
COPY --from=build /opt/disaggpool /opt/disaggpool
# 65532: the conventional "nonroot" uid; the manifests set runAsUser to it as well.
RUN useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin disaggpool
USER 65532:65532
ENV PATH=/opt/disaggpool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MPLCONFIGDIR=/tmp
ENTRYPOINT []
CMD ["disaggpool", "operator"]
