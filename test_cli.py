"""`python -m hermes_state`: exit codes, stdout data, stderr diagnostics."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from hermes_state import SessionDB
from test_support import REPO, V22_DB, TempDirTestCase


class CommandLine(TempDirTestCase):

    def run_cli(self, *args):
        env = dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))
        return subprocess.run([sys.executable, "-m", "hermes_state", *args], capture_output=True,
                              text=True, env=env, cwd=self.tmp, timeout=120)

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
