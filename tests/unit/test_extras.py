"""The packaging extras that the set-up scripts rely on stay consistent."""

from __future__ import annotations

import configparser
from pathlib import Path

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"


def extra(name: str) -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG)
    value = parser["options.extras_require"][name]
    return {line.strip() for line in value.splitlines() if line.strip()}


def test_test_extra_covers_the_demo_extra():
    """scripts/demo accepts a venv that scripts/test installed, so test holds all of demo."""
    assert extra("demo"), "the demo extra is empty"
    assert extra("demo") <= extra("test")


def test_test_extra_builds_the_docs():
    """The docs build runs in the test suite, so test holds the docs extra (on Python >= 3.10)."""
    marker = '; python_version >= "3.10"'
    assert {f"{requirement}{marker}" for requirement in extra("docs")} <= extra("test")


def install_requires() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG)
    value = parser["options"]["install_requires"]
    return {line.strip() for line in value.splitlines() if line.strip()}


def test_celery_is_an_extra():
    """A plain install needs redis-py only; Celery and kombu come with the celery extra."""
    names = {requirement.split(">")[0].split("=")[0] for requirement in install_requires()}
    assert names == {"redis"}
    assert {"celery>=5.3", "kombu>=5.3"} <= extra("celery")


def test_the_celery_extra_runs_a_redis_broker_worker():
    """kombu's Redis transport imports packaging, which kombu does not require itself."""
    assert "packaging" in extra("celery")


def test_demo_and_test_extras_hold_the_celery_extra():
    """scripts/demo and scripts/test run Celery workers, so their extras include Celery's."""
    assert extra("celery") <= extra("demo") <= extra("test")


def test_test_extra_covers_the_web_extra():
    """The dashboard and metrics tests run in the test install, so test holds all of web."""
    assert extra("web"), "the web extra is empty"
    assert extra("web") <= extra("test")


def test_no_extra_needs_docker():
    """pytest-celery (whose worker fixture runs Docker) is in no extra: the tests never use it."""
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG)
    every = "\n".join(parser["options.extras_require"].values())
    assert "pytest-celery" not in every
    assert "docker" not in every


def test_no_docker_plugin_is_loaded(pytestconfig):
    """Where pytest-celery or pytest-docker-tools are still installed, their plugins stay off."""
    manager = pytestconfig.pluginmanager
    assert manager.get_plugin("celery") is None
    assert manager.get_plugin("docker_tools") is None
    loaded = {getattr(plugin, "__name__", "") for plugin in manager.get_plugins()}
    assert not {name for name in loaded if name.startswith(("pytest_celery", "pytest_docker"))}


def test_the_licence_is_mit_and_shipped():
    """LICENSE holds the MIT licence the README names, and the package metadata ships it."""
    text = (SETUP_CFG.parent / "LICENSE").read_text()
    assert text.startswith("MIT License\n")
    assert "Copyright (c) 2026 The celery-redlock authors" in text
    parser = configparser.ConfigParser()
    parser.read(SETUP_CFG)
    assert parser["metadata"]["license"] == "MIT"
    assert parser["metadata"]["license_files"] == "LICENSE"
