"""Our compact forward against transformers, and tensor parallelism (TP=2 on gloo)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from specdec.model import TensorParallel
from specdec.runner import ModelRunner


def _hf_logits(model_dir, ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _prompt(n, seed=0, vocab=150_000):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_forward_matches_transformers_qwen2(tiny_pair):
    target = tiny_pair[1]
    ids = _prompt(24)
    ours = ModelRunner(target, dtype="float32").extend([("r", ids, len(ids))])[0]
    ref = _hf_logits(target, ids)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_forward_matches_transformers_llama_with_rope_scaling(tmp_path, tied):
    """Llama: no q/k/v bias, llama3 RoPE scaling, tied or untied lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    ids = _prompt(40, vocab=1000)
    ours = ModelRunner(tmp_path, dtype="float32").extend([("r", ids, len(ids))])[0]
    torch.testing.assert_close(ours, _hf_logits(tmp_path, ids), atol=1e-4, rtol=1e-4)


def test_a_pruned_vocabulary_head_keeps_the_lowest_ids_and_the_special_tokens(tiny_pair):
    """proposal_vocab: the kept rows' logits are the whole head's, the rest are
    OUTSIDE_HEAD_LOGIT, and the head matmul (what the calibration times) is that much smaller."""
    from specdec.model import OUTSIDE_HEAD_LOGIT
    from specdec.vocab import proposal_ids

    draft = tiny_pair[0]
    ids = _prompt(20, vocab=1000)
    kept = proposal_ids(draft, 1000, 151_936)
    assert kept[:1000] == list(range(1000))
    assert {151_643, 151_645} <= set(kept)  # <|endoftext|> and <|im_end|> can end a proposal
    whole = ModelRunner(draft, dtype="float32").extend([("r", ids, 3)])[0]
    runner = ModelRunner(draft, dtype="float32", proposal_vocab=1000)
    pruned = runner.extend([("r", ids, 3)])[0]
    assert runner.proposal_vocab == len(kept) and pruned.shape == whole.shape
    torch.testing.assert_close(pruned[:, kept], whole[:, kept], atol=1e-5, rtol=1e-5)
    outside = torch.ones(whole.shape[1], dtype=torch.bool)
    outside[kept] = False
    assert (pruned[:, outside] == OUTSIDE_HEAD_LOGIT).all()
    assert f"{len(kept)}x64" in runner.calibration()["kernels"]


def test_missing_weight_is_named(tiny_pair, tmp_path):
    import shutil

    for f in tiny_pair[1].iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.down_proj.weight"):
        ModelRunner(tmp_path, dtype="float32")


def test_rejects_tp_size_not_dividing_kv_heads(tiny_pair):
    with pytest.raises(ValueError, match="kv heads .* divisible by tp_size"):
        ModelRunner(tiny_pair[1], dtype="float32", tp=TensorParallel(0, 4))  # 2 kv heads


# ---- tensor parallelism ----------------------------------------------------------------------


def greedy_trace(runner, prompts, steps):
    """Prefill several requests in one call, then decode all of them greedily together.
    Returns (logits of the first call and of every step, concatenated; tokens per request)."""
    seqs = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    all_logits = []
    num = {rid: len(s) for rid, s in seqs.items()}  # all prompt positions first
    for _ in range(steps + 1):
        out = runner.extend([(rid, s, num[rid]) for rid, s in seqs.items()])
        all_logits += out
        for (rid, s), logits in zip(seqs.items(), out):
            s.append(int(logits[-1].argmax()))
            num[rid] = 1
    tokens = {rid: s[len(p):] for (rid, s), p in zip(seqs.items(), prompts)}
    return torch.cat(all_logits), tokens


def _tp_worker(rank, size, init_file, model_dir, prompts, steps, out_file):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=size)
    try:
        runner = ModelRunner(model_dir, dtype="float32", tp=TensorParallel(rank, size))
        logits, tokens = greedy_trace(runner, prompts, steps)
        if rank == 0:
            flat = {f"tokens_{k}": torch.tensor(v) for k, v in tokens.items()}
            save_file({"logits": logits, **flat}, out_file)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_2_ranks_equals_single(tiny_pair, tmp_path):
    target = tiny_pair[1]
    prompts = [_prompt(9, seed=1), _prompt(23, seed=2), _prompt(4, seed=3)]
    steps = 8
    ref_logits, ref_tokens = greedy_trace(ModelRunner(target, dtype="float32"), prompts, steps)

    out_file = str(tmp_path / "tp.safetensors")
    mp.spawn(_tp_worker, nprocs=2, join=True,
             args=(2, str(tmp_path / "init"), str(target), prompts, steps, out_file))
    got = load_file(out_file)
    diff = (got["logits"] - ref_logits).abs().max().item()
    print(f"TP=2 vs TP=1 max |logit difference| (float32): {diff:.3g}")
    torch.testing.assert_close(got["logits"], ref_logits, atol=1e-4, rtol=1e-4)
    for rid, toks in ref_tokens.items():
        assert got[f"tokens_{rid}"].tolist() == toks


# ---- the real model ---------------------------------------------------------------------------


@pytest.mark.real_pair
def test_forward_matches_transformers_on_real_draft(real_pair):
    draft = real_pair[0]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(draft))
    ids = tok("def quicksort(xs):\n    \"\"\"Sort a list.\"\"\"\n")["input_ids"]
    ours = ModelRunner(draft, dtype="bfloat16").extend([("r", ids, len(ids))])[0]
    ref = _hf_logits(draft, ids, dtype=torch.bfloat16)
    # bf16 roundings differ between the two implementations; the predictions must not.
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (ours - ref).abs().max() < 1.0
    assert os.path.isfile(draft / "model.safetensors")
