"""Fetches NVRTC and the CUDA headers from PyPI's wheels, for compiling the kernels without CUDA.

Usage: python3 fetch_nvrtc.py OUT_DIR DOWNLOAD_DIR
Downloads nvidia-cuda-nvrtc and nvidia-cuda-runtime (no dependencies, never installed) with
pip, checks each wheel's sha256, and extracts NVRTC's libraries into OUT_DIR/lib and the
runtime's headers into OUT_DIR/include. Does nothing if OUT_DIR holds this version already.
"""

import hashlib
import pathlib
import shutil
import subprocess
import sys
import zipfile

VERSION = "13.5.37"
# (package, sha256 of its manylinux x86_64 wheel, the part of the wheel taken, where it goes)
WHEELS = [
    ("nvidia-cuda-nvrtc",
     "86b4d68058807988b7d9af5b44917a0601e9c337f35ccd657bfb3c759ff8d8bc",
     "nvidia/cu13/lib/", "lib"),
    ("nvidia-cuda-runtime",
     "df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d",
     "nvidia/cu13/include/", "include"),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    out, download = (pathlib.Path(a) for a in sys.argv[1:3])
    stamp = out / "VERSION"
    if stamp.exists() and stamp.read_text().strip() == VERSION:
        print(f"{out}: NVRTC {VERSION} present")
        return 0
    download.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={VERSION}" for name, _, _, _ in WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--platform", "manylinux2014_x86_64", "--only-binary=:all:", *specs,
         "-d", str(download)],
        check=True,
    )
    if out.exists():
        shutil.rmtree(out)
    for name, want, prefix, dest in WHEELS:
        wheels = sorted(download.glob(f"{name.replace('-', '_')}-{VERSION}-*.whl"))
        if not wheels:
            print(f"no wheel of {name}=={VERSION} in {download}", file=sys.stderr)
            return 1
        got = sha256(wheels[0])
        if got != want:
            print(f"{wheels[0]}: sha256 {got}, expected {want}", file=sys.stderr)
            return 1
        with zipfile.ZipFile(wheels[0]) as z:
            for member in z.infolist():
                if member.is_dir() or not member.filename.startswith(prefix):
                    continue
                if member.filename.endswith(".a"):
                    continue
                target = out / dest / member.filename[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    stamp.write_text(VERSION + "\n")
    print(f"{out}: NVRTC {VERSION} fetched, sha256 ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
