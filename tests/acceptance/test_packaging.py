"""The wheel users install: licence text, metadata and the extras that carry drivers."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from tests.services import REPO


def test_the_wheel_carries_the_licence_and_the_metadata(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("mqdedup-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        licence = next(name for name in names if name.endswith(".dist-info/licenses/LICENSE"))
        assert "Apache License" in archive.read(licence).decode()
        metadata_name = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        assert "mqdedup/py.typed" in names
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in metadata.get_all("License-File", [])
    classifiers = metadata.get_all("Classifier", [])
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Programming Language :: Python :: 3.11") for c in classifiers)
    requires = metadata.get_all("Requires-Dist", [])
    # The PostgreSQL driver is an extra; the core needs SQLAlchemy, tenacity and the
    # Prometheus client (the /metrics endpoint).
    core = [r for r in requires if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("<")[0].strip() for r in core) == [
        "prometheus-client",
        "sqlalchemy",
        "tenacity",
    ]
    assert any(r.startswith("psycopg[binary]") and "extra == 'postgresql'" in r for r in requires)
    # Linters are not shipped to users through the test extra.
    assert not any(r.startswith(("ruff", "mypy")) and "extra == 'test'" in r for r in requires)
