"""Held-row coverage for in-place compaction: archive_and_compact archives exactly the rows the
compressor held, names held dicts without ids, and falls back to the watermark when it cannot."""

from hermes_state import SessionDB
from test_support import StoreTestCase

PERSISTED = "_db_persisted"


class CoverageTestCase(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def add(self, role, content, **fields):
        self.db.append_message("s", role, content, **fields)
        return self.db.get_active_message_watermark("s")

    def states(self):
        """{content: [(active, compacted), ...]} of every row, in id order."""
        found = {}
        for row in self.raw(self.path).execute(
                "SELECT content, active, compacted FROM messages WHERE session_id = 's' ORDER BY id"):
            found.setdefault(row["content"], []).append((row["active"], row["compacted"]))
        return found

    def live(self):
        return [m["content"] for m in self.db.get_messages_as_conversation("s")]

    def coverage(self, covered, unresolved=(), watermark=None):
        return self.db._execute_write(lambda conn: self.db._proved_coverage(
            conn, "s", covered, list(unresolved), watermark))


class ArchiveHeldRows(CoverageTestCase):

    def test_a_row_below_the_newest_held_one_that_was_not_held_lives_on(self):
        first = self.add("user", "held one")
        gap = self.add("user", "another surface's")
        last = self.add("assistant", "held two")
        count = self.db.archive_and_compact("s", [{"role": "user", "content": "summary"}],
                                            watermark=last, covered_ids=[first, last], unresolved_held=[])
        self.assertEqual(count, 2)
        self.assertEqual(self.live(), ["summary", "another surface's"])
        self.assertEqual(self.states(), {"held one": [(0, 1)], "held two": [(0, 1)],
                                         "another surface's": [(0, 0), (1, 0)], "summary": [(1, 0)]})
        self.assertNotEqual(self.db.get_messages_as_conversation("s", include_row_ids=True)[1]["_row_id"], gap)
        self.assertEqual(self.db.get_session("s")["message_count"], 2)

    def test_without_coverage_everything_up_to_the_watermark_is_summarised(self):
        self.add("user", "held one")
        self.add("user", "another surface's")
        mark = self.add("assistant", "held two")
        self.add("user", "after the snapshot", tool_calls=[{"id": "t"}])
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary"}], watermark=mark)
        self.assertEqual(self.live(), ["summary", "after the snapshot"])
        self.assertEqual(self.states()["another surface's"], [(0, 1)])
        self.assertEqual(self.db.get_session("s")["tool_call_count"], 1)

    def test_carried_messages_rewind_exactly_their_originals(self):
        # A micro-compaction keeps a prefix and a suffix verbatim around its marker.
        self.add("user", "prefix", timestamp=10.0)
        self.add("assistant", "summarised away", timestamp=11.0)
        self.add("tool", "big result", tool_call_id="c1", timestamp=12.0)
        suffix = self.add("user", "suffix", timestamp=13.0)
        kept = self.db.get_messages_as_conversation("s", include_row_ids=True)
        prefix_copy = {k: v for k, v in kept[0].items() if k != "_row_id"}  # matched by identity + time
        marker = {"role": "assistant", "content": "[older turns pruned]"}
        self.db.archive_and_compact("s", [prefix_copy, marker, kept[3]],
                                    carried_messages=[prefix_copy, kept[3]])
        self.assertEqual(self.states(), {
            "prefix": [(0, 0), (1, 0)], "summarised away": [(0, 1)], "big result": [(0, 1)],
            "suffix": [(0, 0), (1, 0)], "[older turns pruned]": [(1, 0)]})
        self.assertNotEqual(kept[3]["_row_id"], suffix, "the carried dict got its new row's id")

    def test_a_carried_row_is_matched_as_a_read_shows_it_recalled_memory_left_out(self):
        recalled = "ask <memory-context>recalled notes</memory-context>"
        self.add("user", recalled, timestamp=10.0)
        self.add("assistant", "summarised away", timestamp=11.0)
        kept = self.db.get_messages_as_conversation("s", include_row_ids=True)
        carried = {k: v for k, v in kept[0].items() if k != "_row_id"}
        self.assertEqual(carried["content"], "ask")  # what the compressor holds
        marker = {"role": "assistant", "content": "[older turns pruned]"}
        self.db.archive_and_compact("s", [carried, marker], carried_messages=[carried])
        # The original is rewound, not left compacted beside its live copy (found twice).
        self.assertEqual(self.states()[recalled], [(0, 0)])

    def test_an_ambiguous_or_changed_carried_dict_stays_summarised(self):
        self.add("user", "same", timestamp=5.0)
        self.add("user", "same", timestamp=5.0)
        changed = self.add("user", "edited later", timestamp=6.0)
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary"}], carried_messages=[
            {"role": "user", "content": "same", "timestamp": 5.0},
            {"role": "user", "content": "not what the row holds", "_row_id": changed, "timestamp": 9.0}])
        self.assertEqual(self.states()["same"], [(0, 1), (0, 1)])
        self.assertEqual(self.states()["edited later"], [(0, 1)])

    def test_the_tail_count_rewinds_the_newest_held_rows(self):
        self.add("user", "old")
        self.add("assistant", "kept reply")
        mark = self.add("user", "kept ask")
        self.add("user", "late")
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary"},
                                          {"role": "assistant", "content": "kept reply"},
                                          {"role": "user", "content": "kept ask"}],
                                    watermark=mark, tail_count=2)
        self.assertEqual(self.states(), {"old": [(0, 1)], "kept reply": [(0, 0), (1, 0)],
                                         "kept ask": [(0, 0), (1, 0)], "late": [(0, 0), (1, 0)],
                                         "summary": [(1, 0)]})
        self.assertEqual(self.live(), ["summary", "kept reply", "kept ask", "late"])

    def test_the_tail_count_with_coverage_takes_the_newest_covered_rows(self):
        first = self.add("user", "old")
        self.add("user", "unseen")
        last = self.add("assistant", "kept")
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary"},
                                          {"role": "assistant", "content": "kept"}],
                                    covered_ids=[first, last], tail_count=1)
        self.assertEqual(self.states(), {"old": [(0, 1)], "unseen": [(0, 0), (1, 0)],
                                         "kept": [(0, 0), (1, 0)], "summary": [(1, 0)]})

    def test_a_stored_held_dict_that_names_no_row_falls_back_to_the_watermark(self):
        first = self.add("user", "held")
        self.add("user", "gap")
        mark = self.add("user", "held without id")
        lost = {"role": "user", "content": "no such row", PERSISTED: True}
        self.db.archive_and_compact("s", [{"role": "user", "content": "summary"}], watermark=mark,
                                    covered_ids=[first], unresolved_held=[lost])
        self.assertEqual(self.states()["gap"], [(0, 1)], "the watermark path summarised the gap too")


