"""The block allocator simulator: paged KV blocks beside a contiguous allocator (chapters 4, 7).

Left, the live block manager of a real ``LLMEngine``: every KV block as a cell, coloured by
the request that holds it, filled as far as its tokens go, with its reference count when
several requests share it (a common prefix) and a mark when it is free but still holds a
prefix-cache hash (reusable until evicted). Right, what a pre-PagedAttention server would
do with the same memory and the same requests: reserve one contiguous range per request,
sized for the longest sequence it might reach, first fit.

Both sides are computed from the engine's live state (``snapshot()``), never from a
formula. Kwon et al. (2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention") measured that such contiguous systems used only 20-40% of their KV
memory for tokens (60-80% wasted) against under 4% waste with paging; chapter 4 reproduces
the effect here.

Waste is split into the paper's three kinds:

* *reserved*: slots set aside for tokens the request will still produce (contiguous only);
* *internal fragmentation*: slots inside an allocation that will never hold a token (the
  tail of a max-length reservation; for paging, the unfilled end of a request's last block);
* *external fragmentation*: free slots in holes too small for the next reservation (never
  for paging: any free block serves any request).

The controller follows the engine's events, so requests that other code adds, steps or
aborts are counted on the contiguous side too, and the view redraws after every engine
step whoever ran it.

``BlockAllocatorController`` is the testable part; ``BlockAllocatorView`` draws it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import ipywidgets as W

from nanoengine import EngineSnapshot, LLMEngine, RequestOutput, SamplingParams
from nanoengine.events import (BlockEvicted, BlocksAllocated, BlocksForked, BlocksFreed, BlockStored, Event,
                               PrefixCacheHit, RequestFinished, RequestPreempted, RequestQueued, RequestScheduled,
                               StepFinished)
from widgets._common import (PALETTE, ControllerView, EngineWatcher, TokenSource, check_int, check_request_fits,
                             escape, format_bytes, guarded, shared_engine_note)
from translations import tr

RESERVE_MODES = ("max_model_len", "request")


# ---------------------------------------------------------------------------------------
# Plain records
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockCell:
    """One KV block as the grid shows it."""

    block_id: int
    state: str  # "used", "cached" (free, still holds a prefix-cache hash) or "free"
    owners: tuple[str, ...]  # requests whose block table holds it
    ref_count: int
    num_filled: int  # token slots that hold KV (0..block_size)


@dataclass(frozen=True)
class MemoryReport:
    """Where one allocator's KV memory goes, in token slots (``*_bytes`` for bytes)."""

    name: str
    capacity_tokens: int
    bytes_per_token: float
    stored_tokens: int  # slots holding a computed token's K and V
    reserved_tokens: int  # set aside for tokens the request will still produce
    internal_tokens: int  # inside allocations, never to hold a token
    external_tokens: int  # free, but in holes too small for the next reservation
    free_tokens: int  # all free slots (external fragmentation included)
    num_placed: int  # requests that hold memory
    num_waiting: int  # requests that do not fit yet

    @property
    def wasted_tokens(self) -> int:
        return self.reserved_tokens + self.internal_tokens + self.external_tokens

    @property
    def allocated_tokens(self) -> int:
        return self.capacity_tokens - self.free_tokens

    @property
    def waste_fraction(self) -> float:
        """Wasted slots over slots that are allocated or stranded (0 when nothing is)."""
        denominator = self.allocated_tokens + self.external_tokens
        return self.wasted_tokens / denominator if denominator else 0.0

    def bytes(self, tokens: int) -> float:
        return tokens * self.bytes_per_token


@dataclass(frozen=True)
class Region:
    """One contiguous reservation: ``size`` token slots from ``start``."""

    request_id: str
    start: int
    size: int


# ---------------------------------------------------------------------------------------
# The contiguous allocator (what PagedAttention replaced)
# ---------------------------------------------------------------------------------------


