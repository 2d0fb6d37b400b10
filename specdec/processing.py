"""Logits processing: raw logits -> the distribution a request samples from.

One function, `process_logits`, serves the draft and the target alike, so that speculative
sampling compares the distributions the request actually asks for (vLLM PR 10198).

Order of operations (vLLM V1's `Sampler`, for one row whose history is prompt + output):

 1. logits in float32.
 2. allowed_token_ids: every other token -> -inf.
 3. bad_words: for each tokenized bad word, its last token -> -inf when its other tokens
    equal the end of the *output* (vLLM matches against output tokens only, not the prompt).
 4. min_tokens: while len(output) < min_tokens, eos_token_ids and stop_token_ids -> -inf.
    (vLLM bans the eos token here even with ignore_eos; `RequestSampling.eos_token_ids`
    is what gets banned, so the caller decides.)
 5. logit_bias: added.
 6. penalties (vLLM / OpenAI definitions):
    repetition: tokens in prompt + output: logit / r if logit > 0 else logit * r;
    frequency: logit -= f * count in output; presence: logit -= p if in output.
 7. greedy rows (temperature < 1e-5): one-hot at the argmax of these logits; their
    logprobs are log_softmax of these logits (temperature 1). Steps 8-11 skip them.
 8. temperature: logits / T.
 9. min_p: tokens with prob < min_p * max prob -> -inf.
10. top_k: tokens below the k-th largest logit -> -inf (ties with the k-th are kept).
11. top_p: keep the smallest set of most probable tokens whose mass reaches p (at least one
    token). Deliberate difference from vLLM: tokens tied with the last kept token are kept
    too (vLLM's cut depends on sort order among ties); with continuous logits the two agree.
12. softmax -> probs; logprobs = log of the same distribution (-inf where probs are 0).
    A probability under e^-87 (1.6e-38) of the row's largest is flushed to 0 in probs
    (`EXP_FLOOR`: float32's denormals, where exp is slow); its logprob stays finite.

Rows with raw=True skip everything: softmax(logits) (the pre-PR-10198 target behaviour,
INCORRECT on purpose; kept for the benchmark).

If a ban (steps 3-4) would leave a row with no possible token (e.g. allowed_token_ids holds
only stop tokens and min_tokens is not reached), that ban is skipped for that row: the
earlier constraint wins and generation can stop, where vLLM would sample from all -inf.

Logits that are NaN or +inf, or -inf at every token a row allows, raise ValueError: the
output never holds NaN.

Implementation: the arithmetic is vLLM's, in its order (so ties that penalties create
stay ties). Steps 2-6 touch only the listed tokens (sparse index ops); min_p and top-k are
one per-row cut (together equal to vLLM's min_p, then top-k); top-p looks at the row's top
max(64, top_k) tokens (one topk shared with top-k, no sort of the vocabulary) and only rows
whose kept set is larger go through a histogram of log-probabilities (a radix select). Rows
with different parameters share every pass; no loop runs over the vocabulary.

Batch invariance: each row's result is bitwise the same alone or in any batch, at any
position and with any number of CPU threads (tests/test_processing.py compares with
`torch.equal`). No row's parameters change how another row is computed (a row's top-p
window width is its own), and the sums over the vocabulary are `vocab_sum` (fixed blocks,
then a pairwise tree of elementwise additions) instead of torch's `sum`, whose order
depends on how many rows are reduced and on the thread count. The remaining reductions
(max, cumsum, sort, topk, scatter-add along a row, softmax) run row by row in a fixed
order on CPU.

Longer than 300 lines because the twelve processing steps share one batched pass and
one set of bitwise-invariant reductions; split, each piece would re-derive the batch layout.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from specdec.errors import RequestError
from specdec.params import GREEDY_EPS, SamplingParams

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RequestSampling:
    """What processing needs from a request; fixed for the request's lifetime."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...] = ()  # banned with stop_token_ids until min_tokens
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # tokenized bad_words

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in self.bad_words_ids))


@dataclass(frozen=True)
class Row:
    """One distribution to compute."""

    request: RequestSampling
    output_ids: Sequence[int]  # committed output + proposals before this position


