"""The sampler: logits -> next tokens (chapter 8; the playground widget calls this code).

For each row the filters run in this order, each on what the previous one left:

1. temperature: divide the logits by T (T < 1 sharpens, T > 1 flattens; T = 0 is greedy
   and skips everything below),
2. top-k: keep the k highest logits,
3. top-p (nucleus): keep the smallest set of most likely tokens whose probability sums
   to at least p,
4. min-p: drop tokens less likely than ``min_p`` times the most likely one.

Cut tokens get a logit of -inf, then one token is drawn from the softmax. A request with a
seed draws from its own ``torch.Generator``, so what else shares the batch never changes
its samples. ``filter_logits`` and ``kept_mask`` are public so the sampling playground
shows exactly what the engine does.

The filter math runs on whole (B, V) tensors with the per-row parameters as (B, 1)
columns (``sampling_probs``), so ``torch.compile`` can fuse it when the engine runs with
``compile=True`` (``engine.compilation`` swaps the sampler's ``probs_fn``). The draw itself
stays outside: each row has its own generator. A greedy batch needs only an argmax and
never reaches the filters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoengine.sampling_params import SamplingParams


def _column(values, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.as_tensor(values, dtype=dtype, device=like.device).reshape(-1, 1)


def kept_mask(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """Which tokens survive the filters. logits (B, V) -> bool (B, V).

    Each parameter is a number or a per-row sequence. ``top_k`` <= 0 keeps all.
    """
    batch, vocab = logits.shape
    scaled = logits.float() / _column(temperature, logits).clamp(min=1e-6).expand(batch, 1)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    # top-k: everything ranked below k goes.
    k = _column(top_k, logits, torch.long).expand(batch, 1)
    k = torch.where(k <= 0, torch.full_like(k, vocab), k.clamp(max=vocab))
    ranks = torch.arange(vocab, device=logits.device).expand(batch, vocab)
    sorted_keep = ranks < k
    # top-p over what top-k kept: keep a token if the mass strictly before it is < p.
    probs = torch.softmax(sorted_logits.masked_fill(~sorted_keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # (top_p = 1 keeps everything: in float32 the mass before the tail rounds up to 1.0.)
    p = _column(top_p, logits).expand(batch, 1)
    sorted_keep &= (mass_before < p) | (p >= 1.0)
    sorted_keep[:, 0] = True  # the most likely token always survives
    # min-p relative to the most likely token, on the renormalised survivors.
    probs = torch.softmax(sorted_logits.masked_fill(~sorted_keep, float("-inf")), dim=-1)
    sorted_keep &= probs >= _column(min_p, logits).expand(batch, 1) * probs[:, :1]
    keep.scatter_(1, order, sorted_keep)
    return keep


def filter_logits(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """Temperature-scaled logits with every filtered-out token set to -inf. (B, V) -> (B, V)."""
    batch = logits.shape[0]
    scaled = logits.float() / _column(temperature, logits).clamp(min=1e-6).expand(batch, 1)
    return scaled.masked_fill(~kept_mask(logits, temperature, top_k, top_p, min_p), float("-inf"))


def sampling_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The distribution one token is drawn from: softmax of ``filter_logits``. (B, V) -> (B, V)."""
    return torch.softmax(filter_logits(logits, temperature, top_k, top_p, min_p), dim=-1)


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    # per row: (sampled token's logprob, ((token id, logprob), ...) top-N) or None
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None]


def sampling_params_columns(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """Each row's temperature, top_k, top_p and min_p as (B, 1) tensors on the logits' device.

    Tensors, not Python numbers: a compiled ``probs_fn`` would specialise on numbers and
    recompile for every new temperature. A greedy row is filtered at temperature 1 (its
    token is the argmax whatever the filters say).
    """
    temperature = _column([1.0 if p.greedy else p.temperature for p in params], logits)
    return (temperature, _column([p.top_k for p in params], logits, torch.long),
            _column([p.top_p for p in params], logits), _column([p.min_p for p in params], logits))


class Sampler:
    """Samples one token per row, honouring each row's own parameters and generator."""

    compilable = ("probs_fn",)  # see engine.compilation; the class attribute is the eager one
    probs_fn = staticmethod(sampling_probs)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 default_generator: torch.Generator | None = None) -> SampleResult:
        logits = logits.float()  # (B, V)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            probs = self.probs_fn(logits, *sampling_params_columns(logits, params))
            tokens = logits.argmax(dim=-1)
            for row, (is_greedy, generator) in enumerate(zip(greedy, generators)):
                if not is_greedy:
                    tokens[row] = torch.multinomial(probs[row], 1, generator=generator or default_generator)[0]
        token_ids = tokens.tolist()
        return SampleResult(token_ids, self._logprobs(logits, params, token_ids))

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]):
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = torch.log_softmax(logits, dim=-1)  # the model's own distribution
        result = []
        for row, n in enumerate(wanted):
            if n is None:
                result.append(None)
                continue
            top = logprobs[row].topk(n) if n else None
            pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if n else ()
            result.append((float(logprobs[row, token_ids[row]]), pairs))
        return result
