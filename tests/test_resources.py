"""tests/resources.py: a resource the tests cannot get fails them in CI and skips them, with a
warning, elsewhere; the repository's scripts load once as modules."""

import pytest

from resources import script, unavailable


@pytest.mark.parametrize("value", ["true", "1", "yes"])
def test_a_missing_resource_fails_in_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(BaseException) as e:  # a skip is a BaseException too: it must not be one
        unavailable("registry down")
    assert e.type is pytest.fail.Exception
    assert "registry down (CI is set" in str(e.value)


@pytest.mark.parametrize("value", [None, "", "0", "false"])
def test_a_missing_resource_skips_loudly_outside_ci(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with (
        pytest.warns(UserWarning, match="registry down: the tests that need it are SKIPPED"),
        pytest.raises(pytest.skip.Exception, match="offline: registry down"),
    ):
        unavailable("registry down")


def test_a_script_loads_once_as_its_module():
    fetch = script("fetch_vocab")
    assert fetch is script("fetch_vocab")
    assert fetch.__name__ == "fetch_vocab" and callable(fetch.main)
