"""Tests for widgets.quiz and the thirteen chapter quiz files."""

from __future__ import annotations

import collections
import json
import math

import pytest

from widgets.quiz import (MIN_QUESTIONS, Question, Quiz, live_answer_positions, load_quiz, make_question,
                          quarter_shares, quiz_path, shuffle_options, shuffle_seed)

CHAPTERS = range(1, 14)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_has_a_valid_quiz(chapter: int) -> None:
    raw = json.loads(quiz_path(chapter).read_text(encoding="utf-8"))
    assert raw["chapter"] == chapter and raw["title"]
    assert len(raw["questions"]) >= MIN_QUESTIONS
    for q in raw["questions"]:
        assert q["question"].strip()
        assert sum(1 for o in q["options"] if o["correct"] is True) == 1
        assert all(o["correct"] in (True, False) for o in q["options"])
        assert all(o["explanation"].strip() and o["text"].strip() for o in q["options"])
        assert len({o["text"] for o in q["options"]}) == len(q["options"])
    quiz = load_quiz(chapter)
    assert quiz.chapter == chapter and len(quiz.questions) == len(raw["questions"])


def _longest_is_correct(question: Question) -> bool:
    """True when the correct option is the (or a joint) longest one: the test-taker's cue."""
    return len(question.options[question.answer].text) == max(len(o.text) for o in question.options)


def test_the_correct_option_is_rarely_the_longest() -> None:
    # Chance level with four options is a quarter; a third at most, overall and per chapter.
    shares = {}
    for chapter in CHAPTERS:
        questions = load_quiz(chapter, shuffle=False).questions
        shares[chapter] = (sum(map(_longest_is_correct, questions)), len(questions))
    longest, total = map(sum, zip(*shares.values()))
    assert longest / total <= 1 / 3, shares
    assert all(n <= math.ceil(q / 3) for n, q in shares.values()), shares
    assert longest > 0, "never the longest is a pattern too: a reader would learn to skip the longest"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_correct_answers_are_spread_evenly_over_positions(chapter: int) -> None:
    quiz = load_quiz(chapter)
    n = len(quiz.questions)
    k = min(len(q.options) for q in quiz.questions)
    positions = collections.Counter(q.answer for q in quiz.questions)
    assert len(positions) > 1, positions
    assert max(positions.values()) <= math.ceil(n / k), positions  # no position dominates


def _is_periodic(sequence: list[int], period: int) -> bool:
    return all(sequence[i] == sequence[i + period] for i in range(len(sequence) - period))


def test_shuffled_positions_are_reproducible_and_follow_no_cycle() -> None:
    shown, written = [], []
    for chapter in CHAPTERS:
        first, again = load_quiz(chapter), load_quiz(chapter)
        assert first == again  # the same order on every load, in CI too (no process-seeded hash)
        shown += [q.answer for q in first.questions]
        written += [q.answer for q in load_quiz(chapter, shuffle=False).questions]
    assert shown != written  # the display order is not the file's order
    assert not any(_is_periodic(shown, p) for p in range(1, 5)), shown  # no constant and no rotation of <= 4
    counts = collections.Counter(shown)
    assert max(counts.values()) - min(counts.values()) <= len(shown) // 6, counts


def test_shuffle_is_seeded_by_chapter_and_question_and_ignores_the_written_order() -> None:
    question = load_quiz(7, shuffle=False).questions[0]
    reversed_ = Question(question.question, question.options[::-1])
    assert shuffle_options(question, 7) == shuffle_options(reversed_, 7)
    assert shuffle_options(shuffle_options(question, 7), 7) == shuffle_options(question, 7)
    orders = {tuple(o.text for o in shuffle_options(question, c).options) for c in range(1, 40)}
    assert len(orders) > 1  # the chapter is part of the seed
    assert shuffle_options(question, 7, answer_at=2).answer == 2
    assert shuffle_seed(3, "q") == shuffle_seed(3, "q") != shuffle_seed(4, "q")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;").replace(
        "'", "&#x27;")


