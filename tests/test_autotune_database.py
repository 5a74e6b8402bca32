"""The tuning cache as a database many processes share (``src/opsmath/kernels/autotune.py``): malformed entries dropped
with one warning, a transient read error never discards the file, concurrent writers keep every entry, a
failed write leaves nothing behind, and the key names the opsmath version."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opsmath.kernels import autotune
from test_autotune import cache, fake_measure, named  # noqa: F401  (the fixture)


def test_wrong_shape_file_warns_once_and_tuning_proceeds(cache, caplog):  # noqa: F811
    cache.write_text(json.dumps({autotune.machine_key(): ["not", "a", "mapping"],
                                 "other": {"op": {"k": "not an entry", "k2": {"choice": "a"}}}}))
    autotune._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="opsmath"):
        assert autotune.cached("op", "k") is None
        assert autotune.pick("op", "k", {"a": named("a"), "b": named("b")}, fake_measure({"a": 2.0, "b": 1.0}, [])) == "b"
        assert autotune.lookup("op", "k2", "other")["choice"] == "a"
    assert sum("malformed" in r.message for r in caplog.records) == 1
    data = json.loads(cache.read_text())
    assert data[autotune.machine_key()]["op"]["k"]["choice"] == "b" and data["other"]["op"] == {"k2": {"choice": "a"}}


def test_transient_read_error_keeps_the_file(cache, monkeypatch):  # noqa: F811
    cache.write_text(json.dumps({autotune.machine_key(): {"op": {"k": {"choice": "a"}}}}))
    real = Path.read_text

    def flaky(self, *a, **kw):
        if self == cache:
            raise OSError(5, "Input/output error")
        return real(self, *a, **kw)
    monkeypatch.setattr(Path, "read_text", flaky)
    assert autotune.lookup("op", "k") is None
    monkeypatch.setattr(Path, "read_text", real)
    assert cache.exists() and not cache.with_suffix(".json.corrupt").exists()
    assert autotune.lookup("op", "k")["choice"] == "a"


def test_failed_write_leaves_no_temporary_file(cache, monkeypatch):  # noqa: F811
    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", full)
    autotune.store("op", "k", dict(choice="a"))
    assert autotune.cached("op", "k") == "a"      # kept in memory
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".tuning-")]


def test_key_names_the_opsmath_version():
    assert f"| opsmath {autotune._version()} |" in autotune.machine_key()


WRITER = """
import sys
from opsmath.kernels import autotune
for i in range(int(sys.argv[2])):
    autotune.store("op", f"{sys.argv[1]}-{i}", dict(choice="a"))
"""


@pytest.mark.skipif(autotune.fcntl is None, reason="no advisory file locks on this platform")
def test_concurrent_processes_keep_every_entry(tmp_path):
    env = dict(os.environ, OPSMATH_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), "200"], env=env) for w in range(4)]
    assert all(p.wait(timeout=600) == 0 for p in procs)
    data = json.loads((tmp_path / "tuning.json").read_text())
    (entries,) = [ops["op"] for ops in data.values()]
    assert len(entries) == 800
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tuning-")]
