"""Output processing: sampled tokens in, ``RequestOutput`` objects out (chapters 2 and 8).

After the scheduler has appended a step's tokens to its requests, this module turns them
into what the user sees. For every request that produced a token it

* records the token's logprobs (when asked for),
* detokenizes incrementally (``IncrementalDetokenizer``: no half characters in a stream),
  and only what somebody reads: a ``FINAL_ONLY`` request (``LLM.generate``) gets its text
  once, when it finishes,
* hands out what the request's ``RequestOutputKind`` asks for: everything so far every step
  (``CUMULATIVE``), only what is new every step (``DELTA``, what a stream appends), or
  the final output alone (``FINAL_ONLY``),
* ends the request when a stop *string* appears in its text (stop token ids and lengths
  are the scheduler's business, since they need no text),
* and builds one ``RequestOutput`` per user request, gathering its ``n`` completions.

A user request (the id ``add_request`` returned) is a ``RequestState`` here: its prompt,
its completion requests in index order, and one detokenizer per completion. The state
lives until every completion has finished; then the final output is built and the
state forgotten, so nothing per request outlives it.
"""

from __future__ import annotations

from nanoengine.engine.detokenizer import IncrementalDetokenizer, token_decoder
from nanoengine.engine.profiler import NO_PROFILER, StepProfiler
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.engine.scheduler import Scheduler
from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from nanoengine.sampling_params import RequestOutputKind


class RequestState:
    """One user request: its prompt and its completions (n of them) with their detokenizers."""

    def __init__(self, request_id: str, prompt: str | None, completions: list[Request], tokenizer,
                 stop: tuple[str, ...]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.completions = completions  # index order; completion i has index i
        self.stop = stop
        self.detokenizers = [IncrementalDetokenizer(tokenizer, stop) for _ in completions]
        self.pending_deltas = [""] * len(completions)  # text not yet handed out
        self.kind = completions[0].sampling_params.output_kind
        # CUMULATIVE and DELTA: an output (and so text) every step; FINAL_ONLY: only the final one.
        self.reads_every_step = self.kind != RequestOutputKind.FINAL_ONLY
        self.tokens_handed_out = [0] * len(completions)  # DELTA: tokens already in an output
        self.prompt_token_ids = tuple(completions[0].prompt_token_ids)  # the same in every output

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.completions)


class OutputProcessor:
    """Builds ``RequestOutput`` objects and applies stop strings."""

    def __init__(self, tokenizer, scheduler: Scheduler, profiler: StepProfiler = NO_PROFILER) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = None if tokenizer is None else token_decoder(tokenizer)
        self.scheduler = scheduler
        self.states: dict[str, RequestState] = {}  # unfinished user requests by id
        self.profiler = profiler  # detokenizing is the step's "detokenize" phase

    def add_request(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def process(self, produced: list[Request], logprobs: dict[str, tuple]) -> list[RequestOutput]:
        """Outputs of the user requests whose completions produced a token this step.

        A ``FINAL_ONLY`` request is reported once it has finished, and its text is made
        then, from all its tokens at once, unless it has stop strings to look for.
        """
        touched: dict[str, RequestState] = {}
        for request in produced:
            state = self.states[request.parent_id]
            if request.request_id in logprobs:
                request.output_logprobs.append(logprobs[request.request_id])
            if state.reads_every_step or state.stop:
                detokenizer = state.detokenizers[request.index]
                state.pending_deltas[request.index] += self._detokenize(request, detokenizer)
                if detokenizer.stop_hit is not None and not request.is_finished:
                    request.stop_reason = detokenizer.stop_hit
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            if state.reads_every_step or state.finished:
                touched[state.request_id] = state
        return [self.make_output(state) for state in touched.values()]

    def make_output(self, state: RequestState) -> RequestOutput:
        """The request's output now (its final one if every completion has finished)."""
        for request, detokenizer in zip(state.completions, state.detokenizers):
            if request.is_finished and not detokenizer.flushed:  # all its text, held-back tail included
                state.pending_deltas[request.index] += self._detokenize(request, detokenizer)
        completions = tuple(self._completion(state, i) for i in range(len(state.completions)))
        state.pending_deltas = [""] * len(state.completions)
        finished = state.finished
        if finished:
            del self.states[state.request_id]
        first = state.completions[0]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics=_metrics(state.completions))

    def _detokenize(self, request: Request, detokenizer: IncrementalDetokenizer) -> str:
        """Feed the detokenizer the tokens it has not seen yet; the text delta."""
        with self.profiler.phase("detokenize"):
            return detokenizer.update(request.output_token_ids[detokenizer.num_tokens:], request.is_finished)

    def _completion(self, state: RequestState, index: int) -> CompletionOutput:
        """Completion ``index`` as its output kind shows it: all of it, or what is new (DELTA)."""
        request = state.completions[index]
        delta = state.pending_deltas[index]
        start, text = 0, state.detokenizers[index].text
        if state.kind == RequestOutputKind.DELTA:
            start, text = state.tokens_handed_out[index], delta
            state.tokens_handed_out[index] = len(request.output_token_ids)
        logprobs = cumulative = None
        if request.sampling_params.logprobs is not None:
            logprobs = tuple(self._token_logprobs(token, entry) for token, entry in
                             zip(request.output_token_ids[start:], request.output_logprobs[start:]))
            cumulative = sum(sampled_lp for sampled_lp, _ in request.output_logprobs)
        return CompletionOutput(index=index, text=text, token_ids=tuple(request.output_token_ids[start:]),
                                finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                                logprobs=logprobs, cumulative_logprob=cumulative, delta=delta)

    def _token_logprobs(self, token_id: int, entry) -> tuple[TokenLogprob, ...]:
        sampled_lp, top = entry
        pairs = [(token_id, sampled_lp)] + [p for p in top if p[0] != token_id]
        return tuple(TokenLogprob(t, lp, self.decode([t])) for t, lp in pairs)

    def decode(self, token_ids: list[int]) -> str:
        if self._decode_ids is None:
            return ""
        return self._decode_ids(token_ids, False)


def _metrics(completions: list[Request]) -> RequestMetrics:
    """One request's timings; with several completions, taken over all of them."""
    if len(completions) == 1:  # the usual case, built every step of a stream: read straight off
        c = completions[0]
        return RequestMetrics(
            arrival_time=c.arrival_time, first_scheduled_time=c.first_scheduled_time,
            first_token_time=c.first_token_time, finished_time=c.finished_time if c.is_finished else None,
            num_output_tokens=c.num_output_tokens, token_times=tuple(c.output_token_times))
    scheduled = [c.first_scheduled_time for c in completions if c.first_scheduled_time is not None]
    first_tokens = [c.first_token_time for c in completions if c.first_token_time is not None]
    finished = all(c.is_finished for c in completions)
    return RequestMetrics(
        arrival_time=completions[0].arrival_time,
        first_scheduled_time=min(scheduled, default=None),
        first_token_time=min(first_tokens, default=None),
        finished_time=max(c.finished_time for c in completions) if finished else None,
        num_output_tokens=sum(c.num_output_tokens for c in completions),
        token_times=tuple(sorted(t for c in completions for t in c.output_token_times)))
