"""`python -m hermes_state`: exit codes, stdout data, stderr diagnostics."""

import contextlib
import csv
import datetime
import io
import json
import os
import re
import shutil
import socket
import stat
import sqlite3
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

from hermes_state import SessionDB
from hermes_state_schema import SCHEMA_VERSION
from test_support import HAS_FTS5, REPO, V22_DB, TempDirTestCase


class CliCase(TempDirTestCase):

    def run_cli(self, *args):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", *args], capture_output=True,
                              text=True, env=env, cwd=self.tmp, timeout=120)


class CommandLine(CliCase):

    def test_demo_builds_and_shows_an_example_store(self):
        result = self.run_cli("demo")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("demo-refactor-1 -> demo-refactor-2", result.stdout)
        self.assertIn("帮我检查一下数据库迁移脚本", result.stdout)
        store = Path(result.stdout.split("store: ")[1].split()[0])
        self.addCleanup(shutil.rmtree, store.parent, True)
        listed = self.run_cli("--db", str(store), "list", "--json")
        # The compression chain is one row, shown by its tip, as `hermes sessions list` shows it.
        self.assertEqual(sorted(s["id"] for s in json.loads(listed.stdout)),
                         ["demo-refactor-2", "demo-zh"])
        listed = self.run_cli("--db", str(store), "list", "--all", "--json")
        self.assertEqual(sorted(s["id"] for s in json.loads(listed.stdout)),
                         ["demo-refactor-1", "demo-refactor-2", "demo-zh"])

    def test_list_show_stats_doctor_on_a_real_store(self):
        db = str(self.copy_fixture(V22_DB))
        listed = self.run_cli("list", "--db", db, "--limit", "50", "--json")
        self.assertEqual(listed.returncode, 0, listed.stderr)
        self.assertEqual(len(json.loads(listed.stdout)), 16)  # 4 are continuations
        shown = self.run_cli("--db", db, "show", "bench_000001", "--lineage", "--json")
        export = json.loads(shown.stdout)
        self.assertEqual(export["lineage_session_ids"], ["bench_000000", "bench_000001"])
        self.assertEqual((len(export["messages"]), export["message_count"]), (32, 32))
        text = self.run_cli("--db", db, "show", "bench_000003")
        self.assertIn("terminal(", text.stdout)
        stats = json.loads(self.run_cli("--db", db, "stats", "--json").stdout)
        self.assertEqual((stats["sessions"], stats["messages_active"]), (20, 320))
        doctor = self.run_cli("--db", db, "doctor", "--json")
        self.assertEqual(doctor.returncode, 0, doctor.stderr)
        report = json.loads(doctor.stdout)
        self.assertEqual(report["integrity_check"], ["ok"])
        self.assertEqual(report["fts_layout"], "legacy")
        self.assertEqual(report["hermes_agent_index"], "legacy")
        for key in ("sqlite_version", "journal_mode", "journal_policy", "fts5", "trigram"):
            self.assertIn(key, report)

    def test_failures_exit_1_and_usage_errors_exit_2(self):
        db = str(self.tmp / "state.db")
        SessionDB(db).close()
        missing = self.run_cli("--db", db, "show", "nope")
        self.assertEqual(missing.returncode, 1)
        self.assertIn("no session matches 'nope'", missing.stderr)
        self.assertEqual(missing.stdout, "")
        self.assertEqual(self.run_cli("frobnicate").returncode, 2)
        self.assertEqual(self.run_cli("list", "--limit", "many").returncode, 2)
        too_many = self.run_cli("--db", db, "list", "--limit", "99999")
        self.assertEqual(too_many.returncode, 2)
        self.assertIn("99999 is out of range: 0-10,000", too_many.stderr)

    def test_a_closed_pipe_ends_the_output_quietly(self):
        if os.name != "posix":
            self.skipTest("uses a POSIX shell pipeline")
        db = str(self.copy_fixture(V22_DB))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        pipeline = subprocess.run(f'"{sys.executable}" -m hermes_state --db "{db}" export - | head -c 100 > /dev/null',
                                  shell=True, capture_output=True, text=True, env=env, timeout=60)
        self.assertNotIn("Broken pipe", pipeline.stderr)
        self.assertNotIn("Traceback", pipeline.stderr)

    def damage_page_of(self, name):
        """A store whose page holding `name` is garbage."""
        path = self.tmp / f"{name}.db"
        with SessionDB(path, journal="delete") as db:
            db.create_session("s", "cli")
            for i in range(300):
                db.append_message("s", "user", f"m{i} " * 20)
        conn = sqlite3.connect(path)
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.close()
        with open(path, "r+b") as handle:
            handle.seek((root - 1) * page_size)
            handle.write(b"\x0d" + b"\xff" * 50)
        return path

    def test_doctor_reports_damage_instead_of_failing(self):
        for name in ("idx_sessions_started", "state_meta"):
            with self.subTest(damaged=name):
                path = self.damage_page_of(name)
                before = path.read_bytes()
                result = self.run_cli("--db", str(path), "doctor", "--json")
                self.assertEqual(result.returncode, 1, result.stderr)
                report = json.loads(result.stdout)
                self.assertFalse(report["ok"])
                self.assertNotEqual(report["integrity_check"], ["ok"])
                self.assertEqual(path.read_bytes(), before)  # a read-only look: nothing repaired
        self.assertEqual([p.name for p in self.tmp.iterdir() if ".bak" in p.name], [])  # diagnosed, not moved


    def test_doctor_runs_quick_check_and_full_runs_integrity_check(self):
        # An index whose entries no longer match its rows: its b-tree is sound, so quick_check
        # (pages and records) passes it, and only integrity_check (every entry against its row)
        # finds it.
        path = self.tmp / "stale_index.db"
        with SessionDB(path, journal="delete") as db:
            for i in range(20):
                db.create_session(f"s{i:02d}", "cli")
                db.set_session_title(f"s{i:02d}", f"title {19 - i:02d}")
        conn = sqlite3.connect(path)
        conn.execute("CREATE INDEX test_by_source ON sessions(source)")
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = 'CREATE INDEX test_by_source ON sessions(title)'"
                     " WHERE name = 'test_by_source'")
        conn.commit()
        conn.close()
        quick = self.run_cli("--db", str(path), "doctor")
        self.assertEqual(quick.returncode, 0, quick.stdout + quick.stderr)
        self.assertTrue(quick.stdout.startswith(
            f"ok: {path} is healthy (quick_check; --full also runs integrity_check)"), quick.stdout)
        full = self.run_cli("--db", str(path), "doctor", "--full", "--json")
        self.assertEqual(full.returncode, 1, full.stderr)
        report = json.loads(full.stdout)
        self.assertEqual((report["check"], report["ok"]), ("integrity_check", False))
        self.assertTrue(any("test_by_source" in line for line in report["integrity_check"]),
                        report["integrity_check"])
        verdict = self.run_cli("--db", str(path), "doctor", "--full").stdout.splitlines()[0]
        # (on a SQLite free of the WAL-reset bug it goes on: the next open's journal switch)
        self.assertTrue(verdict.startswith(f"PROBLEM: {path}: integrity_check failed"), verdict)

    def test_doctor_s_quick_default_finds_a_damaged_page(self):
        path = self.damage_page_of("state_meta")
        result = self.run_cli("--db", str(path), "doctor")
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertTrue(result.stdout.startswith(f"PROBLEM: {path}: quick_check failed"),
                        result.stdout)


