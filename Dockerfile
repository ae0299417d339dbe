# pagedkv on the CPU: `pagedkv serve` on port 8000, the OpenAI-compatible API.
#
#   docker build -t pagedkv .
#   docker run --rm -p 8000:8000 pagedkv                        # the embedded model
#   docker run --rm -p 8000:8000 -v /models/Qwen3-0.6B:/model pagedkv /model --dtype bfloat16
#
# Arguments after the image name are `pagedkv serve`'s (vLLM's engine arguments); the model
# is the first of them, as in `vllm serve MODEL`. No remote code is ever run.
FROM python:3.12-slim

# a C compiler: pagedkv builds its small CPU kernels (fused norms, packed GEMV, ...) at first
# use, and falls back to torch where none is found
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pagedkv
COPY pyproject.toml README.md ./
COPY src ./src
COPY conformance ./conformance
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir . \
    && pagedkv --version

RUN useradd --create-home pagedkv
USER pagedkv
ENV PAGEDKV_KERNEL_CACHE=/home/pagedkv/.cache/pagedkv/kernels

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["pagedkv", "serve", "--host", "0.0.0.0", "--port", "8000"]
