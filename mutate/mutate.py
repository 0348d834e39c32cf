"""`make mutate`: does the suite catch the bugs that matter? Standard library only.

Owns the list of named mutants and the runner. A mutant is one literal text
replacement in one module: a small, realistic bug a developer could make. For
each mutant the runner copies the files git knows (as they are in the working
tree) to a temp folder, applies the replacement there, runs the suite with a
timeout and reports KILLED (a test failed), SURVIVED (every test passed) or
TIMEOUT. It never edits the repository.

A mutant whose old text is not found exactly once is STALE, and one whose
replacement does not compile is BROKEN: the code moved on and the mutant must
follow it. Either makes the run fail, so the list cannot rot silently.

    python3 mutate/mutate.py                      # every mutant, 2 at a time, then the score
    python3 mutate/mutate.py 'cycle-*' pk-heal-oldest-wins   # some, by name or pattern
    python3 mutate/mutate.py --list | --check     # list them; only check they still apply
    python3 mutate/mutate.py --quick NAME         # only the mutant's own tests (no score)
    python3 mutate/mutate.py --quick NAME --tests test_x.Class.test_y   # does this test kill it?

Each mutant names the tests that should kill it; they run first and a failure
there is a kill. Only when they pass does the whole suite run. Slow (minutes),
so it is not part of `make test` or CI.
"""

import argparse
import concurrent.futures
import fnmatch
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import namedtuple
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = ("-m", "unittest", "discover", "-t", ".", "-s", ".", "-p", "test_*.py")
DEFAULT_TIMEOUT = 900
DEFAULT_JOBS = 2
MIN_SCORE = 95.0

Mutant = namedtuple("Mutant", "name module old new behaviour tests")

