"""The prompt index and bounded jumps of hermes_state_timeline on real temporary stores."""

from hermes_state_timeline import get_session_messages_around, get_session_timeline
from test_support import StoreTestCase

END = "--- END OF CONTEXT SUMMARY — respond to the message below, not the summary above ---"


class TimelineTestCase(StoreTestCase):

    def setUp(self):
        super().setUp()
        self.db.create_session("s", "cli")
        add = self.db.append_message
        self.q1 = add("s", "user", "first   question\nspread", timestamp=1)
        add("s", "assistant", "a1", timestamp=2)
        conn = self.raw(self.path)
        conn.execute("UPDATE messages SET active = 0, compacted = 1")  # compacted in place
        conn.commit()
        self.carrier = add("s", "user", "[CONTEXT SUMMARY]: q1 a1\n" + END + "\n\ncarried ask", timestamp=3)
        add("s", "assistant", "a1", timestamp=2)  # the kept tail, copied into this generation
        add("s", "user", "[IMPORTANT: Background process 7 finished]", timestamp=4)
        add("s", "user", "note", display_kind="async_delegation_complete", timestamp=5)
        self.long = add("s", "user", "x" * 200, timestamp=6)
        add("s", "assistant", "a3", timestamp=7)
        self.rewound = add("s", "user", "taken back", timestamp=8)
        self.db.rewind_to_message("s", self.rewound)


class Timeline(TimelineTestCase):

    def test_prompts_a_person_typed_compacted_included_rewound_not(self):
        page = get_session_timeline(self.db, "s")
        self.assertEqual([(e["row_id"], e["preview"]) for e in page["entries"]], [
            (self.q1, "first question spread"), (self.carrier, "carried ask"),
            (self.long, "x" * 119 + "…")])
        self.assertEqual(page["entries"][0]["timestamp"], 1)
        self.assertEqual(page["pagination"], {"limit": 500, "after_row_id": 0, "returned": 3,
                                              "total": 3, "has_more": False, "next_cursor": None})

    def test_the_cursor_pages_through_the_prompts(self):
        first = get_session_timeline(self.db, "s", limit=2)
        self.assertEqual((first["pagination"]["has_more"], first["pagination"]["next_cursor"]),
                         (True, self.carrier))
        rest = get_session_timeline(self.db, "s", limit=2, after_row_id=self.carrier)
        self.assertEqual([e["row_id"] for e in rest["entries"]], [self.long])
        self.assertEqual((rest["pagination"]["total"], rest["pagination"]["has_more"]), (3, False))
        self.assertEqual(get_session_timeline(self.db, "ghost")["entries"], [])


class MessagesAround(TimelineTestCase):

    def test_a_page_starts_at_the_prompt_and_counts_what_is_around_it(self):
        page = get_session_messages_around(self.db, "s", self.carrier, limit=2)
        self.assertEqual([m["id"] for m in page["messages"]], [self.carrier, self.carrier + 2])
        self.assertEqual(page["pagination"], {"row_id": self.carrier, "limit": 2, "returned": 2,
                                              "order": "oldest", "offset": 2, "total": 7,
                                              "has_older": True, "has_newer": True})

    def test_the_copied_tail_is_shown_once_in_its_first_place(self):
        page = get_session_messages_around(self.db, "s", self.q1)
        self.assertEqual([m["content"] for m in page["messages"]][:3],
                         ["first   question\nspread", "a1", page["messages"][2]["content"]])
        self.assertEqual(page["messages"][2]["id"], self.carrier)
        self.assertEqual(page["pagination"]["total"], 7)

    def test_no_page_for_a_row_that_is_no_prompt(self):
        for row_id in (self.rewound, self.carrier + 1, 10 ** 6):
            with self.subTest(row_id=row_id):
                self.assertIsNone(get_session_messages_around(self.db, "s", row_id))
        self.assertIsNone(get_session_messages_around(self.db, "other", self.q1))
