# maxtrain image for TPU VMs / GKE TPU node pools (default) or NVIDIA GPUs:
#   docker build -t maxtrain .                          # TPU (jax and the pinned libtpu)
#   docker build --build-arg ACCELERATOR=cuda -t maxtrain:cuda .   # GPU (jax[cuda12] wheels bundle CUDA)
#   docker run --rm maxtrain configs/base.yml steps=20    # (GPU: docker run --gpus all ...)
FROM python:3.12-slim
ARG ACCELERATOR=tpu
RUN case "$ACCELERATOR" in tpu|cuda) ;; *) echo "ACCELERATOR must be tpu or cuda" >&2; exit 1 ;; esac
WORKDIR /maxtrain
# Dependencies first (cached across code edits), then the code.
COPY pyproject.toml README.md ./
COPY maxtrain/__init__.py maxtrain/__init__.py
RUN pip install --no-cache-dir ".[${ACCELERATOR}]" && pip uninstall -y maxtrain
COPY . .
RUN pip install --no-cache-dir --no-deps -e .
ENTRYPOINT ["python", "-m", "maxtrain.train"]
CMD ["configs/base.yml"]