MUTANTS = [
    # -- schema reconcile ------------------------------------------------------
    Mutant("reconcile-trusts-schema-version", "hermes_state_schema.py",
           "        self._reconcile_columns(conn, objects)\n        self._heal_gateway_routing_pk(conn, objects)\n",
           "        if (conn.execute(SELECT_SCHEMA_VERSION_SQL).fetchone()[0] or 0) < SCHEMA_VERSION:\n"
           "            self._reconcile_columns(conn, objects)\n        self._heal_gateway_routing_pk(conn, objects)\n",
           "columns are added only when schema_version is behind, not whenever one is missing",
           ["test_hermes_state_schema"]),
    Mutant("indexes-before-reconcile", "hermes_state_schema.py",
           "        self._reconcile_columns(conn, objects)\n        self._heal_gateway_routing_pk(conn, objects)\n"
           "        # A store that has messages gets schema 31's message indexes after the pass, each alone.\n"
           "        later = INDEXES_BUILT_AFTER_THE_PASS if \"messages\" in objects else ()\n"
           "        left = self._ensure_deferred_indexes(conn, objects, later)\n",
           "        later = INDEXES_BUILT_AFTER_THE_PASS if \"messages\" in objects else ()\n"
           "        left = self._ensure_deferred_indexes(conn, objects, later)\n"
           "        self._reconcile_columns(conn, objects)\n        self._heal_gateway_routing_pk(conn, objects)\n",
           "deferred indexes are built before the columns they name exist",
           ["test_hermes_state_schema"]),
    Mutant("not-null-added-as-declared", "hermes_state_schema.py",
           '            type_expr = type_expr.replace("NOT NULL", "").strip()\n',
           "            type_expr = type_expr.strip()\n",
           "a NOT NULL column without a default is added as declared, which SQLite refuses",
           ["test_hermes_state_schema"]),
    Mutant("default-expression-unparenthesised", "hermes_state_schema.py",
           '        return f"DEFAULT ({default})"\n',
           '        return f"DEFAULT {default}"\n',
           "an expression default loses the parentheses ALTER TABLE needs",
           ["test_hermes_state_schema"]),
    Mutant("pk-columns-declared-not-null", "hermes_state_schema.py",
           "    if notnull and not in_pk:\n",
           "    if notnull:\n",
           "primary-key columns get NOT NULL in the rebuilt type expression",
           ["test_hermes_state_schema"]),
    # -- gateway_routing primary-key heal --------------------------------------
    Mutant("pk-heal-oldest-wins", "hermes_state_schema.py",
           '" FROM {side} ORDER BY updated_at ASC"',
           '" FROM {side} ORDER BY updated_at DESC"',
           "on a key collision the oldest routing row wins instead of the newest",
           ["test_hermes_state_schema"]),
    Mutant("pk-heal-drops-the-losers", "hermes_state_schema.py",
           "        if copied == kept:\n            conn.execute(DROP_TABLE_SQL.format(table=side))\n",
           "        if True:\n            conn.execute(DROP_TABLE_SQL.format(table=side))\n",
           "the side table is dropped even when rows lost a collision (data deleted)",
           ["test_hermes_state_schema"]),
    Mutant("pk-heal-gated-on-a-column", "hermes_state_schema.py",
           'live_primary_key(conn, "gateway_routing") == GATEWAY_ROUTING_PK:',
           '"scope" in live_columns(conn, "gateway_routing"):',
           "the heal looks for the scope column (which reconcile just added), not at the key",
           ["test_hermes_state_schema"]),
    # -- active-NULL repair -----------------------------------------------------
    Mutant("null-active-first-chunk-only", "hermes_state_schema.py",
           "            if done < size:\n                return total\n",
           "            return total\n",
           "the repair shows only the first chunk of hidden messages",
           ["test_hermes_state_schema", "test_lock_holds"]),
    Mutant("null-active-gated-on-version", "hermes_state_schema.py",
           'WHERE active IS NULL LIMIT 1") is None:\n',
           'WHERE active IS NULL LIMIT 1") is None or \\\n'
           "                self._read_one(SELECT_SCHEMA_VERSION_SQL)[0] == SCHEMA_VERSION:\n",
           "the repair is skipped on a store that claims the current version",
           ["test_hermes_state_schema"]),
    Mutant("null-active-revives-rewound", "hermes_state_schema.py",
           "SELECT id FROM messages WHERE active IS NULL LIMIT ?",
           "SELECT id FROM messages WHERE active IS NOT 1 LIMIT ?",
           "the repair also brings back messages a rewind hid",
           ["test_hermes_state_schema"]),
    # -- short write-lock holds (issue 17) ---------------------------------------
    Mutant("delete-sweeps-in-one-transaction", "hermes_state_maintenance.py",
           "        room = self.DELETE_CHUNK_ROWS\n", "        room = 10 ** 9\n",
           "a delete removes all its messages in one transaction",
           ["test_lock_holds"]),
    Mutant("open-leaves-a-dead-delete-unswept", "hermes_state.py",
           "            self._finish_abandoned_sweeps()", "            pass",
           "messages a process that died mid-delete left stay until some later delete",
           ["test_lock_holds.DeletesInChunks"]),
    Mutant("open-joins-a-live-sweep", "hermes_state_maintenance.py",
           "                or _within(self.get_meta(SWEEP_BEAT_META), time.time(), self.SWEEP_ALIVE_SECONDS):",
           "                or False:",
           "an open takes over another process's running sweep and waits for all of it",
           ["test_lock_holds.DeletesInChunks"]),
    Mutant("reused-id-shows-deleted-messages", "hermes_state_sessions.py",
           "        self._sweep_before_reuse(session_id)\n", "",
           "a session made again under an id still being swept shows the deleted transcript",
           ["test_lock_holds.DeletesInChunks"]),
    Mutant("sweep-key-insert-or-replace", "hermes_state_maintenance.py",
           "            write_meta(conn, SWEEP_META_PREFIX + session_id, str(upto))",
           "            conn.execute(\"INSERT OR REPLACE INTO state_meta VALUES (?, ?)\", (SWEEP_META_PREFIX + session_id,"
           " str(upto)))",
           "an old state_meta without a primary key gets a sweep key twice, and a second deletion's rows stay",
           ["test_lock_holds.DeletesInChunks"]),
    Mutant("empty-sessions-marked-for-sweep", "hermes_state_maintenance.py",
           "marked = [sid for sid in session_ids if conn.execute(has_messages, (sid,)).fetchone()]",
           "marked = list(session_ids)",
           "deleting sessions without messages takes a sweep transaction for nothing",
           ["test_lock_holds.DeletesInChunks"]),
    Mutant("merge-in-one-step", "hermes_state_fts.py",
           "(-pages if group else pages,)", "(-10 ** 9,)",
           "optimize_fts merges a whole index in one transaction",
           ["test_lock_holds"]),
    # -- cycle detection on import ----------------------------------------------
    Mutant("cycle-check-two-hops", "hermes_state_portability.py",
           "    while current:\n        if current in seen:\n",
           "    while current and len(seen) < 2:\n        if current in seen:\n",
           "cycle detection looks only two links up, so a loop of 3+ sessions is attached",
           ["test_hermes_state_portability.ParentLinks"]),
    Mutant("cycle-check-one-hop", "hermes_state_portability.py",
           "        current = row[0] if row else None\n",
           "        current = None\n",
           "only a self-link counts as a cycle",
           ["test_hermes_state_portability.ImportRejects", "test_hermes_state_portability.ParentLinks"]),
    Mutant("cycle-ignores-payload-links", "hermes_state_portability.py",
           "        if current in pending:\n",
           "        if False:\n",
           "the cycle walk follows only stored links, so a loop inside the payload loses a different link",
           ["test_hermes_state_portability.ParentLinks"]),
    Mutant("unknown-parent-attached", "hermes_state_portability.py",
           "        if conn.execute(SESSION_EXISTS_SQL, (parent,)).fetchone() and \\\n"
           "                not _would_create_cycle(conn, pending, child, parent):\n",
           "        if not _would_create_cycle(conn, pending, child, parent):\n",
           "a link to a parent the store does not hold is kept (a dangling link)",
           ["test_hermes_state_portability.ImportRejects"]),
    # -- FTS5-absent degradation --------------------------------------------------
    Mutant("no-fts5-keeps-triggers", "hermes_state_fts.py",
           "                for name in changed:\n                    _drop(conn, \"trigger\", name)\n",
           "                for name in changed:\n                    pass\n",
           "on a runtime without FTS5 our index triggers stay, so every write to messages fails",
           ["test_hermes_state_search.DegradedRuntimes"]),
    Mutant("no-fts5-keeps-hermes-triggers", "hermes_state_fts.py",
           "            if runnable or not present:\n",
           "            if True:\n",
           "on a runtime without FTS5 hermes-agent's index triggers stay, so every write to messages fails",
           ["test_hermes_state_search.DegradedRuntimes"]),
    Mutant("no-fts5-stamps-the-version", "hermes_state_fts.py",
           "        return not self.fts_caps.fts5\n",
           "        return False\n",
           "without FTS5 the schema version is advanced anyway",
           ["test_hermes_state_search.DegradedRuntimes"]),
    Mutant("no-fts5-index-not-marked-stale", "hermes_state_fts.py",
           "                # Rows written while it was not kept are missing from it.\n"
           "                write_meta(conn, _stale_key(index), \"1\")\n",
           "                # Rows written while it was not kept are missing from it.\n"
           "                logger.info(\"search: the %s index is not kept here\", index)\n",
           "an index whose triggers were dropped or changed is not marked stale, so rows written meanwhile are "
           "never indexed",
           ["test_hermes_state_search.DegradedRuntimes", "test_hermes_state_search.ChangedByAnotherProgram"]),
    Mutant("no-fts5-index-counted-usable", "hermes_state_fts.py",
           "                  and self.fts_caps.fts5 and (index != \"trigram\" or self.fts_caps.trigram)}\n",
           "                  and (index != \"trigram\" or self.fts_caps.trigram)}\n",
           "an index counts as usable on a runtime that cannot maintain it",
           ["test_hermes_state_search.DegradedRuntimes"]),
    Mutant("broken-index-not-marked", "hermes_state_search.py",
           "            self._mark_index_stale(exc, state)\n",
           "            logger.warning(\"search: %s\", exc)\n",
           "an index that fails during a search is not marked stale, so it is served again and never rebuilt",
           ["test_hermes_state_search.DegradedRuntimes"]),
    # -- our index among hermes-agent's releases -------------------------------------------------
    Mutant("changed-stamp-trusted", "hermes_state_fts.py",
           "        if read_meta(conn, META_SEARCH_LAYOUT) != str(SEARCH_LAYOUT_VERSION):\n",
           "        if read_meta(conn, META_SEARCH_LAYOUT) is None and False:\n",
           "another program's change of our layout stamp goes unnoticed: the index is not rebuilt",
           ["test_hermes_state_search.ChangedByAnotherProgram"]),
    Mutant("replaced-trigger-kept", "hermes_state_fts.py",
           "            if same_ddl(sql, ddl):\n                continue\n",
           "            if sql is not None:\n                continue\n",
           "a trigger or table of ours another program replaced is kept, so our index drifts from the messages",
           ["test_hermes_state_search.ChangedByAnotherProgram"]),
    Mutant("previous-layout-left-under-hermes-names", "hermes_state_fts.py",
           "        if not old and not leftovers:\n            return False\n",
           "        if True:\n            return False\n",
           "our old index stays under hermes-agent's names, which 0.22 rewrites into one that refuses every write",
           ["test_releases.OurPreviousLayout"]),
    Mutant("hermes-cjk-triggers-kept", "hermes_state_fts.py",
           "            runnable = index != \"cjk\" and self.fts_caps.fts5",
           "            runnable = self.fts_caps.fts5",
           "hermes-agent's CJK triggers, which need a tokenizer only its connections load, fail every write here",
           ["test_releases.StoresSharedWithReleases"]),
    Mutant("scan-needs-every-term", "hermes_state_search.py",
           "            tree, sort = (\"or\", [(\"term\", term) for term in _leaves(tree)]), \"newest\"\n",
           "            sort = \"newest\"\n",
           "a mixed-script query with a short CJK term needs all its terms, where hermes-agent needs any",
           ["test_hermes_state_search.SearchBehaviour", "test_hermes_state_search.CjkOnFixtures"]),
    Mutant("doctor-ignores-trigger-damage", "hermes_state_maintenance.py",
           "        report[\"ok\"] = found[0] == [\"ok\"] and not report.get(\"trigger_damage\")\n",
           "        report[\"ok\"] = found[0] == [\"ok\"]\n",
           "doctor says ok while a trigger writes to a column the store lacks (every write fails)",
           ["test_hermes_state_search.ChangedByAnotherProgram"]),
    Mutant("optimize-percent-float", "hermes_state_fts.py",
           "    return {\"phase\": phase, \"percent\": status[\"percent\"],",
           "    return {\"phase\": phase, \"percent\": float(status[\"percent\"]),",
           "optimize-storage reports a float percent, which hermes-agent's CLI formats with {:3d} and crashes on",
           ["test_hermes_state_search.OptimizeStorage"]),
    Mutant("like-wildcards-unescaped", "hermes_state_search.py",
           'binds.add("like", f"%{escape_like(term.text)}%")',
           'binds.add("like", f"%{term.text}%")',
           "the LIKE fallback takes % and _ of the query as wildcards",
           ["test_hermes_state_search.WildcardsThroughSearch"]),
    Mutant("like-escape-clause-dropped", "hermes_state_search.py",
           "COALESCE({column}, '') LIKE {{pattern}} ESCAPE '\\\\'",
           "COALESCE({column}, '') LIKE {{pattern}}",
           "the fallback escapes wildcards but SQLite is not told the escape character",
           ["test_hermes_state_search.WildcardsThroughSearch"]),
    Mutant("like-not-null-safe", "hermes_state_search.py",
           "COALESCE({column}, '') LIKE {{pattern}} ESCAPE",
           "{column} LIKE {{pattern}} ESCAPE",
           "a NULL column makes NOT (...) NULL in the fallback, dropping rows the index would return",
           ["test_hermes_state_search.DegradedRuntimes"]),
    Mutant("cjk-queue-not-searched", "hermes_state_search.py",
           "    if index == \"cjk\" and state.cjk_pending:\n",
           "    if False:\n",
           "CJK rows still queued for the side index are not found",
           ["test_hermes_state_search.SearchBehaviour"]),
    # -- the write path: BEGIN IMMEDIATE, retry, budget -------------------------
    Mutant("begin-deferred", "hermes_state.py",
           '        conn.execute("BEGIN IMMEDIATE")\n',
           '        conn.execute("BEGIN")\n',
           "a write transaction starts deferred, taking the write lock only at its first write",
           ["test_concurrency.WritePath"]),
    Mutant("retry-budget-from-the-default", "hermes_state.py",
           "                if elapsed + pause >= budget:\n",
           "                if elapsed + pause >= max(budget, WRITE_BUDGET_SECONDS):\n",
           "the retry loop waits the default 20 s whatever budget the store was given",
           ["test_concurrency.LockedStore"]),
    Mutant("retry-forever", "hermes_state.py",
           "                if elapsed + pause >= budget:\n",
           "                if elapsed + pause >= budget * 1000:\n",
           "the retry loop never gives up while the store stays locked",
           ["test_concurrency.LockedStore"]),
    Mutant("retry-pauses-stay-short", "hermes_state.py",
           "LATE_JITTER = (0.25, 1.0)\n",
           "LATE_JITTER = (0.02, 0.15)\n",
           "timing only: after 2 s of contention a writer keeps retrying every 20-150 ms instead of backing "
           "off to 250 ms-1 s; the same rows are written, with more wake-ups",
           ["test_concurrency.LockedStore"]),
    Mutant("writer-lock-polled-slowly", "hermes_state_lockguard.py",
           "FILE_LOCK_POLL = (0.001, 0.004)\n",
           "FILE_LOCK_POLL = (0.05, 0.2)\n",
           "timing only: waiters poll the writer lock 50 times less often; every write still lands, "
           "throughput with several processes drops (make bench measures it, the suite does not)",
           ["test_concurrency.ManyWriters"]),
    Mutant("no-retry-on-busy", "hermes_state.py",
           "                if isinstance(exc, StoreLockedError) or not is_lock_error(exc):\n",
           "                if True:\n",
           "a busy store fails the write at once instead of being waited out",
           ["test_concurrency.LockedStore"]),
    Mutant("no-rollback-on-error", "hermes_state.py",
           '            if conn.in_transaction:\n                conn.execute("ROLLBACK")\n',
           '            pass\n',
           "a failing callback leaves its transaction open and half-written",
           ["test_concurrency.WritePath"]),
    Mutant("queued-tokens-lost-on-failure", "hermes_state.py",
           "        except BaseException as exc:\n            self._tokens.put_back(batch)\n",
           "        except BaseException as exc:\n",
           "token counts queued before a failed write are dropped with it",
           ["test_concurrency.WritePath", "test_hermes_state_usage.TokenQueue"]),
    Mutant("checkpoint-error-reaches-retry", "hermes_state_wal.py",
           "            busy, frames, copied = conn.execute(\"PRAGMA wal_checkpoint(PASSIVE)\").fetchone()\n"
           "        except sqlite3.Error as exc:\n",
           "            busy, frames, copied = conn.execute(\"PRAGMA wal_checkpoint(PASSIVE)\").fetchone()\n"
           "        except sqlite3.DatabaseError as exc:\n            raise\n"
           "        except sqlite3.Error as exc:\n",
           "a failing checkpoint after COMMIT reaches the retry loop, which writes the rows twice",
           ["test_concurrency.CommittedMeansOnce"]),
    Mutant("writer-file-lock-skipped", "hermes_state.py",
           "        use_file_lock = self._file_lock is not None\n",
           "        use_file_lock = False\n",
           "writes skip the cross-process lock that guards the WAL-reset race",
           ["test_concurrency.LockedStore"]),
    Mutant("thread-lock-waits-forever", "hermes_state.py",
           "        if not self._write_lock.acquire(timeout=budget):\n",
           "        if not self._write_lock.acquire():\n",
           "a thread waits without limit for another thread of the process that keeps writing",
           ["test_concurrency.ThreadsOfOneProcess"]),
    # -- import validation --------------------------------------------------------
    Mutant("import-messages-not-validated", "hermes_state_portability.py",
           "    for position, message in enumerate(messages):\n"
           "        _check_message(position, message, limits[\"depth\"])\n",
           "",
           "messages of an imported session are not checked before the write",
           ["test_hermes_state_portability.ImportRejects"]),
    Mutant("import-limit-off-by-one", "hermes_state_portability.py",
           '    if len(sessions) > limits["sessions"]:\n',
           '    if len(sessions) >= limits["sessions"]:\n',
           "a batch of exactly 500 sessions is refused",
           ["test_hermes_state_portability.CommandLine"]),
    Mutant("import-total-not-summed", "hermes_state_portability.py",
           '    totals["messages"] += len(messages)\n',
           '    totals["messages"] = len(messages)\n',
           "the 50,000-message total is checked per session, not for the payload",
           ["test_hermes_state_portability.ImportRejects"]),
    Mutant("import-flags-not-coerced", "hermes_state_portability.py",
           '    row.update({field: 1 if entry.get(field) else 0 for field in SESSION_FLAG_FIELDS})\n',
           '    row.update({field: entry.get(field) or 0 for field in SESSION_FLAG_FIELDS})\n',
           "an imported flag is stored as given (\"yes\") instead of as hermes-agent's 0/1",
           ["test_hermes_state_portability.ImportFixtures"]),
    Mutant("blob-exported-raw", "hermes_state_portability.py",
           "    return {key: json_default(value) if isinstance(value, BINARY_TYPES) else value\n",
           "    return {key: value\n",
           "exports carry raw bytes, which json.dumps refuses",
           ["test_hermes_state_portability.Blobs", "test_hermes_state_portability.SchemaV31"]),
    Mutant("import-counts-inactive", "hermes_state_portability.py",
           '            if _number(message.get("active"), int, 1):\n',
           '            if True:\n',
           "an imported session's message_count includes its rewound messages",
           ["test_hermes_state_portability.ImportFixtures"]),
    Mutant("import-restores-runtime-fields", "hermes_state_portability.py",
           '    return _carry(row, entry, SESSION_RESET_FIELDS | {"system_prompt"},',
           '    return _carry(row, entry, {"system_prompt", "id", "parent_session_id", "messages", "message_count",'
           ' "tool_call_count"},',
           "an import restores routing, identity, handoff and cooldown fields (runtime ownership)",
           ["test_hermes_state_portability.ImportFixtures"]),
    Mutant("file-import-restages-on-rerun", "hermes_state_portability.py",
           "            if staged and conn.execute(f\"SELECT 1 FROM {target} WHERE id = ?\",\n",
           "            if False and conn.execute(f\"SELECT 1 FROM {target} WHERE id = ?\",\n",
           "a rerun of a killed file import stages its sessions again (duplicate messages)",
           ["test_hermes_state_portability.FileImportStaging"]),
    Mutant("file-import-skips-staged-trigram-rows", "hermes_state_portability.py",
           "                self._index_staged_trigram_rows(conn, IMPORT_STAGING_TABLE, after)\n",
           "                pass\n",
           "a file import's messages never reach the trigram index (3+ letter CJK searches miss)",
           ["test_hermes_state_portability.FileImportStaging"]),
    Mutant("file-import-keeps-the-api-totals", "hermes_state_portability.py",
           "    limits = dict(limits, total_messages=float(\"inf\"), total_bytes=float(\"inf\"))\n",
           "    limits = dict(limits)\n",
           "a file import keeps the API's message and byte totals, so a big export is refused whole",
           ["test_hermes_state_portability.FileImportStaging"]),
    # -- quarantine of damaged files ----------------------------------------------
    Mutant("quarantine-name-not-unique", "hermes_state.py",
           "        for n in itertools.count(1):\n"
           "            backup = path.with_name(stem + (f\"-{n}\" if n > 1 else \"\") + \".bak\")\n"
           "            if not any(os.path.lexists(str(backup) + suffix) for suffix in suffixes):\n"
           "                break\n",
           "        backup = path.with_name(stem + \".bak\")\n",
           "a second store set aside in the same second collides with the first one's backup name",
           ["test_lockguard.SetAsideNames"]),
    Mutant("quarantine-leaves-the-wal", "hermes_state.py",
           "        for suffix in suffixes:\n            source = Path(str(path) + suffix)\n",
           "        for suffix in (\"\",):\n            source = Path(str(path) + suffix)\n",
           "a damaged store's -wal stays behind and is taken for the fresh store's journal",
           ["test_concurrency.DamagedFiles"]),
    Mutant("quarantine-empty-file-is-healthy", "hermes_state.py",
           "    if os.stat(path).st_size == 0:\n        return \"empty\"\n",
           "    if os.stat(path).st_size == 0:\n        return None\n",
           "a zero-length state.db is opened as it is instead of being kept aside",
           ["test_concurrency.DamagedFiles"]),
    Mutant("quarantine-backup-not-private", "hermes_state.py",
           "                    os.chmod(target, FILE_MODE)\n",
           "                    pass\n",
           "a store kept aside keeps whatever mode it had, not 0600",
           ["test_concurrency.DamagedFiles"]),
    # -- redaction -------------------------------------------------------------
    Mutant("redact-ids-too", "hermes_state_redact.py",
           "    if key in exempt:\n        return value\n",
           "",
           "redaction masks session ids that look like keys, so the export no longer imports",
           ["test_hermes_state_portability.Redaction", "test_redaction.RedactionCorpus"]),
    Mutant("redact-top-level-only", "hermes_state_redact.py",
           "            else _redact(value, key, exempt, depth) for key, value in mapping.items()}\n",
           "            else redact_text(value) if isinstance(value, str) and key not in exempt else value\n"
           "            for key, value in mapping.items()}\n",
           "nested values (messages, tool call arguments, model_config) are not redacted",
           ["test_hermes_state_portability.Redaction"]),
    Mutant("redact-pem-first-line-only", "hermes_state_redact.py",
           'r"(?s)(?P<secret>-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----"',
           'r"(?P<secret>-----BEGIN[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----"',
           "a private key spanning several lines (every real one) is masked on its first line only",
           ["test_hermes_state_portability.Redaction", "test_redaction.RedactionCorpus"]),
    Mutant("redact-no-jwt", "hermes_state_redact.py",
           '    ("JSON Web Token",\n'
           '     "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJlLWV4YW1wbGU",\n'
           '     ("eyj",),\n'
           '     r"(?<![\\w-])(?P<secret>eyJ[A-Za-z0-9_-]{5,}\\.eyJ[A-Za-z0-9_-]{5,}\\.[A-Za-z0-9_-]*)"),\n',
           "",
           "JSON Web Tokens go out unmasked unless a secret name stands before them",
           ["test_redaction.RedactionCorpus"]),
    Mutant("cli-export-ignores-redact", "hermes_state_cli.py",
           "redact_secrets=args.redact)",
           "redact_secrets=False)",
           "`export --redact` writes secrets out unmasked",
           ["test_hermes_state_portability.CommandLine"]),
    # -- the server's auth -----------------------------------------------------
    Mutant("server-token-compared-with-equals", "hermes_state_server.py",
           "not hmac.compare_digest(given.strip().encode(),\n"
           "                                                                 self.server.token.encode())",
           "given.strip() != self.server.token",
           "timing only: the token is compared with == (early exit) instead of in constant time",
           ["test_hermes_state_server.Auth"]),
    Mutant("server-no-header-no-check", "hermes_state_server.py",
           '            if handler != "page":\n',
           '            if handler != "page" and "Authorization" in self.headers:\n',
           "a request without an Authorization header is let through",
           ["test_hermes_state_server.Auth"]),
    Mutant("server-scheme-not-checked", "hermes_state_server.py",
           'if scheme.lower() != "bearer" or not hmac.compare_digest(',
           'if not hmac.compare_digest(',
           "any scheme (Basic, Token) carrying the token is accepted",
           ["test_hermes_state_server.Auth"]),
    Mutant("server-token-prefix-accepted", "hermes_state_server.py",
           "not hmac.compare_digest(given.strip().encode(),\n"
           "                                                                 self.server.token.encode())",
           "not self.server.token.startswith(given.strip())",
           "an empty or partial token is accepted",
           ["test_hermes_state_server.Auth"]),
    Mutant("server-restore-before-auth", "hermes_state_server.py",
           '            if handler != "page":\n                self._check_token()\n',
           '            if handler not in ("page", "ops_import"):\n                self._check_token()\n',
           "the whole-home restore runs without the token check (it takes its own path past the gate)",
           ["test_hermes_state_server.Auth"]),
    Mutant("server-logs-query-strings", "hermes_state_server.py",
           '        path = urlsplit(getattr(self, "path", "") or "").path\n',
           '        path = getattr(self, "path", "") or ""\n',
           "the request log keeps query strings (search text, anything a client puts there)",
           ["test_hermes_state_server.Endpoints"]),
    Mutant("server-private-networks-count-as-local", "hermes_state_server.py",
           '        return ipaddress.ip_address(host.strip("[]")).is_loopback\n',
           '        return ipaddress.ip_address(host.strip("[]")).is_private\n',
           "the server listens on a LAN address without --allow-remote",
           ["test_hermes_state_server.Endpoints"]),
    # -- the drop-in contract: sessions ------------------------------------------
    Mutant("create-session-not-resume-safe", "hermes_state_sessions.py",
           "            if row is None:\n                changes.update(id=session_id, source=source,",
           "            if True:\n                changes.update(id=session_id, source=source,",
           "create_session on an existing id fails (it inserts again) instead of filling what the row lacks",
           ["test_hermes_state_sessions.CreateSession", "test_hermes_state.Sessions"]),
    Mutant("create-session-clobbers-stored-values", "hermes_state_sessions.py",
           "    changes = {c: v for c, v in values.items() if v is not None and row[c] is None}\n",
           "    changes = {c: v for c, v in values.items() if v is not None}\n",
           "a later create_session on an existing id overwrites values already stored (a bare call clobbers the model)",
           ["test_hermes_state_sessions.CreateSession"]),
    Mutant("ensure-session-default-source", "hermes_state_sessions.py",
           '    def ensure_session(self, session_id, source="unknown", model=None, **kwargs):\n',
           '    def ensure_session(self, session_id, source="cli", model=None, **kwargs):\n',
           "ensure_session's default source is not hermes-agent's 'unknown'",
           ["test_hermes_state_sessions.CreateSession"]),
    Mutant("routing-inherited-by-every-child", "hermes_state_sessions.py",
           '    if parent["end_reason"] == "compression" and parent["id"] not in (\n',
           '    if parent["id"] not in (\n',
           "a branch or delegate child takes its parent's gateway routing, not only a compression continuation",
           ["test_hermes_state_sessions.CreateSession"]),
    Mutant("host-020-sees-schema-31-columns", "hermes_state_common.py",
           "    if host_is_020():\n        for column in SCHEMA_31_COLUMNS[table].intersection(row):\n",
           "    if False:\n        for column in SCHEMA_31_COLUMNS[table].intersection(row):\n",
           "inside 0.20, session and message dicts carry schema 31's columns (a uid reaches its model)",
           ["test_hermes_state_portability.Exports"]),
    Mutant("end-session-last-end-wins", "hermes_state_sessions.py",
           '" WHERE id = :id AND ended_at IS NULL", session_id, end_reason))',
           '" WHERE id = :id", session_id, end_reason))',
           "a second end_session overwrites the first end's reason and time",
           ["test_hermes_state_sessions.EndAndReopen"]),
    Mutant("resolve-ambiguous-prefix", "hermes_state_sessions.py",
           "        return matches[0][0] if len(matches) == 1 else None\n",
           "        return matches[0][0] if matches else None\n",
           "an ambiguous id prefix resolves to the first match instead of None",
           ["test_hermes_state.Sessions"]),
    Mutant("search-default-limit", "hermes_state_search.py",
           "                        limit=20, offset=0, sort=None, include_inactive=False, fields=None,\n",
           "                        limit=50, offset=0, sort=None, include_inactive=False, fields=None,\n",
           "search_messages returns 50 hits by default instead of hermes-agent's 20",
           ["test_hermes_state_search.SearchBehaviour"]),
    # -- the drop-in contract: titles ----------------------------------------------
    Mutant("title-sanitising-dropped", "hermes_state_common.py",
           '    title = " ".join(_SURROGATES.sub("\\ufffd", title).translate(_TITLE_DROPPED).split())\n',
           '    title = " ".join(_SURROGATES.sub("\\ufffd", title).split())\n',
           "invisible and control characters (zero-width spaces, bidi marks, NUL) stay in a stored title",
           ["test_hermes_state_titles.SanitizeTitle"]),
    Mutant("title-limit-counts-the-raw-title", "hermes_state_common.py",
           "        raise TypeError(f\"title must be a string, not {type(title).__name__}\")\n",
           "        raise TypeError(f\"title must be a string, not {type(title).__name__}\")\n"
           "    if len(title) > TITLE_MAX_LENGTH:\n"
           "        raise ValueError(f\"Title too long ({len(title)} chars, max {TITLE_MAX_LENGTH})\")\n",
           "the 100-character limit counts the title before cleaning, refusing one that fits once cleaned",
           ["test_hermes_state_titles.SanitizeTitle"]),
    Mutant("title-taken-twice", "hermes_state_titles.py",
           "        owner = conn.execute(SELECT_TITLE_OWNER_SQL, (title, session_id)).fetchone()\n"
           "        if owner is None:\n",
           "        owner = conn.execute(SELECT_TITLE_OWNER_SQL, (title, session_id)).fetchone()\n"
           "        if True:\n",
           "a title another session holds is given to a second session",
           ["test_hermes_state_titles.SetTitle"]),
    Mutant("auto-title-replaces-its-equal", "hermes_state_titles.py",
           "                if held >= TITLE_SOURCE_RANK[source]:\n",
           "                if held > TITLE_SOURCE_RANK[source]:\n",
           "a generated title replaces a title of the same authority (a second llm title overwrites the first)",
           ["test_hermes_state_titles.SetTitle"]),
    # -- the drop-in contract: messages, rewind, compression ------------------------
    Mutant("append-to-a-compression-closed-session", "hermes_state_messages.py",
           '    elif row["ended_at"] is not None and row["end_reason"] == COMPRESSION_END_REASON:\n',
           '    elif row["ended_at"] is not None and row["end_reason"] == "compressed":\n',
           "a session compression ended still takes appends and replacements (the check names the wrong reason)",
           ["test_hermes_state_messages.Appending"]),
    Mutant("turn-lease-check-skipped", "hermes_state_messages.py",
           "        if lease_holder:\n            self._check_turn_lease(conn, session_id, lease_holder, lease_ttl)\n",
           "",
           "a write naming a turn-lease holder goes through when another holder has the lease",
           ["test_hermes_state_messages.Appending", "test_hermes_state_gateway.TurnLeases"]),
    Mutant("turn-lease-kept-per-session", "hermes_state_messages.py",
           "        return str(root) if root else session_id\n",
           "        return session_id\n",
           "the turn lease is kept per session, so a compression continuation and its root run turns at once",
           ["test_hermes_state_gateway.TurnLeases", "test_hermes_state_messages.Appending"]),
    Mutant("turn-lease-of-a-dead-holder-kept", "hermes_state_gateway.py",
           'if row is not None and (float(row["expires_at"]) <= now\n'
           '                                    or not holder_is_alive(row["holder"])):\n',
           'if row is not None and (float(row["expires_at"]) <= now):\n',
           "the lease of a holder whose process died is waited out to its expiry instead of taken over",
           ["test_hermes_state_gateway.TurnLeases"]),
    Mutant("compression-lock-expiry-ignored", "hermes_state_gateway.py",
           'if row and (row["expires_at"] < now or not holder_is_alive(row["holder"] or "")):',
           'if row and not holder_is_alive(row["holder"] or ""):',
           "an expired compression lock of a live holder is never taken over",
           ["test_hermes_state.RoutingMetaLocks"]),
    Mutant("rewind-keeps-the-target", "hermes_state_messages.py",
           '"UPDATE messages SET active = 0 WHERE session_id = ? AND id >= ? AND active = 1"',
           '"UPDATE messages SET active = 0 WHERE session_id = ? AND id > ? AND active = 1"',
           "rewind_to_message keeps the target user message live and withdraws only what follows it",
           ["test_hermes_state_messages.RewindAndReplace"]),
    Mutant("conversation-drops-tool-call-id", "hermes_state_messages.py",
           '    if tool_call_id:\n        message["tool_call_id"] = tool_call_id\n',
           '',
           "get_messages_as_conversation loses tool_call_id, which chat APIs require on tool turns",
           ["test_hermes_state_messages.Reading"]),
    Mutant("message-count-skips-rewound", "hermes_state_messages.py",
           '"SELECT COUNT(*) FROM messages WHERE session_id = ?",\n',
           '"SELECT COUNT(*) FROM messages WHERE session_id = ? AND active = 1",\n',
           "message_count(session_id) leaves out rewound and compacted rows, which hermes-agent counts",
           ["test_hermes_state_messages.SmallReads"]),
    Mutant("lineage-tip-first", "hermes_state_compression.py",
           '            lineage.append(child["id"])\n',
           '            lineage.insert(0, child["id"])\n',
           "get_compression_lineage no longer lists ids root to tip",
           ["test_hermes_state_compression.Lineage", "test_hermes_state.Lineage"]),
    Mutant("compaction-deletes-old-turns", "hermes_state_compression.py",
           '"UPDATE messages SET active = 0, compacted = 1 WHERE session_id = ? AND active = 1"',
           '"DELETE FROM messages WHERE session_id = ? AND active = 1"',
           "archive_and_compact deletes the turns it replaces instead of keeping them compacted (data deleted)",
           ["test_hermes_state_compression.ArchiveAndCompact"]),
    Mutant("compaction-lock-not-checked", "hermes_state_compression.py",
           "            if lock_holder is not None and not _holds_lock(conn, session_id, lock_holder):\n",
           "            if False:\n",
           "archive_and_compact publishes after its compression lock was lost to another holder",
           ["test_hermes_state_compression.ArchiveAndCompact"]),
    # -- the drop-in contract: token counts, deletes, handoffs, exports ---------------
    Mutant("tokens-lost-on-close", "hermes_state.py",
           "    def _close_now(self):\n        if self._closed:\n            return\n        try:\n",
           "    def _close_now(self):\n        if self._closed:\n            return\n"
           "        self._closed = True\n        try:\n",
           "close() marks the store closed before applying the queue, so queued token counts are lost",
           ["test_hermes_state_usage.TokenQueue", "test_hermes_state.Sessions"]),
    Mutant("delete-session-leaves-topic-bindings", "hermes_state_maintenance.py",
           "            if bindings:\n                conn.execute(\n"
           "                    f\"DELETE FROM telegram_dm_topic_bindings WHERE session_id IN ({marks})\","
           " chunk)\n",
           "",
           "delete_session leaves the session's Telegram topic bindings pointing at nothing",
           ["test_hermes_state_maintenance.Deleting"]),
    Mutant("handoff-claim-not-compare-and-set", "hermes_state_gateway.py",
           "\" WHERE id = ? AND handoff_state = 'pending'\", (session_id,)) > 0",
           "\" WHERE id = ?\", (session_id,)) > 0",
           "claim_handoff succeeds for every caller, so two gateways both run one handoff",
           ["test_hermes_state_gateway.Handoffs"]),
    Mutant("handoff-requested-over-a-running-one", "hermes_state_gateway.py",
           "            \" WHERE id = ? AND (handoff_state IS NULL OR handoff_state IN ('completed', 'failed'))\",\n",
           "            \" WHERE id = ?\",\n",
           "request_handoff resets a handoff in flight back to pending, so it can be claimed twice",
           ["test_hermes_state_gateway.Handoffs"]),
    Mutant("export-includes-rewound", "hermes_state_portability.py",
           "self._export_reader(cursor, streamed, include_inactive)",
           "self._export_reader(cursor, streamed, True)",
           "export_session includes messages a rewind hid",
           ["test_hermes_state_portability.Exports"]),
    # -- the tally's kinds of children (issue 27) -------------------------------
    Mutant("parent-end-does-not-rejudge-children", "hermes_state_schema.py",
           '{_REJUDGE_CHILDREN.format(ids="old.id, new.id")}',
           '{_REJUDGE_CHILDREN.format(ids="NULL")}',
           "a parent's end, reopen or new routing key no longer moves its children's counts",
           ["test_hermes_state_sessions.CountsKeptForChildren"]),
    Mutant("escaped-marker-counted-unjudged", "hermes_state_schema.py",
           "f\" OR (instr({{r}}.model_config, '\\\\u') = 0 AND {quoted}))))\")",
           "f\" OR {quoted})))\")",
           "a marker spelled with \\u escapes is missed: the tally counts a row Python would not",
           ["test_hermes_state_sessions.CountsKeptForChildren"]),
    Mutant("listing-trigger-of-another-version-kept", "hermes_state_schema.py",
           'and objects[name][0] in ("trigger", "index") and objects[name][1] != sql]',
           'and False]',
           "an open keeps a listing trigger another version made under the same name",
           ["test_hermes_state_schema.ListingAidsOfAnotherVersion"]),
    Mutant("start-page-trusts-judged-kinds", "hermes_state_sessions.py",
           "                if _is_listable(row))\n        return [row for row in batch",
           "                if True)\n        return [row for row in batch",
           "the start-order page lists every row the aids left to Python, subagent runs included",
           ["test_hermes_state_sessions.StartOrderPages"]),
    Mutant("start-page-one-read", "hermes_state_sessions.py",
           "            if chunk < 0 or len(batch) < chunk:\n                break\n"
           "            after, chunk = [batch[-1][\"started_at\"], batch[-1][\"id\"]], chunk * 2\n"
           "        # As _rich_rows_by_id",
           "            break\n        # As _rich_rows_by_id",
           "a start-order page with a row Python hid comes back short instead of reading on",
           ["test_hermes_state_sessions.StartOrderPages"]),
]