class Processed(NamedTuple):
    probs: Tensor  # [R, V] float32, the distribution to sample from (one-hot for greedy)
    logprobs: Tensor  # [R, V] float32, log of it (greedy: log_softmax at temperature 1)


def speculative_rows(
    request: RequestSampling, output_ids: Sequence[int], proposals: Sequence[int]
) -> list[Row]:
    """Rows for positions 0..K of a round: row i sees output_ids + proposals[:i]."""
    base, props = tuple(output_ids), tuple(int(t) for t in proposals)
    return [Row(request, base + props[:i]) for i in range(len(props) + 1)]


def tokenize_bad_words(bad_words: Sequence[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Token ids of each bad word, as vLLM does (`SamplingParams.update_from_tokenizer`):
    the word as written (left-stripped), plus its form with a leading space when that is a
    different token sequence of the same length (a word mid-text)."""
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if not ids:
                if not prefix:
                    raise RequestError(
                        f"bad_words entry {word!r} tokenizes to no token; remove it",
                        param="bad_words",
                    )
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return tuple(out)


def process_logits(
    logits: Tensor, rows: Sequence[Row], raw: bool | Sequence[bool] = False
) -> Processed:
    """Processed probabilities and log-probabilities for each row of `logits` [R, V]."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        shape = tuple(logits.shape)
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {shape}")
    raw_mask = _raw_mask(raw, len(rows))
    if not raw_mask.any():
        return _process(logits, None, rows)
    if raw_mask.all():
        return _raw(logits)
    raw_idx, proc_idx = raw_mask.nonzero().squeeze(1), (~raw_mask).nonzero().squeeze(1)
    proc = _process(logits, proc_idx, [rows[i] for i in proc_idx.tolist()])
    rw = _raw(logits[raw_idx])
    probs = logits.new_empty(logits.shape, dtype=torch.float32)
    logprobs = torch.empty_like(probs)
    probs[proc_idx], logprobs[proc_idx] = proc.probs, proc.logprobs
    probs[raw_idx], logprobs[raw_idx] = rw.probs, rw.logprobs
    return Processed(probs, logprobs)


# ---------------------------------------------------------------------------------------
# Batch parameters


def _raw_mask(raw: bool | Sequence[bool], n: int) -> Tensor:
    if isinstance(raw, bool):
        return torch.full((n,), raw, dtype=torch.bool)
    mask = torch.as_tensor(raw if isinstance(raw, Tensor) else list(raw), dtype=torch.bool)
    if mask.shape != (n,):
        raise ValueError(f"raw must be a bool or {n} bools, got {len(mask)}")
    return mask


def _raw(logits: Tensor) -> Processed:
    x = logits.to(torch.float32)
    _check_finite(x.amax(1))
    logprobs = torch.log_softmax(x, dim=1)
    return Processed(logprobs.exp(), logprobs)


class _Batch:
    """Rows grouped by request (rows of one request share its parameters and prompt), with
    per-row parameter tensors."""

    def __init__(self, rows: Sequence[Row], vocab: int, device: torch.device):
        self.rows, self.vocab, self.device = rows, vocab, device
        index: dict[int, int] = {}
        self.requests: list[RequestSampling] = []
        row_req: list[int] = []
        for row in rows:
            u = index.get(id(row.request))
            if u is None:
                u = index[id(row.request)] = len(self.requests)
                self.requests.append(row.request)
            row_req.append(u)
        self.row_req = torch.tensor(row_req, dtype=torch.long, device=device)
        lens = [len(r.output_ids) for r in rows]
        self.out_lens = torch.tensor(lens, dtype=torch.long, device=device)
        self._rows_of = None
        for req in self.requests:
            _check_vocab(req, vocab)

    def rows_of(self, u: int) -> Tensor:
        """Row indices of unique request u."""
        if self._rows_of is None:
            order = torch.argsort(self.row_req, stable=True)
            counts = torch.bincount(self.row_req, minlength=len(self.requests)).tolist()
            self._rows_of = list(torch.split(order, counts))
        return self._rows_of[u]

    def param(self, get, dtype=torch.float32) -> Tensor:
        """Per-row tensor of get(params)."""
        values = [get(r.params) for r in self.requests]
        per_req = torch.tensor(values, dtype=dtype, device=self.device)
        return per_req[self.row_req]

    def pairs(self, wanted) -> tuple[Tensor, Tensor, list[int]]:
        """(row, token) index pairs of wanted(request) -> token ids, over each request's
        rows; also the request index of each pair's block, for per-request values."""
        rs, ts, reqs = [], [], []
        for u, req in enumerate(self.requests):
            toks = wanted(req)
            if not toks:
                continue
            rows = self.rows_of(u)
            t = torch.as_tensor(toks, dtype=torch.long, device=self.device)
            rs.append(rows.repeat_interleave(len(t)))
            ts.append(t.repeat(len(rows)))
            reqs.append(u)
        if not rs:
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            return empty, empty, []
        return torch.cat(rs), torch.cat(ts), reqs

    def output_pairs(self, row_mask: Tensor) -> tuple[Tensor, Tensor]:
        """(row, token) for every output token of the selected rows (with repeats)."""
        sel = row_mask.nonzero().squeeze(1)
        ids = list(itertools.chain.from_iterable(self.rows[i].output_ids for i in sel.tolist()))
        toks = torch.tensor(ids, dtype=torch.long, device=self.device)
        return sel.repeat_interleave(self.out_lens[sel]), toks


def _check_vocab(req: RequestSampling, vocab: int) -> None:
    p = req.params
    fields = {
        "allowed_token_ids": p.allowed_token_ids or (),
        "logit_bias": (p.logit_bias or {}).keys(),
        "stop_token_ids": p.stop_token_ids,
        "eos_token_ids": req.eos_token_ids,
        "bad_words": itertools.chain.from_iterable(req.bad_words_ids),
    }
    for name, ids in fields.items():
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = [t for t in ids if not 0 <= t < vocab]
            raise RequestError(
                f"{name} must be token ids in [0, {vocab}), got {bad[:5]}", param=name
            )


def _check_finite(row_max: Tensor) -> None:
    bad = ~torch.isfinite(row_max)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"logits row {i} has no finite maximum ({float(row_max[i])}): the model produced "
            "NaN/inf, or -inf at every token the request allows"
        )


# ---------------------------------------------------------------------------------------
# The pipeline


def _process(logits: Tensor, idx: Tensor | None, rows: Sequence[Row]) -> Processed:
    b = _Batch(rows, logits.shape[1], logits.device)
    z = _float_copy(logits, idx)
    _mask_allowed(z, b)
    _ban(z, *_bad_word_pairs(b))
    _ban(z, *_min_tokens_pairs(b))
    _add_logit_bias(z, b)
    _apply_penalties(z, b)
    row_max = z.amax(dim=1)
    _check_finite(row_max)

    temperature = b.param(lambda p: p.temperature)
    greedy = temperature < GREEDY_EPS
    g = greedy.nonzero().squeeze(1)
    greedy_tokens = _take(z, g).argmax(dim=1) if len(g) else None  # of the penalised logits
    if not (temperature == 1).all():
        divisor = temperature.masked_fill(greedy, 1.0)  # greedy logprobs: temperature 1
        z.div_(divisor.unsqueeze(1))
        row_max = row_max / divisor  # division is monotonic: still each row's max
    probs, total = _filter(z, b, greedy, row_max)

    logprobs = z.sub_((row_max + total.log()).unsqueeze(1))
    probs.div_(total.unsqueeze(1))
    if greedy_tokens is not None:
        probs.index_fill_(0, g, 0.0)
        probs[g, greedy_tokens] = 1.0
    return Processed(probs, logprobs)


def _filter(z: Tensor, b: _Batch, greedy: Tensor, row_max: Tensor) -> tuple[Tensor, Tensor]:
    """min_p, top-k, top-p on the tempered logits `z` (in place). Returns the unnormalised
    probabilities exp(z - max) of what is kept, and their row sums."""
    vocab = z.shape[1]
    min_p = b.param(lambda p: p.min_p).masked_fill(greedy, 0.0)
    top_k = b.param(lambda p: p.top_k, torch.long)
    top_p = b.param(lambda p: p.top_p).masked_fill(greedy, 1.0)
    use_k = (top_k > 0) & (top_k < vocab) & ~greedy
    # Each row's own window width: another row's top_k must not change how this row is cut.
    width = torch.where(use_k, top_k.clamp(min=TOP_P_WINDOW), TOP_P_WINDOW).clamp(max=vocab)
    win = _window(z, use_k | (top_p < 1), width)
    cut = _min_p_top_k_cut(min_p, top_k, use_k, row_max, win)
    if cut is not None:
        z.masked_fill_(z < cut.unsqueeze(1), NEG_INF)
    shifted = torch.sub(z, row_max.unsqueeze(1))
    # The flush costs three passes: only where some logit lies below EXP_FLOOR or a cut put
    # -inf in (torch.aminmax would find the lowest 40x slower than amin). Rows with none get
    # the same bits either way, so the batch's choice changes no row.
    if cut is not None or bool((shifted.amin(dim=1) < EXP_FLOOR).any()):
        probs = _exp_flushed(shifted)
    else:
        probs = shifted.exp_()
    total = vocab_sum(probs)
    p_rows = (top_p < 1).nonzero().squeeze(1)
    if len(p_rows):
        total = _filter_top_p(z, probs, total, top_p, p_rows, row_max, cut, win)
    return probs, total


# exp(x) for x below this is float32's denormal range or 0, where torch's vectorised exp
# runs 10-25x slower on CPU (measured on 151,936 logits: 0.07 ms in range, 0.7-1.8 ms
# below it), and a pruned draft head puts most of its vocabulary there. Such tokens hold
# under 1.6e-38 of the row's largest probability: they get exactly 0.
EXP_FLOOR = -87.0


def _exp_flushed(shifted: Tensor) -> Tensor:
    """exp of `shifted` (<= 0, overwritten) with exp(x) = 0 for x < EXP_FLOOR, elementwise
    (so batch invariant) and at the in-range speed."""
    flush = shifted < EXP_FLOOR
    return shifted.clamp_(min=EXP_FLOOR).exp_().masked_fill_(flush, 0.0)


def _float_copy(logits: Tensor, idx: Tensor | None) -> Tensor:
    """A float32 copy of the selected rows (ours to modify)."""
    x = logits if idx is None else logits[idx]  # indexing already copies
    if x is logits:
        return x.to(torch.float32, copy=True)
    return x.to(torch.float32)


def _mask_allowed(z: Tensor, b: _Batch) -> None:
    r, t, _ = b.pairs(lambda req: req.params.allowed_token_ids)
    if not len(r):
        return
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[r, t] = True
    restricted = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device)
    restricted[r] = True
    z.masked_fill_(restricted.unsqueeze(1) & ~keep, NEG_INF)


