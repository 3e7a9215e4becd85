"""LocalAI's model config keys: what reaches ModelOptions / PredictOptions, what is warned about
and kept, what refuses the file, and how a request for a model whose file failed is answered."""

from __future__ import annotations

import pytest
from twisted.internet import defer
from twisted.logger import capturedLogs

from localai_tw.backends import backend_pb2
from localai_tw.frontend.inference.coldload import ColdLoader
from localai_tw.frontend.inference.router import InferenceRouter
from localai_tw.localai.catalog import ModelCatalog
from localai_tw.localai.model_config import (
    DIFFUSERS_OPTIONS,
    LIMIT_OPTIONS,
    MODEL_OPTIONS,
    ModelConfigError,
    PARAMETER_MODEL,
    PARAMETER_PREDICT,
    parse_model_config,
    PREDICT_OPTIONS,
)
from localai_tw.frontend.api.openai.requests import Fields, merge_sampling

from .support_openai import FakeRouter, call, make_site

SAMPLE = {"bool": True, "int": 7, "float": 0.5, "str": "x1", "strs": ["a", "b"],
          "floats": [0.25, 0.5]}


def parse(**data):
    data.setdefault("name", "m")
    data.setdefault("backend", "transformers")
    return parse_model_config(data, "m.yaml")


class _Client:
    def __init__(self):
        self.sent = []

    def call(self, method, options, deadline):
        self.sent.append((method, options))
        return defer.succeed(backend_pb2.Result(success=True))


class _Clients:
    def __init__(self):
        self.one = _Client()

    def client(self, node_id, port):
        return self.one


class _Reactor:
    def seconds(self):
        return 0.0


def sent_model_options(config) -> backend_pb2.ModelOptions:
    """What ``ColdLoader._load_model`` sends to LoadModel for ``config`` (the real method, on a
    stand-in holding only what it reads)."""
    holder = type("S", (), {})()
    holder._clients, holder._reactor, holder.load_timeout = _Clients(), _Reactor(), 10.0
    d = defer.ensureDeferred(ColdLoader._load_model(holder, config, "n1", "127.0.0.1:5000",
                                                    "models/m/m.bin", ""))
    assert d.called and d.result is None
    [(method, options)] = holder._clients.one.sent
    assert method == "LoadModel"
    return options


# -- config -> ModelOptions ------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(MODEL_OPTIONS))
def test_every_top_level_model_option_reaches_load_model(key):
    kind, proto = MODEL_OPTIONS[key]
    sent = sent_model_options(parse(**{key: SAMPLE[kind]}))
    assert getattr(sent, proto) == pytest.approx(SAMPLE[kind])
    assert sent.Model == "models/m/m.bin"  # the loader's own fields still win


@pytest.mark.parametrize("section,table", [("diffusers", DIFFUSERS_OPTIONS),
                                           ("limit_mm_per_prompt", LIMIT_OPTIONS)])
def test_nested_model_options_reach_load_model(section, table):
    raw = {key: SAMPLE[kind] for key, (kind, _) in table.items()}
    sent = sent_model_options(parse(**{section: raw}))
    for key, (kind, proto) in table.items():
        assert getattr(sent, proto) == SAMPLE[kind], key


@pytest.mark.parametrize("key", sorted(PARAMETER_MODEL))
def test_parameters_that_are_model_options_reach_load_model(key):
    kind, proto = PARAMETER_MODEL[key]
    sent = sent_model_options(parse(parameters={key: SAMPLE[kind]}))
    assert getattr(sent, proto) == pytest.approx(SAMPLE[kind])


def test_the_transformers_type_and_engine_args_reach_load_model():
    sent = sent_model_options(parse(type="AutoModelForCausalLM", context_size=1024,
                                    engine_args={"b": 1, "a": "x"}, options=["o:1"]))
    assert sent.Type == "AutoModelForCausalLM"
    assert sent.ContextSize == 1024
    assert sent.EngineArgs == '{"a":"x","b":1}'
    assert list(sent.Options) == ["o:1"]


# -- config -> PredictOptions ----------------------------------------------------------------


def predict_options(config, request=None) -> backend_pb2.PredictOptions:
    return merge_sampling(config.parameters, Fields(request or {}),
                          config.predict_options).options(Prompt="p")


@pytest.mark.parametrize("key", sorted(PREDICT_OPTIONS))
def test_every_top_level_predict_option_reaches_every_request(key):
    kind, proto = PREDICT_OPTIONS[key]
    sent = predict_options(parse(**{key: SAMPLE[kind]}))
    value = getattr(sent, proto)
    assert (list(value) if kind == "strs" else value) == pytest.approx(SAMPLE[kind])


@pytest.mark.parametrize("key", sorted(PARAMETER_PREDICT))
def test_parameters_that_are_predict_options_reach_every_request(key):
    kind, proto = PARAMETER_PREDICT[key]
    sent = predict_options(parse(parameters={key: SAMPLE[kind]}))
    assert getattr(sent, proto) == pytest.approx(SAMPLE[kind])


def test_stopwords_come_before_parameter_and_request_stops():
    config = parse(stopwords=["<|im_end|>", "</s>"], parameters={"stop": ["###"]})
    sent = predict_options(config, {"stop": ["</s>", "END"]})
    assert list(sent.StopPrompts) == ["<|im_end|>", "</s>", "###", "END"]


