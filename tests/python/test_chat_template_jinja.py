"""The Jinja interpreter against Python jinja2 in transformers' environment, snippet by snippet.

Each snippet is rendered by `deltaserve chat-template --template FILE` and by the environment
transformers builds (`_compile_jinja_template`: ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, its tojson / raise_exception / namespace). Outputs must be identical;
where jinja2 raises, we must exit 1 (with the same message for raise_exception).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("DS_BUILD_DIR", REPO / "build"))
BIN = BUILD / "bin" / "deltaserve"

pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"{BIN} not built")

MSGS = [{"role": "user", "content": "hi"}]

# (template, extra variables)
SNIPPETS = [
    # whitespace control, trim_blocks, lstrip_blocks
    ("a\n{% if true %}\nb\n{% endif %}\nc\n", {}),
    ("a  {% if true %}  b  {% endif %}  c", {}),
    ("  {% if true %}\n    x\n  {% endif %}\n  y", {}),
    ("{%- if true -%}\n  x  \n{%- endif -%}\n  y", {}),
    ("a\n  {{- 'b' -}}  \nc", {}),
    ("a {{ 'b' }}\n{{ 'c' }}\n", {}),
    ("{% if true +%}\nkeep newline{%+ if true %} lstrip off{% endif %}{% endif %}", {}),
    ("x {# comment #}\ny\n  {# indented comment #}\nz{#- strip -#}   w", {}),
    ("{% raw %}{{ not evaluated }} {% if %}{% endraw %}!", {}),
    ("line1\r\nline2\rline3\n\n", {}),
    ("\t{% for i in range(2) %}\n\t{{ i }}\n\t{% endfor %}\n", {}),
    # literals and output of values
    ("{{ none }}|{{ true }}|{{ 1.0 }}|{{ 1e16 }}|{{ 1e15 }}|{{ 0.0001 }}|{{ 0.00001 }}|{{ -0.0 }}|{{ 3.14159 }}", {}),
    ("{{ [1, 'a', none, true, 1.5, {'k': [1, 2]}] }}|{{ (1,) }}|{{ () }}|{{ ('a', 2) }}", {}),
    ("{{ x }}", {"x": ["quote's", 'dq"', "both'\"", "nl\n", "tab\t", "uni é 中 😀", "\u00a0nbsp", "\x01ctl"]}),
    ("{{ x }}|{{ y }}|{{ z }}", {"x": {"b": 1, "a": [True, None]}, "y": 2.5, "z": -7}),
    ("{{ 'a' 'b' \"c\" }}|{{ 'esc\\n\\t\\\\\\x41\\u00e9' }}|{{ '\\d' }}", {}),
    ("{{ 1_000 }}|{{ 2.5e-3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 7 / 2 }}|{{ 2 ** 10 }}|{{ 2 ** -1 }}|{{ 5.5 % 2 }}", {}),
    ("{{ 1 + 2 * 3 - -1 }}|{{ (1 + 2) * 3 }}|{{ 'ab' * 3 }}|{{ [1] * 2 }}|{{ [1] + [2] }}|{{ 'a' ~ 1 ~ none ~ true }}", {}),
    ("{{ 1 == 1.0 }}|{{ 1 == true }}|{{ 'a' < 'b' }}|{{ [1, 2] < [1, 3] }}|{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ {'a': 1} == {'a': 1} }}", {}),
    ("{{ 'b' in 'abc' }}|{{ 2 in [1, 2] }}|{{ 'k' in {'k': 1} }}|{{ 'z' not in 'abc' }}|{{ 'x' in u }}", {}),
    ("{{ 0 or 'x' }}|{{ 1 and 'y' }}|{{ '' and 'y' }}|{{ not [] }}|{{ not none }}|{{ [] or {} }}", {}),
    ("{{ 'yes' if x else 'no' }}|{{ 'yes' if y }}|{{ 'a' if false else 'b' if true else 'c' }}", {"x": 1, "y": 0}),
    ("{{ -x|abs }}|{{ -(x|abs) }}|{{ x is number and x > 2 }}", {"x": 3}),
    # variables, attribute and item access
    ("{{ d.a }}|{{ d['a'] }}|{{ d.missing }}|{{ d['missing'] }}|{{ l[0] }}|{{ l[-1] }}|{{ l[9] }}|{{ l.0 }}", {"d": {"a": 1}, "l": [1, 2, 3]}),
    ("{{ s[0] }}|{{ s[-1] }}|{{ s[1:3] }}|{{ s[::-1] }}|{{ s[::2] }}|{{ s[-2:] }}|{{ s[:-2] }}|{{ s[5:1:-1] }}", {"s": "héllo wörld"}),
    ("{{ l[::-1] }}|{{ l[1:] }}|{{ l[:1] }}|{{ l[10:] }}|{{ l[-10:2] }}|{{ l[::-2] }}", {"l": [1, 2, 3, 4]}),
    ("{{ d.items() | list }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ d.get('a') }}|{{ d.get('z') }}|{{ d.get('z', 5) }}", {"d": {"a": 1, "b": [2]}}),
    ("{{ d.items is callable }}|{{ d['items'] }}|{{ d.items()|list }}", {"d": {"items": "key not method"}}),
    ("{{ '  a b  '.split(None, 1) }}|{{ '  a b  '.rsplit(None, 1) }}|{{ 'a b c'.split(maxsplit=1) }}", {}),
    ("{{ u }}|{{ u is defined }}|{{ u is undefined }}|{{ u|length }}|{{ u|default('dflt') }}|{{ u|trim }}|{{ u ~ 'x' }}", {}),
    # statements
    ("{% set x = 1 %}{% set y, z = [2, 3] %}{{ x }}{{ y }}{{ z }}", {}),
    ("{% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}up{% endset %}{{ y }}", {}),
    ("{% set x = 5 %}{% for i in [1, 2] %}[{{ x }}]{% set x = i %}{% endfor %}{{ x }}", {}),
    ("{% for i in [1, 2] %}{% if i == 2 %}[{{ x }}]{% endif %}{% set x = i %}{% endfor %}", {}),
    ("{% set ns = namespace(n=0, s='') %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% endfor %}{{ ns.n }} {{ ns.s }}", {}),
    ("{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}", {"l": "abc"}),
    ("{% for x in l %}{{ loop.previtem }}/{{ loop.nextitem }}/{{ loop.cycle('odd', 'even') }};{% endfor %}", {"l": [1, 2, 3]}),
    ("{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1] %}x{% else %}empty{% endfor %}", {}),
    ("{% for x in range(10) if x is odd %}{{ x }}{{ loop.length }},{% endfor %}", {}),
    ("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}", {}),
    ("{% for x in outer %}{% for y in x %}{{ loop.index }}{{ y }}{% endfor %}{{ loop.index }};{% endfor %}", {"outer": [[1, 2], [3]]}),
    ("{% if a %}A{% elif b %}B{% elif c %}C{% else %}D{% endif %}", {"a": 0, "b": "", "c": [0]}),
    ("{% macro m(a, b=2, c=none) %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }}|{{ m(1, 3) }}|{{ m(1, c=4) }}|{{ m() }}", {}),
    ("{% macro m(x) %}{{ g }}{{ x }}{% endmacro %}{% set g = 'G1' %}{{ m(1) }}{% set g = 'G2' %}{{ m(2) }}", {}),
    ("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(4) }}", {}),
    ("{% macro v() %}{{ varargs }}{{ kwargs }}{% endmacro %}{{ v(1, 2, k=3) }}", {}),
    ("{% set c = namespace(v=0) %}{% macro inc() %}{% set c.v = c.v + 1 %}{% endmacro %}{{ inc() }}{{ inc() }}{{ c.v }}", {}),
    ("{% macro m(content) %}\n  {{- content|trim }}\n{% endmacro %}[{{ m('  x  ') }}]|{{ m('a')|length }}", {}),
    ("{% filter upper %}shout {{ 'it' }}{% endfilter %}|{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a }}", {}),
    ("{% generation %}gen {{ 1 }}{% endgeneration %}", {}),
    # filters
    ("{{ ' x '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ '\u3000wide\u3000'|trim }}|{{ 5|string }}|{{ none|string }}|{{ [1]|string }}", {}),
    ("{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ d|tojson(sort_keys=true) }}|{{ d|tojson(separators=(',', ':')) }}", {"d": {"z": [1, 2.5, None, True], "a": {"é": "\u2028\x7f\"\\\n"}, "e": {}, "l": []}}),
    ("{{ d|tojson(ensure_ascii=true) }}|{{ 'x'|tojson }}|{{ 3|tojson }}|{{ none|tojson }}|{{ d|tojson(indent='\t') }}", {"d": {"k": "é😀"}}),
    ("{{ [3, 1, 2]|length }}|{{ 'héllo'|length }}|{{ {'a': 1}|count }}|{{ [1, 2]|first }}|{{ [1, 2]|last }}|{{ 'abc'|first }}|{{ []|first }}", {}),
    ("{{ [1, 2, 3]|join(', ') }}|{{ 'abc'|join('-') }}|{{ users|join(',', attribute='name') }}|{{ [1, 'a']|join }}", {"users": [{"name": "a"}, {"name": "b"}]}),
    ("{{ 'Hello World'|lower }}|{{ 'Hello'|upper }}|{{ 'hello wORLD'|capitalize }}|{{ 'hello-world foo(bar)'|title }}", {}),
    ("{{ x|default('d') }}|{{ ''|default('d') }}|{{ ''|default('d', true) }}|{{ none|default('d') }}|{{ u|d('dd') }}", {"x": 0}),
    ("{{ [3, 1, 2]|sort }}|{{ ['b', 'A', 'c']|sort }}|{{ ['b', 'A', 'c']|sort(case_sensitive=true) }}|{{ [3, 1]|sort(reverse=true) }}", {}),
    ("{{ users|sort(attribute='age')|map(attribute='name')|list }}|{{ users|map(attribute='missing', default='?')|list }}", {"users": [{"name": "a", "age": 30}, {"name": "b", "age": 20}]}),
    ("{{ ['a', 'B']|map('upper')|list }}|{{ [1, 2, 3, 4]|select('odd')|list }}|{{ [1, 2, 3, 4]|reject('even')|list }}|{{ [0, 1, '', 'x']|select|list }}", {}),
    ("{{ users|selectattr('active')|map(attribute='name')|list }}|{{ users|rejectattr('age', 'gt', 25)|map(attribute='name')|join }}", {"users": [{"name": "a", "age": 30, "active": True}, {"name": "b", "age": 20, "active": False}]}),
    ("{{ [1, 2, 1, 3]|unique|list }}|{{ ['a', 'A']|unique|list }}|{{ [1, 2]|reverse|list }}|{{ 'abc'|reverse }}|{{ d|dictsort }}", {"d": {"b": 1, "a": 2}}),
    ("{{ '42'|int }}|{{ 'x'|int }}|{{ 'x'|int(7) }}|{{ 3.9|int }}|{{ '3.5'|float }}|{{ 2|float }}|{{ -3|abs }}|{{ 2.567|round(1) }}|{{ 2.5|round }}|{{ 3|round }}", {}),
    ("{{ [1, 2, 3]|sum }}|{{ [1.5, 2]|sum }}|{{ [3, 1, 2]|max }}|{{ [3, 1, 2]|min }}|{{ ['b', 'a']|max }}", {}),
    ("{{ 'a b'|replace(' ', '_') }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'one two  three'|wordcount }}", {}),
    ("{{ 'x'|center(7) }}|{{ '<a href=\"x\">&</a>'|e }}|{{ [1, 2]|list }}|{{ 'ab'|list }}|{{ d|items|list }}", {"d": {"a": 1}}),
    ("{{ x|safe }}|{{ x|tojson|safe }}|{{ [1]|safe }}", {"x": "<b>"}),
    # tests
    ("{{ 'a' is string }}{{ 1 is string }}{{ 1 is number }}{{ true is number }}{{ 1.5 is number }}{{ 1 is integer }}{{ true is integer }}{{ 1.5 is float }}", {}),
    ("{{ {} is mapping }}{{ [] is mapping }}{{ [] is iterable }}{{ 'a' is iterable }}{{ 1 is iterable }}{{ u is iterable }}{{ {} is iterable }}", {}),
    ("{{ [] is sequence }}{{ 'a' is sequence }}{{ {} is sequence }}{{ 1 is sequence }}{{ none is none }}{{ 0 is none }}{{ u is none }}", {}),
    ("{{ true is boolean }}{{ 1 is boolean }}{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 0 is false }}{{ x is callable }}{{ range is callable }}", {"x": 1}),
    ("{{ 3 is odd }}{{ 3 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 1 is eq 1 }}{{ 1 is ne 2 }}{{ 1 is lt 2 }}{{ 2 is ge 2 }}{{ 'a' is in 'abc' }}", {}),
    ("{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 'aBc' is lower }}{{ none is sameas none }}{{ x is not defined }}{{ 'upper' is filter }}{{ 'odd' is test }}", {}),
    # string methods
    ("{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ ' a b '.rsplit(None, 1) }}", {}),
    ("{{ '  x  '.strip() }}|{{ 'xxyxx'.strip('x') }}|{{ '\n\nx\n'.lstrip('\n') }}|{{ 'x\n\n'.rstrip() }}|{{ 'abcab'.lstrip('ab') }}", {}),
    ("{{ 'hello'.startswith('he') }}{{ 'hello'.endswith('lo') }}{{ 'hello'.startswith(('x', 'h')) }}{{ ''.startswith('') }}", {}),
    ("{{ 'a-b'.replace('-', '+') }}|{{ 'ab'.replace('', '.') }}|{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}{{ 'hi there'.title() }}{{ 'hI'.capitalize() }}", {}),
    ("{{ 'hello'.find('l') }}{{ 'hello'.rfind('l') }}{{ 'hello'.find('z') }}{{ 'hello'.count('l') }}{{ 'héllo'.index('l') }}|{{ ', '.join(['a', 'b']) }}", {}),
    ("{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ ' '.isspace() }}{{ 'a1'.isalnum() }}{{ 'AB'.isupper() }}{{ 'ab'.islower() }}{{ ''.isdigit() }}", {}),
    ("{{ 'a\nb\r\nc'.splitlines() }}|{{ 'prefix_x'.removeprefix('prefix_') }}|{{ 'x.txt'.removesuffix('.txt') }}|{{ '5'.zfill(3) }}|{{ 'a=b=c'.partition('=') }}", {}),
    # globals
    ("{{ range(3)|list }}|{{ range(1, 7, 2)|list }}|{{ range(5, 0, -2)|list }}|{{ dict(a=1, b=2) }}|{{ dict({'x': 1}, y=2) }}", {}),
    ("{{ namespace(a=1).a }}|{% set n = namespace({'k': 'v'}) %}{{ n.k }}", {}),
    # idioms of other models' templates (Llama 3, Mistral, DeepSeek, Gemma)
    ("{{ bos_token ~ '<|h|>' + m['role'] + '<|e|>\n\n' + m['content'] | trim + '<|eot|>' }}", {"bos_token": "<s>", "m": {"role": "user", "content": "  hi  "}}),
    ("{{ parts | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}", {"parts": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}),
    ("{% set loop_messages = ms[1:] %}{% for m in loop_messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{{ m.role[0] }}{% endfor %}", {"ms": [{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "assistant"}]}),
    ("{%- if x is defined and x is not none %}{{ x }}{%- endif %}{{ ms | length > 0 and ms[-1].role == 'user' }}", {"x": 0, "ms": [{"role": "user"}]}),
    ("{% set ns = namespace(found=false) %}{% for m in ms %}{% if m.role == 'system' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.found }}", {"ms": [{"role": "system"}]}),
    ("{{ '[INST] ' + m['content'].strip() + ' [/INST]' if m['role'] == 'user' else m['content'] + eos }}", {"m": {"role": "user", "content": " q "}, "eos": "</s>"}),
    ("{%- for tool in tools %}{{- tool.function.name }}({% for n, p in tool.function.parameters.properties.items() %}{{ n }}: {{ p.type }}{% if not loop.last %}, {% endif %}{% endfor %}){% endfor %}", {"tools": [{"function": {"name": "f", "parameters": {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}}}]}),
    # errors
    ("{{ raise_exception('custom failure: ' ~ x) }}", {"x": 42}),
    ("{{ u.attr }}", {}),
    ("{{ u() }}", {}),
    ("{{ 'a' + 1 }}", {}),
    ("{{ 1 < 'a' }}", {}),
    ("{{ x|items|list }}", {"x": "str"}),
    ("{{ x|tojson }}", {"x": None, "y": 1}),
    ("{{ u|tojson }}", {}),
    ("{% set x = 1 %}{% set x.attr = 2 %}", {}),
    ("{% set n = namespace() %}{% set n._private = 1 %}", {}),
    ("{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
    ("{{ 1 // 0 }}", {}),
    ("{% for x in 5 %}{% endfor %}", {}),
    ("{{ none.attr }}", {}),
    ("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", {}),
    ("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", {}),
    ("{{ ''.split('') }}", {}),
]


@pytest.fixture(scope="module")
def env():
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template


def render_jinja2(compile_fn, template, variables):
    import jinja2

    try:
        t = compile_fn(template)
        kw = {"tools": None, "documents": None, "add_generation_prompt": False, **variables}
        return t.render(messages=MSGS, **kw), None
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        return None, e


@pytest.mark.parametrize("idx", range(len(SNIPPETS)))
def test_snippet(env, idx, tmp_path):
    template, variables = SNIPPETS[idx]
    want, err = render_jinja2(env, template, variables)
    path = tmp_path / "t.jinja"
    path.write_bytes(template.encode())
    request = {"messages": MSGS, **variables}
    res = subprocess.run(
        [str(BIN), "chat-template", "--template", str(path)], input=json.dumps(request).encode(), capture_output=True
    )
    if err is not None:
        assert res.returncode == 1, f"jinja2 raised {type(err).__name__}: {err}; we rendered {res.stdout.decode()!r}"
        if type(err).__name__ == "TemplateError":
            assert str(err) in res.stderr.decode()
        return
    assert res.returncode == 0, f"jinja2 rendered {want!r}; we failed: {res.stderr.decode()}"
    assert res.stdout.decode() == want


# Constructs we reject on purpose (at load time, with line and column), never rendering wrongly.
UNSUPPORTED = [
    ("line1\n{{ x|nosuchfilter }}", "line 2"),
    ("{{ x is nosuchtest }}", "line 1"),
    ("a\nb\n{% include 'other.jinja' %}", "line 3"),
    ("{% for x in y recursive %}{% endfor %}", "recursive"),
    ("{% if x %}unterminated", "endif"),
    ("{{ 'unterminated }}", "line 1"),
    ("{% endfor %}", "endfor"),
    ("{% break %}", "outside of a loop"),
]


@pytest.mark.parametrize("idx", range(len(UNSUPPORTED)))
def test_rejected_with_location(idx, tmp_path):
    template, needle = UNSUPPORTED[idx]
    path = tmp_path / "t.jinja"
    path.write_text(template)
    res = subprocess.run(
        [str(BIN), "chat-template", "--template", str(path)], input=json.dumps({"messages": MSGS}).encode(), capture_output=True
    )
    assert res.returncode == 1
    err = res.stderr.decode()
    assert needle in err and "column" in err, err