def test_answering_checking_and_scoring() -> None:
    view = Quiz(5)
    quiz = view.controller.quiz
    n = len(quiz.questions)
    assert f"Score: <b>0</b> / {n}" in view.score_label.value
    view.check_buttons[0].click()
    assert "choose an answer first" in view.feedback[0].value
    q0, q1 = quiz.questions[0], quiz.questions[1]
    assert [r.options for r in view.radios] == [tuple((o.text, j) for j, o in enumerate(q.options))
                                               for q in quiz.questions]  # shown in the shuffled order
    view.radios[0].value = q0.answer
    view.check_buttons[0].click()
    assert 'data-correct="true"' in view.feedback[0].value
    for option in q0.options:  # once right, every option's explanation is shown
        assert _esc(option.explanation) in view.feedback[0].value
    assert f"Score: <b>1</b> / {n} (first answers; 1 answered, 1 solved)" in view.score_label.value


def test_a_wrong_answer_explains_itself_hides_the_right_one_and_is_what_counts() -> None:
    view = Quiz(5)
    q1 = view.controller.quiz.questions[1]
    wrong = (q1.answer + 1) % len(q1.options)
    view.radios[1].value = wrong
    view.check_buttons[1].click()
    shown = view.feedback[1].value
    assert 'data-correct="false"' in shown and "(your answer)" in shown
    assert _esc(q1.options[wrong].explanation) in shown  # why the chosen one is wrong
    right = q1.options[q1.answer]
    assert _esc(right.explanation) not in shown and _esc(right.text) not in shown  # the answer is not revealed
    others = [o for j, o in enumerate(q1.options) if j not in (wrong, q1.answer)]
    assert all(_esc(o.explanation) not in shown for o in others)
    assert "Try another option" in shown
    assert not view.radios[1].disabled and not view.check_buttons[1].disabled  # the learner can try again
    view.radios[1].value = q1.answer  # a new choice clears the old verdict until checked
    assert view.feedback[1].value == ""
    view.check_buttons[1].click()
    assert 'data-correct="true"' in view.feedback[1].value and "try 2" in view.feedback[1].value
    n = len(view.controller.quiz.questions)
    assert f"Score: <b>0</b> / {n} (first answers; 1 answered, 1 solved)" in view.score_label.value


def test_full_marks_need_every_first_answer_right() -> None:
    view = Quiz(3)
    c = view.controller
    for i, q in enumerate(c.quiz.questions):
        if i == 0:  # one wrong try, then the right one
            c.select(i, (q.answer + 1) % len(q.options))
            assert not c.check(i).correct
        c.select(i, q.answer)
        feedback = c.check(i)
        assert feedback.correct and feedback.attempt == (2 if i == 0 else 1)
    assert c.num_solved == c.num_questions and c.score == c.num_questions - 1
    c.select(0, c.quiz.questions[0].answer)  # checking again changes nothing
    c.check(0)
    assert c.score == c.num_questions - 1
    with pytest.raises(ValueError, match="between|option"):
        c.select(0, 99)