# ---------------------------------------------------------------------------
# Applying a mutant
# ---------------------------------------------------------------------------


def tracked_files(repo):
    """Paths (relative) of the files git knows in `repo`."""
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True)
    return [name for name in listing.stdout.decode("utf-8").split("\0") if name]


def copy_repo(repo, target):
    for name in tracked_files(repo):
        source = repo / name
        if source.is_file():
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)


def problem_with(mutant, repo=REPO):
    """Why `mutant` cannot be applied to `repo` as it is (STALE or BROKEN), or None."""
    path = repo / mutant.module
    if not path.is_file():
        return "STALE", f"{mutant.module} does not exist"
    for test in mutant.tests:
        module, _, rest = test.partition(".")
        test_file = repo / (module + ".py")
        names = rest.split(".") if rest else []
        source = test_file.read_text(encoding="utf-8") if test_file.is_file() else None
        if source is None or (names and not re.search(rf"^class {re.escape(names[0])}\b", source, re.M)) or \
                (len(names) > 1 and not re.search(rf"def {re.escape(names[1])}\b", source)):
            return "STALE", f"its test {test} does not exist"
    text = path.read_text(encoding="utf-8")
    found = text.count(mutant.old)
    if found != 1:
        return "STALE", f"its old text is found {found} times in {mutant.module}, not once"
    if mutant.old == mutant.new:
        return "BROKEN", "its new text is its old text"
    try:
        compile(text.replace(mutant.old, mutant.new), mutant.module, "exec")
    except SyntaxError as exc:
        return "BROKEN", f"the mutated {mutant.module} does not compile: {exc}"
    return None


