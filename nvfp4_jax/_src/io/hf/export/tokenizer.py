"""Export: the optional byte-level tokenizer files (`tokenizer="bytes"`)."""

from __future__ import annotations


def check_tokenizer(tokenizer, config: dict) -> None:
    if tokenizer not in (None, "bytes"):
        raise ValueError(
            f"export_hf_checkpoint: tokenizer must be None or 'bytes', got {tokenizer!r} (for "
            "another tokenizer, save_pretrained it into the folder: the export keeps it)"
        )
    vocab = config.get("vocab_size")
    if tokenizer == "bytes" and not (isinstance(vocab, int) and vocab >= 256):
        raise ValueError(
            f"export_hf_checkpoint: tokenizer='bytes' needs vocab_size >= 256 (token i is "
            f"byte i), the config says {vocab}"
        )


def byte_tokenizer(config: dict) -> dict[str, dict]:
    """A byte-level tokenizer (token i is byte i, no merges, no special tokens) as HF files.

    `tokenizer.json` is a `tokenizers` BPE over GPT-2's byte-to-character table with the
    ByteLevel pre-tokenizer and decoder and no merges, so encoding UTF-8 text gives its bytes
    and decoding bytes gives the text: what `transformers.AutoTokenizer` (and so vLLM, SGLang)
    loads for a model trained on raw bytes.
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    byte_level["use_regex"] = False
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
    model |= {"end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False}
    model |= {"ignore_merges": False, "vocab": {chars[b]: b for b in range(256)}, "merges": []}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": []}
    tokenizer |= {"normalizer": None, "pre_tokenizer": byte_level, "post_processor": None}
    tokenizer |= {"decoder": dict(byte_level), "model": model}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    settings |= {"add_bos_token": False, "add_eos_token": False}
    if isinstance(config.get("max_position_embeddings"), int):
        settings["model_max_length"] = config["max_position_embeddings"]
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": settings}