def test_live_answer_positions_fill_the_least_used_places() -> None:
    placed = [(0, 4), (0, 4), (1, 4), (2, 4), (3, 4)]  # first quarter used twice, the others once
    assert sorted(live_answer_positions(4, placed, [4, 4, 4])) == [1, 2, 3]  # the three less used quarters
    assert live_answer_positions(4, [(0, 4), (1, 4), (2, 4)], [4]) == [3]
    assert live_answer_positions(4, [(0, 4), (1, 4), (2, 4)], [8]) in ([6], [7])  # the last quarter of 8 options
    assert live_answer_positions(4, [], [5, 5]) == live_answer_positions(4, [], [5, 5])  # seeded
    many = live_answer_positions(9, [], [4] * 8)
    assert [many.count(p) for p in range(4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="options"):
        live_answer_positions(9, [], [0])


def test_quarter_shares_split_a_position_over_the_quarters() -> None:
    assert quarter_shares(0, 4) == [1.0, 0.0, 0.0, 0.0]
    assert quarter_shares(1, 2) == [0.0, 0.0, 0.5, 0.5]
    assert [round(x, 6) for x in quarter_shares(1, 5)] == [0.25, 0.75, 0.0, 0.0]
    for k in (3, 5, 6, 7):
        totals = [sum(quarter_shares(p, k)[q] for p in range(k)) / k for q in range(4)]
        assert all(abs(t - 0.25) < 1e-9 for t in totals)  # a random place spreads evenly
    with pytest.raises(ValueError, match="outside"):
        quarter_shares(4, 4)


def test_invalid_quiz_files_are_refused(tmp_path) -> None:
    def write(questions):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"chapter": 99, "title": "bad", "questions": questions}))
        return path

    option = {"text": "a", "correct": False, "explanation": "why"}
    good = {"question": "q", "options": [dict(option, correct=True), dict(option, text="b")]}
    with pytest.raises(ValueError, match="at least 4 questions"):
        load_quiz(write([good] * 3))
    two_right = {"question": "q", "options": [dict(option, correct=True), dict(option, text="b", correct=True)]}
    with pytest.raises(ValueError, match="exactly one correct"):
        load_quiz(write([good] * 3 + [two_right]))
    unexplained = {"question": "q", "options": [dict(option, correct=True), dict(option, explanation=" ")]}
    with pytest.raises(ValueError, match="explanation"):
        load_quiz(write([good] * 3 + [unexplained]))
    twins = {"question": "q", "options": [dict(option, correct=True), dict(option)]}
    with pytest.raises(ValueError, match="same text"):
        load_quiz(write([good] * 3 + [twins]))
    with pytest.raises(ValueError, match="no quiz file"):
        load_quiz(42)


# --------------------------------------------------------------- live questions
def test_make_question_deduplicates_and_validates() -> None:
    q = make_question("2 + 2?", ("4", "sum"), [("4", "same as the answer"), ("5", "off by one"), ("5", "again"),
                                               ("22", "concatenated")])
    assert sorted(o.text for o in q.options) == ["22", "4", "5"] and q.options[q.answer].text == "4"
    with pytest.raises(ValueError, match="at least two options"):
        make_question("2 + 2?", ("4", "sum"), [("4", "the same")])
    with pytest.raises(ValueError, match="explanation"):
        make_question("2 + 2?", ("4", "sum"), [("5", " ")])


def test_live_questions_join_the_quiz_shuffled_and_scored() -> None:
    live = make_question("Which slot?", ("36", "computed"), [("20", "contiguous"), ("2", "block id")])
    view = Quiz(3, live=[live])
    quiz = view.controller.quiz
    assert len(quiz.questions) == len(load_quiz(3).questions) + 1
    shown = quiz.questions[-1]
    assert shown.options[shown.answer].text == "36"
    assert {o.text for o in shown.options} == {o.text for o in live.options}
    assert shown == shuffle_options(live, 3, answer_at=shown.answer)  # the seeded order, answer moved
    view.radios[-1].value = shown.answer
    view.check_buttons[-1].click()
    assert 'data-correct="true"' in view.feedback[-1].value
    with pytest.raises(TypeError, match="Question"):
        Quiz(3, live=["which slot?"])


@pytest.fixture
def engine():
    from nanoengine import LLMEngine
    from nanoengine.loader.weights import random_model

    return LLMEngine.from_model(random_model("tiny-llama"), None, device="cpu", num_kv_blocks=64, block_size=4,
                                max_model_len=64)


def _answer(question: Question) -> str:
    texts = [o.text for o in question.options]
    assert len(set(texts)) == len(texts) >= 3, texts  # distinct, and more than a coin toss
    return question.options[question.answer].text


def _record(engine) -> list:
    events: list = []
    engine.events.subscribe(events.append)
    return events