def apply(mutant, copy):
    path = copy / mutant.module
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


# ---------------------------------------------------------------------------
# Running the suite on a copy
# ---------------------------------------------------------------------------

_running = set()
_running_lock = threading.Lock()
_stopping = threading.Event()


def run_tests(copy, args, timeout):
    """(status, output) of `python -m unittest <args>` in `copy`: 'pass', 'fail' or 'timeout'."""
    env = dict(os.environ, PYTHONPATH="", PYTHONDONTWRITEBYTECODE="1", HERMES_HOME=str(copy / ".home"))
    env.pop("HERMES_STATE_JOURNAL", None)
    if _stopping.is_set():
        return "stopped", ""
    process = subprocess.Popen([sys.executable, *args], cwd=copy, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=(os.name == "posix"))
    with _running_lock:
        _running.add(process)
    try:
        output, _ = process.communicate(timeout=timeout)
        return ("pass" if process.returncode == 0 else "fail"), output
    except subprocess.TimeoutExpired:
        _kill(process)
        output, _ = process.communicate()
        return "timeout", output
    finally:
        with _running_lock:
            _running.discard(process)


def _kill(process):
    """End a suite run with every process it started (its own process group)."""
    try:
        if os.name == "posix":
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass


def failing_tests(output):
    """Ids of the tests unittest reports as FAIL or ERROR, in order."""
    ids = []
    for name, where in re.findall(r"^(?:FAIL|ERROR): (\S+) \(([^)\s]+)\)", output, re.M):
        test_id = where if where.endswith("." + name) else f"{where}.{name}"
        if test_id not in ids:
            ids.append(test_id)
    return ids or ["(the tests did not run: " + (output.strip().splitlines() or ["no output"])[-1] + ")"]


