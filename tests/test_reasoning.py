"""A chat answer's reasoning told apart from its content (pocketllm/serving/reasoning.py): where the
prompt opened a reasoning block and where it did not, an answer cut inside it, and the streamed
form giving what the whole one gives wherever the text is cut. tests/test_serve_sampling.py has
the server's side (--reasoning-parser qwen3)."""

from __future__ import annotations

import pytest

from pocketllm.serving.reasoning import ReasoningStream, opens_reasoning, split_reasoning


def test_a_prompt_opens_reasoning_where_its_last_think_tag_is_unclosed():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    # enable_thinking false: the template closes an empty block itself.
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


@pytest.mark.parametrize("text,open_,want", [
    ("Let me think.\n</think>\n\nParis.", True, ("Let me think.\n", "Paris.")),
    ("cut inside its reasoning", True, ("cut inside its reasoning", "")),
    ("</think>\n\nno reasoning at all", True, ("", "no reasoning at all")),
    ("\n<think>\nhm</think>answer", False, ("\nhm", "answer")),
    ("Paris, with </think> in it", False, (None, "Paris, with </think> in it")),
    ("plain", False, (None, "plain")),
])
def test_whole_answers(text, open_, want):
    assert split_reasoning(text, open_) == want


STREAMED = [("Let me think.\n</think>\n\nParis.", True), ("a </thin b </think>\n", True), ("no end <", True),
            ("\n <think>x</think>\n\ny", False), ("<thinking is not a tag", False), (" <thi", False), ("plain", False)]


@pytest.mark.parametrize("text,open_", STREAMED)
def test_a_streamed_answer_gives_what_the_whole_one_does_wherever_it_is_cut(text, open_):
    reasoning, content = split_reasoning(text, open_)
    for cuts in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
        stream, got_r, got_c = ReasoningStream(open_), "", ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            r, c = stream.feed(text[a:b])
            got_r, got_c = got_r + r, got_c + c
            # What has gone out is the start of what the whole answer has.
            assert (reasoning or "").startswith(got_r) and content.startswith(got_c), (cuts, got_r, got_c)
        r, c = stream.finish()
        assert (got_r + r, got_c + c) == (reasoning or "", content), cuts
