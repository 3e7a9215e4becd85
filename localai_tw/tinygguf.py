"""Write a tiny GGUF chat model, offline, for the ``llama-cpp`` backend::

    python -m localai_tw.tinygguf FILE.gguf [--config MODELS_DIR/tiny-gguf.yaml] [--name NAME]

It exists so the GGUF path (model config, staging, llama.cpp's loader, its tokenizer, the GGUF's
own chat template, grammar-constrained sampling, embeddings) can be tried and tested on a
machine with no model hub, as :mod:`localai_tw.tinychat` does for ``transformers``.  Its weights
are RANDOM: it answers gibberish.  The model is a 2-layer llama-architecture network in float32
(about 520 KB) with a SentencePiece-style vocabulary llama.cpp tokenizes natively: the 256 byte
tokens (so any text tokenizes), the lower-case letters and a few dozen words, each reachable by
SentencePiece's pairwise merges (every prefix of a word is a token), and a chat template in
``tokenizer.chat_template``.

The tests build their tiny GGUF with :func:`build` (the same code a user runs).

What this module must never do: download anything, or import numpy/gguf at import time (the
frontend's base install has neither; they come with the ``llama`` extra).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

#: Whole words of the vocabulary (as "▁word" pieces, the SentencePiece word-start form).
WORDS = ("the cat sat on a mat and dog ran far away user assistant system hello hi say you "
         "i am is it what how good day yes no please thanks").split()
#: Characters that are tokens of their own (others fall back to byte tokens).
CHARACTERS = "abcdefghijklmnopqrstuvwxyz.,!?:"
SPACE = "\u2581"  # SentencePiece's word-boundary mark
#: role : content, one message after another; then "assistant :" to prompt the answer.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
DEFAULT_NAME = "tiny-gguf"
N_EMBD, N_LAYER, N_HEAD, N_FF, N_CTX = 64, 2, 4, 128, 256


def vocabulary() -> list[tuple[str, float, str]]:
    """``(piece, score, type)`` in id order: ``<unk> <s> </s>``, the byte tokens, the
    characters, then every prefix of ``▁word`` for each word (a merge path for llama.cpp's
    SentencePiece tokenizer; longer pieces score higher, so they win)."""
    pieces: list[tuple[str, float, str]] = [
        ("<unk>", 0.0, "UNKNOWN"), ("<s>", 0.0, "CONTROL"), ("</s>", 0.0, "CONTROL")]
    pieces += [(f"<0x{b:02X}>", 0.0, "BYTE") for b in range(256)]
    seen = {p for p, _, _ in pieces}
    for piece in [SPACE, *CHARACTERS]:
        pieces.append((piece, -100.0, "NORMAL"))
        seen.add(piece)
    for word in WORDS:
        full = SPACE + word
        for end in range(2, len(full) + 1):
            piece = full[:end]
            if piece not in seen:
                seen.add(piece)
                pieces.append((piece, -100.0 + end, "NORMAL"))
    return pieces


def build(path: str, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """Write the model to ``path`` (its directory created if needed); ``chat_template=None``
    leaves ``tokenizer.chat_template`` out."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType, TokenType

    pieces = vocabulary()
    rng = np.random.default_rng(seed)

    def weights(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.partial"  # never leave a half-written model under the final name
    writer = GGUFWriter(temporary, "llama")
    writer.add_name("localai-tw tiny gguf (random weights)")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(pieces))
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p for p, _, _ in pieces])
    writer.add_token_scores([s for _, s, _ in pieces])
    writer.add_token_types([int(TokenType[t]) for _, _, t in pieces])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    vocab = len(pieces)
    writer.add_tensor("token_embd.weight", weights(vocab, N_EMBD, scale=1.0))
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(N_EMBD, N_FF))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    # Only the text pieces can win: the rows of <unk>, <s>, </s> and the byte tokens are zero
    # (logit 0, far below the best word's), so the answers are words and letters, not stray
    # bytes, and the end-of-text token never cuts them short.
    output = weights(vocab, N_EMBD, scale=1.0)
    output[[i for i, (_, _, t) in enumerate(pieces) if t != "NORMAL"]] = 0.0
    writer.add_tensor("output.weight", output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(temporary, path)


def model_config(path: str, name: str = DEFAULT_NAME) -> dict:
    """The model config (as a mapping) that serves the GGUF at ``path``."""
    return {
        "name": name,
        "description": "a tiny RANDOM GGUF chat model built offline by python -m "
                       "localai_tw.tinygguf (it answers gibberish)",
        "backend": "llama-cpp",
        "parameters": {"model": os.path.abspath(path), "temperature": 0.7, "max_tokens": 24},
        "template": {"use_tokenizer_template": True},
        "context_size": N_CTX,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localai_tw.tinygguf",
        description="Write a tiny GGUF chat model with random weights (it answers gibberish) "
                    "to FILE, offline, for the llama-cpp backend; with --config, also the "
                    "model config file that serves it.")
    parser.add_argument("file", help="the .gguf file to write (its directory is created)")
    parser.add_argument("--config", metavar="FILE",
                        help="also write the model config here, e.g. "
                             "~/.local/share/localai-tw/models/tiny-gguf.yaml")
    parser.add_argument("--name", default=DEFAULT_NAME,
                        help=f"the model name in that config (default {DEFAULT_NAME})")
    args = parser.parse_args(argv)
    path = os.path.abspath(os.path.expanduser(args.file))
    try:
        build(path)
    except ImportError as e:
        print(f"needs the llama extra ({e.name or e}): pip install 'localai-tw[llama]'",
              file=sys.stderr)
        return 2
    print(f"wrote a tiny GGUF chat model with random weights to {path} (it answers gibberish)")
    if args.config:
        config = os.path.abspath(os.path.expanduser(args.config))
        os.makedirs(os.path.dirname(config), exist_ok=True)
        with open(config, "w") as f:
            yaml.safe_dump(model_config(path, args.name), f, sort_keys=False, width=1000)
        print(f"wrote its model config {config} (model {args.name!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
