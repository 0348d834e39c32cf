"""Tokens and cost: update_token_counts, the token queue, auxiliary usage, routes and totals."""

import os
import sqlite3
import subprocess
import sys
import threading
import time

from hermes_state import SessionDB
from test_support import REPO, StoreTestCase

SESSION_COLUMNS = ("source", "model", "input_tokens", "output_tokens", "cache_read_tokens",
                   "cache_write_tokens", "reasoning_tokens", "api_call_count", "estimated_cost_usd",
                   "actual_cost_usd", "cost_status", "cost_source", "pricing_version",
                   "billing_provider", "billing_base_url", "billing_mode")
USAGE_KEY = ("model", "billing_provider", "billing_base_url", "billing_mode", "task")
USAGE_VALUES = ("api_call_count", "input_tokens", "output_tokens", "cache_read_tokens",
                "cache_write_tokens", "reasoning_tokens", "estimated_cost_usd", "actual_cost_usd",
                "cost_status", "cost_source")

# One agent turn as hermes-agent's conversation loop reports it: a fallback
# route answers first, then a /model switch, then back.
TURN = [
    ("s", dict(input_tokens=100, output_tokens=20, model="fallback", billing_provider="openrouter",
               billing_base_url="https://or", estimated_cost_usd=0.01, cost_status="estimated",
               cost_source="pricing_table", api_call_count=1)),
    ("s", dict(input_tokens=50, output_tokens=5, cache_read_tokens=40, model="fallback",
               billing_provider="openrouter", billing_base_url="https://or", estimated_cost_usd=0.02,
               cost_status="estimated", cost_source="pricing_table", api_call_count=1)),
    ("other", dict(input_tokens=1, api_call_count=1)),
    ("s", dict(input_tokens=7, reasoning_tokens=3, model="sub", billing_provider="anthropic",
               billing_mode="subscription_included", cost_status="included", api_call_count=1)),
    ("s", dict(output_tokens=9, model="fallback", billing_provider="openrouter", actual_cost_usd=0.5,
               cost_status="actual", pricing_version="2026-01", api_call_count=1)),
]


class UsageTestCase(StoreTestCase):
    """Reads of the stored token columns and usage rows."""

    def session_row(self, session_id):
        row = self.raw(self.path).execute(f"SELECT {', '.join(SESSION_COLUMNS)} FROM sessions WHERE id = ?",
                                          (session_id,)).fetchone()
        return None if row is None else dict(row)

    def usage_rows(self, session_id):
        rows = self.raw(self.path).execute("SELECT * FROM session_model_usage WHERE session_id = ?"
                                           " ORDER BY first_seen, rowid", (session_id,))
        return {tuple(row[k] for k in USAGE_KEY): {k: row[k] for k in USAGE_VALUES} for row in rows}