class ContiguousAllocator:
    """First-fit allocation of one contiguous range per request, held until it finishes.

    The address space has ``capacity`` token slots (the same memory as the paged pool).
    Requests that do not fit wait in arrival order; the head of the queue blocks the
    rest (first come, first served, like the engine's scheduler).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.regions: dict[str, Region] = {}
        self.waiting: collections.OrderedDict[str, int] = collections.OrderedDict()  # id -> size

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges as (start, size), in address order."""
        holes, cursor = [], 0
        for region in sorted(self.regions.values(), key=lambda r: r.start):
            if region.start > cursor:
                holes.append((cursor, region.start - cursor))
            cursor = region.start + region.size
        if cursor < self.capacity:
            holes.append((cursor, self.capacity - cursor))
        return holes

    def find_hole(self, size: int) -> int | None:
        """Start of the first hole that holds ``size`` slots, or None."""
        return next((start for start, hole in self.holes() if hole >= size), None)

    def request(self, request_id: str, size: int) -> None:
        """Queue ``request_id`` for a ``size``-slot range and place whatever now fits."""
        if size > self.capacity:
            raise ValueError(f"a {size}-slot reservation can never fit in {self.capacity} slots")
        self.waiting[request_id] = size
        self.place_waiting()

    def release(self, request_id: str) -> None:
        self.regions.pop(request_id, None)
        self.waiting.pop(request_id, None)
        self.place_waiting()

    def place_waiting(self) -> None:
        while self.waiting:
            request_id, size = next(iter(self.waiting.items()))
            start = self.find_hole(size)
            if start is None:
                return
            del self.waiting[request_id]
            self.regions[request_id] = Region(request_id, start, size)

    def next_reservation(self, default: int) -> int:
        """The size the next placement needs: the head waiting request's, else ``default``."""
        return next(iter(self.waiting.values()), default)


# ---------------------------------------------------------------------------------------
# The controller
# ---------------------------------------------------------------------------------------


