"""``bench --speculative``: bad values are refused before anything loads; a tiny run writes a
results file whose figures hang together."""

from __future__ import annotations

import json

import pytest

from nanoengine.__main__ import main


@pytest.mark.parametrize("extra, message", [
    (["--spec-tokens", "0"], "num_speculative_tokens"),
    (["--spec-lookup-min", "5", "--spec-lookup-max", "3"], "prompt_lookup_min"),
    (["--spec-output-len", "0"], "spec_output_len"),
])
def test_bad_speculative_arguments_are_refused(tmp_path, capsys, extra, message):
    code = main(["bench", "--speculative", "--model", str(tmp_path / "none"), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_a_short_race_records_both_engines_and_agreeing_tokens(tiny_llama_tok_dir, tmp_path):
    out = tmp_path / "spec.json"
    code = main(["bench", "--speculative", "--model", str(tiny_llama_tok_dir), "--repeats", "1",
                 "--spec-output-len", "12", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["kind"] == "speculative decoding" and results["speculative_config"]["num_speculative_tokens"] == 4
    assert {(r["workload"], r["mode"]) for r in results["rows"]} == {
        (w, m) for w in ("friendly", "open") for m in ("single stream", "batch")}
    for row in results["rows"]:
        assert row["identical"], row
        assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["plain_tok_s"])
        assert row["num_accepted_tokens"] <= row["num_draft_tokens"]
    assert results["environment"]["nanoengine_revision"] and results["date"]
