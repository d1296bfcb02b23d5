"""Exercise checks of chapter 11 (Benchmarks): warm-up and repeats, the batch size, what counts.

Each check runs the experiment with the value the learner chose, through the engine's
public API, and judges what it observed, never the learner's code. The machine is shared
and noisy, so no check compares a timing with a threshold: they judge structural facts
(which runs a median is taken over, how many engine steps a workload takes, how many
tokens each request produced), and report the timings only as information.

* ``check_measurement`` (11.1): ``measure``'s ``warmup`` and ``repeats`` for a workload on a
  freshly built engine, so that the cold first call is not among the timed runs and the
  median has quartiles worth quoting;
* ``check_max_num_seqs`` (11.2): the smallest ``max_num_seqs`` that serves the chapter's
  workload in the fewest engine steps (tiny random engine: mechanics only);
* ``check_counted_tokens`` (11.3): the ``ignore_eos`` setting under which every system
  produces exactly the tokens it was asked for, so tok/s counts the same tokens everywhere
  (the real default model, greedy).
"""

from __future__ import annotations

from nanoengine import SamplingParams
from nanoengine.events import StepFinished
from nanoengine.measure.benchmark import make_output_lens, make_workload
from nanoengine.measure.timing import MIN_REPEATS, measure
from widgets._common import single_thread, tiny_engine
from widgets.exercises import CheckResult, todo, verdict

NUM_REQUESTS = 8  # the chapter's workload: 8 requests, prompts 16-32 ids, 4-12 output tokens
MIN_PROMPT, MAX_PROMPT = 16, 32
MIN_OUTPUT, MAX_OUTPUT = 4, 12
SEED = 0
MAX_REPEATS = 15  # exercise 11.1: more repeats than this only cost time in a chapter
COUNT_QUESTIONS = ["What is 2+2?", "Name one colour.", "What is the capital of France?"]  # short answers
COUNT_MAX_TOKENS = 24  # exercise 11.3


def chapter_workload(vocab_limit: int = 10000) -> tuple[list[list[int]], list[int]]:
    """The chapter's requests (random token-id prompts) and their output lengths, seeded."""
    prompts = make_workload(NUM_REQUESTS, MIN_PROMPT, MAX_PROMPT, SEED, vocab_limit=vocab_limit)
    return prompts, make_output_lens(NUM_REQUESTS, MIN_OUTPUT, MAX_OUTPUT, SEED)


