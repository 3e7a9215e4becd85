"""LocalAI's own gallery, as a measure of compatibility: every model config of the snapshot in
``tests/fixtures/localai-gallery`` (README there) installed as LocalAI's gallery installs it
(the ``config_file`` text written to ``<entry>.yaml``) must load, and every prompt template in it
must render or be refused with a reason naming the construct.  The counts are asserted exactly,
so a regression (or an improvement to record) turns this red; docs/models.md has the numbers."""

from __future__ import annotations

import os

import pytest
import yaml

from localai_tw.localai.catalog import _Loader, ModelCatalog
from localai_tw.frontend.api.openai.requests import ModelView
from localai_tw.localai.templates import (
    ChatMessage,
    PromptTemplates,
    TemplateError,
    render_chat,
    render_completion,
)

GALLERY = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "localai-gallery")
CONVERSATION = [
    ChatMessage("system", "be brief"),
    ChatMessage("user", "weather in Rome?"),
    ChatMessage("assistant", "", tool_calls='[{"id":"c1","type":"function","function":'
                                            '{"name":"weather","arguments":"{\\"city\\":'
                                            '\\"Rome\\"}"}}]'),
    ChatMessage("tool", "sunny", name="weather", tool_call_id="c1"),
    ChatMessage("user", "thanks"),
]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"}}}}}]


def gallery_entries() -> dict[str, str]:
    entries = {}
    for fname in sorted(os.listdir(GALLERY)):
        if fname.endswith(".yaml"):
            with open(os.path.join(GALLERY, fname), encoding="utf-8") as f:
                entry = yaml.safe_load(f)
            if isinstance(entry, dict) and "config_file" in entry:
                entries[fname] = entry["config_file"]
    return entries


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    models_dir = tmp_path_factory.mktemp("models")
    for fname, text in gallery_entries().items():
        (models_dir / fname).write_text(text, encoding="utf-8")
    return ModelCatalog(str(models_dir), check_interval=3600)


def test_every_gallery_config_loads(catalog):
    assert len(gallery_entries()) == 81
    assert catalog.errors == {}
    assert len(catalog.models()) == 81
    transformers = [m for m in catalog.models() if m.model_options.get("Type")]
    assert transformers, "the gallery's `type:` must reach ModelOptions.Type"
    assert any(m.predict_options.get("StopPrompts") for m in catalog.models())


def render_one(kind: str, text: str) -> str:
    """Render ``text`` as a ``template.function``: the whole prompt when a request's tools are
    shown to the model (``render_chat`` with tools, the path chat requests take)."""
    if kind == "function":
        templates = PromptTemplates.from_config({"function": text})
        return render_chat(templates, CONVERSATION, TOOLS).prompt
    raise AssertionError(kind)


def measure(catalog) -> tuple[dict, dict]:
    rendered: dict[str, int] = {}
    refused: dict[tuple[str, str], str] = {}
    for config in catalog.models():
        for kind in ("chat", "chat_message", "completion"):
            if not getattr(config.template, kind):
                continue
            try:
                # each template on its own (a model's templates are validated together, so
                # one refused template refuses its model's chat and completion requests),
                # and even where use_tokenizer_template leaves them unused
                templates = PromptTemplates.from_config(
                    {kind: getattr(config.template, kind),
                     "join_chat_messages_by_character":
                         config.template.join_chat_messages_by_character},
                    roles=config.roles, system_prompt=config.system_prompt)
                if kind == "completion":
                    out = render_completion(templates, "Once upon a time")
                else:
                    out = render_chat(templates, CONVERSATION).prompt
                assert isinstance(out, str) and out
                rendered[kind] = rendered.get(kind, 0) + 1
            except TemplateError as e:
                refused[(config.source, kind)] = str(e)
        with open(os.path.join(catalog.models_dir, config.source), encoding="utf-8") as f:
            function = (yaml.load(f, Loader=_Loader).get("template") or {}).get("function")
        if function:
            try:
                assert "weather" in render_one("function", function)
                rendered["function"] = rendered.get("function", 0) + 1
            except TemplateError as e:
                refused[(config.source, "function")] = str(e)
    return rendered, refused


def test_every_gallery_template_renders_or_is_refused_naming_the_construct(catalog):
    rendered, refused = measure(catalog)
    assert rendered == {"chat": 44, "chat_message": 38, "completion": 42, "function": 29}
    # {{-.Input}}: Go also needs a space after "{{-"; refused when that template is used
    assert refused == {
        ("smolvlm.yaml", "completion"):
            "template.completion: unsupported syntax '-.Input' in {{-.Input}}",
    }


def test_one_bad_template_does_not_block_the_models_others(catalog):
    templates = ModelView.of(catalog.get("smolvlm")).templates
    assert render_chat(templates, [ChatMessage("user", "hi")]).prompt == \
        "<|im_start|>\nUser: hi<end_of_utterance>\nAssistant: "
    with pytest.raises(TemplateError, match="template.completion: unsupported syntax"):
        render_completion(templates, "Once upon a time")


def test_a_template_failing_on_its_data_is_left_out_as_localai_does():
    # LocalAI's evaluator: a chat_message template that fails renders that message without
    # it (index of a tool_calls list by "name"), a prompt template that fails leaves the
    # joined messages as the prompt (a function template reading .RoleName)
    message = PromptTemplates.from_config({
        "chat_message": '{{if .FunctionCall}}{{index .FunctionCall "name"}}{{else}}'
                        '{{.RoleName}}: {{.Content}}{{end}}'})
    prompt = render_chat(message, CONVERSATION[1:3]).prompt
    assert prompt == "user: weather in Rome?\n" + CONVERSATION[2].tool_calls
    function = PromptTemplates.from_config({"function": "<{{.RoleName}}>{{.Input}}",
                                            "chat": "chat: {{.Input}}"})
    assert render_chat(function, CONVERSATION[1:2], TOOLS).prompt == "weather in Rome?"
    assert render_chat(function, CONVERSATION[1:2]).prompt == "chat: weather in Rome?"


def test_a_chatml_gallery_model_renders_tool_calls_as_json(catalog):
    templates = ModelView.of(catalog.get("chatml")).templates
    prompt = render_chat(templates, CONVERSATION).prompt
    assert '{"function":{"arguments":"{\\"city\\":\\"Rome\\"}","name":"weather"},' \
        '"id":"c1","type":"function"}' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_gallery_use_cases_add_to_the_guess_as_localai_does(catalog):
    from localai_tw.localai.usecases import usecases

    chat_listed = [c for c in catalog.models() if c.known_usecases == ("chat",)]
    assert chat_listed, "the gallery has chat-only listed configs"
    for config in catalog.models():
        found = usecases(config)
        assert set(config.known_usecases or ()) <= found, config.source
        if config.backend == "llama-cpp" and not config.embeddings and \
                not {"score", "token_classify"} & set(config.known_usecases or ()):
            # listed for chat only, a completion still goes to llama.cpp (issue 22 §5)
            assert {"chat", "completion"} <= found, config.source