def _bad_word_pairs(b: _Batch) -> tuple[Tensor, Tensor]:
    """(row, token) to ban: the last token of each bad word whose other tokens end the
    row's output. A Python loop, but only over rows of requests that have bad words."""
    rs: list[int] = []
    ts: list[int] = []
    for u, req in enumerate(b.requests):
        if not req.bad_words_ids:
            continue
        for i in b.rows_of(u).tolist():
            out = b.rows[i].output_ids
            for word in req.bad_words_ids:
                k = len(word) - 1
                if k <= len(out) and tuple(out[len(out) - k :]) == word[:-1]:
                    rs.append(i)
                    ts.append(word[-1])
    return _long(rs, b.device), _long(ts, b.device)


def _min_tokens_pairs(b: _Batch) -> tuple[Tensor, Tensor]:
    def stops(req: RequestSampling):
        if not req.params.min_tokens:
            return None
        return list(req.params.stop_token_ids) + list(req.eos_token_ids)

    r, t, _ = b.pairs(stops)
    if not len(r):
        return r, t
    short = b.out_lens[r] < b.param(lambda p: p.min_tokens, torch.long)[r]
    return r[short], t[short]


def _ban(z: Tensor, r: Tensor, t: Tensor) -> None:
    """Set z[r, t] = -inf, except in rows where that would leave no finite logit."""
    if not len(r):
        return
    saved = z[r, t]
    z[r, t] = NEG_INF
    rows = torch.unique(r)
    dead = rows[_take(z, rows).amax(dim=1) == NEG_INF]  # no copy when every row bans
    if len(dead):
        undo = torch.isin(r, dead)
        z[r[undo], t[undo]] = saved[undo]


