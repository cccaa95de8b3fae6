# syntax=docker/dockerfile:1
#
# bert-tvm-serve image: compiles the bundled MiniLM with TVM in a build stage, then serves the
# artifacts from a slim runtime stage.
#
#   docker build --build-arg TARGET=cpu  -t bert-tvm-serve:0.1.0-cpu  .
#   docker build --build-arg TARGET=cuda --build-arg CUDA_ARCH=sm_90 -t bert-tvm-serve:0.1.0-cuda .
#   docker build --build-arg TARGET=cpu --target compiling -t bert-tvm-serve:0.1.0-cpu-compiling .
#
# The last image also compiles a `--model-id` on its first start (stage `compiling`, below).
#
# Build arguments
#   TARGET     cpu | cuda. cuda compiles configs/cuda.yaml (no GPU needed at build time; the
#              libraries are validated against PyTorch only where a GPU is present, so a CUDA
#              image is NOT validated at build time) and adds the CUDA user-space libraries
#              to the serving environment.
#   CUDA_ARCH  passed to `bert-compile --cuda-arch` (default sm_90, H100).
#   MCPU       LLVM CPU(s) the host code is compiled for. bert-compile's own default is the build
#              machine's CPU, which could SIGILL on a different node. The cpu image's default,
#              x86-64-v3,x86-64-v4, builds every library for both levels, and the server loads
#              the AVX-512 one where the node has AVX-512, else the AVX2 one (any x86 server of
#              the last ten years). A level the build machine cannot run is built but neither
#              validated nor timed there. The cuda image's default is x86-64-v3 (one level).
#
# Base images are pinned by tag to the OS (Debian 12 bookworm, glibc 2.36, gcc 12) and Python
# (3.11) the project is tested on. For fully reproducible builds pin them by digest too
# (python:3.11-slim-bookworm@sha256:...).

ARG TARGET=cpu

# ---------------------------------------------------------------------------------------------
# build: install the project into /opt/venv and compile the artifacts into /opt/bert/artifacts
# ---------------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS build
ARG TARGET
ARG CUDA_ARCH=sm_90
ARG MCPU
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# TVM's export_library links every library with the system C++ compiler. g++ is Debian's
# default-compiler metapackage, whose version only changes between Debian releases.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv

WORKDIR /src
# Dependencies first (one cached layer, independent of the source): the project's own and its
# `compile` extra (torch, transformers, the bundled model) from pyproject.toml, at the exact
# versions in requirements.lock (used as constraints); the lock's test and bench extras (pytest,
# onnx, onnxruntime, matplotlib, sentence-transformers, ...) stay out of the image.
# torch comes from PyTorch's CPU index: PyPI's torch==2.13.0 is the CUDA build (several GB of
# nvidia-* wheels). Only this stage has torch: the runtime stage serves without it.
COPY requirements.lock pyproject.toml ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple \
        -c requirements.lock "torch==2.13.0+cpu" \
    && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print(*p['dependencies'], *p['optional-dependencies']['compile'], sep='\n')" > /tmp/dependencies.txt \
    && pip install -c requirements.lock -r /tmp/dependencies.txt \
    && rm /tmp/dependencies.txt

# The project itself (artifact/, compile/, service/, loadtest/ and the console scripts), not editable,
# so the runtime stage needs no source tree.
COPY README.md ./
COPY configs/ configs/
COPY artifact/ artifact/
COPY compile/ compile/
COPY service/ service/
COPY loadtest/ loadtest/
RUN pip install --no-deps /src

RUN case "$TARGET" in \
        cpu) set -- --config configs/default.yaml --mcpu "${MCPU:-x86-64-v3,x86-64-v4}" ;; \
        cuda) set -- --config configs/cuda.yaml --cuda-arch "$CUDA_ARCH" --mcpu "${MCPU:-x86-64-v3}" ;; \
        *) echo "TARGET must be cpu or cuda, not '$TARGET'" >&2; exit 2 ;; \
    esac \
    && bert-compile "$@" --out /opt/bert/artifacts --quiet

# ---------------------------------------------------------------------------------------------
# serve-env: what serving needs and nothing else (scripts/serve_env.sh): TVM's runtime library,
# tokenizers, FastAPI. No torch, no transformers, no TVM compiler library; `--backend torch` is
# for development machines, not this image.
# ---------------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS serve-env
ARG TARGET
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY requirements.lock pyproject.toml README.md ./
COPY scripts/serve_env.sh scripts/
COPY artifact/ artifact/
COPY compile/ compile/
COPY service/ service/
COPY loadtest/ loadtest/
RUN scripts/serve_env.sh /opt/venv

