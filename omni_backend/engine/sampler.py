"""Batched token sampling on the logits' device: penalties, temperature, top-k, top-p, min-p, seeded draws,
logprobs.

Order of logit processing follows Hugging Face `generate` / vLLM: penalties on raw logits, then temperature,
then top-k, top-p (Holtzman et al., "The Curious Case of Neural Text Degeneration", 2019) and min-p
(Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024). Penalties: repetition (CTRL, Keskar et al.
2019: positive logits divided, negative multiplied, over prompt and output tokens), presence and frequency
(OpenAI API semantics, over output tokens). A draw is argmax(p / E) with E ~ Exp(1) per token, which samples
from p exactly (the exponential race / Gumbel-max trick); E comes from the request's own generator when it
has a seed, so its tokens do not depend on what else is in the batch.

Semantics (those of the sampler before issue #14, kept in tests/engine/sampler_reference.py): a greedy row
(temperature below 1e-5, `GREEDY_TEMPERATURE`, or top_k 1) takes the argmax of its penalized logits. A sampled
row ranks the vocabulary by descending scaled logit x / T, masks ranks >= top_k, softmaxes, drops every rank
whose preceding mass reaches top_p (rank 0 always stays) and every rank with p < min_p * p_max, and takes the
rank that wins the race argmax(p_r / E_r), E_r being the r-th of V exponentials drawn from the row's generator:
a seeded row's generator advances by V draws per step, so its stream is the old one (see _SeededNoise for how the CPU avoids
drawing all V). Unseeded rows (the device's default generator) only need the same distribution.

How it avoids sorting the vocabulary (issue #14). Everything runs with torch ops on the logits' device; the
host receives the token ids, the rows still to redo and the requested logprobs in one transfer, and more only
when a row must be redone.
- The kept ranks form a prefix of the ranking (the top-k, top-p and min-p drops are monotone in rank), so a
  row is finished from its K best tokens when top_k <= K or when its rank K - 1 is dropped. The K best come
  from an exact two-stage top-k (_top_candidates); their values are the first K of the sorted values. K starts
  at max(64, the batch's largest top_k below V / 4); the other rows are redone with 16 times more candidates
  (a top-p row at least as many as the mass of its K implies), then with the reference's full sort once K
  would reach V / 4.
- Probabilities on the prefix: the softmax of the masked prefix equals the first K entries of the softmax of
  the masked sorted row bit for bit (masked ranks add zeros), so rows with top_k <= K get the reference's
  probabilities. A top-p row without top-k also needs the normalizer Z = sum over all V of exp(x / T - max),
  one pass over the vocabulary; min-p and the race only compare probabilities within a row, so other rows need
  no Z.
- Rows without any truncation: unseeded ones are drawn in token order by inverting the CDF of the full softmax
  (no noise, no ranking); seeded ones need the ranking, i.e. the full sort, as before.
- Unseeded rows in a ranked pass invert the CDF of their kept probabilities with one uniform each: no noise
  per candidate.

Exactness for seeded rows (the reference's tokens on the CPU): the candidates' values, the masked softmax (when
top_k <= K), the cumulative mass, the drops and the race are the same float32 operations on the same values
in the same order as the reference's, and the noise is the same by rank, so the chosen rank is the
reference's. Where that argument does not hold, the row is redone with the reference's own sort:
- Ties. The reference's sort is not stable, so which of several tokens with an equal scaled logit sits at a
  rank is its sort's business: redone when the chosen value equals a neighbour's (or is the last candidate).
- Rows without top-k. Their probabilities are not the reference's bits: its Z is a float32 sum over the sorted
  row, off by up to 1.3e-5 relatively on real SmolLM2 rows (ours, summed by blocks, 2e-6). Without a guard a
  top-p row's kept count differed in 0.7 % of (row, top_p) pairs; so a row is redone when any decision is
  within a margin of flipping: a mass before a rank within 1e-4 * top_p of top_p, a probability within 1e-6
  of min_p * p_max, the race's two best within 1e-6 (about 1 % of seeded top-p rows on real logits).
Rows redone with the full sort are the reference's computation. Unseeded rows sample from the same
distribution as the reference (not the same stream).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence

FIRST_CANDIDATES = 64
"""Candidates per row in the first pass; the batch's largest top_k raises it. At T 0.8 and top_p 0.9 about 4 % of
real SmolLM2 next-token distributions keep more than 64 tokens (scripts/bench_sampler.py)."""
GROWTH = 16
"""A row whose kept set goes past its K candidates is redone with GROWTH * K candidates or more, and with the
full sort once that would reach V / 4 (a topk that large costs about as much as sorting)."""
CPU_BLOCK_ELEMENTS = 1 << 19
"""On the CPU a pass over whole vocabularies goes over blocks of rows of about this many float32 (2 MiB, a core's
L2 here) in one buffer allocated per pass: the normalizer of [64, 128256] took 3-4 ms that way against 13.6 ms
for the batch at once, and a fresh buffer per block cost as much again."""


@dataclass
class SampleResult:
    """Per-row outcome. token_ids [B] int64; logprobs: per row None or (chosen logprob, [(id, logprob)])."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Samples one token per row of a logits matrix for the given sequences. Stateless: a seeded request's
    generator lives on its Sequence (made on first use, on the logits' device)."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """Sample one token per row.

        Args:
            logits: [B, V] float32 (other float dtypes are upcast) on the engine's device, CPU or CUDA; row i
                belongs to seqs[i]. Not modified.
            seqs: the B sequences; their params say how to sample, their tokens feed the penalties. A seeded
                sequence without a generator gets `torch.Generator(device=logits.device).manual_seed(seed)`,
                which then advances V draws per sampled step and survives preemption with the sequence.
        Returns:
            SampleResult: token ids, and for rows that asked for logprobs the chosen token's logprob and the
            top-n (id, logprob) pairs, natural log, from log_softmax of the raw (unpenalized) logits.
        """
        logits = logits.float().contiguous()
        params = [s.params for s in seqs]
        penalized = apply_penalties(logits, seqs)
        token_ids = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        greedy = [row for row, p in enumerate(params) if p.greedy]
        if greedy:
            _put(token_ids, greedy, _argmax(_rows(penalized, greedy)))
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        status = torch.empty(0, dtype=torch.int64, device=logits.device)
        if sampled:
            draw = _Draw(_rows(penalized, sampled), [seqs[row] for row in sampled])
            tokens, status = draw.first_pass()
            _put(token_ids, sampled, tokens)
        logprobs = _Logprobs(logits, params)

        ids, status, chosen, top_values, top_ids = _to_host(token_ids, status, logprobs.chosen(token_ids),
                                                            logprobs.top_values, logprobs.top_ids)
        if any(status):
            rows, tokens = draw.finish(status)
            _put(token_ids, [sampled[i] for i in rows], tokens)
            ids, chosen = _to_host(token_ids, logprobs.chosen(token_ids))
        return SampleResult([int(t) for t in ids], logprobs.per_row(chosen, top_values, top_ids))


class _Logprobs:
    """Log-probabilities of the raw logits for the rows that ask for them, on the device until fetched:
    log p = (x - max) - log(sum exp(x - max)), as log_softmax computes them, for the chosen token and the top-n
    only (no [w, V] log_softmax is materialized).

    Args:
        logits: float32 [B, V], unpenalized, contiguous.
        params: the B rows' settings; row i wants logprobs when params[i].logprobs is not None.
    Attributes:
        top_values: float32 [w, n], top_ids: int64 [w, n]: the n best per wanting row, n = the largest
            requested top-n (empty when n is 0).
    """

    def __init__(self, logits: torch.Tensor, params: list[SamplingParams]):
        self.params = params
        self.rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        self.top_n = max((params[row].logprobs for row in self.rows), default=0)
        self.top_values = self.top_ids = torch.empty(0, device=logits.device)
        if not self.rows:
            return
        self.logits = _rows(logits, self.rows)
        self.max = self.logits.amax(dim=-1, keepdim=True)
        self.log_sum = _exp_sums(self.logits, self.max).log_().unsqueeze(1)
        if self.top_n:
            values, self.top_ids = _top_candidates(self.logits, self.top_n)
            self.top_values = (values - self.max) - self.log_sum

    def chosen(self, token_ids: torch.Tensor) -> torch.Tensor:
        """float32 [w, 1]: each wanting row's logprob of its token (token_ids: int64 [B] on the device)."""
        if not self.rows:
            return torch.empty(0, device=token_ids.device)
        return (self.logits.gather(1, _rows(token_ids, self.rows).unsqueeze(1)) - self.max) - self.log_sum

    def per_row(self, chosen: list[float], top_values: list[float], top_ids: list[float]) -> list:
        """SampleResult.logprobs from the fetched values: None, or (chosen, [(id, logprob)] of its top-n)."""
        out: list = [None] * len(self.params)
        for i, row in enumerate(self.rows):
            first, n = i * self.top_n, self.params[row].logprobs
            out[row] = (chosen[i], [(int(t), v) for t, v in zip(top_ids[first:first + n],
                                                                 top_values[first:first + n])])
        return out


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, vectorized over the rows that ask for them.

    Args:
        logits: float32 [B, V] on any device; row i belongs to seqs[i]. Not modified.
        seqs: the B sequences (their params and tokens).
    Returns:
        `logits` itself when no row asks, else a penalized copy [B, V]: with a repetition penalty r != 1 each
        distinct token of the prompt and output becomes x / r if x > 0 else x * r (CTRL); then, with a presence
        or frequency penalty, each distinct generated token becomes x - (frequency * count + presence), count =
        its occurrences in the output (OpenAI). The float32 operations are the pre-#14 sampler's, so the result
        is the same bit for bit.
    """
    vocab = logits.shape[1]
    repeated = [row for row, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    counted = [row for row, s in enumerate(seqs)
               if (s.params.presence_penalty or s.params.frequency_penalty) and s.num_output_tokens]
    if not repeated and not counted:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)
    if repeated:
        positions, owner, _ = _token_positions([seqs[row].token_ids for row in repeated], repeated, vocab,
                                               logits.device)
        penalty = _to_device([seqs[row].params.repetition_penalty for row in repeated], torch.float32,
                             logits.device)[owner]
        values = flat[positions]
        flat[positions] = torch.where(values > 0, values / penalty, values * penalty)
    if counted:
        positions, owner, count = _token_positions([seqs[row].output_token_ids for row in counted], counted,
                                                   vocab, logits.device)
        weights = _to_device([[seqs[row].params.frequency_penalty, seqs[row].params.presence_penalty]
                              for row in counted], torch.float32, logits.device)[owner]
        flat[positions] = flat[positions] - (weights[:, 0] * count.to(torch.float32) + weights[:, 1])
    return logits


def _token_positions(token_lists: list[list[int]], rows: list[int], vocab: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of the given token lists, built on the host and sent in one copy.

    Returns:
        positions: int64 [n], row * vocab + token into the flattened [B, V] logits (rows[i] for token_lists[i]);
        owner: int64 [n], the index i of the list each position comes from;
        count: int64 [n], occurrences of the token in its list.
    """
    lengths = torch.tensor([len(tokens) for tokens in token_lists])
    owner = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    keys = owner * vocab + torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    keys, count = torch.unique(keys, return_counts=True)
    owner = keys // vocab
    positions = torch.tensor(rows)[owner] * vocab + keys % vocab
    moved = _to_device(torch.stack([positions, owner, count]), torch.int64, device)
    return moved[0], moved[1], moved[2]


class _Draw:
    """The sampled (not greedy) rows of one step: their settings on the device, the seeded rows' noise, and the
    passes that finish them (a first pass, then more candidates or the full sort for the rows that need it).

    Args:
        logits: penalized float32 [n, V] on the engine's device, row i for seqs[i].
        seqs: the n sequences (none greedy); seeded ones get their generator here on first use.
    """

    def __init__(self, logits: torch.Tensor, seqs: list[Sequence]):
        self.logits = logits
        self.device = logits.device
        self.vocab = vocab = logits.shape[1]
        params = [s.params for s in seqs]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # top-p without top-k: the only rows whose prefix probabilities need the whole vocabulary's mass
        self.needs_mass = [k == vocab and p.top_p < 1.0 for p, k in zip(params, top_k)]
        self.settings = _to_device([[p.temperature, k, p.top_p, p.min_p, p.seed is not None]
                                    for p, k in zip(params, top_k)], torch.float32, self.device)
        self.k = self._capped(max([FIRST_CANDIDATES] + [k for k in top_k if k < vocab // 4]))
        truncated = [k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p, k in zip(params, top_k)]
        self.in_token_order = [i for i, p in enumerate(params) if not truncated[i] and p.seed is None]
        self.first_levels: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if truncated[i] or p.seed is not None:
                level = self.k if truncated[i] and (top_k[i] <= self.k or top_k[i] == vocab) else vocab
                self.first_levels.setdefault(level, []).append(i)

        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        self.noise_row = {i: j for j, i in enumerate(seeded)}
        for i in seeded:
            if seqs[i].generator is None:
                seqs[i].generator = torch.Generator(device=self.device).manual_seed(seqs[i].params.seed)
        first = {i: level for level, rows in self.first_levels.items() for i in rows}
        self.seeded_noise = _SeededNoise([seqs[i].generator for i in seeded], [first[i] for i in seeded], vocab,
                                         self.device)

    def _capped(self, k: int) -> int:
        """Candidates for a pass: k, or the whole vocabulary (the full sort) once k reaches V / 4."""
        return k if k < self.vocab // 4 else self.vocab

    def _level(self, count: int) -> int:
        """Candidates for a redo that needs at least `count`: the smallest first-pass K times a power of GROWTH
        that holds them (capped), so that redone rows share few passes."""
        level = self.k
        while level < count:
            level *= GROWTH
        return self._capped(level)

    def first_pass(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw every row once.

        Returns:
            tokens: int64 [n], the token drawn per row (final where the status is 0);
            status: int64 [n], per row 0 when done, else how many candidates its redo needs at least (V: the
                full sort).
        """
        n = self.logits.shape[0]
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        status = torch.zeros(n, dtype=torch.int64, device=self.device)
        if self.in_token_order:
            _put(tokens, self.in_token_order, self._draw_in_token_order(self.in_token_order))
        for level, rows in self.first_levels.items():
            level_tokens, level_status = self._pass(rows, level)
            _put(tokens, rows, level_tokens)
            _put(status, rows, level_status)
        return tokens, status

    def finish(self, status: list[float]) -> tuple[list[int], torch.Tensor]:
        """Redo the rows that the first pass left unfinished until every one is done.

        Args:
            status: the first pass's status per row, on the host.
        Returns:
            (indices of the redone rows among the n, int64 [len] their tokens on the device).
        """
        redone = [i for i, s in enumerate(status) if s]
        slot = {i: j for j, i in enumerate(redone)}
        tokens = torch.empty(len(redone), dtype=torch.int64, device=self.device)
        pending: dict[int, list[int]] = {}
        for i in redone:
            pending.setdefault(self._level(int(status[i])), []).append(i)
        while pending:
            k, rows = pending.popitem()
            level_tokens, level_status = self._pass(rows, k)
            _put(tokens, [slot[i] for i in rows], level_tokens)
            if k < self.vocab:
                for i, s in zip(rows, _to_host(level_status)[0]):
                    if s:
                        pending.setdefault(self._level(int(s)), []).append(i)
        return redone, tokens

    def _pass(self, rows: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw the given rows from their k best candidates; k == V sorts like the reference. Seeded rows win the
        exponential race on their own noise; unseeded ones invert the CDF of their kept probabilities (one
        uniform per row, no noise per candidate).

        Returns:
            tokens int64 [m] and status int64 [m] for rows[0..m), as in first_pass (all done when k == V).
        """
        x = _rows(self.logits, rows)
        settings = _rows(self.settings, rows)
        temperature, top_k, top_p, min_p, seeded = (settings[:, c:c + 1] for c in range(5))
        if k < self.vocab:
            values, ids = _top_candidates(x, k)
            scaled = values / temperature  # = the first k of the sorted x / T: division by T > 0 keeps order
        else:
            scaled, ids = (x / temperature).sort(dim=-1, descending=True)
        ranks = torch.arange(k, device=self.device)
        probs = scaled.masked_fill(ranks >= top_k, float("-inf")).softmax(dim=-1)
        whole = [j for j, i in enumerate(rows) if self.needs_mass[i]] if k < self.vocab else []
        if whole:
            top = _rows(scaled, whole)[:, :1]
            mass = _exp_sums(_rows(x, whole), top, _rows(temperature, whole))
            _put(probs, whole, torch.exp(_rows(scaled, whole) - top) / mass.unsqueeze(1))
        # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays); min-p
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p) | (probs < min_p * probs[:, :1])
        drop[:, 0] = False
        kept = probs.masked_fill(drop, 0.0)
        with_seed = [j for j, i in enumerate(rows) if i in self.noise_row]
        if len(with_seed) < len(rows):
            cdf = kept.cumsum(dim=-1)
            # u < cdf[-1]: torch.rand < 1, and rounding u = r * c to nearest stays below c
            u = torch.rand(len(rows), 1, device=self.device) * cdf[:, -1:]
            choice = torch.searchsorted(cdf, u, right=True)
        if with_seed:
            race = kept / self._noise(rows, k)
            won = _argmax(race).unsqueeze(1)
            choice = won if len(with_seed) == len(rows) else torch.where(seeded > 0, won, choice)
        tokens = ids.gather(1, choice).squeeze(1)
        if k == self.vocab:
            return tokens, torch.zeros_like(tokens)
        # done when the kept prefix ends inside the candidates (top-k within them, or rank k - 1 dropped);
        # else redo with GROWTH times more, or, for a top-p row with the whole normalizer and no min-p, at least
        # k + 1 + (top_p - mass of the k) / p_(k-1) (every later rank has p <= p_(k-1))
        more = ~((top_k.squeeze(1) <= k) | drop[:, -1])
        grow = torch.full_like(mass_before[:, 0], k * GROWTH)
        bounded = (top_k >= self.vocab) & (top_p < 1.0) & (min_p == 0)
        need = k + 1 + (top_p - mass_before[:, -1:] - probs[:, -1:]) / probs[:, -1:]
        grow = torch.where(bounded.squeeze(1), torch.maximum(grow, need.squeeze(1).ceil()), grow)
        status = torch.where(more, grow.clamp(max=self.vocab).long(), 0)
        if not with_seed:
            return tokens, status
        # A seeded row is redone with the reference's sort when its token could differ from the reference's:
        # - the chosen value has an equal neighbour (or is the last candidate): the order among equal values is
        #   the reference's sort's;
        # - without top-k the probabilities are ours, not the reference's bits (our normalizer or the prefix's;
        #   the reference's float32 sum over the sorted row is off by up to 1.3e-5 relatively on real rows),
        #   so a decision within that of flipping: a mass before a rank within 1e-4 * top_p of top_p, a
        #   probability within 1e-6 of min_p * p_max, or the race's two best within 1e-6.
        value = scaled.gather(1, choice)
        tie = (((choice > 0) & (scaled.gather(1, (choice - 1).clamp(min=0)) == value))
               | (scaled.gather(1, (choice + 1).clamp(max=k - 1)) == value)).squeeze(1)
        best, second = race.topk(2, dim=-1).values.unbind(dim=1)
        close = (((mass_before - top_p).abs() <= 1e-4 * top_p).any(dim=-1)
                 | ((min_p > 0) & ((probs - min_p * probs[:, :1]).abs() <= 1e-6 * probs)).any(dim=-1)
                 | (second >= best * (1 - 1e-6)))
        redo = (tie | (close & (top_k.squeeze(1) >= self.vocab))) & (seeded.squeeze(1) > 0)
        return tokens, torch.where(redo, self.vocab, status)

    def _noise(self, rows: list[int], k: int) -> torch.Tensor:
        """Exp(1) noise [m, k] by rank for the race: a seeded row's first k of this step's V draws from its
        generator; ones for unseeded rows (they draw by CDF)."""
        seeded = [(j, self.noise_row[i]) for j, i in enumerate(rows) if i in self.noise_row]
        own = self.seeded_noise.ranks([s for _, s in seeded], k) if seeded else None
        if len(seeded) == len(rows):
            return own
        noise = torch.ones(len(rows), k, device=self.device)
        if seeded:
            _put(noise, [j for j, _ in seeded], own)
        return noise

    def _draw_in_token_order(self, rows: list[int]) -> torch.Tensor:
        """Unseeded rows without truncation: invert the CDF of softmax(x / T) in token order with one uniform
        per row (exact sampling without ranking the vocabulary or drawing noise per token).

        Returns int64 [m] token ids.
        """
        x = _rows(self.logits, rows)
        temperature = _rows(self.settings, rows)[:, :1]
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        for block, cdf in _blocks(x):
            torch.div(x[block], temperature[block], out=cdf)
            cdf.sub_(cdf.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)  # unnormalized
            u = torch.rand(cdf.shape[0], 1, device=self.device) * cdf[:, -1:]  # < cdf[-1], as in _pass
            tokens[block] = torch.searchsorted(cdf, u, right=True).squeeze(1)
        return tokens


class _SeededNoise:
    """This step's Exp(1) draws of the seeded rows, by rank: row j's r-th value is the r-th of V exponentials
    drawn from its generator, and every generator advances by V draws per step, as before #14 (on the CPU the
    very same stream).

    On the CPU only the ranks a pass uses are drawn: there `exponential_` is prefix-consistent (the first k of
    V draws equal a k-long draw) and takes one 64-bit draw per value, as float64 `uniform_` does, so the
    generator is moved past the other V - k values with `uniform_` (a third of the cost: 0.9 against 2.8 ms at
    V = 128256), and a longer prefix, for a row redone with more candidates, is drawn again from the state saved
    before. tests/engine/test_sampling.py pins both properties. On CUDA all V are drawn at once.

    Args:
        generators: one per seeded row, on `device`.
        first: per seeded row, how many ranks its first pass uses (V: all).
        vocab: V.
    """

    def __init__(self, generators: list[torch.Generator], first: list[int], vocab: int, device: torch.device):
        self.states: list[torch.Tensor | None] = []
        self.drawn: list[torch.Tensor] = []
        skip = torch.empty(vocab, dtype=torch.float64) if device.type == "cpu" else None
        for generator, k in zip(generators, first):
            if skip is None or k == vocab:
                self.states.append(None)
                self.drawn.append(torch.empty(vocab, device=device).exponential_(generator=generator))
            else:
                self.states.append(generator.get_state())
                self.drawn.append(torch.empty(k).exponential_(generator=generator))
                skip[:vocab - k].uniform_(generator=generator)

    def ranks(self, rows: list[int], k: int) -> torch.Tensor:
        """float32 [len(rows), k]: the first k draws of the given seeded rows."""
        for j in rows:
            if self.drawn[j].numel() < k:
                again = torch.Generator()
                again.set_state(self.states[j])
                self.drawn[j] = torch.empty(k).exponential_(generator=again)
        return torch.stack([self.drawn[j][:k] for j in rows])


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the first index of each row's maximum, by blocks of `width` tokens: the first block
    whose maximum is the row's, then the first index of the maximum inside it. Vectorized maxima instead of
    argmax's index-tracking loop (CPU, [64, 128256]: 0.84 against 7.0 ms; [64, 49152]: 0.39 against 2.7 ms).

    Args:
        x: float32 [m, V], contiguous.
    Returns:
        int64 [m]. A row holding a NaN gets 0 (argmax would give its first NaN).
    """
    rows, vocab = x.shape
    width = 128
    while vocab % width:
        width //= 2
    if width < 32:
        return x.argmax(dim=-1)
    blocks = x.view(rows, vocab // width, width)
    block_max = blocks.amax(dim=2)
    best = block_max.amax(dim=1, keepdim=True)
    first = (block_max == best).to(torch.uint8).argmax(dim=1)
    inside = (blocks[torch.arange(rows, device=x.device), first] == best).to(torch.uint8).argmax(dim=1)
    return first * width + inside


def _top_candidates(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row, in descending order.

    Args:
        x: float32 [m, V], contiguous; k <= V.
    Returns:
        (values float32 [m, k], token ids int64 [m, k]): the values are torch.topk's; among equal values the ids
        may come in another order.

    Two stages when V is large against k: view each row as `width` blocks of C = V / width tokens, take the
    maximum over the blocks for every group {g, g + C, g + 2C, ...}, keep the k groups with the largest maxima
    and take the top k of their k * width entries. Exact: an entry outside the kept groups is <= its group's
    maximum <= the k-th largest kept maximum, and the k kept maxima are k distinct kept entries. It reads the
    row once with a vectorized max and runs torch.topk's selection over V / width + k * width entries instead
    of V. width = the power of two at most sqrt(V / k) / 2 (measured best on one CPU thread: [64, 49152], k 64:
    width 8, 2.7 ms against 6.4 ms for torch.topk; [64, 128256]: width 16, 3.4 against 13.8 ms).
    """
    rows, vocab = x.shape
    width = 1 << max(0, int(math.log2(math.sqrt(vocab / k) / 2)))
    while vocab % width:
        width //= 2
    if width < 4:
        return x.topk(k, dim=-1)
    groups = vocab // width
    best = x.view(rows, width, groups).amax(dim=1).topk(k, dim=-1).indices
    candidates = (best.unsqueeze(2) + groups * torch.arange(width, device=x.device)).view(rows, k * width)
    values, picked = x.gather(1, candidates).topk(k, dim=-1)
    return values, candidates.gather(1, picked)


def _exp_sums(x: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """Per row sum over the vocabulary of exp(x / T - top) (exp(x - top) without a temperature): the softmax
    denominator relative to `top`, the row's largest (scaled) logit.

    Args:
        x: float32 [m, V]; top, temperature: float32 [m, 1].
    Returns:
        float32 [m].
    """
    out = torch.empty(x.shape[0], device=x.device)
    for block, scratch in _blocks(x):
        if temperature is None:
            torch.sub(x[block], top[block], out=scratch)
        else:
            torch.div(x[block], temperature[block], out=scratch).sub_(top[block])
        torch.sum(scratch.exp_(), dim=-1, out=out[block])
    return out


def _blocks(x: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """Row blocks of x [m, V] for a pass over whole vocabularies, each with a float32 scratch [rows, V]: one
    block on CUDA; on the CPU blocks of about CPU_BLOCK_ELEMENTS sharing one scratch buffer."""
    rows, vocab = x.shape
    size = rows if x.device.type == "cuda" else max(1, min(rows, CPU_BLOCK_ELEMENTS // vocab))
    scratch = torch.empty(size, vocab, device=x.device)
    return [(slice(start, start + size), scratch[:min(size, rows - start)]) for start in range(0, rows, size)]


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] along dim 0; t itself when rows are all of its rows in order."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, _to_device(rows, torch.int64, t.device))


def _put(t: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """t[rows] = values along dim 0."""
    if rows == list(range(t.shape[0])):
        t.copy_(values)
    else:
        t.index_copy_(0, _to_device(rows, torch.int64, t.device), values)


def _to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (nested lists or a CPU tensor) as a tensor on `device`; to CUDA through pinned memory, so the
    copy is queued behind the stream's work instead of waiting for it."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _to_host(*tensors: torch.Tensor) -> list[list[float]]:
    """The tensors' values as flat Python lists, in one device-to-host copy (packed as float64: exact for
    float32 values and for integers below 2**53)."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()])
        start += t.numel()
    return out