class BlockAllocatorController:
    """Drive an engine's block manager with a request trace and compare with contiguous.

    ``contiguous_reserve`` picks what the contiguous allocator reserves per request:
    ``"max_model_len"`` (a static server that must be ready for any request) or
    ``"request"`` (prompt + max tokens, the best a contiguous allocator can do).
    """

    def __init__(self, engine: LLMEngine, contiguous_reserve: str = "max_model_len",
                 shared_prefix_len: int | None = None, seed: int = 0) -> None:
        if contiguous_reserve not in RESERVE_MODES:
            raise ValueError(f"contiguous_reserve must be one of {RESERVE_MODES}, got {contiguous_reserve!r}")
        self.engine = engine
        self.contiguous_reserve = contiguous_reserve
        snap = engine.snapshot()
        self.block_size = snap.block_size
        self.num_blocks = snap.num_blocks
        self.bytes_per_block = snap.kv_cache_bytes / snap.num_blocks  # from the real KV tensor
        self.tokens = TokenSource(engine.model_config.vocab_size, seed)
        prefix_len = shared_prefix_len if shared_prefix_len is not None else 4 * self.block_size
        self.shared_prefix = self.tokens.tokens(check_int("shared prefix length", prefix_len, 1,
                                                          engine.max_model_len))
        self.contiguous = ContiguousAllocator(self.num_blocks * self.block_size)
        self.final_lengths: dict[str, int] = {}  # request id -> longest it can get
        self.colours: dict[str, str] = {}
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self._in_step = False
        self._unsubscribe = engine.events.subscribe(self._on_event)
        self.sync()

    # ------------------------------------------------------------------ actions
    def add_request(self, prompt_len: int, max_tokens: int, shared_prefix: bool = False, n: int = 1) -> str:
        """Queue a request of ``prompt_len`` random tokens (starting with the shared prefix).

        ``n > 1`` asks for n completions of the prompt (parallel sampling): once the prompt
        is computed, its full blocks are held by all n (reference count n, drawn with a
        thick border). Everything is checked first; on a bad value nothing changes.
        """
        prompt_len = check_int("prompt length", prompt_len, 1)
        max_tokens = check_int("max tokens", max_tokens, 1)
        n = check_int("completions (n)", n, 1)
        check_request_fits(self.engine, prompt_len, max_tokens)
        params = SamplingParams(temperature=0.8 if n > 1 else 0.0, seed=0 if n > 1 else None, n=n,
                                max_tokens=max_tokens, ignore_eos=True)
        if shared_prefix:
            head = self.shared_prefix[:prompt_len]
            prompt = head + self.tokens.tokens(prompt_len - len(head))
        else:
            prompt = self.tokens.tokens(prompt_len)
        request_id = self.engine.add_request(prompt, params)
        self.sync()
        return request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; refuses (ValueError) when there is nothing to run."""
        if not self.engine.has_unfinished_requests():
            raise ValueError(tr("nothing to step: add a request first"))
        outputs = self.engine.step()
        self.sync()
        return outputs

    def finish(self, request_id: str, max_steps: int = 100_000) -> int:
        """Step the engine until ``request_id`` finishes; returns the steps taken."""
        self._check_live(request_id)
        steps = 0
        while request_id in self.engine.requests and steps < max_steps:
            self.engine.step()
            steps += 1
        self.sync()
        return steps

    def abort(self, request_id: str) -> RequestOutput:
        self._check_live(request_id)
        output = self.engine.abort(request_id)
        self.sync()
        return output

    def set_contiguous_reserve(self, mode: str) -> None:
        """Switch what the contiguous side reserves; it is rebuilt from the live requests.

        The new allocator starts empty and every unfinished request queues again for a
        reservation of the new size, in arrival order, as if the server had used this
        policy from the start (their tokens so far are the same on both policies).
        """
        if mode not in RESERVE_MODES:
            raise ValueError(f"contiguous reserve must be one of {RESERVE_MODES}, got {mode!r}")
        self.contiguous_reserve = mode
        self.contiguous = ContiguousAllocator(self.num_blocks * self.block_size)
        self.final_lengths.clear()  # sync() places only requests it has not seen: forget them all
        self.sync()

    def close(self) -> None:
        """Stop listening to the engine's events."""
        self._unsubscribe()

    # ---------------------------------------------------------------- observing
    @property
    def live_requests(self) -> list[str]:
        """Unfinished request ids in arrival order (waiting ones included)."""
        return list(self.final_lengths)

    def sync(self, snap: EngineSnapshot | None = None) -> None:
        """Bring the contiguous allocator in line with the engine's live requests.

        New requests queue for a reservation (in arrival order); finished ones release
        theirs, which may let waiting ones in. Requests added by other code count too.
        """
        snap = snap or self.engine.snapshot()
        live = {r.request_id: r for r in (*snap.running, *snap.waiting)}
        for request_id in [r for r in self.final_lengths if r not in live]:
            del self.final_lengths[request_id]
            self.contiguous.release(request_id)
        for r in sorted(live.values(), key=lambda r: _arrival_key(r.request_id)):
            if r.request_id in self.final_lengths:
                continue
            final = min(r.num_prompt_tokens + r.max_tokens, snap.max_model_len)
            self.final_lengths[r.request_id] = final
            self.colours.setdefault(r.request_id, PALETTE[len(self.colours) % len(PALETTE)])
            size = snap.max_model_len if self.contiguous_reserve == "max_model_len" else final
            self.contiguous.request(r.request_id, size)

    def cells(self, snap: EngineSnapshot | None = None) -> list[BlockCell]:
        """Every block with its owners and fill, from the engine's snapshot."""
        snap = snap or self.engine.snapshot()
        owners: dict[int, list[str]] = collections.defaultdict(list)
        filled: dict[int, int] = collections.defaultdict(int)
        for r in snap.running:
            for i, block_id in enumerate(r.block_ids):
                owners[block_id].append(r.request_id)
                n = min(self.block_size, max(0, r.num_computed_tokens - i * self.block_size))
                filled[block_id] = max(filled[block_id], n)
        cells = []
        for b in snap.blocks:
            state = "used" if not b.is_free else ("cached" if b.is_cached else "free")
            cells.append(BlockCell(b.block_id, state, tuple(owners.get(b.block_id, ())), b.ref_count,
                                   filled.get(b.block_id, 0)))
        return cells

    def counts(self, cells: list[BlockCell] | None = None) -> dict[str, int]:
        cells = cells if cells is not None else self.cells()
        return {
            "total": len(cells),
            "used": sum(c.state == "used" for c in cells),
            "free": sum(c.state != "used" for c in cells),
            "cached_free": sum(c.state == "cached" for c in cells),
            "shared": sum(c.ref_count > 1 for c in cells),
        }

    def paged_report(self, snap: EngineSnapshot | None = None) -> MemoryReport:
        """Paged memory now: the only waste is the unfilled end of each request's blocks."""
        snap = snap or self.engine.snapshot()
        cells = self.cells(snap)
        used = [c for c in cells if c.state == "used"]
        stored = sum(c.num_filled for c in used)
        return MemoryReport(
            name="paged", capacity_tokens=self.num_blocks * self.block_size,
            bytes_per_token=self.bytes_per_block / self.block_size, stored_tokens=stored, reserved_tokens=0,
            internal_tokens=len(used) * self.block_size - stored, external_tokens=0,
            free_tokens=(self.num_blocks - len(used)) * self.block_size,
            num_placed=len(snap.running), num_waiting=len(snap.waiting))

    def contiguous_report(self, snap: EngineSnapshot | None = None) -> MemoryReport:
        """Contiguous memory now, for the same live requests and their live token counts."""
        snap = snap or self.engine.snapshot()
        computed = {r.request_id: r.num_computed_tokens for r in snap.running}
        stored = reserved = internal = 0
        for region in self.contiguous.regions.values():
            final = self.final_lengths[region.request_id]
            now = min(computed.get(region.request_id, 0), final)
            stored += now
            reserved += final - now
            internal += region.size - final
        need = self.useful_hole_size()
        holes = self.contiguous.holes()
        return MemoryReport(
            name="contiguous", capacity_tokens=self.contiguous.capacity,
            bytes_per_token=self.bytes_per_block / self.block_size, stored_tokens=stored,
            reserved_tokens=reserved, internal_tokens=internal,
            external_tokens=sum(size % need for _, size in holes),
            free_tokens=sum(size for _, size in holes),
            num_placed=len(self.contiguous.regions), num_waiting=len(self.contiguous.waiting))

    def useful_hole_size(self) -> int:
        """The smallest hole the contiguous allocator can use next.

        The head waiting request's reservation if one waits; otherwise ``max_model_len``
        (every reservation has that size), or, when reserving per request, the smallest
        live request's size. Free slots left over in holes are external fragmentation.
        """
        default = self.engine.max_model_len
        if self.contiguous_reserve == "request" and self.final_lengths:
            default = min(self.final_lengths.values())
        return self.contiguous.next_reservation(default)

    # ----------------------------------------------------------------- helpers
    def _check_live(self, request_id: str) -> None:
        if request_id not in self.engine.requests:
            raise ValueError(tr("no unfinished request {rid!r} (unfinished: {live})", rid=request_id,
                                live=self.live_requests))

    def _on_event(self, event: Event) -> None:
        line = _describe_block_event(event)
        if line:
            self.log.append(tr("step {step}: {line}", step=event.step, line=line))
        # Keep the contiguous side in step with the engine whoever drives it: a request
        # queues for its range when it arrives and releases it when it ends. Mid-step events
        # wait for StepFinished, when the engine's queues are settled again.
        if isinstance(event, RequestScheduled):
            self._in_step = True
        elif isinstance(event, StepFinished):
            self._in_step = False
            self.sync()
        elif isinstance(event, (RequestQueued, RequestFinished)) and not self._in_step:
            self.sync()