# CUDA user-space libraries, from NVIDIA's pip wheels (CUDA 13, the version TVM's wheel links:
# libtvm_runtime_cuda.so NEEDs libcudart.so.13 and libcuda.so.1). TVM 0.27 stores CUDA kernels
# in the .so files as CUDA *source* and compiles them when a library is loaded, through
# tvm.support.nvcc's NVRTC path, so serving needs more than libcudart:
#   nvidia-cuda-runtime  libcudart.so.13 and cuda_runtime.h
#   nvidia-cuda-nvrtc    libnvrtc.so.13 and libnvrtc-builtins.so.13.0
#   nvidia-cuda-cccl     the cuda/std/* headers the generated kernels include
#   cuda-bindings        the Python NVRTC binding tvm.support.nvcc calls
# TVM looks for the CCCL headers under $CUDA_PATH/targets/x86_64-linux/include (the toolkit's
# layout), so that path is linked to the wheel's include directory. libcuda.so.1 is the
# driver's and is mounted by the NVIDIA container toolkit at run time.
# (An nvidia/cuda:13.0.x-runtime-ubuntu24.04 base would give libcudart and libnvrtc but
# neither the headers nor cuda-bindings, and Python 3.12 instead of the tested 3.11.)
RUN if [ "$TARGET" = cuda ]; then \
        /opt/venv/bin/pip install nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-cccl==13.0.85 \
            cuda-bindings==13.0.3 \
        && cu13=/opt/venv/lib/python3.11/site-packages/nvidia/cu13 \
        && mkdir -p "$cu13/targets/x86_64-linux" \
        && ln -s ../../include "$cu13/targets/x86_64-linux/include"; \
    fi

# ---------------------------------------------------------------------------------------------
# runtime: the serving venv and the artifacts only; no compiler, no torch, no source tree, no pip cache
# ---------------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS runtime-common
# A fixed numeric UID, so Kubernetes' runAsNonRoot can check it. /data holds a --model-id's
# downloads and compiled artifacts, as TEI's image keeps its models there: mount a volume on it
# (`-v $PWD/data:/data`) so that a model is downloaded and compiled once.
RUN useradd --system --no-log-init --uid 10001 --user-group --no-create-home --home-dir /tmp bert \
    && install -d -o 10001 -g 10001 /data
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    HF_HUB_CACHE=/data/hub \
    BERT_SERVE_ARTIFACT_CACHE=/data/artifacts \
    BERT_SERVE_HOST=0.0.0.0 \
    BERT_SERVE_PORT=8080 \
    BERT_SERVE_GRPC_PORT=50051

FROM runtime-common AS runtime-base
COPY --from=serve-env /opt/venv /opt/venv
COPY --from=build /opt/bert/artifacts /opt/bert/artifacts

FROM runtime-base AS runtime-cpu

FROM runtime-base AS runtime-cuda
ENV CUDA_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cu13 \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia/cu13/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---------------------------------------------------------------------------------------------
# compiling (`docker build --build-arg TARGET=cpu --target compiling`): the runtime, and what a first
# start of a --model-id compiles it with for the node's CPU: the build stage's environment (the
# `compile` extra: torch, transformers, TVM's compiler) and g++, which links every library; the
# default compile config in /opt/bert/configs. The same user, ports, health check and entry point.
# ---------------------------------------------------------------------------------------------
FROM runtime-common AS compiling
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*
ENV BERT_SERVE_CONFIG=/opt/bert/configs/default.yaml
COPY --from=build /opt/venv /opt/venv
COPY --from=build /src/configs/default.yaml /opt/bert/configs/default.yaml
COPY --from=build /opt/bert/artifacts /opt/bert/artifacts
USER 10001:10001
EXPOSE 8080 50051
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BERT_SERVE_PORT', '8080'), timeout=4); sys.exit(0)"]
ENTRYPOINT ["bert-serve"]
CMD ["--artifacts", "/opt/bert/artifacts"]

# The final stage is runtime-cpu or runtime-cuda. DL3006 ("always tag the version of an image")
# is a false positive here: runtime-${TARGET} names one of the two stages above, not an image
# from a registry, and hadolint does not expand the build argument.
# hadolint ignore=DL3006
FROM runtime-${TARGET} AS runtime
USER 10001:10001
EXPOSE 8080 50051
# /health is "alive"; readiness (/ready, 503 until warmed up) is for the orchestrator.
# Python's urllib instead of curl: nothing extra in the image. Non-2xx or no answer -> exit 1.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('BERT_SERVE_PORT', '8080'), timeout=4); sys.exit(0)"]
# Arguments after the image name go to bert-serve, as TEI's image takes them
# (`docker run IMAGE --model-id ORG/NAME`); without any, it serves the artifacts compiled above.
# Every other setting comes from the BERT_SERVE_* environment variables above (a ConfigMap
# overrides them in Kubernetes).
ENTRYPOINT ["bert-serve"]
CMD ["--artifacts", "/opt/bert/artifacts"]
