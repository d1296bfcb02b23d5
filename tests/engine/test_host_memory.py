"""The CPU allocator settings (nanoengine.engine.host_memory) respect the user's own."""

import platform

import pytest

from nanoengine.engine import host_memory

on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not on_glibc, reason="mallopt is glibc's")
def test_applies_on_glibc_when_the_user_has_not_tuned_malloc(monkeypatch):
    for name in host_memory.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.keep_freed_memory.__wrapped__() is True


@pytest.mark.parametrize("variable", host_memory.USER_VARIABLES)
def test_leaves_a_user_choice_alone(monkeypatch, variable):
    monkeypatch.setenv(variable, "131072")
    assert host_memory.keep_freed_memory.__wrapped__() is False


def test_not_applied_off_glibc(monkeypatch):
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert host_memory.keep_freed_memory.__wrapped__() is False