def _arrival_key(request_id: str) -> tuple[int, int | str]:
    """Engine-assigned ids are counters; sort them numerically, others after, by name."""
    return (0, int(request_id)) if request_id.isdigit() else (1, request_id)


def _describe_block_event(event: Event) -> str | None:
    if isinstance(event, BlocksAllocated):
        return tr("request {rid} got blocks {blocks}", rid=event.request_id, blocks=list(event.block_ids))
    if isinstance(event, BlocksFreed):
        return tr("request {rid} released blocks {blocks}", rid=event.request_id, blocks=list(event.block_ids))
    if isinstance(event, PrefixCacheHit):
        return tr("request {rid} reuses cached blocks {blocks} ({n} tokens)", rid=event.request_id,
                  blocks=list(event.block_ids), n=event.num_cached_tokens)
    if isinstance(event, BlocksForked):
        return tr("request {rid} shares blocks {blocks} of {parent} (fork)", rid=event.request_id,
                  blocks=list(event.block_ids), parent=event.parent_id)
    if isinstance(event, BlockStored):
        return tr("block {block} is full: its hash enters the prefix cache", block=event.block_id)
    if isinstance(event, BlockEvicted):
        return tr("block {block} evicted from the prefix cache (reused)", block=event.block_id)
    if isinstance(event, RequestPreempted):
        return tr("request {rid} preempted, {n} blocks freed", rid=event.request_id, n=event.num_blocks_freed)
    if isinstance(event, RequestFinished):
        return tr("request {rid} finished ({reason})", rid=event.request_id, reason=event.finish_reason)
    return None


