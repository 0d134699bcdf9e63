"""MTP speculative decoding for the embedded engine: a mixin of `Engine` (split out of rollout/engine.py).

The MTP layer drafts up to `spec_drafts` tokens per row, one target forward verifies them; greedy acceptance at
temperature 0, rejection sampling above it (exact); returned log-probs are the target model's."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sampling import filtered_logits, sample

if TYPE_CHECKING:
    from .engine import GenRequest


class SpeculativeDecoding:
    """`Engine._speculate`: uses the engine's model, cache, slot bookkeeping and `_append` / `_stop_ids` / `_t`."""

    # ---- MTP speculative decoding ------------------------------------------------------------------
    # Invariant per slot: `_hidden[slot]` holds the main model's last-layer hidden state for every cached
    # position (aligned with slot_tokens); the MTP cache covers a prefix of the pairs (h_j, token_{j+1}).
    @torch.no_grad()
    def _speculate(self, reqs: list[GenRequest]) -> None:
        """One speculative step for every decoding request at once: batched MTP draft forwards (each row over its
        own MTP prefix, rows with fewer drafts drop out of the later chained steps), ONE target forward verifying
        every row's [c_n, d_1..d_k] (ragged: rows without drafts verify just c_n, i.e. decode plainly), acceptance
        per row, a per-row rollback of the rejected positions, and one transfer of the emitted tokens and their
        log-probs to the host. Greedy rows are decided on the device; sampled rows with drafts run the same
        sequential rejection test as ever on their own generator (its host syncs), so seeded requests draw the
        same random stream whatever they are batched with."""
        dev = self.device
        ctxs = [r.context() for r in reqs]
        ns = [len(c) - 1 for c in ctxs]  # newest confirmed token c_n of each row is not yet in the main cache
        ks = []
        for r, c in zip(reqs, ctxs):
            p = r.params
            k = min(self.spec_drafts, p.max_new_tokens - len(r.output_ids) - 1, self.max_len - len(c) - 1)
            if len(r.output_ids) < p.min_new_tokens and self._stop_ids(r):
                k = 0  # drafts could propose (and accept) a stop token too early: decode plainly, with it masked
            ks.append(max(k, 0))
        b, kmax = len(reqs), max(ks)
        spec = [i for i in range(b) if ks[i]]
        drafts = torch.zeros(b, kmax, dtype=torch.long, device=dev)
        qdist: dict[int, list[torch.Tensor]] = {i: [] for i in spec}
        if spec:
            # draft 1: MTP over each row's positions m..n-1 (right-padded), pairing h_j with c_{j+1}
            sslots = self._t([reqs[i].slot for i in spec])
            ms = [min(m, ns[i] - 1) for i, m in zip(spec, self.cache.mtp_lengths[sslots].tolist())]
            self.cache.mtp_lengths[sslots] = self._t(ms)
            widths = [ns[i] - m for i, m in zip(spec, ms)]
            w = max(widths)
            hid = torch.stack([torch.nn.functional.pad(self._hidden[reqs[i].slot][m : ns[i]], (0, 0, 0, w - n))
                               for i, m, n in zip(spec, ms, widths)])
            nxt = self._t([ctxs[i][m + 1 : ns[i] + 1] + [0] * (w - n) for i, m, n in zip(spec, ms, widths)])
            lg, g = self.model.mtp(hid, nxt, 0, cache=self.cache, slots=sslots, n_new=self._t(widths))
            last = self._t([n - 1 for n in widths])
            ar = torch.arange(len(spec), device=dev)
            logits, g = lg[ar, last], g[ar, last]
            rows = spec  # the rows still drafting; logits/g are theirs, in this order
            for step in range(kmax):
                d = logits.argmax(-1)
                for j, i in enumerate(rows):
                    p = reqs[i].params
                    if not p.greedy:
                        q = filtered_logits(logits[j], p).softmax(-1)
                        d[j] = torch.multinomial(q, 1, generator=reqs[i].gen)[0]
                        qdist[i].append(q)
                drafts[self._t(rows), step] = d
                keep = [j for j, i in enumerate(rows) if ks[i] > step + 1]
                if not keep:
                    break
                # chain: the MTP layer consumes its own previous hidden state
                sel = self._t(keep)
                rows = [rows[j] for j in keep]
                lg, gg = self.model.mtp(g[sel][:, None], d[sel][:, None], step + 1, cache=self.cache,
                                        slots=self._t([reqs[i].slot for i in rows]))
                logits, g = lg[:, 0], gg[:, 0]
        # verify every row's [c_n, d_1..d_k] in one target forward
        slots = self._t([r.slot for r in reqs])
        kt = self._t(ks)
        ids = torch.cat([self._t([c[-1] for c in ctxs])[:, None], drafts], 1)
        out = self.model.run(ids, cache=self.cache, slots=slots, n_new=kt + 1)
        tl = out.logits.float()
        masked = [(i, t) for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens
                  for t in self._stop_ids(r)]  # only rows without drafts (k = 0): as plain decoding masks them
        if masked:
            tl[self._t([i for i, _ in masked]), 0, self._t([t for _, t in masked])] = float("-inf")
        # greedy acceptance: the longest prefix of drafts equal to the target's argmax
        col = torch.arange(kmax, device=dev)
        match = (tl[:, :kmax].argmax(-1) == drafts) & (col[None, :] < kt[:, None])
        acc = match.long().cumprod(1).sum(1)
        bonus = torch.zeros(b, dtype=torch.long, device=dev)
        rejected = set()
        for i in spec:  # rejection sampling, row by row on the request's own generator
            r = reqs[i]
            p = r.params
            if p.greedy:
                continue
            a = 0
            for j in range(ks[i]):
                dj = int(drafts[i, j])
                pt = filtered_logits(tl[i, j], p).softmax(-1)
                q = qdist[i][j]
                if float(torch.rand((), generator=r.gen, device=dev)) < min(1.0, float(pt[dj] / q[dj])):
                    a += 1
                    continue
                resid = torch.clamp(pt - q, min=0)
                bonus[i] = torch.multinomial(resid / resid.sum(), 1, generator=r.gen)[0]
                rejected.add(i)
                break
            acc[i] = a
        # the token after the accepted drafts: the target's own sample there (argmax for greedy rows)
        rest = [i for i in range(b) if i not in rejected]
        if rest:
            at = self._t(rest)
            bonus[at] = sample(tl[at, acc[at]], [reqs[i].params for i in rest], [reqs[i].gen for i in rest])
        emitted = torch.cat([drafts, drafts.new_zeros(b, 1)], 1).scatter(1, acc[:, None], bonus[:, None])
        lp = tl.log_softmax(-1).gather(2, emitted[:, :, None])[:, :, 0]
        host = torch.cat([emitted.double(), lp.double(), acc.double()[:, None]], 1).tolist()  # the one transfer
        accs = [int(h[-1]) for h in host]
        keep = [n + 1 + a for n, a in zip(ns, accs)]  # c_n and the accepted drafts stay in the main cache
        self.cache.truncate(slots, self._t(keep))
        if spec:  # chained-draft rows beyond n-1 used MTP hiddens: recompute later
            self.cache.mtp_lengths[self._t([reqs[i].slot for i in spec])] = self._t([ns[i] for i in spec])
        for i, r in enumerate(reqs):
            n, a, c = ns[i], accs[i], ctxs[i]
            toks = [int(t) for t in host[i][: a + 1]]
            self.slot_tokens[r.slot] = self.slot_tokens[r.slot][:n] + [c[n]] + toks[:a]
            self._hidden[r.slot] = torch.cat([self._hidden[r.slot][:n], out.hidden[i, : a + 1]], 0)
            r.cached = keep[i]
        for i, r in enumerate(reqs):
            a = accs[i]
            emit = zip([int(t) for t in host[i][: a + 1]], host[i][kmax + 1 : kmax + 2 + a])
            if not ks[i]:  # no drafts: a plain decode step
                self._append(r, *next(emit))
                continue
            self.stats.spec_verifies += 1
            r.spec_verify += 1
            r.spec_accepted += a
            for tok, v in emit:
                self.stats.spec_emitted += 1
                if self._append(r, tok, v):
                    break