class UpdateTokenCounts(UsageTestCase):

    def test_every_parameter_is_written_at_once_in_the_reference_order(self):
        self.db.create_session("s", "cli")
        self.db.update_token_counts("s", 10, 5, "m", 1, 2, 3, 0.5, 0.25, "estimated", "table", "v1",
                                    "prov", "https://x", "paid", 1, False)
        self.assertEqual(self.session_row("s"), dict(
            source="cli", model="m", input_tokens=10, output_tokens=5, cache_read_tokens=1,
            cache_write_tokens=2, reasoning_tokens=3, api_call_count=1, estimated_cost_usd=0.5,
            actual_cost_usd=0.25, cost_status="estimated", cost_source="table", pricing_version="v1",
            billing_provider="prov", billing_base_url="https://x", billing_mode="paid"))
        self.assertEqual(self.usage_rows("s"), {("m", "prov", "https://x", "paid", ""): dict(
            api_call_count=1, input_tokens=10, output_tokens=5, cache_read_tokens=1, cache_write_tokens=2,
            reasoning_tokens=3, estimated_cost_usd=0.5, actual_cost_usd=0.25, cost_status="estimated",
            cost_source="table")})

    def test_a_missing_session_is_created_with_source_unknown_and_the_model(self):
        self.db.update_token_counts("new", model="m")
        row = self.session_row("new")
        self.assertEqual((row["source"], row["model"], row["input_tokens"], row["estimated_cost_usd"]),
                         ("unknown", "m", 0, 0.0))
        self.assertEqual(self.usage_rows("new"), {})  # nothing was counted
        self.assertIsNotNone(self.db.get_session("new")["started_at"])

    def test_the_guard_row_carries_the_callers_surface_once(self):
        self.db.queue_token_counts("q", source="telegram", input_tokens=1, model="m")  # 0.22's turn
        self.db.update_token_counts("u", input_tokens=1)
        self.db.update_token_counts("u", input_tokens=1, source="discord")  # a bare row learns it
        self.db.update_token_counts("u", input_tokens=1, source="slack")  # and keeps it
        self.db.flush_token_counts()
        self.assertEqual([self.session_row(s)["source"] for s in ("q", "u")], ["telegram", "discord"])
        self.assertEqual(self.session_row("u")["input_tokens"], 3)

    def test_a_tasks_calls_count_in_the_totals_under_their_own_row_never_as_the_route(self):
        self.db.create_session("s", "cli", model="main")
        self.db.update_token_counts("s", input_tokens=4, model="voice-m", billing_provider="vp",
                                    api_call_count=1, task="voice_chat")
        self.db.update_token_counts("s", input_tokens=1, billing_provider="p", api_call_count=1)
        row = self.session_row("s")
        self.assertEqual((row["input_tokens"], row["api_call_count"], row["model"],
                          row["billing_provider"]), (5, 2, "main", "p"))
        self.assertEqual(sorted(self.usage_rows("s")), [("main", "p", "", "", ""),
                                                        ("voice-m", "vp", "", "", "voice_chat")])
        with self.assertRaises(ValueError):
            self.db.update_token_counts("s", input_tokens=1, task=["not", "text"])

    def test_counters_add_statuses_keep_the_last_value_and_routes_fill_only_empty_columns(self):
        self.db.create_session("s", "cli", model="requested")
        self.db.update_token_counts("s", input_tokens=3, cost_status="estimated", billing_provider="p1",
                                    api_call_count=1)
        self.db.update_token_counts("s", input_tokens=4, cost_status="actual", billing_provider="p2",
                                    model="other")
        row = self.session_row("s")
        self.assertEqual((row["input_tokens"], row["cost_status"], row["billing_provider"], row["model"]),
                         (7, "actual", "p1", "requested"))
        self.assertIsNone(row["actual_cost_usd"])  # stays NULL until a provider reports one

    def test_the_first_counted_call_records_the_route_that_answered(self):
        self.db.create_session("s", "cli", model="primary")
        self.db.update_token_counts("s", input_tokens=1, model="fallback", billing_provider="fb",
                                    billing_base_url="https://fb", api_call_count=1)
        self.db.update_token_counts("s", input_tokens=1, model="third", billing_provider="t", api_call_count=1)
        row = self.session_row("s")
        self.assertEqual((row["model"], row["billing_provider"], row["billing_base_url"]),
                         ("fallback", "fb", "https://fb"))
        self.assertEqual(sorted(key[0] for key in self.usage_rows("s")), ["fallback", "third"])

    def test_absolute_totals_replace_the_counters_and_add_no_usage_row(self):
        self.db.update_token_counts("s", input_tokens=5, model="m", actual_cost_usd=0.4, api_call_count=1)
        self.db.update_token_counts("s", input_tokens=100, output_tokens=50, api_call_count=9, absolute=True)
        row = self.session_row("s")
        self.assertEqual((row["input_tokens"], row["output_tokens"], row["api_call_count"],
                          row["estimated_cost_usd"], row["actual_cost_usd"]), (100, 50, 9, 0.0, 0.4))
        self.assertEqual(list(self.usage_rows("s").values())[0]["input_tokens"], 5)

    def test_a_usage_row_without_a_model_takes_the_sessions_route_or_unknown(self):
        self.db.create_session("s", "cli", model="m")
        self.db.update_token_counts("s", input_tokens=1)
        self.db.update_token_counts("bare", input_tokens=1)
        self.assertEqual(list(self.usage_rows("s")), [("m", "", "", "", "")])
        self.assertEqual(list(self.usage_rows("bare")), [("unknown", "", "", "", "")])

    def test_numeric_text_and_none_are_accepted_as_hermes_agent_accepts_them(self):
        self.db.update_token_counts("s", input_tokens="12", output_tokens=None, estimated_cost_usd="0.5",
                                    model=7, api_call_count=True)
        row = self.session_row("s")
        self.assertEqual((row["input_tokens"], row["output_tokens"], row["estimated_cost_usd"], row["model"],
                          row["api_call_count"]), (12, 0, 0.5, "7", 1))

    def test_bad_values_raise_the_reference_class_and_write_nothing(self):
        cases = [
            (dict(session_id=None, input_tokens=1), sqlite3.IntegrityError, "session_id must be a string"),
            (dict(session_id="s", estimated_cost_usd="abc"), ValueError, "estimated_cost_usd must be a number"),
            (dict(session_id="s", input_tokens="many"), ValueError, "input_tokens must be a number"),
            (dict(session_id="s", cost_status={"a": 1}), sqlite3.ProgrammingError, "cost_status must be a string"),
            (dict(session_id="s", input_tokens=1 << 70), ValueError, "SQLite's integer range"),
            (dict(session_id="s", model="\ud800"), ValueError, "model holds a lone surrogate"),
            (dict(session_id="s", bogus=1), TypeError, "bogus"),
        ]
        for kwargs, error, message in cases:
            with self.subTest(kwargs=kwargs), self.assertRaisesRegex(error, message):
                self.db.update_token_counts(**kwargs)
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM sessions").fetchone()[0], 0)
        self.assertEqual(self.usage_rows("s"), {})


