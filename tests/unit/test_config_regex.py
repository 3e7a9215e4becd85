"""Model-config regexes are RE2 (Go's regexp): linear in the text, Go's semantics, and an
expression RE2 cannot take is a config error naming the key when the file loads (issue 21 §1)."""

from __future__ import annotations


import pytest
import re2

from localai_tw.localai.configregex import (
    MAX_MATCHES,
    ConfigRegex,
    GoTemplate,
    RegexError,
)
from localai_tw.localai.model_config import ModelConfigError, parse_model_config
from localai_tw.localai.toolcalls import FunctionConfig, clean_content, parse_tool_calls


def _config(function: dict) -> FunctionConfig:
    return parse_model_config({"name": "m", "backend": "echo", "function": function},
                              "m.yaml").functions


@pytest.mark.parametrize("key, field", [
    ("response_regex", "function.response_regex[0]"),
    ("json_regex_match", "function.json_regex_match[0]"),
])
@pytest.mark.parametrize("pattern, words", [
    (r"(a)\1", "backreferences and lookaround are not RE2"),
    (r"a(?=b)", "backreferences and lookaround are not RE2"),
    (r"(?<=a)b", "backreferences and lookaround are not RE2"),
    (r"(?P<n>a)(?P=n)", "RE2"),
    (".{1000}.{1000}.{1000}", "RE2 instructions"),
    ("x" * 1025, "1 to 1024 characters"),
])
def test_an_expression_re2_cannot_take_refuses_the_file_naming_the_key(key, field, pattern,
                                                                        words):
    with pytest.raises(ModelConfigError) as caught:
        _config({key: [pattern]})
    assert caught.value.field == field
    assert words in str(caught.value)
    assert str(caught.value).startswith(f"m.yaml: {field}: ")


def test_a_replacement_key_re2_cannot_take_names_its_key():
    with pytest.raises(ModelConfigError, match=r"m.yaml: function.replace_llm_results\[1\]"
                                               r"\.key: .*lookaround"):
        _config({"replace_llm_results": [{"key": "a", "value": ""},
                                         {"key": "(?!x)y", "value": ""}]})


def test_catastrophic_backtracking_patterns_run_in_linear_time():
    # With Python's re, ^(a+)+$ against 28 characters of output froze a replica for 8 s, and
    # each two characters more multiplied that by 4.  A config's expressions run on RE2, whose
    # matching is linear: these inputs would take Python's re longer than the age of the
    # universe, so a regression does not go unnoticed (the run's timeout ends it) and no clock
    # is read here.
    config = _config({"response_regex": [r"^(?P<name>(a+)+)$"],
                      "replace_function_results": [{"key": r"^(x+x+)+y", "value": ""}]})
    assert all(isinstance(regex._regex, type(re2.compile("x")))
               for regex in [ConfigRegex(r"^(a+)+$"), ConfigRegex(r"^(x+x+)+y")])
    parsed = parse_tool_calls("a" * 200 + "!", config, None)
    assert clean_content("x" * 5000, config) == "x" * 5000
    parse_tool_calls("x" * 200 + "!", config, None)
    assert parsed.calls == ()


def test_go_semantics_dot_and_dollar():
    # "." stops at a newline unless (?s); "$" is the end of the text, not before a final "\n".
    assert [m.group(1) for m in ConfigRegex(r"<a>(.*)</a>").finditer("<a>x\ny</a>")] == []
    assert [m.group(1) for m in ConfigRegex(r"(?s)<a>(.*)</a>").finditer("<a>x\ny</a>")] == \
        ["x\ny"]
    assert list(ConfigRegex(r"b$").finditer("ab\n")) == []
    assert len(list(ConfigRegex(r"(?m)b$").finditer("ab\n"))) == 1
    # leftmost-first, as Go (not POSIX leftmost-longest)
    assert [m.group() for m in ConfigRegex(r"a|ab").finditer("ab")] == ["a"]