# ---------------------------------------------------------------------------------------
# Rendering (pure functions of the controller's state: fast and testable)
# ---------------------------------------------------------------------------------------

_FREE, _CACHED, _INTERNAL, _EXTERNAL = "#ffffff", "#d9ecf7", "#bdbdbd", "#e57373"


def render_grid(controller: BlockAllocatorController, cells: list[BlockCell] | None = None,
                columns: int | None = None) -> str:
    """The block grid as one HTML string: one styled div per block, no image to encode."""
    cells = cells if cells is not None else controller.cells()
    columns = columns or (16 if len(cells) <= 128 else 32 if len(cells) <= 512 else 40)
    size = 22 if len(cells) <= 128 else 15 if len(cells) <= 512 else 12
    bs = controller.block_size
    parts = [f'<div class="ne-grid" style="display:grid;grid-template-columns:repeat({columns},{size}px);'
             f'gap:2px;font:9px monospace">']
    for c in cells:
        if c.state == "used":
            colour = controller.colours.get(c.owners[0], "#777") if c.owners else "#777"
            pct = 100 * c.num_filled // bs
            background = f"linear-gradient(to top,{colour} {pct}%,{colour}55 {pct}%)"
            border = "2px solid #222" if c.ref_count > 1 else f"1px solid {colour}"
            label = str(c.ref_count) if c.ref_count > 1 else ""
            title = tr("block {block}: {owners}; {filled}/{bs} tokens; ref count {refs}", block=c.block_id,
                       owners=", ".join(c.owners) or "?", filled=c.num_filled, bs=bs, refs=c.ref_count)
        elif c.state == "cached":
            background, border, label = _CACHED, "1px dashed #5b9bd5", ""
            title = tr("block {block}: free, still holds a prefix-cache hash (reusable until evicted)",
                       block=c.block_id)
        else:
            background, border, label = _FREE, "1px solid #ccc", ""
            title = tr("block {block}: free", block=c.block_id)
        parts.append(f'<div class="ne-block ne-{c.state}" data-block="{c.block_id}" '
                     f'data-owner="{escape(",".join(c.owners))}" data-fill="{c.num_filled}" '
                     f'data-ref="{c.ref_count}" title="{escape(title)}" style="width:{size}px;height:{size}px;'
                     f'box-sizing:border-box;background:{background};border:{border};text-align:center;'
                     f'line-height:{size - 2}px;color:#fff">{label}</div>')
    parts.append("</div>")
    return "".join(parts)


