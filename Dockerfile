# syntax=docker/dockerfile:1.7
# The serverless LLM worker: CUDA base, Python, the pinned requirements (CUDA torch with the Triton
# it depends on), the package, and optionally a model baked in at build time.
#
#   docker build -t serverless-llm .                                    # configure by env vars
#   docker build -t my-model --build-arg MODEL_NAME=org/model --build-arg BASE_PATH=/models \
#       --secret id=HF_TOKEN,env=HF_TOKEN .                             # model baked in
#
# docker-bake.hcl names the CUDA variants. HF_TOKEN is only ever a BuildKit secret: it is never
# a build arg or an ENV, so it cannot land in an image layer or its history.

# The base image's CUDA sets the host driver the image needs (NVIDIA_REQUIRE_CUDA). The CUDA
# libraries themselves come with torch's wheels, so the small `base` flavour is enough.
ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION}

# Where torch comes from. Empty: PyPI, whose torch 2.13 wheels are built for CUDA 13.0; for
# CUDA 12.6, the PyTorch index https://download.pytorch.org/whl/cu126 (see docker-bake.hcl).
ARG TORCH_INDEX_URL=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Non-empty: a C compiler in the image, so a worker on CPU runs the native CPU kernels
# (docs/engine.md, "CPU speed"; without one it runs the torch path), and with a baked
# model they are built and measured at build time (below).
ARG CPU_KERNELS=""

# The distribution's Python 3.12. Versions are not pinned: the base image tag fixes the release,
# and the archive drops superseded package versions, so exact pins would break rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && if [ -n "$CPU_KERNELS" ]; then \
        apt-get install -y --no-install-recommends gcc libc6-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /app

# Dependencies first: this layer is reused until requirements.txt changes.
COPY requirements.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch==' requirements.txt)"; \
    fi \
    && pip install -r requirements.txt

COPY pyproject.toml README.md ./
COPY src ./src
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps .

# Storage root: `<BASE_PATH>/huggingface-cache/hub` holds downloaded models. /runpod-volume is
# the network volume when one is attached (one download, shared by every worker); for a baked
# model choose a path no volume is mounted over, such as /models.
ARG BASE_PATH=/runpod-volume
ENV BASE_PATH=${BASE_PATH}

COPY builder ./builder

# Optional baked model. Empty MODEL_NAME: nothing is downloaded and the worker reads MODEL_NAME
# from the endpoint's environment. Build args reach the script as environment variables; the
# token only as the secret file, mounted for this step alone. huggingface_hub's own cache (Xet
# chunks) goes to a cache mount, not into the layer.
ARG MODEL_NAME=""
ARG MODEL_REVISION=""
# DL3064 reads "TOKEN" in these names as a secret: they name a tokenizer repo and its revision.
# hadolint ignore=DL3064
ARG TOKENIZER_NAME=""
# hadolint ignore=DL3064
ARG TOKENIZER_REVISION=""
ARG QUANTIZATION=""
# LoRA adapters to bake beside the model (docs/lora.md): hub repos are downloaded too.
ARG ENABLE_LORA=""
ARG LORA_MODULES=""
RUN --mount=type=secret,id=HF_TOKEN,required=false \
    --mount=type=cache,target=/root/.cache/huggingface \
    if [ -n "$MODEL_NAME" ]; then python builder/download_model.py --no-progress; fi

# Baked kernels (docs/engine.md, "Cold start"): with a baked model, its Triton kernels compiled
# for these GPU architectures (TORCH_CUDA_ARCH_LIST style; empty: none) into the image's cache,
# with no GPU at build time. The list follows the settings this build declares (MODEL_NAME,
# QUANTIZATION, ENABLE_LORA) and the defaults of the rest (DTYPE, MAX_MODEL_LEN, BLOCK_SIZE...);
# a deployment that changes those compiles what differs at start (its warm-up line counts it).
ARG KERNEL_ARCH_LIST="8.0 8.6 8.9 9.0 10.0"
ENV BAKED_TRITON_CACHE_DIR=/opt/triton-cache
RUN if [ -n "$MODEL_NAME" ] && [ -n "$KERNEL_ARCH_LIST" ]; then \
        TRITON_CACHE_DIR=$BAKED_TRITON_CACHE_DIR python builder/compile_kernels.py; \
    fi

# Baked native CPU kernels (docs/engine.md, "Cold start"): with a baked model and a compiler
# (CPU_KERNELS), the library built and the linears' row choice measured for the build machine's
# CPU into the image. A worker on the same kind of CPU skips both; on another CPU (model, flags,
# core count) the keys differ and it builds and measures its own. With a network volume the
# worker keeps its cache under BASE_PATH and copies these entries there (worker/native_cache.py).
ENV BAKED_NATIVE_KERNEL_CACHE=/opt/cpu-native-cache
RUN if [ -n "$MODEL_NAME" ] && command -v cc >/dev/null 2>&1; then \
        NATIVE_KERNEL_CACHE=$BAKED_NATIVE_KERNEL_CACHE python builder/bake_cpu_kernels.py; \
    fi

CMD ["python", "-m", "serverless_llm.worker"]
