# The commands README.md shows; .ci/run calls the same targets.
.PHONY: setup serve test lint

setup:
	scripts/setup.sh

serve: setup
	.venv/bin/tokenmill serve

test:
	scripts/test.sh

lint:
	.venv/bin/python -m ruff check tokenmill tests benchmarks
