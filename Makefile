# make test  - the whole suite (python3 -m unittest), closing with "N passed, N failed, N skipped"
# make bench - speed and memory ratios, printed as a table
# make demo  - build and show an example store in a temporary home
SHELL := /bin/bash
PYTHON ?= python3

.PHONY: test bench demo

test:
	@log=$$(mktemp); \
	$(PYTHON) -m unittest discover -t . -s . -p 'test_*.py' 2>&1 | tee "$$log"; \
	status=$${PIPESTATUS[0]}; \
	awk -v status="$$status" ' \
	  /^Ran [0-9]+ test/ { ran = $$2 } \
	  /^(FAILED|OK)/ { while (match($$0, /(failures|errors|skipped)=[0-9]+/)) { \
	      split(substr($$0, RSTART, RLENGTH), kv, "="); n[kv[1]] = kv[2]; $$0 = substr($$0, RSTART + RLENGTH) } } \
	  END { failed = n["failures"] + n["errors"]; if (status != 0 && failed == 0) failed = 1; \
	        printf "%d passed, %d failed, %d skipped\n", ran - failed - n["skipped"], failed, n["skipped"] }' "$$log"; \
	rm -f "$$log"; \
	exit $$status

bench:
	@$(PYTHON) bench.py

demo:
	@$(PYTHON) -m hermes_state demo