def _is_count(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def steps_to_serve(max_num_seqs: int) -> int:
    """Engine steps a tiny random engine (mechanics only) takes to serve the chapter's
    workload, all requests queued at the start, with at most ``max_num_seqs`` per step."""
    prompts, lens = chapter_workload(vocab_limit=256)
    engine = tiny_engine(num_kv_blocks=256, block_size=4, max_model_len=64, max_num_seqs=max_num_seqs)
    steps = []
    engine.events.subscribe(lambda e: steps.append(e) if isinstance(e, StepFinished) else None)
    with single_thread():
        for p, n in zip(prompts, lens):
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    return len(steps)


def check_measurement(warmup, repeats) -> CheckResult:
    """11.1: time a workload on a freshly built tiny engine with ``measure(warmup, repeats)``.

    Right when the cold first call is not timed (``warmup >= 1``) and there are enough
    timed runs for a median and quartiles (``MIN_REPEATS`` to ``MAX_REPEATS``). The check
    times the cold call apart and reports it next to the median, as information."""
    name = "11.1"
    if todo(warmup) or todo(repeats):
        return verdict(name, False, "", "set both warmup and repeats (whole numbers).")
    if not _is_count(warmup, 0) or not _is_count(repeats, 1) or warmup > MAX_REPEATS:
        return verdict(name, False, "", f"warmup is a whole number >= 0 (at most {MAX_REPEATS}) and repeats a "
                        "whole number of timed runs.")
    if not MIN_REPEATS <= repeats <= MAX_REPEATS:
        return verdict(name, False, "", f"a median and quartiles need at least {MIN_REPEATS} timed runs; more than "
                        f"{MAX_REPEATS} only costs time here.")
    prompts, lens = chapter_workload(vocab_limit=256)
    engine = tiny_engine(num_kv_blocks=256, block_size=4, max_model_len=64)
    calls = []

    def workload() -> None:
        import time

        start = time.perf_counter()
        engine.reset_prefix_cache()
        for p, n in zip(prompts, lens):
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        calls.append(time.perf_counter() - start)

    with single_thread():
        timing = measure(workload, warmup=warmup, repeats=repeats, label="tiny engine, chapter workload")
    cold_timed = warmup == 0
    right = not cold_timed and len(timing.runs) == repeats
    return verdict(
        name, right,
        f"the cold first call ({1e3 * calls[0]:.1f} ms) ran untimed; the median of the {repeats} timed runs is "
        f"{1e3 * timing.median:.1f} ms (IQR {1e3 * timing.quartiles[0]:.1f} ms to {1e3 * timing.quartiles[1]:.1f} ms).",
        "with warmup=0 the first timed run is the cold one (first allocations, first kernels), and the median "
        "would mix it in: warm up at least once.")


def check_max_num_seqs(max_num_seqs) -> CheckResult:
    """11.2: the smallest ``max_num_seqs`` that serves the chapter's workload in the fewest steps."""
    name = "11.2"
    if todo(max_num_seqs):
        return verdict(name, False, "", "set max_num_seqs to a whole number of sequences.")
    if not _is_count(max_num_seqs, 1) or max_num_seqs > 256:
        return verdict(name, False, "", "max_num_seqs is a whole number of sequences per step, 1 to 256.")
    fewest = steps_to_serve(NUM_REQUESTS)  # every request in every step: nothing waits
    steps = steps_to_serve(max_num_seqs)
    if steps > fewest:
        return verdict(name, False, "", f"with {max_num_seqs} sequences per step the workload takes {steps} steps, "
                        f"not the fewest ({fewest}): some requests wait for a slot. Allow more.")
    if max_num_seqs > 1 and steps_to_serve(max_num_seqs - 1) == steps:
        return verdict(name, False, "", f"{max_num_seqs} reaches the fewest steps ({steps}), but so does "
                        f"{max_num_seqs - 1}: look for the smallest. Requests that start late still finish "
                        "in time if they are short.")
    return verdict(name, True, f"{max_num_seqs} sequences per step serve the workload in {steps} steps, the fewest; "
                    f"{max_num_seqs - 1} would need {steps_to_serve(max_num_seqs - 1) if max_num_seqs > 1 else '-'}. "
                    "Beyond it, more slots cannot help: nothing is waiting for one.", "")


def check_counted_tokens(llm, ignore_eos) -> CheckResult:
    """11.3: greedy chat requests with ``max_tokens=COUNT_MAX_TOKENS`` and the chosen
    ``ignore_eos``: right when every request produced exactly ``COUNT_MAX_TOKENS`` tokens,
    so a benchmark's token count is the same for every system and every run."""
    name = "11.3"
    if todo(ignore_eos) or not isinstance(ignore_eos, bool):
        return verdict(name, False, "", "ignore_eos is True or False.")
    params = SamplingParams(temperature=0.0, max_tokens=COUNT_MAX_TOKENS, ignore_eos=ignore_eos)
    outs = llm.generate([llm.apply_chat_template([{"role": "user", "content": q}]) for q in COUNT_QUESTIONS],
                        params, use_tqdm=False)
    counts = [len(o.token_ids) for o in outs]
    right = all(c == COUNT_MAX_TOKENS for c in counts)
    return verdict(
        name, right,
        f"every request produced {COUNT_MAX_TOKENS} tokens ({counts}): the count no longer depends on when the "
        "model chooses to stop, so tok/s means the same tokens for every system.",
        f"the requests produced {counts} tokens for {COUNT_MAX_TOKENS} asked: the model stopped at its end-of-text "
        "token, and another system (or dtype) may stop elsewhere.")
