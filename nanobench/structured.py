"""Structured output measured: what a grammar costs the engine, and the engine against vLLM (chapter 14).

``python -m nanoengine bench --structured [--vs-vllm]`` asks the default model for JSON: each
prompt names a record to describe and comes with the JSON schema the answer must follow (four
schemas: a person, a review, a product with a list, an event with a date pattern). Two shapes,
as the engine serves them:

* **batched**: every request at once (``--num-requests``, the schemas in turn);
* **single stream**: the first four requests one after another.

In each round (``--repeats``, alternating) the engine runs the requests **constrained**
(greedy, each stopping where its grammar ends) and **free**: the same prompts without a
constraint, each generating exactly as many tokens as its constrained answer had (EOS
ignored), so the two runs compute the same tokens and differ only by the grammar's work (the
masks, advancing the matchers, compiling). The ratio of their tok/s is what structured output
costs. With ``--vs-vllm`` vLLM's CPU build runs the same token ids constrained (its default
grammar backend unless ``--vllm-structured-backend``) and free in the same rounds.

Every constrained answer of every system is checked against its schema with ``jsonschema``;
the file records how many were valid, the medians, the ratios, the machine, the date and the
command.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path

from nanobench.timing import in_turn

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 30}}}
REVIEW = {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars", "summary"],
          "properties": {"sentiment": {"enum": ["positive", "negative", "mixed"]},
                         "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                         "summary": {"type": "string", "maxLength": 80}}}
PRODUCT = {"type": "object", "additionalProperties": False, "required": ["name", "price", "tags"],
           "properties": {"name": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0},
                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 4}}}
EVENT = {"type": "object", "additionalProperties": False, "required": ["title", "date", "attendees"],
         "properties": {"title": {"type": "string", "maxLength": 40},
                        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "attendees": {"type": "integer", "minimum": 1}}}
TASKS = [
    (PERSON, ["a famous scientist", "a fictional detective", "a chef in Paris", "an astronaut", "a poet",
              "a marathon runner"]),
    (REVIEW, ["a noisy hotel", "a great sushi bar", "a slow bicycle shop", "a museum", "a phone", "a movie"]),
    (PRODUCT, ["a laptop", "running shoes", "a coffee grinder", "a desk lamp", "a tent", "a keyboard"]),
    (EVENT, ["a team meeting", "a birthday party", "a concert", "a science fair", "a wedding", "a hackathon"]),
]
MAX_TOKENS = 160  # a constrained answer that has not ended by then is cut (and counted invalid)
SINGLE_STREAM_REQUESTS = 4


def workload(num_requests: int) -> list[tuple[str, dict]]:
    """``num_requests`` (question, schema) pairs, the four schemas in turn."""
    pairs = []
    for i in range(num_requests):
        schema, subjects = TASKS[i % len(TASKS)]
        subject = subjects[(i // len(TASKS)) % len(subjects)]
        pairs.append((f"Describe {subject} as a JSON object with the fields {', '.join(schema['required'])}.", schema))
    return pairs


def is_valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured(args) -> dict:
    from nanoengine import LLM, SamplingParams
    from nanoengine.sampling_params import StructuredOutputsParams
    from nanobench.benchmark import environment, load_average

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              seed=args.seed)
    pairs = workload(args.num_requests)
    ids = [llm.engine.tokenize_prompt(llm.apply_chat_template([{"role": "user", "content": q}]))[1]
           for q, _ in pairs]
    schemas = [schema for _, schema in pairs]
    constrained = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                  structured_outputs=StructuredOutputsParams(json=schema)) for schema in schemas]
    first = llm.generate(ids, constrained, use_tqdm=False)  # warm-up; fixes the free runs' lengths
    lengths = [len(out.outputs[0].token_ids) for out in first]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    shapes = {"batched": range(len(ids)), "single stream": range(min(SINGLE_STREAM_REQUESTS, len(ids)))}
    peer = _start_vllm(args, llm, ids, lengths) if args.vs_vllm else None
    rounds: dict[str, dict[str, list]] = {shape: {} for shape in shapes}
    validity: dict[str, list[bool]] = {}
    try:
        for turn in range(args.repeats):
            for shape, chosen in shapes.items():
                batches = [list(chosen)] if shape == "batched" else [[i] for i in chosen]
                runners = _systems(llm, peer, ids, constrained, free, schemas, lengths)
                for system in in_turn(runners, turn):
                    run = runners[system]
                    seconds = tokens = 0.0
                    for batch in batches:
                        took, produced, texts = run(batch)
                        seconds, tokens = seconds + took, tokens + produced
                        if texts is not None:
                            validity.setdefault(f"{system} {shape}", []).extend(
                                is_valid(t, schemas[i]) for t, i in zip(texts, batch))
                    rounds[shape].setdefault(system, []).append(tokens / seconds)
    finally:
        if peer is not None:
            peer.close()
    rows = []
    for shape, systems in rounds.items():
        tok_s = {system: statistics.median(values) for system, values in systems.items()}
        row = {"shape": shape, "num_requests": len(shapes[shape]), "tok_s": tok_s, "rounds_tok_s": systems,
               "engine_constrained_over_free": tok_s["engine_constrained"] / tok_s["engine_free"]}
        if peer is not None:
            row["vllm_constrained_over_free"] = tok_s["vllm_constrained"] / tok_s["vllm_free"]
            row["engine_over_vllm_constrained"] = tok_s["engine_constrained"] / tok_s["vllm_constrained"]
        rows.append(row)
        print(f"{shape:<14} engine constrained {tok_s['engine_constrained']:6.1f} tok/s, free "
              f"{tok_s['engine_free']:6.1f} ({row['engine_constrained_over_free']:.2f}x)"
              + (f"; vLLM constrained {tok_s['vllm_constrained']:6.1f}, free {tok_s['vllm_free']:6.1f}; engine/vLLM "
                 f"constrained {row['engine_over_vllm_constrained']:.2f}x" if peer is not None else ""))
    record = {
        "benchmark": "structured", "date": datetime.date.today().isoformat(),
        "command": getattr(args, "command_line", None), "environment": environment(), "load_average": load_average(),
        "repeats": args.repeats, "max_tokens": MAX_TOKENS, "output_tokens_per_request": lengths,
        "engine_settings": {"max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                            "max_num_seqs": llm.engine.config.max_num_seqs,
                            "structured_outputs_backend": llm.engine.structured_output.backend.name,
                            "dtype": str(llm.engine.config.torch_dtype).removeprefix("torch.")},
        "vllm_peer": None if peer is None else {"settings": peer.settings.described(), "version": peer.ready["vllm_version"]},
        "valid": {name: {"valid": sum(v), "of": len(v)} for name, v in validity.items()},
        "rows": rows,
    }
    out = Path(args.out or f"results/bench-structured-cpu-{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"valid answers: " + ", ".join(f"{k} {v['valid']}/{v['of']}" for k, v in record["valid"].items()))
    print(f"wrote {out}")
    return record


def _systems(llm, peer, ids, constrained, free, schemas, lengths) -> dict:
    """Each system's run of some requests: (seconds, output tokens, constrained texts or None)."""
    def engine(params, keep_texts: bool):
        def run(batch):
            llm.engine.reset_prefix_cache()  # a repeat must not find the previous run's prompts cached
            start = time.perf_counter()
            outs = llm.generate([ids[i] for i in batch], [params[i] for i in batch], use_tqdm=False)
            took = time.perf_counter() - start
            return took, sum(len(o.outputs[0].token_ids) for o in outs), \
                [o.outputs[0].text for o in outs] if keep_texts else None
        return run

    systems = {"engine_constrained": engine(constrained, True), "engine_free": engine(free, False)}
    if peer is not None:
        def vllm(structured: bool):
            def run(batch):
                answer = peer.run([ids[i] for i in batch], [MAX_TOKENS if structured else lengths[i] for i in batch],
                                  keep_tokens=len(batch) if structured else 0,
                                  structured_outputs=[{"json": schemas[i]} for i in batch] if structured else None)
                texts = [llm.engine.tokenizer.decode(t, skip_special_tokens=True) for t in answer["tokens"]]
                return answer["seconds"], answer["output_tokens"], texts if structured else None
            return run

        systems.update(vllm_constrained=vllm(True), vllm_free=vllm(False))
    return systems


def _start_vllm(args, llm, ids, lengths):
    from nanoengine.loader.weights import resolve_model_source
    from nanobench.vllm_peer import start_peer

    config = llm.engine.config
    backend = getattr(args, "vllm_structured_backend", None)
    peer = start_peer(args, resolve_model_source(args.model), ids, [MAX_TOKENS] * len(ids),
                      str(config.torch_dtype).removeprefix("torch."), config.max_num_seqs,
                      max_num_batched_tokens=config.max_num_batched_tokens,
                      structured_outputs_config={"backend": backend} if backend else None)
    peer.ready = peer.wait_ready()
    return peer
