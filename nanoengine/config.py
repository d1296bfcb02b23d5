"""Engine configuration: one validated dataclass (chapters 2, 4, 5).

Every knob a chapter turns lives here with vLLM's name, checked when the config is built
(a ``ValueError`` names the field, the value and what is allowed), so a bad setting fails
before any memory is allocated. The two limits that also depend on the model are resolved
once its shape is known: ``resolve_max_model_len`` and ``resolve_num_kv_blocks`` (chapter 3).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nanoengine.backends import check_compile, check_environment, default_dtype
from nanoengine.engine.scheduling_policy import POLICIES as SCHEDULING_POLICIES
from nanoengine.models.config import ModelConfig
from nanoengine.spec_decode.config import SpeculativeConfig
from nanoengine.structured_output.config import StructuredOutputsConfig

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
POLICIES = tuple(SCHEDULING_POLICIES)  # their names: "fcfs", "prefill_first", "static"
DEFAULT_MAX_NUM_SEQS = 256


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    device: "auto" (CUDA if available, else CPU), "cpu" or "cuda".
    dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "float16", "bfloat16".
    block_size: tokens per KV block (vLLM's default 16; nano-vLLM uses 256).
    num_kv_blocks: size of the KV pool in blocks; None derives it from kv_cache_memory_gb.
    kv_cache_memory_gb: memory budget for the KV pool when num_kv_blocks is None.
    max_num_seqs: most requests running at once; None takes 256, or max_num_batched_tokens if smaller.
    max_num_batched_tokens: the token budget of one step (prefill chunks + decodes); at least
        max_num_seqs, since every running request needs a token of it (vLLM's ``SchedulerConfig`` refuses the same).
    max_model_len: longest prompt + output a request may reach; None takes the model's.
    enable_prefix_caching: reuse KV blocks of identical prefixes.
    enable_chunked_prefill: split long prompts over several steps.
    scheduling_policy: "fcfs" (vLLM v1: decodes and prefill chunks share a step),
        "prefill_first" (nano-vLLM / early vLLM: a step with admissions runs prefills only),
        or "static" (the static-batching baseline: a batch of up to max_num_seqs requests
        runs until all of it has finished before anyone new is admitted).
    tensor_parallel_size: processes the model is split over.
    enforce_eager: run the model operator by operator from Python, as its code reads and as hooks and
        the chapters see it (vLLM's flag): no CUDA graphs on a GPU, no native call per layer on a CPU.
    compile: CUDA only (elsewhere a ValueError): torch.compile the small fused ops (``backends.compilation``);
        on failure the engine warns once and stays eager. enforce_eager does not turn it off.
    seed: seeds the engine's generator for requests without a seed of their own.
    speculative_config: None (no speculation) or vLLM's dict, e.g. ``{"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` (chapter 13).
    structured_outputs_config: None or vLLM's dict, e.g. ``{"backend": "guidance"}``: the grammar
        library for requests with ``structured_outputs`` (chapter 14).
    Both dicts are checked and kept as their config classes.
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    compile: bool = False
    seed: int = 0
    speculative_config: SpeculativeConfig | dict | None = None
    structured_outputs_config: StructuredOutputsConfig | dict | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available; use 'cpu' or 'auto'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if isinstance(self.kv_cache_memory_gb, bool) or not isinstance(self.kv_cache_memory_gb, (int, float)) \
                or not 0 < self.kv_cache_memory_gb < float("inf"):
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0, got {self.kv_cache_memory_gb!r}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_seqs is None:
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): each running request needs a token of every step's budget. Raise "
                f"max_num_batched_tokens to at least {self.max_num_seqs}, or lower max_num_seqs to at most "
                f"{self.max_num_batched_tokens} (or leave it unset)")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile and self.tensor_parallel_size > 1:
            raise ValueError(f"compile=True runs in one process only; it is not supported with "
                             f"tensor_parallel_size > 1 (got {self.tensor_parallel_size})")
        if self.compile:
            check_compile(self.torch_device)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) (torch.Generator's range), got {self.seed!r}")
        if self.speculative_config is not None:
            self.speculative_config = _from_dict(SpeculativeConfig, "speculative_config", self.speculative_config)
        self.structured_outputs_config = _from_dict(StructuredOutputsConfig, "structured_outputs_config",
                                                    self.structured_outputs_config)
        check_environment(self.torch_device)  # the backend's environment variables, before anything loads

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, naming any unknown key and the known ones."""
        _check_keys(cls, kwargs, "engine option")
        return cls(**kwargs)

    @property
    def torch_device(self) -> torch.device:
        """The resolved device ("auto" becomes cuda when available)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The resolved dtype: float32 on CPU, bfloat16 on CUDA unless set."""
        return DTYPES[self.dtype] or default_dtype(self.torch_device)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The effective max_model_len, refused if the model or the token budget cannot serve it."""
    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({limit})")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(f"without chunked prefill a whole prompt must fit one step: max_num_batched_tokens "
                         f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})")
    return max_model_len


def kv_cache_num_blocks(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                        memory_bytes: float, tp_size: int = 1) -> int:
    """How many blocks fit in ``memory_bytes`` (per rank: each holds its share of KV heads)."""
    per_token = model_config.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()) // tp_size
    return max(1, int(memory_bytes // (per_token * block_size)))


def resolve_num_kv_blocks(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> int:
    """Number of KV blocks, refused if the pool cannot hold even one maximal request."""
    num_blocks = config.num_kv_blocks or kv_cache_num_blocks(
        model_config, config.block_size, config.torch_dtype, config.kv_cache_memory_gb * 2**30,
        config.tensor_parallel_size)
    needed = -(-max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one request "
                         f"of max_model_len={max_model_len} tokens ({needed} blocks): raise num_kv_blocks / "
                         f"kv_cache_memory_gb or lower max_model_len")
    return num_blocks


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_keys(cls: type, given: dict, what: str) -> None:
    """Refuse a key of ``given`` that names no field of the dataclass ``cls``, listing the known ones."""
    known = sorted(f.name for f in fields(cls))
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; known: {known}")


def _from_dict(cls: type, name: str, value: object):
    """A sub-config from the dict ``LLM(name={...})`` gave (vLLM's shape); None: its defaults."""
    if value is None or isinstance(value, cls):
        return cls() if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {value!r:.80}")
    _check_keys(cls, value, f"{name} key")
    return cls(**value)
