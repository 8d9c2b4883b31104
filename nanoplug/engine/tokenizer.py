"""The checkpoint's tokenizer, and a clear refusal when its folder holds none.

transformers 5 does not fail on a folder without tokenizer files: it builds an empty tokenizer (its
only token a special one), so text prompts then tokenize to nothing and every output reads ''. An
engine without a tokenizer is still possible, asked for by name: `skip_tokenizer_init=True` (vLLM's
option) loads none; prompts are then token ids and outputs carry token ids with empty text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from nanoplug.errors import ModelLoadError

# the files a Hugging Face tokenizer reads its vocabulary from (one of them is enough)
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model", "tokenizer.tiktoken")
SKIP_HINT = ("or, to run token-id prompts without a tokenizer, pass skip_tokenizer_init=True "
             "(outputs then carry token ids and empty text)")


def is_empty(tokenizer: Any) -> bool:
    """A tokenizer with no ordinary token: what transformers builds from a folder without vocabulary."""
    return len(tokenizer) <= len(set(tokenizer.all_special_tokens))


def load_tokenizer(folder: Path, hf_config: Any = None) -> Any:
    """AutoTokenizer for `folder`; raises ModelLoadError naming the missing files and the fix. `hf_config`, the
    checkpoint's config loaded already, spares AutoTokenizer reading it again (through the config class)."""
    from transformers import AutoTokenizer

    how_to_add = (f"copy the tokenizer of the model these weights came from into it "
                  f"(AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained({str(folder)!r}), "
                  f"or copy its tokenizer.json and tokenizer_config.json), {SKIP_HINT}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **({} if hf_config is None else {"config": hf_config}))
    except Exception as exc:
        raise ModelLoadError(f"no usable tokenizer in {str(folder)!r} ({type(exc).__name__}: {exc}); "
                             + how_to_add) from exc
    if is_empty(tokenizer):
        found = [f for f in VOCABULARY_FILES if (folder / f).is_file()]
        if found:
            what = f"its {', '.join(found)} gave"
        else:
            present = [f for f in ("tokenizer_config.json", "special_tokens_map.json") if (folder / f).is_file()]
            has = f" ({', '.join(present)} there hold no vocabulary)" if present else ""
            what = f"none of {', '.join(VOCABULARY_FILES)} is there{has}, and transformers made"
        raise ModelLoadError(f"{str(folder)!r} has no tokenizer vocabulary: {what} an empty tokenizer of "
                             f"{len(tokenizer)} token(s); " + how_to_add)
    return tokenizer