def test_kv_slot_and_block_questions_match_the_engine(engine) -> None:
    from nanoengine import SamplingParams
    from nanoengine.events import BatchPrepared
    from widgets.live_questions import blocks_needed_question, kv_slot_question

    events = _record(engine)
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request(list(range(10, 20)), params, request_id="a")  # 10 tokens: blocks 0-2
    engine.add_request(list(range(30, 52)), params, request_id="b")  # 22 tokens: after a's blocks
    engine.step()
    snapshot = engine.snapshot()
    rows = {r.request_id: r for e in events if isinstance(e, BatchPrepared) for r in e.rows}
    for position in (0, 5, 13, 20):  # the slots the engine wrote the prompt's K/V to
        expected = rows["b"].slot_mapping[rows["b"].positions.index(position)]
        assert _answer(kv_slot_question(snapshot, "b", position)) == str(expected)
    assert str(position) != str(expected)  # the contiguous guess is a distractor, not the answer
    with pytest.raises(ValueError, match="outside"):
        kv_slot_question(snapshot, "b", 24)
    with pytest.raises(ValueError, match="no request"):
        kv_slot_question(snapshot, "zz", 0)
    held = {r.request_id: len(r.block_ids) for r in snapshot.running}
    assert _answer(blocks_needed_question(snapshot, 10)) == str(held["a"]) == "3"
    assert _answer(blocks_needed_question(snapshot, 22)) == str(held["b"]) == "6"
    assert _answer(blocks_needed_question(snapshot, 8)) == "2"


def test_kv_bytes_question_matches_the_allocated_pool(engine) -> None:
    from widgets.live_questions import kv_bytes_question

    report = engine.memory_report()
    question = kv_bytes_question(engine.model_config, report)
    measured = report.kv_cache_bytes // (report.num_kv_blocks * report.block_size)  # the tensor, per token slot
    assert int(_answer(question).replace(",", "")) == measured


def test_step_questions_match_what_the_scheduler_schedules() -> None:
    from nanoengine import LLMEngine, SamplingParams
    from nanoengine.events import RequestScheduled
    from nanoengine.loader.weights import random_model
    from widgets.live_questions import plan_next_step, step_question, step_tokens_question

    engine = LLMEngine.from_model(random_model("tiny-llama"), None, device="cpu", num_kv_blocks=64, block_size=4,
                                  max_model_len=64, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0)
    engine.add_request(list(range(10, 22)), params, request_id="a")
    engine.step()  # a: 12-token prefill, now decoding
    engine.add_request(list(range(40, 50)), params, request_id="b")  # 10 tokens
    engine.add_request(list(range(60, 80)), params, request_id="c")  # 20 tokens: only a chunk fits
    snapshot = engine.snapshot()
    questions = {rid: step_question(snapshot, engine.config, rid) for rid in ("a", "b", "c")}
    total = step_tokens_question(snapshot, engine.config)
    plan = plan_next_step(snapshot)
    events = _record(engine)
    engine.step()
    scheduled = {e.request_id: e for e in events if isinstance(e, RequestScheduled)}
    assert {p.request_id: (p.num_tokens, p.is_prefill) for p in plan} == \
        {rid: (e.num_tokens, e.is_prefill) for rid, e in scheduled.items()}
    assert _answer(questions["a"]) == "decode, 1 token"
    assert _answer(questions["b"]) == "prefill, 10 tokens"
    assert _answer(questions["c"]) == "prefill, 5 tokens"  # 16 - 1 - 10: chunked prefill
    assert _answer(total) == str(sum(e.num_tokens for e in scheduled.values())) == "16"


def test_prefix_hit_question_matches_the_block_manager(engine) -> None:
    from nanoengine import SamplingParams
    from widgets.live_questions import prefix_hit_question

    params = SamplingParams(max_tokens=1, temperature=0)
    shared = list(range(100, 114))  # 14 tokens: 3 full blocks of 4 are cached
    engine.add_request(shared, params, request_id="first")
    while engine.has_unfinished_requests():
        engine.step()
    cases = {"same start": shared[:12] + [7, 8, 9],  # 3 cached blocks, a new tail
             "whole prompt": shared[:12],  # 3 blocks match but the last token must be computed: 2
             "different start": [5] + shared[1:12] + [1],  # the first block differs: chain broken, 0
             "offset": shared[4:12] + [3, 3, 3]}  # equal blocks after a different prefix: 0
    for i, (name, prompt) in enumerate(cases.items()):
        snapshot = engine.snapshot()
        answer = _answer(prefix_hit_question(snapshot, prompt))
        engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0), request_id=f"r{i}")
        engine.step()  # admitted: the scheduler looked the prompt up in the prefix cache
        cached = next(r.num_cached_tokens for r in engine.snapshot().running if r.request_id == f"r{i}")
        assert answer.startswith(f"{cached // 4} block"), (name, answer, cached)
        assert cached == {"same start": 12, "whole prompt": 8}.get(name, 0), name
        while engine.has_unfinished_requests():
            engine.step()