class TokenQueue(UsageTestCase):

    def stored(self, path):
        conn = self.raw(path)
        sessions = [tuple(r) for r in conn.execute(f"SELECT id, {', '.join(SESSION_COLUMNS)} FROM sessions"
                                                   " ORDER BY id")]
        usage = [tuple(r) for r in conn.execute(
            f"SELECT session_id, {', '.join(USAGE_KEY + USAGE_VALUES)} FROM session_model_usage"
            " ORDER BY session_id, model, billing_provider, billing_mode")]
        return sessions, usage

    def input_tokens(self, session_id):
        row = self.raw(self.path).execute("SELECT input_tokens FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return None if row is None else row[0]

    def test_a_queued_turn_stores_exactly_what_the_same_calls_made_one_by_one_store(self):
        self.db.create_session("s", "cli", model="requested")
        with SessionDB(self.tmp / "direct.db") as direct:
            direct.create_session("s", "cli", model="requested")
            for session_id, kwargs in TURN:
                self.db.queue_token_counts(session_id, **kwargs)
                direct.update_token_counts(session_id, **kwargs)
        self.assertEqual(self.input_tokens("s"), 0)  # still queued
        self.assertTrue(self.db.flush_token_counts())
        self.assertEqual(self.stored(self.path), self.stored(self.tmp / "direct.db"))
        self.assertEqual(self.input_tokens("s"), 157)

    def test_reads_that_need_the_counts_see_them(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", input_tokens=3, model="m", billing_provider="p", api_call_count=1)
        self.assertEqual(self.db.get_session("s")["input_tokens"], 3)
        self.db.queue_token_counts("s", input_tokens=2, model="m", billing_provider="p", api_call_count=1)
        self.assertEqual(self.db.list_sessions_rich()[0]["input_tokens"], 5)
        self.db.queue_token_counts("s", input_tokens=1, model="m", billing_provider="p", api_call_count=1)
        self.assertEqual(self.db.get_dominant_session_model_route("s")["api_call_count"], 3)

    def test_queued_counts_ride_with_the_next_write(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", input_tokens=4, api_call_count=1)
        self.db.append_message("s", "user", "hi")
        self.assertEqual(self.input_tokens("s"), 4)

    def test_a_write_outside_a_transaction_leaves_the_queue_for_the_next_one(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", input_tokens=7)
        self.db._execute_write(lambda conn: None, transaction=False)  # what vacuum() runs
        self.db.close()
        self.assertEqual(self.session_row("s")["input_tokens"], 7)

    def test_a_write_that_fails_keeps_the_queue_in_order(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", cost_status="first", input_tokens=1)

        def write_that_fails(conn):
            # Another caller queues while this write holds the batch taken from the queue.
            self.db.queue_token_counts("s", cost_status="second", input_tokens=1)
            raise ValueError("the write's own error")

        with self.assertRaisesRegex(ValueError, "the write's own error"):
            self.db._execute_write(write_that_fails)
        self.assertTrue(self.db.flush_token_counts())
        row = self.raw(self.path).execute("SELECT input_tokens, cost_status FROM sessions WHERE id = 's'").fetchone()
        self.assertEqual(tuple(row), (2, "second"))

    def test_a_bad_delta_is_logged_and_dropped_never_raised(self):
        self.db.create_session("s", "cli")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            self.assertIsNone(self.db.queue_token_counts("s", bogus=1))
            self.assertIsNone(self.db.queue_token_counts("s", input_tokens="lots"))
            self.assertIsNone(self.db.queue_token_counts(None, input_tokens=1))
        self.assertEqual(len(logs.output), 3)
        self.db.queue_token_counts("s", input_tokens=2)
        self.db.append_message("s", "user", "the next write is not blocked")
        self.assertEqual(self.input_tokens("s"), 2)

    def test_flush_gives_up_after_its_timeout_and_keeps_the_counts(self):
        self.db.create_session("s", "cli")
        held, release = threading.Event(), threading.Event()

        def hold_the_write_lock():
            self.db._execute_write(lambda conn: (held.set(), release.wait(10)))

        holder = threading.Thread(target=hold_the_write_lock)
        holder.start()
        try:
            held.wait(10)
            self.db.queue_token_counts("s", input_tokens=5)
            started = time.monotonic()
            self.assertFalse(self.db.flush_token_counts(timeout=0.2))
            self.assertLess(time.monotonic() - started, 2)
        finally:
            release.set()
            holder.join(10)
        self.assertEqual(self.input_tokens("s"), 0)
        self.assertTrue(self.db.flush_token_counts())
        self.assertEqual(self.input_tokens("s"), 5)

    def hold_the_store_in_another_process(self):
        """Another process inside a write (state.db.lock and SQLite's write lock held) until the returned
        function is called."""
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from hermes_state import SessionDB\n"
                "with SessionDB(sys.argv[2]) as db:\n"
                "    db._execute_write(lambda conn: (print('held', flush=True), sys.stdin.readline()))\n")
        return self.held_by_another_process(code, REPO, self.path)

    def test_a_flush_while_another_process_keeps_the_store_locked_fails_and_lands_the_counts_later_once(self):
        self.db.create_session("s", "cli")
        impatient = SessionDB(self.path, write_budget=0.3)
        self.addCleanup(impatient.close)
        impatient.queue_token_counts("s", input_tokens=5, model="m", billing_provider="p", api_call_count=1)
        impatient.queue_token_counts("other", output_tokens=2)
        release = self.hold_the_store_in_another_process()
        with self.assertLogs("hermes_state", "WARNING") as logs:
            self.assertFalse(impatient.flush_token_counts())
        self.assertIn("2 deltas kept", logs.output[0])
        self.assertEqual(len(impatient._tokens), 2)
        self.assertEqual(self.input_tokens("s"), 0)
        release()
        self.assertTrue(impatient.flush_token_counts())
        self.assertTrue(impatient.flush_token_counts())  # nothing left to land twice
        impatient.close()
        self.assertEqual((self.input_tokens("s"), self.session_row("other")["output_tokens"]), (5, 2))
        self.assertEqual(self.usage_rows("s")[("m", "p", "", "", "")]["api_call_count"], 1)

    def test_a_delta_sqlite_refuses_is_dropped_alone_and_the_others_land(self):
        self.db.create_session("s", "cli")
        self.db.create_session("refused", "cli", model="requested")
        conn = self.raw(self.path)
        conn.execute("CREATE TRIGGER another_programs_rule BEFORE UPDATE OF input_tokens ON sessions"
                     " WHEN NEW.id = 'refused' BEGIN SELECT RAISE(ABORT, 'refused by another program'); END")
        conn.commit()
        before = self.session_row("refused")
        self.db.queue_token_counts("s", input_tokens=1)
        # Counted on a new route: the route is rewritten before the counters, so it is rolled back too.
        self.db.queue_token_counts("refused", input_tokens=9, model="fallback", billing_provider="p",
                                   api_call_count=1)
        self.db.queue_token_counts("s", input_tokens=2, model="m")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            self.db.append_message("s", "user", "the write the deltas ride with")
        self.assertEqual(len(logs.output), 1)
        self.assertIn("queued token counts for session 'refused' dropped: refused by another program",
                      logs.output[0])
        self.assertEqual(self.input_tokens("s"), 3)
        self.assertEqual(self.session_row("refused"), before)
        self.assertEqual(self.usage_rows("refused"), {})
        self.assertEqual(len(self.db.get_messages("s")), 1)
        self.assertEqual(len(self.db._tokens), 0)

    def test_a_delta_whose_refusal_rolls_back_the_whole_write_is_dropped_alone_and_the_write_lands(self):
        """RAISE(ROLLBACK) ends the transaction, savepoint and all: the refused delta must not be put back
        to fail every later write."""
        self.db.create_session("s", "cli")
        self.db.create_session("refused", "cli")
        conn = self.raw(self.path)
        conn.execute("CREATE TRIGGER another_programs_rule BEFORE UPDATE OF input_tokens ON sessions"
                     " WHEN NEW.id = 'refused' BEGIN SELECT RAISE(ROLLBACK, 'rolled back by another program'); END")
        conn.commit()
        self.db.queue_token_counts("s", input_tokens=1)
        self.db.queue_token_counts("refused", input_tokens=9)
        self.db.queue_token_counts("s", input_tokens=2, model="m")
        with self.assertLogs("hermes_state", "WARNING") as logs:
            self.db.append_message("s", "user", "the write the deltas ride with")
        self.assertEqual(len(logs.output), 1)
        self.assertIn("session 'refused' dropped: rolled back by another program", logs.output[0])
        self.db.append_message("s", "user", "and the next write")
        self.assertEqual((self.input_tokens("s"), self.input_tokens("refused")), (3, 0))
        self.assertEqual(len(self.db.get_messages("s")), 2)
        self.assertEqual(len(self.db._tokens), 0)

    def test_counts_queued_from_many_threads_all_arrive(self):
        self.db.create_session("s", "cli")

        def queue_many():
            for _ in range(200):
                self.db.queue_token_counts("s", input_tokens=1, api_call_count=1, model="m")

        threads = [threading.Thread(target=queue_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        session = self.db.get_session("s")
        self.assertEqual((session["input_tokens"], session["api_call_count"]), (800, 800))

    def test_close_applies_the_queue_and_later_calls_raise_like_update_token_counts(self):
        self.db.create_session("s", "cli")
        self.db.queue_token_counts("s", input_tokens=6)
        self.db.close()
        self.assertEqual(self.input_tokens("s"), 6)
        self.assertTrue(self.db.flush_token_counts())
        # Used after close(), a writable handle reopens as 0.22's does: the counts land.
        self.db.queue_token_counts("s", input_tokens=1)
        self.db.close()
        self.assertEqual(self.input_tokens("s"), 7)
        closed = SessionDB(self.path, read_only=True)
        closed.close()
        with self.assertRaises(sqlite3.ProgrammingError):
            closed.get_session("s")

    def run_and_exit_without_close(self, body):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from hermes_state import SessionDB\n"
                "db = SessionDB(sys.argv[2])\n" + body)
        subprocess.run([sys.executable, "-c", code, os.getcwd(), str(self.path)], check=True, timeout=60)

    def test_the_queue_survives_an_interpreter_exit_without_close(self):
        self.db.create_session("s", "cli")
        self.run_and_exit_without_close("db.queue_token_counts('s', input_tokens=41, model='m')")
        self.assertEqual(self.db.get_session("s")["input_tokens"], 41)

    def test_the_queue_survives_its_sessiondb_being_dropped_unclosed(self):
        self.db.create_session("s", "cli")
        self.run_and_exit_without_close("db.queue_token_counts('s', input_tokens=8)\n"
                                        "del db\nimport gc; gc.collect()")
        self.assertEqual(self.db.get_session("s")["input_tokens"], 8)


class AuxiliaryUsage(UsageTestCase):

    def test_an_auxiliary_call_adds_to_its_task_row_and_leaves_the_session_counters(self):
        self.db.update_token_counts("s", input_tokens=10, model="main", billing_provider="p", api_call_count=1)
        for _ in range(2):
            self.db.record_auxiliary_usage("s", "vision", model="vm", billing_provider="g", input_tokens=4,
                                           output_tokens=1, estimated_cost_usd=0.01)
        self.db.record_auxiliary_usage("s", "background_review", input_tokens=3, api_call_count=5)
        self.db.record_auxiliary_usage("s", "title_generation", api_call_count=None)
        rows = self.usage_rows("s")
        self.assertEqual(rows[("vm", "g", "", "", "vision")]["input_tokens"], 8)
        self.assertEqual(rows[("vm", "g", "", "", "vision")]["api_call_count"], 2)
        self.assertAlmostEqual(rows[("vm", "g", "", "", "vision")]["estimated_cost_usd"], 0.02)
        self.assertEqual(rows[("unknown", "", "", "", "background_review")]["api_call_count"], 5)
        self.assertEqual(rows[("unknown", "", "", "", "title_generation")]["api_call_count"], 1)
        self.assertEqual(self.session_row("s")["input_tokens"], 10)

    def test_a_missing_session_gets_a_bare_row_and_empty_ids_are_ignored(self):
        self.db.record_auxiliary_usage("new", "compression", model="m")
        self.assertEqual((self.session_row("new")["source"], self.session_row("new")["model"]), ("unknown", None))
        self.assertIsNone(self.db.record_auxiliary_usage("", "vision"))
        self.assertIsNone(self.db.record_auxiliary_usage("s", None))
        self.assertIsNone(self.session_row("s"))

    def test_bad_auxiliary_values_raise_valueerror_and_write_nothing(self):
        for kwargs in (dict(api_call_count="abc"), dict(estimated_cost_usd="abc"), dict(input_tokens=[1])):
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError):
                self.db.record_auxiliary_usage("s", "vision", **kwargs)
        self.assertIsNone(self.session_row("s"))


class RoutesAndTotals(UsageTestCase):

    def test_the_dominant_route_is_the_main_loop_route_with_most_calls(self):
        for model, provider in (("a", "pa"), ("b", "pb"), ("b", "pb"), ("unknown", "pu")):
            self.db.queue_token_counts("s", input_tokens=1, model=model, billing_provider=provider, api_call_count=1)
        self.db.record_auxiliary_usage("s", "vision", model="v", billing_provider="pv", api_call_count=50)
        self.assertEqual(self.db.get_dominant_session_model_route("s"), dict(
            model="b", billing_provider="pb", billing_base_url="", billing_mode="", api_call_count=2))
        self.assertIsNone(self.db.get_dominant_session_model_route("missing"))

    def test_a_billing_route_change_overwrites_the_route_and_drops_the_stored_prompt(self):
        self.db.create_session("s", "cli", model="m", system_prompt="Provider: old")
        self.db.update_token_counts("s", input_tokens=1, billing_provider="old", billing_mode="paid")
        self.assertIsNone(self.db.update_session_billing_route("s", provider="new", base_url="https://n"))
        row = self.raw(self.path).execute("SELECT billing_provider, billing_base_url, billing_mode, system_prompt,"
                                          " system_prompt_hash FROM sessions WHERE id = 's'").fetchone()
        self.assertEqual(tuple(row), ("new", "https://n", "paid", None, None))
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM system_prompts").fetchone()[0], 0)
        self.assertIsNone(self.db.update_session_billing_route("missing", provider="x", base_url="y"))

    def test_usage_totals_sum_root_sessions_with_messages_preferring_the_billed_cost(self):
        self.db.create_session("a", "cli")
        self.db.create_session("b", "cli")
        self.db.create_session("child", "cli", parent_session_id="a")
        for session_id in ("a", "b", "child"):
            self.db.append_message(session_id, "user", "hi")
        self.db.queue_token_counts("a", input_tokens=100, output_tokens=50, estimated_cost_usd=0.5)
        self.db.queue_token_counts("b", input_tokens=7, output_tokens=1, estimated_cost_usd=9.0, actual_cost_usd=0.25)
        self.db.queue_token_counts("child", input_tokens=1000)
        self.db.queue_token_counts("empty", input_tokens=3)
        self.assertEqual(self.db.usage_totals(), {"tokens": 158, "cost_usd": 0.75})
        self.assertEqual(self.db.usage_totals(min_message_count=0)["tokens"], 161)
        self.db.set_session_archived("b", True)
        self.assertEqual(self.db.usage_totals(), {"tokens": 150, "cost_usd": 0.5})
        self.assertEqual(self.db.usage_totals(include_archived=True)["tokens"], 158)


class SessionActivity(UsageTestCase):
    """The heartbeat hermes-agent's turn writes (touch) and clears at its end."""

    def activity(self, session_id="s"):
        return tuple(self.raw(self.path).execute(
            "SELECT last_activity_at, last_activity_description, last_activity_provenance FROM sessions"
            " WHERE id = ?", (session_id,)).fetchone())

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def test_a_touch_stores_time_trimmed_description_and_known_provenance(self):
        self.db.touch_session_activity("s", 1000.0, description="  calling the model  ", provenance="agent.compression")
        self.assertEqual(self.activity(), (1000.0, "calling the model", "agent.compression"))
        self.db.touch_session_activity("s", "1001", description="x" * 130, provenance="made up")
        self.assertEqual(self.activity(), (1001.0, "x" * 119 + "\u2026", "unknown"))

    def test_a_touch_never_moves_the_stamp_back_and_defaults_to_now(self):
        self.db.touch_session_activity("s", 1000.0, description="first")
        self.db.touch_session_activity("s", 999.0, description="late arrival")
        self.assertEqual(self.activity(), (1000.0, "first", "unknown"))
        before = time.time()
        self.db.touch_session_activity("s")
        self.assertGreaterEqual(self.activity()[0], before)
        self.assertEqual(self.activity()[1:], ("", "unknown"))

    def test_clearing_keeps_the_time_and_blanks_the_labels(self):
        self.db.touch_session_activity("s", 1000.0, description="compressing", provenance="agent.compression")
        self.db.clear_session_activity_labels("s")
        self.assertEqual(self.activity(), (1000.0, "", "unknown"))

    def test_missing_sessions_and_empty_ids_are_no_ops_and_bad_values_raise(self):
        for call in (lambda: self.db.touch_session_activity("gone", 5.0), lambda: self.db.touch_session_activity(""),
                     lambda: self.db.clear_session_activity_labels("gone"),
                     lambda: self.db.clear_session_activity_labels("")):
            self.assertIsNone(call())
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM sessions").fetchone()[0], 1)
        with self.assertRaises(ValueError):
            self.db.touch_session_activity("s", "soon")
        self.assertEqual(self.activity(), (None, None, None))


class RoutesAndAuxiliaryTasks(UsageTestCase):

    def test_the_recent_route_is_the_one_used_last_not_the_most(self):
        for _ in range(3):
            self.db.update_token_counts("s", input_tokens=1, model="old", billing_provider="p1",
                                        api_call_count=1)
        self.db.update_token_counts("s", input_tokens=1, model="new", billing_provider="p2",
                                    billing_base_url="https://p2", api_call_count=1)
        self.db.record_auxiliary_usage("s", "vision", model="aux", billing_provider="p3")
        self.assertEqual(self.db.get_dominant_session_model_route("s")["model"], "old")
        recent = self.db.get_recent_session_model_route("s")
        self.assertEqual(recent, {"model": "new", "billing_provider": "p2", "billing_base_url": "https://p2",
                                  "billing_mode": recent["billing_mode"], "api_call_count": 1})
        self.assertIsNone(self.db.get_recent_session_model_route("nope"))

    def test_auxiliary_usage_sums_per_task_along_the_lineage_up_to_a_branch(self):
        self.db.create_session("root", "cli")
        self.db.create_session("branch", "cli", parent_session_id="root", model_config={"_branched_from": "root"})
        self.db.create_session("tip", "cli", parent_session_id="branch")
        self.db.record_auxiliary_usage("root", "vision", model="v", input_tokens=100)
        self.db.record_auxiliary_usage("branch", "vision", model="v", input_tokens=10, estimated_cost_usd=0.5)
        self.db.record_auxiliary_usage("tip", "vision", model="v", input_tokens=1, api_call_count=2)
        self.db.record_auxiliary_usage("tip", "title_generation", model="t", output_tokens=4)
        self.db.update_token_counts("tip", input_tokens=1000, model="main")
        by_task = self.db.auxiliary_usage_by_task("tip")
        self.assertEqual(sorted(by_task), ["title_generation", "vision"])
        self.assertEqual(by_task["vision"]["api_calls"], 3)
        self.assertEqual(by_task["vision"]["input_tokens"], 11)
        self.assertEqual(by_task["vision"]["estimated_cost_usd"], 0.5)
        self.assertEqual(by_task["title_generation"]["output_tokens"], 4)
        self.assertEqual(self.db.auxiliary_usage_by_task("root")["vision"]["input_tokens"], 100)
        self.assertEqual(self.db.auxiliary_usage_by_task(""), {})
