"""The command line's output contract, run as a subprocess on real stores: exit codes and argparse
ranges, --json on every command, list/search formats and paging, human values, confirmation of
destructive commands (on a pseudo-terminal too), progress lines, `import -`, and the all-or-nothing
import."""

import csv
import io
import json
import os
import select
import sqlite3
import subprocess
import sys
import time

from hermes_state import SessionDB
from test_support import HAS_FTS5, REPO, V26_DB, TempDirTestCase, fixture_path

EXPORT = "hermes_v26_export.jsonl"


class CliCase(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.db = self.copy_fixture(V26_DB)

    def env(self):
        return dict(os.environ, HERMES_HOME=str(self.tmp / "home"), PYTHONPATH=str(REPO))

    def run_cli(self, *args, stdin=None, db=True):
        prefix = ("--db", str(self.db)) if db else ()
        return subprocess.run([sys.executable, "-m", "hermes_state", *prefix, *map(str, args)],
                              capture_output=True, text=True, env=self.env(), cwd=self.tmp,
                              timeout=120, input=stdin)

    def run_on_terminal(self, *args, answer=None, while_asking=None):
        """The CLI with stdin and stderr on a pseudo-terminal (stdout a pipe); `answer` is typed
        once the question is asked, after `while_asking()` ran. Returns (exit status, stdout, what
        the terminal showed)."""
        try:
            import pty
        except ImportError:  # Windows has no pseudo-terminals
            self.skipTest("no pty module here: the terminal dialogue is checked on POSIX")
        leader, follower = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "hermes_state", "--db", str(self.db),
                                 *map(str, args)], stdin=follower, stdout=subprocess.PIPE,
                                stderr=follower, env=self.env(), cwd=self.tmp)
        os.close(follower)
        shown, answered, deadline = b"", False, time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = select.select([leader], [], [], 0.2)[0]
            if ready:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:
                    chunk = b""
                if not chunk and proc.poll() is not None:
                    break
                shown += chunk
            if answer is not None and not answered and b"[y/N]" in shown:
                if while_asking is not None:
                    while_asking()
                os.write(leader, answer.encode() + b"\n")
                answered = True
            if proc.poll() is not None and not ready:
                break
        out = proc.stdout.read().decode()
        proc.stdout.close()
        proc.wait(30)
        os.close(leader)
        return proc.returncode, out, shown.decode(errors="replace")

    def session_ids(self):
        with SessionDB(self.db, read_only=True) as db:
            return {s["id"] for s in db.list_sessions_rich(limit=1000, include_children=True)}


class UsageErrors(CliCase):

    def test_every_usage_error_is_exit_2_with_the_option_and_its_range(self):
        cases = [
            (("serve", "--port", "99999"), "--port: 99999 is out of range: 1-65,535"),
            (("serve", "--port", "-1"), "--port: -1 is out of range"),
            (("serve", "--port", "http"), "--port: 'http' is not an integer"),
            (("list", "--offset", "99999999999999999999"),
             "--offset: 99999999999999999999 is out of range"),
            (("search", "x", "--offset", "99999999999999999999"), "--offset"),
            (("list", "--limit", "-1"), "--limit: -1 is out of range: 0-10,000"),
            (("search", "x", "-n", "10001"), "out of range: 0-10,000"),
            (("search", "x", "--sort", "bogus"), "invalid choice: 'bogus'"),
            (("prune", "--older-than", "nan"), "days must be a finite number >= 0"),
            (("prune", "--older-than", "-1"), "days must be a finite number >= 0"),
            (("prune", "--older-than", "inf"), "days must be a finite number >= 0"),
            (("export", "--session-id", "", "-"), "--session-id: must not be empty"),
            (("show", ""), "must not be empty"),
            (("list", "--format", "xml"), "invalid choice: 'xml'"),
            (("frobnicate",), "invalid choice"),
        ]
        before = self.db.read_bytes()
        for args, message in cases:
            with self.subTest(args=args):
                result = self.run_cli(*args)
                self.assertEqual((result.returncode, result.stdout), (2, ""), result.stderr)
                self.assertIn(message, result.stderr)
                self.assertNotIn("Traceback", result.stderr)
        self.assertEqual(self.db.read_bytes(), before)

    def test_every_option_has_help_and_every_command_an_example(self):
        from hermes_state_cli import build_parser
        parser = build_parser()
        commands = next(a for a in parser._actions if a.dest == "command").choices
        for name, sub in commands.items():
            with self.subTest(command=name):
                example = "example:\n  " + ("python3 -m hermes_state " if name != "serve" else "")
                self.assertIn(example, sub.epilog)
                for action in sub._actions:
                    what = action.option_strings or action.dest
                    self.assertTrue(action.help, f"{name} {what} has no help")
                shown = self.run_cli(name, "--help", db=False)
                self.assertEqual(shown.returncode, 0)
                self.assertIn("example:", shown.stdout)


