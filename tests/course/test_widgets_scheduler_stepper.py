"""Tests for widgets.scheduler_stepper: a live engine one step at a time.

Driven through the view's controls on a tiny random model: the queues, the batch and the
timeline shown must match what the engine did (its snapshot and its events).
"""

from __future__ import annotations

import asyncio
import html
import re

import pytest

from nanoengine import SamplingParams
from nanoengine.events import RequestPreempted, RequestScheduled, StepFinished
from widgets import single_thread, tiny_engine
from widgets.scheduler_stepper import SchedulerStepper, SchedulerStepperController


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():  # tiny matmuls: thread wake-ups cost more than the work
        yield


def make_view(**engine_kwargs) -> SchedulerStepper:
    options = dict(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=32)
    options.update(engine_kwargs)
    return SchedulerStepper(tiny_engine(**options))


def queue_ids(view: SchedulerStepper, name: str) -> list[str]:
    section = next(part for part in view.queues.value.split('class="ne-queue ') if part.startswith(f"ne-queue-{name}"))
    return re.findall(r'data-request="([^"]+)"', section)


def add(view: SchedulerStepper, random_tokens: int, max_tokens: int, count: int = 1, **params) -> None:
    view.random_tokens.value, view.max_tokens.value, view.count.value = random_tokens, max_tokens, count
    for name, value in params.items():
        getattr(view, name).value = value
    view.add_button.click()


def test_step_moves_requests_from_waiting_to_running_with_chunked_prefill() -> None:
    view = make_view()
    engine = view.controller.engine
    engine.events.keep_history()  # to compare the view with every event afterwards
    add(view, 40, 4)  # longer than the 32-token budget: two prefill chunks
    add(view, 6, 4)
    assert "queued" in view.message.value
    assert queue_ids(view, "waiting") == ["0", "1"] and queue_ids(view, "running") == []

    view.step_button.click()
    assert queue_ids(view, "running") == ["0"] and queue_ids(view, "waiting") == ["1"]
    record = view.controller.steps[-1]
    assert [(c.request_id, c.num_tokens, c.is_prefill) for c in record.chunks] == [("0", 32, True)]
    assert "32 prefill + 0 decode = 32 of a 32-token budget" in view.batch.value
    assert "32/44 tokens · 8 blocks" in view.queues.value and "0/10 tokens · 0 blocks" in view.queues.value

    view.step_button.click()  # the rest of the first prompt, then the second prompt
    record = view.controller.steps[-1]
    assert [(c.request_id, c.num_tokens, c.start) for c in record.chunks] == [("0", 8, 32), ("1", 6, 0)]
    assert queue_ids(view, "running") == ["0", "1"]

    view.step_button.click()  # both decode now
    record = view.controller.steps[-1]
    assert record.num_decode_tokens == 2 and record.num_prefill_tokens == 0
    assert "0 prefill + 2 decode" in view.batch.value
    # what the view recorded is what the engine reported
    finished = [e for e in engine.events.history if isinstance(e, StepFinished)]
    scheduled = [e for e in engine.events.history if isinstance(e, RequestScheduled)]
    assert [s.num_tokens for s in view.controller.steps] == [f.num_prefill_tokens + f.num_decode_tokens
                                                             for f in finished]
    assert sum(len(s.chunks) for s in view.controller.steps) == len(scheduled)
    assert f'data-steps="3"' in view.timeline.value
    engine.check_invariants()


def test_run_n_finishes_requests_and_lists_them() -> None:
    view = make_view()
    add(view, 8, 3, count=3)
    view.run_count.value = 50
    view.run_button.click()
    assert re.search(r"ran \d+ steps", view.message.value)
    assert not view.controller.engine.has_unfinished_requests()
    assert sorted(queue_ids(view, "finished")) == ["0", "1", "2"]
    assert "length: 8 + 3 tokens" in view.queues.value
    assert all(f.finish_reason == "length" and f.num_output_tokens == 3 for f in view.controller.finished)
    in_steps = sorted(rid for s in view.controller.steps for rid, _ in s.finished)
    assert in_steps == ["0", "1", "2"]
    view.step_button.click()
    assert "nothing to step" in view.message.value


