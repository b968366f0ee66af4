"""Chat templates come from the model file: rendering is sandboxed and bounded in time and size."""

import time
import tracemalloc

import pytest

from localkv.errors import ModelError
from localkv.model import chat_template as ct

MESSAGES = [{"role": "user", "content": "hi"}]


def render(source: str) -> str:
    return ct.render(ct.compile_template(source), messages=MESSAGES, add_generation_prompt=True)


def test_a_normal_template_renders():
    out = render(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    )
    assert out == "<user>hi<a>"


@pytest.mark.parametrize(
    "source, msg",
    [
        ("{% for a in range(100000) %}{% for b in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}", "characters"),
        ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ 'x' * 1000000000 }}", "size limit"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            "size limit",
        ),
        ("{{ [1] * 1000000000 }}", "size limit"),
        ("{{ 10 ** 100000000 }}", "exponent"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
        ("{{ raise_exception('no system role') }}", "rejected the conversation: no system role"),
        ("{{ messages.__class__.__mro__ }}", "failed to render"),
    ],
)
def test_hostile_templates_end_in_one_line_with_bounded_memory(source, msg, monkeypatch):
    if msg == "characters":  # the output cap must be what stops it, even on a busy machine
        monkeypatch.setattr(ct, "MAX_SECONDS", 60.0)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ModelError, match=msg) as e:
            render(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "\n" not in str(e.value)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB before the error"
    assert time.monotonic() - t0 < 10 * ct.MAX_SECONDS


def test_a_template_that_does_not_parse():
    with pytest.raises(ModelError, match="does not parse"):
        ct.compile_template("{% for %}")
