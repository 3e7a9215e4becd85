"""The backends shipped with localai-tw, exposed as plugins (see ``localai_tw.backends.builtin``).
Nothing else belongs here: ``twisted.plugin`` collects every module attribute that provides a
plugin interface."""

from localai_tw.backends.builtin import (
    bert_numpy_backend,
    echo_backend,
    espeak_ng_backend,
    external_backend,
    hash_image_backend,
    llama_cpp_backend,
    pocketsphinx_backend,
    sentence_transformers_backend,
    transformers_backend,
)

__all__ = ["external_backend", "echo_backend", "bert_numpy_backend",
           "sentence_transformers_backend", "transformers_backend", "llama_cpp_backend",
           "espeak_ng_backend", "pocketsphinx_backend", "hash_image_backend"]
