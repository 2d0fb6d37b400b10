"""Getting a model: `resolve_model` turns a name into a model folder, and
`check_same_tokenizer` refuses a draft and a target that do not share token ids.

A model folder holds `config.json`, safetensors weights and the tokenizer files. The default
pair's folders are made (once) by `specdec.model_pair`.
"""

from __future__ import annotations

from pathlib import Path

from specdec.model_pair import DEFAULT_MODELS, ensure_model


class TokenizerMismatchError(ValueError):
    """Draft and target do not share one tokenizer (vocabulary and ids)."""


def resolve_model(name_or_path, cache_dir=None, *, weights: bool = True) -> Path:
    """A model folder for "default-draft" / "default-target", a local folder holding
    config.json, or a Hugging Face hub id (downloaded only because the user named it;
    `weights=False` fetches config and tokenizer only, for processes that need no weights)."""
    name = str(name_or_path)
    if name in DEFAULT_MODELS:
        return ensure_model(DEFAULT_MODELS[name], cache_dir)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a folder without config.json; not a model folder")
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model {name!r}: not 'default-draft'/'default-target', not a "
                                "model folder and not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download  # only for hub ids the user names

    patterns = ["*.json", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]
    if weights:
        patterns.append("*.safetensors")  # never *.bin / *.pt: no pickle
    return Path(snapshot_download(name, allow_patterns=patterns))


def _vocab_of(model_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).get_vocab()


def _same_tokenizer_files(a: Path, b: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json")
    if not all((d / n).is_file() for d in (a, b) for n in names):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def check_same_tokenizer(draft_dir, target_dir) -> None:
    """Raises TokenizerMismatchError unless both tokenizers map the same tokens to the same ids
    (added and special tokens included)."""
    if _same_tokenizer_files(Path(draft_dir), Path(target_dir)):
        return  # byte-identical files: no need to load two 150k-token vocabularies
    draft, target = _vocab_of(Path(draft_dir)), _vocab_of(Path(target_dir))
    if draft == target:
        return
    only_d = sorted(set(draft) - set(target))
    only_t = sorted(set(target) - set(draft))
    moved = sorted(t for t in set(draft) & set(target) if draft[t] != target[t])
    details = []
    if len(draft) != len(target):
        details.append(f"vocab sizes differ: draft {len(draft)}, target {len(target)}")
    if only_d:
        details.append(f"{len(only_d)} tokens only in the draft, e.g. {only_d[:3]}")
    if only_t:
        details.append(f"{len(only_t)} tokens only in the target, e.g. {only_t[:3]}")
    if moved:
        t = moved[0]
        details.append(f"{len(moved)} tokens with different ids, e.g. {t!r}: draft "
                       f"{draft[t]}, target {target[t]}")
    raise TokenizerMismatchError(
        f"draft {draft_dir} and target {target_dir} do not share a tokenizer "
        f"({'; '.join(details)}); speculative decoding needs identical token ids")
