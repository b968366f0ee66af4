"""scripts/chat_loops.py's loop test: a reply that ran to max_tokens repeating itself is a loop;
one that stopped, or ran long without repeating, is not."""

from resources import script

loops = script("chat_loops")


def test_a_reply_cut_at_max_tokens_while_repeating_is_a_loop():
    reply = list(range(40)) + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 6
    assert loops.looped(reply, "length")


def test_a_stopped_reply_or_a_long_one_without_repeats_is_not():
    assert not loops.looped([1, 2, 3] * 30, "stop")
    assert not loops.looped(list(range(100)), "length")
    assert not loops.looped([], "length")


def test_a_setting_reads_sampling_fields():
    assert loops.setting("repeat_penalty=1.1, top_k=20") == {"repeat_penalty": 1.1, "top_k": 20}
    assert loops.setting("") == {}
