"""The wire contract: generated code matches proto/, and every RPC and field is documented."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto():
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_rpc_field_and_enum_value_has_a_doc_comment():
    undocumented = []
    for proto in sorted((ROOT / "proto" / "specdec" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_decl = (
                s.startswith(("rpc ", "message ", "enum ", "service "))
                or re.match(r"^(optional |repeated )?[\w.]+ \w+ = \d+;", s)
                or re.match(r"^[A-Z_]+ = \d+;", s)
            )
            if is_decl and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {s}")
    assert not undocumented, "undocumented declarations:\n" + "\n".join(undocumented)


def test_enums_start_with_unspecified():
    for proto in (ROOT / "proto" / "specdec" / "v1").glob("*.proto"):
        for name, body in re.findall(r"enum (\w+) \{(.*?)\}", proto.read_text(), re.S):
            first = re.search(r"([A-Z_]+) = 0;", body).group(1)
            assert first.endswith("_UNSPECIFIED") and first.startswith(re.sub(r"(?<!^)([A-Z])", r"_\1", name).upper())


def test_pure_core_imports_no_grpc_no_redis():
    code = (
        "import sys\n"
        "import specdec.core.rejection, specdec.core.sampling, specdec.core.rng, specdec.core.speculation, "
        "specdec.core.kv, specdec.core.sessions, specdec.core.steps, specdec.core.session_table\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'redis') or m.startswith('specdec.v1')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the pure core imported {out}"
