"""Prompt templates: the Go text/template subset, LocalAI's chat/completion rendering rules,
and refusal of everything outside the subset.  Pure functions; no I/O."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from localai_tw.localai.model_config import ModelTemplate
from localai_tw.localai.templates import (
    ChatMessage,
    PromptTemplates,
    TemplateError,
    compile_template,
    render_chat,
    render_completion,
    template_fields,
)

CHATML_MESSAGE = (
    '<|im_start|>{{if eq .RoleName "assistant"}}assistant{{else if eq .RoleName "system"}}'
    'system{{else if eq .RoleName "tool"}}tool{{else if eq .RoleName "user"}}user{{end}}\n'
    "{{ if .Content -}}\n{{.Content}}\n{{ end -}}<|im_end|>"
)


def render(text, **data):
    return compile_template(text).render(data)


@pytest.mark.parametrize("text, data, expected", [
    ("{{.Input}}", {"Input": "x"}, "x"),
    ("a {{ .Input }} b", {"Input": "x"}, "a x b"),
    ("a  {{- .Input -}}  b", {"Input": "x"}, "axb"),
    ("a {{-.Input}}", {"Input": "x"}, None),  # Go wants a space after a trim marker
    ("{{if .A}}yes{{else}}no{{end}}", {"A": ""}, "no"),
    ("{{if .A}}yes{{else}}no{{end}}", {"A": "z"}, "yes"),
    ("{{if not .A}}none{{end}}", {"A": 0}, "none"),
    ("{{if eq .N 0}}first{{end}}", {"N": 0}, "first"),
    ("{{if eq .R \"a\" \"b\"}}ab{{end}}", {"R": "b"}, "ab"),
    ("{{if ne .R `a`}}not a{{end}}", {"R": "b"}, "not a"),
    ("{{if and .A (or .B .C)}}ok{{end}}", {"A": 1, "B": "", "C": True}, "ok"),
    ("{{if .A}}{{if .B}}ab{{else}}a{{end}}{{end}}", {"A": 1, "B": 0}, "a"),
    ("{{.Flag}} {{.Nothing}}", {"Flag": True, "Nothing": None}, "true "),
    ("x{{/* a comment */}}y", {}, "xy"),
    ("{{\"quoted\\n\"}}", {}, "quoted\n"),
    ("{{{{.A}}", {"A": "b"}, None),
    # range, with, variables, field chains and the helpers LocalAI's gallery calls
    ("{{range .L}}[{{.}}]{{else}}none{{end}}", {"L": ["a", "b"]}, "[a][b]"),
    ("{{range .L}}x{{else}}none{{end}}", {"L": []}, "none"),
    ("{{range $i, $v := .L}}{{$i}}={{$v}};{{end}}", {"L": ["a", "b"]}, "0=a;1=b;"),
    ("{{range $k, $v := .M}}{{$k}}:{{index $v \"t\"}} {{end}}",
     {"M": {"b": {"t": "int"}, "a": {"t": "str"}}}, "a:str b:int "),
    ("{{range .F}}{{.Name}}({{toJson .Parameters}}){{end}}",
     {"F": [{"Name": "f", "Parameters": {"b": 1, "a": "<x>"}}]},
     'f({"a":"\\u003cx\\u003e","b":1})'),
    ("{{$t := \"\"}}{{range .F}}{{$t = print $t .N \" \"}}{{end}}{{$t}}",
     {"F": [{"N": "a"}, {"N": "b"}]}, "a b "),
    ("{{with .A}}{{.B}}{{else}}no{{end}}", {"A": {"B": "in"}}, "in"),
    ("{{with .A}}{{.B}}{{else}}no{{end}}", {"A": None}, "no"),
    ("{{.A.B}} {{add1 .N}} {{len .L}} {{if lt .N 3}}small{{end}}",
     {"A": {"B": "x"}, "N": 1, "L": [1, 2]}, "x 2 2 small"),
    ("{{range .L}}{{$.Top}}{{end}}", {"L": [1, 2], "Top": "t"}, "tt"),
    ("<f>{{`{{\"k\": 1}}`}}</f>", {}, '<f>{{"k": 1}}</f>'),
    ('{{"}}"}}', {}, "}}"),
    ("{{.__class__.__mro__}}", {"A": 1}, None),
    ("{{.A.__class__}}", {"A": {}}, ""),
    ("{{.A.B}}", {"A": "text"}, None),
    ("{{$x}}", {}, None),
    ("{{range .A}}{{end}}", {"A": "text"}, None),
    ("{{index .L 5}}", {"L": [1]}, None),
])
def test_template_subset(text, data, expected):
    if expected is None:
        with pytest.raises(TemplateError):
            compile_template(text).render(data)
        return
    assert render(text, **data) == expected


@pytest.mark.parametrize("text", [
    "{{define \"x\"}}{{end}}", "{{range .A}}{{break}}{{end}}", "{{with .A}}{{else if .B}}{{end}}",
    "{{template \"x\"}}", "{{.A | printf \"%s\"}}", "{{$x := }}", "{{range $a, := .A}}{{end}}",
    "{{call .F}}", "{{index}}", "{{printf \"%s\" .A}}", "{{if .A}}", "{{end}}",
    "{{else}}", "{{if .A}}{{else}}{{else}}{{end}}", "{{.A", "{{}}", "{{not}}",
    "{{eq .A}}", "{{(.A}}", "{{\"bad \\q escape\"}}", "{{/* unterminated }}",
    "{{__import__}}", "{{range .A}}", "{{toJson}}", "{{-.Input}}",
])
def test_everything_outside_the_subset_is_refused_at_compile_time(text):
    with pytest.raises(TemplateError):
        compile_template(text)


def test_unknown_fields_are_refused_when_rendered_with_the_allowed_names():
    with pytest.raises(TemplateError) as refused:
        render("{{.Secret}}", Input="x")
    assert ".Secret" in str(refused.value) and ".Input" in str(refused.value)


def test_deep_nesting_is_bounded():
    with pytest.raises(TemplateError):
        compile_template("{{if .A}}" * 40 + "{{end}}" * 40)
    with pytest.raises(TemplateError):
        compile_template("{{" + "(" * 40 + ".A" + ")" * 40 + "}}")


def test_template_fields():
    assert template_fields(CHATML_MESSAGE) == {"RoleName", "Content"}


def test_chatml_like_localai():
    templates = PromptTemplates(chat="{{.Input}}\n<|im_start|>assistant\n",
                                chat_message=CHATML_MESSAGE)
    rendered = render_chat(templates, [ChatMessage("system", "be nice"),
                                       ChatMessage("user", "hi"),
                                       ChatMessage("assistant", ""),
                                       ChatMessage("user", "bye")])
    assert rendered.prompt == (
        "<|im_start|>system\nbe nice\n<|im_end|>\n<|im_start|>user\nhi\n<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nbye\n<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert rendered.messages == () and not rendered.use_tokenizer_template


def test_message_fields_index_last_and_role_prefix():
    templates = PromptTemplates(
        chat_message="{{.MessageIndex}}:{{.Role}}{{.Content}}{{if .LastMessage}}!{{end}}",
        roles={"user": "U> "}, join="|")
    rendered = render_chat(templates, [ChatMessage("user", "a"), ChatMessage("bot", "b")])
    assert rendered.prompt == "0:U> a|1:b!"


def test_messages_a_chat_message_template_renders_empty_are_skipped():
    templates = PromptTemplates(chat_message="{{if .Content}}{{.Content}}{{end}}")
    rendered = render_chat(templates, [ChatMessage("user", "a"), ChatMessage("user", ""),
                                       ChatMessage("user", "c")])
    assert rendered.prompt == "a\nc"


def test_without_templates_the_joined_text_is_the_prompt_with_role_prefixes():
    templates = PromptTemplates(roles={"user": "User: ", "assistant": "AI: "})
    rendered = render_chat(templates, [ChatMessage("user", "hi"),
                                       ChatMessage("assistant", "hello"),
                                       ChatMessage("tool", "42")])
    assert rendered.prompt == "User: hi\nAI: hello\n42"
    assert render_chat(PromptTemplates(), [ChatMessage("user", "x")]).prompt == "x"


def test_tool_calls_are_appended_as_json_without_a_message_template():
    templates = PromptTemplates(roles={"assistant_function_call": "CALL"})
    rendered = render_chat(templates, [ChatMessage("assistant", "", tool_calls='[{"id":1}]')])
    assert rendered.prompt == 'CALL [{"id":1}]'


def test_suppress_system_prompt_and_system_prompt():
    templates = PromptTemplates(
        chat="{{if not .SuppressSystemPrompt}}{{.SystemPrompt}}\n{{end}}{{.Input}}",
        system_prompt="You are terse.")
    assert render_chat(templates, [ChatMessage("user", "q")]).prompt == "You are terse.\nq"
    assert render_chat(templates, [ChatMessage("system", "s"), ChatMessage("user", "q")]
                       ).prompt == "s\nq"


def test_tokenizer_template_sends_messages_and_no_prompt():
    messages = [ChatMessage("user", "hi")]
    rendered = render_chat(PromptTemplates(use_tokenizer_template=True, chat="{{.Input}}X"),
                           messages)
    assert rendered.prompt == "" and rendered.use_tokenizer_template
    assert rendered.messages == tuple(messages)


def test_completion_template_or_raw():
    assert render_completion(PromptTemplates(), "raw {{.Input}}") == "raw {{.Input}}"
    assert render_completion(PromptTemplates(completion="Q: {{.Input}}\nA:"), "2+2") == \
        "Q: 2+2\nA:"


def test_from_config_reads_the_model_config_template_and_validates_it():
    templates = PromptTemplates.from_config(ModelTemplate(chat="<{{.Input}}>"))
    assert render_chat(templates, [ChatMessage("user", "x")]).prompt == "<x>"
    from_mapping = PromptTemplates.from_config(
        {"completion": "{{.Input}}?", "roles": {"user": "U:"},
         "join_chat_messages_by_character": " "})
    assert from_mapping.roles == {"user": "U:"} and from_mapping.join == " "
    assert PromptTemplates.from_config(None) == PromptTemplates()
    # refused when that template is used, naming it (one bad template never blocks others)
    bad = PromptTemplates.from_config({"chat_message": "{{define \"x\"}}{{end}}",
                                       "completion": "<{{.Input}}>"})
    assert render_completion(bad, "x") == "<x>"
    with pytest.raises(TemplateError) as refused:
        render_chat(bad, [ChatMessage("user", "x")])
    assert "template.chat_message" in str(refused.value)


@given(st.text(max_size=200))
def test_user_text_is_never_interpreted(text):
    # Whatever a message holds (template syntax included), it comes out verbatim.
    templates = PromptTemplates(chat="[{{.Input}}]", chat_message="{{.RoleName}}={{.Content}}")
    assert render_chat(templates, [ChatMessage("user", text)]).prompt == f"[user={text}]"
    assert render_completion(PromptTemplates(completion="<{{.Input}}>"), text) == f"<{text}>"


@given(st.text(alphabet="{}.-/*()\"`abcdefgiflsenotudq $|:= \n", max_size=60))
def test_arbitrary_template_text_compiles_or_is_refused_cleanly(text):
    try:
        template = compile_template(text)
    except TemplateError:
        return
    try:
        template.render({"a": "x"})
    except TemplateError:
        pass


def test_range_work_and_output_are_bounded():
    nested = "{{range .L}}{{range $.L}}{{range $.L}}x{{end}}{{end}}{{end}}"
    with pytest.raises(TemplateError, match="more than"):
        compile_template(nested).render({"L": list(range(100))})
    with pytest.raises(TemplateError, match="exceed"):
        compile_template("{{range .L}}{{$.Big}}{{end}}").render(
            {"L": list(range(100)), "Big": "y" * 100_000})


def test_tool_calls_are_data_for_to_json_and_range_and_print_as_their_json():
    calls = '[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]'
    templates = PromptTemplates(chat_message=(
        "{{.RoleName}}:{{toJson .FunctionCall}}|{{.FunctionCall}}|"
        "{{range .FunctionCall}}{{.function.name}}{{end}}"))
    rendered = render_chat(templates, [ChatMessage("assistant", "", tool_calls=calls)])
    assert rendered.prompt == (
        'assistant:[{"function":{"arguments":"{}","name":"f"},"id":"c1","type":"function"}]|'
        + calls + "|f")


@pytest.mark.parametrize("text", ["{" * 65000, '{{"' * 20000, "{{ `" * 15000, "x}}" * 20000])
def test_finding_actions_is_linear(text):
    # The former regular expression rescanned to the end from every "{{": 90 s for 64 KiB of "{".
    started = time.monotonic()
    try:
        compile_template(text)
    except TemplateError:
        pass
    assert time.monotonic() - started < 2.0


def test_a_variable_doubled_in_a_loop_is_bounded():
    with pytest.raises(TemplateError, match="exceed|functions handle more than"):
        compile_template('{{$t := "xxxxxxxx"}}{{range 64}}{{$t = print $t $t}}{{end}}').render({})
def test_a_guessed_tokenizer_template_also_sends_the_plain_prompt():
    """A guessed template (a llama-cpp config with none) sends the messages for the GGUF's
    template and the joined text for a file without one; a written one sends no prompt."""
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    guessed = PromptTemplates.from_config({"use_tokenizer_template": True,
                                           "tokenizer_template_guessed": True})
    out = render_chat(guessed, messages)
    assert out.use_tokenizer_template and out.messages == tuple(messages)
    assert out.prompt == "be brief\nhi"
    written = render_chat(PromptTemplates.from_config({"use_tokenizer_template": True}),
                          messages)
    assert written.use_tokenizer_template and written.prompt == ""


@pytest.mark.parametrize("body", ["{{$x := toJson $.Input}}", "{{if eq $.Input $.Input}}{{end}}",
                                  "{{$x := print $.Input}}"])
def test_function_calls_in_a_loop_are_bounded_by_the_text_they_handle(body):
    # Issue 21 §1: toJson of a 100 KB prompt a million times emits nothing, so the output bound
    # never fired: 77 s on the reactor.  Now every call costs its text, 8 Mi characters in all.
    template = compile_template("{{range $i := 1000000}}" + body + "{{end}}done")
    with pytest.raises(TemplateError, match="functions handle more than 8388608 characters"):
        template.render({"Input": "x" * 100_000})
    assert compile_template("{{range $i := 3}}" + body + "{{end}}done").render(
        {"Input": "x" * 100_000}) == "done"


def test_nested_empty_ranges_count_their_iterations():
    # Issue 21 §1: an empty range body ran no action, so this nest iterated 60 million times
    # (51 s on the reactor) under a 200 000-action bound.
    with pytest.raises(TemplateError, match="runs more than 50000 actions"):
        compile_template("{{range $i := 300}}{{range $j := 200000}}{{end}}{{end}}").render({})
    assert compile_template("{{range $i := 3}}{{range $j := 4}}{{end}}{{end}}ok").render({}) \
        == "ok"


def test_one_budget_for_every_message_of_a_conversation():
    # chat_message renders once per message: 40 000 iterations each is within the bound for
    # one message, and the conversation's renderings share it.
    templates = PromptTemplates(chat_message="{{range $i := 40000}}{{end}}{{.Content}}")
    one = render_chat(templates, [ChatMessage(role="user", content="hi")])
    assert one.prompt == "hi"
    with pytest.raises(TemplateError, match="runs more than 50000 actions"):
        render_chat(templates, [ChatMessage(role="user", content="hi")] * 2)