class OutputContract(CliCase):

    def test_json_on_every_command(self):
        out = self.tmp / "all.jsonl"
        steps = [
            (("list",), list), (("search", "parser"), list), (("show", "bench_000003"), dict),
            (("stats",), dict), (("doctor",), dict), (("optimize",), dict), (("export", out), dict),
            (("backup", self.tmp / "home.zip"), dict), (("delete", "bench_000019", "--yes"), dict),
            (("prune", "--older-than", "0", "--dry-run"), dict), (("import", out), dict),
            (("optimize-storage", "--yes", "--no-vacuum"), dict),
        ]
        for args, kind in steps:
            with self.subTest(command=args[0]):
                result = self.run_cli(*args, "--json")
                if args[0] == "optimize-storage" and not HAS_FTS5:  # no index to build: refused
                    self.assertEqual((result.returncode, result.stderr.strip()),
                                     (1, "error: optimize-storage refused: fts5_unavailable"))
                    continue
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertIsInstance(json.loads(result.stdout), kind)
        restored = subprocess.run([sys.executable, "-m", "hermes_state", "--db",
                                   str(self.tmp / "r" / "state.db"), "restore",
                                   self.tmp / "home.zip", "--json"], capture_output=True,
                                  text=True, env=self.env(), timeout=120)
        self.assertEqual(restored.returncode, 0, restored.stderr)
        self.assertIn("restored", json.loads(restored.stdout))
        demo = self.run_cli("demo", "--json", db=False)
        self.assertEqual(len(json.loads(demo.stdout)["sessions"]), 3)

    def test_list_formats_paging_and_the_cut_said_on_stderr(self):
        table = self.run_cli("list", "--all")
        lines = table.stdout.splitlines()
        self.assertEqual(lines[0].split(), ["id", "source", "last", "active", "messages", "title"])
        self.assertEqual(len(lines), 2 + 20)
        self.assertEqual(table.stderr, "")
        cut = self.run_cli("list", "--all", "-n", "5")
        self.assertEqual(len(cut.stdout.splitlines()), 2 + 5)
        self.assertEqual(cut.stderr,
                         "showing 5 of 20 sessions (-n 0 for all, --offset 5 for the next page)\n")
        everything = json.loads(self.run_cli("list", "--all", "--limit", "0", "--format", "json").stdout)
        self.assertEqual(len(everything), 20)
        jsonl = self.run_cli("list", "--all", "-n", "3", "--format", "jsonl").stdout.splitlines()
        self.assertEqual([json.loads(line)["id"] for line in jsonl],
                         [s["id"] for s in everything[:3]])
        table = self.run_cli("list", "--all", "-n", "0", "--format", "csv").stdout
        rows = list(csv.DictReader(io.StringIO(table)))
        self.assertEqual([r["id"] for r in rows], [s["id"] for s in everything])
        self.assertIn("message_count", rows[0])
        from hermes_state_cli import OFFSET_MAX
        far = self.run_cli("list", "--all", "--offset", str(OFFSET_MAX))
        self.assertEqual((far.returncode, far.stderr),
                         (0, f"no sessions past offset {OFFSET_MAX:,} of 20\n"))
        for command in (("list",), ("search", "parser")):
            beyond = self.run_cli(*command, "--offset", str(OFFSET_MAX + 1))
            self.assertEqual(beyond.returncode, 2, beyond.stderr)
            self.assertIn(f"out of range: 0-{OFFSET_MAX:,}", beyond.stderr)
        last = self.run_cli("search", "parser", "--offset", str(OFFSET_MAX))
        self.assertEqual(last.returncode, 0, last.stderr)
        # Without --all, as `hermes sessions list`: no delegate runs, continuations, tool sessions.
        with SessionDB(self.db, read_only=True) as db:
            listable = db.list_sessions_rich(limit=1000, exclude_sources=["tool"])
            children = {s["id"] for s in everything} - {s["id"] for s in listable}
        default = json.loads(self.run_cli("list", "-n", "0", "--format", "json").stdout)
        self.assertEqual([s["id"] for s in default], [s["id"] for s in listable])
        self.assertTrue(children)
        self.assertTrue(all(s["parent_session_id"] or s["source"] == "tool"
                            or s["end_reason"] == "compression"  # its chain shown by its tip
                            for s in everything if s["id"] in children))
        none = self.run_cli("list", "--source", "nosuch")
        self.assertEqual((none.returncode, none.stdout, none.stderr), (0, "", "no sessions\n"))

    def test_search_formats_and_paging(self):
        hits = json.loads(self.run_cli("search", "parser", "-n", "0", "--format", "json").stdout)
        self.assertEqual(len(hits), 66)  # fixtures/README.md
        page = self.run_cli("search", "parser")
        self.assertEqual(len(page.stdout.splitlines()), 2 + 20)
        self.assertIn("showing the first 20 hits; more match", page.stderr)
        table = self.run_cli("search", "parser", "-n", "7", "--format", "csv").stdout
        rows = list(csv.DictReader(io.StringIO(table)))
        self.assertEqual([int(r["id"]) for r in rows], [h["id"] for h in hits[:7]])
        ranked = self.run_cli("search", "parser", "--sort", "relevance", "-n", "3")
        self.assertEqual(ranked.returncode, 0, ranked.stderr)

    def test_every_hit_is_highlighted_cjk_of_any_length_included(self):
        for query in ("会话", "parser", "迁移"):
            with self.subTest(query=query):
                table = self.run_cli("search", query, "-n", "0").stdout.splitlines()[2:]
                self.assertTrue(table)
                for row in table:
                    self.assertRegex(row, r">>>(会话|parser|迁移|schema)<<<", row)
        hits = json.loads(self.run_cli("search", "会话", "--json").stdout)
        self.assertEqual([h["id"] for h in hits], [276, 108, 73])  # fixtures/README.md
        # hermes-agent's reading keeps its plain snippet for a 1-2 character CJK term.
        plain = json.loads(self.run_cli("search", "会话", "--json", "--grammar", "hermes-agent").stdout)
        self.assertEqual([h["id"] for h in plain], [276, 108, 73])
        self.assertNotIn(">>>", plain[0]["snippet"])

    def test_human_values_not_reprs(self):
        stats = self.run_cli("stats").stdout
        self.assertRegex(stats, r"db_bytes: 1\.3 MB\n")
        self.assertIn("sessions_by_source: cli 13, telegram 7\n", stats)
        shown = self.run_cli("show", "bench_000003").stdout
        self.assertIn("title: -\n", shown)
        doctor = self.run_cli("doctor").stdout
        for text in (stats, shown, doctor):
            for repr_text in ("None", "True", "False", "{'", "['"):
                self.assertNotIn(repr_text, text)
        self.assertTrue(doctor.startswith(f"ok: {self.db} is healthy"), doctor.splitlines()[0])

    def test_show_numbers_a_sessions_messages_from_1(self):
        shown = self.run_cli("show", "bench_000003").stdout
        numbers = [int(line[1:line.index("]")]) for line in shown.splitlines()
                   if line.startswith("[")]
        self.assertEqual(numbers, list(range(1, 17)))

    def test_import_dash_reads_stdin(self):
        target = self.tmp / "fresh.db"
        result = subprocess.run([sys.executable, "-m", "hermes_state", "--db", str(target),
                                 "import", "-"], input=fixture_path(EXPORT).read_text("utf-8"),
                                capture_output=True, text=True, env=self.env(), timeout=120)
        self.assertEqual((result.returncode, result.stdout),
                         (0, "imported 20, skipped 0, detached 0\n"), result.stderr)


