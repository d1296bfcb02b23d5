"""The CPU platform's host settings (nanoengine.backends.cpu_platform) respect the user's own."""

import ctypes
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoengine.backends import cpu_platform
from nanoengine.kernels import cpu_gemm

on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not on_glibc, reason="mallopt is glibc's")
def test_applies_on_glibc_when_the_user_has_not_tuned_malloc(monkeypatch):
    for name in cpu_platform.USER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cpu_platform.keep_freed_memory.__wrapped__() is True


@pytest.mark.parametrize("variable", cpu_platform.USER_VARIABLES)
def test_leaves_a_user_choice_alone(monkeypatch, variable):
    monkeypatch.setenv(variable, "131072")
    assert cpu_platform.keep_freed_memory.__wrapped__() is False


def test_not_applied_off_glibc(monkeypatch):
    monkeypatch.setattr(cpu_platform.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert cpu_platform.keep_freed_memory.__wrapped__() is False


# ------------------------------------------------------- oneDNN's shape caches
def test_the_cpu_backend_bounds_the_shape_caches_and_keeps_a_user_value(monkeypatch):
    from nanoengine.backends.cpu import CpuBackend
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    CpuBackend("cpu")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(cpu_platform.SHAPE_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


# A fresh process (the caches read their size once, at the first oneDNN product): a CPU backend,
# then one packed product for each of 1,000 row counts; prints how much more malloc'd memory is in use.
NEW_ROW_COUNTS = """
import ctypes, gc
import torch
from nanoengine.backends.cpu import CpuBackend
from nanoengine.kernels import cpu_gemm
torch.set_num_threads(1)
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
CpuBackend("cpu")
packed, x = cpu_gemm.pack_weight(torch.randn(64, 64)), torch.randn(1000, 64)
cpu_gemm.packed_linear(x[:1], packed, 64)
gc.collect()
before = libc.mallinfo2().uordblks
for rows in range(2, 1001):
    cpu_gemm.packed_linear(x[:rows], packed, 64)
gc.collect()
print(libc.mallinfo2().uordblks - before)
"""


@pytest.mark.skipif(not (on_glibc and hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")),
                    reason="mallinfo2 is glibc's (2.33 and later)")
@pytest.mark.skipif(not cpu_gemm.packing_available(), reason="no oneDNN packing in this PyTorch build")
def test_bounded_shape_caches_stop_growing_where_the_defaults_do_not():
    """1,000 new row counts: with oneDNN's defaults (1,024 entries each) every one stays cached;
    with the engine's bound the memory they hold stops at what ``SHAPE_CACHE_ENTRIES`` keep."""
    def grown(env: dict[str, str]) -> int:
        env = {k: v for k, v in os.environ.items() if k not in cpu_platform.SHAPE_CACHE_VARIABLES} | env
        run = subprocess.run([sys.executable, "-c", NEW_ROW_COUNTS], env=env, capture_output=True, text=True,
                             timeout=300, cwd=Path(__file__).resolve().parents[2])
        assert run.returncode == 0, run.stderr
        return int(run.stdout.split()[-1])
    bounded = grown({})
    defaults = grown({name: "1024" for name in cpu_platform.SHAPE_CACHE_VARIABLES})
    assert defaults > 4 * bounded, (bounded, defaults)  # measured: about 52 against 413 MiB


# ----------------------------------------------------------------- huge pages
thp = pytest.mark.skipif(cpu_platform.huge_pages_unavailable() is not None,
                         reason=f"no transparent huge pages here: {cpu_platform.huge_pages_unavailable()}")


def _advised(address: int) -> bool:
    """Whether the mapping holding ``address`` is eligible for huge pages (``THPeligible`` in smaps)."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return re.search(r"THPeligible:\s+1", block) is not None
    return False


@thp
def test_moved_tensors_keep_their_values_in_one_aligned_advised_region():
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(300, 129, generator=generator), torch.randn(7, generator=generator).to(torch.bfloat16),
               torch.randn(1000, 1000, generator=generator)]
    params = [torch.nn.Parameter(w.clone(), requires_grad=False) for w in weights]
    moved = cpu_platform.move_to_huge_pages([*params, params[0]])  # given twice: moved once
    assert moved == sum(w.numel() * w.element_size() for w in weights)
    assert all(torch.equal(p, w) and p.dtype == w.dtype and p.shape == w.shape for p, w in zip(params, weights))
    first = params[1].data_ptr()  # the smallest goes first
    assert first % cpu_platform.HUGE_PAGE_BYTES == 0
    assert all(p.data_ptr() % cpu_platform.ALIGNMENT == 0 for p in params)
    assert first < params[0].data_ptr() < params[2].data_ptr()  # one region, smallest first
    assert params[2].data_ptr() - first < moved + 3 * cpu_platform.ALIGNMENT
    assert _advised(first) and _advised(params[2].data_ptr())
    assert cpu_platform.huge_page_bytes() % cpu_platform.HUGE_PAGE_BYTES == 0


@thp
def test_no_tensor_starts_moving_once_the_budget_is_spent(monkeypatch):
    clock = iter(range(100))  # each reading of the clock one second later than the last
    monkeypatch.setattr(cpu_platform.time, "perf_counter", lambda: float(next(clock)))
    small, large = torch.ones(10), torch.ones(1000)
    where = large.data_ptr()
    # start: 0 s, deadline 1.5 s; before the small tensor 1 s (moves), before the large one 2 s (stays)
    assert cpu_platform.move_to_huge_pages([large, small], budget_s=1.5) == small.numel() * 4
    assert small.data_ptr() % cpu_platform.HUGE_PAGE_BYTES == 0 and large.data_ptr() == where
    assert torch.equal(small, torch.ones(10)) and torch.equal(large, torch.ones(1000))


def test_a_zero_budget_moves_nothing():
    weight = torch.ones(64, 64)
    where = weight.data_ptr()
    assert cpu_platform.move_to_huge_pages([weight], budget_s=0) == 0 and weight.data_ptr() == where


@pytest.mark.parametrize("text, budget", [(None, cpu_platform.MOVE_BUDGET_S), ("2.5", 2.5), ("0", 0.0),
                                          ("inf", None)])
def test_the_budget_comes_from_the_environment(monkeypatch, text, budget):
    if text is None:
        monkeypatch.delenv(cpu_platform.MOVE_BUDGET_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(cpu_platform.MOVE_BUDGET_VARIABLE, text)
    assert cpu_platform.move_budget() == budget


@pytest.mark.parametrize("own", [None, "2"])
def test_a_server_or_benchmark_waits_for_all_the_huge_pages_unless_the_user_said(monkeypatch, own):
    if own is None:
        monkeypatch.delenv(cpu_platform.MOVE_BUDGET_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(cpu_platform.MOVE_BUDGET_VARIABLE, own)
    cpu_platform.wait_for_all_huge_pages()
    assert cpu_platform.move_budget() == (None if own is None else 2.0)


@pytest.mark.parametrize("text", ["soon", "-1", "nan", ""])
def test_a_bad_budget_is_refused_by_name(monkeypatch, text):
    monkeypatch.setenv(cpu_platform.MOVE_BUDGET_VARIABLE, text)
    with pytest.raises(ValueError, match=f"{cpu_platform.MOVE_BUDGET_VARIABLE} must be a number of seconds >= 0"):
        cpu_platform.move_budget()


def test_nothing_moves_where_the_machine_has_no_huge_pages(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(cpu_platform, "THP_SETTING", setting)
    assert "off on this machine" in cpu_platform.huge_pages_unavailable()
    weight = torch.ones(64, 64)
    where = weight.data_ptr()
    assert cpu_platform.move_to_huge_pages([weight]) == 0 and weight.data_ptr() == where


def test_tensors_it_cannot_move_stay_where_they_are():
    strided = torch.ones(8, 8).t()
    empty = torch.ones(0)
    where = (strided.data_ptr(), empty.data_ptr())
    assert cpu_platform.move_to_huge_pages([strided, empty]) == 0
    assert (strided.data_ptr(), empty.data_ptr()) == where


@thp
def test_the_cpu_backend_moves_the_weights_and_the_tokens_do_not_change(build_tiny_llm, monkeypatch):
    from nanoengine import SamplingParams

    config = dict(device="cpu", max_model_len=128, num_kv_blocks=64, block_size=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10]]
    llm = build_tiny_llm(config)
    backend, model = llm.engine.runner.backend, llm.engine.runner.model
    params = list(model.parameters())
    assert backend.huge_page_weight_bytes == sum(p.numel() * p.element_size() for p in params)
    assert all(_advised(p.data_ptr()) for p in params) and "weights in huge pages" in backend.describe()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, still
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    # the same weights where PyTorch put them give the same tokens
    monkeypatch.setattr(cpu_platform, "huge_pages_unavailable", lambda: "off for this test")
    plain = build_tiny_llm(config)
    assert plain.engine.runner.backend.huge_page_weight_bytes == 0
    assert "huge pages" not in plain.engine.runner.backend.describe()
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)] == got


@thp
def test_the_backend_says_what_share_of_the_weights_moved(build_tiny_llm, monkeypatch):
    config = dict(device="cpu", max_model_len=128, num_kv_blocks=64, block_size=8)
    monkeypatch.setenv(cpu_platform.MOVE_BUDGET_VARIABLE, "0")
    backend = build_tiny_llm(config).engine.runner.backend
    assert backend.huge_page_weight_bytes == 0 and "huge pages" not in backend.describe()
    backend.huge_page_weight_bytes = backend.weight_bytes // 4  # as if the budget had run out a quarter in
    assert backend.describe().endswith("25% of the weights in huge pages")


def test_a_bad_budget_is_refused_with_the_engine_config(monkeypatch):
    from nanoengine.config import EngineConfig

    monkeypatch.setenv(cpu_platform.MOVE_BUDGET_VARIABLE, "forever")
    with pytest.raises(ValueError, match=cpu_platform.MOVE_BUDGET_VARIABLE):  # before any weight is read
        EngineConfig(device="cpu")
