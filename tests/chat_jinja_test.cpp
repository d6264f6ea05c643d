// The Jinja interpreter: expected outputs are what Python jinja2 renders in transformers'
// environment (tests/python/test_chat_template_jinja.py checks the same ground against jinja2
// itself); here the unit-level contracts: values, whitespace rules, scoping, errors with location.
#include <gtest/gtest.h>

#include <chrono>

#include "chat/chat_template.h"
#include "chat/jinja.h"

namespace ds::jinja {
namespace {

using ojson = nlohmann::ordered_json;

std::string render(const std::string& tmpl, const std::string& vars_json = "{}") {
  Value v = Value::from_json(ojson::parse(vars_json));
  return Template(tmpl).render(v.as_dict());
}

TEST(JinjaValue, PythonFloatRepr) {
  EXPECT_EQ(python_float_repr(1.0), "1.0");
  EXPECT_EQ(python_float_repr(0.1), "0.1");
  EXPECT_EQ(python_float_repr(1e16), "1e+16");
  EXPECT_EQ(python_float_repr(1e15), "1000000000000000.0");
  EXPECT_EQ(python_float_repr(0.0001), "0.0001");
  EXPECT_EQ(python_float_repr(0.00001), "1e-05");
  EXPECT_EQ(python_float_repr(1.5e-7), "1.5e-07");
  EXPECT_EQ(python_float_repr(-0.0), "-0.0");
  EXPECT_EQ(python_float_repr(123456789.125), "123456789.125");
  EXPECT_EQ(python_float_repr(1e300 * 1e10), "inf");
}

TEST(JinjaValue, StrReprAndJson) {
  Value v = Value::from_json(
      ojson::parse(R"({"b": [1, 2.0, null, true, "it's"], "a": {"x": "\"q\" é\u2028\n"}})"));
  EXPECT_EQ(v.str(), R"({'b': [1, 2.0, None, True, "it's"], 'a': {'x': '"q" é\u2028\n'}})");
  EXPECT_EQ(v.to_json(JsonOptions{}),
            "{\"b\": [1, 2.0, null, true, \"it's\"], \"a\": {\"x\": \"\\\"q\\\" é\u2028\\n\"}}");
  JsonOptions pretty;
  pretty.pretty = true;
  pretty.indent = "  ";
  pretty.item_sep = ",";
  EXPECT_EQ(Value::from_json(ojson::parse(R"({"a": [1, {}], "b": []})")).to_json(pretty),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
  EXPECT_THROW(Value().to_json(JsonOptions{}), Error);
}

TEST(JinjaValue, EqualityAndOrder) {
  EXPECT_TRUE(values_equal(Value::integer(1), Value::floating(1.0)));
  EXPECT_TRUE(values_equal(Value::integer(1), Value::boolean(true)));
  EXPECT_FALSE(values_equal(Value::string("1"), Value::integer(1)));
  EXPECT_FALSE(
      values_equal(Value::list({Value::integer(1)}, true), Value::list({Value::integer(1)})));
  EXPECT_LT(compare_values(Value::string("a"), Value::string("b")), 0);
  EXPECT_THROW(compare_values(Value::string("a"), Value::integer(1)), Error);
}

TEST(Jinja, WhitespaceControlAsHF) {
  EXPECT_EQ(render("a\n{% if true %}\nb\n{% endif %}\nc\n"),
            "a\nb\nc");  // trim_blocks, trailing \n dropped
  EXPECT_EQ(render("  {% if true %}\n    x\n  {% endif %}\n  y"), "    x\n  y");  // lstrip_blocks
  EXPECT_EQ(render("a  {% if true %}b{% endif %}"), "a  b");  // lstrip only at line start
  EXPECT_EQ(render("{%- if true -%}\n  x  \n{%- endif -%}\n  y"), "xy");
  EXPECT_EQ(render("a\n  {{- 'b' -}}  \nc"), "abc");
  EXPECT_EQ(render("{% if true +%}\nk{%+ if true %} l{% endif %}{% endif %}"), "\nk l");
  EXPECT_EQ(render("x {# c #}\ny{#- s -#}   w"), "x yw");  // trim_blocks applies to comments
  EXPECT_EQ(render("{% raw %}{{ x }}{% endraw %}"), "{{ x }}");
  EXPECT_EQ(render("a\r\nb\rc"), "a\nb\nc");
}

TEST(Jinja, LoopsScopesNamespaces) {
  EXPECT_EQ(render("{% for a in [1,2,3] %}{{ loop.previtem }}/{{ loop.nextitem }};{% endfor %}"),
            "/2;1/3;2/;");
  EXPECT_EQ(
      render("{% set x = 5 %}{% for i in [1, 2] %}[{{ x }}]{% set x = i %}{% endfor %}{{ x }}"),
      "[5][5]5");
  EXPECT_EQ(
      render("{% for i in [1, 2] %}{% if i == 2 %}[{{ x }}]{% endif %}{% set x = i %}{% endfor %}"),
      "[]");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i "
                   "%}{% endfor %}{{ ns.n }}"),
            "6");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 "
                   "%}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "0134");
  EXPECT_EQ(
      render("{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}", R"({"d": {"b": 1, "a": 2}})"),
      "b=1;a=2;");
  EXPECT_EQ(render("{% for m in ms[::-1] %}{{ m }}{% endfor %}", R"({"ms": [1, 2, 3]})"), "321");
}

TEST(Jinja, MacrosSeeCallTimeGlobals) {
  EXPECT_EQ(render("{% macro m(a, b=2) %}{{a}}-{{b}}-{{ g }}{% endmacro %}{% set g = 1 %}{{ m(1) "
                   "}}{% set g = 3 %}{{ m(4, b=5) }}"),
            "1-2-14-5-3");
  EXPECT_EQ(
      render(
          "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"),
      "321");
}

TEST(Jinja, UndefinedSemantics) {
  EXPECT_EQ(render("[{{ u }}]{{ u is defined }}{{ u|length }}{{ u is iterable }}{{ 'x' in u }}"),
            "[]False0TrueFalse");
  EXPECT_EQ(render("{{ d.missing }}|{{ l[5] }}|{{ 'abc'.nope }}", R"({"d": {}, "l": []})"), "||");
  try {
    render("line one\n{{ d.content.startswith('x') }}", R"({"d": {}})");
    FAIL() << "expected an error";
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.line(), 2);
    EXPECT_NE(std::string(e.what()).find("'dict object' has no attribute 'content'"),
              std::string::npos)
        << e.what();
  }
}

TEST(Jinja, RaiseExceptionMessageIsExact) {
  try {
    render("{{ raise_exception('No user query found in messages.') }}");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_TRUE(e.raised_by_template());
    EXPECT_STREQ(e.what(), "No user query found in messages.");
  }
}

TEST(Jinja, UnsupportedConstructsFailAtParseWithLocation) {
  auto parse_error = [](const std::string& src) -> std::pair<int, int> {
    try {
      Template t(src);
    } catch (const TemplateError& e) {
      return {e.line(), e.column()};
    }
    return {0, 0};
  };
  EXPECT_EQ(parse_error("ab\n  {{ x|nosuchfilter }}"), (std::pair<int, int>{2, 8}));
  EXPECT_EQ(parse_error("{{ x is nosuchtest }}").first, 1);
  EXPECT_EQ(parse_error("\n\n{% include 'x' %}").first, 3);
  EXPECT_EQ(parse_error("{% if x %}").first, 1);
  EXPECT_EQ(parse_error("{{ 'open }}").first, 1);
  EXPECT_EQ(parse_error("{% break %}").first, 1);
}

TEST(Jinja, StringMethodsAndFilters) {
  EXPECT_EQ(render("{{ ' a  b '.split() }}|{{ 'a,b'.split(',') }}|{{ '\n\nx\n'.lstrip('\n') }}|{{ "
                   "'x\n\n'.rstrip('\n') }}"),
            "['a', 'b']|['a', 'b']|x\n|x");
  EXPECT_EQ(render("{{ s[1:3] }}|{{ s|length }}|{{ s[-1] }}", R"({"s": "héllo"})"), "él|5|o");
  EXPECT_EQ(render("{{ '\u3000x '|trim }}|{{ [1,2]|tojson }}|{{ {'a': 'é'}|tojson }}"),
            "x|[1, 2]|{\"a\": \"é\"}");
  EXPECT_EQ(render("{{ x | tojson | safe if x is mapping else x | string }}", R"({"x": true})"),
            "True");
}

TEST(ChatTemplate, NormalisesLikeTransformers) {
  ChatTemplate t = ChatTemplate::from_string(
      "{% for m in messages %}{{ m|tojson }}\n{% endfor %}{{ eos_token }}|{{ tools }}|{{ "
      "add_generation_prompt }}",
      ojson::parse(R"({"eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}})"));
  ojson req = ojson::parse(R"({"messages": [{"role": "user", "content": null, "name": "x"},
                                            {"role": "assistant", "content": "a", "reasoning": "r"}]})");
  EXPECT_EQ(t.render(req),
            "{\"role\": \"user\", \"name\": \"x\"}\n"
            "{\"thinking\": \"r\", \"role\": \"assistant\", \"content\": \"a\", \"reasoning\": "
            "\"r\", \"reasoning_content\": \"r\"}\n"
            "<|im_end|>|None|False");
  EXPECT_THROW(t.render(ojson::parse(R"({"messages": []})")), Error);
  EXPECT_THROW(t.render(ojson::parse(R"({"messages": "x"})")), Error);
  EXPECT_THROW(t.render(ojson::parse(R"({"messages": [1]})")), Error);
}

}  // namespace
}  // namespace ds::jinja

