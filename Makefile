# Two commands set everything up on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test install demo lock clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch comes from local disk; install it first so no CUDA build is pulled.
	# --no-compile: a module's bytecode is written when it is first imported (PYTHONDONTWRITEBYTECODE
	# is unset below), not for all ~30k files up front.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[ucx,test]'
	touch $(STAMP)

install: $(STAMP)

# Bytecode is cached (in the venv and the checkout's gitignored __pycache__ folders) even where the
# environment turns it off: every process of a stack imports torch and the project.
RUN := env -u PYTHONDONTWRITEBYTECODE $(PY)

up: $(STAMP)
	$(RUN) -m launcher

demo: $(STAMP)
	$(RUN) -m common.engine.demo

# Test files run in TEST_WORKERS processes, each file whole in one (--dist loadfile): most tests wait
# on processes they started, so three share two cores well.  TEST_WORKERS=0 runs them in this one.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(RUN) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# Regenerate requirements/*.lock (the images' pinned, hashed dependencies) after a pyproject change; needs uv.
lock:
	bash requirements/compile.sh

clean:
	rm -rf $(VENV)
