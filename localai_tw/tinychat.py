"""Write a tiny chat model to a local directory, offline, for the ``transformers`` backend::

    python -m localai_tw.tinychat DIRECTORY [--config MODELS_DIR/tiny-chat.yaml] [--name NAME]

It exists so the chat path (model config, cold load, the tokenizer's chat template, generation,
streaming) can be tried and tested on a machine with no model hub.  Its weights are RANDOM: it
answers gibberish drawn from a few dozen words.  The model is a 2-layer GPT-2 (about 50 KB)
with a word-level, lower-cased vocabulary and a chat template, written with ``save_pretrained``
so ``parameters.model: DIRECTORY`` loads it with ``local_files_only``.  With ``--config`` it
also writes the model config file naming that directory (into the frontend's models
directory, where it is picked up without a restart).

The tests build their tiny model with :func:`build` (the same code a user runs).

What this module must never do: download anything, or import torch/transformers at import
time (the frontend's base install has neither; they are imported when a model is built).
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

#: The vocabulary, in id order (the first two are the end-of-text and unknown tokens).
WORDS = ("<|endoftext|> <unk> the cat sat on a mat and dog ran far away user : . assistant "
         "system hello hi say you i am is it what how good day , ! ? yes no please "
         "thanks").split()
#: role : content, one message after another; then "assistant :" to prompt the answer.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")
DEFAULT_NAME = "tiny-chat"


def build(directory: str, seed: int = 0, chat_template: str = CHAT_TEMPLATE) -> None:
    """Write the model and its tokenizer to ``directory`` (created if needed);
    ``chat_template``: another Jinja chat template (tests render tools with one)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)},
                                           unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", unk_token="<unk>",
        pad_token="<|endoftext|>", chat_template=chat_template)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(WORDS), n_embd=32, n_layer=2, n_head=2,
                                       n_positions=128, eos_token_id=0, bos_token_id=0))
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)


def model_config(directory: str, name: str = DEFAULT_NAME) -> dict:
    """The model config (as a mapping) that serves the model in ``directory``."""
    return {
        "name": name,
        "description": "a tiny RANDOM chat model built offline by python -m localai_tw.tinychat"
                       " (it answers gibberish)",
        "backend": "transformers",
        "parameters": {"model": os.path.abspath(directory), "temperature": 0.7,
                       "max_tokens": 24},
        "template": {"use_tokenizer_template": True},
        "context_size": 128,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localai_tw.tinychat",
        description="Write a tiny chat model with random weights (it answers gibberish) to "
                    "DIRECTORY, offline, for the transformers backend; with --config, also "
                    "the model config file that serves it.")
    parser.add_argument("directory", help="where to write the model (created if needed)")
    parser.add_argument("--config", metavar="FILE",
                        help="also write the model config here, e.g. "
                             "~/.local/share/localai-tw/models/tiny-chat.yaml")
    parser.add_argument("--name", default=DEFAULT_NAME,
                        help=f"the model name in that config (default {DEFAULT_NAME})")
    args = parser.parse_args(argv)
    directory = os.path.abspath(os.path.expanduser(args.directory))
    try:
        build(directory)
    except ImportError as e:
        print(f"needs the transformers extra ({e.name or e}): pip install "
              f"'localai-tw[transformers]'", file=sys.stderr)
        return 2
    print(f"wrote a tiny chat model with random weights to {directory} (it answers gibberish)")
    if args.config:
        path = os.path.abspath(os.path.expanduser(args.config))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            yaml.safe_dump(model_config(directory, args.name), f, sort_keys=False, width=1000)
        print(f"wrote its model config {path} (model {args.name!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
