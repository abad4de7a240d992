# One image, three entry points (all the `disaggpool` console script):
#   disaggpool operator                      the Kopf operator (manifests/03-operator.yaml)
#   disaggpool sidecar --config FILE         the routing sidecar (rendered by the operator)
#   disaggpool calibrate --endpoint URL ...  the calibration probe (run as a Job by the operator)
# Runs as an unprivileged user with a read-only root filesystem (only /tmp needs to be writable).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
# 65532: the conventional "nonroot" uid; the manifests set runAsUser to it as well.
RUN useradd --uid 65532 --user-group --no-create-home --shell /usr/sbin/nologin disaggpool
USER 65532:65532
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MPLCONFIGDIR=/tmp
ENTRYPOINT []
CMD ["disaggpool", "operator"]
