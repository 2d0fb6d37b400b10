"""K policies replayed on real match sequences, without timing noise.

In drafter-invariant mode a request's text is its target-only text, whatever K, and the
draft's proposal at a position whose prefix is that text is fixed too (the same history,
the same Gumbel noise of (seed, position)). So one bit per position, "the draft proposes
the target's token here", decides every round of every K policy: a round at position t with
K proposals accepts the run of ones from t (at most K) and emits one more token. This module
computes those bits with the shipped engine (`match_bits`: target-only text, then the draft
teacher-forced through `run_draft`, the function the Draft deployment runs), and replays K
policies on them (`replay`) under one cost model: the adaptive-K cost table the engine
measured at load (`k_policy.Costs`, whole passes). Policies: the shipped one (a real
`Generation`'s `plan_k`; also with its evidence not fading, as before), each fixed K, and
an oracle that knows the bits (an upper bound for any policy). Their ratios to K = 0
compare how K is chosen, free of the VM's drift; what the ratios leave out (prefill, the
cost table's own error) is the same for all.

    .venv/bin/python -m benchmarks.k_replay --prompts 12 --tokens 64
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.k_policy import AcceptanceEvidence, Costs, round_ms
from specdec.rounds import DraftCall, run_draft


@dataclass
class Replay:
    tokens: int
    ms: float
    rounds: int
    proposed: int
    accepted: int

    def to_dict(self) -> dict:
        return dict(tokens=self.tokens, ms=round(self.ms, 1), rounds=self.rounds,
                    proposed=self.proposed, accepted=self.accepted)


def accepted_run(bits: Sequence[int], t: int, k: int) -> int:
    """Proposals a round at position t with K = k accepts: the run of ones from t, at most k."""
    n = 0
    while n < k and t + n < len(bits) and bits[t + n]:
        n += 1
    return n


def replay(bits: Sequence[int], choose: Callable[[int, int], int], costs: Costs, *,
           prompt_len: int, on_round: Callable[[int, int], None] | None = None) -> Replay:
    """Run a request of len(bits) tokens under `choose(t, left) -> K`, pricing each round
    as the adaptive-K policy does at concurrency 1 with whole passes: K draft passes and a
    target pass over K + 1 rows, plus the draft's catch-up over tokens its cache lacks (the
    prompt, before the first drafted round; the tokens of rounds at K = 0; the last round's
    final token). `on_round(k, accepted)` tells a stateful policy what happened."""
    t, ms, rounds, proposed, accepted = 0, 0.0, 0, 0, 0
    seen = 0  # tokens (prompt included) the draft holds in its cache
    while t < len(bits):
        left = len(bits) - t
        k = max(0, min(choose(t, left), left - 1))
        ms += round_ms(k, costs, whole_pass=True)
        n = accepted_run(bits, t, k)
        if k:
            ms += costs.catch_up(prompt_len + t - seen, whole_pass=True)
            # its cache then holds the accepted proposals (the last one is never fed)
            seen = prompt_len + t + min(n, k - 1)
        if on_round:
            on_round(k, n)
        t += n + 1
        rounds, proposed, accepted = rounds + 1, proposed + k, accepted + n
    return Replay(len(bits), ms, rounds, proposed, accepted)


def fixed(k: int) -> Callable[[int, int], int]:
    return lambda t, left: k


def oracle(bits: Sequence[int], max_k: int) -> Callable[[int, int], int]:
    """K = the run of accepted proposals ahead (0 where the draft misses): a bound, not a
    policy (it reads the future)."""
    return lambda t, left: accepted_run(bits, t, max_k)


def shipped_policy(generation, evidence: AcceptanceEvidence | None = None
                   ) -> tuple[Callable[[int, int], int], Callable[[int, int], None]]:
    """The shipped adaptive K: `generation.plan_k` at concurrency 1 (first round K = 0, then
    the request's own acceptance and the cost table), told each round's outcome; `evidence`
    replaces the request's own (another decay)."""
    if evidence is not None:
        generation.evidence = evidence

    def choose(t: int, left: int) -> int:
        assert len(generation.output) == t
        k = generation.plan_k(1, 0)
        if k:
            generation.draft_call(k)  # the draft has seen the request's tokens up to here
        return k

    def on_round(k: int, accepted: int) -> None:
        generation.record_round(k, accepted, accepted + 1)
        generation.output.extend([0] * (accepted + 1))  # only the count matters to plan_k

    return choose, on_round


def match_bits(backend, prompt_ids: list[int], params: dict, seed: int, tokens: int) -> list[int]:
    """The target-only text of a drafter-invariant request, then at each of its positions
    whether the draft's proposal (run_draft with K = 1 on the true prefix) is the target's
    token."""
    from benchmarks.shipped import _requests
    from specdec.api_types import GenerateRequest
    from specdec.generation import Generation

    (req,) = _requests([prompt_ids], params, k=0, max_tokens=tokens, seed0=seed)
    (out,), _ = backend.run([req], 1)
    text = list(out.token_ids)
    # the request as the engine admits it: its processing (banned EOS included) and seed
    gen = Generation.admit(GenerateRequest.model_validate(req), backend.engine.info)
    draft = backend.draft.runner
    rid = f"k-replay-{seed}"
    try:
        bits = []
        for t in range(len(text)):
            call = DraftCall(rid, list(prompt_ids) + text[:t], 1, gen.sampling, gen.seed)
            bits.append(int(run_draft(draft, [call])[0].tokens[0] == text[t]))
    finally:
        draft.release(rid)
    return bits


def replay_all(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], costs: Costs,
               max_k: int, new_generation: Callable[[int], object]) -> dict[str, dict]:
    """Every policy on every sequence; per policy the totals and the speed vs K = 0."""
    policies: dict[str, Callable] = {f"K={k}": (lambda bits, i, k=k: (fixed(k), None))
                                     for k in range(max_k + 1)}
    policies["adaptive (shipped)"] = lambda bits, i: shipped_policy(new_generation(i))
    # as it was before its evidence faded: what the fading does on the sequences at hand
    policies["adaptive, evidence not fading"] = \
        lambda bits, i: shipped_policy(new_generation(i), AcceptanceEvidence(decay=1.0))
    policies["oracle"] = lambda bits, i: (oracle(bits, max_k), None)
    out = {}
    for name, make in policies.items():
        total = Replay(0, 0.0, 0, 0, 0)
        for i, bits in enumerate(sequences):
            choose, on_round = make(bits, i)
            r = replay(bits, choose, costs, prompt_len=prompt_lens[i], on_round=on_round)
            total = Replay(total.tokens + r.tokens, total.ms + r.ms, total.rounds + r.rounds,
                           total.proposed + r.proposed, total.accepted + r.accepted)
        out[name] = total.to_dict()
    base = out["K=0"]["tokens"] / out["K=0"]["ms"]
    for row in out.values():
        row["vs_k0"] = round(row["tokens"] / row["ms"] / base, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.k_replay",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12, help="HumanEval prompts (default 12)")
    p.add_argument("--first", type=int, default=0, help="index of the first prompt (default 0)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1234, help="seed of the first prompt (+1 each)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)

    from benchmarks import prompts
    from benchmarks.shipped import shipped_backend, shipped_config
    from specdec.api_types import GenerateRequest
    from specdec.generation import Generation
    from specdec.model_pair import ensure_default_pair

    cfg = shipped_config()
    backend = shipped_backend(*ensure_default_pair(), cfg)
    info = backend.engine.info
    if info.k_costs is None:
        raise SystemExit("the engine measured no cost table (a GPU?): nothing to replay")
    params = {"temperature": args.temperature}
    if args.temperature > 0 and args.top_p < 1:
        params["top_p"] = args.top_p
    chosen = prompts.load_humaneval(args.first + args.prompts)[args.first:]
    ids = [backend.tokenizer(pr.text)["input_ids"] for pr in chosen]
    sequences = []
    for i, prompt in enumerate(ids):
        sequences.append(match_bits(backend, prompt, params, args.seed + i, args.tokens))
        print(f"prompt {i}: {''.join(map(str, sequences[-1]))}", flush=True)

    def new_generation(i: int):
        sp = dict(params, max_tokens=args.tokens, seed=args.seed + i, drafter_invariant=True)
        return Generation.admit(GenerateRequest(prompt_token_ids=ids[i], sampling_params=sp), info)

    results = replay_all(sequences, [len(x) for x in ids], info.k_costs,
                         cfg.num_speculative_tokens, new_generation)
    matched = sum(map(sum, sequences)) / sum(map(len, sequences))
    print(f"\nmatch rate {matched:.3f}; cost table {info.k_costs.to_dict()}")
    print("| policy | speed vs K=0 | rounds | proposed | accepted |\n|---|---|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['vs_k0']:.3f}x | {row['rounds']} | {row['proposed']} "
              f"| {row['accepted']} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(args=vars(args), params=params, match_rate=round(matched, 4),
                           costs=info.k_costs.to_dict(), sequences=sequences,
                           policies=results), fh, indent=1)


if __name__ == "__main__":
    main()