Result = namedtuple("Result", "mutant verdict seconds detail")


def run_mutant(mutant, timeout, quick, known_failures=frozenset()):
    """KILLED, SURVIVED, TIMEOUT, STALE or BROKEN, with the killing test or the reason.

    A test that already fails without the mutant (`known_failures`) kills nothing.
    """
    start = time.monotonic()
    problem = problem_with(mutant)
    if problem:
        return Result(mutant, problem[0], 0.0, problem[1])
    failfast = () if known_failures else ("-f",)
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as scratch:
        copy = Path(scratch)
        copy_repo(REPO, copy)
        apply(mutant, copy)
        stages = [("-m", "unittest", *failfast, *mutant.tests)] if mutant.tests else []
        if not quick:
            stages.append(SUITE + failfast)
        for stage in stages:
            status, output = run_tests(copy, stage, timeout)
            if _stopping.is_set():
                return Result(mutant, "STOPPED", time.monotonic() - start, "interrupted")
            if status == "timeout":
                return Result(mutant, "TIMEOUT", time.monotonic() - start, f"a suite run passed {timeout}s")
            new = [t for t in failing_tests(output) if t not in known_failures] if status == "fail" else []
            if new:
                return Result(mutant, "KILLED", time.monotonic() - start, new[0])
    detail = mutant.behaviour + (" (its own tests only: --quick)" if quick else "")
    return Result(mutant, "SURVIVED", time.monotonic() - start, detail)


