"""Conformance with vLLM: the same logits and parameters through vLLM's own sampling code
and through `specdec.processing.process_logits` must give the same distributions.

Needs the optional vLLM extra, which lives in its own virtualenv (scripts/setup_vllm_venv.sh):
    .venv-vllm/bin/python -m pytest tests/test_vllm_conformance.py -m vllm

What is compared (vLLM 0.32, V1 sampler, CPU):
- penalties: vllm.model_executor.layers.utils.apply_penalties;
- top-k / top-p: vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p (its pure-PyTorch
  path, the one vLLM runs on CPU);
- min-p: vLLM's MinPLogitsProcessor;
- everything together: vllm.v1.sample.sampler.Sampler (allowed_token_ids, bad words,
  min_tokens, logit_bias, penalties, greedy, temperature, min-p, top-k, top-p) with its
  processed log-probabilities, on a batch whose rows carry different parameters;
- bad-word tokenization: vllm.SamplingParams.update_from_tokenizer, real Qwen tokenizer;
- SamplingParams.from_any on a real vllm.SamplingParams.

Deliberate differences, kept out of the random cases here and covered in
tests/test_processing.py: (1) top-p ties: we keep every token tied with the last kept one,
vLLM's cut among ties follows sort order; (2) a ban that would leave a row with no token
(min_tokens or bad words against allowed_token_ids) is skipped by us, vLLM leaves an
all -inf row; (3) vLLM bans the eos token for min_tokens even with ignore_eos; we ban
whatever `RequestSampling.eos_token_ids` holds, so that is the caller's choice.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from vllm.model_executor.layers.utils import apply_penalties  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import (  # noqa: E402
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.logits_processor.state import BatchUpdateBuilder  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from specdec.params import SamplingParams  # noqa: E402
from specdec.processing import (  # noqa: E402
    RequestSampling,
    Row,
    process_logits,
    tokenize_bad_words,
)

# vLLM picks its CPU kernel library (AVX2 / AVX512) here; greedy argmax needs it.
current_platform.import_kernels()

VOCAB = 1000
EOS = 2


def _logits(rows: int, seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _ours(logits, vp, prompt=(), output=(), eos=(EOS,), bad=()) -> torch.Tensor:
    req = RequestSampling(SamplingParams.from_any(vp), tuple(prompt), tuple(eos), tuple(bad))
    return process_logits(logits, [Row(req, tuple(output))] * len(logits)).probs


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours > 0, theirs > 0), "different supports"
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-4)


def test_from_any_reads_a_real_vllm_sampling_params():
    vp = vllm.SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.3, logit_bias={5: 1.0}, allowed_token_ids=[1, 5], bad_words=["x"], seed=3,
        max_tokens=50, min_tokens=2, stop=["\n"], stop_token_ids=[9], ignore_eos=True, logprobs=2,
        include_stop_str_in_output=True,
    )
    p = SamplingParams.from_any(vp)
    for name in (
        "temperature top_p top_k min_p repetition_penalty presence_penalty frequency_penalty logit_bias "
        "allowed_token_ids bad_words seed max_tokens min_tokens stop stop_token_ids ignore_eos logprobs "
        "include_stop_str_in_output"
    ).split():
        assert getattr(p, name) == getattr(vp, name), name
    assert SamplingParams.from_any(vllm.SamplingParams()) == SamplingParams()


def test_bad_words_tokenize_like_vllm(tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    # vLLM's own tokenizer wrapper adds max_token_id; that is all update_from_tokenizer needs.
    tokenizer = SimpleNamespace(encode=hf.encode, max_token_id=len(hf) - 1)
    words = ["print", " def", "import numpy", "hello world", "x", "  spaced"]
    vp = vllm.SamplingParams(bad_words=words)
    vp.update_from_tokenizer(tokenizer)
    assert tokenize_bad_words(words, hf) == tuple(tuple(ids) for ids in vp.bad_words_token_ids)


@pytest.mark.parametrize(
    "rep, freq, pres", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, -0.4, 0.8), (1.2, 0.3, -0.6)]
)
def test_penalties_match_vllm(rep, freq, pres):
    logits = _logits(4, seed=1)
    prompt, outputs = [1, 5, 5, 9, 700], [[], [5], [3, 3, 8, 999], [1, 2, 2, 2, 40, 5]]
    vp = vllm.SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    theirs = apply_penalties(
        logits.clone(),
        torch.tensor([prompt] * 4),
        _pad(outputs, VOCAB),
        torch.full((4,), pres),
        torch.full((4,), freq),
        torch.full((4,), rep),
    ).softmax(dim=1)
    req = RequestSampling(SamplingParams.from_any(vp), tuple(prompt))
    ours = process_logits(logits, [Row(req, out) for out in outputs]).probs
    _assert_same(ours, theirs)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 1, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9), (0.6, 0, 0.5), (1.3, 50, 0.95), (1.0, 999, 0.99), (0.8, 5, 0.3)],
)
def test_top_k_top_p_match_vllm(temperature, top_k, top_p):
    logits = _logits(8, seed=2)
    vp = vllm.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    k = torch.full((8,), top_k, dtype=torch.long) if top_k > 0 else None
    p = torch.full((8,), top_p) if top_p < 1 else None
    theirs = apply_top_k_top_p(logits / temperature, k, p).softmax(dim=1)
    _assert_same(_ours(logits, vp), theirs)


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_vllm(min_p):
    logits = _logits(6, seed=3)
    vp = vllm.SamplingParams(temperature=0.9, min_p=min_p)
    proc = MinPLogitsProcessor(_config(6), torch.device("cpu"), False)
    proc.update_state(_batch_update([(vp, [], [])] * 6))
    theirs = proc.apply(logits / 0.9).softmax(dim=1)
    _assert_same(_ours(logits, vp), theirs)


# ---- the whole sampler, mixed parameters in one batch ----------------------------------------

CASES = [
    # (vLLM SamplingParams kwargs, prompt, output, bad word ids)
    (dict(temperature=0.0, repetition_penalty=1.5), [4, 8], [8, 15], ()),
    (dict(temperature=0.6, top_p=0.9), [1], [], ()),
    (dict(temperature=1.0, top_k=20), [], [3], ()),
    (dict(temperature=1.3, min_p=0.05, top_k=50, top_p=0.95), [9, 9], [9], ()),
    (dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3), [1, 2, 3], [3, 3, 4], ()),
    (dict(logit_bias={3: 5.0, 10: -100.0}, allowed_token_ids=list(range(0, VOCAB, 3))), [], [6], ()),
    (dict(temperature=0.7, min_tokens=5, stop_token_ids=[7]), [], [1, 2], ()),
    (dict(temperature=0.0, min_tokens=1, logit_bias={EOS: 50.0}), [], [], ()),
    (dict(temperature=0.9, top_p=0.8), [], [4, 4], ((11,), (4, 12), (5, 13))),
]


def test_sampler_matches_vllm_on_a_mixed_batch():
    logits = _logits(len(CASES), seed=4)
    vparams = [vllm.SamplingParams(**kw) for kw, *_ in CASES]
    for vp in vparams:
        vp.update_from_generation_config({}, eos_token_id=EOS)  # how the engine adds eos
    metadata = _metadata(vparams, [c[1] for c in CASES], [c[2] for c in CASES], [c[3] for c in CASES])
    sampler = Sampler(logprobs_mode="processed_logprobs")
    processed = sampler.apply_logits_processors(logits.clone(), metadata, predict_bonus_token=False)
    sampled, theirs = sampler.sample(processed, metadata)

    rows = [
        Row(RequestSampling(SamplingParams.from_any(vp), tuple(prompt), (EOS,), bad), tuple(out))
        for vp, (_, prompt, out, bad) in zip(vparams, CASES)
    ]
    ours = process_logits(logits, rows)
    for i, vp in enumerate(vparams):
        if vp.temperature == 0:  # greedy: same token, same temperature-1 logprobs
            assert int(ours.probs[i].argmax()) == int(sampled[i]) and ours.probs[i].max() == 1
            assert torch.allclose(ours.logprobs[i], theirs[i], atol=1e-5)
        else:
            _assert_same(ours.probs[i], theirs[i].exp())
            finite = torch.isfinite(theirs[i])
            assert torch.equal(torch.isfinite(ours.logprobs[i]), finite)
            assert torch.allclose(ours.logprobs[i][finite], theirs[i][finite], atol=1e-4)


def _metadata(vparams, prompts, outputs, bad_words) -> SamplingMetadata:
    """SamplingMetadata as vLLM's InputBatch would build it for these requests."""
    n = len(vparams)
    temperature = torch.tensor([vp.temperature for vp in vparams])
    greedy = temperature < 1e-5
    top_k = [vp.top_k if 0 < vp.top_k < VOCAB else VOCAB for vp in vparams]
    allowed = torch.zeros(n, VOCAB, dtype=torch.bool)
    for i, vp in enumerate(vparams):
        if vp.allowed_token_ids is not None:
            allowed[i] = True
            allowed[i, vp.allowed_token_ids] = False
    procs = [
        cls(_config(n), torch.device("cpu"), False)
        for cls in (MinTokensLogitsProcessor, LogitBiasLogitsProcessor, MinPLogitsProcessor)
    ]
    update = _batch_update(list(zip(vparams, prompts, outputs)))
    for proc in procs:
        proc.update_state(update)
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=torch.tensor([vp.top_p for vp in vparams]),
        top_k=torch.tensor(top_k),
        generators={},
        max_num_logprobs=VOCAB,
        no_penalties=False,
        prompt_token_ids=_pad(prompts, VOCAB),
        frequency_penalties=torch.tensor([vp.frequency_penalty for vp in vparams]),
        presence_penalties=torch.tensor([vp.presence_penalty for vp in vparams]),
        repetition_penalties=torch.tensor([vp.repetition_penalty for vp in vparams]),
        output_token_ids=[list(o) for o in outputs],
        allowed_token_ids_mask=allowed,
        bad_words_token_ids={i: [list(w) for w in words] for i, words in enumerate(bad_words) if words},
        logitsprocs=LogitsProcessors(procs),
    )


def _config(max_num_seqs: int):
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def _batch_update(requests):
    builder = BatchUpdateBuilder()
    for i, (vp, prompt, output) in enumerate(requests):
        builder.added.append((i, vp, list(prompt), list(output)))
    return builder.get_and_reset(len(requests))


def _pad(lists, pad: int) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([list(x) + [pad] * (width - len(x)) for x in lists], dtype=torch.long)
