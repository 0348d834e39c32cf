"""Export shapes: one session, and a compression chain as one logical session."""

from hermes_state import SessionDB
from test_support import V26_DB, TempDirTestCase


class Exports(TempDirTestCase):

    def setUp(self):
        super().setUp()
        self.db = SessionDB(self.copy_fixture(V26_DB))
        self.addCleanup(self.db.close)

    def test_export_session_has_every_column_and_decoded_active_messages(self):
        export = self.db.export_session("bench_000003")
        columns = {r[1] for r in self.db._read_all("PRAGMA table_info(sessions)")}
        self.assertTrue(columns <= set(export))
        self.assertEqual(export["system_prompt"], "You are a helpful agent. 你是一个助手。")
        self.assertEqual(len(export["messages"]), 16)
        self.assertEqual([m["id"] for m in export["messages"]], sorted(m["id"] for m in export["messages"]))
        calls = [m["tool_calls"] for m in export["messages"] if m["tool_calls"]]
        self.assertEqual(len(calls), 4)
        self.assertIsInstance(calls[0], list)
        self.assertEqual(export["last_active"], export["messages"][-1]["timestamp"])
        self.assertIsNone(self.db.export_session("ghost"))

    def test_export_leaves_out_rewound_messages(self):
        first = self.db.export_session("bench_000003")["messages"][3]["id"]
        self.db.rewind_to_message("bench_000003", first)
        self.assertEqual(len(self.db.export_session("bench_000003")["messages"]), 4)

    def test_lineage_export_is_one_logical_session(self):
        for member in ("bench_000005", "bench_000006"):
            export = self.db.export_session_lineage(member)
            self.assertEqual(export["lineage_session_ids"], ["bench_000005", "bench_000006"])
            self.assertEqual(export["id"], "bench_000006")
            self.assertEqual([s["id"] for s in export["segments"]], ["bench_000005", "bench_000006"])
            self.assertEqual((len(export["messages"]), export["message_count"]), (32, 32))
            self.assertEqual(export["tool_call_count"], 8)
            self.assertEqual(export["messages"][:16], export["segments"][0]["messages"])
        self.assertIsNone(self.db.export_session_lineage("ghost"))