def test_preemption_is_highlighted() -> None:
    # 16 blocks of 4 tokens: three requests growing to 52 tokens (13 blocks each) cannot all fit
    view = make_view(num_kv_blocks=16, max_num_batched_tokens=64)
    engine = view.controller.engine
    engine.events.keep_history()
    add(view, 12, 40, count=3)
    preempted_step = None
    for _ in range(40):
        view.step_button.click()
        if view.controller.steps and view.controller.steps[-1].preempted:
            preempted_step = view.controller.steps[-1]
            break
    assert preempted_step is not None
    victim = preempted_step.preempted[0]
    assert victim == "2"  # the newest running request goes first
    assert any(isinstance(e, RequestPreempted) and e.request_id == victim for e in engine.events.history)
    assert "PREEMPTED" in view.queues.value and victim in queue_ids(view, "waiting")
    assert "preempted: 2" in view.batch.value and "▲" in view.timeline.value
    assert "PREEMPTED 2" in view.event_log.value
    assert "preemptions so far <b>1</b>" in view.status.value
    engine.check_invariants()
    view.run_count.value = 500
    view.run_button.click()
    assert not engine.has_unfinished_requests() and len(view.controller.finished) == 3


def test_sampling_parameters_from_the_form_reach_the_engine() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 5, 7, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=123)
    request = engine.requests["0"]
    assert request.sampling_params == SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                                                     max_tokens=7, seed=123, ignore_eos=True)


def test_play_steps_on_each_tick_and_stops_when_idle() -> None:
    view = make_view()
    add(view, 4, 2)
    view.play.playing = True
    for _ in range(5):
        view.play.value += 1  # what the browser's timer does
    assert not view.controller.engine.has_unfinished_requests()
    assert view.play.playing is False and "idle" in view.message.value
    steps = len(view.controller.steps)
    view.play.value += 1  # paused: a tick does nothing
    assert len(view.controller.steps) == steps


def test_abort_and_reset() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 6, 10, count=3)
    view.step_button.click()
    view.abort_picker.value = "1"
    view.abort_button.click()
    assert "aborted 1" in view.message.value and "1" not in engine.requests
    assert "abort" in view.queues.value
    view.step_button.click()
    assert all(rid != "1" for s in view.controller.steps for rid, _ in s.finished)  # an abort is not a step's
    view.reset_button.click()
    snap = engine.snapshot()
    assert not snap.running and not snap.waiting
    assert view.controller.steps == [] and view.controller.finished == []
    assert "no step yet" in view.batch.value
    engine.check_invariants()


def test_reset_with_a_factory_builds_a_fresh_engine() -> None:
    built = []

    def factory():
        built.append(tiny_engine(num_kv_blocks=32, block_size=4, max_model_len=32))
        return built[-1]

    controller = SchedulerStepperController(engine_factory=factory)
    controller.add_requests(5, SamplingParams(max_tokens=2, ignore_eos=True))
    controller.step()
    controller.reset()
    assert len(built) == 2 and controller.engine is built[1]
    assert not controller.engine.has_unfinished_requests() and controller.steps == []
    controller.add_requests(5, SamplingParams(max_tokens=2, ignore_eos=True))
    assert controller.step() is not None