def baseline(timeout, tests=None):
    """(status, failing test ids) of the suite, or of `tests`, on an unmutated copy."""
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as scratch:
        copy = Path(scratch)
        copy_repo(REPO, copy)
        status, output = run_tests(copy, ("-m", "unittest", *tests) if tests else SUITE, timeout)
        return status, (failing_tests(output) if status == "fail" else [])


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def select(patterns):
    if not patterns:
        return list(MUTANTS)
    chosen, unknown = [], []
    for pattern in patterns:
        matched = [m for m in MUTANTS if fnmatch.fnmatchcase(m.name, pattern)]
        if not matched:
            unknown.append(pattern)
        chosen += [m for m in matched if m not in chosen]
    if unknown:
        raise SystemExit(f"mutate.py: no mutant named {', '.join(unknown)} (see --list)")
    return chosen


def print_result(result, done, total):
    print(f"[{done:>2}/{total}] {result.verdict:<8} {result.mutant.name:<38} {result.seconds:6.1f}s  "
          f"{result.detail}", flush=True)


def summary(results, wall, min_score):
    """Print the score line; returns the exit status."""
    counts = {verdict: sum(r.verdict == verdict for r in results)
              for verdict in ("KILLED", "SURVIVED", "TIMEOUT", "STALE", "BROKEN")}
    ran = counts["KILLED"] + counts["SURVIVED"] + counts["TIMEOUT"]
    detected = counts["KILLED"] + counts["TIMEOUT"]
    score = 100.0 * detected / ran if ran else 0.0
    print(f"\n{len(results)} mutants: {counts['KILLED']} killed, {counts['SURVIVED']} survived, "
          f"{counts['TIMEOUT']} timed out, {counts['STALE']} stale, {counts['BROKEN']} broken; "
          f"score {detected}/{ran} = {score:.1f}% (needs {min_score:g}%); {wall:.0f}s")
    for result in results:
        if result.verdict == "SURVIVED":
            print(f"  survived: {result.mutant.name}: {result.mutant.behaviour}")
    for result in results:
        if result.verdict in ("STALE", "BROKEN"):
            print(f"  {result.verdict.lower()}: {result.mutant.name}: {result.detail}; update it in mutate.py")
    if counts["STALE"] or counts["BROKEN"] or score < min_score:
        return 1
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mutate.py", description="Mutation testing of the suite.")
    parser.add_argument("names", nargs="*", metavar="NAME", help="mutants to run (names or patterns); default all")
    parser.add_argument("-j", "--jobs", type=int, default=DEFAULT_JOBS, help="mutants run at once (default 2)")
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, help="seconds per suite run")
    parser.add_argument("--min-score", type=float, default=MIN_SCORE, help="fail below this percentage")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run first")
    parser.add_argument("--quick", action="store_true", help="only each mutant's own tests, not the suite")
    parser.add_argument("--tests", nargs="+", metavar="TEST", help="with --quick: these tests instead of each "
                        "mutant's own (does a given test kill a given bug?)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--check", action="store_true", help="only check that every mutant still applies")
    args = parser.parse_args(argv)
    mutants = select(args.names)
    if args.tests:
        if not args.quick:
            parser.error("--tests goes with --quick (a score always runs the whole suite)")
        mutants = [m._replace(tests=list(args.tests)) for m in mutants]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name:<38} {mutant.module:<28} {mutant.behaviour}")
        return 0
    if args.check:
        problems = [(m, problem_with(m)) for m in mutants]
        for mutant, problem in problems:
            if problem:
                print(f"{problem[0]:<8} {mutant.name}: {problem[1]}")
        bad = sum(1 for _m, p in problems if p)
        print(f"{len(mutants) - bad} of {len(mutants)} mutants apply")
        return 1 if bad else 0
    start = time.monotonic()
    known_failures = []
    try:
        if not args.no_baseline:
            tests = sorted({t for m in mutants for t in m.tests if not problem_with(m)}) if args.quick else None
            print(f"baseline: {'their tests' if tests else 'the suite'} on an unmutated copy ...", flush=True)
            status, known_failures = baseline(args.timeout, tests)
            if status == "timeout" or any(t.startswith("(the tests did not run") for t in known_failures):
                print(f"baseline: the unmutated suite does not run ({status}: {known_failures}); no score")
                return 2
            for test_id in known_failures:
                print(f"baseline: FAILS WITHOUT ANY MUTANT: {test_id} (it kills nothing in this run)")
            print(f"baseline: done ({time.monotonic() - start:.0f}s)", flush=True)
        results = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [pool.submit(run_mutant, m, args.timeout, args.quick, frozenset(known_failures))
                       for m in mutants]
            try:
                for future in concurrent.futures.as_completed(futures):
                    results.append(future.result())
                    print_result(results[-1], len(results), len(mutants))
            except KeyboardInterrupt:
                _stopping.set()
                for future in futures:
                    future.cancel()
                with _running_lock:
                    for process in list(_running):
                        _kill(process)
                raise
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    order = {m.name: i for i, m in enumerate(mutants)}
    results.sort(key=lambda r: order[r.mutant.name])
    if args.quick:
        print("\n--quick: each mutant met only its own tests; this is not a mutation score")
        status = 1 if any(r.verdict in ("STALE", "BROKEN") for r in results) else 0
    else:
        status = summary(results, time.monotonic() - start, args.min_score)
    if known_failures:
        # A mutant whose tests already fail shows as SURVIVED; often a new module git does not
        # know yet, as the copies hold only the files git knows.
        print(f"the unmutated copy fails {len(known_failures)} test(s), listed at the top (a file "
              "git does not know?); they kill nothing, and the run fails until they pass")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
