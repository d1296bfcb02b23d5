"""Output processing: sampled tokens in, ``RequestOutput`` objects out (chapters 2 and 8).

After the scheduler has appended a step's tokens, ``detokenize`` records their logprobs and
makes text incrementally (``IncrementalDetokenizer``), only what somebody reads: a
``FINAL_ONLY`` request (``LLM.generate``) gets its text once, when it finishes. It reports
the stop *strings* it finds but ends no request (``check_stop`` in the scheduler decides).
Then ``make_outputs`` builds one ``RequestOutput`` per user request, gathering its ``n``
completions, holding what its ``RequestOutputKind`` asks for.

A user request (the id ``add_request`` returned) is a ``RequestState`` here, kept until every
completion has finished: then its final output is built and the state forgotten. Its
completions are also indexed by their own ids, which ``LLMEngine.requests`` shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from nanoengine.engine.detokenizer import IncrementalDetokenizer, token_decoder
from nanoengine.engine.parallel_sampling import gather_metrics
from nanoengine.engine.profiler import NO_PROFILER, StepProfiler
from nanoengine.engine.request import Request, RequestStatus
from nanoengine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from nanoengine.sampling_params import RequestOutputKind

logger = logging.getLogger("nanoengine.engine")


class RequestState:
    """One user request: its prompt and its completions (n of them) with their detokenizers."""

    def __init__(self, request_id: str, prompt: str | None, completions: list[Request], tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.completions = completions  # index order; completion i has index i
        self.stop = completions[0].sampling_params.stop  # the same for every completion
        self.detokenizers = [IncrementalDetokenizer(tokenizer, self.stop) for _ in completions]
        self.pending_deltas = [""] * len(completions)  # text not yet handed out
        self.kind = completions[0].sampling_params.output_kind
        # CUMULATIVE and DELTA: an output (and so text) every step; FINAL_ONLY: only the final one.
        self.reads_every_step = self.kind != RequestOutputKind.FINAL_ONLY
        self.tokens_handed_out = [0] * len(completions)  # DELTA: tokens already in an output
        self.prompt_token_ids = tuple(completions[0].prompt_token_ids)  # the same in every output

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.completions)


class LiveRequests(Mapping[str, Request]):
    """The unfinished completion requests by id: a read-only view, live, not a copy (``in`` and ``[]``
    cost one dict lookup). Take ``dict(view)`` for a snapshot, or ``list(view)`` before aborting while
    iterating, because the view follows the engine as it changes."""

    def __init__(self, completions_by_id: dict[str, Request]) -> None:
        self._completions_by_id = completions_by_id

    def __getitem__(self, request_id: str) -> Request:
        request = self._completions_by_id[request_id]
        if request.is_finished:  # finished, but a sibling completion is still running
            raise KeyError(request_id)
        return request

    def __iter__(self) -> Iterator[str]:
        return (rid for rid, request in self._completions_by_id.items() if not request.is_finished)

    def __len__(self) -> int:
        return sum(1 for request in self._completions_by_id.values() if not request.is_finished)

    def __repr__(self) -> str:
        return f"LiveRequests({sorted(self)!r})"


class OutputProcessor:
    """Detokenizes, finds stop strings and builds ``RequestOutput`` objects."""

    def __init__(self, tokenizer, profiler: StepProfiler = NO_PROFILER) -> None:
        self._decode_ids = None if tokenizer is None else token_decoder(tokenizer)
        self.states: dict[str, RequestState] = {}  # unfinished user requests by id
        # their completions by completion id (a finished one stays until its whole request ends)
        self.completions_by_id: dict[str, Request] = {}
        self.profiler = profiler  # detokenizing is the step's "detokenize" phase

    def add_request(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        self.completions_by_id.update((c.request_id, c) for c in state.completions)

    def id_in_use(self, request_id: str) -> bool:
        """Whether an unfinished user request or one of its completions has this id (free again
        once the request's final output is made)."""
        return request_id in self.states or request_id in self.completions_by_id

    def detokenize(self, produced: list[Request], logprobs: dict[str, tuple],
                   faults: dict[str, Exception]) -> dict[str, str]:
        """Take in this step's tokens (their logprobs; text where it is read every step or searched for
        stop strings); returns the stop string found, by request id. A request whose text cannot be made
        goes to ``faults`` and the others go on (``LLMEngine`` finishes it with the error)."""
        stop_strings: dict[str, str] = {}
        for request in produced:
            state = self.states[request.parent_id]
            if request.request_id in logprobs:
                request.output_logprobs.append(logprobs[request.request_id])
            if state.reads_every_step or state.stop:
                detokenizer = state.detokenizers[request.index]
                try:
                    state.pending_deltas[request.index] += self._detokenize(request, detokenizer)
                except Exception as exc:
                    faults[request.request_id] = exc
                    continue
                if detokenizer.stop_hit is not None:
                    stop_strings[request.request_id] = detokenizer.stop_hit
        return stop_strings

    def make_outputs(self, produced: list[Request], faults: dict[str, Exception]) -> list[RequestOutput]:
        """Outputs of the user requests whose completions produced a token this step, once the stop
        decision is made (a ``FINAL_ONLY`` request's only once all of it has finished), but none of a
        completion in ``faults``. A request whose output cannot be made goes to ``faults`` (by its first
        completion's id)."""
        touched: dict[str, RequestState] = {}
        for request in produced:
            if request.request_id in faults:
                continue
            state = self.states[request.parent_id]
            if state.reads_every_step or state.finished:
                touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            try:
                outputs.append(self.make_output(state))
            except Exception as exc:
                faults[state.completions[0].request_id] = exc
        return outputs

    def failed(self, faults: dict[str, Exception], step: int) -> list[tuple[RequestState, str]]:
        """Each unfinished user request a completion of which is in ``faults``, with the error to end it with,
        logged. Inputs were checked before queueing: a fault is an engine bug that one request's data
        reached. A completion that had finished but whose output could not be made is relabelled "error"."""
        failed: dict[str, tuple[RequestState, str]] = {}
        for completion_id, exc in faults.items():
            request = self.completions_by_id.get(completion_id)
            state = None if request is None else self.states.get(request.parent_id)
            if state is None or state.request_id in failed:  # already ended, or two of its completions raised
                continue
            logger.error("step %d: request %s failed and is finished with an error; the engine goes on",
                         step, state.request_id, exc_info=exc)
            error = f"{type(exc).__name__}: {exc}"
            if request.is_finished:
                request.status, request.error = RequestStatus.FINISHED_ERROR, error
            failed[state.request_id] = (state, error)
        return list(failed.values())

    def make_output(self, state: RequestState) -> RequestOutput:
        """The request's output now (its final one if every completion has finished).

        A completion that ended in an error (``Request.error``) keeps the text it had: no
        more is made for it, since making text may be what failed."""
        for request, detokenizer in zip(state.completions, state.detokenizers):
            if request.is_finished and not detokenizer.flushed and request.error is None:  # all its text, tail too
                state.pending_deltas[request.index] += self._detokenize(request, detokenizer)
        completions = tuple(self._completion(state, i) for i in range(len(state.completions)))
        state.pending_deltas = [""] * len(state.completions)
        finished = state.finished
        if finished:
            del self.states[state.request_id]
            for request in state.completions:
                del self.completions_by_id[request.request_id]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=state.completions[0].num_cached_tokens,
            metrics=gather_metrics(state.completions))

    def _detokenize(self, request: Request, detokenizer: IncrementalDetokenizer) -> str:
        """Feed the detokenizer the tokens it has not seen yet; the text delta. A new last token among
        ``stop_token_ids`` will end the request (``check_stop``, run after this), so its text is left out."""
        new_token_ids = request.output_token_ids[detokenizer.num_tokens:]
        ends_on_stop_token = bool(new_token_ids) and new_token_ids[-1] in request.sampling_params.stop_token_ids
        with self.profiler.phase("detokenize"):
            return detokenizer.update(new_token_ids, request.is_finished, ends_on_stop_token)

    def _completion(self, state: RequestState, index: int) -> CompletionOutput:
        """Completion ``index`` as its output kind shows it: all of it, or what is new (DELTA)."""
        request = state.completions[index]
        delta = state.pending_deltas[index]
        start, text = 0, state.detokenizers[index].text
        if state.kind == RequestOutputKind.DELTA:
            start, text = state.tokens_handed_out[index], delta
            state.tokens_handed_out[index] = len(request.output_token_ids)
        logprobs = cumulative = None
        if request.sampling_params.logprobs is not None and request.error is None:
            logprobs = tuple(self._token_logprobs(token, entry) for token, entry in
                             zip(request.output_token_ids[start:], request.output_logprobs[start:]))
            cumulative = sum(sampled_lp for sampled_lp, _ in request.output_logprobs)
        return CompletionOutput(index=index, text=text, token_ids=tuple(request.output_token_ids[start:]),
                                finish_reason=request.status.finish_reason, stop_reason=request.stop_reason,
                                logprobs=logprobs, cumulative_logprob=cumulative, delta=delta, error=request.error)

    def _token_logprobs(self, token_id: int, entry) -> tuple[TokenLogprob, ...]:
        sampled_lp, top = entry
        pairs = [(token_id, sampled_lp)] + [p for p in top if p[0] != token_id]
        return tuple(TokenLogprob(t, lp, self.decode([t])) for t, lp in pairs)

    def decode(self, token_ids: list[int]) -> str:
        return "" if self._decode_ids is None else self._decode_ids(token_ids, False)
