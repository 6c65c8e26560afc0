"""bench/evidence.py --quick writes the evidence page with its four findings, each with a
quoted claim, a table with intervals and a verdict, the command that made it, and figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_evidence_quick_writes_the_page(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "evidence.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    page = (tmp_path / "evidence.md").read_text()
    assert page.startswith("# Evidence")
    assert "bench/evidence.py --quick" in page and "Quick mode" in page
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    assert [s.split(".")[0] for s in sections] == ["1", "2", "3", "4", "5"]
    for s in sections:
        assert "\n> " in s, s[:200]  # the claim, quoted
        assert "| --- |" in s and re.search(r"\[-?[\d.]+%?, -?[\d.]+%?\]", s), s[:300]  # intervals
    assert "arXiv 2405.01741" in sections[0] and "arXiv 2307.10244" in sections[2]
    assert "arXiv 2212.03475" in sections[3]
    for s in (sections[0], sections[1]):  # a verdict, whichever way it goes
        assert re.search(r"\*\*(Agrees|Does not|Partly)", s), s[-400:]
    for name in ("fp32", "bf16", "fp8 e4m3"):
        assert f"| {name}" in sections[1]
    assert "held out" in sections[2] and "shadow" in sections[2]
    for basis in ("| sbp | modelled |", "| sbp-shadow | measured |", "| abft | measured |"):
        assert basis in sections[4]  # measured and modelled rows side by side
    for fig in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page):
        assert (tmp_path / fig).stat().st_size > 1000, fig
    assert len(re.findall(r"!\[", page)) == 2
