# The two set-up commands of the README: `make demo` and `make test`. Each builds .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 (CPU build) lies on this kind of machine's disk; pinning it avoids a multi-GB CUDA download.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench published fuzz calibration-repeat clean venv sysdeps gpu-kit

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)" -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# The main job on the embedded default: an unmodified DDP script as rank 0 of 64 CPU ranks.
demo: venv
	mkdir -p out
	$(BIN)/nbox run topologies/cpu-64-demo.yaml --report out/demo-run.json --trace out/demo-trace.json \
		-- $(BIN)/python examples/ddp_train.py --steps 30

# Root tests need iptables (the user-space delay relay, loss) and ping; the metrics test needs a real
# Prometheus server (Debian's, with promtool); the docker runtime's tests need a Docker engine, Debian's
# docker-compose (1.29) and mmdebstrap (its images come from Debian packages: no registry here).
# Install them as root when missing. The tests start dockerd themselves when none answers and stop
# the one they started (tests/conftest.py, docker_engine).
sysdeps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		! { command -v iptables && command -v ping && command -v prometheus && command -v promtool && \
		    command -v dockerd && command -v docker-compose && command -v mmdebstrap; } >/dev/null; then \
		echo "installing iptables, ping, prometheus, docker.io, docker-compose and mmdebstrap for the tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iputils-ping prometheus \
			docker.io docker-compose mmdebstrap >/dev/null; \
	fi

test: venv sysdeps
	$(BIN)/python -m pytest -q

# Issue 31's long hostile-input fuzz (10,000 inputs per surface; about 1.5 minutes on 2 cores):
# writes benchmarks/results/fuzz_hostile.json. The default test suite runs 300 per surface.
fuzz: venv
	$(BIN)/python benchmarks/fuzz_hostile.py --examples 10000

bench: venv
	$(BIN)/python benchmarks/model_speed.py
	$(BIN)/python benchmarks/flow_speed.py
	$(BIN)/python benchmarks/emu_overhead.py

# The nccl model against published nccl-tests runs (benchmarks/published/); --write refits the
# shipped hardware profiles (neuronabox/model/hardware/) from them.
published: venv
	$(BIN)/python benchmarks/published_accuracy.py --write

# Issue 28 part 4: five calibrations of one 2-node netns cluster at 100 and at 300 Mbit/s, the
# spread of what they predict and what each profile's own samples allow (root; about 20 min):
# writes benchmarks/results/calibration_repeat.{md,json}.
calibration-repeat: venv
	$(BIN)/python benchmarks/calibration_repeat.py --calibrations 5 --rates 100,300

# Wheels for benchmarks/gpu_checks.sh on the lent GPU machine, which has torch, numpy and transformers
# but no package index: neuronabox's other dependencies but matplotlib, pytest, and theirs (pinned
# together, as pydantic pins pydantic-core; pytest's for Python 3.10 named, as pip download reads
# dependency markers for the Python it runs on), for CPython 3.10-3.13 on x86_64 Linux. It travels
# with the run (carry .gpu-kit).
GPU_KIT_WHEELS := pydantic PyYAML Jinja2 networkx typer rich prometheus-client psutil pyroute2 wrapt nvidia-ml-py pytest \
	exceptiongroup tomli
gpu-kit:
	rm -rf .gpu-kit && mkdir -p .gpu-kit/wheels
	for v in 3.10 3.11 3.12 3.13; do \
		$(PYTHON) -m pip download -q --only-binary=:all: --implementation cp --python-version $$v \
			--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
			-d .gpu-kit/wheels $(GPU_KIT_WHEELS) || exit 1; \
	done
	du -sh .gpu-kit

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info .gpu-kit