def render_contiguous(controller: BlockAllocatorController, snap: EngineSnapshot | None = None) -> str:
    """The contiguous address space as one bar: each reservation split into its parts."""
    alloc = controller.contiguous
    cap = alloc.capacity
    snap = snap or controller.engine.snapshot()
    computed = {r.request_id: r.num_computed_tokens for r in snap.running}
    need = controller.useful_hole_size()
    segments = []  # (start, size, colour, title)
    for region in alloc.regions.values():
        colour = controller.colours.get(region.request_id, "#777")
        final = controller.final_lengths[region.request_id]
        now = min(computed.get(region.request_id, 0), final)
        rid = escape(region.request_id)
        segments += [(region.start, now, colour, tr("request {rid}: {n} tokens stored", rid=rid, n=now)),
                     (region.start + now, final - now, colour + "55",
                      tr("request {rid}: reserved for later tokens", rid=rid)),
                     (region.start + final, region.size - final, _INTERNAL,
                      tr("request {rid}: internal fragmentation (never used)", rid=rid))]
    for start, size in alloc.holes():
        stranded = size % need
        segments += [(start, size - stranded, _FREE, tr("free")),
                     (start + size - stranded, stranded, _EXTERNAL, tr("external fragmentation: too small to use"))]
    divs = "".join(
        f'<div title="{t}" style="position:absolute;left:{100 * s / cap:.4f}%;width:{100 * n / cap:.4f}%;'
        f'height:100%;background:{c}"></div>' for s, n, c, t in sorted(segments) if n > 0)
    waiting = ", ".join(escape(r) for r in alloc.waiting) or tr("none")
    return (f'<div class="ne-contiguous" style="position:relative;height:26px;border:1px solid #999;'
            f'background:{_FREE}">{divs}</div>'
            f'<div style="font-size:12px">'
            + tr("{cap} token slots (the paged pool's memory), {n} reservations; waiting for a contiguous range: "
                 "{waiting}", cap=cap, n=len(alloc.regions),
                 waiting=f'<span class="ne-contiguous-waiting">{waiting}</span>')
            + '</div>')


def render_headline(paged: MemoryReport, contiguous: MemoryReport, reserve: str) -> str:
    """The two numbers the chapter is about, in one line next to the buttons."""
    policy = "max_model_len" if reserve == "max_model_len" else tr("prompt + max tokens")
    return (f'<div class="ne-alloc-headline" style="font-size:13px;padding:3px 0">'
            f'<b>{tr("wasted")}</b>: {tr("paged")} <b class="ne-headline-waste-paged">'
            f'{100 * paged.waste_fraction:.1f}%</b> · '
            f'{tr("contiguous (reserving {policy})", policy=policy)} <b class="ne-headline-waste-contiguous">'
            f'{100 * contiguous.waste_fraction:.1f}%</b> &nbsp;|&nbsp; <b>{tr("requests holding memory / waiting")}</b>: '
            f'{tr("paged")} <b class="ne-headline-placed-paged">{paged.num_placed} / {paged.num_waiting}</b> · '
            f'{tr("contiguous")} <b class="ne-headline-placed-contiguous">{contiguous.num_placed} / '
            f'{contiguous.num_waiting}</b></div>')


def render_report_table(paged: MemoryReport, contiguous: MemoryReport) -> str:
    rows = [(tr("stored KV (tokens)"), "stored_tokens"), (tr("reserved for later tokens"), "reserved_tokens"),
            (tr("internal fragmentation"), "internal_tokens"), (tr("external fragmentation"), "external_tokens"),
            (tr("total waste"), "wasted_tokens"), (tr("free"), "free_tokens")]
    body = []
    for label, attr in rows:
        cells = []
        for rep in (paged, contiguous):
            n = getattr(rep, attr)
            cells.append(f"<td>{tr('{n:,} slots', n=n)} <small>({format_bytes(rep.bytes(n))})</small></td>")
        body.append(f"<tr><th style='text-align:left'>{label}</th>{''.join(cells)}</tr>")
    body.append(f"<tr><th style='text-align:left'>{tr('waste / (allocated + stranded)')}</th>"
                f"<td class='ne-waste-paged'>{100 * paged.waste_fraction:.1f}%</td>"
                f"<td class='ne-waste-contiguous'>{100 * contiguous.waste_fraction:.1f}%</td></tr>")
    body.append(f"<tr><th style='text-align:left'>{tr('requests holding memory / waiting')}</th>"
                f"<td>{paged.num_placed} / {paged.num_waiting}</td>"
                f"<td>{contiguous.num_placed} / {contiguous.num_waiting}</td></tr>")
    return ("<table class='ne-report' style='font-size:12px;line-height:1.3;border-collapse:collapse' border='1' "
            f"cellpadding='3'><tr><th></th><th>{tr('paged (live engine)')}</th><th>{tr('contiguous, same trace')}"
            "</th></tr>"
            + "".join(body) + "</table>")