V26_DB, V31_DB = "hermes_v26_split.db", "hermes_v31_store.db"


def terminal_cells(text):
    """Cells a terminal gives `text`: two for a wide or full-width character (counted here, apart
    from the product's own count)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def utc(ts):
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ReadingRealStores(CliCase):
    """What a person reads from stores hermes-agent 0.19 (schema 22), 0.20 (26) and 0.22 (31)
    wrote: each command run as a subprocess on a copy."""

    def cli_json(self, *args):
        done = self.run_cli(*args)
        self.assertEqual(done.returncode, 0, done.stderr)
        return json.loads(done.stdout)

    def test_a_search_hit_names_its_number_in_show(self):
        for fixture in (V22_DB, V26_DB, V31_DB):
            with self.subTest(fixture=fixture):
                db = str(self.copy_fixture(fixture))
                hits = self.cli_json("--db", db, "search", "parser", "-n", "6", "--json")
                self.assertEqual(len(hits), 6)
                for hit in hits:
                    shown = self.cli_json("--db", db, "show", hit["session_id"], "--json")
                    self.assertEqual(shown["messages"][hit["number"] - 1]["id"], hit["id"], hit)
                table = self.run_cli("--db", db, "search", "parser", "-n", "6").stdout.splitlines()
                self.assertEqual(table[0].split()[:3], ["session", "#", "role"])
                self.assertEqual([line.split()[:2] for line in table[2:]],
                                 [[hit["session_id"], str(hit["number"])] for hit in hits])

    def test_search_means_what_the_user_typed_unless_asked_for_hermes_agents_reading(self):
        db = str(self.copy_fixture(V26_DB))

        def ids(query, *grammar):
            return {hit["id"] for hit in self.cli_json("--db", db, "search", query, "-n", "0",
                                                       "--json", *grammar)}
        cjk, word = ids("迁移"), ids("schema")
        self.assertEqual(ids("迁移 schema"), cjk & word)
        self.assertEqual(ids("迁移 NOT schema"), cjk - word)  # a NOT never adds a hit
        self.assertEqual(ids("迁移 OR schema"), cjk | word)
        # hermes-agent's reading: a 1-2 character CJK term makes every term an alternative.
        self.assertEqual(ids("迁移 NOT schema", "--grammar", "hermes-agent"), cjk | word)
        refused = self.run_cli("--db", db, "search", "x", "--grammar", "any")
        self.assertEqual(refused.returncode, 2)

    def test_show_heads_a_session_with_its_times_and_cost_and_full_prints_it_whole(self):
        db = str(self.copy_fixture(V31_DB))
        with contextlib.closing(sqlite3.connect(db)) as conn:
            started, ended = conn.execute("SELECT started_at, ended_at FROM sessions"
                                          " WHERE id = 'bench_000003'").fetchone()
            tool = conn.execute("SELECT content FROM messages WHERE session_id = 'bench_000003'"
                                " AND role = 'tool' ORDER BY length(content) DESC").fetchone()[0]
        shown = self.run_cli("--db", db, "show", "bench_000003")
        self.assertEqual(shown.returncode, 0, shown.stderr)
        local = lambda ts: time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))
        self.assertIn(f"started: {local(started)}\n", shown.stdout)
        self.assertIn(f"ended: {local(ended)}\n", shown.stdout)
        self.assertIn("cost: $0.0110 (actual)\n", shown.stdout)  # the actual cost, not the estimate
        self.assertGreater(len(tool), 400)
        self.assertNotIn(tool, shown.stdout)
        self.assertIn(f"({len(tool):,} chars; show --full prints them all)", shown.stdout)
        whole = self.run_cli("--db", db, "show", "bench_000003", "--full")
        self.assertIn(tool, whole.stdout)
        self.assertNotIn("--full prints", whole.stdout)

    def test_a_chain_is_headed_by_its_totals(self):
        db = str(self.copy_fixture(V31_DB))
        with contextlib.closing(sqlite3.connect(db)) as conn:
            totals = conn.execute(
                "SELECT SUM(tool_call_count), SUM(input_tokens), SUM(output_tokens) FROM sessions"
                " WHERE id IN ('bench_000000', 'bench_000001')").fetchone()
            tip = conn.execute("SELECT tool_call_count, input_tokens FROM sessions"
                               " WHERE id = 'bench_000001'").fetchone()
        self.assertEqual(tip[1], 0)  # the tip alone counted no tokens: its root did
        chain = self.run_cli("--db", db, "show", "bench_000001", "--lineage").stdout
        header = dict(line.strip().split(": ", 1) for line in chain.split("\n\n")[0].splitlines())
        self.assertEqual((header["message_count"], header["tool_call_count"],
                          header["input_tokens"], header["output_tokens"]),
                         ("32", str(totals[0]), f"{totals[1]:,}", f"{totals[2]:,}"))
        self.assertEqual(chain.count("-> terminal("), totals[0])
        alone = self.run_cli("--db", db, "show", "bench_000001").stdout
        self.assertIn(f"tool_call_count: {tip[0]}\n", alone)

    def test_an_ambiguous_prefix_lists_its_candidates_as_git_does(self):
        db = str(self.copy_fixture(V26_DB))
        done = self.run_cli("--db", db, "show", "BENCH_00001")
        self.assertEqual((done.returncode, done.stdout), (1, ""))
        lines = done.stderr.splitlines()
        self.assertEqual(lines[0], "error: 'BENCH_00001' is ambiguous: 10 sessions start with it; "
                                   "the candidates are:")
        self.assertEqual([line.split()[0] for line in lines[1:]],
                         [f"bench_0000{n}" for n in range(10, 20)])
        wide = self.run_cli("--db", db, "show", "bench_0000")
        self.assertEqual(wide.stderr.splitlines()[-1], "  ... and 10 more")
        self.assertIn("no session matches 'zzz'", self.run_cli("--db", db, "show", "zzz").stderr)

    def test_list_fits_the_terminal_counting_a_cjk_character_as_two_cells(self):
        db = str(self.copy_fixture(V31_DB))
        for columns in (64, 80, 132):  # from 62 cells: the title keeps at least 10
            with self.subTest(columns=columns):
                env = dict(os.environ, COLUMNS=str(columns), PYTHONPATH=str(REPO))
                done = subprocess.run([sys.executable, "-m", "hermes_state", "--db", db, "list",
                                       "-n", "0"], capture_output=True, text=True, env=env,
                                      timeout=120)
                lines = done.stdout.splitlines()
                self.assertEqual(len(lines), 2 + 16, done.stderr)
                self.assertLessEqual(max(map(terminal_cells, lines)), columns, done.stdout)
                # The title column starts at one cell in every row, CJK titles included.
                start = lines[0].index("title")
                self.assertEqual({terminal_cells(line.split("  16  ")[0]) + 6 for line in lines[2:]},
                                 {start})
                self.assertTrue(any(re.search(r"[\u4e00-\u9fff]", line) for line in lines[2:]))

    def test_a_title_that_is_the_first_message_is_marked(self):
        db = str(self.copy_fixture(V26_DB))
        rows = {line.split()[0]: line for line in self.run_cli("--db", db, "list", "-n", "0")
                .stdout.splitlines()[2:]}
        self.assertTrue(rows["bench_000014"].endswith("  会话 14 title"), rows["bench_000014"])
        self.assertRegex(rows["bench_000013"], r"  “[^”]+”$")

    def test_list_and_search_data_carry_utc_times_and_csv_its_chosen_columns(self):
        db = str(self.copy_fixture(V26_DB))
        for session in self.cli_json("--db", db, "list", "-n", "0", "--json"):
            self.assertEqual(session["started_at_utc"], utc(session["started_at"]))
            self.assertEqual(session["last_active_utc"], utc(session["last_active"]))
            self.assertEqual(session["ended_at_utc"], utc(session["ended_at"]))
        for hit in self.cli_json("--db", db, "search", "会话", "--json"):
            self.assertEqual(hit["timestamp_utc"], utc(hit["timestamp"]))
        rows = list(csv.reader(io.StringIO(self.run_cli("--db", db, "list", "-n", "3",
                                                        "--format", "csv").stdout)))
        self.assertEqual(len(rows), 4)
        self.assertEqual(rows[0][:6], ["id", "source", "title", "preview", "started_at",
                                       "started_at_utc"])
        self.assertLess(len(rows[0]), 20)
        every = next(csv.reader(io.StringIO(self.run_cli("--db", db, "list", "-n", "1",
                                                         "--format", "csv", "-c", "*").stdout)))
        self.assertGreater(len(every), 60)
        chosen = self.run_cli("--db", db, "list", "-n", "2", "--tsv", "-c", "id,started_at_utc",
                              "--no-headers")
        self.assertEqual(chosen.stdout.splitlines()[0].split("\t")[0], "bench_000019")
        self.assertEqual([len(line.split("\t")) for line in chosen.stdout.splitlines()], [2, 2])
        # No listed session ended: its default columns still hold ended_at_utc, empty.
        fresh = self.tmp / "open-sessions.db"
        with SessionDB(fresh) as store:
            store.create_session("open", "cli")
            store.append_message("open", "user", "hi")
        for fmt in ("csv", "tsv"):
            run = self.run_cli("--db", str(fresh), "list", "--format", fmt)
            self.assertEqual((run.returncode, run.stderr), (0, ""))
            header, row = list(csv.reader(io.StringIO(run.stdout),
                                          delimiter="," if fmt == "csv" else "\t"))
            self.assertEqual(row[header.index("ended_at_utc")], "")
        typo = self.run_cli("--db", db, "list", "--format", "csv", "-c", "titel")
        self.assertEqual((typo.returncode, typo.stdout), (1, ""))
        self.assertIn("no column 'titel'", typo.stderr)
        for refused in (("--tsv", "--format", "csv"), ("-c", "id"), ("--json", "--no-headers")):
            with self.subTest(refused=refused):
                self.assertEqual(self.run_cli("--db", db, "list", *refused).returncode, 2)

    def test_list_help_names_the_order_it_lists_in(self):
        db = str(self.copy_fixture(V26_DB))
        self.assertIn("newest start first", " ".join(self.run_cli("list", "--help").stdout.split()))
        starts = [s["started_at"] for s in self.cli_json("--db", db, "list", "-n", "0", "--all",
                                                         "--json")]
        self.assertEqual(starts, sorted(starts, reverse=True))

    def test_stats_totals_tokens_cost_and_activity(self):
        db = str(self.copy_fixture(V31_DB))
        with contextlib.closing(sqlite3.connect(db)) as conn:
            tokens = conn.execute("SELECT SUM(input_tokens), SUM(output_tokens),"
                                  " SUM(cache_read_tokens), SUM(reasoning_tokens),"
                                  " SUM(COALESCE(actual_cost_usd, estimated_cost_usd)),"
                                  " MIN(started_at) FROM sessions").fetchone()
            last = conn.execute("SELECT MAX(t) FROM (SELECT MAX(timestamp) AS t FROM messages"
                                " UNION ALL SELECT MAX(started_at) FROM sessions"
                                " UNION ALL SELECT MAX(last_activity_at) FROM sessions)").fetchone()[0]
        self.assertEqual(tokens[:2], (1123, 245))
        stats = self.cli_json("--db", db, "stats", "--json")
        self.assertEqual((stats["tokens"]["input"], stats["tokens"]["output"],
                          stats["tokens"]["cache_read"], stats["tokens"]["reasoning"]), tokens[:4])
        self.assertAlmostEqual(stats["cost_usd"], tokens[4])
        self.assertEqual((stats["first_activity"], stats["last_activity"]), (tokens[5], last))
        self.assertEqual(stats["first_activity_utc"], utc(tokens[5]))
        text = self.run_cli("--db", db, "stats").stdout
        self.assertIn("tokens: input 1,123, output 245,", text)
        self.assertIn(f"first_activity: {time.strftime('%Y-%m-%d %H:%M', time.localtime(tokens[5]))}",
                      text)

    def test_doctor_hints_optimize_storage_until_the_index_is_ours(self):
        db = str(self.copy_fixture(V22_DB))
        report = self.cli_json("--db", db, "doctor", "--json")
        if not HAS_FTS5:  # no index can be built on this SQLite: nothing to hint at
            self.assertEqual((report["fts5"], report["searchable_by_index"]), (False, []))
            self.assertNotIn("hint", report)
            return
        self.assertIn("optimize-storage", report["hint"])
        self.assertNotIn(None, report["search_meta"].values())
        self.assertIn("optimize-storage", self.run_cli("--db", db, "doctor").stdout)
        moved = self.run_cli("--db", db, "optimize-storage", "--yes", "--no-vacuum")
        self.assertEqual(moved.returncode, 0, moved.stderr)
        report = self.cli_json("--db", db, "doctor", "--json")
        self.assertNotIn("hint", report)
        self.assertTrue(report["search_meta"])
        self.assertNotIn(None, report["search_meta"].values())

    def test_list_hides_a_delegate_run_as_hermes_agent_lists_and_all_shows_it(self):
        db = str(self.copy_fixture("hermes_v31_raw_readers.db"))
        shown = [row["id"] for row in self.cli_json("--db", db, "list", "--json")]
        everything = [row["id"] for row in self.cli_json("--db", db, "list", "--all", "--json")]
        self.assertNotIn("deleg_1", shown)
        self.assertEqual(sorted(everything), sorted(shown + ["deleg_1"]))

    def test_one_of_a_thing_is_said_in_the_singular(self):
        home = self.tmp / "home"
        home.mkdir()
        shutil.copy(self.copy_fixture(V31_DB), home / "state.db")
        said = {args: self.run_cli(*args) for args in (
            ("search", "-n", "1", "session"), ("list", "-n", "1"),
            ("export", "--session-id", self.cli_json("list", "-n", "1", "--json")[0]["id"],
             str(self.tmp / "one.jsonl")),
            ("backup", str(self.tmp / "one.zip")))}
        for args, done in said.items():
            self.assertEqual(done.returncode, 0, (args, done.stderr))
            self.assertNotRegex(done.stdout + done.stderr, r"\b1 (hits|sessions|files)\b", args)
        self.assertIn("showing the first 1 hit; more match", said[("search", "-n", "1", "session")].stderr)
        self.assertRegex(said[("backup", str(self.tmp / "one.zip"))].stdout, r"^backed up 1 file of ")
        self.assertIn("exported 1 session as jsonl", "".join(
            done.stderr for args, done in said.items() if args[0] == "export"))
        lines = self.run_cli("import", str(self.tmp / "one.jsonl")).stderr
        self.assertIn("checked: 1 session, every line valid", lines)

    def test_optimize_says_it_upgraded_a_019_or_020_stores_schema_and_stats_said_it_would(self):
        for fixture, version in ((V22_DB, 22), (V26_DB, 26)):
            with self.subTest(fixture=fixture):
                db = str(self.copy_fixture(fixture))
                would = self.cli_json("--db", db, "stats", "--json")["agent_open_would"]
                first = self.run_cli("--db", db, "optimize")
                self.assertEqual(first.returncode, 0, first.stderr)
                again = self.run_cli("--db", db, "optimize", "--json")
                self.assertIsNone(json.loads(again.stdout)["schema_upgraded"])
                self.assertEqual(self.cli_json("--db", db, "stats", "--json")["agent_open_would"],
                                 [])
                if not HAS_FTS5:  # the open holds the version back there: nothing to say
                    self.assertNotIn("upgraded the schema", first.stdout + first.stderr)
                    continue
                upgrade = f"upgrade its schema from version {version} to {SCHEMA_VERSION}"
                self.assertIn(upgrade, would)
                self.assertRegex(first.stdout, rf"^upgraded the schema of {re.escape(db)} from "
                                               rf"version {version} to {SCHEMA_VERSION}\n")


class ErrorsInOneLine(CliCase):

    def assert_one_error(self, done, text):
        self.assertEqual(done.returncode, 1, done.stderr)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        self.assertEqual(errors, [f"error: {text}"], done.stderr)
        self.assertNotIn("Traceback", done.stderr)
        self.assertNotIn("[Errno", done.stderr)

    def test_a_missing_import_file_is_said_in_lower_case_and_nothing_is_made(self):
        missing = self.tmp / "none.jsonl"
        self.assert_one_error(self.run_cli("import", str(missing)),
                              f"cannot read {missing}: no such file or directory; nothing was "
                              "imported")
        self.assertFalse((self.tmp / "home").exists())

    def test_a_bad_archive_is_refused_by_restore(self):
        bad = self.tmp / "notes.zip"
        bad.write_text("not a zip")
        self.assert_one_error(self.run_cli("restore", str(bad)),
                              f"restore refused: {bad} is not a zip archive; nothing was restored")
        # With a store in place the archive is still looked at first: --force would not help.
        store = self.tmp / "home" / "state.db"
        store.parent.mkdir()
        shutil.copy(self.copy_fixture(V26_DB), store)
        before = store.read_bytes()
        self.assert_one_error(self.run_cli("restore", str(bad)),
                              f"restore refused: {bad} is not a zip archive; nothing was restored")
        self.assertEqual(store.read_bytes(), before)
        self.assert_one_error(self.run_cli("restore", str(self.tmp / "none.zip")),
                              f"restore: {self.tmp / 'none.zip'} does not exist; give the zip "
                              "`backup` wrote")

    def test_an_address_in_use_and_an_unwritable_path_are_one_sentence(self):
        db = str(self.copy_fixture(V26_DB))
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            done = self.run_cli("--db", db, "serve", "--port", str(port))
        self.assert_one_error(done, f"cannot listen on 127.0.0.1:{port}: address already in use; "
                                    "another program listens there (--port picks another)")
        out = self.tmp / "missing" / "x.jsonl"
        self.assert_one_error(self.run_cli("--db", db, "export", str(out)),
                              f"cannot write {out}: no such file or directory; nothing was written")
        self.assert_one_error(self.run_cli("--db", db, "backup", str(out.with_suffix(".zip"))),
                              f"cannot write {out.with_suffix('.zip')}: no such file or directory; "
                              "nothing was written")

    def test_a_device_or_fifo_is_never_replaced_by_an_export_or_a_backup(self):
        # The write renames a new file over OUT: over a FIFO (or, as root, /dev/full) that
        # replaced the special file itself.
        if not hasattr(os, "mkfifo"):
            self.skipTest("no FIFOs on this platform")
        db = str(self.copy_fixture(V26_DB))
        fifo = self.tmp / "pipe"
        os.mkfifo(fifo)
        for command in (("export", str(fifo)), ("backup", str(fifo), "--force")):
            with self.subTest(command=command[0]):
                self.assert_one_error(self.run_cli("--db", db, *command),
                                      f"{fifo} is not a regular file (a device, a FIFO or a "
                                      "socket); nothing was written: give a file, or '-' for "
                                      "standard output")
                self.assertTrue(stat.S_ISFIFO(os.lstat(fifo).st_mode))
