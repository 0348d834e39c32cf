"""hermes_state_ids: the id hermes-agent mints for a session, and every shape it recognises."""

import re
import unittest
import uuid
from datetime import datetime

from hermes_state_ids import DEFAULT_HEX_LEN, is_known_session_id, new_session_id


class Minting(unittest.TestCase):

    def test_an_id_is_the_local_time_and_six_random_hex_digits(self):
        before = datetime.now().replace(microsecond=0)
        session_id = new_session_id()
        self.assertRegex(session_id, r"^\d{8}_\d{6}_[0-9a-f]{6}$")
        self.assertEqual(DEFAULT_HEX_LEN, 6)
        stamp = datetime.strptime(session_id[:15], "%Y%m%d_%H%M%S")
        self.assertLessEqual(before, stamp)
        self.assertLessEqual(stamp, datetime.now())

    def test_now_pins_the_stamp_and_hex_len_the_random_part(self):
        now = datetime(2026, 1, 2, 3, 4, 5)
        for hex_len in (1, 6, 8, 12, 32, 40):
            with self.subTest(hex_len=hex_len):
                session_id = new_session_id(now, hex_len=hex_len)
                self.assertRegex(session_id, rf"^20260102_030405_[0-9a-f]{{{hex_len}}}$")

    def test_ids_of_one_second_differ(self):
        now = datetime(2026, 1, 2, 3, 4, 5)
        self.assertEqual(len({new_session_id(now, hex_len=12) for _ in range(1000)}), 1000)

    def test_hex_len_is_keyword_only_and_must_be_a_positive_whole_number(self):
        with self.assertRaises(TypeError):
            new_session_id(None, 8)
        for bad in (0, -1, 2.5, "6", True):
            with self.subTest(hex_len=bad), self.assertRaisesRegex(ValueError, "hex_len"):
                new_session_id(hex_len=bad)


class Recognising(unittest.TestCase):

    def test_every_shape_hermes_agent_mints_is_known(self):
        for session_id in (new_session_id(), new_session_id(hex_len=12),
                           "cron_3f2a9c1b7d4e_20260102_030405", "cron_job-1_20260102_030405",
                           "bg_030405_a1b2c3", "bg_a1b2c3", "room_" + "ab" * 16,
                           "api_1767323045_0a1b2c3d", "api-0123456789abcdef", "run_" + uuid.uuid4().hex,
                           str(uuid.uuid4())):
            with self.subTest(session_id=session_id):
                self.assertTrue(is_known_session_id(session_id))

    def test_anything_else_is_not(self):
        for value in ("", "hello", "20260102_030405", "2026-01-02_030405_abc", "cron_job_2026",
                      "bg_ABCDEF", "bg_a1b2c3d", "room_abc", "api_12_0a1b2c3d", "api-0123",
                      "run_" + "g" * 32, str(uuid.uuid1()), "x20260102_030405_abc123",
                      None, 42, b"20260102_030405_abc123"):
            with self.subTest(value=value):
                self.assertFalse(is_known_session_id(value))

    def test_the_minted_stamp_is_what_recognition_anchors_on(self):
        self.assertTrue(re.match(r"\d{8}_\d{6}_", new_session_id()))
        self.assertTrue(is_known_session_id("20260102_030405_anything-after-the-stamp"))


if __name__ == "__main__":
    unittest.main()
