"""The message identity codec: dicts to identity columns and back, on rows with and without the
schema-31 columns."""

import json
import sqlite3
import unittest

from hermes_state_identity import (
    ABSORBED_MESSAGE_UIDS, MESSAGE_UID, SNAPSHOT_COLUMNS, TOOL_CALL_UID, TOOL_CALL_UIDS,
    _fill_missing_tool_call_uids, _restore_row_identity, identity_values, restore_identity_columns,
    row_snapshot, snapshot_of, stamp_identity, tool_call_key, uid_list, uid_map,
)


def row(**columns):
    """A sqlite3.Row with these columns, as a `SELECT *` gives it."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.row_factory = sqlite3.Row
        names = ", ".join(f"? AS {name}" for name in columns) or "1 AS id"
        return conn.execute(f"SELECT {names}", tuple(columns.values())).fetchone()
    finally:
        conn.close()  # a fetched Row keeps its values


class Codec(unittest.TestCase):

    def test_a_rows_ownership_version_is_0_22s_digest(self):
        # The digests hermes-agent 0.22.2.post1's agent.transcript_repair.transcript_row_snapshot
        # gives these rows (every other column None): its flush compares them with ours.
        rows = {"e8ff173a9182d54f78b5d85848fb966d": {"content": "数据 q\ud800", "token_count": 3,
                                                      "reasoning": "r"},
                "b2bbb17293aaf13aba948fd0b1377dc3": {"tool_call_uids": '{"c": "u1"}',
                                                      "token_count": 2.5,
                                                      "finish_reason": b"\x00\x01"},
                "c238460d76034704aab948f807ecd008": {}}
        for digest, stored in rows.items():
            self.assertEqual(row_snapshot(stored), digest)
            self.assertEqual(snapshot_of([stored.get(c) for c in SNAPSHOT_COLUMNS]), digest)

    def test_uid_lists_and_maps_keep_only_uids(self):
        self.assertEqual(uid_list(["a", "", 3, "a", "b"]), ["a", "b"])
        self.assertEqual(uid_list('["x"]'), ["x"])
        self.assertEqual(uid_list("not json"), [])
        self.assertEqual(uid_map({"c1": "u", "c2": ["u1", "u2"], "c3": "", "c4": [], "": "u", "c5": [1]}),
                         {"c1": "u", "c2": ["u1", "u2"]})
        self.assertEqual(uid_map('{"c": "u"}'), {"c": "u"})
        self.assertEqual(uid_map(["c"]), {})

    def test_a_tool_calls_key_is_its_call_id_before_its_id(self):
        self.assertEqual(tool_call_key({"id": " fc_1 ", "call_id": "call_1|item"}), "call_1")
        self.assertEqual(tool_call_key({"id": "c2"}), "c2")
        self.assertEqual(tool_call_key({}), "")

    def test_stamping_mints_once_and_pairs_results_within_a_write(self):
        seen = {}
        assistant = {"role": "assistant", "tool_calls": [{"id": "c1"}, {"id": "c1"}, {"id": "c2"}]}
        stamp_identity(assistant, assistant["tool_calls"], seen)
        uid = assistant[MESSAGE_UID]
        stamp_identity(assistant, assistant["tool_calls"], seen)
        self.assertEqual(assistant[MESSAGE_UID], uid)
        self.assertEqual(sorted(assistant[TOOL_CALL_UIDS]), ["c1", "c2"])
        result = {"role": "tool", "tool_call_id": "c2"}
        stamp_identity(result, None, seen)
        self.assertEqual(result[TOOL_CALL_UID], assistant[TOOL_CALL_UIDS]["c2"])
        stamp_identity({"role": "user"}, None, seen)
        late = {"role": "tool", "tool_call_id": "c1"}
        stamp_identity(late, None, seen)
        self.assertNotIn(TOOL_CALL_UID, late)  # never across a user turn

    def test_values_and_restore_are_inverse(self):
        message = {MESSAGE_UID: "m", ABSORBED_MESSAGE_UIDS: ["a", "a", "b"],
                   TOOL_CALL_UIDS: {"c2": "u2", "c1": "u1"}, TOOL_CALL_UID: "t"}
        values = identity_values(message)
        self.assertEqual(values, {"message_uid": "m", "absorbed_message_uids": '["a", "b"]',
                                  "tool_call_uids": json.dumps({"c1": "u1", "c2": "u2"}),
                                  "tool_call_uid": "t"})
        restored = {}
        restore_identity_columns(row(**values), restored)
        self.assertEqual(restored, {MESSAGE_UID: "m", ABSORBED_MESSAGE_UIDS: ["a", "b"],
                                    TOOL_CALL_UIDS: {"c1": "u1", "c2": "u2"}, TOOL_CALL_UID: "t"})
        self.assertEqual(identity_values({"message_uid": 5, "tool_call_uids": '{"c": "u"}'}),
                         {"message_uid": None, "absorbed_message_uids": None,
                          "tool_call_uids": '{"c": "u"}', "tool_call_uid": None})

    def test_a_row_without_the_columns_restores_nothing(self):
        message = {"role": "user"}
        restore_identity_columns(row(id=1, content="x"), message)
        _fill_missing_tool_call_uids(row(id=1), {"tool_calls": [{"id": "c"}]})
        self.assertEqual(message, {"role": "user"})

    def test_the_stored_uid_wins_but_a_live_list_extending_it_stays(self):
        message = {MESSAGE_UID: "live", TOOL_CALL_UIDS: {"c1": ["u1", "u9"], "c2": "old", "c3": "x"}}
        _restore_row_identity(row(message_uid="stored", tool_call_uids='{"c1": "u1", "c2": "u2"}',
                                  tool_call_uid=None), message)
        self.assertEqual(message, {MESSAGE_UID: "stored",
                                   TOOL_CALL_UIDS: {"c1": ["u1", "u9"], "c2": "u2", "c3": "x"}})

    def test_a_rewrite_gets_back_the_uids_of_calls_it_still_names(self):
        stored = row(tool_call_uids='{"c1": "u1", "c2": "u2"}')
        message = {"tool_calls": [{"id": "c1"}], TOOL_CALL_UIDS: {"c9": "u9"}}
        _fill_missing_tool_call_uids(stored, message)
        self.assertEqual(message[TOOL_CALL_UIDS], {"c9": "u9", "c1": "u1"})
        untouched = {"tool_calls": "not a list"}
        _fill_missing_tool_call_uids(stored, untouched)
        self.assertEqual(untouched, {"tool_calls": "not a list"})


if __name__ == "__main__":
    unittest.main()
