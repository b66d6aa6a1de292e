"""Write a tiny model of any family sluice knows (Qwen3, Qwen3-MoE, ...) and a character-level tokenizer into a folder.

The model is real (same classes SGLang and the trainer load), just small enough to run on two CPU cores; its
family (``pipeline.models.families``) holds its small default config. The tokenizer covers what sluice's CPU
recipe needs for synthetic arithmetic and copy tasks: digits, arithmetic symbols, lowercase letters, space, newline
and a few special tokens.

    python -m pipeline.models.tiny --arch qwen3-moe --out DIR [--seed N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TinyArch = Literal["qwen3", "qwen3-moe", "deepseek-v3"]
TINY_ARCHS: tuple[str, ...] = get_args(TinyArch)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)
# One token per character; the order fixes the ids, so it must never change for existing models.
CHARACTERS: tuple[str, ...] = tuple(string.digits + "+-*/=()<>.,:;?!#%^'\"" + string.ascii_lowercase + " \n")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character in ``CHARACTERS`` is one token, specials come first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` rather than `.` so that newlines become tokens too.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )


def _model_config(arch: TinyArch, vocab_size: int, special_ids: dict[str, int], overrides: dict[str, Any]) -> Any:
    from pipeline.models.families import family_for_tiny

    return family_for_tiny(arch).tiny_config(arch, {"vocab_size": vocab_size, **special_ids, **overrides})


def init_tiny_model(arch: TinyArch, out_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a randomly initialised tiny model (safetensors) and its tokenizer into ``out_dir``; return the folder.

    ``overrides`` are passed to the transformers config (``num_hidden_layers=4``, ``num_experts=16``, ...). The same
    ``seed`` and overrides give bitwise the same weights.
    """
    if arch not in TINY_ARCHS:
        raise ConfigError(f"unknown tiny model arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models.families import family_for_tiny

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    special_ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = _model_config(arch, len(tokenizer), special_ids, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    family_for_tiny(arch).init_tiny_weights(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _parse_value(text: str) -> Any:
    """``--set`` values are JSON when they parse as JSON (numbers, booleans, lists), otherwise plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parse_overrides(pairs: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r} (for example --set num_hidden_layers=4)")
        overrides[key.strip()] = _parse_value(value.strip())
    return overrides


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: write a tiny model and print its folder."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.models.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=TINY_ARCHS, default="qwen3-moe")
    parser.add_argument("--out", required=True, help="folder to write the model and tokenizer into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    out = init_tiny_model(args.arch, args.out, seed=args.seed, **_parse_overrides(args.overrides))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