def test_stopwords_reach_the_backend_through_the_chat_api():
    router = FakeRouter([parse(name="chatml", backend="echo", stopwords=["<|im_end|>"])])
    response = call(make_site(router), "POST", "/v1/chat/completions",
                    {"model": "chatml", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status == 200
    [(_, _, options)] = router.calls
    assert list(options.StopPrompts) == ["<|im_end|>"]


# -- warnings and refusals -------------------------------------------------------------------


def test_unknown_and_unused_keys_are_warned_once_and_the_model_kept(tmp_path):
    (tmp_path / "m.yaml").write_text(
        "name: m\nbackend: llama-cpp\nf16: true\nbogus: 1\n"
        "function: {grammar: {mixed_mode: true}, xml_format_preset: x, what: 1}\n"
        "parameters: {model: m.gguf, nope: 2}\ntemplate: {edit: x, chat: '{{.Input}}'}\n")
    catalog = ModelCatalog(str(tmp_path), check_interval=0)
    with capturedLogs() as events:
        assert [m.name for m in catalog.models()] == ["m"]
        catalog.refresh()
        catalog.models()
    warned = [e["warning"] for e in events if "warning" in e]
    assert sorted(warned) == sorted([
        "bogus: unknown key; ignored",
        "function.grammar.mixed_mode: a LocalAI key localai-tw does not act on; ignored",
        "function.xml_format_preset: a LocalAI key localai-tw does not act on; ignored",
        "function.what: unknown key; ignored",
        "parameters.nope: unknown parameter; ignored",
        "template.edit: a LocalAI key localai-tw does not act on; ignored"])
    assert catalog.errors == {}
    assert catalog.get("m").model_options == {"F16Memory": True, "MMap": True}


@pytest.mark.parametrize("data,field", [
    ({"f16": "yes"}, "f16"),
    ({"threads": 1.5}, "threads"),
    ({"gpu_layers": 2 ** 40}, "gpu_layers"),
    ({"mmap": 1}, "mmap"),
    ({"type": ["a"]}, "type"),
    ({"stopwords": "</s>"}, "stopwords"),
    ({"stopwords": ["x"] * 33}, "stopwords"),
    ({"roles": {"user": 1}}, "roles"),
    ({"parameters": {"tfz": "high"}}, "parameters.tfz"),
    ({"diffusers": {"cuda": "on"}}, "diffusers.cuda"),
    ({"engine_args": ["x"]}, "engine_args"),
    ({"template": {"join_chat_messages_by_character": 1}},
     "template.join_chat_messages_by_character"),
])
def test_a_known_key_of_the_wrong_type_refuses_the_file_naming_it(data, field):
    with pytest.raises(ModelConfigError) as caught:
        parse(**data)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"m.yaml: {field}: ")
    assert "must" in str(caught.value) or "at most" in str(caught.value)


def test_a_file_without_name_is_named_after_the_file():
    assert parse_model_config({"backend": "echo"}, "chatml.yaml").name == "chatml"


# -- a request for a model whose file failed -----------------------------------------------


@pytest.fixture
def broken_site(tmp_path):
    (tmp_path / "good.yaml").write_text("name: good\nbackend: echo\n")
    (tmp_path / "typed.yaml").write_text("name: typed\nbackend: echo\nf16: maybe\n")
    (tmp_path / "garbled.yaml").write_text("name: [unclosed\n")
    catalog = ModelCatalog(str(tmp_path), check_interval=0)
    return make_site(InferenceRouter(catalog, None, None, None, None, None))


@pytest.mark.parametrize("name,words", [
    ("typed", "typed.yaml: f16: must be true or false"),
    ("garbled", "garbled.yaml: is not valid YAML at line 2"),
])
def test_a_request_for_a_broken_config_names_the_file_and_the_reason(broken_site, name, words):
    response = call(broken_site, "POST", "/v1/chat/completions",
                    {"model": name, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status == 500
    error = response.json()["error"]
    assert error["code"] == "model_config_invalid"
    assert words in error["message"]
    assert "does not exist" not in error["message"]
    assert call(broken_site, "GET", f"/v1/models/{name}").json()["error"]["code"] == \
        "model_config_invalid"


def test_models_lists_the_broken_configs_beside_the_good_ones(broken_site):
    listing = call(broken_site, "GET", "/v1/models").json()
    assert [m["id"] for m in listing["data"]] == ["good"]
    assert {e["id"]: e["error"].split(":")[0] for e in listing["errors"]} == \
        {"garbled": "garbled.yaml", "typed": "typed.yaml"}
    missing = call(broken_site, "POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    assert (missing.status, missing.json()["error"]["code"]) == (404, "model_not_found")


def test_the_warnings_a_file_can_cause_are_bounded():
    config = parse(**{f"key{i}": i for i in range(500)})
    assert len(config.warnings) == 33
    assert config.warnings[-1] == "... and 468 more ignored keys"


def test_mmap_is_on_unless_the_config_turns_it_off(tmp_path):
    """LocalAI's default (generic_defaults.go): a GGUF is memory-mapped unless ``mmap: false``;
    without it llama.cpp read the whole file into memory."""
    from localai_tw.localai.model_config import parse_model_config

    on = parse_model_config({"name": "a", "backend": "llama-cpp",
                             "parameters": {"model": "a.gguf"}}, "a.yaml")
    off = parse_model_config({"name": "b", "backend": "llama-cpp", "mmap": False,
                              "parameters": {"model": "b.gguf"}}, "b.yaml")
    assert on.model_options["MMap"] is True and on.predict_options["MMap"] is True
    assert off.model_options["MMap"] is False and off.predict_options["MMap"] is False
