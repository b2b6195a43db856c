"""Generate the Python code of the wire contract (proto/specdec/v1) into specdec/v1.

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 if specdec/v1 differs from a fresh generation

The generated files are committed so a plain install needs no generator; `--check` runs in CI and
in the test suite (tests/test_proto.py), so the committed code cannot drift from proto/.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = ROOT / "specdec" / "v1"
INIT = '"""Generated gRPC/protobuf code for specdec.v1. Do not edit: run scripts/gen_proto.py."""\n'


def generate(out_root: Path) -> Path:
    from grpc_tools import protoc  # dev dependency: pip install -e .[dev]

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "specdec" / "v1").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = out_root / "specdec" / "v1"
    (out / "__init__.py").write_text(INIT)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = sorted(p.name for p in fresh.iterdir())
        if args.check:
            current = sorted(p.name for p in PACKAGE_DIR.iterdir() if p.is_file() and p.name != "__pycache__")
            _, mismatch, errors = filecmp.cmpfiles(fresh, PACKAGE_DIR, names, shallow=False)
            stale = set(current) - set(names)
            if mismatch or errors or stale:
                print(f"specdec/v1 is out of date with proto/ (differs: {mismatch + errors}, extra: {sorted(stale)}); "
                      "run: python scripts/gen_proto.py", file=sys.stderr)
                return 1
            print("specdec/v1 matches proto/")
            return 0
        PACKAGE_DIR.mkdir(parents=True, exist_ok=True)
        for old in PACKAGE_DIR.glob("*"):
            if old.is_file():
                old.unlink()
        for name in names:
            (PACKAGE_DIR / name).write_bytes((fresh / name).read_bytes())
        print(f"wrote {len(names)} files to {PACKAGE_DIR.relative_to(ROOT)}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
