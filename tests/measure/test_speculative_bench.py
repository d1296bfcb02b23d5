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
    (["--spec-tokens-per-batch-size", "[[2, 4, 1]]"], "must start at batch size 1"),
])
def test_bad_speculative_arguments_are_refused(tmp_path, capsys, extra, message):
    code = main(["bench", "--speculative", "--model", str(tmp_path / "none"), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_a_schedule_that_is_not_json_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--speculative", "--model", str(tmp_path / "none"), "--spec-tokens-per-batch-size", "[[1, 4, 1]"])
    assert exit_.value.code == 2 and "not JSON" in capsys.readouterr().err


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


def test_vs_vllm_races_four_systems_in_the_same_rounds(tiny_llama_tok_dir, tmp_path):
    """vLLM's side is the protocol's stand-in (tests/measure/fake_vllm_runner.py), run twice:
    once plain and once given the same speculative_config."""
    from test_vllm_peer import fake_venv

    out = tmp_path / "spec-vllm.json"
    code = main(["bench", "--speculative", "--vs-vllm", "--vllm-venv", str(fake_venv(tmp_path)),
                 "--vllm-threads-bind", "0", "--model", str(tiny_llama_tok_dir), "--repeats", "2",
                 "--spec-output-len", "8", "--spec-tokens", "3", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert [(r["workload"], r["mode"]) for r in results["rows"]] == [("friendly", "single stream"),
                                                                    ("open", "single stream")]
    for row in results["rows"]:
        assert all(len(runs) == 2 for runs in row["seconds"].values())  # every system in every round
        tok_s = row["tok_s"]
        assert row["engine_over_vllm_spec"] == pytest.approx(tok_s["engine_spec"] / tok_s["vllm_spec"])
        assert row["speedup_engine"] == pytest.approx(tok_s["engine_spec"] / tok_s["engine_plain"])
        agreement = row["greedy_agreement"]
        assert agreement["engine_spec"]["tokens_compared"] == agreement["engine_spec"]["tokens_agreeing"] \
            == row["output_tokens"]  # speculation never changes the engine's greedy tokens
        settings = row["vllm_settings"]
        assert settings["vllm_plain"]["speculative_config"] is None
        assert settings["vllm_spec"]["speculative_config"] == results["speculative_config"]