class Confirmation(CliCase):

    def test_delete_and_prune_refuse_unattended_without_yes(self):
        for args in (("delete", "bench_000019"), ("prune", "--older-than", "0"),
                     ("optimize-storage",)):
            with self.subTest(command=args[0]):
                result = self.run_cli(*args, stdin="y\n")
                self.assertEqual((result.returncode, result.stdout), (1, ""))
                self.assertIn(f"error: {args[0]} asks before it changes anything; pass --yes",
                              result.stderr)
        self.assertEqual(len(self.session_ids()), 20)

    def test_dry_run_lists_and_deletes_nothing(self):
        delete = self.run_cli("delete", "bench_000019", "--dry-run")
        self.assertEqual((delete.returncode, delete.stdout), (0, "would delete bench_000019\n"))
        prune = self.run_cli("prune", "--older-than", "0", "--source", "telegram", "--dry-run")
        self.assertTrue(prune.stdout.startswith("would delete 7 ended sessions"), prune.stdout)
        self.assertEqual(len(self.session_ids()), 20)

    def test_on_a_terminal_it_lists_what_goes_and_asks(self):
        status, out, shown = self.run_on_terminal("delete", "bench_000019", answer="n")
        self.assertEqual((status, out), (1, ""))
        self.assertIn("bench_000019", shown)
        self.assertIn("[y/N]", shown)
        self.assertIn("nothing was changed", shown)
        self.assertIn("bench_000019", self.session_ids())
        status, out, shown = self.run_on_terminal("prune", "--older-than", "0", "--source",
                                                  "telegram", answer="y")
        self.assertEqual(status, 0, shown)
        self.assertIn("will delete:", shown)
        self.assertEqual(out.splitlines()[0],
                         "deleted 7 ended sessions inactive for more than 0 days")
        self.assertEqual(len(self.session_ids()), 13)


    def test_what_changed_while_it_asked_is_not_deleted(self):
        def end_another_telegram_session():
            with SessionDB(self.db) as db:
                db.create_session("ended-while-asking", "telegram")
                db.end_session("ended-while-asking", "user_exit")
        status, out, shown = self.run_on_terminal("prune", "--older-than", "0", "--source",
                                                  "telegram", answer="y",
                                                  while_asking=end_another_telegram_session)
        self.assertEqual(status, 0, shown)
        self.assertNotIn("ended-while-asking", shown + out)
        self.assertEqual(len(self.session_ids()), 14)  # 20 - 7 shown + the one ended meanwhile
        self.assertIn("ended-while-asking", self.session_ids())

        def start_a_delegate():
            with SessionDB(self.db) as db:
                db.create_session("late-delegate", "cli", parent_session_id="bench_000019",
                                  model_config={"_delegate_from": "bench_000019"})
        status, out, shown = self.run_on_terminal("delete", "bench_000019", answer="y",
                                                  while_asking=start_a_delegate)
        self.assertEqual((status, out), (1, ""), shown)
        self.assertIn("changed while you were asked", shown)
        self.assertLessEqual({"bench_000019", "late-delegate"}, self.session_ids())