def _add_logit_bias(z: Tensor, b: _Batch) -> None:
    r, t, reqs = b.pairs(lambda req: list(req.params.logit_bias or ()))
    if not len(r):
        return
    # Same layout as the pairs: each row of request u gets u's biases, in dict order.
    bias = torch.cat([
        torch.tensor(list(b.requests[u].params.logit_bias.values())).repeat(len(b.rows_of(u)))
        for u in reqs
    ])
    z.index_put_((r, t), bias.to(z.device), accumulate=True)


def _apply_penalties(z: Tensor, b: _Batch) -> None:
    rep = b.param(lambda p: p.repetition_penalty)
    freq = b.param(lambda p: p.frequency_penalty)
    pres = b.param(lambda p: p.presence_penalty)
    if (rep != 1).any():
        _repetition(z, b, rep)
    counted = (freq != 0) | (pres != 0)
    if not counted.any():
        return
    r, t = b.output_pairs(counted)
    if not len(r):
        return
    key, count = torch.unique(r * z.shape[1] + t, return_counts=True)
    r, t = key // z.shape[1], key % z.shape[1]
    # Two subtractions, as vLLM does them (so its rounding, and its ties, are ours).
    z[r, t] = z[r, t] - freq[r] * count
    z[r, t] = z[r, t] - pres[r]


