"""``bench --structured``: bad combinations are refused before anything loads; a tiny run writes a
results file whose figures hang together; with ``--vs-vllm`` vLLM's side takes its turn in each round."""

from __future__ import annotations

import json

import pytest

from nanoengine.__main__ import main
from nanobench.structured import TASKS, is_valid, workload


@pytest.mark.parametrize("extra, message", [
    (["--speculative"], "leave out --speculative"),
    (["--overhead"], "leave out --overhead"),
    (["--num-requests", "0"], "num_requests"),
    (["--vllm-structured-backend", "guidance"], "give both"),
])
def test_bad_structured_arguments_are_refused(tmp_path, capsys, extra, message):
    code = main(["bench", "--structured", "--model", str(tmp_path / "none"), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_the_workload_takes_the_schemas_in_turn_and_the_validator_can_say_no():
    pairs = workload(9)
    assert [schema for _, schema in pairs[:4]] == [schema for schema, _ in TASKS]
    assert pairs[8][1] is TASKS[0][0] and len({q for q, _ in pairs}) == 9
    person = TASKS[0][0]
    assert is_valid('{"name": "Ada", "age": 36, "city": "London"}', person)
    assert not is_valid('{"name": "Ada", "age": -1, "city": "London"}', person)
    assert not is_valid('{"name": "Ada", "age": 36', person)


@pytest.mark.slow
def test_a_short_run_records_constrained_and_free_of_the_same_tokens(tiny_llama_tok_dir, tmp_path):
    out = tmp_path / "structured.json"
    code = main(["bench", "--structured", "--model", str(tiny_llama_tok_dir), "--num-requests", "4",
                 "--repeats", "2", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert [row["shape"] for row in results["rows"]] == ["batched", "single stream"]
    for row in results["rows"]:
        assert len(row["rounds_tok_s"]["engine_free"]) == 2
        assert row["engine_constrained_over_free"] == pytest.approx(
            row["tok_s"]["engine_constrained"] / row["tok_s"]["engine_free"])
    assert results["valid"]["engine_constrained batched"]["of"] == 8  # 4 requests, 2 rounds
    assert results["engine_settings"]["structured_outputs_backend"] == "guidance"
    assert results["environment"]["nanoengine_revision"] and results["vllm_peer"] is None


@pytest.mark.slow
def test_vs_vllm_runs_vllm_constrained_and_free_in_the_same_rounds(tiny_llama_tok_dir, tmp_path):
    from test_vllm_peer import fake_venv

    out = tmp_path / "structured-vllm.json"
    code = main(["bench", "--structured", "--vs-vllm", "--vllm-venv", str(fake_venv(tmp_path)),
                 "--vllm-threads-bind", "0", "--model", str(tiny_llama_tok_dir), "--num-requests", "2",
                 "--repeats", "1", "--vllm-structured-backend", "guidance", "--out", str(out)])
    assert code == 0
    results = json.loads(out.read_text())
    assert results["vllm_peer"]["settings"]["structured_outputs_config"] == {"backend": "guidance"}
    for row in results["rows"]:
        assert set(row["tok_s"]) == {"engine_constrained", "engine_free", "vllm_constrained", "vllm_free"}
        assert row["engine_over_vllm_constrained"] > 0
    # the stand-in's tokens are not JSON: counted, and counted invalid
    assert results["valid"]["vllm_constrained batched"] == {"valid": 0, "of": 2}
