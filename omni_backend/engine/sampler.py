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
a seeded row's generator advances by V draws per step, so its stream is the old one (see _SeededNoise for how the
CPU avoids drawing all V). Unseeded rows (the device's default generator) only need the same distribution.

How it avoids sorting the vocabulary (issue #14). Everything runs with torch ops on the logits' device; the
host receives the token ids, the rows still to redo and the requested logprobs in one transfer, and more only
when a row must be redone.
- The kept ranks form a prefix of the ranking (the top-k, top-p and min-p drops are monotone in rank), so a
  row is finished from its K best tokens when top_k <= K or when its rank K - 1 is dropped. The K best come
  from an exact two-stage top-k (top_candidates); their values are the first K of the sorted values. K starts
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

Non-finite logits (a NaN anywhere in a row, a +inf, or no finite value: a broken model or kernel, never a sampling
setting) fail only their row: SampleResult.failed names it and the engine ends that request with an error. Such a
row's token is a placeholder, and every index drawn for it stays inside the vocabulary: a NaN cumulative mass can
make searchsorted return one past the end, which gathered on CUDA is a device-side assert that ends the process
(every request of the stage with it). Its redo status is 0, so no pass loops on it. The check is one max per row
over the logits (0.45 ms at [64, 49152] on one CPU thread; microseconds on a GPU), fetched with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_backend.engine.penalties import apply_penalties
from omni_backend.engine.sampling_ops import (argmax, exp_sums, put_rows, row_blocks, take_rows, to_device, to_host,
                                               top_candidates)
from omni_backend.engine.sampling_params import SamplingParams
from omni_backend.engine.sequence import Sequence

FIRST_CANDIDATES = 64
"""Candidates per row in the first pass; the batch's largest top_k raises it. At T 0.8 and top_p 0.9 about 4 % of
real SmolLM2 next-token distributions keep more than 64 tokens (scripts/bench_sampler.py)."""
GROWTH = 16
"""A row whose kept set goes past its K candidates is redone with GROWTH * K candidates or more, and with the
full sort once that would reach V / 4 (a topk that large costs about as much as sorting)."""


@dataclass
class SampleResult:
    """Per-row outcome. token_ids [B] int64; logprobs: per row None or (chosen logprob, [(id, logprob)]);
    failed: the rows whose logits were not finite (NaN, +inf, or no finite value), whose token is a placeholder."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    failed: list[int] = field(default_factory=list)


class Sampler:
    """Samples one token per row of a logits matrix for the given sequences. Stateless: a seeded request's
    generator lives on its Sequence (made on first use, on the logits' device)."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """`sample`, leaving every seeded sequence's generator as it was when it raises: the engine retries a step
        that ran out of device memory, and the retry must draw the seeded rows' tokens from the same state
        (the noise is drawn before the passes that can run out of memory)."""
        saved = [(seq, None if seq.generator is None else seq.generator.get_state())
                 for seq in seqs if seq.params.seed is not None]
        try:
            return self.sample(logits, seqs)
        except BaseException:
            for seq, state in saved:
                if state is None:
                    seq.generator = None  # made in the failed call: the retry makes it again from the seed
                else:
                    seq.generator.set_state(state)
            raise

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """Sample one token per row.

        Args:
            logits: [B, V] float32 (other float dtypes are upcast) on the engine's device, CPU or CUDA; row i
                belongs to seqs[i]. Not modified.
            seqs: the B sequences; their params say how to sample, their tokens feed the penalties. A seeded
                sequence without a generator gets `torch.Generator(device=logits.device).manual_seed(seed)`,
                which then advances V draws per sampled step and survives preemption with the sequence.
        Returns:
            SampleResult: token ids, and for rows that asked for logprobs the chosen token's logprob and the
            top-n (id, logprob) pairs, natural log, from log_softmax of the raw (unpenalized) logits; the rows
            with non-finite logits in `failed` (see the module docstring).
        """
        logits = logits.float().contiguous()
        params = [s.params for s in seqs]
        finite = logits.amax(dim=-1).isfinite()  # amax propagates a NaN; +inf or an all -inf row is not finite
        penalized = apply_penalties(logits, seqs)
        token_ids = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        greedy = [row for row, p in enumerate(params) if p.greedy]
        if greedy:
            put_rows(token_ids, greedy, argmax(take_rows(penalized, greedy)))
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        status = torch.empty(0, dtype=torch.int64, device=logits.device)
        if sampled:
            draw = _Draw(take_rows(penalized, sampled), [seqs[row] for row in sampled], take_rows(finite, sampled))
            tokens, status = draw.first_pass()
            put_rows(token_ids, sampled, tokens)
        logprobs = _Logprobs(logits, params)

        ids, finite, status, chosen, top_values, top_ids = to_host(
            token_ids, finite, status, logprobs.chosen(token_ids), logprobs.top_values, logprobs.top_ids)
        if any(status):
            rows, tokens = draw.finish(status)
            put_rows(token_ids, [sampled[i] for i in rows], tokens)
            ids, chosen = to_host(token_ids, logprobs.chosen(token_ids))
        return SampleResult([int(t) for t in ids], logprobs.per_row(chosen, top_values, top_ids),
                            [row for row, ok in enumerate(finite) if not ok])


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
        self.logits = take_rows(logits, self.rows)
        self.max = self.logits.amax(dim=-1, keepdim=True)
        self.log_sum = exp_sums(self.logits, self.max).log_().unsqueeze(1)
        if self.top_n:
            values, self.top_ids = top_candidates(self.logits, self.top_n)
            self.top_values = (values - self.max) - self.log_sum

    def chosen(self, token_ids: torch.Tensor) -> torch.Tensor:
        """float32 [w, 1]: each wanting row's logprob of its token (token_ids: int64 [B] on the device)."""
        if not self.rows:
            return torch.empty(0, device=token_ids.device)
        return (self.logits.gather(1, take_rows(token_ids, self.rows).unsqueeze(1)) - self.max) - self.log_sum

    def per_row(self, chosen: list[float], top_values: list[float], top_ids: list[float]) -> list:
        """SampleResult.logprobs from the fetched values: None, or (chosen, [(id, logprob)] of its top-n)."""
        out: list = [None] * len(self.params)
        for i, row in enumerate(self.rows):
            first, n = i * self.top_n, self.params[row].logprobs
            out[row] = (chosen[i], [(int(t), v) for t, v in zip(top_ids[first:first + n],
                                                                 top_values[first:first + n])])
        return out


class _Draw:
    """The sampled (not greedy) rows of one step: their settings on the device, the seeded rows' noise, and the
    passes that finish them (a first pass, then more candidates or the full sort for the rows that need it).

    Args:
        logits: penalized float32 [n, V] on the engine's device, row i for seqs[i].
        seqs: the n sequences (none greedy); seeded ones get their generator here on first use.
        finite: bool [n] on the device, False for a row whose logits are not finite (never redone).
    """

    def __init__(self, logits: torch.Tensor, seqs: list[Sequence], finite: torch.Tensor):
        self.logits = logits
        self.finite = finite
        self.device = logits.device
        self.vocab = vocab = logits.shape[1]
        params = [s.params for s in seqs]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        # top-p without top-k: the only rows whose prefix probabilities need the whole vocabulary's mass
        self.needs_mass = [k == vocab and p.top_p < 1.0 for p, k in zip(params, top_k)]
        self.settings = to_device([[p.temperature, k, p.top_p, p.min_p, p.seed is not None]
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
            put_rows(tokens, self.in_token_order, self._draw_in_token_order(self.in_token_order))
        for level, rows in self.first_levels.items():
            level_tokens, level_status = self._pass(rows, level)
            put_rows(tokens, rows, level_tokens)
            put_rows(status, rows, level_status)
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
            put_rows(tokens, [slot[i] for i in rows], level_tokens)
            if k < self.vocab:
                for i, s in zip(rows, to_host(level_status)[0]):
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
        x = take_rows(self.logits, rows)
        settings = take_rows(self.settings, rows)
        temperature, top_k, top_p, min_p, seeded = (settings[:, c:c + 1] for c in range(5))
        if k < self.vocab:
            values, ids = top_candidates(x, k)
            scaled = values / temperature  # = the first k of the sorted x / T: division by T > 0 keeps order
        else:
            scaled, ids = (x / temperature).sort(dim=-1, descending=True)
        ranks = torch.arange(k, device=self.device)
        probs = scaled.masked_fill(ranks >= top_k, float("-inf")).softmax(dim=-1)
        whole = [j for j, i in enumerate(rows) if self.needs_mass[i]] if k < self.vocab else []
        if whole:
            top = take_rows(scaled, whole)[:, :1]
            mass = exp_sums(take_rows(x, whole), top, take_rows(temperature, whole))
            put_rows(probs, whole, torch.exp(take_rows(scaled, whole) - top) / mass.unsqueeze(1))
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
            choice = torch.searchsorted(cdf, u, right=True).clamp_(max=k - 1)  # k for a NaN mass
        if with_seed:
            race = kept / self._noise(rows, k)
            won = argmax(race).unsqueeze(1)
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
        finite = take_rows(self.finite, rows)
        status = torch.where(more & finite, grow.clamp(max=self.vocab).long(), 0)
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
        redo = (tie | (close & (top_k.squeeze(1) >= self.vocab))) & (seeded.squeeze(1) > 0) & finite
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
            put_rows(noise, [j for j, _ in seeded], own)
        return noise

    def _draw_in_token_order(self, rows: list[int]) -> torch.Tensor:
        """Unseeded rows without truncation: invert the CDF of softmax(x / T) in token order with one uniform
        per row (exact sampling without ranking the vocabulary or drawing noise per token).

        Returns int64 [m] token ids.
        """
        x = take_rows(self.logits, rows)
        temperature = take_rows(self.settings, rows)[:, :1]
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        for block, cdf in row_blocks(x):
            torch.div(x[block], temperature[block], out=cdf)
            cdf.sub_(cdf.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)  # unnormalized
            u = torch.rand(cdf.shape[0], 1, device=self.device) * cdf[:, -1:]  # < cdf[-1], as in _pass
            tokens[block] = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=self.vocab - 1)
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