def _repetition(z: Tensor, b: _Batch, rep: Tensor) -> None:
    """Tokens seen in prompt or output: positive logits * (1 / r), others * r (vLLM's
    arithmetic)."""

    def prompt(req):
        return sorted(set(req.prompt_ids)) if req.params.repetition_penalty != 1 else None

    pr, pt, _ = b.pairs(prompt)
    orr, ot = b.output_pairs(rep != 1)
    r, t = _unique_pairs(torch.cat([pr, orr]), torch.cat([pt, ot]), z.shape[1])
    vals, pen = z[r, t], rep[r]
    z[r, t] = vals * torch.where(vals > 0, 1.0 / pen, pen)


class _Window(NamedTuple):
    """The largest logits of the rows that need top-k or top-p: one topk serves both."""

    vals: Tensor  # [n, W] logits after temperature, descending; -inf past the row's width
    idx: Tensor  # [n, W] their token ids (0 past the row's width)
    width: Tensor  # [n] the row's own width: max(TOP_P_WINDOW, its top_k), at most V
    pos: Tensor  # [R] row -> index into vals (-1: the row has no window)


def _window(z: Tensor, need: Tensor, width: Tensor) -> _Window | None:
    """One topk per distinct width, so a row's window is what it would be alone."""
    rows = need.nonzero().squeeze(1)
    if not len(rows):
        return None
    w = width[rows]
    widths = torch.unique(w).tolist()
    if len(widths) == 1:
        vals, idx = _take(z, rows).topk(widths[0], dim=1)
    else:
        vals = z.new_full((len(rows), widths[-1]), NEG_INF)
        idx = torch.zeros(len(rows), widths[-1], dtype=torch.long, device=z.device)
        for width_g in widths:
            g = (w == width_g).nonzero().squeeze(1)
            vals[g, :width_g], idx[g, :width_g] = z[rows[g]].topk(width_g, dim=1)
    pos = torch.full((z.shape[0],), -1, dtype=torch.long, device=z.device)
    pos[rows] = torch.arange(len(rows), device=z.device)
    return _Window(vals, idx, w, pos)


def _min_p_top_k_cut(
    min_p: Tensor, top_k: Tensor, use_k: Tensor, row_max: Tensor, win: _Window | None
) -> Tensor | None:
    """One cut per row: max(min_p cut, k-th largest logit); None if no row has either.
    Both cuts on the same logits equal vLLM's min_p followed by top-k on its output."""
    if not (min_p > 0).any() and not use_k.any():
        return None
    cut = row_max + torch.log(min_p)  # log 0 = -inf: no cut
    if use_k.any():
        rows = use_k.nonzero().squeeze(1)
        kth = win.vals[win.pos[rows]].gather(1, (top_k[rows] - 1).unsqueeze(1)).squeeze(1)
        cut[rows] = torch.maximum(cut[rows], kth)
    return cut