class ProgressLines(CliCase):

    def test_plain_lines_when_stderr_is_not_a_terminal(self):
        out = self.tmp / "all.html"
        result = self.run_cli("export", "--format", "html", "--redact", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        lines = result.stderr.splitlines()
        self.assertEqual(lines[0], "export: writing html (redacting secrets), 0.0s")
        self.assertRegex(lines[-1], r"^export: exported 20 sessions as html to .* "
                                    r"\(redacted, best effort\) in \d+\.\ds$")
        self.assertNotIn("\r", result.stderr)
        self.assertLess(len(lines), 6)  # throttled: not one line per session
        storage = self.run_cli("optimize-storage", "--yes")
        if not HAS_FTS5:  # refused at once, in one plain line
            self.assertEqual((storage.returncode, storage.stderr.splitlines()),
                             (1, ["error: optimize-storage refused: fts5_unavailable"]))
            return
        self.assertEqual(storage.returncode, 0, storage.stderr)
        phases = [line.split(":")[1].split(",")[0].split()[0]
                  for line in storage.stderr.splitlines()]
        # each phase said once, not 270 times
        self.assertEqual(len(phases), len(set(phases)), storage.stderr)
        self.assertTrue(any(line.startswith("optimize-storage: vacuum: rewrites the whole file")
                            for line in storage.stderr.splitlines()), storage.stderr)

    def test_one_line_rewritten_in_place_on_a_terminal(self):
        status, out, shown = self.run_on_terminal("export", "--format", "md", self.tmp / "md")
        self.assertEqual(status, 0, shown)
        self.assertIn("\r\033[Kexport: writing md", shown)
        self.assertRegex(shown, r"export: exported 20 sessions as md to .* in \d+\.\ds")


class AllOrNothingImport(CliCase):

    def many_sessions(self, n, messages=20):
        return [{"id": f"bulk_{i:05d}", "source": "cli", "started_at": 1_700_000_000 + i,
                 "messages": [{"role": "user" if j % 2 == 0 else "assistant",
                               "content": f"bulk session {i} message {j} " + "words " * 30,
                               "timestamp": 1_700_000_000 + i + j / 100} for j in range(messages)]}
                for i in range(n)]

    def test_a_bad_line_near_the_end_writes_nothing(self):
        lines = [json.dumps(s) for s in self.many_sessions(600, 2)]
        lines.insert(598, "{not json")
        source = self.tmp / "bad.jsonl"
        source.write_text("\n".join(lines) + "\n", encoding="utf-8")
        result = self.run_cli("import", source)
        self.assertEqual(result.returncode, 1)
        self.assertIn(f"error: {source}:599: not JSON", result.stderr)
        self.assertEqual(len(self.session_ids()), 20)

    def test_a_write_that_fails_late_in_a_long_import_leaves_nothing_written(self):
        # More sessions than one import chunk (IMPORT_CHUNK_SECONDS of writing) holds; the store
        # refuses the last one only when it is written, so the failure comes after earlier chunks
        # would have committed.
        sessions = self.many_sessions(1500)
        source = self.tmp / "many.jsonl"
        source.write_text("".join(json.dumps(s) + "\n" for s in sessions), encoding="utf-8")
        conn = sqlite3.connect(self.db)
        conn.execute("CREATE TRIGGER refuse_the_last BEFORE INSERT ON sessions "
                     "WHEN NEW.id = 'bulk_01499' "
                     "BEGIN SELECT RAISE(ABORT, 'the store refuses bulk_01499'); END")
        conn.commit()
        conn.close()
        result = self.run_cli("import", source)
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("the store refuses bulk_01499", result.stderr)
        self.assertIn("none of the import is visible; run it again to resume", result.stderr)
        self.assertEqual(len(self.session_ids()), 20)
        conn = sqlite3.connect(self.db)
        bulk = conn.execute("SELECT COUNT(*) FROM sessions WHERE id LIKE 'bulk_%'").fetchone()[0]
        self.assertEqual(bulk, 0)
        conn.close()


class ReadmeFirstScreen(TempDirTestCase):

    def test_the_api_example_runs_and_writes_nothing_into_the_real_home(self):
        text = (REPO / "README.md").read_text(encoding="utf-8")
        self.assertLess(text.index("```python\n"), len("\n".join(text.splitlines()[:120])))
        example = text.split("```python\n", 1)[1].split("```", 1)[0]
        env = {k: v for k, v in os.environ.items() if k != "HERMES_HOME"}
        env.update(HOME=str(self.tmp / "user"), USERPROFILE=str(self.tmp / "user"),
                   PYTHONPATH=str(REPO), TMPDIR=str(self.tmp))
        (self.tmp / "user").mkdir()
        result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                                env=env, cwd=self.tmp, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertRegex(result.stdout, r"hermes-example-.*state\.db 2 messages")
        self.assertEqual(list((self.tmp / "user").iterdir()), [])

    def test_every_command_in_the_table_is_one_the_cli_has(self):
        from hermes_state_cli import build_parser
        text = (REPO / "README.md").read_text(encoding="utf-8")
        first = "\n".join(text.splitlines()[:120])
        self.assertIn("--sort relevance", first)
        for path in ("docs/design.md", "docs/search.md", "docs/testing.md", "docs/differences.md"):
            self.assertIn(f"]({path})", first)
            self.assertTrue((REPO / path).exists(), path)
        commands = next(a for a in build_parser()._actions if a.dest == "command").choices
        for name, sub in commands.items():
            row = next(line for line in first.splitlines() if line.startswith(f"| `{name}"))
            options = {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
            for option in options - {"--help", "--db", "--replica", "--json"}:
                if name in ("list", "search") and option == "--limit":
                    option = "-n"
                self.assertIn(option, row, f"README row of {name} leaves out {option}")