namespace ds::jinja {
namespace {

// Robustness: mutated real templates and random token soups must either render or throw
// TemplateError / Error, never crash or hang.
// Nested loops whose ranges are each within the sandbox's cap still end: a render runs at most
// 2,000,000 loop iterations (this one ran for minutes on a request thread), then fails cleanly.
TEST(Jinja, NestedLoopsHaveABudget) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    render("{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}");
    ADD_FAILURE() << "100M iterations rendered";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loop iterations"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  // Within the budget: fine.
  EXPECT_EQ(render("{% for a in range(1000) %}{% for b in range(1000) %}{% endfor %}{% endfor %}ok"),
            "ok");
}

TEST(Jinja, MutatedTemplatesFailCleanly) {
  std::string base =
      "{%- set ns = namespace(a=1) %}{% macro m(x, y=2) %}{{ x ~ y }}{% endmacro %}"
      "{% for msg in messages[::-1] if msg.role != 'x' %}{{ loop.index }}{{ m(msg.content|trim, "
      "y=ns.a) }}"
      "{% if msg.content is string and 'a' in msg.content %}{% set ns.a = ns.a + 1 %}{% elif not "
      "msg %}"
      "{{ raise_exception('boom') }}{% else %}{{ msg|tojson(indent=2) }}{% endif %}{% endfor %}"
      "{{ (tools or [])|length }}{{ {'k': [1, 2.5, none]}['k'][1:] }}{{ 'a,b'.split(',')|join('-') "
      "}}";
  const char* pieces[] = {"{{", "}}",  "{%", "%}",    "{#",     "#}",    "-",   "+",     "(",
                          ")",  "[",   "]",  "{",     "}",      "'",     "\"",  "|",     ".",
                          ",",  ":",   "if", "for",   "endfor", "endif", "set", "macro", "in",
                          "is", "not", "~",  "*",     "**",     "//",    "%",   "\\",    "\n",
                          " ",  "x",   "1",  "1.5e3", "none",   "loop",  "ns"};
  Value msgs = Value::from_json(
      ojson::parse(R"([{"role": "user", "content": " abc "}, {"role": "assistant"}])"));
  Dict vars;
  vars.set("messages", msgs);
  uint64_t rng = 12345;
  auto next = [&rng](uint64_t n) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<size_t>((rng >> 33) % n);
  };
  int rendered = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string t = base;
    int edits = 1 + static_cast<int>(next(4));
    for (int k = 0; k < edits; ++k) {
      size_t pos = next(t.size() + 1);
      switch (next(3)) {
        case 0:
          t.insert(pos, pieces[next(sizeof(pieces) / sizeof(pieces[0]))]);
          break;
        case 1:
          t.erase(pos, next(6));
          break;
        default:
          t.insert(pos, 1, static_cast<char>(next(256)));
          break;
      }
    }
    try {
      Template tmpl(t);
      tmpl.render(vars);
      ++rendered;
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rendered, 100);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace ds::jinja
