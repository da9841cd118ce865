"""Every report names where its numbers come from and the one command that regenerates it whole."""
import configparser
import re
import sys
from pathlib import Path

import numpy as np

from xenc_lab import report
from xenc_lab.provenance import FLAGS, commit, provenance

ROOT = Path(__file__).resolve().parent.parent


def test_provenance_names_machine_flags_date_commit_versions_and_command():
    text = provenance("xenc-lab report precision")
    assert text.startswith("Machine: ") and "Regenerate with `xenc-lab report precision`." in text
    for name in ("Python ", "torch ", "transformers ", "sentence-transformers "):
        assert name in text, name
    assert re.search(r"Written \d{4}-\d\d-\d\d \d\d:\d\d UTC at commit ", text)
    assert commit() in text and re.match(r"[0-9a-f]{12}( \+changes)?$|unknown", commit())
    # every flag that picks a kernel is named, present or absent
    machine = text.splitlines()[0]
    assert all(flag in machine for flag in FLAGS) or "none of " in machine


def test_a_given_machine_line_is_kept():
    assert provenance("cmd", "NVIDIA Example; host X").startswith("Machine: NVIDIA Example; host X.")


def test_throughput_regeneration_keeps_the_compiled_columns():
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    assert "--compile" in tox["testenv:bench"]["commands"].split()
    assert "--compile" in report.THROUGHPUT


def test_parity_report_has_tolerance_and_result_columns_and_flags_a_value_past_the_bound(tmp_path):
    sys.path.insert(0, str(ROOT))
    from parity_tests.report import ParityRecorder

    rec = ParityRecorder()
    rec.add("bert", "float32", "raw logits", np.array([1.0, 2.0 + 1e-6]), np.array([1.0, 2.0]))
    rec.add("bert", "float32", "wrong", np.array([1.0, 2.5]), np.array([1.0, 2.0]))
    rec.add("qwen", "bfloat16", "raw", np.array([1.0, 2.01]), np.array([1.0, 2.0]))
    rec.write(tmp_path / "parity.md")
    text = (tmp_path / "parity.md").read_text()
    assert text.startswith("# Parity") and "Machine: " in text and "sentence-transformers " in text
    assert "| tolerance | result |" in text
    rows = {line.split(" | ")[2]: line for line in text.splitlines() if line.startswith("| bert") or
            line.startswith("| qwen")}
    assert rows["raw logits"].endswith("| pass |")
    assert rows["wrong"].endswith("| FAIL: 1 past it |")
    assert rows["raw"].endswith("| n/a |")
