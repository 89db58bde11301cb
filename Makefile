# The two commands of the README. Each installs what it needs (scripts/install.sh is idempotent).
.PHONY: install demo test test-unit bench lint

install:
	bash scripts/install.sh

demo: install
	.venv/bin/saoserve demo --out report

# Bytecode is written even where the shell says not to (PYTHONDONTWRITEBYTECODE): without it,
# every run compiles and assertion-rewrites every module again (README, the fast tier's figures).
test: install
	PYTHONDONTWRITEBYTECODE= .venv/bin/pytest -q -p no:cacheprovider

# The fast tier, tests/unit: pure modules and plans, no engine, model, broker or PostgreSQL
# (tests/conftest.py refuses a test there that asks for one); two workers (pytest-xdist), one per
# core, each with one torch thread: two workers of two OpenMP threads each on two cores spin
# against each other (README, the fast tier's figures).
test-unit: install
	PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 .venv/bin/pytest -q -p no:cacheprovider tests/unit -n 2

bench: install
	.venv/bin/python bench/bench_serving.py
	.venv/bin/python bench/bench_sao_step.py

lint: install
	.venv/bin/ruff check .
