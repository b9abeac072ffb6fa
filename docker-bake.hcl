# docker buildx bake: the worker image for each CUDA version, and a model baked in.
#
#   docker buildx bake                      # the default group: one image per CUDA version
#   docker buildx bake --push               # the same, pushed to REGISTRY/IMAGE
#   HF_TOKEN=hf_... MODEL_NAME=org/model docker buildx bake baked
#
# Tags are <REGISTRY>/<IMAGE>:<TAG>-cuda<version>. worker-config.json names the same tags
# (python -m serverless_llm.worker.console_form), and a test keeps the two in step.

variable "REGISTRY" {
  default = "docker.io/serverless-llm"
}

variable "IMAGE" {
  default = "worker"
}

variable "TAG" {
  default = "0.1.0"
}

# The baked-model example: any hub repo the engine supports. Gated or private repos need
# HF_TOKEN in the environment of `docker buildx bake`; it goes in as a BuildKit secret only.
variable "MODEL_NAME" {
  default = "HuggingFaceTB/SmolLM2-135M-Instruct"
}

variable "MODEL_REVISION" {
  default = ""
}

variable "BAKED_TAG" {
  default = "smollm2-135m-instruct"
}

group "default" {
  targets = ["cuda-13-0", "cuda-12-6"]
}

group "baked" {
  targets = ["baked-model"]
}

target "_common" {
  context    = "."
  dockerfile = "Dockerfile"
  platforms  = ["linux/amd64"]
}

# CUDA 13.0: torch's wheels on PyPI are built for it. Needs a host driver >= 580.
target "cuda-13-0" {
  inherits = ["_common"]
  args = {
    CUDA_VERSION    = "13.0.0"
    TORCH_INDEX_URL = ""
  }
  tags = ["${REGISTRY}/${IMAGE}:${TAG}-cuda13.0"]
}

# CUDA 12.6: torch's cu126 wheels from the PyTorch index, for hosts with older drivers (>= 560).
target "cuda-12-6" {
  inherits = ["_common"]
  args = {
    CUDA_VERSION    = "12.6.3"
    TORCH_INDEX_URL = "https://download.pytorch.org/whl/cu126"
  }
  tags = ["${REGISTRY}/${IMAGE}:${TAG}-cuda12.6"]
}

# A model baked in: downloaded at build time into /models (a path no network volume is mounted
# over), and served with the hub switched off.
target "baked-model" {
  inherits = ["cuda-12-6"]
  args = {
    MODEL_NAME     = "${MODEL_NAME}"
    MODEL_REVISION = "${MODEL_REVISION}"
    BASE_PATH      = "/models"
  }
  secret = ["id=HF_TOKEN,env=HF_TOKEN"]
  tags   = ["${REGISTRY}/${IMAGE}:${TAG}-${BAKED_TAG}-cuda12.6"]
}
