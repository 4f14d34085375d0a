#!/usr/bin/env bash
# Fetch, here (where pip reaches PyPI), the wheels that the GPU machine's Python lacks, into
# .whl/, for tools/device_check.sh to install there. Its image has torch, transformers, numpy,
# httpx, prometheus-client, matplotlib, hypothesis and pytest, but not tierlm's server stack
# (pydantic, fastapi, uvicorn), redis, OpenTelemetry, the anthropic/openai SDKs the tests
# drive, peft (the LoRA tests' reference) or compressed-tensors (the quantized checkpoints'
# reference). Python 3.12, x86-64 (as seen in December 2026). About 10 MB.
#
#   bash tools/device_wheels.sh && echo /.whl/ >> .git/info/exclude
#   # then, with the device tool: run(command="bash tools/device_check.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 redis==8.1.0 pytest-asyncio==1.5.0 \
  anthropic==2.14.0 openai==3.57.0 jiter==0.19.0 distro==1.9.0 docstring_parser==0.18.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1 anyio==4.16.0 typing_extensions==4.16.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
  opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0 protobuf==7.36.2 \
  peft==0.21.2 accelerate==1.16.0 psutil==7.2.2 PyYAML==6.0.3 compressed-tensors==0.20.1 loguru==0.7.3
ls .whl | wc -l
