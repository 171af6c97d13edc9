import pytest
from PIL import Image

from nodes.data import COLORS, TASKS, ShapesSource, make_sample


def test_samples_are_a_pure_function_of_seed_and_index():
    a_img, a_prompt, a_meta = make_sample(3, 17, "count")
    b_img, b_prompt, b_meta = make_sample(3, 17, "count")
    assert a_img.tobytes() == b_img.tobytes() and a_prompt == b_prompt and a_meta == b_meta
    assert make_sample(3, 18, "count")[0].tobytes() != a_img.tobytes()


def test_the_answer_is_in_the_image_not_the_prompt():
    for i in range(40):
        image, prompt, meta = make_sample(0, i, "color")
        assert prompt == TASKS["color"]
        assert image.mode == "RGB" and image.size == (32, 32)
        # The shape's colour is the most common non-background pixel colour.
        colors = {c: n for n, c in image.getcolors(32 * 32)}
        assert COLORS[meta["answer"]] in colors


def test_source_streams_and_resumes_from_its_position():
    src = ShapesSource(batch_size=4, seed=1)
    first = src.run()
    assert len(first["images"]) == 4 and all(isinstance(im, Image.Image) for im in first["images"])
    state = src.state_dict()
    second = src.run()
    resumed = ShapesSource(batch_size=4, seed=1)
    resumed.load_state_dict(state)
    again = resumed.run()
    assert [m["index"] for m in second["meta"]] == [4, 5, 6, 7]
    assert again["meta"] == second["meta"]


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="node 'shapes_source': task 'colour' is not one of"):
        ShapesSource(task="colour")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ShapesSource(batch_size=0)


def test_answer_reward_and_vocabulary():
    from nodes.data import answer_reward, task_vocabulary

    _, prompt, meta = make_sample(0, 0, "color")
    assert answer_reward(f"{meta['answer']} it is", meta) == 1.0
    wrong = next(c for c in meta["choices"] if c != meta["answer"])
    assert answer_reward(wrong, meta) == pytest.approx(0.2)
    assert answer_reward("", meta) == 0.0 and answer_reward("square", meta) == 0.0
    vocab = task_vocabulary()
    assert len(vocab) == len(set(vocab)) and set(prompt.split()) <= set(vocab) and "yellow" in vocab


def test_text_hint_puts_the_answer_in_words_that_the_vocabulary_covers():
    from nodes.data import task_vocabulary

    _, prompt, meta = make_sample(2, 5, "shape", text_hint=True)
    assert meta["shape"] in prompt.split() and prompt.endswith(TASKS["shape"])
    assert set(prompt.split()) <= set(task_vocabulary())


def test_answer_reward_matches_without_case_punctuation_or_number_format():
    """User data: capitalized, numeric and several-word answers (the shapes task's are one
    lower-case word, whose rewards are unchanged)."""
    from nodes.data import answer_reward

    assert answer_reward("Red", {"answer": "Red"}) == 1.0
    assert answer_reward("red.", {"answer": "RED"}) == 1.0
    assert answer_reward("42, I think", {"answer": 42}) == 1.0
    assert answer_reward("3.0", {"answer": "3"}) == 1.0
    assert answer_reward("New York City", {"answer": "new york"}) == 1.0
    assert answer_reward("New Jersey", {"answer": "new york"}) == 0.0
    assert answer_reward("York", {"answer": "new york"}) == 0.0
    choice = {"answer": "Paris", "choices": ["Paris", "Rome"]}
    assert answer_reward("Rome!", choice) == pytest.approx(0.2)


def test_answer_reward_scores_the_shapes_task_as_its_first_word_rule():
    """On the built-in task (one lower-case word answers and choices) the reward is the rule it
    always was: the response's first word, stripped of .,!? and lower-cased."""
    import random

    from nodes.data import answer_reward, task_vocabulary

    def first_word_rule(text, meta):
        words = text.split()
        first = words[0].strip(".,!?").lower() if words else ""
        if first == meta["answer"]:
            return 1.0
        return 0.2 if first in meta.get("choices", ()) else 0.0

    vocab = task_vocabulary()
    pieces = [*vocab, *(w.upper() for w in vocab), ".", "!", "?,", "x", "", "1"]
    rng = random.Random(0)
    for _ in range(3000):
        meta = {"answer": rng.choice(vocab), "choices": rng.sample(vocab, 4)}
        text = " ".join(rng.choice(pieces) + rng.choice(["", ".", ","]) for _ in range(3))
        assert answer_reward(text, meta) == first_word_rule(text, meta), (text, meta)
