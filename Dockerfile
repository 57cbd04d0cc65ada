# warmroute's proxy image: `pip install .` without extras (no bench, plots or gRPC), run as a
# non-root user, with a HEALTHCHECK on /health. Build: docker build -t warmroute .
# Run:   docker run -p 8080:8080 -e WARMROUTE_BACKENDS=http://10.0.0.5:8000 warmroute
# The same image runs the simulated engines: docker run warmroute sim --host 0.0.0.0 --port 8001

FROM python:3.11-slim AS build
# gcc for the build stage only: setup.py compiles the per-chunk hot path with mypyc (which pip
# brings), the meter's C scans and the prefix index's C tables (proxy/_eventscan.c,
# proxy/_blockmap.c); without a compiler the install would
# still succeed, as pure Python. The image below copies the built venv and has no compiler.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/warmroute
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
COPY plugins ./plugins
RUN /opt/warmroute/bin/pip install --no-cache-dir .

FROM python:3.11-slim
COPY --from=build /opt/warmroute /opt/warmroute
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin warmroute
ENV PATH=/opt/warmroute/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    WARMROUTE_HOST=0.0.0.0 \
    WARMROUTE_PORT=8080
USER 10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('WARMROUTE_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["warmroute"]
CMD ["serve"]