def _survivors(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[int]:
    """The filters written out in plain Python, independently of the sampler's tensors."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k > 0 else order
    z = [math.exp(scaled[i] - scaled[kept[0]]) for i in kept]
    probs = [v / sum(z) for v in z]
    mass, nucleus = 0.0, []
    for i, p in zip(kept, probs):
        if mass < top_p or not nucleus:
            nucleus.append(i)
        mass += p
    z = [math.exp(scaled[i] - scaled[nucleus[0]]) for i in nucleus]
    return sorted(i for i, v in zip(nucleus, z) if v / sum(z) >= min_p * z[0] / sum(z))


@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_k=5, top_p=0.5),
                                      dict(temperature=1.0, top_k=6),
                                      dict(temperature=1.3, top_p=0.2),
                                      dict(temperature=0.7, top_k=8, min_p=0.5)])
def test_sampling_question_matches_an_independent_filter(engine, settings) -> None:
    from widgets.live_questions import sampling_question

    logits = engine.next_token_logits([1, 2, 3, 4]) * 20  # a peakier row than the random model's
    question = sampling_question(logits, **settings)
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | settings
    expected = _survivors(logits.tolist(), **full)
    assert _answer(question) == "{" + ", ".join(map(str, expected)) + "}"
    labels = [f"t{i}" for i in range(logits.numel())]
    named = sampling_question(logits, labels=labels, **settings)
    assert _answer(named) == "{" + ", ".join(repr(labels[i]) for i in expected) + "}"
    with pytest.raises(ValueError, match="survive"):
        sampling_question(logits, temperature=1.0, max_kept=1, top_k=3)


def test_prefix_question_offers_the_unchained_lookup_as_a_mistake(engine) -> None:
    from nanoengine import SamplingParams
    from widgets.live_questions import prefix_hit_question

    shared = list(range(100, 114))
    engine.add_request(shared, SamplingParams(max_tokens=1, temperature=0), request_id="first")
    while engine.has_unfinished_requests():
        engine.step()
    # blocks 2 and 3 of the cached prompt, after a different first block: none is served
    question = prefix_hit_question(engine.snapshot(), [1, 1, 1, 1] + shared[4:12] + [5])
    texts = {o.text: o for o in question.options}
    assert texts["0 blocks (0 tokens skipped)"].correct
    assert not texts["2 blocks (8 tokens skipped)"].correct  # equal tokens, different prefix


def test_allreduce_bytes_question_counts_the_row_parallel_layers() -> None:
    """Chapter 9's live question: two all-reduces per layer of (tokens, hidden) partial sums."""
    from nanoengine.loader.weights import random_model
    from widgets.live_questions import allreduce_bytes_question

    net = random_model("tiny-llama")  # 2 layers, hidden 32
    question = allreduce_bytes_question(net, dtype_bytes=4, num_tokens=3, tp_size=2)
    assert _answer(question) == f"{2 * 2 * 3 * 32 * 4:,}"
    assert len(question.options) >= 4 and len({o.text for o in question.options}) == len(question.options)
    with pytest.raises(ValueError):
        allreduce_bytes_question(net, dtype_bytes=4, num_tokens=1, tp_size=1)


def test_sampling_question_filters_a_real_vocabulary_a_bounded_number_of_times(monkeypatch) -> None:
    """On a full-size row (49,152 logits, SmolLM2's vocabulary) with top-p set, the question
    calls the engine's filter a few times, not once per vocabulary token."""
    import torch

    import widgets.live_questions as live_questions

    calls = []
    real = live_questions.kept_mask

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(live_questions, "kept_mask", spy)
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(0)) * 3
    question = live_questions.sampling_question(logits, temperature=0.8, top_k=6, top_p=0.95)
    assert len(question.options) >= 2 and len(calls) <= 10
