# Images of the KV-cache service and of the executor, from one file:
#   docker build --target cache-service -t kvcache/cache-service .   (no torch: small)
#   docker build --target executor      -t kvcache/executor .        (torch CPU build)
# Every package is installed ONLY from ./wheelhouse (pip --no-index --find-links): fill it first
# with `bash scripts/docker/wheelhouse.sh`, which uses the host's pip index (PyPI or a mirror).
# That is the same here, where pip inside `docker build` cannot reach an index, and elsewhere.
# BASE_IMAGE: any Debian-like image with python3.11 + venv. The tests pass a local debootstrap
# image (scripts/docker/base_image.sh); elsewhere the default is pulled from a registry.
# Only classic-builder syntax is used, so Docker 20.10 (Debian's docker.io) builds it as is.
ARG BASE_IMAGE=python:3.11-slim

# ---- build stages: venvs of third-party packages, and the project's wheel ----
# The requirement lists come from pyproject.toml; only their text keys the dependency layers,
# so editing anything else in pyproject.toml does not reinstall torch.
FROM ${BASE_IMAGE} AS requirements
COPY pyproject.toml scripts/docker/requirements.py /src/
RUN mkdir /requirements \
 && python3 /src/requirements.py /src/pyproject.toml --extra cluster > /requirements/base.txt \
 && python3 /src/requirements.py /src/pyproject.toml --extra executor > /requirements/executor.txt

FROM ${BASE_IMAGE} AS deps
# Another wheelhouse directory, e.g. one with a CUDA torch for the gpu profile.
ARG WHEELHOUSE=wheelhouse
ENV PIP_NO_INDEX=1 \
    PIP_FIND_LINKS=/wheelhouse \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/venv
COPY ${WHEELHOUSE}/ /wheelhouse/
COPY --from=requirements /requirements/base.txt /requirements/
RUN /opt/venv/bin/pip install -q -r /requirements/base.txt

# The project as a wheel (its build backend also comes from the wheelhouse).
FROM deps AS wheel
# README.m[d]: the glob lets the build go on in a checkout without a README.
COPY pyproject.toml README.m[d] /src/
COPY cache_service/ /src/cache_service/
COPY executor/ /src/executor/
COPY kernels/ /src/kernels/
COPY kvcache_common/ /src/kvcache_common/
RUN /opt/venv/bin/pip wheel -q --no-deps -w /dist /src

# ---- runtime stages: base image + one venv + an unprivileged user, nothing else ----
FROM ${BASE_IMAGE} AS runtime
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvcache \
      --shell /usr/sbin/nologin kvcache
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/kvcache
# Each image: COPY a venv of third-party packages (a cached layer while the wheelhouse is
# unchanged), then install the small project wheel on top, as root, then drop to the user.

FROM runtime AS cache-service
COPY --from=deps /opt/venv/ /opt/venv/
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install -q --no-index --no-deps --no-cache-dir --root-user-action=ignore \
      --disable-pip-version-check /tmp/dist/*.whl && rm -rf /tmp/dist \
 && pip check \
 && mkdir /data && chown kvcache:kvcache /data
# /data: where compose mounts the data-dir volume (KVCACHE_DATA_DIR=/data there). Owned by
# the server's user, so a new named volume mounted on it starts writable by that user.
USER kvcache
# Inside a container the server must listen on every interface (its own default is loopback);
# publish the ports on 127.0.0.1 on the host instead (see docker-compose.yml).
ENV KVCACHE_HOST=0.0.0.0 \
    KVCACHE_PORT=50051 \
    KVCACHE_METRICS_PORT=9400
EXPOSE 50051 9400
# The probe asks grpc.health.v1 on the port in $KVCACHE_PORT (read at probe time).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "kvcache_common.healthcheck", "--port-env", "KVCACHE_PORT", "--default-port", "50051"]
# Exec form: the server is PID 1 and receives SIGTERM itself (it drains, then exits 0).
ENTRYPOINT ["kvcache-server"]
CMD []

# ---- the executor: after cache-service, so that building that target (classic builder builds
# every stage before its target) never installs torch ----
FROM deps AS deps-executor
COPY --from=requirements /requirements/executor.txt /requirements/
RUN /opt/venv/bin/pip install -q -r /requirements/executor.txt

FROM runtime AS executor
COPY --from=deps-executor /opt/venv/ /opt/venv/
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install -q --no-index --no-deps --no-cache-dir --root-user-action=ignore \
      --disable-pip-version-check /tmp/dist/*.whl && rm -rf /tmp/dist \
 && pip check
USER kvcache
# One intra-op thread unless told otherwise: executors share the host's cores with each other.
ENV KVCACHE_EXECUTOR_HOST=0.0.0.0 \
    KVCACHE_EXECUTOR_PORT=50061 \
    OMP_NUM_THREADS=1
EXPOSE 50061
# SERVING only once the executor has registered its pool with the cache service.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "kvcache_common.healthcheck", "--port-env", "KVCACHE_EXECUTOR_PORT", "--default-port", "50061"]
# The same image runs the demo client: `docker run --entrypoint kvcache-demo IMAGE --target ...`.
ENTRYPOINT ["kvcache-executor"]
CMD []
