"""The sampler: logits -> next tokens (chapter 8; the playground widget calls this code).

For each row the filters run in this order, each on what the previous one left: temperature
(divide the logits by T; T = 0 is greedy and skips the rest), top-k (keep the k highest logits),
top-p (keep the smallest set of most likely tokens whose probability sums to at least p), min-p
(drop tokens less likely than ``min_p`` times the most likely one). Cut tokens get a logit of -inf,
then one token is drawn from the softmax. A request with a seed draws from its own
``torch.Generator``, so what else shares the batch never changes its samples.

``kept_mask`` is the definition (public, so the sampling playground shows exactly it): it sorts
each row's whole vocabulary, which on a CPU is costly (``results/README.md``). The engine sorts only
what the filters can keep: a row with only a temperature draws from its scaled softmax; a filtered
row applies the filters to its best candidates (its top-k, or ``TOP_P_CANDIDATES``), normalised as
``kept_mask`` normalises them. Without top-k that is exact only if the first token past the
candidates would be cut; a flatter row falls back to ``sampling_probs``, the definition on (B, V)
tensors with (B, 1) parameter columns, which ``compile=True`` compiles on CUDA. Tests check that
both paths give the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoengine.layers.kernels import current_kernels
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


# Candidates taken for a row that has top-p or min-p but no top-k. Enough for a real model's
# nucleus almost always (top-p 0.95 keeps tens to hundreds of tokens); a flatter row falls back.
TOP_P_CANDIDATES = 1024


class Sampler:
    """Samples one token per row, honouring each row's own parameters and generator."""

    probs_fn = staticmethod(sampling_probs)  # the eager function; each instance calls the one its kernels gave it

    def __init__(self) -> None:
        self.probs_fn = current_kernels().sampling_probs or sampling_probs

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 default_generator: torch.Generator | None = None) -> SampleResult:
        logits = logits.float()  # (B, V)
        random_rows = [row for row, p in enumerate(params) if not p.greedy]
        # max(dim) gives the first maximum like argmax, and is several times faster on a CPU.
        tokens = logits.max(dim=-1).indices if len(random_rows) < len(params) else \
            torch.empty(len(params), dtype=torch.long, device=logits.device)
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            tokens[rows] = self._sample(logits.index_select(0, rows), [params[r] for r in random_rows],
                                        [generators[r] for r in random_rows], default_generator)
        token_ids = tokens.tolist()
        return SampleResult(token_ids, self.token_logprobs(logits, params, token_ids))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list,
                default_generator: torch.Generator | None) -> torch.Tensor:
        """Draw one token per row of (R, V) logits, none of them greedy. -> (R,) token ids."""
        device = logits.device
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=device)
        filtered = [i for i, p in enumerate(params) if p.has_filters]
        plain = sorted(set(range(len(params))) - set(filtered))  # temperature only: nothing to cut
        if plain:  # the softmax of the scaled logits is the whole distribution: no filter, no sort
            rows = torch.tensor(plain, device=device)
            probs = self.distribution(logits.index_select(0, rows), [params[i] for i in plain])
            tokens[rows] = self._draw(probs, [generators[i] for i in plain], default_generator)
        whole = []  # filtered rows too flat for their candidates: the whole-vocabulary definition
        if filtered:
            probs, candidates, widths, exact = self._candidate_probs(
                logits.index_select(0, torch.tensor(filtered, device=device)), [params[i] for i in filtered])
            flags = exact.tolist()
            exact_at = [at for at, ok in enumerate(flags) if ok]
            whole = [filtered[at] for at, ok in enumerate(flags) if not ok]
            if exact_at:
                at = torch.tensor(exact_at, device=device)
                picked = self._draw(probs.index_select(0, at), [generators[filtered[a]] for a in exact_at],
                                    default_generator, [widths[a] for a in exact_at])
                rows = torch.tensor([filtered[a] for a in exact_at], device=device)
                tokens[rows] = candidates.index_select(0, at).gather(1, picked[:, None])[:, 0]
        if whole:
            rows = torch.tensor(whole, device=device)
            probs = self.distribution(logits.index_select(0, rows), [params[i] for i in whole])
            tokens[rows] = self._draw(probs, [generators[i] for i in whole], default_generator)
        return tokens

    @staticmethod
    def _candidate_probs(logits: torch.Tensor, params: list[SamplingParams]):
        """The filters applied to each row's top candidates only.

        A row's candidates are its ``top_k`` best tokens, or its ``TOP_P_CANDIDATES`` best
        without top-k: a number of its own, whatever else is in the batch, so a seeded row
        draws the same token in any batch. Returns (R, K) probabilities to draw from (0
        past a row's width or where a filter cut), the (R, K) token ids they belong to,
        (R,) each row's width, and (R,) whether its result is exact (see the module doc).
        """
        batch, vocab = logits.shape
        temperature, top_k, top_p, min_p = sampling_params_columns(logits, params)
        temperature = temperature.clamp(min=1e-6)
        has_top_k = top_k > 0  # (R, 1)
        widths = [min(p.top_k if p.top_k > 0 else TOP_P_CANDIDATES, vocab) for p in params]
        width = torch.tensor(widths, device=logits.device).reshape(-1, 1)
        k = max(widths)
        # A positive temperature keeps the order, so the unscaled logits give the same candidates;
        # only the (R, K) candidates are scaled, never the whole (R, V) row.
        values, candidates = logits.topk(k, dim=-1)  # (R, K), sorted descending
        values = values / temperature
        in_width = torch.arange(k, device=logits.device).expand(batch, k) < width
        head = values.masked_fill(~in_width, float("-inf"))
        # As kept_mask: probabilities over the top-k survivors, or over the whole row without top-k.
        log_norm = head.logsumexp(dim=-1, keepdim=True)
        whole_rows = [row for row, p in enumerate(params) if p.top_k <= 0]
        if whole_rows:
            at = torch.tensor(whole_rows, device=logits.device)
            log_norm[at] = (logits.index_select(0, at) / temperature[at]).logsumexp(dim=-1, keepdim=True)
        probs = (head - log_norm).exp()  # (R, K), 0 past each row's width
        total = probs.cumsum(dim=-1)
        keep = in_width & ((total - probs < top_p) | (top_p >= 1.0))
        keep[:, 0] = True  # the most likely token always survives
        survivors = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
        keep &= survivors >= min_p * survivors[:, :1]
        # A row without top-k is exact if the first token past its candidates would be cut:
        # by top-p (their mass reaches p) or by min-p (their last one is cut already).
        last = width - 1
        top_p_cut = (total.gather(1, last) >= top_p) & (top_p < 1.0)
        min_p_cut = ~keep.gather(1, last) & (min_p > 0.0) & ~top_p_cut
        exact = has_top_k | (width == vocab) | top_p_cut | min_p_cut
        return torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1), candidates, widths, exact[:, 0]

    @staticmethod
    def _draw(probs: torch.Tensor, generators: list, default_generator: torch.Generator | None,
              widths: list[int] | None = None) -> torch.Tensor:
        """One index per row of (R, N) probabilities: a seeded row with its own generator over
        its own ``widths[row]`` first entries (so the batch never changes its draw), the
        others together in one call with the engine's. -> (R,)"""
        picked = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
        shared = [row for row, g in enumerate(generators) if g is None]
        for row, generator in enumerate(generators):
            if generator is not None:
                row_probs = probs[row] if widths is None else probs[row, :widths[row]]
                picked[row] = torch.multinomial(row_probs, 1, generator=generator)[0]
        if shared:
            idx = torch.tensor(shared, device=probs.device)
            picked[idx] = torch.multinomial(probs.index_select(0, idx), 1, generator=default_generator)[:, 0]
        return picked

    def distribution(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The whole distribution each row's token is drawn from. (R, V) -> (R, V), rows sum to 1.

        Speculative decoding needs it whole: it reads a drafted token's probability and, on a
        rejection, draws from the rest.
        """
        if any(p.greedy for p in params):
            raise ValueError("distribution() is for sampling rows; a greedy row's token is its argmax")
        logits = logits.float()
        columns = sampling_params_columns(logits, params)
        if not any(p.has_filters for p in params):
            return torch.softmax(logits / columns[0].clamp(min=1e-6), dim=-1)
        return self.probs_fn(logits, *columns)

    @staticmethod
    def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]):
        """Per row, the logprob of ``token_ids[row]`` and the row's top-N (None where not asked for)."""
        wanted = [p.logprobs for p in params]
        if all(n is None for n in wanted):
            return [None] * len(params)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # the model's own distribution
        result = []
        for row, n in enumerate(wanted):
            if n is None:
                result.append(None)
                continue
            top = logprobs[row].topk(n)
            result.append((float(logprobs[row, token_ids[row]]), tuple(zip(top.indices.tolist(), top.values.tolist()))))
        return result
