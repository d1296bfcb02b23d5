"""llguidance against xgrammar (nanobench/grammar_backends.py): the packed-mask helpers, the per-step
summary, the reading on both sides of its thresholds, and the measurement's core on a tiny constraint for
each library, including that it notices a mask refusing the next token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nanobench import grammar_backends as gb


def test_constraint_checks_its_kind_and_a_grammar_needs_both_syntaxes():
    with pytest.raises(ValueError, match="kind must be"):
        gb.Constraint("x", "yaml", {}, "")
    with pytest.raises(ValueError, match="both syntaxes"):
        gb.Constraint("x", "grammar", {"lark": "start: \"a\""}, "a")
    assert gb.Constraint("x", "json_object", {"type": "object"}, "{}").is_json
    assert not gb.Constraint("x", "regex", "a+", "a").is_json


def test_every_sample_is_valid_json_where_the_constraint_is_json():
    for constraint in gb.CONSTRAINTS:
        if constraint.is_json:
            assert isinstance(json.loads(constraint.sample), dict), constraint.name


def test_packed_mask_bit_of_token_t_is_bit_t_mod_32_of_word_t_div_32():
    words = np.zeros(3, dtype=np.int32)
    words[0] = 1 << 5  # token 5
    words[2] = np.int32(-(1 << 31))  # token 95: bit 31, the sign bit
    assert gb.allowed(words, 5) and gb.allowed(words, 95)
    assert not gb.allowed(words, 4) and not gb.allowed(words, 37)
    assert gb.allowed_count(words, 96) == 2
    assert gb.allowed_count(words, 90) == 1  # bits past the vocabulary are not tokens


def test_step_summary_takes_the_median_over_repeats_then_spreads_over_steps():
    repeats = [[1e-6, 2e-6, 10e-6], [3e-6, 2e-6, 30e-6], [2e-6, 2e-6, 20e-6]]  # 3 repeats of 3 steps
    summary = gb.step_summary(repeats)  # per step: 2, 2, 20 us
    assert summary["first_us"] == pytest.approx(2.0) and summary["median_us"] == pytest.approx(2.0)
    assert summary["max_us"] == pytest.approx(20.0) and summary["total_us"] == pytest.approx(24.0)
    assert summary["p90_us"] == pytest.approx(2.0 + 0.8 * 18.0)


def row(name: str, kind: str, fill_us: tuple[float, float], p90_us: tuple[float, float],
        compile_ms: tuple[float, float], same: int = 10, steps: int = 10) -> dict:
    libraries = {lib: {"compile_ms": {"median": compile_ms[i]}, "fill": {"median_us": fill_us[i], "p90_us": p90_us[i]},
                       "accept": {"median_us": 5.0}} for i, lib in enumerate(gb.LIBRARIES)}
    return {"name": name, "kind": kind, "steps": steps, "libraries": libraries,
            "agreement": {"steps": steps, "same_count": same}}


def results(p90=(40.0, 8.0), fill=(14.0, 2.0), compile_ms=(1.0, 6.0)) -> dict:
    return {"file": "grammar-backends-cpu-2026-12-07.json", "date": "2026-12-07T08:43:00+00:00",
            "command": "python -m nanobench.grammar_backends", "model": "SmolLM2-135M-Instruct", "vocab_size": 49152,
            "load_average": {"start": [0.3, 0.5, 0.8], "end": [1.1, 0.7, 0.8]},
            "environment": {"cpu_model": "AMD EPYC", "cpu_count": 2},
            "libraries": {"llguidance": {"version": "1.9.1", "setup": {"median_ms": 330.0}},
                          "xgrammar": {"version": "0.2.9", "setup": {"median_ms": 400.0}}},
            "rows": [row("json: flat object", "json", fill, p90, compile_ms, same=6),
                     row("json_object", "json_object", fill, p90, compile_ms, same=8),
                     row("choice", "choice", fill, p90, compile_ms)]}


@pytest.mark.parametrize("p90, negligible", [((99.0, 8.0), True), ((8.0, 101.0), False), ((250.0, 8.0), False)])
def test_mask_speed_decides_only_from_one_percent_of_a_decode_step(p90, negligible):
    text = gb.reading(results(p90=p90))
    assert ("mask speed cannot decide" in text) is negligible
    assert ("prefer the faster mask" in text) is not negligible


@pytest.mark.parametrize("compile_ms, says", [((1.0, 6.0), "compile llguidance faster (6.0x)"),
                                              ((6.0, 1.0), "compile xgrammar faster (6.0x)"),
                                              ((1.0, 1.09), "compile level (0.92x)"),
                                              ((1.0, 1.12), "compile llguidance faster (1.1x)")])
def test_compile_reads_level_within_ten_percent(compile_ms, says):
    assert says in gb.reading(results(compile_ms=compile_ms))


def test_reading_counts_json_agreement_apart_from_the_other_constraints():
    text = gb.reading(results())
    assert "JSON steps where both allow the same number of tokens: 14/20 (70%)" in text
    assert "regex, choice and grammar steps: 10/10" in text
    assert "fill xgrammar faster (7.0x)" in text


def test_describe_prints_provenance_and_every_constraint():
    text = gb.describe(results())
    for expected in ("2026-12-07 08:43 UTC, AMD EPYC, 2 cores", "command: python -m nanobench.grammar_backends",
                     "llguidance 1.9.1 (setup 330 ms)", "json: flat object", "6/10"):
        assert expected in text


def test_report_takes_the_newest_file(tmp_path):
    old, new = results(compile_ms=(2.0, 6.0)), results(compile_ms=(1.0, 6.0))
    old["date"], new["date"] = "2026-12-01T00:00:00", "2026-12-07T00:00:00"
    for name, data in (("grammar-backends-cpu-b.json", old), ("grammar-backends-cpu-a.json", new)):
        (tmp_path / name).write_text(json.dumps({k: v for k, v in data.items() if k != "file"}))
    assert gb.newest_file(tmp_path)["file"] == "grammar-backends-cpu-a.json"
    assert "grammar-backends-cpu-a.json" in gb.report(tmp_path)
    assert gb.report(tmp_path / "empty").startswith("no grammar-backends results")


# ------------------------------------------------------------------ the libraries themselves


@pytest.fixture(scope="module")
def backends():
    pytest.importorskip("llguidance")
    pytest.importorskip("xgrammar")
    from nanoengine.loader.weights import load_model_config, load_tokenizer, resolve_model_source

    source = resolve_model_source(None)
    tokenizer = load_tokenizer(source)
    vocab = load_model_config(source).vocab_size
    return tokenizer, {name: cls(tokenizer, vocab) for name, cls in gb.BACKENDS.items()}


TINY = gb.Constraint("choice", "choice", ["yes", "no"], "no")


@pytest.mark.slow  # loads the tokenizer, torch and both libraries: ~4 s on 2 cores
def test_each_library_walks_a_tiny_constraint_and_both_masks_agree(backends):
    tokenizer, libs = backends
    rows = gb.measure(libs, [TINY], tokenizer, tokenizer.eos_token_id, repeats=2)
    (result,) = rows
    assert result["steps"] == len(tokenizer.encode("no", add_special_tokens=False)) + 1
    for name in gb.LIBRARIES:
        lib = result["libraries"][name]
        assert lib["fill"]["median_us"] > 0 and len(lib["compile_ms"]["runs"]) == 2
        assert lib["allowed_per_step"][-1] == 1  # after "no", only EOS
    assert result["agreement"]["same_mask"] == result["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("name", gb.LIBRARIES)
def test_a_walk_notices_a_mask_that_refuses_the_next_token(backends, name):
    tokenizer, libs = backends
    wrong = tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(AssertionError, match="refuses the valid next token"):
        gb.walk(libs[name], TINY, wrong, tokenizer.eos_token_id)
