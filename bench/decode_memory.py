"""Peak memory of decoding one large 16-bit PNG: the decode rule now against the earlier widening, side by side.

    .venv/bin/python bench/decode_memory.py [--side 8000]

Writes a --side x --side 16-bit greyscale PNG (a smooth gradient: a small file, well inside max_file_bytes), then
decodes it to 224 px in two fresh processes: (a) the earlier way, the pixels widened to int64, clipped and shifted (each
a copy), (b) tasks/rules/images.py:decode_square as it is. Each prints its peak resident memory above the process's own
after its imports and the file's read (ru_maxrss), in MB and in bytes per pixel; then (b) over (a).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from figures import add_record_option, keep  # bench/figures.py

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import io, json, resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from PIL import Image
from imagelake.tasks.rules import images
data = open(sys.argv[2], "rb").read()
if sys.argv[3] == "widened":  # the rule as it was: int64, clipped, shifted
    def to_rgb(image):
        if image.mode in ("I;16", "I;16B", "I;16L", "I"):
            wide = np.asarray(image, dtype=np.int64).clip(0, 65535)
            image = Image.fromarray((wide >> 8).astype(np.uint8), "L")
        return image.convert("RGB")
    images.to_rgb = to_rgb
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
images.decode_square(data, 224, max_pixels=10**9)
print(json.dumps({"peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=8000)
    add_record_option(parser)
    args = parser.parse_args()
    import numpy as np
    from PIL import Image

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "deep.png"
        ramp = np.linspace(0, 65535, args.side, dtype=np.uint32)
        values = ((ramp[None, :] + ramp[:, None]) // 2).astype(np.uint16)
        Image.fromarray(values).save(path, compress_level=6)
        del values
        pixels = args.side * args.side
        print(f"{args.side} x {args.side} 16-bit PNG, {path.stat().st_size / 1e6:.1f} MB, decoded to 224 px")
        peaks = {}
        for way in ("widened", "now"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(REPO), str(path), way], check=True, capture_output=True, text=True
            ).stdout
            peaks[way] = json.loads(out.splitlines()[-1])["peak_kb"] * 1024
            print(
                f"  ({'a' if way == 'widened' else 'b'}) {way:8} peak {peaks[way] / 1e6:7.0f} MB  "
                f"{peaks[way] / pixels:5.1f} bytes a pixel"
            )
        print(f"  (b) / (a): {peaks['now'] / peaks['widened']:.2f}")
        keep(
            args,
            "decode_memory",
            f"the decoder's peak memory on a {args.side} x {args.side} 16-bit PNG, against widening it first",
            {
                "now_peak_mb": round(peaks["now"] / 1e6),
                "widened_peak_mb": round(peaks["widened"] / 1e6),
                "now_of_widened_ratio": round(peaks["now"] / peaks["widened"], 2),
            },
        )


if __name__ == "__main__":
    main()