class ProvedCoverage(CoverageTestCase):

    def test_held_dicts_without_ids_are_named_by_their_content(self):
        first = self.add("user", "a")
        second = self.add("assistant", "b")
        self.assertEqual(self.coverage([first], [{"role": "assistant", "content": "  b ", PERSISTED: True}]),
                         ([first, second], set()))
        self.assertEqual(self.coverage([first], [{"role": "user", "content": "never stored"}]), ([first], set()))
        self.assertIsNone(self.coverage([first], [{"role": "user", "content": "never stored", PERSISTED: True}]))
        self.assertIsNone(self.coverage(None))
        self.add("assistant", "b")
        self.assertIsNone(self.coverage([], [{"role": "assistant", "content": "b"}]), "two rows: ambiguous")

    def test_a_merged_user_run_is_named_and_its_later_rows_are_merged_away(self):
        one = self.add("user", "first ask")
        two = self.add("user", "second ask")
        merged = {"role": "user", "content": "[Tue 2026-04-28 13:40:53 CEST] first ask\n\nsecond ask",
                  "_merged_durable_rows": 2}
        self.assertEqual(self.coverage([], [merged]), ([one, two], {two}))
        self.assertEqual(self.coverage([], [dict(merged, _absorbed_row_ids=[two])]), ([one, two], set()))
        self.assertIsNone(self.coverage([], [dict(merged, content="other text")]))
        self.assertIsNone(self.coverage([], [merged], watermark=one), "the run ends above the watermark")

    def test_retired_rows_are_named_once_or_coverage_is_abandoned(self):
        call = self.add("assistant", "", tool_calls=[{"id": "c1"}])
        retired = {"role": "assistant", "content": None, "tool_call_ids": ["c1"], "_retired_row": True}
        self.assertEqual(self.coverage([], [retired]), ([call], {call}))
        self.assertEqual(self.coverage([], [dict(retired, _own_row=True)]), ([call], set()))
        self.assertIsNone(self.coverage([], [dict(retired, tool_call_ids=["c2"])]))

    def test_the_positional_helpers_count_what_tail_count_does_not(self):
        uncounted = SessionDB._uncounted_merged_rows
        self.assertEqual(uncounted([{"_merged_durable_rows": 3}, {"_unnamed_durable_rows": 2},
                                    {"_merged_durable_rows": 3, "_absorbed_row_ids": [7, 8]},
                                    {"_merged_durable_rows": 3, "_row_id": 4}, "not a dict"]), 4)
        originals = SessionDB._tail_originals
        self.assertEqual(originals([1, 2, 3, 4], 2, set()), [3, 4])
        self.assertEqual(originals([1, 2, 3, 4], 2, {4}), [2, 3, 4])
        self.assertEqual(originals([1, 2], 5, {2}), [1, 2])