def render_counts(controller: BlockAllocatorController, cells: list[BlockCell] | None = None) -> str:
    c = controller.counts(cells)
    bpb = controller.bytes_per_block
    return ('<div class="ne-counts" style="font-size:13px;line-height:1.4">'
            + tr("<b>{used}</b> used · <b>{free}</b> free (<b>{cached}</b> cached, reusable) · <b>{shared}</b> "
                 "shared (ref count &gt; 1) of {total} blocks × {bs} tokens · {per_block} per block, {in_use} in use "
                 "of {all_bytes} (measured on the engine's KV tensor)", used=c["used"], free=c["free"],
                 cached=c["cached_free"], shared=c["shared"], total=c["total"], bs=controller.block_size,
                 per_block=format_bytes(bpb), in_use=format_bytes(bpb * c["used"]),
                 all_bytes=format_bytes(bpb * c["total"]))
            + '</div>')


# ---------------------------------------------------------------------------------------
# The view
# ---------------------------------------------------------------------------------------


class BlockAllocatorView(ControllerView, W.VBox):
    """The controls and the headline (waste, requests placed) on top, then the grid beside the
    contiguous comparison, then the legend and the event log (folded).

    ``shared_with`` names another simulator that drives the same engine; the view then
    says so. It redraws after every engine step, whoever ran it.
    """

    def __init__(self, engine: LLMEngine | None = None, controller: BlockAllocatorController | None = None,
                 shared_with: str | None = None, **controller_kwargs) -> None:
        if controller is None:
            if engine is None:
                raise ValueError("give an engine or a controller")
            controller = BlockAllocatorController(engine, **controller_kwargs)
        self.controller = controller
        max_len = controller.engine.max_model_len
        self.message = W.HTML()
        show = self.show_message
        default_prompt = min(len(controller.shared_prefix) + controller.block_size + 1, max_len // 2)
        self.prompt_len = W.BoundedIntText(value=default_prompt, min=0, max=10 * max_len, description=tr("prompt len"),
                                           layout=W.Layout(width="180px"))
        self.max_tokens = W.BoundedIntText(value=max(1, min(2 * controller.block_size, max_len // 4)), min=0,
                                           max=10 * max_len, description=tr("max tokens"),
                                           layout=W.Layout(width="180px"))
        self.shared = W.Checkbox(value=False, description=tr("starts with the shared prefix"), indent=False,
                                 layout=W.Layout(width="auto", margin="0 12px"))
        self.add_button = W.Button(description=tr("Add request"), button_style="primary")
        self.step_button = W.Button(description=tr("Step"))
        self.request_picker = W.Dropdown(options=[], description=tr("request"))
        self.finish_button = W.Button(description=tr("Finish"))
        self.abort_button = W.Button(description=tr("Abort"), button_style="danger")
        self.reserve = W.ToggleButtons(options=[(tr("reserve max_model_len"), "max_model_len"),
                                                (tr("reserve prompt + max tokens"), "request")],
                                       value=controller.contiguous_reserve, style={"button_width": "215px"})
        self.shared_note = W.HTML(shared_engine_note(shared_with))
        self.headline = W.HTML()
        self.counts = W.HTML()
        self.grid = W.HTML()
        self.contiguous = W.HTML()
        self.report = W.HTML()
        self.event_log = W.HTML()
        for widget, name in ((self.add_button, "add"), (self.step_button, "step"),
                             (self.finish_button, "finish"), (self.abort_button, "abort"),
                             (self.prompt_len, "prompt-len"), (self.max_tokens, "max-tokens")):
            widget.add_class(f"ne-alloc-{name}")

        @guarded(show)
        def on_add(_):
            rid = controller.add_request(self.prompt_len.value, self.max_tokens.value, self.shared.value)
            self.refresh(tr("added request {rid}", rid=rid), "ok")

        @guarded(show)
        def on_step(_):
            controller.step()
            self.refresh(tr("ran engine step {step}", step=controller.engine.snapshot().step - 1), "ok")

        @guarded(show)
        def on_finish(_):
            rid = self._picked()
            steps = controller.finish(rid)
            self.refresh(tr("request {rid} finished after {steps} more steps", rid=rid, steps=steps), "ok")

        @guarded(show)
        def on_abort(_):
            rid = self._picked()
            controller.abort(rid)
            self.refresh(tr("request {rid} aborted: its blocks are free", rid=rid), "ok")

        @guarded(show)
        def on_reserve(change):
            controller.set_contiguous_reserve(change["new"])
            live = len(controller.live_requests)
            policy = "max_model_len" if change["new"] == "max_model_len" else tr("prompt + max tokens")
            self.refresh(tr("contiguous side rebuilt for the {live} unfinished request(s), reserving {policy} each",
                            live=live, policy=policy), "ok")

        self.add_button.on_click(on_add)
        self.step_button.on_click(on_step)
        self.finish_button.on_click(on_finish)
        self.abort_button.on_click(on_abort)
        self.reserve.observe(on_reserve, names="value")
        legend = ("<div style='font-size:11px'>"
                  + tr("cell colour = owner request; filled part = token slots holding KV; a number = ref count "
                       "(shared prefix block); dashed blue = free but cached; white = free. Contiguous bar: "
                       "solid = stored, pale = reserved for later tokens, grey = internal fragmentation, "
                       "red = external fragmentation.")
                  + "</div>")
        details = W.Accordion([W.VBox([W.HTML(legend), self.event_log])], selected_index=None)
        details.set_title(0, tr("legend and block event log"))
        super().__init__([
            self.shared_note,
            W.HBox([self.prompt_len, self.max_tokens, self.shared, self.add_button]),
            W.HBox([self.step_button, self.request_picker, self.finish_button, self.abort_button]),
            W.HBox([W.HTML(f"<b>{tr('contiguous side:')}</b>", layout=W.Layout(margin="0 8px 0 0")), self.reserve]),
            self.message, self.headline, self.counts,
            W.HBox([W.VBox([W.HTML(f"<b>{tr('Paged KV blocks (live block manager)')}</b>"), self.grid],
                           layout=W.Layout(width="50%")),
                    W.VBox([W.HTML(f"<b>{tr('Contiguous allocator, same requests')}</b>"),
                            self.contiguous, self.report], layout=W.Layout(width="50%"))]),
            details])
        self.add_class("ne-block-allocator")
        self.headline.add_class("ne-alloc-summary")
        self.watcher = EngineWatcher(controller.engine, self.refresh)
        self.refresh()

    def refresh(self, text: str | None = None, kind: str = "info") -> None:
        """Redraw everything from the engine's live state."""
        c = self.controller
        snap = c.engine.snapshot()  # one snapshot for the whole redraw
        c.sync(snap)
        cells = c.cells(snap)
        live = c.live_requests
        self.request_picker.options = live
        if live and self.request_picker.value not in live:
            self.request_picker.value = live[0]
        paged, contiguous = c.paged_report(snap), c.contiguous_report(snap)
        self.headline.value = render_headline(paged, contiguous, c.contiguous_reserve)
        self.counts.value = render_counts(c, cells)
        self.grid.value = render_grid(c, cells)
        self.contiguous.value = render_contiguous(c, snap)
        self.report.value = render_report_table(paged, contiguous)
        idle = not c.live_requests
        self.step_button.disabled = idle  # Step has nothing to do: the grid shows no live request
        self.finish_button.disabled = self.abort_button.disabled = idle
        recent = list(c.log)[-12:]
        self.event_log.value = ("<pre class='ne-alloc-log' style='font-size:11px;max-height:12em;overflow:auto'>"
                          + escape("\n".join(reversed(recent)) or tr("no block events yet")) + "</pre>")
        if text is not None:
            self.show_message(text, kind)
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.drawn()

    def _picked(self) -> str:
        rid = self.request_picker.value
        if rid is None:
            raise ValueError(tr("no request selected: add one first"))
        return rid