def test_bad_input_shows_a_message_and_leaves_the_engine_unchanged() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 6, 4)
    view.step_button.click()
    before, requests_before = engine.snapshot(), dict(engine.requests)
    cases = [
        (dict(random_tokens=6, max_tokens=4, temperature=-1.0), "temperature must be non-negative"),
        (dict(random_tokens=6, max_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
        (dict(random_tokens=6, max_tokens=4, top_k=-5), "top_k must be"),
        (dict(random_tokens=6, max_tokens=4, min_p=1.5), "min_p must be in [0, 1]"),
        (dict(random_tokens=6, max_tokens=0), "max_tokens must be at least 1"),
        (dict(random_tokens=70, max_tokens=1), "max_model_len is 64"),
        (dict(random_tokens=50, max_tokens=20), "exceeds max_model_len"),
        (dict(random_tokens=0, max_tokens=4), "no tokenizer"),
        (dict(random_tokens=6, max_tokens=4, count=0), "count must be"),
    ]
    for values, expected in cases:
        view.temperature.value, view.top_p.value, view.top_k.value, view.min_p.value = 0.0, 1.0, -1, 0.0
        view.count.value = 1
        for name, value in values.items():
            getattr(view, name).value = value
        view.add_button.click()
        assert "ne-msg-error" in view.message.value and expected in html.unescape(view.message.value), values
        assert engine.snapshot() == before and dict(engine.requests) == requests_before
    view.run_count.value = 0
    view.run_button.click()
    assert "steps must be between" in view.message.value
    assert engine.snapshot() == before


def test_a_step_of_sixty_four_requests_on_a_thousand_blocks_redraws() -> None:
    engine = tiny_engine(num_kv_blocks=1000, block_size=16, max_model_len=256, max_num_seqs=64,
                         max_num_batched_tokens=16384)
    view = SchedulerStepper(engine)
    add(view, 150, 16, count=64)
    view.step_button.click()
    assert len(queue_ids(view, "running")) == 64
    assert view.controller.steps[-1].num_prefill_tokens == 64 * 150


# ----------------------------------------------------------------------------------------
# One engine, two simulators: the stepper shows what the engine did, whoever stepped it
# ----------------------------------------------------------------------------------------


def _stepper_and_playground():
    from widgets.sampling_playground import SamplingPlayground

    engine = tiny_engine(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=32)
    stepper = SchedulerStepper(engine, shared_with="sampling playground")
    playground = SamplingPlayground(engine, prompt=list(range(100, 108)), shared_with="scheduler stepper")
    add(stepper, 6, 4, count=3)
    playground.gen_tokens.value, playground.gen_seed.value = 12, 0
    return engine, stepper, playground


def _assert_stepper_shows_everything_finished(engine, stepper) -> None:
    snap = engine.snapshot()
    assert not snap.running and not snap.waiting
    assert queue_ids(stepper, "waiting") == [] and queue_ids(stepper, "running") == []
    assert sorted(queue_ids(stepper, "finished")) == ["0", "1", "2", "3"]  # "3" is the playground's
    assert f"engine step <b>{snap.step}</b>" in stepper.status.value
    assert "every request has finished" in stepper.status.value
    # no button contradicts the display: there is nothing to step, and Step says so by being off
    assert stepper.step_button.disabled and stepper.run_button.disabled and stepper.abort_button.disabled
    assert "ran outside this stepper" in stepper.message.value
    assert "run elsewhere" in stepper.batch.value
    assert all(s.elsewhere for s in stepper.controller.steps)


def test_generate_on_a_shared_engine_redraws_the_stepper() -> None:
    """The issue's case: Generate ran the stepper's queued requests; the stepper kept showing
    'waiting (3)' at engine step 0 while Step said nothing was left."""
    engine, stepper, playground = _stepper_and_playground()
    assert queue_ids(stepper, "waiting") == ["0", "1", "2"] and not stepper.step_button.disabled
    assert "shared with the sampling playground" in stepper.shared_note.value
    assert "shared with the scheduler stepper" in playground.shared_note.value

    playground.gen_button.click()
    assert "finish reason: length" in playground.generation.value
    assert "advanced 3 other request(s)" in playground.message.value
    assert "3 of which finished" in playground.message.value
    _assert_stepper_shows_everything_finished(engine, stepper)

    add(stepper, 5, 2)  # a new request brings Step back
    assert not stepper.step_button.disabled and queue_ids(stepper, "waiting") == ["4"]
    stepper.step_button.click()
    assert not stepper.controller.steps[-1].elsewhere and "run elsewhere" not in stepper.batch.value


def test_in_a_kernel_the_redraw_comes_once_after_the_handler() -> None:
    """In a running event loop (as in a kernel) the stepper redraws once, after Generate's
    last step, when the engine's snapshot is complete, not once per step mid-step."""
    engine, stepper, playground = _stepper_and_playground()

    async def click_generate_then_yield() -> tuple[int, str]:
        redraws = stepper.watcher.num_redraws
        playground.gen_button.click()
        waiting_during = queue_ids(stepper, "waiting")  # not redrawn yet: the handler is still running
        await asyncio.sleep(0)  # the kernel's loop runs the deferred redraw
        return stepper.watcher.num_redraws - redraws, waiting_during

    redraws, waiting_during = asyncio.run(click_generate_then_yield())
    assert waiting_during == ["0", "1", "2"]
    assert redraws == 1
    _assert_stepper_shows_everything_finished(engine, stepper)


def test_the_stepper_redraws_after_steps_a_notebook_cell_runs() -> None:
    view = make_view()
    engine = view.controller.engine
    add(view, 6, 3, count=2)
    engine.step()  # not through the view
    assert queue_ids(view, "running") == ["0", "1"] and queue_ids(view, "waiting") == []
    engine.abort("1")  # between steps
    assert queue_ids(view, "running") == ["0"] and "1" not in queue_ids(view, "finished")
    assert "aborted (1): 1" in view.queues.value  # an abort is listed apart from the finished requests
    view.close()
    while engine.has_unfinished_requests():
        engine.step()
    assert queue_ids(view, "running") == ["0"]  # closed: it no longer listens, so it shows the old state


def test_the_stepper_shows_static_batching_holding_a_freed_slot() -> None:
    view = make_view(scheduling_policy="static", max_num_seqs=2, max_num_batched_tokens=64)
    assert "policy <b" in view.status.value and ">static</b>" in view.status.value
    add(view, 6, 2)
    add(view, 6, 6)
    add(view, 6, 2)
    view.step_button.click()
    assert queue_ids(view, "running") == ["0", "1"] and queue_ids(view, "waiting") == ["2"]
    for _ in range(2):
        view.step_button.click()
    # Request 0 has finished, but its slot stays empty until 1 finishes too.
    assert queue_ids(view, "running") == ["1"] and queue_ids(view, "waiting") == ["2"]
    for _ in range(4):
        view.step_button.click()
    assert "2" in queue_ids(view, "running")


def test_one_block_is_singular_and_aborts_leave_the_finished_column() -> None:
    view = make_view()
    add(view, 3, 2)  # 3 prompt tokens in 4-token blocks: one block
    add(view, 6, 10, count=2)
    view.step_button.click()
    assert "3/5 tokens · 1 block " in view.queues.value and "1 blocks" not in view.queues.value
    view.abort_picker.value = "2"
    view.abort_button.click()
    view.run_button.click()  # request 0 finishes on its own; 1 too
    finished = queue_ids(view, "finished")
    assert "2" not in finished and sorted(finished) == ["0", "1"]
    assert 'class="ne-aborted" data-count="1"' in view.queues.value and "aborted (1): 2" in view.queues.value
    assert 'finished (2)' in view.queues.value
    assert [f.request_id for f in view.controller.aborted] == ["2"]
    assert not any("1 blocks" in line for line in view.controller.log)


def test_long_answers_stay_inside_the_finished_column() -> None:
    view = make_view()
    add(view, 6, 20)
    view.run_count.value = 100
    view.run_button.click()
    # every column may shrink (min-width:0) and cuts what does not fit instead of overflowing
    assert view.queues.value.count("min-width:0;overflow:hidden") == 3
    section = view.queues.value.split('ne-queue-finished')[1]
    assert "text-overflow:ellipsis" in section and "white-space:nowrap" in section