def _filter_top_p(
    z: Tensor,
    probs: Tensor,
    total: Tensor,
    top_p: Tensor,
    rows: Tensor,
    row_max: Tensor,
    cut: Tensor | None,
    win: _Window,
) -> Tensor:
    """Keep the smallest set of most probable tokens whose mass reaches p (plus ties).

    `probs` holds unnormalised exp(z - max) with row sums `total`; returns the new sums.
    Most rows of a language model reach p within their window (top TOP_P_WINDOW logits):
    no sort of the vocabulary. The other rows find their cut by a histogram."""
    total = total.clone()
    target = top_p[rows].double() * total[rows].double()
    local = win.pos[rows]
    vals, idx, width = win.vals[local], win.idx[local], win.width[local]
    floor = torch.full_like(row_max[rows], NEG_INF) if cut is None else cut[rows]
    in_window = (vals - row_max[rows].unsqueeze(1)).exp()
    in_window = in_window.masked_fill_(vals < floor.unsqueeze(1), 0.0)  # min_p / top-k cuts
    cum = in_window.double().cumsum(dim=1)  # zeros past a row's width add nothing
    last = torch.minimum((cum < target.unsqueeze(1)).sum(dim=1), width - 1)
    threshold = in_window.gather(1, last.unsqueeze(1)).squeeze(1)
    smallest = in_window.gather(1, (width - 1).unsqueeze(1)).squeeze(1)
    # The window holds the whole kept set, ties included, unless the cut is its last value.
    fast = (cum[:, -1] >= target) & (threshold > smallest) | (width == z.shape[1])
    if fast.any():
        f = fast.nonzero().squeeze(1)
        keep = in_window[f] >= threshold[f].unsqueeze(1)
        keep &= torch.arange(keep.shape[1], device=z.device) < width[f].unsqueeze(1)
        rf, idx_f = rows[f], idx[f]
        kept_p = torch.where(keep, probs[rf.unsqueeze(1), idx_f], 0.0)
        kept_z = z[rf.unsqueeze(1), idx_f]
        z.index_fill_(0, rf, NEG_INF)
        probs.index_fill_(0, rf, 0.0)
        at, col = keep.nonzero(as_tuple=True)
        z[rf[at], idx_f[at, col]], probs[rf[at], idx_f[at, col]] = kept_z[at, col], kept_p[at, col]
        total[rf] = row_sum(kept_p.double()).float()
    if not fast.all():
        s = (~fast).nonzero().squeeze(1)
        _top_p_by_histogram(z, probs, total, rows[s], target[s], top_p[rows[s]], row_max)
    return total


TOP_P_WINDOW = 64
BUCKETS = 1024


def _top_p_by_histogram(
    z: Tensor,
    probs: Tensor,
    total: Tensor,
    rows: Tensor,
    target: Tensor,
    p: Tensor,
    row_max: Tensor,
) -> None:
    """Top-p for rows whose kept set is large (flat distributions). Tokens are bucketed by
    log-probability between the row maximum and (1 - p) / V of the row's mass (all tokens
    below that hold less than 1 - p together, so the cut lies above it); only the bucket
    where the cumulative mass reaches the target is sorted."""
    pr, zr = _take(probs, rows), _take(z, rows)
    cut = (1 - p.double()) / z.shape[1] * total[rows].double()
    per_unit = (BUCKETS / -torch.log(cut)).float().unsqueeze(1)
    depth = (row_max[rows].unsqueeze(1) - zr).mul_(per_unit)  # -log(prob / max), in buckets
    bucket = depth.clamp_(max=BUCKETS).long()  # BUCKETS: below the cut, never kept
    mass = torch.zeros(len(rows), BUCKETS + 1, device=z.device).scatter_add_(1, bucket, pr)
    cum = mass.double().cumsum(dim=1)
    j = (cum < target.unsqueeze(1)).sum(dim=1).clamp(max=BUCKETS - 1)
    above = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    r, t = (bucket == j.unsqueeze(1)).nonzero(as_tuple=True)
    threshold = _sorted_threshold(pr[r, t], r, len(rows), target - above)
    drop = pr < threshold.unsqueeze(1)
    zr.masked_fill_(drop, NEG_INF)
    pr.masked_fill_(drop, 0.0)
    if pr is not probs:
        z[rows], probs[rows] = zr, pr
    total[rows] = vocab_sum(pr)


