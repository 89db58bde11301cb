# The two commands of the README. Each installs what it needs (scripts/install.sh is idempotent).
.PHONY: install demo test bench lint

install:
	bash scripts/install.sh

demo: install
	.venv/bin/saoserve demo --out report

test: install
	.venv/bin/pytest -q -p no:cacheprovider

bench: install
	.venv/bin/python bench/bench_serving.py
	.venv/bin/python bench/bench_sao_step.py

lint: install
	.venv/bin/ruff check .