@pytest.mark.parametrize("template, expected", [
    ("[$1]", "[k]"),
    ("[${2}]", "[v]"),
    ("[${key}:${val}]", "[k:v]"),
    ("[$key:$val]", "[k:v]"),
    ("[$1x]", "[]"),            # Go: the group named "1x", which does not exist
    ("[${nope}]", "[]"),
    ("[$$1]", "[$1]"),
    ("[$]", "[$]"),
    ("[${1]", "[${1]"),
    (r"[\1]", r"[\1]"),         # no Python escapes: a backslash is a backslash
])
def test_replacements_are_gos_templates(template, expected):
    regex = ConfigRegex(r"(?P<key>\w)=(?P<val>\w)")
    assert regex.sub(GoTemplate(template), "<k=v>") == f"<{expected}>"


def test_replacements_and_json_regex_match_in_a_config():
    config = _config({
        "json_regex_match": [r"(?s)<calls>(.*?)</calls>"],
        "replace_function_results": [{"key": r"(?s)^[^<]*", "value": ""}],
        "replace_llm_results": [{"key": r"(?s)<think>(.*?)</think>", "value": "($1)"}],
    })
    parsed = parse_tool_calls('noise <calls>{"name": "f", "arguments": {"a": 1}}</calls>',
                              config, ["f"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", '{"a":1}')]
    assert clean_content("<think>hm</think>ok", config) == "(hm)ok"


def test_at_most_max_matches_are_used():
    regex = ConfigRegex("x")
    assert len(list(regex.finditer("x" * (MAX_MATCHES * 3)))) == MAX_MATCHES
    out = regex.sub(GoTemplate("y"), "x" * (MAX_MATCHES + 5))
    assert out == "y" * MAX_MATCHES + "x" * 5


def test_non_ascii_text_keeps_character_offsets():
    regex = ConfigRegex(r"(?s)<c>(.*?)</c>")
    text = "été <c>ü€</c> ñ"
    match = next(regex.finditer(text))
    assert match.group(1) == "ü€"
    assert text[match.span()[0]:match.span()[1]] == "<c>ü€</c>"
    assert regex.sub(GoTemplate("[$1]"), text) == "été [ü€] ñ"


def test_every_regex_of_localais_gallery_compiles():
    # The expressions LocalAI's own gallery configs use (tests/fixtures/localai-gallery).
    for pattern in [r"(?s)<tool_call>(.*?)</tool_call>", r"(?s)<tool_call>(.*)",
                    r"\[(?P<name>\w+)\((?P<arguments>.*)\)\]",
                    r"<function=(?P<name>\w+)>(?P<arguments>.*)</function>",
                    "(?s)<|im_start|>call(.*?)<|im_end|>", r"(?s)^[^{\[]*", r"(?s)[^}\]]*$",
                    r"(?s)<Output>(.*?)</Output>"]:
        ConfigRegex(pattern)


def test_regex_error_is_a_value_error():
    with pytest.raises(ValueError):
        ConfigRegex(r"(?=x)")
    assert issubclass(RegexError, ValueError)


def test_the_projects_own_tag_patterns_do_not_backtrack_on_spaces():
    # "<tool_call>x" then spaces and no closing tag: the old patterns (\s* on both sides of a
    # lazy group) took 11.3 s for 20 000 spaces, quadratic in the spaces a model writes; with
    # 400 000 here they would take over an hour, so a regression is ended by the run's timeout
    # (no clock is read here); the linear patterns read them at once.
    spaces = " " * 400_000
    assert parse_tool_calls("<tool_call>x" + spaces + "y", FunctionConfig(), ["f"]).calls == ()
    called = parse_tool_calls("<function=f>x" + spaces + "y", FunctionConfig(), ["f"]).calls
    assert [call.name for call in called] == ["f"]  # an unclosed tag still names its function