def _sorted_threshold(vals: Tensor, row: Tensor, n: int, target: Tensor) -> Tensor:
    """Per row, the value at which the descending cumulative sum of `vals` (grouped by
    ascending `row`) first reaches `target`. A row that misses the target by rounding lands
    on the zero after its own values: it keeps everything (whatever the other rows hold)."""
    counts = torch.bincount(row, minlength=n)
    desc = _pad_by_row(vals, row, n, counts).sort(dim=1, descending=True).values
    reached = desc.double().cumsum(dim=1) < target.unsqueeze(1)
    last = torch.minimum(reached.sum(dim=1), counts)
    return desc.gather(1, last.unsqueeze(1)).squeeze(1)


# ---------------------------------------------------------------------------------------
# Small tensor helpers


def _take(x: Tensor, rows: Tensor) -> Tensor:
    """x[rows], without a copy when rows are all of x's rows (in order)."""
    return x if len(rows) == x.shape[0] else x[rows]


def _long(values: list[int], device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _unique_pairs(r: Tensor, t: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    key = torch.unique(r * vocab + t)
    return key // vocab, key % vocab


def _pad_by_row(vals: Tensor, row: Tensor, n: int, counts: Tensor) -> Tensor:
    """Scatter values (grouped by ascending row) into an [n, max count + 1] zero-padded
    tensor: every row ends with at least one zero."""
    width = (int(counts.max()) if len(counts) else 0) + 1
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(len(row), device=row.device) - starts[row]
    out = torch.zeros(n, width, dtype=vals.dtype, device=vals.device)
    out[row, pos] = vals
    return out


def row_sum(x: Tensor) -> Tensor:
    """Sum of each row of x [R, C] in a fixed order: a pairwise tree over the columns,
    zero-padded to a power of two (column i + P/2 is added to column i, P halving).

    torch's `sum` splits a long row between threads when a single row is reduced, so its
    rounding depends on the batch and the thread count. Elementwise additions round the
    same on every path, so this sum is bitwise the same for a row alone or in any batch,
    with any number of threads and any zero padding on the right. It allocates [R, C / 2]:
    for rows of the whole vocabulary use `vocab_sum`."""
    rows, w = x.shape
    if w <= 1:
        return x.sum(dim=1) if w else x.new_zeros(rows)
    span = 1 << (w - 1).bit_length()  # the padded width
    half = span // 2
    acc = x[:, :half].clone()
    acc[:, : w - half] += x[:, half:w]
    w = half
    while w > 1:
        half = w // 2
        acc[:, :half] += acc[:, half:w]
        w = half
    return acc[:, 0].clone()


SUM_BLOCK = 1024


def vocab_sum(x: Tensor) -> Tensor:
    """Sum of each row of x [R, V] in an order fixed by V alone: sums of consecutive blocks
    of SUM_BLOCK columns, then `row_sum` over the block sums and the tail's.

    A block sum is one output of a reduction with at least two outputs per row, which torch
    never splits between threads (it splits the outputs), so each block is summed by one
    thread in one fixed order, alone or in any batch; the rest is elementwise. Unlike
    `row_sum`, no copy of the rows is made."""
    rows, w = x.shape
    n = w // SUM_BLOCK
    if n < 2:
        return row_sum(x)
    blocks = x[:, : n * SUM_BLOCK].unfold(1, SUM_BLOCK, SUM_BLOCK).sum(dim=2)  # [R, n]
    if n * SUM_BLOCK < w:
        blocks = torch.cat([blocks, row_sum(x[:, n * SUM_BLOCK :]).unsqueeze(1)], dim=1)
    return row_sum(blocks)
